"""Wires communication into a run: the DDP comm hook chain (compression -> link emulation ->
recording), CO2, the optimizer of each layout, and knobs changed live at step boundaries.

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

from engine.config import RunConfig

if TYPE_CHECKING:
    from engine.parallelize import Parallelized
    from engine.train import Trainer

Emit = Callable[[int, str, str, float], None]


class CommMonitor:
    """Per-step accounting of a DDP model's bucket all-reduces (bytes, wire bytes, timing)."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.last_launch = 0.0
        self.buckets: list[tuple[int, float, float]] = []  # (dense bytes, launch, done)
        self.wire_bytes = 0
        self.dense_bytes = 0
        self.total_wire = 0
        self.total_dense = 0
        self.compressor_state: Any = None
        self.link = None

    def begin_backward(self) -> None:
        self.last_launch = time.perf_counter()

    def exposed_tail(self) -> float:
        """Seconds backward() kept running after the last bucket was launched."""
        if not self.buckets:
            return 0.0
        return max(0.0, time.perf_counter() - self.last_launch)

    def on_bytes(self, wire: int, dense: int) -> None:
        self.wire_bytes += wire
        self.dense_bytes += dense

    def wrap(self, hook: Callable) -> Callable:
        """A DDP comm hook that times `hook` from launch to completion of its future."""

        def recording_hook(state, bucket):  # no annotations: DDP rejects a string-typed `bucket`
            launch = time.perf_counter()
            self.last_launch = launch
            nbytes = bucket.buffer().numel() * bucket.buffer().element_size()
            fut = hook(state, bucket)

            def done(f: torch.futures.Future) -> torch.Tensor:
                self.buckets.append((nbytes, launch, time.perf_counter()))
                return f.value()

            return fut.then(done)

        return recording_hook

    def record(self, step: int, emit: Emit) -> None:
        """Emit this step's totals and reset."""
        from profilers.collectives import busbw

        if self.buckets:
            nbytes = sum(b for b, _, _ in self.buckets)
            busy = sum(end - start for _, start, end in self.buckets)
            emit(step, "comm", "all_reduce/bytes", float(nbytes))
            emit(step, "comm", "all_reduce/count", float(len(self.buckets)))
            emit(step, "comm", "all_reduce/time(s)", busy)
            if busy > 0:
                emit(step, "comm", "all_reduce/busbw(GB/s)", busbw("all_reduce", nbytes, busy, self.group_size))
        dense = self.dense_bytes or sum(b for b, _, _ in self.buckets)
        wire = self.wire_bytes or dense
        self.total_wire += wire
        self.total_dense += dense
        emit(step, "comm", "wire_bytes", float(wire))
        emit(step, "comm", "dense_bytes", float(dense))
        self.buckets.clear()
        self.wire_bytes = self.dense_bytes = 0


def install_comm(trainer: Trainer, ddp: torch.nn.Module, group) -> dict[str, Any]:
    """Register compression + link emulation + recording as one comm hook on a DDP module."""
    cfg: RunConfig = trainer.cfg
    n = dist.get_world_size(group)
    monitor = CommMonitor(n)
    state, hook = _compression_hook(cfg, group, monitor)
    if cfg.link.gbps > 0:
        from engine.comm.link import LinkEmulator

        monitor.link = LinkEmulator(cfg.link.gbps, cfg.link.latency_us)
        hook = monitor.link.wrap_hook(hook)
    if cfg.profile.enabled or cfg.comm.compressor != "none" or cfg.link.gbps > 0:
        ddp.register_comm_hook(state, monitor.wrap(hook))
    trainer.comm = monitor
    return {"monitor": monitor, "compressor": state}


def _compression_hook(cfg: RunConfig, group, monitor: CommMonitor) -> tuple[Any, Callable]:
    c = cfg.comm
    if c.compressor == "none":
        return group, default_hooks.allreduce_hook
    if c.adaptive:
        from engine.comm.adaptive import make_adaptive_hook

        state, hook = make_adaptive_hook(c.compressor, process_group=group, density=c.density, rank=c.rank,
                                         error_budget=c.error_budget, interval=c.adaptive_interval,
                                         seed=cfg.train.seed, on_bytes=monitor.on_bytes)
    else:
        from engine.comm.compress import make_comm_hook

        state, hook = make_comm_hook(c.compressor, process_group=group, density=c.density, rank=c.rank,
                                     seed=cfg.train.seed, on_bytes=monitor.on_bytes)
    monitor.compressor_state = state
    return state, hook


def build_optimizer(par: Parallelized, cfg: RunConfig, mesh) -> torch.optim.Optimizer:
    t = cfg.train
    if cfg.parallel.zero == 1 and cfg.parallel.dp > 1 and par.pipeline is None:
        from engine.parallel.zero import build_optimizer as zero_optimizer

        return zero_optimizer(par.modules[0], stage=1, lr=t.lr, betas=(t.beta1, t.beta2),
                              weight_decay=t.weight_decay, process_group=mesh["dp"].get_group())
    params = [p for p in par.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)


def install_co2(trainer: Trainer, par: Parallelized) -> None:
    cfg = trainer.cfg
    if not cfg.co2.enabled or trainer.dims.dp == 1:
        return
    from engine.comm.co2 import CO2

    o = cfg.co2
    monitor = CommMonitor(trainer.dims.dp)
    trainer.comm = None  # CO2 does no per-step backward communication
    trainer.co2 = CO2(par.modules[0], par.optimizer, process_group=trainer.mesh["dp"].get_group(), tau=o.tau,
                      outer_lr=o.outer_lr, outer_momentum=o.outer_momentum, clip=o.clip,
                      staleness_penalty=o.staleness_penalty, on_bytes=monitor.on_bytes,
                      link=_link_of(cfg))
    trainer.co2_monitor = monitor


def _link_of(cfg: RunConfig):
    if cfg.link.gbps <= 0:
        return None
    from engine.comm.link import LinkEmulator

    return LinkEmulator(cfg.link.gbps, cfg.link.latency_us)


LIVE_KNOBS = ("comm.density", "comm.rank", "co2.tau", "co2.outer_lr", "link.gbps", "link.latency_us",
              "batch.micro", "train.lr")


def apply_live_knobs(trainer: Trainer, knobs: dict[str, Any]) -> None:
    """Apply knobs that need no restart; the same dict must reach every rank at the same step."""
    from engine.config import replace

    unknown = set(knobs) - set(LIVE_KNOBS)
    if unknown:
        raise ValueError(f"knobs {sorted(unknown)} need a restart; live knobs are {', '.join(LIVE_KNOBS)}")
    trainer.cfg = replace(trainer.cfg, knobs)
    cfg = trainer.cfg
    monitor = trainer.comm
    if monitor is not None and monitor.compressor_state is not None and hasattr(monitor.compressor_state, "set_level"):
        monitor.compressor_state.set_level(density=cfg.comm.density, rank=cfg.comm.rank)
    if monitor is not None and monitor.link is not None:
        monitor.link.set(cfg.link.gbps, cfg.link.latency_us)
    if trainer.co2 is not None:
        trainer.co2.set_knobs(tau=cfg.co2.tau, outer_lr=cfg.co2.outer_lr)
    for name, value in knobs.items():
        trainer.emit(trainer.current_step if hasattr(trainer, "current_step") else -1, "knob", name, float(value))
