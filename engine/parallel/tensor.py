"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) with DTensor `parallelize_module`.

Attention: q/k/v column-parallel (each rank keeps whole heads; `Attention` infers its local
head count from the width), o row-parallel. MLP: w1 column-parallel, w2 row-parallel. One
all-reduce after each row-parallel layer in forward and one per column-parallel input in
backward (formulas.md). With sequence parallelism (Korthikanti et al. 2022) the LayerNorms run on
a 1/tp slice of the sequence and each all-reduce becomes an all-gather + reduce-scatter pair.
The embeddings and the tied head stay replicated (plain tensors), so tying survives.
Works on gloo/CPU as on NCCL (platform.md), so there is no hand-written fallback.
"""
from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from engine.model.mlp import MLP
from engine.model.gpt import GPT


def _block_plan(sequence_parallel: bool) -> dict[str, object]:
    """The per-block plan; the sequence-parallel variant follows torchtitan's llama plan."""
    if not sequence_parallel:
        return {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(), "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel()}
    # the residual stream between blocks is a local (b, s/tp, h) tensor: the norms run on it,
    # attention and MLP all-gather it to the full sequence and reduce-scatter back to Shard(1)
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "ln1": SequenceParallel(), "attn": gather,
        "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ln2": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def _shard_sequence_edges(model: GPT, tp_mesh: DeviceMesh) -> None:
    """Split the replicated embedding output by sequence before the first block; gather before the head.

    On a pipeline stage without the embedding (or the head) the stage input (or output) is
    already the local sequence slice, so that side is left alone.
    """
    first = next(iter(model.layers))
    if model.tok_emb is not None:
        parallelize_module(model.layers[first], tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True))
    if model.ln_f is not None:
        parallelize_module(model.ln_f, tp_mesh, SequenceParallel())
    if model.head is not None:
        parallelize_module(model.head, tp_mesh, PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True))
    elif model.ln_f is not None:
        raise ValueError("sequence_parallel: a stage with ln_f but no head is not a supported split")


def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False) -> GPT:
    """Shard every block of `model` over the 1-D `tp_mesh` in place and return it.

    Block weights become DTensors sharded over tp (Shard(0) for column-parallel, Shard(1) for
    row-parallel); embeddings, the tied head and (without sequence parallelism) the norms stay
    plain replicated tensors whose gradients come out identical on every tp rank, because the
    backward of each column-parallel input all-reduces its partial gradient. Every tp rank must
    see the same tokens. With `sequence_parallel`, the norms' weights become Replicate DTensors
    and the sequence length must divide by the tp degree.
    """
    tp = tp_mesh.size()
    heads = model.cfg.heads
    d_model = model.cfg.d_model
    if heads % tp or d_model % tp:
        fits = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0 and d_model % d == 0)
        raise ValueError(f"tp={tp} must divide model.heads={heads} and model.d_model={d_model}; try {fits}")
    if sequence_parallel and model.cfg.seq_len % tp:
        raise ValueError(f"sequence_parallel needs tp={tp} to divide model.seq_len={model.cfg.seq_len}")
    own_plan = getattr(model, "tp_block_plan", None)  # a Hugging Face model brings its own (engine/model/hf.py)
    for block in model.layers.values():
        if own_plan is not None:
            parallelize_module(block, tp_mesh, own_plan(sequence_parallel))
            continue
        plan = _block_plan(sequence_parallel)
        if not isinstance(block.mlp, MLP):  # an MoE block: experts stay replicated over tp (engine/parallel/expert.py)
            plan = {k: v for k, v in plan.items() if not k.startswith("mlp")}
        parallelize_module(block, tp_mesh, plan)
    if sequence_parallel:
        if not model.layers:
            raise ValueError("sequence_parallel needs at least one block on this pipeline stage")
        _shard_sequence_edges(model, tp_mesh)
    return model

