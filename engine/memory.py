"""Per-rank memory: an analytic estimate from the config, and the model state a rank really holds.

Training keeps fp32 parameters, fp32 gradients and two fp32 AdamW states (also under bf16
autocast, which only casts activations), so the model state is 16 bytes per parameter before
sharding: the mixed-precision ZeRO formulas of Rajbhandari et al. 2020 (2+2+12 Psi) become
4 Psi params + 4 Psi grads + 8 Psi Adam here.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.config import RunConfig
from engine.errors import ConfigError

FP32 = 4  # bytes


def _stage_layers(cfg: RunConfig) -> list[int]:
    pp, layers = cfg.parallel.pp, cfg.model.layers
    if cfg.parallel.layer_split:
        return list(cfg.parallel.layer_split)
    return [layers // pp + (1 if i < layers % pp else 0) for i in range(pp)]


def _stage_params(cfg: RunConfig, stage: int) -> float:
    """Parameters one rank of pipeline `stage` holds before ZeRO sharding (TP divides the block matmuls)."""
    m, tp = cfg.model, cfg.parallel.tp
    h, r = m.d_model, m.mlp_ratio
    per_layer = (4 + 2 * r) * h * h / tp + 4 * h  # q,k,v,o + mlp split over tp; two LayerNorms replicated
    n = _stage_layers(cfg)[stage] * per_layer
    last = cfg.parallel.pp - 1
    if stage == 0:
        n += m.vocab * h + m.seq_len * h  # token + position embeddings
    if stage == last:
        n += 2 * h + (m.vocab * h if last > 0 else 0)  # ln_f; the tied head is a second copy when pp > 1
    return n


def _layer_activation_elems(cfg: RunConfig) -> float:
    """Saved activation elements of one block for one micro-batch (fp32, no recomputation).

    Korthikanti et al. 2022 count 34 s b h + 5 a s^2 b bytes per layer at 16 bits. Here, with
    `scaled_dot_product_attention`'s flash kernel (dropout 0; no s^2 scores kept), the tensors
    autograd saves are: ln1 in, ln1 out, q, k, v, attention out, wo in, ln2 in, ln2 out,
    w1 out (r h), gelu out (r h) = (9 + 2 r) s b h elements, plus the log-sum-exp (a s b).
    Under TP the q/k/v/o and MLP tensors split over t; the norm outputs stay whole (the
    column-parallel layers save them replicated); sequence parallelism splits the norm inputs.
    Dropout > 0 takes the math kernel: + 2 a s^2 b scores/probs (fp32) + masks.
    """
    m, p = cfg.model, cfg.parallel
    s, b, h, a, r, t = m.seq_len, cfg.batch.micro, m.d_model, m.heads, m.mlp_ratio, p.tp
    norm_inputs = 2.0 / t if p.sequence_parallel else 2.0
    elems = s * b * h * (norm_inputs + 2.0 + (5 + 2 * r) / t) + a * s * b / t
    if m.dropout > 0:
        elems += (2 * a * s * s * b + (a * s * s * b + 2 * s * b * h) / FP32) / t
    return elems


def _activation_bytes(cfg: RunConfig, stage: int) -> float:
    m, p = cfg.model, cfg.parallel
    s, b, h = m.seq_len, cfg.batch.micro, m.d_model
    if cfg.train.activation_checkpointing:
        # full recomputation keeps each block input (Korthikanti: 2 s b h bytes at 16 bits)
        # plus one block's activations while it is recomputed in backward
        block_in = s * b * h / (p.tp if p.sequence_parallel else 1)
        per_mb = _stage_layers(cfg)[stage] * block_in + _layer_activation_elems(cfg)
    else:
        per_mb = _stage_layers(cfg)[stage] * _layer_activation_elems(cfg)
    if stage == p.pp - 1:
        per_mb += 2 * s * b * h + s * b * m.vocab  # ln_f in, head in, log-softmax out for the loss
    # micro-batches in flight: GPipe keeps all of them, 1F1B at most p - stage (Narayanan et al. 2021)
    # (without pp, gradient accumulation frees each micro-batch's activations in its backward)
    num_micro = max(1, cfg.batch.global_ // (p.dp * cfg.batch.micro))
    if p.pp == 1:
        in_flight = 1
    else:
        in_flight = num_micro if p.schedule == "gpipe" else min(num_micro, p.pp - stage)
    return FP32 * per_mb * in_flight


def estimate_memory(cfg: RunConfig, *, pp_rank: int | None = None) -> dict[str, float]:
    """Analytic bytes one rank holds: {params, grads, optimizer, activations}; the values sum to the total.

    ZeRO over dp = N (Rajbhandari et al. 2020, fp32 Adam): stage 0: 4+4+8 Psi; stage 1:
    optimizer / N; stage 2: + grads / N; stage 3: + params / N. Stage 2 here is FSDP2 without
    reshard-after-forward, whose parameters are sharded at rest too (params / N between steps;
    the full 4 Psi are held only from forward to backward, which this does not count). Psi is
    the parameter count of the rank's pipeline stage after tensor-parallel splitting.
    `pp_rank=None` reports the pipeline stage with the largest total.
    """
    stages = range(cfg.parallel.pp) if pp_rank is None else [pp_rank]
    return max((_estimate_stage(cfg, s) for s in stages), key=lambda d: sum(d.values()))


def _estimate_stage(cfg: RunConfig, stage: int) -> dict[str, float]:
    psi, n, zero = _stage_params(cfg, stage), cfg.parallel.dp, cfg.parallel.zero
    return {"params": FP32 * psi / (n if zero >= 2 else 1),
            "grads": FP32 * psi / (n if zero >= 2 else 1),
            "optimizer": 2 * FP32 * psi / (n if zero >= 1 else 1),
            "activations": _activation_bytes(cfg, stage)}


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _optimizer_state(optimizer: torch.optim.Optimizer) -> Any:
    # ZeroRedundancyOptimizer and DTensorZeroOptimizer keep this rank's shard in `.optim`
    return getattr(optimizer, "optim", optimizer).state


def measure_model_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, float]:
    """Bytes of {params, grads, optimizer} this rank stores right now (same keys as `estimate_memory`).

    Local shards only: DTensor (TP, FSDP2) parameters and gradients count `to_local()`; tied
    weights count once; ZeroRedundancyOptimizer counts its local partition. Call it after
    backward and before `zero_grad` to include the gradients. DDP with
    `gradient_as_bucket_view=False` holds a second copy of the gradients in its buckets,
    which is not counted.
    """
    seen: set[int] = set()
    params = grads = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        params += _local_bytes(p)
        if p.grad is not None:
            grads += _local_bytes(p.grad)
    opt = 0
    if optimizer is not None:
        for state in _optimizer_state(optimizer).values():
            opt += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return {"params": float(params), "grads": float(grads), "optimizer": float(opt)}


GIB = 2**30


def memory_error(cfg: RunConfig, *, limit_bytes: float, ranks_sharing: int, limit_name: str) -> ConfigError | None:
    """A ConfigError when the estimate exceeds the limit (None when it fits); pure and fast.

    `ranks_sharing` ranks draw on one `limit_bytes` (the ranks of one node on host RAM; 1 on a GPU
    each). The field named is the knob behind the larger term: model size or batch.micro.
    """
    est = estimate_memory(cfg)
    per_rank = sum(est.values())
    need = per_rank * ranks_sharing
    if need <= limit_bytes:
        return None
    state = est["params"] + est["grads"] + est["optimizer"]
    field, value = ("model.d_model", cfg.model.d_model) if state >= est["activations"] else ("batch.micro", cfg.batch.micro)
    split = f"{state / GIB:.3g} GiB model state + {est['activations'] / GIB:.3g} GiB activations"
    per = f" per rank x {ranks_sharing} ranks = {need / GIB:.3g} GiB" if ranks_sharing > 1 else " per rank"
    return ConfigError(field, value, f"the run needs an estimated {per_rank / GIB:.3g} GiB{per} ({split}), "
                       f"more than the {limit_bytes / GIB:.3g} GiB {limit_name}; use a smaller model or "
                       "batch.micro, or more parallel.tp/pp, or parallel.zero")


def machine_limit(cfg: RunConfig, nnodes: int = 1) -> tuple[float, int, str]:
    """(bytes, ranks sharing them, what they are) for this machine: one GPU's memory per rank when
    the run will use CUDA, else the host's available RAM shared by this node's ranks."""
    from engine.device import pick_backend

    if pick_backend(cfg.backend) == "nccl" and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        return float(total), 1, f"of GPU memory on {torch.cuda.get_device_name(0)}"
    import psutil

    return float(psutil.virtual_memory().available), max(1, cfg.world_size // max(nnodes, 1)), \
        "of RAM available on this machine (psutil)"


def check_fits(cfg: RunConfig, nnodes: int = 1) -> None:
    """Raise ConfigError before launch when the run cannot fit this machine's memory (the built-in
    GPT only: a model.entry model's size is unknown until it is built)."""
    if cfg.model.entry is not None:
        return
    limit, ranks, name = machine_limit(cfg, nnodes)
    error = memory_error(cfg, limit_bytes=limit, ranks_sharing=ranks, limit_name=name)
    if error is not None:
        raise error
