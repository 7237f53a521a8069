"""The training loop of one rank: build, parallelize, step, measure, checkpoint.

`Trainer.run()` yields StepMetrics per optimizer step. Knobs that can change without a restart
are applied at step boundaries through `apply_knobs()` (the live tuner uses it).
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engine.train import checkpoint as ckpt
from engine.train.comm_setup import apply_live_knobs, install_link_groups
from engine.train.compose import compose
from engine.config.schema import RunConfig
from engine.data.batches import rank_batches
from engine.device import init_host_group, peak_flops
from engine.mesh import ParallelDims
from engine.train.loss import global_loss, micro_loss, moe_aux_loss
from engine.model.gpt import flops_per_token, loss_fn
from engine.parallel.parallelize import Parallelized
from profilers.collectives import CollectiveProfiler
from profilers.steps import StepTimer

Emit = Callable[[int, str, str, float], None]


@dataclass(slots=True)
class StepMetrics:
    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    lr: float
    grad_norm: float
    mfu: float | None = None
    val_loss: float | None = None
    breakdown: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0  # the step by the trainer's own clock, independent of the StepTimer

    def records(self) -> list[tuple[str, str, float]]:
        """(kind, name, value) records of the step: its own, its val loss, its time breakdown."""
        out = [("step", name, value) for name, value in (
            ("loss", self.loss), ("step_time(s)", self.step_time_s), ("wall_time(s)", self.wall_s),
            ("tokens_per_s", self.tokens_per_s), ("lr", self.lr), ("grad_norm", self.grad_norm))]
        out += [("step", "mfu", self.mfu)] if self.mfu is not None else []
        out += [("eval", "val_loss", self.val_loss)] if self.val_loss is not None else []
        return out + [("breakdown", f"{phase}(s)", seconds) for phase, seconds in self.breakdown.items()]


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warmup, then cosine / linear decay to lr * min_lr_ratio, or constant."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.schedule == "constant" or t.steps <= t.warmup_steps:
        return t.lr
    frac = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
    decay = 0.5 * (1 + math.cos(math.pi * frac)) if t.schedule == "cosine" else 1 - frac
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * decay)


class Trainer:
    """One rank's training. Needs an initialised process group when world_size > 1.
    `init_values=False` builds the parts without their initial values (engine/train/dryrun.py)."""

    def __init__(self, cfg: RunConfig, *, device: torch.device, emit: Emit | None = None,
                 flush: Callable[[], object] | None = None, run_dir: Path | None = None,
                 init_values: bool = True) -> None:
        self.cfg, self.device, self.run_dir = cfg, device, run_dir
        self.emit: Emit = emit or (lambda *a: None)
        # called after each step's records: a killed rank loses no completed step
        self.flush: Callable[[], object] = flush or (lambda: None)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        # before the CollectiveProfiler wraps torch.distributed: its records include the emulated links
        order = install_link_groups(cfg, world)
        self.dims = ParallelDims(cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, world, cp=cfg.parallel.cp,
                                 order=order)
        self.coords = self.dims.coords(self.rank)
        self.mesh = self.dims.build_mesh(device.type) if dist.is_initialized() else None
        if dist.is_initialized():
            init_host_group(timeout_s=cfg.train.timeout_s)  # no-op when the world already has one
        self.start_step = 0
        self.timer = StepTimer(device, enabled=cfg.profile.enabled)
        # records every torch.distributed collective (and DDP buckets) once enabled
        self.collectives = CollectiveProfiler(enabled=cfg.profile.enabled and self.dims.world_size > 1)
        self._step_events: list[dict[str, Any]] = []
        if self.collectives.enabled:  # records read tp:all_reduce, dp:all_gather, pp:send, ...
            self.collectives.name_groups(_axis_groups(self.mesh, self.dims))
        parts = compose(cfg, dims=self.dims, mesh=self.mesh if self.mesh is not None else _NoMesh(), device=device,
                        mark=self.timer.mark, collectives=self.collectives, init_values=init_values)
        self.par: Parallelized = parts.par
        self.comm, self.co2 = parts.comm, parts.co2  # gradient traffic's CommMonitor, CO2's rounds
        self.user_dataset, self.user_step = parts.user_dataset, parts.user_step
        self.live_start_cfg = cfg  # live knobs are judged against what was built
        self.batches = rank_batches(data=cfg.data, model=cfg.model, global_batch=cfg.batch.global_,
                                    seed=cfg.train.seed, user_dataset=self.user_dataset, **self._data_ranks())
        self.stream = self.batches.stream  # a real data source read in order: checkpoints keep its place
        sample = cfg.model.seq_len if self.user_dataset is None else self.user_dataset.seq_len
        self.tokens_per_step = cfg.batch.global_ * sample
        # a user's model is an unknown architecture: MFU reads n/a
        self.flops_per_step = flops_per_token(cfg.model) * self.tokens_per_step if self.user_dataset is None else None
        self.peak = peak_flops(device)
        self._fwd_kw: dict[str, torch.Tensor] = {}  # per-sample forward inputs besides tokens (positions, doc_ids)
        self._loss_norm: float | None = None  # packed data: local token-loss sum / this = share of the global mean
        self.flexsp = None  # adaptive sequence parallelism (engine/parallel/adaptive_sp.py), after calibration
        if cfg.parallel.adaptive_sp and self.dims.world_size > 1:
            self.flexsp = self._start_flexsp()
        if cfg.train.resume_from:
            self.start_step = ckpt.load(self.rank_state(), cfg.train.resume_from)

    def rank_state(self) -> ckpt.RankState:
        """What this rank's checkpoints save and load into (live objects: a load fills them)."""
        c, d = self.cfg, self.dims
        return ckpt.RankState(par=self.par, layout={"dp": d.dp, "tp": d.tp, "pp": d.pp, "cp": d.cp,
                                                    "ep": c.parallel.ep},
                              coords=self.coords, rank=self.rank, device=self.device, seed=c.train.seed,
                              dropout=c.model.dropout, data_source=c.data.source, compressor=c.comm.compressor,
                              zero=c.parallel.zero, comm=self.comm, co2=self.co2, stream=self.stream)

    # ------------------------------------------------------------------ steps
    def _local_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's batch of `step` on the device; its other forward inputs go to `self._fwd_kw`."""
        batch = self.batches.train(step).to(self.device)
        self._fwd_kw = batch.fwd_kw
        if batch.real_tokens is not None:  # packed: tokens/s counts real tokens, the loss sums them
            self.tokens_per_step, self._loss_norm = batch.real_tokens, batch.loss_norm
        return batch.x, batch.y

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _micro_steps(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward over the micro-batches; the mean loss of the local batch, on the device."""
        par, micro, accum = self.par, self.cfg.batch.micro, self.cfg.grad_accum
        # float64 on the device, never .item() here: a per-micro-batch host sync would stall the
        # launch queue (and float64 adds the float32 losses exactly as Python floats did)
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for i in range(accum):
            last = i == accum - 1
            with (contextlib.nullcontext() if last else par.no_sync()):
                with self.timer.phase("forward"), self.collectives.scope("forward"), self._autocast():
                    xs, ys = x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro]
                    kw = {k: v[i * micro:(i + 1) * micro] for k, v in self._fwd_kw.items()}
                    loss = micro_loss(par.forward(xs, **kw), ys, accum=accum, loss_norm=self._loss_norm)
                    if self.cfg.model.experts > 0 or self.cfg.model.hf is not None:  # + MoE load-balancing loss
                        loss = loss + moe_aux_loss(par.modules) / accum
                    total += loss.detach().double()
                if last and self.comm is not None:
                    self.comm.begin_backward()
                with self.timer.phase("backward"), self.collectives.scope("backward"):
                    loss.backward()
        if self.comm is not None:
            # DDP's backward returns only once every bucket's all-reduce finished: the tail after
            # the last gradient was ready is communication that compute did not hide
            self.timer.move("backward", "comm_exposed",
                            self.comm.exposed_tail(self.timer.last_end("backward"), self.timer.seconds))
        return total

    def _pipeline_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pipe = self.par.pipeline
        with self.timer.phase("forward"), self._autocast():
            loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
        # read after the step's synchronise (CUDA events): the pipeline's own clock, per span
        self.timer.move("forward", "bubble", lambda: pipe.last_timing["bubble_s"])
        # forward and backward interleave inside a schedule: report the compute as forward+backward
        self.timer.move("forward", "backward", lambda: pipe.last_timing["backward_s"])
        if loss is None:  # not the last stage: no loss here (NaN in a 1-stage-per-rank view)
            return torch.full((1,), math.nan, dtype=torch.float64, device=self.device)
        return loss.detach().double().reshape(1)

    def _start_flexsp(self):
        """Adaptive sequence parallelism (FlexSP): calibrated here, planned a step ahead."""
        from engine.parallel.adaptive_sp import AdaptiveSP, cost_records

        c, p = self.cfg, self.cfg.parallel
        flexsp = AdaptiveSP(self.par.modules[0], documents=self.batches.documents, world=self.dims.world_size,
                            rank=self.rank, seq_len=c.model.seq_len, device=self.device, steps=c.train.steps,
                            timeout_s=c.train.timeout_s, max_tokens=p.adaptive_token_cap, buckets=p.adaptive_buckets,
                            time_limit_s=p.adaptive_time_limit_s,
                            on_group=lambda g: self.collectives.name_groups({"sp": g}))  # records read sp:...
        for name, value in cost_records(flexsp.cost):
            self.emit(self.start_step, "flexsp_cost", name, value)
        return flexsp

    def _reduce_loss(self, local: torch.Tensor) -> Callable[[], float]:
        """The global-batch loss of `local` (engine/train/loss.py), launched; the function waits for it."""
        d, pipe = self.dims, self.par.pipeline
        return global_loss(local, mesh=self.mesh, dp=d.dp, cp=d.cp, pp=d.pp,
                           last_stage=pipe.is_last if d.pp > 1 else True)

    def _data_ranks(self) -> dict[str, int]:
        """Which rows this rank reads: its dp slice of each batch, cut along the sequence over cp. Under adaptive
        SP every rank holds the whole model and nothing joins a row's pieces (FlexSP forms its own groups each
        step), so its validation rows are whole: dp x cp ranks split them as dp ranks do."""
        d, c = self.dims, self.coords
        if self.cfg.parallel.adaptive_sp:
            return {"dp": d.dp * d.cp, "dp_rank": c["dp"] * d.cp + c.get("cp", 0), "cp": 1, "cp_rank": 0}
        return {"dp": d.dp, "dp_rank": c["dp"], "cp": d.cp, "cp_rank": c.get("cp", 0)}

    def _sync_loss(self, local: float | torch.Tensor) -> float:
        """The global-batch loss of a local loss (Python float or device tensor), waited for."""
        t = torch.as_tensor(local, dtype=torch.float64, device=self.device).reshape(1)
        return self._reduce_loss(t)()

    def train_step(self, step: int) -> StepMetrics:
        par, c = self.par, self.cfg
        par.train(True)
        peak = None
        if step == self.start_step and self.cfg.profile.enabled:  # set up before the step's clocks start
            from engine.train.memory import ModelStatePeak

            peak = ModelStatePeak(par.modules).start()  # peak params + grads during backward
        t0 = time.perf_counter()
        self.timer.start_step()
        lr = lr_at(step, c)
        for group in par.optimizer.param_groups:
            group["lr"] = lr
        if self.flexsp is not None:  # its plan's records (rank 0) before the step's own
            local, self.tokens_per_step, records = self.flexsp.step(step, autocast=self._autocast(),
                                                                     phase=self.timer.phase)
            for kind, name, value in records:
                self.emit(step, kind, name, value)
        else:
            with self.timer.phase("data"):
                x, y = self._local_batch(step)
            if self.user_step is not None:  # model.entry's own step function (examples/minmax.py)
                with self.timer.phase("backward"), self.collectives.scope("backward"), self._autocast():
                    local = self.user_step(par.forward, x, y, lr).detach().double().reshape(1)
            else:
                local = self._pipeline_step(x, y) if par.pipeline is not None else self._micro_steps(x, y)
        # launched before CO2's outer all-reduce (same dp group): waiting for it never waits for CO2;
        # issuing it is host time spent on communication, so the breakdown counts it there
        with self.timer.phase("comm_exposed"):
            loss_result = self._reduce_loss(local)
        with self.timer.phase("optimizer"):
            par.after_backward()
            grad_norm = par.clip_grad_norm(c.train.grad_clip, pp_group=self.mesh["pp"].get_group()
                                           if par.pipeline is not None else None)
            if self.user_step is None:  # a user's step function has updated the parameters itself
                par.optimizer.step()
            if peak is not None:  # after the step: optimizer state exists
                self._record_memory_accounting(step, peak.stop())
            par.optimizer.zero_grad(set_to_none=True)
            if self.co2 is not None:
                self.co2.after_inner_step(step)
        breakdown = self.timer.end_step()
        if par.pipeline is not None:
            emit_schedule(self.emit, step, par.pipeline)
        # host syncs left in a step: this loss .item() (after the optimizer, to report it), the
        # norm .item() in clip_grad_norm (a Python coefficient for DTensor and plain grads alike)
        # and, with profiling on, one event synchronise in StepTimer.end_step
        wall = time.perf_counter() - t0
        loss = loss_result()
        # unprofiled: host time up to the loss, whose read waits for the step's queued work
        step_time = self.timer.step_time if breakdown else time.perf_counter() - t0
        if self.collectives.enabled:
            self._step_events = self.collectives.drain()
            _expose_blocking_comm(breakdown, self._step_events)
        tps = self.tokens_per_step / step_time if step_time > 0 else 0.0
        mfu = self.flops_per_step / step_time / (self.peak * self.dims.world_size) \
            if self.peak and self.flops_per_step else None
        return StepMetrics(step=step, loss=loss, step_time_s=step_time, tokens_per_s=tps, lr=lr,
                           grad_norm=grad_norm, mfu=mfu, breakdown=breakdown, wall_s=wall)

    def _record_memory_accounting(self, step: int, peak: dict[str, float] | None = None) -> None:
        """Measured model-state bytes of this rank next to the analytic estimate (engine/train/memory.py)."""
        from engine.train.memory import estimate_memory, model_state_records

        estimate = None if self.user_dataset is not None else estimate_memory(self.cfg, pp_rank=self.coords["pp"])
        for name, value in model_state_records(self.par.modules, self.par.optimizer, peak=peak,
                                               estimate=estimate).items():
            self.emit(step, "memory", name, value)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean val loss over fixed validation batches (all ranks take part)."""
        self.par.train(False)
        batches = self.batches.val(self.cfg.train.eval_batches)
        total = 0.0
        for batch in batches:
            with self._autocast():
                total += self._eval_batch(batch.to(self.device, non_blocking=False))
        return self._sync_loss(total / len(batches))

    def _eval_batch(self, batch) -> float:
        pipe, micro, x, y, kw = self.par.pipeline, self.cfg.batch.micro, batch.x, batch.y, batch.fwd_kw
        if pipe is not None:
            loss = pipe.evaluate(x if pipe.is_first else None, y if pipe.is_last else None)
            return float(loss) if loss is not None else 0.0
        chunks = range(0, x.shape[0], micro)
        return sum(loss_fn(self.par.forward(x[i:i + micro], **{k: v[i:i + micro] for k, v in kw.items()}),
                           y[i:i + micro]).item() for i in chunks) / len(chunks)

    # ------------------------------------------------------------------ loop
    def run(self, on_boundary: Callable[["Trainer", int], None] | None = None) -> Iterator[StepMetrics]:
        c = self.cfg
        trace = None
        if c.profile.trace_steps:
            from profilers.trace import TraceWindow

            a, b = c.profile.trace_steps
            trace = TraceWindow(a, b, (self.run_dir or Path(".")) / "traces", self.rank)
        try:
            yield from self._loop(on_boundary, trace)
            if self.co2 is not None:
                self.co2.flush()  # apply the last outer round, still in flight
        finally:
            if trace is not None:
                trace.close()
            self.collectives.disable()
            if self.flexsp is not None:
                self.flexsp.close()  # the plan thread (rank 0) solving a step that will not run

    def _loop(self, on_boundary, trace) -> Iterator[StepMetrics]:
        c = self.cfg
        for step in range(self.start_step, c.train.steps):
            if on_boundary is not None:
                on_boundary(self, step)
            if trace is not None:
                trace.step(step)
            m = self.train_step(step)
            if c.train.eval_interval and ((step + 1) % c.train.eval_interval == 0 or step + 1 == c.train.steps):
                m.val_loss = self.evaluate()
            self._record(m)
            self.flush()
            if c.train.checkpoint_interval and (step + 1) % c.train.checkpoint_interval == 0:
                ckpt.save(self.rank_state(), step + 1, ckpt.checkpoint_folder(self.cfg, self.run_dir))
            yield m

    def _record(self, m: StepMetrics) -> None:
        e, s = self.emit, m.step
        for kind, name, value in m.records():
            e(s, kind, name, value)
        if self.comm is not None:
            self.comm.record(s, e)
        if self.collectives.enabled:
            events, self._step_events = self._step_events + self.collectives.drain(), []
            for name, value in _collective_records(self.collectives.step_metrics(events), events,
                                                   count_sent=self.comm is None).items():
                e(s, "comm", name, value)
        if self.cfg.model.experts > 0:  # tokens this rank routed to each expert, and the drop rate
            from engine.model.moe import step_stats

            for name, value in step_stats(self.par.modules).items():
                e(s, "moe", name, value)
        if self.cfg.profile.enabled:
            from profilers.memory import peak_memory

            for name, value in peak_memory(self.device).items():
                e(s, "memory", name, value)

    def apply_knobs(self, knobs: dict[str, Any], step: int = -1) -> None:
        """Change knobs that need no restart, at the boundary before `step`, on every rank alike
        (engine/train/live.py's KnobChannel calls this); each knob is recorded at `step`."""
        self.cfg = apply_live_knobs(knobs, start=self.live_start_cfg, now=self.cfg, comm=self.comm, co2=self.co2)
        for name, value in knobs.items():
            self.emit(step, "knob", name, float(value))


def emit_schedule(emit: Emit, step: int, pipe: Any) -> None:
    """The compute actions this rank executed in the step, as records of kind "schedule" (name
    `<action>@start` / `<action>@end`, seconds from the step start; `@wall_start` epoch seconds)
    and, under SkipPipe, each micro-batch's path as kind "skip_path" (name `mb<i>`, value the
    bitmask of visited stages)."""
    record = pipe.last_actions
    emit(step, "schedule", "@wall_start", record["wall_start"])
    emit(step, "schedule", "@total", record["total_s"])
    if record.get("peak_act_bytes"):
        emit(step, "schedule", "@peak_act_bytes", float(record["peak_act_bytes"]))
    for action, start, end in record["actions"]:
        emit(step, "schedule", f"{action}@start", start)
        emit(step, "schedule", f"{action}@end", end)
    for mb, path in getattr(pipe, "last_paths", {}).items():
        emit(step, "skip_path", f"mb{mb}", float(sum(1 << s for s in path)))


def _axis_groups(mesh, dims: ParallelDims) -> dict[str, Any]:
    """The process group of each mesh axis wider than 1, by name (and dp_cp, the gradient average
    over dp x cp under context parallelism: engine/mesh.py)."""
    groups = {axis: mesh[axis].get_group() for axis in ("pp", "dp", "cp", "tp") if getattr(dims, axis) > 1}
    if dims.dp > 1 and dims.cp > 1:
        groups["dp_cp"] = mesh["dp_cp"].get_group()
    return groups


def _collective_records(step_metrics: dict[str, float], events: list[dict[str, Any]], *,
                        count_sent: bool) -> dict[str, float]:
    """A step's "comm" records from the collective profiler, less the CommMonitor's own per-step
    wire and dense bytes; `count_sent` (no DDP gradient hook: TP, FSDP2, pipeline; nothing
    compressed): both are the bytes sent (bus factors, the unit of the compressors' wire bytes;
    not nccl-tests sizes)."""
    out = {name: value for name, value in step_metrics.items() if name not in ("wire_bytes", "dense_bytes")}
    if count_sent:
        from profilers.bandwidth import sent_bytes

        sent = float(sum(sent_bytes(ev) for ev in events if ev["op"] != "ddp_bucket"))
        out.update(wire_bytes=sent, dense_bytes=sent)
    return out


def _expose_blocking_comm(breakdown: dict[str, float], events: list[dict[str, Any]]) -> None:
    """Move the time of functional collectives (tensor/sequence parallel) out of forward and
    backward into comm_exposed: DTensor waits for each before computing on, so it is exposed.
    Under a pipeline schedule forward and backward interleave, so TP time stays in compute there."""
    from profilers.bandwidth import blocking_time

    for phase in ("forward", "backward"):
        seconds = min(blocking_time(events, phase), breakdown.get(phase, 0.0))
        if seconds > 0:
            breakdown[phase] -= seconds
            breakdown["comm_exposed"] = breakdown.get("comm_exposed", 0.0) + seconds


class _NoMesh:
    """Stands in for a DeviceMesh in a single-process run (every group is None)."""

    def __getitem__(self, axis: str):
        raise RuntimeError(f"no process group for mesh axis {axis!r} in a single-process run")
