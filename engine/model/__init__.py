"""The models a config names: the GPT (and its MoE blocks), Hugging Face causal LMs, their shapes (parameters and FLOPs per token, defined once in shapes.py), meta-device construction and weights loading.

May import engine.config.schema, engine.parallel (expert layers) and profilers/."""
