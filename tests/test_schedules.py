"""Schedules as data (engine/parallel/schedules.py): the action lists, and torch's runtime executing
them with single-process loss parity (fp32, 5 AdamW steps, 1e-4) at pp=2 and pp=4, with dp=2 under
ZeRO-3 where they compose.

Two spawned runs: world 2 (pp=2, every schedule) and world 4 (pp=4, every schedule; dp=2 x pp=2
under ZeRO-3 with looped_bfs and zbv).
"""
from __future__ import annotations

import statistics
from collections import Counter

import pytest
import torch

from engine.config.schema import ModelConfig
from engine.model.gpt import build_model, loss_fn
from engine.parallel.schedules import chunks_per_rank, compute_actions, schedule_actions, stage_to_rank
from engine.config.validate import SCHEDULES
from parallel_harness import counting_batches, run_ranks, single_process_losses

SEED, STEPS, GLOBAL_BATCH, MICRO, LR = 0, 5, 16, 2, 1e-2
CFG = ModelConfig(layers=8, d_model=16, heads=2, seq_len=8, vocab=64, dropout=0.0)
TOL = 1e-4
RUN = [s for s in SCHEDULES if s != "skip"]
NEW = ["looped_bfs", "modular", "zero_bubble", "zbv", "dualpipev"]  # pp=2 gpipe/1f1b/interleaved: test_pipeline.py
VIRTUAL = 2  # interleaved, looped_bfs, zero_bubble


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return counting_batches(steps=STEPS, global_batch=GLOBAL_BATCH, seq_len=CFG.seq_len, vocab=CFG.vocab)


def _reference_losses() -> list[float]:
    return single_process_losses(CFG, _batches(), seed=SEED, lr=LR)


def _train(mesh, schedule: str, zero3: bool = False, skip_ratio: float | None = None) -> dict:
    import torch.distributed as dist

    from engine.parallel.pipeline import allreduce_grads, build_pipeline
    from engine.parallel.skippipe import build_skip_pipeline
    from engine.parallel.zero import apply_zero

    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    local = GLOBAL_BATCH // dp
    pipe = build_skip_pipeline(build_model(CFG, seed=SEED), mesh["pp"], skip_ratio=skip_ratio,
                               n_microbatches=local // MICRO, micro=MICRO, loss_fn=loss_fn) \
        if skip_ratio is not None else build_pipeline(build_model(CFG, seed=SEED), mesh["pp"], schedule=schedule, virtual=VIRTUAL,
                          n_microbatches=local // MICRO, loss_fn=loss_fn, device="cpu",
                          parallelize=(lambda c: apply_zero(c, mesh["dp"], stage=3)) if zero3 else None)
    opt = torch.optim.AdamW([p for m in pipe.modules for p in m.parameters()], lr=LR)
    rows = slice(dp_rank * local, (dp_rank + 1) * local)
    losses, executed, paths = [], [], []
    for x, y in _batches():
        opt.zero_grad()
        loss = pipe.step(x[rows], y[rows])
        if not zero3:
            allreduce_grads(pipe.modules, mesh["dp"].get_group())
        opt.step()
        losses.append(None if loss is None else loss.item())
        executed.append(pipe.last_actions)
        paths.append(dict(getattr(pipe, "last_paths", {})))
    dist.barrier()
    return {"losses": losses, "is_last": pipe.is_last, "executed": executed, "paths": paths,
            "planned": [str(a) for a in pipe.actions[mesh["pp"].get_local_rank()]]}


def _world(rank: int, world_size: int, pp: int, part: str = "schedules") -> dict:
    from engine.mesh import ParallelDims

    mesh = ParallelDims(dp=1, tp=1, pp=pp, world_size=pp).build_mesh("cpu")
    if pp == 2:
        return {s: _train(mesh, s) for s in NEW}
    if part == "schedules":
        return {s: _train(mesh, s) for s in RUN}
    out = {}
    if world_size == 4:
        out["skip0"] = _train(mesh, "skip", skip_ratio=0.0)
        out["skip50"] = _train(mesh, "skip", skip_ratio=0.5)
        dp_mesh = ParallelDims(dp=2, tp=1, pp=2, world_size=4).build_mesh("cpu")
        out["dp2_zero3_looped_bfs"] = _train(dp_mesh, "looped_bfs", zero3=True)
        out["dp2_manual_zbv"] = _train(dp_mesh, "zbv")
    return out


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return _reference_losses()


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return run_ranks(2, _world, 2, timeout=400)


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return run_ranks(4, _world, 4, "schedules", timeout=900)


@pytest.fixture(scope="module")
def world4_skip_dp() -> list[dict]:
    return run_ranks(4, _world, 4, "skip_dp", timeout=900)


def _losses(results: list[dict], layout: str) -> list[float]:
    last = [r[layout]["losses"] for r in results if r[layout]["is_last"]]
    return [statistics.fmean(step) for step in zip(*last)]


@pytest.mark.slow
@pytest.mark.xdist_group("schedules")
@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule", NEW)
def test_pp2_every_schedule_matches_single_process(world2, reference, schedule):
    got = _losses(world2, schedule)
    assert max(abs(a - b) for a, b in zip(got, reference)) <= TOL, (got, reference)
    assert reference[-1] < reference[0] - 0.1  # it trains, so parity is not trivially met
    # the engine executed exactly the planned compute actions, in order (OVERLAP_F_B runs F then B)
    for rank in world2:
        executed = [a for a, _, _ in rank[schedule]["executed"][-1]["actions"]]
        assert executed == _flat(rank[schedule]["planned"]), schedule


@pytest.mark.slow
@pytest.mark.xdist_group("schedules")
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", RUN)
def test_pp4_every_schedule_matches_single_process(world4, reference, layout):
    _check_layout(world4, reference, layout)


@pytest.mark.slow
@pytest.mark.xdist_group("schedules")
@pytest.mark.timeout(900)
def test_pp4_peak_activations_are_measured(world4):
    """Saved-tensor bytes held at once on rank 0 (stage 0, 8 micro-batches of one shape): GPipe
    holds all 8 forwards before the first backward, 1F1B at most pp = 4, so exactly twice as much."""
    peak = {s: world4[0][s]["executed"][-1]["peak_act_bytes"] for s in ("gpipe", "1f1b")}
    assert peak["1f1b"] > 0 and peak["gpipe"] == 2 * peak["1f1b"], peak


@pytest.mark.slow
@pytest.mark.xdist_group("schedules")
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["skip0", "dp2_zero3_looped_bfs", "dp2_manual_zbv"])
def test_pp4_skip0_and_dp2_match_single_process(world4_skip_dp, reference, layout):
    _check_layout(world4_skip_dp, reference, layout)


def _check_layout(world4: list[dict], reference: list[float], layout: str) -> None:
    got = _losses(world4, layout)
    assert max(abs(a - b) for a, b in zip(got, reference)) <= TOL, (got, reference)
    step = world4[0][layout]["executed"][-1]
    starts = [start for _, start, _ in step["actions"]]
    assert starts == sorted(starts) and 0 <= starts[0] and step["actions"][-1][2] <= step["total_s"]


def _flat(planned: list[str]) -> list[str]:
    from torch.distributed.pipelining.schedules import _Action

    return [str(a) for s in planned for a in compute_actions(_Action.from_str(s))] if planned else []


@pytest.mark.parametrize("schedule", RUN)
@pytest.mark.parametrize("pp", [2, 4])
def test_every_stage_and_microbatch_runs_once(schedule, pp):
    m, layers = 8, 8
    actions = schedule_actions(schedule=schedule, pp=pp, n_microbatches=m, virtual=VIRTUAL, layers=layers)
    v = chunks_per_rank(schedule, VIRTUAL, layers=layers, pp=pp)
    placement = stage_to_rank(schedule, pp, pp * v)
    done = Counter()
    for rank, order in actions.items():
        for action in (a for outer in order for a in compute_actions(outer)):
            assert placement[action.stage_index] == rank
            done[(action.stage_index, action.computation_type.value, action.microbatch_index)] += 1
    kinds = {k for _, k, _ in done}
    assert kinds == ({"F", "I", "W"} if schedule in ("zero_bubble", "zbv") else
                     {"F", "B", "I", "W"} if schedule == "dualpipev" else {"F", "B"})
    for stage in range(pp * v):
        for mb in range(m):
            assert done[(stage, "F", mb)] == 1
            backward = done[(stage, "B", mb)] + done[(stage, "I", mb)]
            assert backward == 1 and done[(stage, "W", mb)] == done[(stage, "I", mb)]


def test_modular_places_layer_i_on_rank_i_mod_pp():
    from engine.parallel.pipeline import stage_layers

    pp, layers = 4, 8
    v = chunks_per_rank("modular", layers=layers, pp=pp)
    assert v == layers // pp
    placement = stage_to_rank("modular", pp, pp * v)
    for stage, block_ids in enumerate(stage_layers(layers, pp, v)):
        assert block_ids == [stage] and placement[stage] == stage % pp


def test_v_schedules_put_first_and_last_stage_on_rank0():
    assert stage_to_rank("zbv", 4, 8) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 3, 5: 2, 6: 1, 7: 0}
    assert stage_to_rank("interleaved", 4, 8)[7] == 3


def test_looped_bfs_runs_each_stage_breadth_first():
    """Breadth-first: a rank runs every micro-batch through a stage before the next stage."""
    order = [str(a) for a in schedule_actions(schedule="looped_bfs", pp=2, n_microbatches=4, virtual=2)[0]]
    assert order[:8] == ["0F0", "0F1", "0F2", "0F3", "2F0", "2F1", "2F2", "2F3"]
    assert order[8:12] == ["2B3", "2B2", "2B1", "2B0"]


@pytest.mark.slow
@pytest.mark.xdist_group("schedules")
@pytest.mark.timeout(900)
def test_skippipe_runs_the_recorded_paths(world4_skip_dp, reference):
    """skip_ratio 0.5 at pp=4: each micro-batch skips one of the two middle stages; a middle rank
    runs exactly the micro-batches whose recorded path visits it, and the loss departs from the
    full pipeline's (skip0 above matches the single process: the executor itself is exact)."""
    for rank, result in enumerate(world4_skip_dp):
        for step, paths in enumerate(result["skip50"]["paths"]):
            assert all(p[0] == 0 and p[-1] == 3 and len(p) == 3 for p in paths.values())
            visiting = sorted(mb for mb, p in paths.items() if rank in p)
            ran = sorted(int(a.split("F")[1]) for a, _, _ in result["skip50"]["executed"][step]["actions"] if "F" in a)
            assert ran == visiting
        assert result["skip50"]["paths"][0] != result["skip50"]["paths"][1]  # paths change per step
    got = _losses(world4_skip_dp, "skip50")
    assert max(abs(a - b) for a, b in zip(got, reference)) > 1e-3  # a shorter network: not the full pipeline
    assert got[-1] < got[0] - 0.05  # and it trains


def test_skip_paths_visit_every_middle_stage_equally():
    from engine.parallel.skippipe import skip_paths

    for step in range(3):
        paths = skip_paths(pp=6, n_microbatches=8, skip_ratio=0.5, step=step)  # 4 middle stages, skip 2
        assert all(p[0] == 0 and p[-1] == 5 and len(p) == 4 and p == sorted(p) for p in paths.values())
        visits = Counter(s for p in paths.values() for s in p[1:-1])
        assert visits == {1: 4, 2: 4, 3: 4, 4: 4}
    assert skip_paths(pp=4, n_microbatches=2, skip_ratio=0.0) == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}


@pytest.mark.parametrize("cap", [1, 2, 4])
def test_skip_actions_respect_the_memory_cap(cap):
    from engine.parallel.skippipe import skip_actions, skip_paths
    from tuning.sim.schedule import peak_in_flight, walk

    paths = skip_paths(pp=4, n_microbatches=8, skip_ratio=0.5)
    actions = skip_actions(paths, pp=4, mem_cap=cap)
    for stage, order in actions.items():
        assert peak_in_flight([(str(a), 0.0, 0.0) for a in order]) <= cap
        assert sorted(a.microbatch_index for a in order if a.computation_type.value == "F") == \
            [mb for mb, p in paths.items() if stage in p]
    walk(actions, stage_rank={s: s for s in range(4)}, paths=paths)  # runs to the end: no deadlock


def test_walk_prices_the_bubble_from_the_action_list():
    """Unit costs (F 1, B 2): GPipe and 1F1B idle (p-1)(F+B) per rank, i.e. (p-1)/m of the compute
    (Narayanan et al. 2021); the zero-bubble lists fill most of it; skipping stages shortens the fill."""
    from tuning.sim.schedule import bubble_ratio

    assert bubble_ratio("gpipe", 4, 8) == pytest.approx(3 / 8)
    assert bubble_ratio("1f1b", 4, 8) == pytest.approx(3 / 8)
    assert bubble_ratio("interleaved", 4, 8, 2) == pytest.approx(3 / 16)
    assert bubble_ratio("zbv", 4, 8) < bubble_ratio("zero_bubble", 4, 8, 1) <= bubble_ratio("1f1b", 4, 8) / 2
    assert bubble_ratio("skip", 4, 8, skip_ratio=0.5) < bubble_ratio("1f1b", 4, 8)
    assert bubble_ratio("1f1b", 1, 8) == 0.0


def _same(row: list, expected: list) -> None:
    """Same actions in order, at the same (start, end) times up to rounding."""
    assert [a for a, _, _ in row] == [a for a, _, _ in expected]
    assert [t for _, *ts in row for t in ts] == pytest.approx([t for _, *ts in expected for t in ts])


def test_walk_prices_overhead_p2p_head_and_tail():
    """Hand-walked 1f1b, pp=2, one micro-batch: F 1, B 2, host work 0.5 before each action, p2p
    0.25, head 0.1, tail 0.2. Rank 0: head [0, .1], 0F0 [.6, 1.6]; rank 1: 1F0 ready 1.85, runs
    [2.35, 3.35], 1B0 [3.85, 5.85], tail to 6.05; rank 0: 0B0 ready 6.1, runs [6.6, 8.6], tail 8.8."""
    import random

    from torch.distributed.pipelining.schedules import _Action

    from tuning.sim.schedule import Costs, walk

    actions = schedule_actions(schedule="1f1b", pp=2, n_microbatches=1)
    costs = Costs(overhead_s=0.5, p2p_s=0.25, head_s=0.1, tail_s=0.2)
    t = walk(actions, stage_rank={0: 0, 1: 1}, costs=costs)
    _same(t.rows[0], [("0F0", 0.6, 1.6), ("0B0", 6.6, 8.6)])
    _same(t.rows[1], [("1F0", 2.35, 3.35), ("1B0", 3.85, 5.85)])
    assert list(t.windows[0]) == pytest.approx([0.0, 8.8]) and list(t.windows[1]) == pytest.approx([0.0, 6.05])
    assert t.bubble_fraction(0) == pytest.approx(1 - 3 / 8.8)
    assert t.bubble_fraction(1) == pytest.approx(1 - 3 / 6.05)
    # with an rng, each action's host work is a draw from the recorded samples (here always 1)
    one_rank = {0: [_Action.from_str("0F0"), _Action.from_str("0F1")]}
    drawn = walk(one_rank, stage_rank={0: 0}, costs=Costs(overhead_s=5, overhead_draws=(1.0,)), rng=random.Random(0))
    _same(drawn.rows[0], [("0F0", 1.0, 2.0), ("0F1", 3.0, 4.0)])


def _ps_step() -> dict:
    """GPipe pp=2, two micro-batches, F 1 and B 2 of work, both ranks sharing one core (hand-walked):
    rank 0 F0 [0,1] alone; 0F1 and 1F0 share [1,3]; 1F1 [3,4], 1B0 [4,6] alone; 0B0 and 1B1 share
    [6,10]; 0B1 [10,12]."""
    spans = {0: [("0F0", 0, 1), ("0F1", 1, 3), ("0B0", 6, 10), ("0B1", 10, 12)],
             1: [("1F0", 1, 3), ("1F1", 3, 4), ("1B0", 4, 6), ("1B1", 6, 10)]}
    return {r: {"actions": [(a, float(b), float(e)) for a, b, e in row], "total_s": float(row[-1][2]),
                "wall_start": 100.0, "paths": {}} for r, row in spans.items()}


def test_walk_shares_the_cores_among_running_ranks():
    """Processor sharing: with one core, two ranks computing at once each run at half speed, and a
    rank waiting on an input frees the core (the hand-walked `_ps_step`); background threads take
    their share too."""
    from torch.distributed.pipelining.schedules import _Action

    from tuning.sim.schedule import Costs, walk

    actions = schedule_actions(schedule="gpipe", pp=2, n_microbatches=2)
    t = walk(actions, stage_rank={0: 0, 1: 1}, costs=Costs(cores=1))
    for rank, row in _ps_step().items():
        _same(t.rows[rank], row["actions"])
    assert t.bubble_fraction(0) == pytest.approx(1 - 9 / 12) and t.bubble_fraction(1) == pytest.approx(1 - 9 / 10)
    one = walk({0: [_Action.from_str("0F0")]}, stage_rank={0: 0}, costs=Costs(cores=1, background=1))
    _same(one.rows[0], [("0F0", 0.0, 2.0)])


def test_calibrate_reads_the_costs_off_a_recorded_step():
    """A recorded 1f1b step (pp=2, one micro-batch) whose every gap is what the walk charges: host
    work 0.5 before each action, an action waiting on a remote input starting 1.0 after its send
    (p2p 1.0 in the default form, where the host work runs while the input is in flight; 0.5 plus
    the host work in the form before, `overlap=False`), tail 0.5, rank 1 entering 0.25 s late.
    Calibrated from it, the walk reproduces the step and its measured bubble in both forms; with
    one shared core, `_ps_step`'s stretched spans are read back as F 1, B 2 of work (plain means:
    stage 0 F 1.5)."""
    from tuning.calibrate.schedule import calibrate, measured_bubble, predicted_timeline

    step = {0: {"actions": [("0F0", 0.5, 1.5), ("0B0", 7.0, 9.0)], "total_s": 9.5, "wall_start": 100.0, "paths": {}},
            1: {"actions": [("1F0", 2.25, 3.25), ("1B0", 3.75, 5.75)], "total_s": 6.25, "wall_start": 100.25,
                "paths": {}}}
    cal = calibrate(step, stage_rank={0: 0, 1: 1})
    compute, costs = cal.compute, cal.costs
    assert compute == pytest.approx({(0, "F"): 1.0, (1, "F"): 1.0, (0, "B"): 2.0, (1, "B"): 2.0})
    assert (costs.overhead_s, costs.p2p_s, costs.head_s, costs.tail_s) == pytest.approx((0.5, 1.0, 0.0, 0.5))
    assert dict(costs.start_s) == pytest.approx({0: 0.0, 1: 0.25})
    before = calibrate(step, stage_rank={0: 0, 1: 1}, overlap=False).costs
    assert (before.overhead_s, before.p2p_s, before.head_s, before.tail_s) == pytest.approx((0.5, 0.5, 0.0, 0.5))
    for overlap in (True, False):
        t = predicted_timeline(step, schedule="1f1b", pp=2, n_microbatches=1, overlap=overlap)
        _same(t.rows[0], [("0F0", 0.5, 1.5), ("0B0", 7.0, 9.0)])
        assert [t.bubble_fraction(r) for r in (0, 1)] == pytest.approx(list(measured_bubble(step).values()))
        assert [t.bubble_fraction(r) for r in (0, 1)] == pytest.approx([1 - 3 / 9.5, 1 - 3 / 6.25])

    shared = calibrate(_ps_step(), stage_rank={0: 0, 1: 1}, cores=1).compute
    assert shared == pytest.approx({(0, "F"): 1.0, (1, "F"): 1.0, (0, "B"): 2.0, (1, "B"): 2.0})
    plain = calibrate(_ps_step(), stage_rank={0: 0, 1: 1})
    assert plain.compute[(0, "F")] == pytest.approx(1.5) and sorted(plain.draws[(0, "F")]) == [1.0, 2.0]


def test_drawn_walks_draw_the_actions_work_and_keep_the_host_work_at_its_mean():
    """A recorded gpipe step (pp=2, two micro-batches) with F 1 and B 2 every time and local host
    gaps 0.2, 0.8, 0.5, 0.5, 0.5 (mean 0.5): with nothing to draw in the actions' work, a drawn walk
    is the walk at mean costs, whatever the seed (drawing the host gaps too moved actions by up to
    0.3 s); `draw_host=True` keeps that older form. The inputs' delays are not drawn here
    (`draw_p2p=False`; see `test_host_work_runs_while_the_input_is_in_flight`)."""
    import random

    from tuning.calibrate.schedule import calibrate, predicted_bubble, predicted_timeline

    spans = {0: [("0F0", 0.5, 1.5), ("0F1", 1.7, 2.7), ("0B0", 7.8, 9.8), ("0B1", 10.3, 12.3)],
             1: [("1F0", 2.0, 3.0), ("1F1", 3.8, 4.8), ("1B0", 5.3, 7.3), ("1B1", 7.8, 9.8)]}
    step = {r: {"actions": row, "total_s": row[-1][2] + 0.5, "wall_start": 100.0, "paths": {}}
            for r, row in spans.items()}
    costs = calibrate(step, stage_rank={0: 0, 1: 1}).costs
    assert sorted(costs.overhead_draws) == pytest.approx([0.2, 0.5, 0.5, 0.5, 0.8])
    assert costs.overhead_s == pytest.approx(0.5)
    kwargs = {"schedule": "gpipe", "pp": 2, "n_microbatches": 2, "draw_p2p": False}
    mean = predicted_timeline(step, **kwargs)
    for seed in range(5):
        drawn = predicted_timeline(step, rng=random.Random(seed), **kwargs)
        for rank in (0, 1):
            _same(drawn.rows[rank], mean.rows[rank])
    assert predicted_bubble(step, draws=8, **kwargs) == pytest.approx(predicted_bubble(step, **kwargs))
    old = [predicted_timeline(step, rng=random.Random(seed), draw_host=True, **kwargs) for seed in range(5)]
    assert any(t.rows[1][0][1] != pytest.approx(mean.rows[1][0][1]) for t in old)


def test_an_overlap_pair_sends_its_forward_only_after_its_backward():
    """torch's runtime posts an OVERLAP_F_B's sends after both halves (`_add_send_recv`). Unit costs
    (F 1, B 2), pp=2, rank 0 running 0F0, (0F1;0B0), 0B1, hand-walked: 0F1 ends at 2 but 0B0 waits
    for 1B0 (ends 4) and runs [4, 6], so 0F1's activation leaves at 6: 1F1 [6, 7], 1B1 [7, 9], 0B1
    [9, 11]. Timed from 0F1's end (the walk before), 1F1 ran [4, 5] and the step ended at 9."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    from engine.parallel.schedules import with_comms
    from tuning.sim.schedule import walk

    a = _Action.from_str
    pair = _Action(-1, _ComputationType.OVERLAP_F_B, None, (a("0F1"), a("0B0")))
    actions = {0: [a("0F0"), pair, a("0B1")], 1: [a("1F0"), a("1B0"), a("1F1"), a("1B1")]}
    t = walk(actions, stage_rank={0: 0, 1: 1}, comms=with_comms(actions, {0: 0, 1: 1}))
    _same(t.rows[0], [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 4, 6), ("0B1", 9, 11)])
    _same(t.rows[1], [("1F0", 1, 2), ("1B0", 2, 4), ("1F1", 6, 7), ("1B1", 7, 9)])
    assert walk(actions, stage_rank={0: 0, 1: 1}).makespan == pytest.approx(9.0)


def test_an_input_leaves_when_its_send_is_posted():
    """With torch's lowered lists, an input arrives p2p after the sender's list posts its send.
    Hand lists, rank 0 posting both sends after 0F1; F 1, p2p 0.5: 0F0 [0, 1], 0F1 [1, 2], both
    sent at 2, so 1F0 runs [2.5, 3.5] and 1F1 [3.5, 4.5]; timed from the end of 0F0 (without the
    lists), 1F0 ran [1.5, 2.5]. The unit-cost search walk lowers every schedule the same way
    (dualpipev pp=4, 8 micro-batches: bubble 0.125 of the compute, 0.0625 before)."""
    from torch.distributed.pipelining.schedules import _Action

    from tuning.sim.schedule import Costs, bubble_ratio, walk

    a = _Action.from_str
    actions = {0: [a("0F0"), a("0F1")], 1: [a("1F0"), a("1F1")]}
    comms = {0: [a("0F0"), a("0F1"), a("0SEND_F0"), a("0SEND_F1")],
             1: [a("1RECV_F0"), a("1RECV_F1"), a("1F0"), a("1F1")]}
    t = walk(actions, stage_rank={0: 0, 1: 1}, comms=comms, costs=Costs(p2p_s=0.5))
    _same(t.rows[1], [("1F0", 2.5, 3.5), ("1F1", 3.5, 4.5)])
    _same(walk(actions, stage_rank={0: 0, 1: 1}, costs=Costs(p2p_s=0.5)).rows[1], [("1F0", 1.5, 2.5), ("1F1", 2.5, 3.5)])
    assert bubble_ratio("dualpipev", 4, 8) == pytest.approx(0.125)


def test_calibrate_reads_each_ranks_own_host_work():
    """A recorded gpipe step (pp=2, two micro-batches, F 1, B 2) walked by hand with host work 0.2
    before each action on rank 0, 0.8 on rank 1, and p2p 0.3: rank 0 0F0 [.2, 1.2], 0F1 [1.4, 2.4];
    rank 1 1F0 ready 1.5, runs [2.3, 3.3], 1F1 [4.1, 5.1], 1B0 [5.9, 7.9], 1B1 [8.7, 10.7]; rank 0
    0B0 [8.4, 10.4], 0B1 [11.2, 13.2]. Calibrated from it, each rank gets its own host work (the
    one mean is 0.65) and p2p 0.3, and the walk reproduces the step; one mean for all
    (`per_rank=False`, the form before) moves rank 1's actions. Host work per kind is off here
    (`per_kind=False`): the kinds' factors pooled over both ranks are not 1 on this step. The form
    tested is the one before 2026-11-24's last change (host work after the input is in,
    `overlap=False`)."""
    from tuning.calibrate.schedule import calibrate, predicted_timeline

    spans = {0: [("0F0", 0.2, 1.2), ("0F1", 1.4, 2.4), ("0B0", 8.4, 10.4), ("0B1", 11.2, 13.2)],
             1: [("1F0", 2.3, 3.3), ("1F1", 4.1, 5.1), ("1B0", 5.9, 7.9), ("1B1", 8.7, 10.7)]}
    step = {r: {"actions": row, "total_s": row[-1][2], "wall_start": 100.0, "paths": {}} for r, row in spans.items()}
    costs = calibrate(step, stage_rank={0: 0, 1: 1}, per_kind=False, overlap=False).costs
    assert dict(costs.rank_overhead_s) == pytest.approx({0: 0.2, 1: 0.8})
    assert (costs.overhead_s, costs.p2p_s, costs.head_s, costs.tail_s) == pytest.approx((0.65, 0.3, 0.0, 0.0))
    kwargs = {"schedule": "gpipe", "pp": 2, "n_microbatches": 2, "per_kind": False, "overlap": False}
    t = predicted_timeline(step, **kwargs)
    for rank, row in spans.items():
        _same(t.rows[rank], row)
    one_mean = predicted_timeline(step, per_rank=False, **kwargs)
    assert one_mean.rows[1][1][1] != pytest.approx(4.1)



def test_the_walk_charges_each_kinds_host_work():
    """Host work per (rank, kind): rank 0 0.2 before an F, 0.6 before a B; rank 1 0.4 and 1.2; p2p
    0.3, F 1, B 2, gpipe pp=2 with two micro-batches and torch's sends. By hand: 0F0 [.2, 1.2], 0F1
    [1.4, 2.4]; 1F0 ready 1.5, runs [1.9, 2.9], 1F1 [3.3, 4.3], 1B0 [5.5, 7.5], 1B1 [8.7, 10.7];
    0B0 ready 7.8, runs [8.4, 10.4], 0B1 ready 11.0, runs [11.6, 13.6]. Read back from that step:
    local gaps 0.2 (F) on rank 0 and 0.4 (F), 1.2, 1.2 (B) on rank 1, so the kinds' factors are
    0.3 / 0.75 and 1.2 / 0.75, and a rank's host work before a kind is its mean times that factor;
    the remote gaps (0.9, 0.9 on rank 0 before a B, 0.7 on rank 1 before an F) less that host work
    give p2p (0.58 + 0.58 + 0.3267) / 3. Without kinds (the form before): one host work per rank and
    p2p (0.7 + 0.7 - 0.2333) / 3. Both in the form with the host work after the input is in
    (`overlap=False`, `Costs`' default)."""
    from torch.distributed.pipelining.schedules import _Action

    from engine.parallel.schedules import with_comms
    from tuning.calibrate.schedule import calibrate
    from tuning.sim.schedule import Costs, walk

    a = _Action.from_str
    actions = {0: [a("0F0"), a("0F1"), a("0B0"), a("0B1")], 1: [a("1F0"), a("1F1"), a("1B0"), a("1B1")]}
    comms = with_comms(actions, {0: 0, 1: 1})
    costs = Costs(p2p_s=0.3, rank_overhead_s={0: 0.4, 1: 0.8}, kind_factor={"F": 0.5, "B": 1.5})
    t = walk(actions, stage_rank={0: 0, 1: 1}, costs=costs, comms=comms)
    spans = {0: [("0F0", 0.2, 1.2), ("0F1", 1.4, 2.4), ("0B0", 8.4, 10.4), ("0B1", 11.6, 13.6)],
             1: [("1F0", 1.9, 2.9), ("1F1", 3.3, 4.3), ("1B0", 5.5, 7.5), ("1B1", 8.7, 10.7)]}
    for rank, row in spans.items():
        _same(t.rows[rank], row)
    step = {r: {"actions": row, "total_s": row[-1][2], "wall_start": 100.0, "paths": {}} for r, row in spans.items()}
    read = calibrate(step, stage_rank={0: 0, 1: 1}, comms=comms, overlap=False).costs
    r1 = (0.4 + 1.2 + 1.2) / 3
    assert dict(read.rank_overhead_s) == pytest.approx({0: 0.2, 1: r1})
    assert dict(read.kind_factor) == pytest.approx({"F": 0.4, "B": 1.6})
    assert read.p2p_s == pytest.approx((0.58 + 0.58 + (0.7 - r1 * 0.4)) / 3)
    before = calibrate(step, stage_rank={0: 0, 1: 1}, comms=comms, per_kind=False, overlap=False).costs
    assert not before.kind_factor and before.p2p_s == pytest.approx((0.7 + 0.7 + (0.7 - r1)) / 3)


def test_host_work_runs_while_the_input_is_in_flight():
    """The walk's default form (ours, 2026-11-24): after an action a rank does its host work at once,
    while its next input is in flight, and the next action starts at the later of the two; p2p is
    the delay from the send's posting to that start. gpipe pp=2, two micro-batches, torch's sends,
    F 1, B 2, host work 0.2 on rank 0 and 0.6 on rank 1, delay 0.5, by hand: 0F0 [.2, 1.2], 0F1
    [1.4, 2.4]; 1F0 max(0.6, 1.2 + .5) [1.7, 2.7], 1F1 max(3.3, 2.9) [3.3, 4.3], 1B0 [4.9, 6.9], 1B1
    [7.5, 9.5]; 0B0 max(2.6, 7.4) [7.4, 9.4], 0B1 max(9.6, 10.0) [10.0, 12.0]. Read back from that
    step with 0B1 started at 10.1 instead: p2p 0.5, the mean delay of the inputs that gated their
    action (1F0, 0B0: sent later than the rank's host work after its previous action would end;
    0B1's was sent 0.1 after, within rank 0's 0.2, so its 0.6 is left out), and the walk reproduces
    the step but 0B1. The form before (host work after the input is in): p2p = mean of start - sent
    - host over the three waits, (0.3 + 0.4 - 0.1) / 3. A walk given recorded delays draws one per
    input."""
    import random

    from torch.distributed.pipelining.schedules import _Action

    from engine.parallel.schedules import with_comms
    from tuning.calibrate.schedule import calibrate, predicted_timeline
    from tuning.sim.schedule import Costs, walk

    a = _Action.from_str
    actions = {0: [a("0F0"), a("0F1"), a("0B0"), a("0B1")], 1: [a("1F0"), a("1F1"), a("1B0"), a("1B1")]}
    comms = with_comms(actions, {0: 0, 1: 1})
    costs = Costs(p2p_s=0.5, rank_overhead_s={0: 0.2, 1: 0.6}, host_overlaps_wait=True)
    t = walk(actions, stage_rank={0: 0, 1: 1}, costs=costs, comms=comms)
    spans = {0: [("0F0", 0.2, 1.2), ("0F1", 1.4, 2.4), ("0B0", 7.4, 9.4), ("0B1", 10.0, 12.0)],
             1: [("1F0", 1.7, 2.7), ("1F1", 3.3, 4.3), ("1B0", 4.9, 6.9), ("1B1", 7.5, 9.5)]}
    for rank, row in spans.items():
        _same(t.rows[rank], row)

    spans[0][3] = ("0B1", 10.1, 12.1)
    step = {r: {"actions": row, "total_s": row[-1][2], "wall_start": 100.0, "paths": {}} for r, row in spans.items()}
    read = calibrate(step, stage_rank={0: 0, 1: 1}, comms=comms, per_kind=False).costs
    assert dict(read.rank_overhead_s) == pytest.approx({0: 0.2, 1: 0.6})
    assert read.p2p_s == pytest.approx(0.5) and sorted(read.p2p_draws) == pytest.approx([0.5, 0.5])
    walked = predicted_timeline(step, schedule="gpipe", pp=2, n_microbatches=2, per_kind=False)
    _same(walked.rows[0], spans[0][:3] + [("0B1", 10.0, 12.0)])
    _same(walked.rows[1], spans[1])
    before = calibrate(step, stage_rank={0: 0, 1: 1}, comms=comms, per_kind=False, overlap=False).costs
    assert before.p2p_s == pytest.approx((0.3 + 0.4 - 0.1) / 3)

    spread = Costs(p2p_s=0.5, p2p_draws=(0.1, 0.9), rank_overhead_s={0: 0.2, 1: 0.6}, host_overlaps_wait=True)
    starts = {walk(actions, stage_rank={0: 0, 1: 1}, costs=spread, comms=comms,
                   draw_p2p=random.Random(seed)).rows[1][0][1] for seed in range(8)}
    assert sorted(round(x, 9) for x in starts) == pytest.approx([1.3, 2.1])


def test_simulator_prices_every_schedule():
    from tuning.sim.simulator import SCHEDULES as SIM_SCHEDULES, ModelSpec, ParallelSpec, simulate
    from tuning.sim.hardware import load_cluster

    model = ModelSpec(layers=8, hidden=256, heads=4, seq=128, vocab=256)
    assert set(SIM_SCHEDULES) == set(SCHEDULES)
    bubbles = {}
    for name in SCHEDULES:
        par = ParallelSpec(pp=4, micro=1, global_batch=8, schedule=name,
                           virtual=2 if name in ("interleaved", "looped_bfs") else 1,
                           skip_ratio=0.5 if name == "skip" else 0.0)
        bubbles[name] = simulate(model, load_cluster("dgx-a100-80gb"), par).bubble_fraction
    assert bubbles["1f1b"] == pytest.approx(3 / 8) and bubbles["zbv"] < bubbles["1f1b"]


def test_validate_names_the_new_schedule_rules():
    from engine.config.schema import load_config
    from engine.errors import ConfigError, ConfigErrors

    def errors(*overrides: str) -> str:
        with pytest.raises((ConfigError, ConfigErrors)) as info:
            load_config(None, list(overrides))
        return str(info.value)

    assert "parallel.skip_ratio" in errors("parallel.skip_ratio=0.3")  # schedule is not skip
    assert "parallel.pp" in errors("parallel.schedule=skip", "parallel.pp=2", "batch.global=16", "batch.micro=2")
    assert "parallel.zero" in errors("parallel.schedule=zbv", "parallel.pp=2", "parallel.dp=2", "parallel.zero=3",
                                     "model.layers=4", "batch.global=16", "batch.micro=2")
    assert "parallel.virtual" in errors("parallel.schedule=gpipe", "parallel.pp=2", "parallel.virtual=2")


def test_schedule_virtual_and_skip_ratio_are_searchable():
    """tuning/space.py: SCHEDULE_PARAMS names every schedule (validate's names) and every point of
    its grid that the base config admits is a valid run config."""
    from engine.config.schema import load_config, replace
    from tuning.space import SCHEDULE_PARAMS, SearchSpace

    assert set(SCHEDULE_PARAMS["parallel.schedule"]["choices"]) == set(SCHEDULES)
    space = SearchSpace.from_dict({"params": SCHEDULE_PARAMS, "fixed": {}})
    base = load_config(None, ["parallel.pp=4", "model.layers=16", "batch.global=16", "batch.micro=2"])
    points = space.grid()
    assert {p["parallel.schedule"] for p in points} == set(SCHEDULES)
    assert {p.get("parallel.skip_ratio") for p in points if p["parallel.schedule"] == "skip"} == {0.33, 0.5}
    for point in points:
        replace(base, space.to_overrides(point, base))  # validates: raises on an invalid config


def test_search_enumerates_every_schedule():
    from tuning.sim.hardware import load_cluster
    from tuning.search import ALL_SCHEDULE_AXIS, enumerate_configs
    from tuning.sim.simulator import ModelSpec

    model = ModelSpec(layers=8, hidden=256, heads=4, seq=128, vocab=256)
    df = enumerate_configs(model, load_cluster("dgx-a100-80gb"), 8, 32, axes={"schedule": ALL_SCHEDULE_AXIS})
    assert set(df["schedule"].astype(str)) == set(SCHEDULES)
    pp4 = df[(df.pp == 4) & (df.micro == 1) & (df.zero == 0) & (df.recompute == "none") & ~df.sequence_parallel
             & (df.tp == 1) & (df.virtual == 1) & (df.cp == 1) & (df.ep == 1)].set_index("schedule")
    assert pp4.loc["zbv", "bubble_fraction"] < pp4.loc["1f1b", "bubble_fraction"]


def test_show_reads_the_executed_schedule(tmp_path):
    """workbench show / the Run page: measured bubble per rank = 1 - busy / step time from the
    recorded actions (hand-computed here), predicted from the 1f1b action list, and a grid figure."""
    from profilers.records import Record
    from profilers.store import RunStore
    from workbench.schedule_view import schedule_figure, schedule_report

    store = RunStore.open_home(tmp_path)
    cfg = {"parallel": {"pp": 2, "schedule": "1f1b", "dp": 1, "virtual": 1}, "batch": {"global": 4, "micro": 2},
           "model": {"layers": 2}}
    store.create_run("r1", name="t", config=cfg, world_size=2)
    # rank 0: 0F0 [0,1] 0F1 [1,2] 0B0 [4,6] 0B1 [7,9], step 10 s -> busy 6, bubble 0.4
    # rank 1: 1F0 [1,2] 1B0 [2,4] 1F1 [4,5] 1B1 [5,7], step 10 s -> busy 6, bubble 0.4
    spans = {0: [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 4, 6), ("0B1", 7, 9)],
             1: [("1F0", 1, 2), ("1B0", 2, 4), ("1F1", 4, 5), ("1B1", 5, 7)]}
    records = []
    for rank, actions in spans.items():
        records += [Record("r1", rank, 3, "schedule", "@total", 10.0, 0.0),
                    Record("r1", rank, 3, "schedule", "@wall_start", 100.0, 0.0)]
        for name, start, end in actions:
            records += [Record("r1", rank, 3, "schedule", f"{name}@start", float(start), 0.0),
                        Record("r1", rank, 3, "schedule", f"{name}@end", float(end), 0.0)]
    store.write(records)
    report = schedule_report(store, "r1")
    assert report["step"] == 3 and report["schedule"] == "1f1b"
    assert report["per_rank"][0]["measured"] == pytest.approx(0.4)
    assert report["per_rank"][1]["measured"] == pytest.approx(0.4)
    # predicted: F 1 s, B 2 s (the measured means) on the 1f1b list, no gap waited on nothing (no
    # overhead, no p2p), tails 1 and 3 s (mean 2): rank 0 ends its last B at 9 -> window 11, rank 1 at 7 -> 9
    assert report["per_rank"][0]["predicted"] == pytest.approx(1 - 6 / 11)
    assert report["per_rank"][1]["predicted"] == pytest.approx(1 - 6 / 9)
    fig = schedule_figure(report)
    assert {trace.name for trace in fig.data} == {"F", "B"}
    assert sum(len(trace.x) for trace in fig.data) == 8


def test_a_step_priced_from_another_runs_costs():
    """Out of sample (issue 36.3): `priced_from` reads the prices off another recorded step, so a
    step can be predicted from an earlier run's costs; pricing a step from itself is the default."""
    from tuning.calibrate.schedule import predicted_timeline

    step = {0: {"actions": [("0F0", 0.5, 1.5), ("0B0", 7.0, 9.0)], "total_s": 9.5, "wall_start": 100.0, "paths": {}},
            1: {"actions": [("1F0", 2.25, 3.25), ("1B0", 3.75, 5.75)], "total_s": 6.25, "wall_start": 100.25,
                "paths": {}}}
    slow = {0: {"actions": [("0F0", 0.5, 1.5), ("0B0", 9.0, 11.0)], "total_s": 11.5, "wall_start": 100.0, "paths": {}},
            1: {"actions": [("1F0", 2.25, 3.25), ("1B0", 3.75, 7.75)], "total_s": 8.25, "wall_start": 100.25,
                "paths": {}}}
    kw = dict(schedule="1f1b", pp=2, n_microbatches=1)
    own, crossed = predicted_timeline(step, **kw), predicted_timeline(step, priced_from=slow, **kw)
    assert predicted_timeline(step, priced_from=step, **kw).rows == own.rows
    assert crossed.rows == predicted_timeline(slow, **kw).rows != own.rows
    assert crossed.bubble_fraction(0) > own.bubble_fraction(0)  # rank 1's backward took 4, not 2
