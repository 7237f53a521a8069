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

from engine import checkpoint as ckpt
from engine.comm_setup import apply_live_knobs, install_link_groups
from engine.compose import compose
from engine.config import RunConfig
from engine.data import Splits, build_splits, local_batch, val_batches
from engine.device import init_host_group, peak_flops
from engine.mesh import ParallelDims
from engine.model import flops_per_token, loss_fn
from engine.parallelize import Parallelized
from engine.validate_data import STREAM_SOURCES
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
    `init_values=False` builds the parts without their initial values (engine/dryrun.py)."""

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
            self.collectives.name_groups({axis: self.mesh[axis].get_group() for axis in ("pp", "dp", "cp", "tp")
                                          if getattr(self.dims, axis) > 1})
            if self.dims.dp > 1 and self.dims.cp > 1:  # the gradient average over dp x cp (engine/mesh.py)
                self.collectives.name_groups({"dp_cp": self.mesh["dp_cp"].get_group()})
        self.stream = self.val_stream = None  # a real data source read in order (engine/data_sources.py)
        parts = compose(cfg, dims=self.dims, mesh=self.mesh if self.mesh is not None else _NoMesh(), device=device,
                        mark=self.timer.mark, collectives=self.collectives, init_values=init_values)
        self.par: Parallelized = parts.par
        self.comm, self.co2 = parts.comm, parts.co2  # gradient traffic's CommMonitor, CO2's rounds
        self.user_dataset, self.user_step = parts.user_dataset, parts.user_step
        self.live_start_cfg = cfg  # live knobs are judged against what was built
        if self.user_dataset is not None:
            # a user's model trains on its own dataset (validated on it too: it brings no split)
            self.splits = Splits(self.user_dataset, self.user_dataset)
            self.tokens_per_step = cfg.batch.global_ * self.user_dataset.seq_len
            self.flops_per_step = None  # unknown architecture: MFU reads n/a
        else:
            if cfg.data.source in STREAM_SOURCES:
                from engine.data_sources import build_streams

                self.stream, self.val_stream = build_streams(cfg.data, cfg.model)
            else:
                self.splits = build_splits(cfg.data, cfg.model, seed=cfg.train.seed)
            self.tokens_per_step = cfg.batch.global_ * cfg.model.seq_len
            self.flops_per_step = flops_per_token(cfg.model) * self.tokens_per_step
        self.peak = peak_flops(device)
        self._fwd_kw: dict[str, torch.Tensor] = {}  # per-sample forward inputs besides tokens (positions, doc_ids)
        self._loss_norm: float | None = None  # packed data: local token-loss sum / this = share of the global mean
        self.flexsp = None  # adaptive sequence parallelism: (GroupCache, CostModel, PlanAhead) after calibration
        if cfg.parallel.adaptive_sp and self.dims.world_size > 1:
            self._calibrate_flexsp()
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
        c = self.cfg
        if self.stream is not None:
            return self._stream_batch()
        if c.data.lengths != "fixed" and self.user_dataset is None:
            return self._packed_batch(step)
        x, y = local_batch(self.splits.train, global_batch=c.batch.global_, dp=self.dims.dp,
                           dp_rank=self.coords["dp"], seed=c.train.seed, step=step)
        x, y = self._cp_shard(x, y)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _stream_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the stream's next global batch (the stream moves on: one call per step)."""
        from engine.data_sources import rank_rows

        rows = rank_rows(self.stream.next_rows(self.cfg.batch.global_), dp=self.dims.dp, dp_rank=self.coords["dp"])
        packed = (rows.positions, rows.doc_ids) if self.cfg.data.pack else (None, None)
        x, y = self._cp_shard(rows.x, rows.y, *packed)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _cp_shard(self, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None = None,
                  doc_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This cp rank's sequence chunk of a (dp-local) batch; positions and document ids of the
        chunk go to the forward through `self._fwd_kw` (document ids stay whole: Ulysses attends
        over the full row)."""
        from engine.parallel.context import shard_sequence

        cp, r = self.dims.cp, self.coords.get("cp", 0)
        if positions is None and cp > 1:
            positions = torch.arange(x.shape[1]).expand_as(x)
        self._fwd_kw = {}
        if positions is not None:
            self._fwd_kw["positions"] = shard_sequence(positions, cp=cp, cp_rank=r).to(self.device)
        if doc_ids is not None:
            self._fwd_kw["doc_ids"] = doc_ids.to(self.device)
        return shard_sequence(x, cp=cp, cp_rank=r), shard_sequence(y, cp=cp, cp_rank=r)

    def _packed_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the packed variable-length global batch (engine/lengths.py)."""
        from engine.lengths import packed_global_batch

        c, d = self.cfg, self.cfg.data
        packed = packed_global_batch(self.splits.train.tokens, rows=c.batch.global_, row_len=c.model.seq_len,
                                     kind=d.lengths, mean=d.length_mean, sigma=d.length_sigma,
                                     max_len=d.length_max or c.model.seq_len, seed=c.train.seed, step=step)
        self.tokens_per_step = packed.real_tokens  # tokens/s counts real tokens, not padding
        # each rank sums its token losses over 1/(dp*cp) of the global real tokens; the gradient
        # average over dp x cp then gives the global token mean whatever each rank's share
        self._loss_norm = packed.real_tokens / (self.dims.dp * self.dims.cp)
        per, r = c.batch.global_ // self.dims.dp, self.coords["dp"]
        rows = slice(r * per, (r + 1) * per)
        x, y = self._cp_shard(packed.x[rows], packed.y[rows], packed.positions[rows], packed.doc_ids[rows])
        return x.to(self.device), y.to(self.device)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor, accum: int) -> torch.Tensor:
        if self._loss_norm is None:
            return loss_fn(logits, targets) / accum
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                                 reduction="sum") / self._loss_norm

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
                    loss = self._loss(par.forward(xs, **kw), ys, accum)
                    if self.cfg.model.experts > 0 or self.cfg.model.hf is not None:  # + MoE load-balancing loss
                        loss = loss + _moe_aux_loss(par.modules) / accum
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

    # ------------------------------------------------------------------ adaptive SP (FlexSP)
    def _calibrate_flexsp(self) -> None:
        from engine.parallel.adaptive_sp import GroupCache, PlanAhead, calibrate
        from engine.parallel.flexsp import solve

        groups = GroupCache(self.cfg.train.timeout_s,
                            on_group=lambda g: self.collectives.name_groups({"sp": g}))  # records read sp:...
        model = self.par.modules[0]
        cost = calibrate(model, world=self.dims.world_size, groups=groups, seq_len=self.cfg.model.seq_len,
                         device=self.device)
        p, world = self.cfg.parallel, self.dims.world_size
        ahead = PlanAhead(lambda lengths: solve(lengths, n=world, cap=self._flexsp_cap(lengths), cost=cost,
                                                buckets=p.adaptive_buckets, time_limit_s=p.adaptive_time_limit_s),
                          rank=self.rank)
        self.flexsp = (groups, cost, ahead)
        for name, value in (("a1(s/token^2)", cost.a1), ("a2(s/token)", cost.a2), ("bias(s)", cost.bias),
                            ("per_seq(s)", cost.per_seq), ("pack_a2(s/token)", cost.pack_a2),
                            *((f"a2a_g{g}(s/token)", v) for g, v in cost.a2a.items()),
                            *((f"bias_g{g}(s)", v) for g, v in cost.group_bias.items())):
            self.emit(self.start_step, "flexsp_cost", name, value)

    def _flexsp_cap(self, lengths: list[int]) -> int:
        return self.cfg.parallel.adaptive_token_cap or 2 * -(-sum(lengths) // self.dims.world_size)

    def _flexsp_docs(self, step: int) -> list[torch.Tensor]:
        from engine.lengths import budget_documents

        if self._docs_ahead is not None and self._docs_ahead[0] == step:  # drawn last step for the plan
            return self._docs_ahead[1]
        c, d = self.cfg, self.cfg.data
        return budget_documents(self.splits.train.tokens, budget=c.batch.global_ * c.model.seq_len, kind=d.lengths,
                                mean=d.length_mean, sigma=d.length_sigma, max_len=d.length_max or c.model.seq_len,
                                seed=c.train.seed, step=step)

    def _adaptive_step(self, step: int) -> torch.Tensor:
        """FlexSP: this step's plan (solved during the previous step), then step t+1's plan starts
        solving in the background (rank 0) while this rank runs its group; the plan is recorded."""
        from engine.parallel.adaptive_sp import run_step

        c = self.cfg
        groups, cost, ahead = self.flexsp
        with self.timer.phase("data"):
            docs = self._flexsp_docs(step)
            lengths = [doc.numel() - 1 for doc in docs]
            cap = self._flexsp_cap(lengths)
            plan = ahead.take(step, lengths)
            if self.rank == 0 and step + 1 < c.train.steps:  # documents are a pure function of the step
                self._docs_ahead = (step + 1, self._flexsp_docs(step + 1))
                ahead.submit(step + 1, [doc.numel() - 1 for doc in self._docs_ahead[1]])
        self.tokens_per_step = sum(lengths)
        share, report = run_step(self.par.modules[0], docs, plan, groups, rank=self.rank,
                                 total_tokens=sum(lengths), cost=cost, device=self.device,
                                 autocast=self._autocast(), phase=self.timer.phase)  # forward, backward apart
        if self.rank == 0:
            self._record_plan(step, report, cap)
        # _reduce_loss averages over the dp x cp ranks; the shares add up to the mean
        return (share * self.dims.world_size).double().reshape(1)

    def _record_plan(self, step: int, report, cap: int) -> None:
        from engine.parallel.flexsp import SOLVERS

        e, plan = self.emit, report.plan
        for name, value in (("solve(s)", plan.solve_s), ("solve_exposed(s)", plan.exposed_s),
                            ("milp_vars", plan.milp_size[0]), ("predicted(s)", max(report.predicted_group_s)),
                            ("measured(s)", max(report.measured_group_s)), ("groups", len(report.group_ranks)),
                            ("max_tokens_per_rank", report.max_tokens_per_rank), ("token_cap", cap),
                            ("solver", SOLVERS.index(plan.solver))):
            e(step, "flexsp", name, float(value))
        order = sorted(range(len(plan.sizes)), key=lambda j: -plan.sizes[j])
        for j, (ranks, pred, meas) in enumerate(zip(report.group_ranks, report.predicted_group_s,
                                                    report.measured_group_s)):
            members = plan.members[order[j]]
            for name, value in (("size", len(ranks)), ("first_rank", ranks[0]), ("sequences", len(members)),
                                ("tokens", sum(report.lengths[i] for i in members)),
                                ("predicted(s)", pred), ("measured(s)", meas)):
                e(step, "flexsp_group", f"g{j}_{name}", float(value))

    def _reduce_loss(self, local: torch.Tensor) -> Callable[[], float]:
        """Launch the global-batch loss reduction (mean over dp of the last pipeline stage's loss)
        without waiting; the returned function waits and gives the Python float.

        `local` is a float64 tensor of shape (1,) on `self.device`, the device of the mesh groups.
        """
        if not dist.is_initialized() or self.dims.world_size == 1:
            return lambda: local.item()
        work = None
        if self.dims.pp > 1:
            src_is_last = self.par.pipeline.is_last  # V schedules: the last stage is on pp rank 0
            local = local if src_is_last else torch.zeros_like(local)
            work = dist.all_reduce(local, group=self.mesh["pp"].get_group(), async_op=True)
        replicas = self.dims.dp * self.dims.cp  # cp ranks hold equal chunks: their mean is the batch's
        if replicas > 1:
            if work is not None:
                work.wait()  # on NCCL a stream wait, not a host one
            axis = "dp_cp" if self.dims.cp > 1 else "dp"
            work = dist.all_reduce(local, group=self.mesh[axis].get_group(), async_op=True)

        def result() -> float:
            if work is not None:
                work.wait()
            return local.item() / replicas if replicas > 1 else local.item()

        return result

    def _sync_loss(self, local: float | torch.Tensor) -> float:
        """The global-batch loss of a local loss (Python float or device tensor), waited for."""
        t = torch.as_tensor(local, dtype=torch.float64, device=self.device).reshape(1)
        return self._reduce_loss(t)()

    def train_step(self, step: int) -> StepMetrics:
        par, c = self.par, self.cfg
        par.train(True)
        peak = None
        if step == self.start_step and self.cfg.profile.enabled:  # set up before the step's clocks start
            from engine.memory import ModelStatePeak

            peak = ModelStatePeak(par.modules).start()  # peak params + grads during backward
        t0 = time.perf_counter()
        self.timer.start_step()
        lr = lr_at(step, c)
        for group in par.optimizer.param_groups:
            group["lr"] = lr
        if self.flexsp is not None:
            local = self._adaptive_step(step)
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
            grad_norm = self._clip()
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
        """Measured model-state bytes of this rank next to the analytic estimate (GiB); `peak`
        (ModelStatePeak) gives params and grads at their peak during backward."""
        from engine.memory import estimate_memory, measure_model_state

        measured: dict[str, float] = {}
        for i, module in enumerate(self.par.modules):
            for key, value in measure_model_state(module, self.par.optimizer if i == 0 else None).items():
                measured[key] = measured.get(key, 0.0) + value
        measured.update(peak or {})
        estimate = {} if self.user_dataset is not None else estimate_memory(self.cfg, pp_rank=self.coords["pp"])
        for key, value in measured.items():
            self.emit(step, "memory", f"{key}(GiB)", value / 2**30)
        for key, value in estimate.items():
            self.emit(step, "memory", f"estimate_{key}(GiB)", value / 2**30)

    def _clip(self) -> float:
        from engine.parallel.data import clip_grad_norm

        max_norm = self.cfg.train.grad_clip
        pipe = self.par.pipeline
        pp_group = self.mesh["pp"].get_group() if pipe is not None else None
        # the last stage's head is a copy of the first stage's tok_emb (on one rank under V schedules)
        tied_copy = [_unwrap(m).head.weight for m in pipe.modules if _unwrap(m).head is not None
                     and _unwrap(m).tok_emb is None and getattr(_unwrap(m), "tied", True)] if pipe is not None else []
        ep = self.par.experts  # expert-parallel experts differ per ep rank: their squares sum over ep
        norm = clip_grad_norm(list(self.par.parameters()), max_norm, pp_group=pp_group, not_in_norm=tied_copy,
                              sharded=ep.expert_params if ep else (), shard_group=ep.ep_group if ep else None)
        return float(norm)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean val loss over fixed validation batches (all ranks take part)."""
        c, par = self.cfg, self.par
        par.train(False)
        batches = self._val_batches()
        total = 0.0
        for x, y, *packed in batches:
            x, y = self._cp_shard(x, y, *packed)
            x, y = x.to(self.device), y.to(self.device)
            with self._autocast():
                total += self._eval_batch(x, y)
        return self._sync_loss(total / len(batches))

    def _val_batches(self) -> list[tuple[torch.Tensor, ...]]:
        """This rank's slices of the fixed validation batches (with positions and document ids when packed)."""
        c = self.cfg
        if self.val_stream is None:
            return val_batches(self.splits.val, global_batch=c.batch.global_, n=c.train.eval_batches,
                               dp=self.dims.dp, dp_rank=self.coords["dp"])
        from engine.data_sources import rank_rows, val_rows

        out = [rank_rows(b, dp=self.dims.dp, dp_rank=self.coords["dp"])
               for b in val_rows(self.val_stream, rows=c.batch.global_, n=c.train.eval_batches)]
        return [(b.x, b.y, b.positions, b.doc_ids) if c.data.pack else (b.x, b.y) for b in out]

    def _eval_batch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        pipe, micro = self.par.pipeline, self.cfg.batch.micro
        if pipe is not None:
            loss = pipe.evaluate(x if pipe.is_first else None, y if pipe.is_last else None)
            return float(loss) if loss is not None else 0.0
        chunks = range(0, x.shape[0], micro)
        kw = self._fwd_kw
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
                self.flexsp[2].close()  # the plan thread (rank 0) solving a step that will not run

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
                ckpt.save(self.rank_state(), step + 1, self._checkpoint_dir())
            yield m

    def _checkpoint_dir(self) -> Path:
        return ckpt.checkpoint_folder(self.cfg, self.run_dir)

    def _record(self, m: StepMetrics) -> None:
        e, s = self.emit, m.step
        e(s, "step", "loss", m.loss)
        e(s, "step", "step_time(s)", m.step_time_s)
        e(s, "step", "wall_time(s)", m.wall_s)
        e(s, "step", "tokens_per_s", m.tokens_per_s)
        e(s, "step", "lr", m.lr)
        e(s, "step", "grad_norm", m.grad_norm)
        if m.mfu is not None:
            e(s, "step", "mfu", m.mfu)
        if m.val_loss is not None:
            e(s, "eval", "val_loss", m.val_loss)
        for phase, seconds in m.breakdown.items():
            e(s, "breakdown", f"{phase}(s)", seconds)
        if self.comm is not None:
            self.comm.record(s, e)
        if self.collectives.enabled:
            events, self._step_events = self._step_events + self.collectives.drain(), []
            for name, value in self.collectives.step_metrics(events).items():
                if name not in ("wire_bytes", "dense_bytes"):  # the CommMonitor's, per step
                    e(s, "comm", name, value)
            if self.comm is None:  # no DDP gradient hook (TP, FSDP2, pipeline): nothing compressed
                from profilers.collectives import sent_bytes

                # bytes sent (bus factors), the unit of the compressors' wire bytes; not nccl-tests sizes
                sent = float(sum(sent_bytes(ev) for ev in events if ev["op"] != "ddp_bucket"))
                e(s, "comm", "wire_bytes", sent)
                e(s, "comm", "dense_bytes", sent)
        if self.cfg.model.experts > 0:  # tokens this rank routed to each expert, and the drop rate
            from engine.moe import step_stats

            for name, value in step_stats(self.par.modules).items():
                e(s, "moe", name, value)
        if self.cfg.profile.enabled:
            from profilers.memory import peak_memory

            for name, value in peak_memory(self.device).items():
                e(s, "memory", name, value)

    _docs_ahead: tuple[int, list[torch.Tensor]] | None = None  # FlexSP: (step, documents) drawn a step early

    def apply_knobs(self, knobs: dict[str, Any], step: int = -1) -> None:
        """Change knobs that need no restart, at the boundary before `step`, on every rank alike
        (engine/live.py's KnobChannel calls this); each knob is recorded at `step`."""
        self.cfg = apply_live_knobs(knobs, start=self.live_start_cfg, now=self.cfg, comm=self.comm, co2=self.co2)
        for name, value in knobs.items():
            self.emit(step, "knob", name, float(value))


def _moe_aux_loss(modules) -> torch.Tensor | float:
    from engine.moe import take_aux_loss

    total = 0.0
    for module in modules:
        aux = take_aux_loss(module)
        if aux is not None:
            total = total + aux
    return total


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


def _unwrap(module):
    """The GPT chunk inside a wrapper (FSDP2 modifies in place; DDP keeps it as .module)."""
    return getattr(module, "module", module)


def _expose_blocking_comm(breakdown: dict[str, float], events: list[dict[str, Any]]) -> None:
    """Move the time of functional collectives (tensor/sequence parallel) out of forward and
    backward into comm_exposed: DTensor waits for each before computing on, so it is exposed.
    Under a pipeline schedule forward and backward interleave, so TP time stays in compute there."""
    from profilers.collectives import blocking_time

    for phase in ("forward", "backward"):
        seconds = min(blocking_time(events, phase), breakdown.get(phase, 0.0))
        if seconds > 0:
            breakdown[phase] -= seconds
            breakdown["comm_exposed"] = breakdown.get("comm_exposed", 0.0) + seconds


class _NoMesh:
    """Stands in for a DeviceMesh in a single-process run (every group is None)."""

    def __getitem__(self, axis: str):
        raise RuntimeError(f"no process group for mesh axis {axis!r} in a single-process run")
