"""parallelize(): reads the config, applies the techniques in a fixed order, explains each order.

The only place that knows the whole config; each technique's entry takes a mesh and plain keywords.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from engine.config.schema import RunConfig
from engine.mesh import ParallelDims
from engine.model.meta_init import materialize, record_of
from engine.model.gpt import GPT, loss_fn
from engine.parallel.data import is_dtensor


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
    experts: Any = None  # engine.parallel.expert.ExpertParallel when parallel.ep > 1
    layer_split: list[int] | None = None  # pp > 1: blocks per stage chunk it runs (None: even)

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

    def clip_grad_norm(self, max_norm: float, *, pp_group=None) -> float:
        """Clip the gradients to a global 2-norm of `max_norm` (0: only measure); the norm before
        (engine/parallel/data.py): squares summed over the stages (`pp_group`), without the last
        stage's tied head (a copy of the first stage's tok_emb, on one rank under V schedules), and
        over ep for expert-parallel experts (they differ per ep rank)."""
        from engine.parallel.data import clip_grad_norm

        pipe, ep = self.pipeline, self.experts
        chunks = [getattr(m, "module", m) for m in pipe.modules] if pipe is not None else []
        tied_copy = [m.head.weight for m in chunks if m.head is not None and m.tok_emb is None
                     and getattr(m, "tied", True)]
        return float(clip_grad_norm(list(self.parameters()), max_norm, pp_group=pp_group, not_in_norm=tied_copy,
                                    sharded=ep.expert_params if ep else (), shard_group=ep.ep_group if ep else None))


def grad_axis(cp: int) -> str:
    """The mesh axis gradients are averaged and ZeRO shards over: dp, or dp x cp flattened under
    context parallelism (cp > 1)."""
    return "dp_cp" if cp > 1 else "dp"


def _data_parallel(model: nn.Module, cfg: RunConfig, mesh, axis: str = "dp", ignored_params=None) -> nn.Module:
    from engine.parallel.data import apply_data_parallel

    d = cfg.ddp
    return apply_data_parallel(model, process_group=mesh[axis].get_group(), dp_mesh=mesh[axis],
                               bucket_cap_mb=d.bucket_cap_mb, gradient_as_bucket_view=d.gradient_as_bucket_view,
                               static_graph=d.static_graph, find_unused_parameters=d.find_unused_parameters,
                               broadcast_buffers=d.broadcast_buffers, ignored_params=ignored_params)


def _expert_parallel(model: nn.Module, cfg: RunConfig, mesh):
    """Shard the experts over ep ranks carved out of dp (None when parallel.ep == 1)."""
    p, c = cfg.parallel, cfg.comm
    import datetime

    if cfg.model.hf is not None and p.ep > 1:  # transformers' fused experts (engine/parallel/expert_fused.py)
        from engine.parallel.expert_fused import apply_fused_expert_parallel

        return apply_fused_expert_parallel(model, mesh, ep=p.ep, timeout=datetime.timedelta(seconds=cfg.train.timeout_s))
    if cfg.model.experts == 0 or p.ep == 1:
        return None

    from engine.parallel.expert import apply_expert_parallel

    link = None
    if cfg.link.gbps > 0:
        from engine.comm.link import LinkEmulator

        link = LinkEmulator(gbps=cfg.link.gbps, latency_us=cfg.link.latency_us)
    return apply_expert_parallel(model, mesh, ep=p.ep,
                                 hierarchical=c.moe_hierarchical, ranks_per_node=cfg.link.ranks_per_node,
                                 node_groups=[g.ranks for g in cfg.link.groups] if cfg.link.groups else None,
                                 link=link, compression=c.moe_compression, lsh_buckets=c.lsh_buckets,
                                 lsh_hashes=c.lsh_hashes, seed=cfg.train.seed,
                                 timeout=datetime.timedelta(seconds=cfg.train.timeout_s))


def _no_sync_of(module: nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
    from engine.parallel.data import no_sync_context

    return lambda: no_sync_context(module)


def _keep_gathered_of(module: nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
    from engine.parallel.zero import keep_gathered

    return lambda: keep_gathered(module)


def _tp_and_checkpointing(model: nn.Module, cfg: RunConfig, mesh, device_type: str = "cpu") -> None:
    p = cfg.parallel
    if p.tp > 1:
        from engine.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=p.sequence_parallel)
    if p.cp > 1:  # after TP: Ulysses splits each tp rank's local heads again over cp
        from engine.parallel.context import apply_context_parallel

        apply_context_parallel(model, mesh["cp"], impl=p.cp_impl, device_type=device_type)
    if hasattr(model, "set_activation_checkpointing"):  # a user's model (model.entry) may not have it
        model.set_activation_checkpointing(cfg.train.activation_checkpointing)


def fsdp_mp_policy(cfg: RunConfig) -> Any:
    """FSDP2's MixedPrecisionPolicy under precision=bf16 (ZeRO-2/3; None otherwise): all-gather bf16 copies of
    the fp32 shards, reduce gradients in fp32. Autocast over gathered fp32 weights would keep a bf16 copy of
    each until the forward ends (0.41 GiB per Llama-8B layer, docs/dryrun.md); bf16 weights it leaves alone."""
    if cfg.precision != "bf16" or cfg.parallel.zero < 2:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def parallelize(model: nn.Module, cfg: RunConfig, dims: ParallelDims, mesh, *, device: torch.device,
                comm_hook_factory: Callable[[nn.Module, Any], Any] | None = None,
                saved_split: list[int] | None = None, init_values: bool = True) -> Parallelized:
    """Apply TP, activation checkpointing, then PP and ZeRO/DP, in that order.

    `comm_hook_factory(ddp_module, dp_group)` registers the comm hook (compression, link emulation,
    recording) on a DDP module (engine/train/compose.py keeps what it returns). `saved_split`: the
    layers per stage a resumed layer_split=auto run's checkpoint used (timings vary: it is kept).
    A model built on meta (engine/model/meta_init.py) gets the layout on meta; then this rank's parts
    alone are materialised on `device` (before a wrapper that needs values: DDP broadcasts them),
    with the full seeded build's values; `init_values=False` leaves them uninitialised (dry runs).
    """
    p = cfg.parallel

    def real(*modules: nn.Module) -> None:
        materialize(list(modules), device=device, values=init_values)

    if record_of([model]) is None:
        model.to(device)
    if p.pp > 1:
        return _pipeline(model, cfg, dims, mesh, device=device, saved_split=saved_split, real=real)
    if p.adaptive_sp and dims.world_size > 1:
        # FlexSP: every rank holds the whole model; each step's groups are set by the trainer
        from engine.parallel.adaptive_sp import sum_gradients

        real(model)
        model.set_activation_checkpointing(cfg.train.activation_checkpointing)
        return Parallelized(modules=[model], forward=model, after_backward=lambda: sum_gradients(model))
    # TP first: ZeRO/FSDP2 then shards the DTensors TP produced (torchtitan's order); checkpointing
    # before wrapping so the wrappers see the recomputing blocks
    _tp_and_checkpointing(model, cfg, mesh, device.type)
    experts = _expert_parallel(model, cfg, mesh)
    if dims.dp * dims.cp == 1 or cfg.co2.enabled:
        # one replica, or CO2: each rank keeps a plain module and CO2 synchronises parameters itself
        real(model)
        return Parallelized(modules=[model], forward=model)
    if p.zero > 1:  # ZeRO-1 is DDP (+ a sharded optimizer): _data_parallel keeps the ddp.* knobs
        from engine.parallel.zero import apply_zero

        # over dp x cp under context parallelism, as torchtitan's dp_shard_cp: cp ranks hold the same
        # weights and their gradients are averaged with dp's, so they shard them too
        wrapped = apply_zero(model, mesh[grad_axis(dims.cp)], stage=p.zero,
                             reshard_after_forward=p.reshard_after_forward, mp_policy=fsdp_mp_policy(cfg))
        real(wrapped)  # after sharding: each rank allocates and fills its shards only
    else:
        real(model)
        ignored = set(experts.expert_params) if experts else None
        if not init_values and not any(is_dtensor(t) for t in model.parameters()):
            return _dry_data_parallel(model, mesh[grad_axis(dims.cp)].get_group(), ignored, experts)
        wrapped = _data_parallel(model, cfg, mesh, grad_axis(dims.cp), ignored)
    hooks: dict[str, Any] = {}
    if isinstance(wrapped, DistributedDataParallel) and comm_hook_factory is not None:
        hooks = comm_hook_factory(wrapped, mesh[grad_axis(dims.cp)].get_group())
    # ZeRO-2/3 reduce-scatter every micro-batch (as ZeRO defines them): skipping the sync would
    # keep every block's full unsharded gradients until the last micro-batch; ZeRO-2 keeps the
    # parameters gathered between micro-batches (one all-gather per step), ZeRO-3 re-gathers them
    no_sync = _no_sync_of(wrapped) if p.zero < 2 else _keep_gathered_of(wrapped) if p.zero == 2 \
        else contextlib.nullcontext
    if experts is not None:  # expert gradients: summed over their replicas, not averaged by the dp wrapper
        return Parallelized(modules=[wrapped], forward=wrapped, no_sync=no_sync, hooks=hooks, experts=experts,
                            after_backward=experts.reduce_gradients)
    return Parallelized(modules=[wrapped], forward=wrapped, no_sync=no_sync, hooks=hooks)


def _dry_data_parallel(model: nn.Module, group, ignored: set[nn.Parameter] | None, experts) -> Parallelized:
    """DDP as a dry run (engine/train/dryrun.py) plays it: DDP's C++ reducer verifies the parameters' values
    and allocates real buckets (32 GB for Llama-3.1-8B in fp32), which a model without values has not got.
    The gradients accumulate in the parameters and are all-reduced in place after the step's backward: the
    bytes DDP holds with gradient_as_bucket_view (its buckets are the gradients) and sends, one call per
    parameter instead of one per bucket."""
    from engine.parallel.data import allreduce_each

    skip = {id(p) for p in ignored or ()}

    def after_backward() -> None:
        allreduce_each([p for p in model.parameters() if id(p) not in skip], group)
        if experts is not None:
            experts.reduce_gradients()

    return Parallelized(modules=[model], forward=model, after_backward=after_backward, experts=experts)


def _pipeline(model: GPT, cfg: RunConfig, dims: ParallelDims, mesh, *, device: torch.device,
              saved_split: list[int] | None = None,
              real: Callable[..., None] = lambda *modules: None) -> Parallelized:
    """Stages first, then per chunk: TP, checkpointing, ZeRO-2/3 over dp (torchtitan applies its
    parallelize function per model part); plain dp averages gradients after the schedule. A meta
    model's chunks are materialised together once laid out (`real`): only this rank's stages."""
    from engine.parallel.pipeline import allreduce_grads, build_pipeline

    p = cfg.parallel

    def per_chunk(chunk: nn.Module) -> nn.Module:
        _tp_and_checkpointing(chunk, cfg, mesh)
        if dims.dp > 1 and p.zero > 0:
            from engine.parallel.zero import apply_zero

            return apply_zero(chunk, mesh["dp"], stage=p.zero, reshard_after_forward=p.reshard_after_forward,
                              mp_policy=fsdp_mp_policy(cfg))
        return chunk

    if p.schedule == "skip":
        from engine.parallel.skippipe import build_skip_pipeline

        real(model)  # SkipPipe cuts a real model (every rank builds it whole, as before)
        _tp_and_checkpointing(model, cfg, mesh, device.type)
        pipe = build_skip_pipeline(model, mesh["pp"], skip_ratio=p.skip_ratio, n_microbatches=cfg.grad_accum,
                                   micro=cfg.batch.micro, loss_fn=loss_fn, device=device)
        skip_dp = mesh["dp"].get_group() if dims.dp > 1 else None
        return Parallelized(modules=list(pipe.modules), forward=None, pipeline=pipe,
                            after_backward=lambda: allreduce_grads(pipe.modules, skip_dp))
    layer_split = (saved_split or _auto_split(model, cfg, dims, mesh, device)) if p.layer_split == "auto" \
        else p.layer_split
    pipe = build_pipeline(model, mesh["pp"], schedule=p.schedule, virtual=p.virtual, layer_split=layer_split,
                          n_microbatches=cfg.grad_accum, loss_fn=loss_fn, device=device, parallelize=per_chunk,
                          materialize=real)
    dp_group = mesh["dp"].get_group() if dims.dp > 1 and p.zero == 0 else None

    def after_backward() -> None:  # the schedule already summed the tied embedding/head gradients
        if dp_group is not None:
            allreduce_grads(pipe.modules, dp_group)

    return Parallelized(modules=list(pipe.modules), forward=None, pipeline=pipe, after_backward=after_backward,
                        layer_split=layer_split)


def _auto_split(model: GPT, cfg: RunConfig, dims: ParallelDims, mesh, device: torch.device) -> list[int]:
    """parallel.layer_split=auto: layers per stage by each stage's measured speed (Holmes)."""
    from engine.device import host_group
    from engine.parallel.layer_split import auto_layer_split, layer_seconds

    m = cfg.model
    dp_group = mesh["dp"].get_group() if dims.dp > 1 else None
    block = model.layers["0"]
    with torch.random.fork_rng(devices=[]):  # the probe's dropout leaves the run's random stream alone
        if record_of([model]) is not None:  # a meta model: time a real copy of the block (values drawn here)
            block = copy.deepcopy(block).to_empty(device=device)
            for t in block.parameters():
                torch.nn.init.normal_(t.data, std=0.02)
        seconds = layer_seconds(block, micro=cfg.batch.micro, seq=m.seq_len, d_model=m.d_model,
                                n_microbatches=cfg.grad_accum, dp_group=dp_group)
    stage = mesh["pp"].get_local_rank()
    return auto_layer_split(m.layers, stage=stage, pp=dims.pp, seconds=seconds, group=host_group())
