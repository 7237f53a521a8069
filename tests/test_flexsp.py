"""FlexSP's per-step solver (engine/parallel/flexsp.py): cases whose optimum is worked out by hand."""
from __future__ import annotations

import random

import pytest

from engine.parallel.flexsp import CostModel, bucketize, greedy_plan, solve

HUGE = 1e6  # an all-to-all cost per token that rules a group size out


def _valid(plan, lengths: list[int], n: int, cap: int) -> None:
    assert sum(plan.sizes) == n  # every device used
    assert all(g & (g - 1) == 0 for g in plan.sizes)  # powers of two
    assert sorted(i for m in plan.members for i in m) == list(range(len(lengths)))  # each sequence once
    for g, m in zip(plan.sizes, plan.members):
        assert sum(lengths[i] for i in m) <= cap * g  # tokens per rank under the cap


def test_bucketize_minimises_padding():
    # three natural clusters: any other 3-way split pads more
    assert bucketize([1, 2, 3, 10, 11, 12, 50], 3) == [(3, [0, 1, 2]), (12, [3, 4, 5]), (50, [6])]


def test_two_long_and_four_short_sequences_go_to_two_groups_of_two():
    # attention only (a1=1): T(s, g) = s^2 / g; groups of 4 priced out by their all-to-all.
    # [2,2] with one long (8) and two short (1) each: (64 + 1 + 1) / 2 = 33.
    # [2,1,1]: both longs in the pair: 128 / 2 = 64; [1,1,1,1]: a long alone takes 64. Optimum 33.
    lengths = [8, 8, 1, 1, 1, 1]
    cost = CostModel(a1=1.0, a2=0.0, a2a={4: HUGE})
    plan = solve(lengths, n=4, cap=100, cost=cost, buckets=2, time_limit_s=5.0)
    _valid(plan, lengths, 4, 100)
    assert sorted(plan.sizes) == [2, 2]
    assert plan.predicted_s == pytest.approx(33.0)
    assert all(sorted(lengths[i] for i in m) == [1, 1, 8] for m in plan.members)


def test_short_sequences_stay_on_single_ranks():
    # equal short sequences, linear cost: four groups of one rank beat any sequence-parallel group
    # once all-to-all costs anything: 2 sequences of 10 per rank = 20; a pair: 4 x (10 + 2) / 2 = 24
    lengths = [10] * 8
    cost = CostModel(a1=0.0, a2=1.0, a2a={2: 0.2, 4: 0.4})
    plan = solve(lengths, n=4, cap=100, cost=cost, time_limit_s=5.0)
    assert plan.sizes == [1, 1, 1, 1]
    assert plan.predicted_s == pytest.approx(20.0)
    # 80 device-seconds at best (every sequence on one rank) over 4 ranks: 20, what the greedy plan
    # reaches, so HiGHS never starts
    assert plan.status == "within gap of the lower bound" and plan.milp_size == (0, 0)


def test_memory_cap_forces_the_whole_world_into_one_group():
    # 30 tokens with 10 per rank fit only a group of 4 ranks (30 <= 40); the rest must join it
    lengths = [30, 5, 5]
    plan = solve(lengths, n=4, cap=12, cost=CostModel(a1=0.0, a2=1.0), time_limit_s=5.0)
    _valid(plan, lengths, 4, 12)
    assert plan.sizes == [4]


def test_a_sequence_larger_than_the_cluster_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"sequence of 50 tokens exceeds the memory of all 4 ranks \(10 tokens each\)"):
        solve([50, 1], n=4, cap=10, cost=CostModel(a1=0.0, a2=1.0))


def _long_tail(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [int(min(4000, max(16, rng.lognormvariate(6.0, 1.0)))) for _ in range(n)]


def test_time_limit_still_gives_a_valid_plan():
    lengths = _long_tail(60, seed=3)
    cost = CostModel(a1=1e-6, a2=1e-4, a2a={2: 2e-5, 4: 3e-5, 8: 4e-5})
    plan = solve(lengths, n=8, cap=8000, cost=cost, buckets=16, time_limit_s=0.01)
    _valid(plan, lengths, 8, 8000)
    assert "time limit" in plan.status.lower() or plan.status in ("optimal", "within gap of the lower bound")


def test_greedy_fallback_is_lpt_on_the_smallest_group_size_that_fits():
    # longest first to the least-loaded rank with room: {7, 2} and {5, 4} -> slowest 9 (linear cost)
    plan = greedy_plan([7, 5, 4, 2], n=2, cap=10, cost=CostModel(a1=0.0, a2=1.0))
    assert plan.sizes == [1, 1] and plan.solver == "greedy"
    assert sorted(sorted([7, 5, 4, 2][i] for i in m) for m in plan.members) == [[2, 7], [4, 5]]
    assert plan.predicted_s == pytest.approx(9.0)
    # 14 tokens cannot sit on single ranks of 10: the pair it is
    assert greedy_plan([14, 1], n=2, cap=10, cost=CostModel(a1=0.0, a2=1.0)).sizes == [2]


def test_milp_beats_every_uniform_group_size_on_a_long_tail():
    from engine.parallel.flexsp import evaluate

    lengths = _long_tail(40, seed=0)
    cost = CostModel(a1=2e-6, a2=1e-4, a2a={2: 3e-5, 4: 5e-5})
    plan = solve(lengths, n=4, cap=12000, cost=cost, buckets=8, time_limit_s=5.0)
    _valid(plan, lengths, 4, 12000)
    uniform = [greedy_plan(lengths, n=4, cap=12000, cost=cost).predicted_s]
    assert plan.predicted_s <= min(uniform) + 1e-12
    assert plan.predicted_s == pytest.approx(evaluate(plan.sizes, plan.members, lengths, cost))


def test_slots_are_pruned_as_flexsp_does():
    from engine.parallel.flexsp import slot_sizes

    # one sequence needs a pair: the single ranks share the 2 ranks that pair leaves
    assert slot_sizes([2, 1, 1], 4) == [1, 1, 2, 2, 4]
    assert slot_sizes([1, 1], 4) == [1, 1, 1, 1, 2, 2, 4]  # nothing long: every slot
    assert slot_sizes([4, 1], 4) == [4]  # the whole world is needed
    assert slot_sizes([2, 2, 2], 4) == [2, 2, 4]  # more pairs needed than fit: no single slots left


def test_a_constant_per_group_keeps_short_sequences_on_single_ranks():
    # linear cost, a2=1: [2,2] with {30} and {10,10,10} gives 15 (as does [4]: 60/4) against 30 for
    # single ranks (the 30 alone); a constant of 100 per group of 2 or 4 ranks makes singles best
    lengths = [10, 10, 10, 30]
    free = solve(lengths, n=4, cap=100, cost=CostModel(a1=0.0, a2=1.0), time_limit_s=5.0)
    assert free.predicted_s == pytest.approx(15.0) and free.sizes != [1, 1, 1, 1]
    priced = solve(lengths, n=4, cap=100, cost=CostModel(a1=0.0, a2=1.0, group_bias={2: 100.0, 4: 100.0}),
                   time_limit_s=5.0)
    assert priced.sizes == [1, 1, 1, 1] and priced.predicted_s == pytest.approx(30.0)


def test_the_work_cut_gives_the_lp_relaxation_the_device_seconds_bound():
    # the case above with two long and four short sequences: every plan spends 8^2 + 8^2 + 4 x 1^2 = 132
    # device-seconds (groups of 4 priced out), so M >= 132 / 4 = 33 already in the LP relaxation
    from scipy.optimize import Bounds, LinearConstraint, milp

    from engine.parallel.flexsp import build_milp

    cost = CostModel(a1=1.0, a2=0.0, a2a={4: HUGE})
    model = build_milp([(1, [2, 3, 4, 5]), (8, [0, 1])], n=4, cap=100, cost=cost, upper=None)
    relaxed = milp(model.c, bounds=Bounds(0, model.ub), constraints=LinearConstraint(model.A, model.lo, model.hi))
    assert relaxed.fun == pytest.approx(33.0)
    assert model.size == (2 * 7 + 7 + 1, model.A.shape[0])  # A[k,p], m[p], M over 7 slots


def test_group_overhead_is_split_into_per_token_and_constant_parts():
    from engine.parallel.adaptive_sp import fit_group_overhead

    base = CostModel(a1=0.0, a2=1e-3, bias=0.01)
    # g=2, 0.002 s per token of the rank's share and 0.05 s per group on top of 1/2 the compute + bias:
    # s=512: 0.256 + 0.01 + 0.002 * 256 + 0.05 = 0.828; s=1024: 0.512 + 0.01 + 0.002 * 512 + 0.05 = 1.596
    slope, const = fit_group_overhead(base, 2, {512: 0.828, 1024: 1.596})
    assert slope == pytest.approx(0.002) and const == pytest.approx(0.05)
    # a line tilted down by noise: no negative per-token cost, the mean excess becomes the constant
    slope, const = fit_group_overhead(base, 2, {512: 0.5, 1024: 0.5})
    assert slope == 0.0 and const == pytest.approx(((0.5 - 0.266) + (0.5 - 0.522)) / 2)


def test_a_per_sequence_constant_is_paid_by_every_rank_of_the_group():
    # a2=1, 5 s per sequence not split over the group: a pair runs two sequences of 10 in
    # 2 x (10/2 + 5) = 20, a single rank one in 10 + 5 = 15, so four single ranks it is
    cost = CostModel(a1=0.0, a2=1.0, a2a={4: HUGE}, per_seq=5.0)
    assert cost.seq_time(10, 2) == pytest.approx(10.0)
    plan = solve([10] * 4, n=4, cap=100, cost=cost, time_limit_s=5.0)
    assert plan.sizes == [1, 1, 1, 1] and plan.predicted_s == pytest.approx(15.0)


def test_a_group_size_the_model_did_not_calibrate_is_refused_not_free():
    # calibrated: 1 and 2 only. Free communication at size 4 would make [4] the plan for one long
    # sequence (64/4 = 16 < 64/2 = 32); an uncalibrated size is never planned and cannot be priced.
    cost = CostModel(a1=1.0, a2=0.0, a2a={2: 0.0}, sizes=(1, 2))
    plan = solve([8, 1, 1], n=4, cap=100, cost=cost, time_limit_s=5.0)
    assert 4 not in plan.sizes and sum(plan.sizes) == 4
    with pytest.raises(ValueError, match="group size 4 was not calibrated"):
        cost.seq_time(8, 4)
    with pytest.raises(ValueError, match="largest usable \\(calibrated\\) group"):
        solve([300], n=4, cap=100, cost=cost)
