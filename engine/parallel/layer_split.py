"""Holmes' self-adapting pipeline partition: layers per stage in proportion to each stage's speed.

Holmes (Li et al. 2023) gives each pipeline stage a share of the layers proportional to the speed
of the group of GPUs that runs it, so a stage on slow NICs (whose data-parallel all-reduce takes
longer) gets fewer layers. Ours: a stage's speed is measured at start as 1 / (seconds one layer
costs that stage per step): micro-batches x one block's forward + backward on this rank, plus the
all-reduce of one block's gradients over the stage's dp group (on the emulated links); every rank
gathers all measurements and derives the same split.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn


def proportional_split(layers: int, speeds: Sequence[float]) -> list[int]:
    """Layers per stage proportional to `speeds`, each >= 1, summing to `layers` (largest remainder)."""
    n = len(speeds)
    if n < 1 or layers < n or min(speeds) <= 0:
        raise ValueError(f"need layers={layers} >= stages={n} >= 1 and speeds > 0; got speeds={list(speeds)}")
    total = float(sum(speeds))
    spare = layers - n  # one layer per stage first, the rest by speed
    quotas = [spare * s / total for s in speeds]
    split = [1 + int(q) for q in quotas]
    by_remainder = sorted(range(n), key=lambda i: (-(quotas[i] - int(quotas[i])), i))
    for i in by_remainder[: layers - sum(split)]:
        split[i] += 1
    return split


def layer_seconds(block: nn.Module, *, micro: int, seq: int, d_model: int, n_microbatches: int,
                  dp_group: dist.ProcessGroup | None, repeats: int = 3) -> float:
    """Seconds one layer costs this rank per step: n_microbatches x (forward + backward of `block`
    on a micro-batch) + one all-reduce of its gradients over `dp_group` (None: no dp)."""
    from engine.device import comm_device

    device = next(block.parameters()).device
    # a private generator: the probe leaves the run's random stream (data, dropout) untouched
    x = torch.randn(micro, seq, d_model, generator=torch.Generator().manual_seed(0)).to(device).requires_grad_()
    compute = []
    for _ in range(repeats):
        start = time.perf_counter()
        block(x).sum().backward()
        compute.append(time.perf_counter() - start)
    block.zero_grad(set_to_none=True)
    comm = 0.0
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        flat = torch.zeros(sum(p.numel() for p in block.parameters()), device=comm_device(dp_group))
        times = []
        for _ in range(2):
            start = time.perf_counter()
            dist.all_reduce(flat, group=dp_group)  # pays the emulated links of this dp group
            times.append(time.perf_counter() - start)
        comm = min(times)
    return n_microbatches * statistics.median(compute) + comm


def auto_layer_split(layers: int, *, stage: int, pp: int, seconds: float, group: dist.ProcessGroup) -> list[int]:
    """Every rank's (stage, seconds per layer) gathered over `group`; a stage runs at its slowest rank.
    Returns the same split on every rank."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (stage, seconds), group=group)
    return split_from_measurements(layers, pp, gathered)


def split_from_measurements(layers: int, pp: int, measured: Sequence[tuple[int, float]]) -> list[int]:
    """Layers per stage from every rank's (stage, seconds per layer): a stage is as fast as its
    slowest rank; its share of the layers is proportional to 1 / its seconds."""
    per_stage = [max(s for st, s in measured if st == i) for i in range(pp)]
    return proportional_split(layers, [1.0 / max(s, 1e-9) for s in per_stage])
