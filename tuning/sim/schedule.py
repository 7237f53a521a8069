"""Price a pipeline schedule by walking its action list (engine/parallel/schedules.py).

`walk(actions, stage_rank=..., cost=...)` places every compute action of every rank at the
earliest time its rank is free and its inputs are ready: a forward after the forward of the
previous stage on the micro-batch's path, a full or input backward after its own forward and the
backward of the next stage on the path, a weight backward after its input backward; a dependency
on another rank adds `p2p_s`, counted, when the lists carry torch's SEND / RECV actions
(`comms`, `schedules.with_comms`), from where the sender's list posts the send. `Costs`
adds the rest of what a run spends (host work before each action, per rank and kind, run while
the action's inputs are in flight, the head and tail of each rank's step, when each rank enters
it, and processor sharing when ranks outnumber cores);
`calibrate` (tuning/calibrate/schedule.py) reads those off a recorded step, so `predicted_timeline` prices
the executed schedule with what the run itself measured. The result holds each action's
start and end, so the bubble of every rank is read off the timeline, never derived by formula. `bubble_ratio(schedule, pp, m, v)`
prices with unit costs (forward 1, full backward 2, input and weight backward 1 each) and is
cached per (schedule, pp, m, v) for the search, in the process and between processes (`_kept`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from tuning.sim.spec import SCHEDULES

if TYPE_CHECKING:  # torch's pipelining costs ~4 s to import: only a walk needs it, not every simulate
    from engine.torch_compat import _Action


def _action(name: str) -> _Action:
    """torch's action from its recorded string form ("0F1")."""
    from engine.torch_compat import _Action

    return _Action.from_str(name)


STEADY_MB = 2  # micro-batches per pp rank walked in full by `bubble_ratio`
MAX_WALK_PP = 4  # larger pipelines are priced from a walk on this many ranks (see bubble_ratio)
UNIT_COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True, kw_only=True)
class Costs:
    """What the walk charges besides each compute action's own cost (all seconds).

    The runtime does host work around every compute action (posting sends and receives, the
    loss) and a transfer crosses ranks; on a CPU machine the ranks also share the cores. The
    defaults price none of it (the unit-cost search walk); `calibrate` reads them off a
    recorded step.
    """

    p2p_s: float = 0.0  # a dependency on another rank: latency + bytes / bandwidth (see `p2p_seconds`)
    overhead_s: float = 0.0  # host CPU work of the runtime before every compute action
    head_s: float = 0.0  # host CPU work from a rank's step start to its first action (input split)
    tail_s: float = 0.0  # host work after a rank's last action until its step returns (send waits, losses)
    start_s: Mapping[int, float] = field(default_factory=dict)  # when each rank enters the step (default 0)
    # processor sharing: with `cores` set, every rank doing CPU work (compute, overhead, head,
    # tail; not waiting on a receive) runs at min(1, cores / (running ranks + background)) of
    # its own speed, so 4 ranks on 2 cores take twice as long while all compute and a rank
    # waiting in recv frees its share; None: each rank has a core of its own
    cores: float | None = None
    background: float = 0.0  # other runnable threads on those cores (e.g. other jobs)
    overhead_draws: tuple[float, ...] = ()  # recorded host-work samples, drawn from by `walk(rng=...)`
    rank_overhead_s: Mapping[int, float] = field(default_factory=dict)  # per rank, in place of overhead_s
    # per action kind ("F" / "B" / "I" / "W"): the factor on its rank's host work before an action of that kind
    kind_factor: Mapping[str, float] = field(default_factory=dict)
    # True: the host work before an action runs right after the rank's previous one, while its
    # inputs are in flight, and the action starts at the later of the two (p2p_s then counts from
    # the send's posting to the action's start); False: the host work runs once the inputs are in
    host_overlaps_wait: bool = False
    p2p_draws: tuple[float, ...] = ()  # recorded input delays, drawn from by `walk(draw_p2p=...)`

    def rate(self, running: int) -> float:
        """Speed of each of `running` ranks doing CPU work at once (1: a core of its own)."""
        if self.cores is None or running == 0:
            return 1.0
        return min(1.0, self.cores / (running + self.background))


def p2p_seconds(nbytes: float, *, latency_s: float = 0.0, bytes_per_s: float = float("inf")) -> float:
    """One point-to-point transfer: latency + bytes / bandwidth (alpha-beta, engine/comm/link.py)."""
    return latency_s + nbytes / bytes_per_s


@dataclass(frozen=True)
class Timeline:
    """Every rank's executed compute actions as (action string, start, end), in rank order, and
    each rank's step window (its start, the end of its tail)."""

    rows: dict[int, list[tuple[str, float, float]]]
    windows: dict[int, tuple[float, float]] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        ends = [row[-1][2] for row in self.rows.values() if row] + [end for _, end in self.windows.values()]
        return max(ends, default=0.0)

    def busy(self, rank: int) -> float:
        return sum(end - start for _, start, end in self.rows[rank])

    def bubble_fraction(self, rank: int) -> float:
        """Idle share of `rank`'s own step (its window; the makespan without one): 1 - busy / step,
        the definition the engine measures (engine/parallel/pipeline.py `last_timing`)."""
        start, end = self.windows.get(rank, (0.0, self.makespan))
        return 1.0 - self.busy(rank) / (end - start) if end > start else 0.0

    def bubble_ratio(self) -> float:
        """Step time over the busiest rank's compute, minus 1 (the simulator's bubble / ideal)."""
        busiest = max(self.busy(r) for r in self.rows)
        return self.makespan / busiest - 1.0 if busiest > 0 else 0.0


@dataclass
class _Rank:
    """One rank's progress through its segments in the walk."""

    segments: list[tuple[str, float, _Action | None]]  # (kind: head/overhead/compute/tail, work, action)
    start: float
    index: int = 0
    left: float = 0.0  # work left in the current segment
    ready: float | None = None  # when the current segment may run (None: inputs not yet done)
    seg_start: float = 0.0


def walk(actions: dict[int, list[_Action]], *, stage_rank: dict[int, int],
         cost: Callable[[_Action], float] | None = None, p2p_s: float = 0.0,
         paths: dict[int, list[int]] | None = None, costs: Costs | None = None,
         rng: random.Random | None = None, comms: dict[int, list[_Action]] | None = None,
         draw_p2p: random.Random | None = None) -> Timeline:
    """The timeline of `actions` run in order per rank (see the module docstring).

    `paths[mb]` is the stages micro-batch mb visits in order (SkipPipe); default every stage.
    `costs` adds host overhead, p2p delay and core sharing (`p2p_s` is a shorthand for
    `Costs(p2p_s=...)`). `comms`: the same lists with the SEND / RECV actions torch's runtime runs
    (`schedules.with_comms`); an input from another rank then arrives `p2p_s` after its send is
    posted (an OVERLAP_F_B posts its sends after both halves), not after the action computing it.
    `draw_p2p`: each input's delay is one draw from `costs.p2p_draws` instead. With
    `costs.host_overlaps_wait` the host work before an action starts when the rank's previous
    segment ends and the action when both that and its inputs are done; without, the host work
    starts once the inputs are in. An event-driven walk: time advances to the next segment end or
    input arrival, and every rank doing CPU work progresses at `costs.rate(running)`.
    Raises RuntimeError when the lists deadlock (an action waits on one that never runs).
    """
    cost = cost or (lambda a: UNIT_COST[a.computation_type.value])
    costs = costs or Costs(p2p_s=p2p_s)
    hop = _hops(paths, len(stage_rank))

    def overhead(rank: int) -> Callable[[_Action], float]:
        if rng and costs.overhead_draws:
            return lambda a: rng.choice(costs.overhead_draws)
        mean = costs.rank_overhead_s.get(rank, costs.overhead_s)
        return lambda a: mean * costs.kind_factor.get(a.computation_type.value, 1.0)

    ranks = {r: _Rank(_segments((comms or actions)[r], cost, overhead(r), costs), costs.start_s.get(r, 0.0))
             for r in actions}
    done: dict[tuple[int, str, int], float] = {}
    sent: dict[tuple[str, int, int], float] | None = {} if comms is not None else None  # when each send was posted
    rows: dict[int, list[tuple[str, float, float]]] = {r: [] for r in ranks}
    windows: dict[int, tuple[float, float]] = {}
    now = 0.0
    p2p = (lambda: draw_p2p.choice(costs.p2p_draws)) if draw_p2p and costs.p2p_draws else (lambda: costs.p2p_s)
    while True:
        # a rank finishing an action can make an earlier-visited rank ready at the same instant
        while any([_advance(r, st, now, done, rows, windows, hop, stage_rank, p2p, sent,
                            costs.host_overlaps_wait)
                   for r, st in ranks.items()]):
            pass
        live = {r: st for r, st in ranks.items() if st.index < len(st.segments)}
        if not live:
            return Timeline(rows, windows)
        running = [st for st in live.values() if st.ready is not None and st.ready <= now]
        rate = costs.rate(len(running))
        waits = [st.ready - now for st in live.values() if st.ready is not None and st.ready > now]
        steps = [st.left / rate for st in running] + waits
        if not steps:
            stuck = {r: str(st.segments[st.index][2]) for r, st in live.items()}
            raise RuntimeError(f"schedule deadlocks: next actions {stuck}")
        dt = min(steps)
        for st in running:
            st.left -= dt * rate
        now += dt


def _segments(order: list[_Action], cost: Callable[[_Action], float], overhead: Callable[[_Action], float],
              costs: Costs) -> list[tuple[str, float, _Action | None]]:
    from engine.parallel import schedules

    segs: list[tuple[str, float, _Action | None]] = [("head", costs.head_s, None)]
    for outer in order:
        if outer.computation_type.value in _SENDS:
            segs.append(("send", 0.0, outer))
        elif outer.computation_type.value in ("RECV_F", "RECV_B"):
            continue  # posting a receive is in the host work; a wait on it is in the p2p delay
        elif outer.is_compute_op or outer.sub_actions:
            for a in schedules.compute_actions(outer):
                segs += [("overhead", overhead(a), a), ("compute", cost(a), a)]
    return segs + [("tail", costs.tail_s, None)]


_SENDS = ("SEND_F", "SEND_B")


def _transfer(send: _Action) -> tuple[str, int, int]:
    """The input a SEND action posts: (direction F / B, receiving stage, micro-batch)."""
    kind, s, mb = send.computation_type.value, send.stage_index, send.microbatch_index
    return kind[-1], s + (1 if kind == "SEND_F" else -1), mb


def _advance(rank: int, st: _Rank, now: float, done: dict, rows: dict, windows: dict, hop: Callable,
             stage_rank: dict[int, int], p2p_s: Callable[[], float], sent: dict | None = None,
             overlap: bool = False) -> bool:
    """Finish `rank`'s segments whose work is done at `now` and find when the next one may run;
    True when a compute action finished or a send was posted (other ranks may now be ready)."""
    eps = 1e-12 * max(1.0, now)
    finished = False
    while st.index < len(st.segments):
        kind, work, action = st.segments[st.index]
        if st.ready is None:
            if kind == "head":
                st.ready = st.start
            elif kind == ("compute" if overlap else "overhead"):  # the segment that waits on the inputs
                ready = _ready_time(action, done, hop, stage_rank, p2p_s, sent)
                if ready is None:
                    return finished
                st.ready = max(ready, now) if overlap else ready
            else:
                st.ready = now
            st.left, st.seg_start = work, max(now, st.ready)
        if st.ready > now or st.left > eps:
            return finished
        if kind == "compute":
            done[(action.stage_index, action.computation_type.value, action.microbatch_index)] = now
            rows[rank].append((str(action), st.seg_start, now))
            finished = True
        elif kind == "send":
            sent[_transfer(action)] = now
            finished = True
        elif kind == "tail":
            windows[rank] = (st.start, now)
        st.index, st.ready = st.index + 1, None
    return finished


def _hops(paths: dict[int, list[int]] | None, num_stages: int) -> Callable[[int, int, int], int | None]:
    """hop(stage, mb, +1/-1): the next / previous stage on the micro-batch's path (None at an end)."""
    if paths is None:
        return lambda s, mb, d: s + d if 0 <= s + d < num_stages else None
    index = {mb: {s: i for i, s in enumerate(path)} for mb, path in paths.items()}

    def hop(s: int, mb: int, d: int) -> int | None:
        i = index[mb][s] + d
        return paths[mb][i] if 0 <= i < len(paths[mb]) else None

    return hop


def _needs(action: _Action, hop: Callable) -> list[tuple[int, tuple[str, ...]]]:
    """The (stage, kinds) whose action on the same micro-batch `action` waits for."""
    s, kind, mb = action.stage_index, action.computation_type.value, action.microbatch_index
    if kind == "W":
        return [(s, ("I",))]
    if kind == "F":
        prev = hop(s, mb, -1)
        return [(prev, ("F",))] if prev is not None else []
    nxt = hop(s, mb, +1)  # B or I: own forward, and the gradient from the next stage (its B or I)
    return [(s, ("F",))] + ([(nxt, ("B", "I"))] if nxt is not None else [])


def _input_key(kinds: tuple[str, ...], stage: int, mb: int) -> tuple[str, int, int]:
    """The key `_transfer` gives the input of (stage, mb) computed by actions of `kinds`."""
    return ("F" if kinds == ("F",) else "B", stage, mb)


def _ready_time(action: _Action, done: dict, hop: Callable, stage_rank: dict[int, int],
                p2p_s: Callable[[], float], sent: dict | None = None) -> float | None:
    """When the inputs of `action` are ready; None while one of them has not run (with `sent`, the
    times sends were posted: while one from another rank has not been sent). `p2p_s()` gives the
    delay of each input from another rank (a constant, or a draw)."""
    s, mb = action.stage_index, action.microbatch_index
    ready = 0.0
    for stage, kinds in _needs(action, hop):
        if stage_rank[stage] != stage_rank[s] and sent is not None:
            at = sent.get(_input_key(kinds, s, mb))
            if at is None:
                return None
            ready = max(ready, at + p2p_s())
            continue
        ends = [done[(stage, k, mb)] for k in kinds if (stage, k, mb) in done]
        if not ends:
            return None
        ready = max(ready, min(ends) + (p2p_s() if stage_rank[stage] != stage_rank[s] else 0.0))
    return ready


def schedule_bubble(codes: Any, pp: Any, m: Any, virtual: Any, layers: int, skip_ratio: Any = 0.0) -> np.ndarray:
    """`bubble_ratio` for arrays of configurations (schedule codes index tuning.sim.spec.SCHEDULES),
    walked once per distinct (schedule, pp, m, v, skip_ratio)."""
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
        return _kept((schedule, pp, m, virtual, layers, skip_ratio), lambda: _skip_bubble(pp, m, skip_ratio))
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
    key = (schedule, pp, m, virtual, layers, skip_ratio)
    return _kept(key, lambda: _walked_bubble(schedule, pp, m, virtual, layers))


def _walked_bubble(schedule: str, pp: int, m: int, virtual: int, layers: int | None) -> float:
    from engine.parallel import schedules

    v = schedules.chunks_per_rank(schedule, virtual, layers=layers, pp=pp)
    actions = schedules.schedule_actions(schedule=schedule, pp=pp, n_microbatches=m, virtual=virtual, layers=layers)
    stage_rank = schedules.stage_to_rank(schedule, pp, pp * v)
    return walk(actions, stage_rank=stage_rank, comms=schedules.with_comms(actions, stage_rank)).bubble_ratio()


def _skip_bubble(pp: int, m: int, skip_ratio: float) -> float:
    from engine.parallel.skippipe import skip_actions, skip_paths

    paths = skip_paths(pp=pp, n_microbatches=m, skip_ratio=skip_ratio)
    return walk(skip_actions(paths, pp=pp), stage_rank={s: s for s in range(pp)}, paths=paths).bubble_ratio()


def _kept(key: tuple, compute: Callable[[], float]) -> float:
    """`compute()` (a walk of torch's action lists: torch's pipelining costs a process ~4 s of CPU to import) kept
    between processes for the code as it is (tuning/sim/cache.py): a `workbench plan` that finds its walks there
    never imports torch for them."""
    from tuning.sim.cache import add_values, code_cache_path

    path, name = code_cache_path("bubbles", (__name__,)), "|".join(map(repr, key))
    kept = _kept_bubbles(path)
    if name not in kept:
        kept[name] = compute()
        add_values(path, {name: kept[name]})
    return kept[name]


@lru_cache(maxsize=4)
def _kept_bubbles(path: Path) -> dict[str, float]:
    from tuning.sim.cache import read_values

    return read_values(path)


# ---------------------------------------------------------------- executed schedules (runs)


def peak_in_flight(actions: list[tuple[str, float, float]]) -> int:
    """Most (stage, micro-batch) activations one rank held at once: forwards run, backward not yet."""
    held, peak = set(), 0
    for name, _, _ in actions:
        a = _action(name)
        key = (a.stage_index, a.microbatch_index)
        if a.computation_type.value == "F":
            held.add(key)
            peak = max(peak, len(held))
        elif a.computation_type.value in ("B", "I"):
            held.discard(key)
    return peak
