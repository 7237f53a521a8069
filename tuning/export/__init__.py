"""Exports of a tuned config: the workbench's own YAML and torchrun line, and Megatron-LM, DeepSpeed, torchtitan and accelerate configs that build the same model (plus the accelerate training script).

May import tuning.sim (pricing a plan), engine/ (config, shapes) and profilers/."""
