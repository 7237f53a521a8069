"""parallelize(): reads the config, applies the techniques in a fixed order, explains each order.

The only place that knows the whole config; each technique's entry takes a mesh and plain keywords.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from engine.config import RunConfig
from engine.mesh import ParallelDims
from engine.model import GPT, loss_fn


@dataclass(slots=True)
class Parallelized:
    """What the train loop drives, whatever the layout."""

    modules: list[nn.Module]  # local modules holding this rank's parameters
    forward: nn.Module | None  # the module to call for pp=1 (DDP/FSDP-wrapped or plain)
    pipeline: Any = None  # engine.parallel.pipeline.Pipeline when pp > 1
    optimizer: torch.optim.Optimizer | None = None
    no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    after_backward: Callable[[], None] = lambda: None  # grad syncs not done by a wrapper
    hooks: dict[str, Any] = field(default_factory=dict)  # comm hook states (compression, co2, link)

    def parameters(self) -> Iterator[nn.Parameter]:
        seen: set[int] = set()
        for m in self.modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def train(self, mode: bool = True) -> None:
        for m in self.modules:
            m.train(mode)


def _data_parallel(model: nn.Module, cfg: RunConfig, mesh) -> nn.Module:
    from engine.parallel.data import apply_data_parallel

    d = cfg.ddp
    return apply_data_parallel(model, process_group=mesh["dp"].get_group(), dp_mesh=mesh["dp"],
                               bucket_cap_mb=d.bucket_cap_mb, gradient_as_bucket_view=d.gradient_as_bucket_view,
                               static_graph=d.static_graph, find_unused_parameters=d.find_unused_parameters,
                               broadcast_buffers=d.broadcast_buffers)


def _no_sync_of(module: nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
    from engine.parallel.data import no_sync_context

    return lambda: no_sync_context(module)


def _tp_and_checkpointing(model: nn.Module, cfg: RunConfig, mesh) -> None:
    p = cfg.parallel
    if p.tp > 1:
        from engine.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=p.sequence_parallel)
    if hasattr(model, "set_activation_checkpointing"):  # a user's model (model.entry) may not have it
        model.set_activation_checkpointing(cfg.train.activation_checkpointing)


def parallelize(model: nn.Module, cfg: RunConfig, dims: ParallelDims, mesh, *, device: torch.device,
                comm_hook_factory: Callable[[nn.Module, Any], dict[str, Any]] | None = None) -> Parallelized:
    """Apply TP, activation checkpointing, then PP and ZeRO/DP, in that order.

    `comm_hook_factory(ddp_module, dp_group)` registers the comm hook (compression, link emulation,
    recording) on a DDP module and returns its states; the train loop owns it.
    """
    p = cfg.parallel
    model.to(device)
    if p.pp > 1:
        return _pipeline(model, cfg, dims, mesh, device=device)
    # TP first: ZeRO/FSDP2 then shards the DTensors TP produced (torchtitan's order); checkpointing
    # before wrapping so the wrappers see the recomputing blocks
    _tp_and_checkpointing(model, cfg, mesh)
    if dims.dp == 1 or cfg.co2.enabled:
        # one replica, or CO2: each rank keeps a plain module and CO2 synchronises parameters itself
        return Parallelized(modules=[model], forward=model)
    if p.zero > 0:
        from engine.parallel.zero import apply_zero

        wrapped = apply_zero(model, mesh["dp"], stage=p.zero, reshard_after_forward=p.reshard_after_forward)
    else:
        wrapped = _data_parallel(model, cfg, mesh)
    hooks: dict[str, Any] = {}
    if isinstance(wrapped, DistributedDataParallel) and comm_hook_factory is not None:
        hooks = comm_hook_factory(wrapped, mesh["dp"].get_group())
    # ZeRO-2/3 reduce-scatter every micro-batch (as ZeRO defines them): skipping the sync would
    # keep every block's full unsharded gradients until the last micro-batch
    no_sync = _no_sync_of(wrapped) if p.zero < 2 else contextlib.nullcontext
    return Parallelized(modules=[wrapped], forward=wrapped, no_sync=no_sync, hooks=hooks)


def _pipeline(model: GPT, cfg: RunConfig, dims: ParallelDims, mesh, *, device: torch.device) -> Parallelized:
    """Stages first, then per chunk: TP, checkpointing, ZeRO-2/3 over dp (torchtitan applies its
    parallelize function per model part); plain dp averages gradients after the schedule."""
    from engine.parallel.pipeline import allreduce_grads, build_pipeline

    p = cfg.parallel

    def per_chunk(chunk: nn.Module) -> nn.Module:
        _tp_and_checkpointing(chunk, cfg, mesh)
        if dims.dp > 1 and p.zero > 0:
            from engine.parallel.zero import apply_zero

            return apply_zero(chunk, mesh["dp"], stage=p.zero, reshard_after_forward=p.reshard_after_forward)
        return chunk

    pipe = build_pipeline(model, mesh["pp"], schedule=p.schedule, virtual=p.virtual, layer_split=p.layer_split,
                          n_microbatches=cfg.grad_accum, loss_fn=loss_fn, device=device, parallelize=per_chunk)
    dp_group = mesh["dp"].get_group() if dims.dp > 1 and p.zero == 0 else None

    def after_backward() -> None:  # the schedule already summed the tied embedding/head gradients
        if dp_group is not None:
            allreduce_grads(pipe.modules, dp_group)

    return Parallelized(modules=list(pipe.modules), forward=None, pipeline=pipe, after_backward=after_backward)
