"""A recorded pipeline step priced by its own schedule (tuning/sim/schedule.py walks it): the executed
action lists of each rank (`executed_steps`), the bubble the run measured (`measured_bubble`), the
costs read off the step (`calibrate`: action durations, host work, p2p delays, processor sharing),
and the step predicted with them (`predicted_timeline`, `predicted_bubble` with costs drawn from the
recorded ones). What the Run page's schedule view and bench/schedules.py compare."""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from tuning.sim.schedule import _SENDS, Costs, Timeline, _action, _hops, _input_key, _needs, _transfer, walk

if TYPE_CHECKING:
    from engine.torch_compat import _Action


def executed_steps(records: list[Any]) -> dict[int, dict[int, dict[str, Any]]]:
    """Records of kind "schedule" / "skip_path" (engine/train/trainer.py `emit_schedule`) as
    {step: {rank: {"actions": [(action, start, end)], "total_s", "wall_start", "paths"}}} (and
    "peak_act_bytes" where recorded: the activation bytes autograd held at most)."""
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
        elif rec.name == "@peak_act_bytes":
            row["peak_act_bytes"] = rec.value
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


@dataclass(frozen=True)
class Calibration:
    """The walk's prices read off a recorded step: per (stage, kind) the work of every execution
    (`draws`) and their mean (`compute`), and the `Costs` (means, and the host-work samples)."""

    compute: dict[tuple[int, str], float]
    draws: dict[tuple[int, str], tuple[float, ...]]
    costs: Costs

    def cost(self, a: _Action, rng: random.Random | None = None) -> float:
        """The work of `a`: its (stage, kind)'s mean, or with `rng` one recorded execution of it."""
        key = (a.stage_index, a.computation_type.value)
        if key not in self.compute:  # never executed in the step (e.g. a stage a path skipped)
            return sum(self.compute.values()) / len(self.compute) if self.compute else 1.0
        return rng.choice(self.draws[key]) if rng else self.compute[key]


def predicted_timeline(step: dict[int, dict[str, Any]], *, schedule: str, pp: int, n_microbatches: int,
                       virtual: int = 1, layers: int | None = None, cores: float | None = None,
                       background: float = 0.0, rng: random.Random | None = None,
                       draw_host: bool = False, sends: bool = True, per_rank: bool = True,
                       per_kind: bool = True, overlap: bool = True, draw_p2p: bool = True,
                       priced_from: dict[int, dict[str, Any]] | None = None) -> Timeline:
    """The walk of the schedule's planned action list (SkipPipe: the step's recorded paths) priced
    with the costs `calibrate` reads off the recorded `step`; `cores` / `background` as in `Costs`;
    with `rng`, every action's work is one draw from the step's recorded ones of its (stage, kind),
    and the host work before it its rank's mean in the step (`draw_host`: a draw too, see
    `predicted_bubble`). The forms before 2026-11-24 stay available: `sends=False` times an input
    from the end of the action computing it rather than from its send in torch's lowered list
    (SkipPipe, with its own executor, always does), `per_rank=False` charges every rank the
    mean host work, `per_kind=False` charges a rank the same host work before every kind of
    action, and `overlap=False` (the form before 2026-11-24's last change, with `draw_p2p=False`)
    runs the host work before an action only once its inputs are in, at one mean p2p delay. The
    default (ours) runs it while the inputs are in flight (`Costs.host_overlaps_wait`), and with
    `rng` each input's delay is one draw from the step's recorded ones (`draw_p2p`). `priced_from`:
    read the prices off this other recorded step instead (out of sample: calibrate on one run,
    predict the next); SkipPipe's paths still come from `step` (they are drawn before it runs)."""
    from engine.parallel import schedules
    from engine.parallel.skippipe import skip_actions

    paths = next((row["paths"] for row in step.values() if row["paths"]), None)
    if schedule == "skip":
        actions, stage_rank = skip_actions(paths, pp=pp), {s: s for s in range(pp)}
    else:
        v = schedules.chunks_per_rank(schedule, virtual, layers=layers, pp=pp)
        actions = schedules.schedule_actions(schedule=schedule, pp=pp, n_microbatches=n_microbatches,
                                             virtual=virtual, layers=layers)
        stage_rank = schedules.stage_to_rank(schedule, pp, pp * v)
    paths = paths if schedule == "skip" else None
    comms = schedules.with_comms(actions, stage_rank) if schedule != "skip" and sends else None
    priced = priced_from or step
    priced_paths = next((row["paths"] for row in priced.values() if row["paths"]), None) if paths else None
    cal = calibrate(priced, stage_rank=stage_rank, paths=priced_paths, cores=cores, background=background,
                    comms=comms, per_rank=per_rank, per_kind=per_kind, overlap=overlap)
    return walk({i: actions[i] for i in sorted(actions)}, stage_rank=stage_rank, cost=lambda a: cal.cost(a, rng),
                paths=paths, costs=cal.costs, rng=rng if draw_host else None, comms=comms,
                draw_p2p=rng if draw_p2p else None)


def predicted_bubble(step: dict[int, dict[str, Any]], *, draws: int = 0, seed: int = 0,
                     **kwargs: Any) -> dict[int, float]:
    """Per pp rank (0..pp-1), the predicted bubble of `step`: the walk at mean costs, or with
    `draws` > 0 the mean over that many walks with every action's work drawn from the recorded ones
    (ours: the step time is a max over paths, so a walk at mean costs misses the waits that the
    spread of the costs adds, E[max] >= max E), and each input's delay from its send to the start
    of the action it gated drawn from the recorded ones (heavy-tailed too: at pp=4 on 2 cores mean
    0.8-1.3 ms, median 0.3-0.6 ms, the same for every schedule; the chunked schedules cross ranks
    twice as often per micro-batch, so one mean delay per hop left them 1-2 points optimistic, and
    the walk runs the host work while the input is in flight, as torch's runtime posts its sends
    and receives before it blocks on one). The host work between actions stays at its mean:
    its recorded gaps are heavy-tailed (pp=4 on 2 cores: coefficient of variation 0.8-1.3, 1f1b's
    median 0.8 ms, mean 3.0 ms, max 14 ms), so independent draws put a rare long gap before random
    actions on the critical path. Each rank keeps its own mean: the middle ranks post sends and
    receives both ways, and on shared cores the ranks get unequal shares (at pp=4 on 2 cores, a
    rank's delays beyond the overall mean, summed over a step, ran from -32 to +38 ms); and each
    kind of action its own factor on it (a W waits on no receive: 0.65-0.87 of the mean before it,
    an I 1.09-1.3). Measured minus predicted on 13 saved bench/schedules.py runs at pp=4 (median
    over each run's steps of the step's own difference; docs/simulator.md): 117 of 117 (schedule,
    run) pairs within 3 points, mean |error| 0.73 points, against 115 of 117 and 1.16 for the form
    with host work after the input is in and one mean delay (`overlap=False, draw_p2p=False`);
    three more fresh runs 27 of 27.
    kwargs as `predicted_timeline`."""
    if draws <= 0:
        t = predicted_timeline(step, **kwargs)
        return {r: t.bubble_fraction(r) for r in t.rows}
    rng = random.Random(seed)
    walks = [predicted_timeline(step, rng=rng, **kwargs) for _ in range(draws)]
    return {r: statistics.fmean(t.bubble_fraction(r) for t in walks) for r in walks[0].rows}


def calibrate(step: dict[int, dict[str, Any]], *, stage_rank: dict[int, int], paths: dict[int, list[int]] | None = None,
              cores: float | None = None, background: float = 0.0,
              comms: dict[int, list[_Action]] | None = None, per_rank: bool = True,
              per_kind: bool = True, overlap: bool = True) -> Calibration:
    """The walk's prices read off one recorded step (`executed_steps(...)[step]`, ranks keyed in
    pp order): the cost of each (stage, kind), and `Costs`.

    Ranks are aligned on their wall-clock step starts (`start_s`). For each executed action the
    gap since the rank's previous action (or its step start) is sorted by what it waited on: an
    input from another rank sent later than that (a remote gap, a wait), else nothing (a local
    gap: host work only). overhead_s = mean local gap past the first
    action, rank_overhead_s = each rank's own (`per_rank`), and kind_factor (`per_kind`, ours) = the
    mean local gap before actions of that kind, over all ranks, / overhead_s (the walk charges a rank's
    mean x its kind's factor): the
    runtime's host work depends on the rank (its share of the cores, sends both ways in the middle)
    and on what precedes the action (before an F or I it waits on a receive; before a W nothing),
    and one factor per kind, pooled over the ranks, stays steady where a rank has few gaps of a kind;
    with `overlap` (the default, ours), p2p_s = mean delay from an input's send to the start of the
    action it gated, over the waits whose input was sent later than the rank's previous action
    end plus the host work the walk charges before the action (its rank's mean local gap x its
    kind's factor; all waits where none was), and `p2p_draws` those delays; without (the form
    before), p2p_s = mean over remote gaps of the time from the send less that host work; tail_s =
    mean time from a rank's last action to its step end; the walk charges the host work before
    every action, the first included, so head_s = mean first gap of a rank that did not wait -
    overhead_s. With `cores` set, every compute,
    overhead, head and tail span is converted to work at a core of its own by the same processor
    sharing the walk applies (`Costs.rate` of the ranks running at each instant; a rank in a
    remote gap counts as waiting), so the walk inflates it back by its own sharing. With `comms`
    (the lists the walk will run, `walk(comms=...)`), an input arrives when its send was posted
    (at the end of the compute before the SEND in the sender's list), as the walk times it.
    """
    origin = min(row["wall_start"] for row in step.values())
    ranks = {rank: i for i, rank in enumerate(sorted(step))}
    start = {ranks[r]: row["wall_start"] - origin for r, row in step.items()}
    hop = _hops(paths, len(stage_rank))
    ends: dict[tuple[int, str, int], float] = {}
    for r, row in step.items():
        for name, _, end in row["actions"]:
            a = _action(name)
            ends[(a.stage_index, a.computation_type.value, a.microbatch_index)] = end + start[ranks[r]]
    sent = _sent(step, comms, ends, start) if comms is not None else None
    spans: dict[str, list[tuple[float, float]]] = {"local": [], "head": [], "tail": []}
    compute: dict[tuple[int, str], list[tuple[float, float]]] = {}
    by_rank: dict[int, list[tuple[float, float]]] = {}  # local gaps per rank
    by_kind: dict[str, list[tuple[float, float]]] = {}  # local gaps per kind of the action after them
    # the remote gaps: (rank, action kind, input arrived, action start, the rank's previous action end)
    waits: list[tuple[int, str, float, float, float]] = []
    for r, row in step.items():
        off = start[ranks[r]]
        prev = off
        for i, (name, s, e) in enumerate(row["actions"]):
            a = _action(name)
            remote = [min(ends[(st, k, a.microbatch_index)] for k in kinds if (st, k, a.microbatch_index) in ends)
                      if sent is None else sent.get(_input_key(kinds, a.stage_index, a.microbatch_index), -1.0)
                      for st, kinds in _needs(a, hop)
                      if stage_rank[st] != stage_rank[a.stage_index]
                      and any((st, k, a.microbatch_index) in ends for k in kinds)]
            arrived = max(remote, default=-1.0)
            if arrived > prev:
                waits.append((ranks[r], a.computation_type.value, arrived, s + off, prev))
            else:
                spans["head" if i == 0 else "local"].append((prev, s + off))
                if i:
                    by_rank.setdefault(ranks[r], []).append((prev, s + off))
                    by_kind.setdefault(a.computation_type.value, []).append((prev, s + off))
            compute.setdefault((a.stage_index, a.computation_type.value), []).append((s + off, e + off))
            prev = e + off
        spans["tail"].append((prev, row["total_s"] + off))
    sharing = Costs(cores=cores, background=background)
    running = [span for kind in ("local", "head", "tail") for span in spans[kind]] + \
        [span for spans_ in compute.values() for span in spans_]

    def mean_work(items: list[tuple[float, float]]) -> float:
        return sum(_work(a, b, running, sharing) for a, b in items) / len(items) if items else 0.0

    def mean_wall(items: list[tuple[float, float]]) -> float:
        return sum(b - a for a, b in items) / len(items) if items else 0.0

    local_wall = {rank: mean_wall(items) for rank, items in by_rank.items()} if per_rank else {}
    overall = mean_wall(spans["local"])

    def kind_factors(mean: Callable[[list[tuple[float, float]]], float]) -> dict[str, float]:
        """Each kind's mean local gap over the mean of all (ranks pooled)."""
        whole = mean(spans["local"])
        return {kind: mean(items) / whole for kind, items in by_kind.items()} if per_kind and whole > 0 else {}

    kind_wall = kind_factors(mean_wall)

    def host_wall(rank: int, kind: str) -> float:
        """The host work the walk charges `rank` before an action of `kind` (wall seconds)."""
        return local_wall.get(rank, overall) * kind_wall.get(kind, 1.0)

    if overlap:  # the delays of the inputs that gated their action: in after the rank's own host work
        delays = tuple(b - a for rank, kind, a, b, prev in waits if a - prev > host_wall(rank, kind)) or \
            tuple(b - a for _, _, a, b, _ in waits)
        p2p = statistics.fmean(delays) if delays else 0.0
    else:
        delays = ()
        p2p = max(0.0, statistics.fmean(b - a - host_wall(rank, kind) for rank, kind, a, b, _ in waits)) \
            if waits else 0.0
    overhead = mean_work(spans["local"])
    costs = Costs(p2p_s=p2p, overhead_s=overhead, head_s=max(0.0, mean_work(spans["head"]) - overhead),
                  tail_s=mean_work(spans["tail"]), start_s=start, cores=cores, background=background,
                  overhead_draws=tuple(_work(a, b, running, sharing) for a, b in spans["local"]),
                  rank_overhead_s={rank: mean_work(items) for rank, items in by_rank.items()} if per_rank else {},
                  kind_factor=kind_factors(mean_work), host_overlaps_wait=overlap, p2p_draws=delays)
    return Calibration({key: mean_work(items) for key, items in compute.items()},
                       {key: tuple(_work(a, b, running, sharing) for a, b in items) for key, items in compute.items()},
                       costs)


def _sent(step: dict[int, dict[str, Any]], comms: dict[int, list[_Action]], ends: dict, start: dict[int, float]
          ) -> dict[tuple[str, int, int], float]:
    """Per input (direction, receiving stage, micro-batch), when the recorded step posted its send:
    at the end of the compute before the SEND in the sender's list."""
    from engine.parallel import schedules

    out: dict[tuple[str, int, int], float] = {}
    for i in range(len(step)):
        last = start[i]
        for a in comms.get(i, []):
            if a.computation_type.value in _SENDS:
                out[_transfer(a)] = last
            elif a.is_compute_op or a.sub_actions:
                for sub in schedules.compute_actions(a):
                    last = max(last, ends.get((sub.stage_index, sub.computation_type.value, sub.microbatch_index), last))
    return out


def _work(a: float, b: float, running: list[tuple[float, float]], costs: Costs) -> float:
    """Work done in [a, b] by one running rank under `costs`' sharing, given every rank's running
    spans: the integral of `costs.rate(ranks running at t)` over the span."""
    if costs.cores is None or b <= a:
        return max(b - a, 0.0)
    cuts = sorted({a, b} | {t for span in running for t in span if a < t < b})
    total = 0.0
    for lo, hi in zip(cuts, cuts[1:]):
        mid = (lo + hi) / 2
        total += (hi - lo) * costs.rate(sum(1 for s, e in running if s <= mid < e))
    return total
