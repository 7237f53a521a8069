"""Launching ranks: the local torchrun launcher, Slurm jobs, the rank entry point (worker), preemption, the run's record in the store, fault injection for the reliability tests.

May import engine.config.schema, engine.train.trainer, engine.data.corpus, engine.model.gpt and profilers/."""
