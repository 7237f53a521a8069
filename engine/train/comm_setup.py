"""Wires communication into a run: the DDP comm hook chain (compression -> link emulation ->
recording), CO2, the optimizer of each layout, and knobs changed live at step boundaries. Each
function takes the pieces it wires (a DDP module, a group, the config, a clock) and returns what it
made; engine/train/compose.py calls them in order.

Hook order, innermost first: the compressor decides what goes on the wire; the emulated link
delays that wire traffic; the recorder times what the training thread actually waits for.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from engine.config.schema import LIVE_KNOBS, RunConfig

if TYPE_CHECKING:
    from engine.parallel.parallelize import Parallelized
    from profilers.collectives import CollectiveProfiler

Emit = Callable[[int, str, str, float], None]


class CommMonitor:
    """Per-step accounting of a DDP model's gradient buckets: when the last one was launched
    (for exposed communication) and the dense vs wire bytes. Timing of the collectives
    themselves is the CollectiveProfiler's (profilers/collectives.py)."""

    def __init__(self, group_size: int, mark: Callable[[], Any] = time.perf_counter) -> None:
        """`mark()` reads the step timer's clock: a CUDA event on the stream the bucket became
        ready on (GPU time), or perf_counter on CPU."""
        self.group_size = group_size
        self._mark = mark
        self.last_launch: Any = 0.0
        self.buckets = 0
        self.bucket_bytes = 0
        self.wire_bytes = 0
        self.dense_bytes = 0
        self.compressor_state: Any = None
        self.bucket_order = None  # engine.comm.bucket_order.BucketOrder of a compressed DDP model
        self.link = None
        self._legs_seen: dict[str, list[int]] = {}  # bidirectional: per-leg totals at the last record

    def begin_backward(self) -> None:
        self.last_launch = self._mark()
        self.buckets = 0

    def exposed_tail(self, end: Any, seconds: Callable[[Any, Any], float]) -> Callable[[], float]:
        """Seconds from the last bucket's launch to `end` (backward's end, same clock), as a
        function to call once the marks can be read (CUDA events: after the step's synchronise)."""
        start = self.last_launch if self.buckets else None
        return lambda: max(0.0, seconds(start, end)) if start is not None else 0.0

    def on_bytes(self, wire: int, dense: int) -> None:
        self.wire_bytes += wire
        self.dense_bytes += dense

    def track(self, hook: Callable) -> Callable:
        """Wrap a DDP comm hook to note each bucket's launch."""

        def tracking_hook(state, bucket):  # no annotations: DDP rejects a string-typed `bucket`
            self.last_launch = self._mark()
            self.buckets += 1
            self.bucket_bytes += bucket.buffer().numel() * bucket.buffer().element_size()
            return hook(state, bucket)

        return tracking_hook

    def record(self, step: int, emit: Emit) -> None:
        """Emit this step's dense and wire bytes (bus factors applied, as the compressors count) and reset."""
        from engine.comm.compress import Wire

        dense = self.dense_bytes or Wire("all_reduce", self.bucket_bytes).on_wire(self.group_size)
        wire = self.wire_bytes if self.dense_bytes else dense
        emit(step, "comm", "wire_bytes", float(wire))
        emit(step, "comm", "dense_bytes", float(dense))
        self._record_legs(step, emit)
        self.bucket_bytes = self.wire_bytes = self.dense_bytes = 0


    def _record_legs(self, step: int, emit: Emit) -> None:
        """Bidirectional compression: this step's wire and dense bytes per leg (reduce, broadcast)."""
        legs = getattr(self.compressor_state, "legs", None)
        if legs is None:
            return
        for leg, (wire, dense) in legs.items():
            seen = self._legs_seen.get(leg, [0, 0])
            emit(step, "comm", f"{leg}_leg_wire_bytes", float(wire - seen[0]))
            emit(step, "comm", f"{leg}_leg_dense_bytes", float(dense - seen[1]))
            self._legs_seen[leg] = [wire, dense]


def install_comm(ddp: torch.nn.Module, group, *, cfg: RunConfig, mark: Callable[[], Any],
                 collectives: CollectiveProfiler) -> CommMonitor | None:
    """Register compression + link emulation + bucket tracking (+ recording) as one DDP comm hook;
    returns its CommMonitor, or None when DDP keeps its own all-reduce (nothing to compress,
    emulate or record). `mark` reads the step timer's clock."""
    n = dist.get_world_size(group)
    monitor = CommMonitor(n, mark=mark)
    state, hook = _compression_hook(cfg, ddp, group, monitor)
    if cfg.comm.compressor != "none":  # a resumed run compresses its first buckets in the checkpoint's order
        from engine.comm.bucket_order import BucketOrder

        monitor.bucket_order = BucketOrder(ddp.module.named_parameters())
        hook = monitor.bucket_order.wrap(hook)
    if cfg.link.gbps > 0 or cfg.link.groups:
        monitor.link = _link_of(cfg, group)
        # the cost reads monitor.link at each bucket, so a live tuner can change the link
        hook = monitor.link.wrap_hook(hook, group_size=n, cost=_link_cost(monitor, n),
                                      group=group if group is not None else dist.group.WORLD)
    if cfg.profile.enabled or cfg.comm.compressor != "none" or cfg.link.gbps > 0 or cfg.link.groups:
        hook = monitor.track(hook)
        if collectives.enabled:
            hook = collectives.wrap_comm_hook(hook)
        ddp.register_comm_hook(state, hook)
        return monitor
    return None


def _link_cost(monitor: CommMonitor, n: int) -> Callable[[Any, dist.GradBucket], float]:
    """Seconds a bucket spends on the emulated link: its real wire bytes when compressed."""

    def cost(state: Any, bucket: dist.GradBucket) -> float:
        link = monitor.link
        if link is None:
            return 0.0
        last = getattr(state, "last_cost", {}).get(bucket.index())
        if last is not None:  # a compressor's (wire bytes, collectives) of this bucket
            return link.wire_delay(*last)
        buf = bucket.buffer()
        dense = buf.numel() * 4  # fp32 gradients
        ratio = state.wire_bytes / state.dense_bytes if getattr(state, "dense_bytes", 0) else 1.0
        return link.delay_for("all_reduce", dense * ratio, n)

    return cost


def _compression_hook(cfg: RunConfig, ddp: torch.nn.Module, group, monitor: CommMonitor) -> tuple[Any, Callable]:
    c = cfg.comm
    if c.compressor == "none":
        return group, default_hooks.allreduce_hook
    if c.adaptive:
        from engine.comm.adaptive import AdaptiveCompressor, adaptive_hook

        state: Any = AdaptiveCompressor(ddp.module.named_parameters(), process_group=group,
                                        default_level=c.density, error_budget=c.error_budget,
                                        interval=c.adaptive_interval, on_bytes=monitor.on_bytes)
        hook: Callable = adaptive_hook
    elif c.bidirectional:
        from engine.comm.bidirectional import make_bidirectional_hook

        state, hook = make_bidirectional_hook(c.compressor, process_group=group, density=c.density,
                                              seed=cfg.train.seed, on_bytes=monitor.on_bytes)
    else:
        from engine.comm.compress import make_comm_hook

        state, hook = make_comm_hook(c.compressor, process_group=group, density=c.density, rank=c.rank,
                                     seed=cfg.train.seed, on_bytes=monitor.on_bytes)
    monitor.compressor_state = state
    return state, hook


def install_fsdp_comm(par: Parallelized, *, cfg: RunConfig, dp: int, dp_group,
                      mark: Callable[[], Any]) -> CommMonitor | None:
    """ZeRO-2/3 (FSDP2) with randk/topk: a compressed custom reduce-scatter on every fully_shard
    group (engine/comm/fsdp_compress.py); its gradient bytes go to the CommMonitor it returns
    (None when the layout has no such reduce-scatter)."""
    if cfg.parallel.zero < 2 or cfg.comm.compressor == "none" or dp == 1 or cfg.co2.enabled:
        return None
    from torch.distributed.fsdp import FSDPModule

    from engine.comm.fsdp_compress import apply_fsdp_compression

    monitor = CommMonitor(dp, mark=mark)
    groups = [m for root in par.modules for m in root.modules() if isinstance(m, FSDPModule)]
    monitor.compressor_state = apply_fsdp_compression(
        groups, cfg.comm.compressor, process_group=dp_group, density=cfg.comm.density,
        seed=cfg.train.seed, on_bytes=monitor.on_bytes)
    return monitor


def build_optimizer(par: Parallelized, cfg: RunConfig, mesh) -> torch.optim.Optimizer:
    """The layout's optimizer through the one builder (`engine.parallel.zero.build_optimizer`)."""
    from engine.parallel.parallelize import grad_axis
    from engine.parallel.zero import build_optimizer as zero_optimizer

    t, p = cfg.train, cfg.parallel
    # ZeRO-1 shards a DDP model's optimizer over dp (x cp: the gradient axis); stages 2-3 shard
    # through FSDP2's DTensor parameters
    stage = p.zero if p.dp * p.cp > 1 and not cfg.co2.enabled else 0
    group = mesh[grad_axis(p.cp)].get_group() if stage == 1 else None
    return zero_optimizer(list(par.parameters()), stage=stage, lr=t.lr, betas=(t.beta1, t.beta2),
                          weight_decay=t.weight_decay, process_group=group)


def install_co2(par: Parallelized, *, cfg: RunConfig, dp: int, dp_group) -> tuple[Any, CommMonitor] | None:
    """CO2's outer rounds over the dp group, and the CommMonitor counting its wire bytes (there is
    no backward communication under CO2); None without co2.enabled or at dp=1."""
    if not cfg.co2.enabled or dp == 1:
        return None
    from engine.comm.co2 import CO2

    o = cfg.co2
    monitor = CommMonitor(dp)
    co2 = CO2(par.modules[0], par.optimizer, process_group=dp_group, tau=o.tau, outer_lr=o.outer_lr,
              outer_momentum=o.outer_momentum, clip=o.clip, penalty=o.penalty, gap_penalty=o.gap_penalty,
              on_bytes=monitor.on_bytes, link=_link_of(cfg, dp_group))
    return co2, monitor


def _link_of(cfg: RunConfig, group=None):
    """The emulated link of `group`'s collectives: link.gbps, or with link.groups the hops its ring crosses."""
    from engine.comm.link import LinkEmulator, topology_of

    if cfg.link.groups:
        topology = topology_of(cfg.link.groups, inter_gbps=cfg.link.inter_gbps,
                               inter_latency_us=cfg.link.inter_latency_us)
        return topology.link_for(dist.get_process_group_ranks(group) if group is not None
                                 else range(dist.get_world_size()))
    if cfg.link.gbps <= 0:
        return None
    return LinkEmulator(gbps=cfg.link.gbps, latency_us=cfg.link.latency_us)


def install_link_groups(cfg: RunConfig, world: int) -> tuple[int, ...] | None:
    """With link.groups: every torch.distributed collective and send pays the links it crosses
    (engine/comm/link_patch.py), and the mesh order of `parallel.placement`; else None."""
    if not cfg.link.groups or world < 2:
        import sys

        if "engine.comm.link_patch" in sys.modules:  # a previous run in this process emulated groups
            sys.modules["engine.comm.link_patch"].emulate_topology(None)
        return None
    from engine.comm.link import topology_of
    from engine.comm.link_patch import emulate_topology
    from engine.config.placement import rank_order

    emulate_topology(topology_of(cfg.link.groups, inter_gbps=cfg.link.inter_gbps,
                                 inter_latency_us=cfg.link.inter_latency_us))
    return tuple(rank_order(world, placement=cfg.parallel.placement, groups=[g.ranks for g in cfg.link.groups],
                            pp=cfg.parallel.pp, tp=cfg.parallel.tp))




def apply_live_knobs(knobs: dict[str, Any], *, start: RunConfig, now: RunConfig, comm: CommMonitor | None,
                     co2: Any = None) -> RunConfig:
    """Apply knobs that need no restart to the run's compressor, link and CO2; returns the config
    with them. `start` is the config the run was built with, `now` the current one. The same dict
    must reach every rank at the same step.

    Refuses (ValueError) a knob that cannot act in this run (engine.train.live.inert_knobs), so no
    measurement is ever attributed to a knob that did nothing.
    """
    from engine.config.schema import replace
    from engine.train.live import inert_knobs

    unknown = set(knobs) - set(LIVE_KNOBS)
    if unknown:
        raise ValueError(f"knobs {sorted(unknown)} need a restart; live knobs are {', '.join(LIVE_KNOBS)}")
    inert = inert_knobs(start, knobs)
    if inert:
        raise ValueError("; ".join(f"{k}={knobs[k]!r} cannot act: {why}" for k, why in inert.items()))
    cfg = replace(now, knobs)
    _apply_comm_knobs(comm, cfg, knobs)
    if co2 is not None:
        co2.set_knobs(tau=cfg.co2.tau, outer_lr=cfg.co2.outer_lr)
    return cfg


def _apply_comm_knobs(monitor: CommMonitor | None, cfg: RunConfig, knobs: dict[str, Any]) -> None:
    if monitor is None:
        return
    state = monitor.compressor_state
    if "comm.density" in knobs and hasattr(state, "set_default_level"):  # L-GreCo (adaptive)
        state.set_default_level(cfg.comm.density)
    elif hasattr(state, "set_level") and ({"comm.density", "comm.rank"} & set(knobs)):
        state.set_level(density=cfg.comm.density, rank=cfg.comm.rank)
    if {"link.gbps", "link.latency_us"} & set(knobs):
        from engine.comm.link import LinkEmulator

        # the hook reads monitor.link per bucket: None (gbps=0) pauses the emulation, a new one resumes it
        monitor.link = LinkEmulator(gbps=cfg.link.gbps, latency_us=cfg.link.latency_us) if cfg.link.gbps > 0 else None
