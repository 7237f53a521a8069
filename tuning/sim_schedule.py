"""Price a pipeline schedule by walking its action list (engine/parallel/schedules.py).

`walk(actions, stage_rank=..., cost=...)` places every compute action of every rank at the
earliest time its rank is free and its inputs are ready: a forward after the forward of the
previous stage on the micro-batch's path, a full or input backward after its own forward and the
backward of the next stage on the path, a weight backward after its input backward; a dependency
on another rank adds `p2p_s`. The result holds each action's start and end, so the bubble of
every rank is read off the timeline, never derived by formula. `bubble_ratio(schedule, pp, m, v)`
prices with unit costs (forward 1, full backward 2, input and weight backward 1 each) and is
cached per (schedule, pp, m, v) for the search.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import numpy as np
from torch.distributed.pipelining.schedules import _Action

from engine.parallel.schedules import chunks_per_rank, compute_actions, schedule_actions, stage_to_rank

STEADY_MB = 2  # micro-batches per pp rank walked in full by `bubble_ratio`
MAX_WALK_PP = 4  # larger pipelines are priced from a walk on this many ranks (see bubble_ratio)
UNIT_COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class Timeline:
    """Every rank's executed actions as (action string, start, end), in rank order."""

    rows: dict[int, list[tuple[str, float, float]]]

    @property
    def makespan(self) -> float:
        return max((row[-1][2] for row in self.rows.values() if row), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(end - start for _, start, end in self.rows[rank])

    def bubble_fraction(self, rank: int) -> float:
        """Idle share of the step on `rank`: 1 - busy / makespan."""
        span = self.makespan
        return 1.0 - self.busy(rank) / span if span > 0 else 0.0

    def bubble_ratio(self) -> float:
        """Step time over the busiest rank's compute, minus 1 (the simulator's bubble / ideal)."""
        busiest = max(self.busy(r) for r in self.rows)
        return self.makespan / busiest - 1.0 if busiest > 0 else 0.0


def walk(actions: dict[int, list[_Action]], *, stage_rank: dict[int, int],
         cost: Callable[[_Action], float] | None = None, p2p_s: float = 0.0,
         paths: dict[int, list[int]] | None = None) -> Timeline:
    """The timeline of `actions` run in order per rank (see the module docstring).

    `paths[mb]` is the stages micro-batch mb visits in order (SkipPipe); default every stage.
    Raises RuntimeError when the lists deadlock (an action waits on one that never runs).
    """
    cost = cost or (lambda a: UNIT_COST[a.computation_type.value])
    num_stages = len(stage_rank)
    hop = _hops(paths, num_stages)
    flat = {r: [a for outer in order for a in compute_actions(outer)] for r, order in actions.items()}
    done: dict[tuple[int, str, int], float] = {}
    free = dict.fromkeys(flat, 0.0)
    pos = dict.fromkeys(flat, 0)
    rows: dict[int, list[tuple[str, float, float]]] = {r: [] for r in flat}
    remaining = sum(len(v) for v in flat.values())
    while remaining:
        progressed = False
        for rank, order in flat.items():
            while pos[rank] < len(order):
                action = order[pos[rank]]
                ready = _ready_time(action, done, hop, stage_rank, p2p_s)
                if ready is None:
                    break
                start = max(free[rank], ready)
                end = start + cost(action)
                done[(action.stage_index, action.computation_type.value, action.microbatch_index)] = end
                rows[rank].append((str(action), start, end))
                free[rank], pos[rank] = end, pos[rank] + 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(o[pos[r]]) for r, o in flat.items() if pos[r] < len(o)}
            raise RuntimeError(f"schedule deadlocks: next actions {stuck}")
    return Timeline(rows)


def _hops(paths: dict[int, list[int]] | None, num_stages: int) -> Callable[[int, int, int], int | None]:
    """hop(stage, mb, +1/-1): the next / previous stage on the micro-batch's path (None at an end)."""
    if paths is None:
        return lambda s, mb, d: s + d if 0 <= s + d < num_stages else None
    index = {mb: {s: i for i, s in enumerate(path)} for mb, path in paths.items()}

    def hop(s: int, mb: int, d: int) -> int | None:
        i = index[mb][s] + d
        return paths[mb][i] if 0 <= i < len(paths[mb]) else None

    return hop


def _ready_time(action: _Action, done: dict, hop: Callable, stage_rank: dict[int, int], p2p_s: float) -> float | None:
    """When the inputs of `action` are ready; None while one of them has not run."""
    s, kind, mb = action.stage_index, action.computation_type.value, action.microbatch_index
    if kind == "W":
        needs = [(s, ("I",))]
    elif kind == "F":
        prev = hop(s, mb, -1)
        needs = [(prev, ("F",))] if prev is not None else []
    else:  # B or I: own forward, and the gradient from the next stage (its B or I)
        nxt = hop(s, mb, +1)
        needs = [(s, ("F",))] + ([(nxt, ("B", "I"))] if nxt is not None else [])
    ready = 0.0
    for stage, kinds in needs:
        ends = [done[(stage, k, mb)] for k in kinds if (stage, k, mb) in done]
        if not ends:
            return None
        ready = max(ready, min(ends) + (p2p_s if stage_rank[stage] != stage_rank[s] else 0.0))
    return ready


def schedule_bubble(codes: Any, pp: Any, m: Any, virtual: Any, layers: int, skip_ratio: Any = 0.0) -> np.ndarray:
    """`bubble_ratio` for arrays of configurations (schedule codes index tuning.simulator.SCHEDULES),
    walked once per distinct (schedule, pp, m, v, skip_ratio)."""
    from tuning.simulator import SCHEDULES

    cols = np.broadcast_arrays(np.asarray(codes), np.asarray(pp), np.asarray(m), np.asarray(virtual),
                               np.asarray(skip_ratio, dtype=float))
    ints = [np.ravel(a).astype(np.int64) for a in cols[:4]]
    ratio = np.round(np.ravel(cols[4]) * 1000).astype(np.int64)
    # one int64 key per row (schedule, pp, m, v, skip ratio in 1/1000): a 1-D unique is fast
    key = (((ints[0] * 2**12 + ints[1]) * 2**20 + ints[2]) * 2**12 + ints[3]) * 2**10 + ratio
    unique, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    values = np.array([bubble_ratio(SCHEDULES[int(ints[0][i])], int(ints[1][i]), max(int(ints[2][i]), 1),
                                    max(int(ints[3][i]), 1),
                                    layers if int(ints[0][i]) == SCHEDULES.index("modular") else None,
                                    float(ratio[i]) / 1000) for i in first])
    return values[np.ravel(inverse)].reshape(cols[0].shape)


@lru_cache(maxsize=4096)
def bubble_ratio(schedule: str, pp: int, m: int, virtual: int = 1, layers: int | None = None,
                 skip_ratio: float = 0.0) -> float:
    """Bubble / ideal compute of `schedule` from its action list with unit costs (cached)."""
    if pp <= 1:
        return 0.0
    if schedule == "skip":
        from engine.parallel.skippipe import skip_actions, skip_paths

        paths = skip_paths(pp=pp, n_microbatches=m, skip_ratio=skip_ratio)
        return walk(skip_actions(paths, pp=pp), stage_rank={s: s for s in range(pp)}, paths=paths).bubble_ratio()
    if pp > MAX_WALK_PP:
        # ours, for search speed: walk the same schedule on MAX_WALK_PP ranks with as many
        # micro-batches per rank, and scale its idle time with the fill/drain length (pp - 1);
        # exact for gpipe / 1f1b ((p-1)/m) and interleaved ((p-1)/(v m))
        per_rank = max(1, min(m // pp, STEADY_MB))
        small_layers = layers // pp * MAX_WALK_PP if schedule == "modular" and layers else None
        small = bubble_ratio(schedule, MAX_WALK_PP, per_rank * MAX_WALK_PP, virtual, small_layers, skip_ratio)
        return small * (pp - 1) / (MAX_WALK_PP - 1) * (per_rank * MAX_WALK_PP) / m
    if m > STEADY_MB * pp and schedule not in ("dualpipev",):
        # ours: past STEADY_MB*pp micro-batches the walk's idle time no longer grows (fill and
        # drain only), so it is walked once at that length and spread over the m micro-batches
        m0 = STEADY_MB * pp
        return bubble_ratio(schedule, pp, m0, virtual, layers) * m0 / m
    v = chunks_per_rank(schedule, virtual, layers=layers, pp=pp)
    actions = schedule_actions(schedule=schedule, pp=pp, n_microbatches=m, virtual=virtual, layers=layers)
    return walk(actions, stage_rank=stage_to_rank(schedule, pp, pp * v)).bubble_ratio()


# ---------------------------------------------------------------- executed schedules (runs)

def executed_steps(records: list[Any]) -> dict[int, dict[int, dict[str, Any]]]:
    """Records of kind "schedule" / "skip_path" (engine/train.py `emit_schedule`) as
    {step: {rank: {"actions": [(action, start, end)], "total_s", "wall_start", "paths"}}}."""
    out: dict[int, dict[int, dict[str, Any]]] = {}
    spans: dict[tuple[int, int, str], list[float]] = {}
    for rec in records:
        row = out.setdefault(rec.step, {}).setdefault(rec.rank, {"actions": [], "total_s": 0.0, "wall_start": 0.0,
                                                                  "paths": {}})
        if rec.kind == "skip_path":
            row["paths"][int(rec.name[2:])] = [s for s in range(64) if int(rec.value) >> s & 1]
        elif rec.name == "@total":
            row["total_s"] = rec.value
        elif rec.name == "@wall_start":
            row["wall_start"] = rec.value
        else:
            action, edge = rec.name.rsplit("@", 1)
            spans.setdefault((rec.step, rec.rank, action), [0.0, 0.0])[edge == "end"] = rec.value
    for (step, rank, action), (start, end) in spans.items():
        out[step][rank]["actions"].append((action, start, end))
    for ranks in out.values():
        for row in ranks.values():
            row["actions"].sort(key=lambda a: a[1])
    return out


def measured_bubble(step: dict[int, dict[str, Any]]) -> dict[int, float]:
    """Per rank: idle share of its step, 1 - (its compute actions' time) / (its step time)."""
    return {rank: 1.0 - sum(e - s for _, s, e in row["actions"]) / row["total_s"] if row["total_s"] > 0 else 0.0
            for rank, row in step.items()}


def predicted_timeline(step: dict[int, dict[str, Any]], *, schedule: str, pp: int, n_microbatches: int,
                       virtual: int = 1, layers: int | None = None, p2p_s: float = 0.0) -> Timeline:
    """The walk of the schedule's planned action list (SkipPipe: the step's recorded paths),
    each action costing the mean measured duration of its (stage, kind) in `step` plus the
    median gap between a rank's consecutive actions (host overhead of the runtime)."""
    from engine.parallel.skippipe import skip_actions

    paths = next((row["paths"] for row in step.values() if row["paths"]), None)
    if schedule == "skip":
        actions, stage_rank = skip_actions(paths, pp=pp), {s: s for s in range(pp)}
    else:
        v = chunks_per_rank(schedule, virtual, layers=layers, pp=pp)
        actions = schedule_actions(schedule=schedule, pp=pp, n_microbatches=n_microbatches, virtual=virtual,
                                   layers=layers)
        stage_rank = stage_to_rank(schedule, pp, pp * v)
    durations: dict[tuple[int, str], list[float]] = {}
    for row in step.values():
        for name, start, end in row["actions"]:
            a = _Action.from_str(name)
            durations.setdefault((a.stage_index, a.computation_type.value), []).append(end - start)
    mean = {k: sum(v) / len(v) for k, v in durations.items()}
    fallback = sum(mean.values()) / len(mean) if mean else 1.0
    # the runtime's own host work between two actions of a rank (posting sends/recvs, the loss):
    # the median gap between consecutive actions, charged to every action
    gaps = sorted(b[1] - a[2] for row in step.values() for a, b in zip(row["actions"], row["actions"][1:]))
    overhead = max(gaps[len(gaps) // 2], 0.0) if gaps else 0.0

    def cost(a: _Action) -> float:
        return mean.get((a.stage_index, a.computation_type.value), fallback) + overhead

    return walk(actions, stage_rank=stage_rank, cost=cost, p2p_s=p2p_s, paths=paths if schedule == "skip" else None)


def peak_in_flight(actions: list[tuple[str, float, float]]) -> int:
    """Most (stage, micro-batch) activations one rank held at once: forwards run, backward not yet."""
    held, peak = set(), 0
    for name, _, _ in actions:
        a = _Action.from_str(name)
        key = (a.stage_index, a.microbatch_index)
        if a.computation_type.value == "F":
            held.add(key)
            peak = max(peak, len(held))
        elif a.computation_type.value in ("B", "I"):
            held.discard(key)
    return peak
