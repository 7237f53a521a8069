"""The loss of a step: each micro-batch's (a mean, or packed data's share of the global token sum),
the MoE load-balancing term, and the global-batch loss reduced over the ranks without waiting.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from engine.model.gpt import loss_fn


def micro_loss(logits: torch.Tensor, targets: torch.Tensor, *, accum: int,
               loss_norm: float | None = None) -> torch.Tensor:
    """One micro-batch's part of the local loss: its mean over `accum` micro-batches, or with packed
    data (`loss_norm`, engine/data/batches.py) its token-loss sum over this rank's share of the real tokens."""
    if loss_norm is None:
        return loss_fn(logits, targets) / accum
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                             reduction="sum") / loss_norm


def moe_aux_loss(modules: Iterable[torch.nn.Module]) -> torch.Tensor | float:
    """The MoE load-balancing losses the modules' forwards left (taken: the next forward starts anew)."""
    from engine.model.moe import take_aux_loss

    total = 0.0
    for module in modules:
        aux = take_aux_loss(module)
        if aux is not None:
            total = total + aux
    return total


def global_loss(local: torch.Tensor, *, mesh, dp: int, cp: int, pp: int,
                last_stage: bool = True) -> Callable[[], float]:
    """Launch the global-batch loss reduction (mean over dp x cp of the last pipeline stage's loss)
    without waiting; the returned function waits and gives the Python float.

    `local` is a float64 tensor of shape (1,) on the device of the `mesh`'s groups; `last_stage`:
    this pp rank holds the last stage (V schedules put it on pp rank 0).
    """
    if not dist.is_initialized() or dp * cp * pp == 1:
        return lambda: local.item()
    work = None
    if pp > 1:
        local = local if last_stage else torch.zeros_like(local)
        work = dist.all_reduce(local, group=mesh["pp"].get_group(), async_op=True)
    replicas = dp * cp  # cp ranks hold equal chunks: their mean is the batch's
    if replicas > 1:
        if work is not None:
            work.wait()  # on NCCL a stream wait, not a host one
        axis = "dp_cp" if cp > 1 else "dp"
        work = dist.all_reduce(local, group=mesh[axis].get_group(), async_op=True)

    def result() -> float:
        if work is not None:
            work.wait()
        return local.item() / replicas if replicas > 1 else local.item()

    return result
