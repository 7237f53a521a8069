"""Data parallelism over the dp group, the gradient-accumulation context, and global-norm clipping.

What works in torch 2.13 on gloo (measured for this file, 4 ranks, dp=2 x tp=2):
- `DistributedDataParallel` refuses DTensor (tensor-parallel) parameters: its initial
  broadcast fails with "aten.cat.default got mixed torch.Tensor and DTensor".
- `torch.distributed.tensor.parallel.ddp._pre_dp_module_transform` + DDP trains with parity,
  but after the first forward the TP weights are no longer registered on the module
  (`parameters()` drops from 24 to 12 tensors, `state_dict()` loses them), which breaks
  clipping, checkpoints and memory accounting; not used.
- `replicate` of `torch.distributed._composable.replicate_with_fsdp` (FSDP2 machinery,
  parameters replicated over the dp mesh) trains with parity and keeps DTensor parameters:
  used for dp with tp > 1. DDP's bucket and hook knobs do not apply to it (a warning says so),
  so gradient-compression hooks need tp=1.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import math
import sys
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from engine.device import comm_device
from engine.torch_compat import ddp_ignore_params, replicate_with_fsdp

logger = logging.getLogger(__name__)


def is_dtensor(t: object) -> bool:
    """isinstance(t, DTensor) without importing DTensor (about 1 s of a rank's start): when the
    module was never imported, nothing can be a DTensor."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def _has_dtensor_params(model: nn.Module) -> bool:
    return any(is_dtensor(p) for p in model.parameters())


def apply_data_parallel(model: nn.Module, *, process_group: dist.ProcessGroup | None = None,
                        dp_mesh: DeviceMesh | None = None, bucket_cap_mb: float = 25.0,
                        gradient_as_bucket_view: bool = True, static_graph: bool = False,
                        find_unused_parameters: bool = False, broadcast_buffers: bool = False,
                        ignored_params: set[nn.Parameter] | None = None) -> nn.Module:
    """Replicate `model` over the dp group; gradients are averaged over it in backward.

    Plain parameters: `DistributedDataParallel` over `process_group` (or `dp_mesh`'s group)
    with the given bucket/overlap knobs; returns the DDP wrapper. Tensor-parallel (DTensor)
    parameters: FSDP2's `replicate` over `dp_mesh` (required then), applied in place; returns
    `model`. Initial weights must already be equal on every dp rank (same seed).
    `ignored_params` are neither broadcast nor averaged (expert-parallel experts reduce themselves).
    """
    if process_group is None and dp_mesh is not None:
        process_group = dp_mesh.get_group()
    if ignored_params and not _has_dtensor_params(model):
        ids = {id(p) for p in ignored_params}
        ddp_ignore_params(model, [name for name, p in model.named_parameters() if id(p) in ids])
    if not _has_dtensor_params(model):
        # torch 2.13 renamed broadcast_buffers (warns) to forward_sync_buffers; older torch lacks it
        renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
        buffers = {"forward_sync_buffers" if renamed else "broadcast_buffers": broadcast_buffers}
        return DistributedDataParallel(
            model, process_group=process_group, bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
            find_unused_parameters=find_unused_parameters, **buffers)
    if dp_mesh is None:
        raise ValueError("apply_data_parallel: a tensor-parallel model needs dp_mesh (the 'dp' sub-mesh), "
                         "because DDP refuses DTensor parameters")
    replicate = replicate_with_fsdp()

    logger.warning("data parallel over tensor-parallel parameters uses FSDP2 replicate: bucket_cap_mb, "
                   "gradient_as_bucket_view, static_graph, find_unused_parameters, broadcast_buffers "
                   "and DDP comm hooks do not apply")
    replicate(model, mesh=dp_mesh, ignored_params=set(ignored_params or ()))
    return model


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def allreduce_each(params: Iterable[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Average each parameter's gradient over `group` in place, one all-reduce per parameter (no
    flat copy: a dry run's DDP, engine/parallel/parallelize.py)."""
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=group)


def no_sync_context(model: nn.Module) -> contextlib.AbstractContextManager:
    """The context for a non-final micro-batch: skips the gradient all-reduce / reduce-scatter.

    DDP: `model.no_sync()`. FSDP2 (`fully_shard`, `replicate`): `set_requires_gradient_sync(False)`
    inside, restored on exit; FSDP2 then keeps unsharded gradients until the synced micro-batch.
    Anything else (one process, tensor parallel only, pipeline stages): a null context.
    """
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


def _group_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of `grads`, all of one kind and one mesh, reduced over that mesh."""
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    # a DTensor norm is Partial over sharded axes (and over Partial grads): full_tensor() reduces it
    return norm.full_tensor() if is_dtensor(norm) else norm


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, *,
                   pp_group: dist.ProcessGroup | None = None,
                   not_in_norm: Iterable[torch.Tensor] = (),
                   sharded: Iterable[torch.Tensor] = (), shard_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip gradients in place to a global 2-norm of `max_norm`; return the norm before clipping
    (a 0-d host tensor: the norm is read from the device once, for the coefficient).

    Works for plain tensors (replicated: counted once, as every rank holds the same gradient),
    DTensors of tensor parallelism, FSDP2 shards and 2-D FSDP+TP, mixed in one list:
    `torch.nn.utils.clip_grad_norm_` refuses mixed plain and DTensor gradients, so the squared
    norms are summed per mesh (as torchtitan's `clip_grad_norm_` does for one mesh). Pipeline
    stages hold disjoint parameters: pass `pp_group` to sum the squares over the stages.
    `max_norm <= 0` only measures. `not_in_norm` are clipped but not counted (the last pipeline
    stage's copy of the tied head, whose gradient equals the first stage's embedding gradient).
    `sharded` plain parameters differ across `shard_group` (expert-parallel experts): their
    squares are summed over it.
    """
    groups: dict[object, list[torch.Tensor]] = {}
    sharded = [p for p in sharded if p.grad is not None]
    skip = {id(p) for p in not_in_norm} | {id(p) for p in sharded}
    seen: set[int] = set(skip)
    for p in params:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))  # tied weights appear once
        key = p.grad.device_mesh if is_dtensor(p.grad) else None
        groups.setdefault(key, []).append(p)
    squares = [_group_norm([p.grad for p in ps]).float() ** 2 for ps in groups.values()]
    if squares:
        total_sq = torch.stack(squares).sum()
    else:  # no gradient here (a stage without parameters): a zero on the device pp_group serves
        total_sq = torch.zeros((), device=comm_device(pp_group) if pp_group is not None else "cpu")
    if shard_group is not None:
        shard_sq = _group_norm([p.grad for p in sharded]).float() ** 2 if sharded \
            else torch.zeros((), device=comm_device(shard_group))
        dist.all_reduce(shard_sq, group=shard_group)
        total_sq = total_sq + shard_sq.to(total_sq.device)
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    # the step's one host read of the norm: the coefficient is a Python float for every gradient kind
    norm = total_sq.sqrt().item()
    coef = max_norm / (norm + 1e-6)  # the 1e-6 of torch.nn.utils.clip_grad_norm_
    if 0 < max_norm and coef < 1.0 and math.isfinite(coef):
        for ps in groups.values():
            for p in ps:
                p.grad.mul_(coef)  # a Python float: DTensor and plain gradients alike
        for p in [*not_in_norm, *sharded]:
            if p.grad is not None:
                p.grad.mul_(coef)
    return torch.tensor(norm)  # a host tensor of the value read above: reading it again costs no sync
