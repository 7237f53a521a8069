"""Adaptive sequence parallelism (FlexSP) at run time: calibrate the cost model, then each step
split the ranks into the plan's groups and run every group's sequences with Ulysses over it.

The solver is engine/parallel/flexsp.py (pure). Here: process groups (one `new_group` per group
of each size pattern, cached), the calibration of attention/linear and all-to-all time on this
machine, planning one step ahead (`PlanAhead`), and one step: rank 0's plan is broadcast, each group packs its sequences into
one row (document ids keep them apart, positions restart), shards it over its ranks and runs
forward and backward; gradients are summed over all ranks (every rank holds the whole model).
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from engine.data.lengths import IGNORE
from engine.model.gpt import GPT, causal_attention
from engine.parallel.context import shard_sequence, ulysses_attention
from engine.parallel.flexsp import CostModel, Plan, powers_of_two, solve


def group_layout(sizes: list[int]) -> list[list[int]]:
    """Global ranks of each group: largest first, contiguous (aligned, since sizes are powers of two)."""
    out, at = [], 0
    for g in sorted(sizes, reverse=True):
        out.append(list(range(at, at + g)))
        at += g
    return out


class GroupCache:
    """The process groups of every size pattern used so far (created once, on every rank, in order)."""

    def __init__(self, timeout_s: float, *, on_group: Callable[[dist.ProcessGroup], None] | None = None) -> None:
        import datetime

        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self.on_group = on_group  # hears each new group (the trainer labels its collectives "sp")

    def get(self, ranks: list[int]) -> dist.ProcessGroup | None:
        key = tuple(ranks)
        if key not in self.groups:  # every rank reaches here with the same plan, so calls match
            self.groups[key] = None if len(ranks) == 1 else dist.new_group(ranks, timeout=self.timeout)
            if self.on_group is not None and len(ranks) > 1 and dist.get_rank() in ranks:  # a member's group
                self.on_group(self.groups[key])
        return self.groups[key]

    def pattern(self, sizes: list[int]) -> list[tuple[list[int], dist.ProcessGroup | None]]:
        return [(ranks, self.get(ranks)) for ranks in group_layout(sizes)]


@dataclass(slots=True)
class StepReport:
    """One adaptive step as data: the plan, the predicted and measured times, tokens per rank."""

    plan: Plan
    lengths: list[int]
    group_ranks: list[list[int]]
    predicted_group_s: list[float]
    measured_group_s: list[float]
    max_tokens_per_rank: int


def _set_core(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    core = causal_attention if group is None else functools.partial(ulysses_attention, group=group)
    for module in model.modules():
        if hasattr(module, "core") and hasattr(module, "head_dim"):
            module.core = core


def _pack_row(docs: list[torch.Tensor], multiple: int) -> tuple[torch.Tensor, ...]:
    """One row of the group's documents padded to a multiple of the group size: x, y, positions, doc ids."""
    n = sum(d.numel() - 1 for d in docs)
    width = -(-n // multiple) * multiple
    x, y = torch.zeros(1, width, dtype=torch.long), torch.full((1, width), IGNORE, dtype=torch.long)
    pos, ids = torch.zeros(1, width, dtype=torch.long), torch.full((1, width), -1, dtype=torch.long)
    at = 0
    for j, d in enumerate(docs):
        k = d.numel() - 1
        x[0, at:at + k], y[0, at:at + k], pos[0, at:at + k], ids[0, at:at + k] = d[:-1], d[1:], torch.arange(k), j
        at += k
    return x, y, pos, ids


def broadcast_plan(plan: Plan | None, group=None) -> Plan:
    """Rank 0's plan on every rank (HiGHS under a time limit need not give every rank the same)."""
    from engine.device import host_group

    box = [plan]
    dist.broadcast_object_list(box, src=0, group=group or host_group())
    return box[0]


def run_step(model: GPT, docs: list[torch.Tensor], plan: Plan, groups: GroupCache, *, rank: int,
             total_tokens: int, cost: CostModel, device: torch.device,
             autocast=None, phase: Callable[[str], Any] | None = None) -> tuple[torch.Tensor, StepReport]:
    """Forward and backward of this rank's share of the step under `plan`; returns the rank's
    loss share (its token-loss sum / the step's real tokens: the shares add up to the mean) and
    the step report (measured times gathered from every rank). `phase(name)` (the trainer's
    StepTimer.phase) times the forward and the backward apart."""
    import contextlib

    phase = phase or (lambda name: contextlib.nullcontext())

    lengths = [d.numel() - 1 for d in docs]
    order = sorted(range(len(plan.sizes)), key=lambda j: -plan.sizes[j])  # as group_layout lays them
    layout = groups.pattern(plan.sizes)
    mine = next(i for i, (ranks, _) in enumerate(layout) if rank in ranks)
    ranks, group = layout[mine]
    members = plan.members[order[mine]]
    g = len(ranks)
    x, y, pos, ids = _pack_row([docs[i] for i in members], g)
    me = ranks.index(rank)
    _set_core(model, group)
    t0 = time.perf_counter()
    with phase("forward"), autocast or contextlib.nullcontext():
        logits = model(shard_sequence(x, cp=g, cp_rank=me).to(device),
                       positions=shard_sequence(pos, cp=g, cp_rank=me).to(device), doc_ids=ids.to(device))
        target = shard_sequence(y, cp=g, cp_rank=me).to(device)
        loss = _cross_entropy(logits, target) / total_tokens
    with phase("backward"):
        loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    times = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    from engine.device import host_group

    dist.all_gather(times, elapsed, group=host_group())  # host floats: the host group (gloo)
    measured = [max(times[r].item() for r in rs) for rs, _ in layout]
    predicted = [cost.group_time([lengths[i] for i in plan.members[order[j]]], len(rs))
                 for j, (rs, _) in enumerate(layout)]
    per_rank = max(-(-sum(lengths[i] for i in plan.members[order[j]]) // len(rs)) for j, (rs, _) in enumerate(layout))
    report = StepReport(plan, lengths, [rs for rs, _ in layout], predicted, measured, per_rank)
    return loss.detach(), report


def sum_gradients(model: nn.Module, group=None) -> None:
    """Sum the gradients over all ranks (each rank's loss is its share of the step's mean)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([gr.reshape(-1) for gr in grads])
    dist.all_reduce(flat, group=group)
    at = 0
    for gr in grads:
        gr.copy_(flat[at:at + gr.numel()].view_as(gr))
        at += gr.numel()


# ---------------------------------------------------------------- calibration

def _time(fn, repeats: int = 3) -> float:
    """Least seconds of `fn` over `repeats` calls, all ranks starting together."""
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def calibrate(model: GPT, *, world: int, groups: GroupCache, seq_len: int, device: torch.device,
              rounds: int = 5) -> CostModel:
    """Fit (a1 s^2 + a2 s + bias) to one rank's forward+backward of one sequence at four lengths
    (non-negative least squares), then what packing adds (`fit_packing`): a per-sequence constant and a
    per-token cost, from two packed rows of 16 documents, seq_len and 2 seq_len tokens (the steps pack
    rows of up to the token cap, about twice the mean tokens per rank), then each group size g's
    sequence-parallel overhead: the same
    forward+backward of a sequence sharded over every group of g ranks at once (Ulysses) at two
    lengths, minus 1/g of the single-rank model, split into a per-token all-to-all cost and a
    constant per group (`fit_group_overhead`). That overhead is the all-to-all as it really costs
    here, latency and waits for the slowest group member included. All ranks measure at once (as
    they run), `rounds` times (medians); rank 0's numbers go to every rank."""
    from scipy.optimize import nnls

    lengths = sorted({max(2, seq_len // 8), max(2, seq_len // 4), max(2, seq_len // 2), seq_len})
    full = torch.randint(0, model.cfg.vocab, (1, seq_len + 1), device=device)  # + the last target
    sizes, two = calibration_lengths(world=world, seq_len=seq_len, heads=model.cfg.heads)
    single: dict[int, list[float]] = {s: [] for s in lengths}
    grouped: dict[tuple[int, int], list[float]] = {(g, s): [] for g in sizes for s in two[g]}
    docs = max(2, min(16, seq_len // 2))  # packed rows of short documents, as the steps run them
    rows = {tokens: _packed_row(tokens, docs, model.cfg.vocab, device) for tokens in (seq_len, 2 * seq_len)}
    packed: dict[int, list[float]] = {tokens: [] for tokens in rows}
    for _ in range(rounds):  # rounds interleave every measurement: a load change on a shared machine hits all alike
        _set_core(model, None)
        for s in lengths:
            single[s].append(_time(lambda: _loss(model, full[:, :s + 1]).backward(), repeats=1))
        for g in sizes:
            ranks, group = next((r, grp) for r, grp in groups.pattern([g] * (world // g)) if dist.get_rank() in r)
            _set_core(model, group)
            me = ranks.index(dist.get_rank())
            for s in two[g]:
                local = shard_sequence(full[:, :s], cp=g, cp_rank=me)
                target = shard_sequence(full[:, 1:s + 1], cp=g, cp_rank=me)
                pos = shard_sequence(torch.arange(s, device=device), cp=g, cp_rank=me, dim=0)
                grouped[g, s].append(_time(lambda: _cross_entropy(model(local, positions=pos), target).backward(),
                                           repeats=1))
        _set_core(model, None)  # documents packed in one row: what packing adds per document and per token
        for tokens, (row, pos, ids) in rows.items():
            packed[tokens].append(_time(lambda: _loss(model, row, positions=pos, doc_ids=ids).backward(), repeats=1))
    # the median, not the least: on a shared machine the steps pay the load too, and the least of a
    # few samples is mostly luck
    single = {s: float(np.median(v)) for s, v in single.items()}
    grouped = {k: float(np.median(v)) for k, v in grouped.items()}
    (a1, a2, bias), _ = nnls(np.array([[s * s, s, 1.0] for s in lengths]), np.array([single[s] for s in lengths]))
    base = CostModel(a1=float(a1), a2=float(a2), bias=float(bias))  # one unpacked sequence: no per_seq
    pack_a2, per_seq = fit_packing(base, {(tokens, docs): float(np.median(v)) for tokens, v in packed.items()})
    a2a, group_bias = {}, {}
    for g in sizes:
        a2a[g], group_bias[g] = fit_group_overhead(base, g, {s: grouped[g, s] for s in two[g]})
    _set_core(model, None)
    model.zero_grad(set_to_none=True)
    box = [CostModel(a1=base.a1, a2=base.a2, a2a=a2a, bias=base.bias, group_bias=group_bias, per_seq=per_seq,
                     pack_a2=pack_a2,
                     sizes=(1, *sizes))]
    from engine.device import host_group

    dist.broadcast_object_list(box, src=0, group=host_group())  # one cost model everywhere: plans must agree
    return box[0]


def calibration_lengths(*, world: int, seq_len: int, heads: int) -> tuple[list[int], dict[int, tuple[int, int]]]:
    """The group sizes > 1 that calibration measures and, per size g, its two sequence lengths: about
    seq_len / 2 and seq_len rounded down to multiples of g (Ulysses splits a sequence into g equal
    chunks). A size with fewer than two such lengths, or that does not divide `heads`, is left out,
    and the cost model then refuses it (plans never use it) rather than price it as free."""
    sizes, two = [], {}
    for g in powers_of_two(world)[1:]:
        short, full = seq_len // 2 // g * g, seq_len // g * g
        if heads % g == 0 and 0 < short < full:
            sizes.append(g)
            two[g] = (short, full)
    return sizes, two


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The steps' loss (run_step): summed token cross-entropy."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                             reduction="sum")


def _loss(model: GPT, tokens: torch.Tensor, **kw) -> torch.Tensor:
    """The steps' loss of tokens[:, :-1] predicting tokens[:, 1:]."""
    return _cross_entropy(model(tokens[:, :-1], **kw), tokens[:, 1:])


def _packed_row(tokens: int, docs: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A row of `tokens` (+1 for the targets) cut into `docs` equal documents: ids, positions, doc ids."""
    length = tokens // docs
    ids = (torch.arange(tokens, device=device) // length).clamp(max=docs - 1)
    pos = torch.arange(tokens, device=device) - ids * length
    return torch.randint(0, vocab, (1, tokens + 1), device=device), pos[None], ids[None]


def fit_packing(base: CostModel, measured: dict[tuple[int, int], float]) -> tuple[float, float]:
    """(seconds per token, seconds per document) that packing documents into one row adds to the
    lone-sequence model `base`, from two packed rows {(tokens, documents): seconds} of equal document
    counts: the excess over `base` is documents * per_seq + tokens * pack_a2; both clamped at 0."""
    (row1, t1), (row2, t2) = sorted(measured.items())
    (n1, d1), (n2, d2) = row1, row2
    e1, e2 = (t - base.group_time([n // d] * d, 1) for (n, d), t in ((row1, t1), (row2, t2)))
    pack_a2 = max(0.0, (e2 - e1) / (n2 - n1))
    return pack_a2, max(0.0, (e1 - n1 * pack_a2) / d1)


def fit_group_overhead(base: CostModel, g: int, measured: dict[int, float]) -> tuple[float, float]:
    """(all-to-all seconds per token, constant seconds per group) of groups of g ranks from their
    measured time at two lengths: the excess over the single-rank model (compute / g + bias) is a
    line in the group's tokens per rank; both parts clamped at 0 (noise can tilt the line)."""
    (s1, t1), (s2, t2) = sorted(measured.items())
    r1, r2 = (t - base.group_time([s], g) for s, t in ((s1, t1), (s2, t2)))
    slope = max(0.0, (r2 - r1) / ((s2 - s1) / g))  # seconds per token of the rank's share
    const = max(0.0, (r1 + r2) / 2 - slope * (s1 + s2) / (2 * g))
    return slope, const


class PlanAhead:
    """Plans solved one step ahead, as FlexSP overlaps planning with training: rank 0 solves step
    t+1's plan in a background thread while step t runs (a step's documents are known before it
    runs), and step t+1 waits only for what is left of that solve (`Plan.exposed_s`). HiGHS
    releases the GIL while it searches (measured: the training thread keeps its CPU beside it), so
    the thread overlaps for real; on a machine with fewer cores than ranks it still takes CPU time
    from rank 0, which the step time shows. Without a plan submitted ahead, `take` solves in line."""

    def __init__(self, solve_fn: Callable[[list[int]], Plan], *, rank: int) -> None:
        self.solve_fn, self.rank = solve_fn, rank
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flexsp") if rank == 0 else None
        self.pending: dict[int, tuple[list[int], Future]] = {}

    def submit(self, step: int, lengths: list[int]) -> None:
        """Start solving `step`'s plan (rank 0; other ranks do nothing)."""
        if self.pool is not None and step not in self.pending:
            self.pending[step] = (list(lengths), self.pool.submit(self.solve_fn, list(lengths)))

    def wait(self, step: int) -> float:
        """Rank 0: block until `step`'s submitted solve ends; the seconds waited (0 elsewhere)."""
        if self.pool is None or step not in self.pending:
            return 0.0
        t0 = time.perf_counter()
        self.pending[step][1].exception()  # waits; errors surface in take
        return time.perf_counter() - t0

    def take(self, step: int, lengths: list[int]) -> Plan:
        """Every rank: `step`'s plan (rank 0's), `exposed_s` set to the seconds rank 0 waited for it."""
        plan = None
        if self.rank == 0:
            t0 = time.perf_counter()
            ahead, fut = self.pending.pop(step, (None, None))
            plan = fut.result() if fut is not None and ahead == list(lengths) else self.solve_fn(list(lengths))
            plan.exposed_s = time.perf_counter() - t0
        return broadcast_plan(plan)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------- a run's steps

def token_cap(lengths: list[int], *, world: int, cap: int = 0) -> int:
    """The most tokens a rank may hold in a step: `cap` (parallel.adaptive_token_cap), or twice the
    step's mean tokens per rank."""
    return cap or 2 * -(-sum(lengths) // world)


def cost_records(cost: CostModel) -> list[tuple[str, float]]:
    """The calibrated cost model as (record name, value): kind "flexsp_cost"."""
    return [("a1(s/token^2)", cost.a1), ("a2(s/token)", cost.a2), ("bias(s)", cost.bias),
            ("per_seq(s)", cost.per_seq), ("pack_a2(s/token)", cost.pack_a2),
            *((f"a2a_g{g}(s/token)", v) for g, v in cost.a2a.items()),
            *((f"bias_g{g}(s)", v) for g, v in cost.group_bias.items())]


def plan_records(report: StepReport, cap: int) -> list[tuple[str, str, float]]:
    """One step's plan as (kind, name, value): kind "flexsp" the step's, "flexsp_group" each group's
    (`g<j>_<name>`, largest group first)."""
    from engine.parallel.flexsp import SOLVERS

    plan = report.plan
    out = [("flexsp", name, float(value)) for name, value in (
        ("solve(s)", plan.solve_s), ("solve_exposed(s)", plan.exposed_s), ("milp_vars", plan.milp_size[0]),
        ("predicted(s)", max(report.predicted_group_s)), ("measured(s)", max(report.measured_group_s)),
        ("groups", len(report.group_ranks)), ("max_tokens_per_rank", report.max_tokens_per_rank),
        ("token_cap", cap), ("solver", SOLVERS.index(plan.solver)))]
    order = sorted(range(len(plan.sizes)), key=lambda j: -plan.sizes[j])
    for j, (ranks, pred, meas) in enumerate(zip(report.group_ranks, report.predicted_group_s,
                                                report.measured_group_s)):
        members = plan.members[order[j]]
        out += [("flexsp_group", f"g{j}_{name}", float(value)) for name, value in (
            ("size", len(ranks)), ("first_rank", ranks[0]), ("sequences", len(members)),
            ("tokens", sum(report.lengths[i] for i in members)), ("predicted(s)", pred), ("measured(s)", meas))]
    return out


class AdaptiveSP:
    """FlexSP over a run: the cost model calibrated once at the start, then each step runs the plan
    solved during the previous step while rank 0 starts solving the next one (`PlanAhead`).
    `documents(step)` gives a step's documents (a pure function of the step: drawn a step early)."""

    def __init__(self, model: GPT, *, documents: Callable[[int], list[torch.Tensor]], world: int, rank: int,
                 seq_len: int, device: torch.device, steps: int, timeout_s: float, max_tokens: int, buckets: int,
                 time_limit_s: float, on_group: Callable[[dist.ProcessGroup], None] | None = None) -> None:
        self.model, self.documents, self.world, self.rank, self.device = model, documents, world, rank, device
        self.steps, self.max_tokens = steps, max_tokens
        self.groups = GroupCache(timeout_s, on_group=on_group)
        self.cost = calibrate(model, world=world, groups=self.groups, seq_len=seq_len, device=device)
        self.ahead = PlanAhead(lambda lengths: solve(lengths, n=world, cap=self.cap(lengths), cost=self.cost,
                                                     buckets=buckets, time_limit_s=time_limit_s), rank=rank)
        self._docs_ahead: tuple[int, list[torch.Tensor]] | None = None  # (step, documents) drawn a step early

    def cap(self, lengths: list[int]) -> int:
        return token_cap(lengths, world=self.world, cap=self.max_tokens)

    def _docs(self, step: int) -> list[torch.Tensor]:
        if self._docs_ahead is not None and self._docs_ahead[0] == step:  # drawn last step for the plan
            return self._docs_ahead[1]
        return self.documents(step)

    def plan(self, step: int) -> tuple[list[torch.Tensor], Plan]:
        """`step`'s documents and plan (rank 0's, solved ahead); rank 0 then starts on step + 1's."""
        docs = self._docs(step)
        plan = self.ahead.take(step, [doc.numel() - 1 for doc in docs])
        if self.rank == 0 and step + 1 < self.steps:
            self._docs_ahead = (step + 1, self._docs(step + 1))
            self.ahead.submit(step + 1, [doc.numel() - 1 for doc in self._docs_ahead[1]])
        return docs, plan

    def step(self, step: int, *, autocast=None,
             phase: Callable[[str], Any] | None = None) -> tuple[torch.Tensor, int, list[tuple[str, str, float]]]:
        """Forward and backward of this rank's group in `step`: its loss share times the world (a float64
        (1,) tensor whose mean over the ranks is the step's loss), the step's tokens, and (rank 0) the
        plan's records. `phase(name)` (StepTimer.phase) times data, forward and backward apart."""
        import contextlib

        phase = phase or (lambda name: contextlib.nullcontext())
        with phase("data"):
            docs, plan = self.plan(step)
        lengths = [doc.numel() - 1 for doc in docs]
        share, report = run_step(self.model, docs, plan, self.groups, rank=self.rank, total_tokens=sum(lengths),
                                 cost=self.cost, device=self.device, autocast=autocast, phase=phase)
        records = plan_records(report, self.cap(lengths)) if self.rank == 0 else []
        return (share * self.world).double().reshape(1), sum(lengths), records

    def close(self) -> None:
        """Stop the plan thread (rank 0), which may be solving a step that will not run."""
        self.ahead.close()
