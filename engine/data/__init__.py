"""Training data: the built-in corpus, token files, Megatron datasets and tokenized local files, document lengths, and each rank's batches (packing, context-parallel sharding, FlexSP documents).

May import engine.config.schema and profilers/."""
