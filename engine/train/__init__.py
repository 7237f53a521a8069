"""One rank's training: compose the model, layout and communication, the Trainer's step and loop, the loss, memory accounting, live knobs, checkpoints, and the dry run on the fake backend.

May import engine.model.gpt, engine.data.corpus, engine.parallel, engine.comm, engine.config.schema and profilers/."""
