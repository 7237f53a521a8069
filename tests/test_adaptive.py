"""L-GreCo solver against brute force, error tables, and the adaptive hook in a 2-rank DDP run."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.distributed as dist
from parallel_harness import run_ranks

from engine.comm.adaptive import (
    apply_adaptive,
    lowrank_errors,
    measure_errors,
    solve_levels,
    topk_errors,
)
from engine.comm.compress import error_feedback, k_for

WORLD = 2


def _brute_force(errors: list[list[float]], sizes: list[list[int]], budget: float) -> float:
    best = float("inf")
    for combo in itertools.product(*(range(len(r)) for r in errors)):
        if sum(errors[l][c] for l, c in enumerate(combo)) <= budget:
            best = min(best, sum(sizes[l][c] for l, c in enumerate(combo)))
    return best


def _cost(rows: list[list[float]], picked: list[int]) -> float:
    return sum(rows[l][c] for l, c in enumerate(picked))


def test_solver_equals_brute_force_integer_instances() -> None:
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        layers, levels = rng.randint(1, 4), rng.randint(1, 4)
        errors = [[float(rng.randint(0, 12)) for _ in range(levels)] for _ in range(layers)]
        sizes = [[rng.randint(1, 100) for _ in range(levels)] for _ in range(layers)]
        budget = rng.randint(0, 30)
        want = _brute_force(errors, sizes, budget)
        if want == float("inf"):
            with pytest.raises(ValueError, match="no assignment fits error budget"):
                solve_levels(errors, sizes, budget, bins=max(1, budget))
            continue
        # bins = budget: every error is a whole number of units, so the DP is exact
        picked = solve_levels(errors, sizes, budget, bins=max(1, budget))
        assert _cost(errors, picked) <= budget
        assert _cost(sizes, picked) == want
        checked += 1
    assert checked > 100


def test_solver_float_instances_bounded_by_rounding() -> None:
    rng = random.Random(1)
    bins = 200
    for _ in range(200):
        layers, levels = rng.randint(1, 5), rng.randint(2, 4)
        errors = [[rng.random() for _ in range(levels)] for _ in range(layers)]
        sizes = [[rng.randint(1, 1000) for _ in range(levels)] for _ in range(layers)]
        budget = rng.uniform(0.2, 1.0) * layers
        if _brute_force(errors, sizes, budget * (1 - layers / bins)) == float("inf"):
            continue
        picked = solve_levels(errors, sizes, budget, bins=bins)
        size = _cost(sizes, picked)
        assert _cost(errors, picked) <= budget * (1 + 1e-9)
        # optimal for the true budget at best, and no worse than the optimum for a budget
        # shrunk by the rounding loss (< 1 unit per layer)
        assert _brute_force(errors, sizes, budget) <= size
        assert size <= _brute_force(errors, sizes, budget * (1 - layers / bins))


def test_topk_errors_match_error_feedback() -> None:
    t = torch.randn(3000, generator=torch.Generator().manual_seed(4))
    densities = [0.001, 0.01, 0.1, 1.0]
    errors, sizes = topk_errors(t, densities)
    for d, e, s in zip(densities, errors, sizes):
        k = k_for(3000, d)
        _, _, residual = error_feedback(t, None, k)
        assert e == pytest.approx(float(residual.double().square().sum()), rel=1e-6, abs=1e-9)
        assert s == 8 * k
    assert errors == sorted(errors, reverse=True) and errors[-1] == 0.0


def test_lowrank_errors_zero_at_true_rank() -> None:
    gen = torch.Generator().manual_seed(5)
    m = torch.randn(40, 3, generator=gen) @ torch.randn(3, 60, generator=gen)
    errors, sizes = lowrank_errors(m, [1, 2, 3, 4])
    assert errors[0] > errors[1] > 1e-6
    assert errors[2] == pytest.approx(0.0, abs=1e-8) and errors[3] == pytest.approx(0.0, abs=1e-8)
    assert sizes == [100 * r * 4 for r in (1, 2, 3, 4)]
    assert lowrank_errors(torch.randn(7), [1, 2]) == ([0.0, 0.0], [28, 28])


def test_measure_errors_table_shape() -> None:
    grads = {"a": torch.randn(100), "b": torch.randn(10, 20)}
    table = measure_errors(grads, [0.01, 0.1])
    assert table.names == ["a", "b"] and len(table.errors) == 2 and len(table.errors[0]) == 2
    low = measure_errors(grads, [1, 2], method="powersgd")
    assert low.sizes[0] == [400, 400]
    with pytest.raises(ValueError, match="method='svd' must be"):
        measure_errors(grads, [1], method="svd")


# ---- 2-rank gloo DDP ---------------------------------------------------------------------


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(200, 16)  # row-sparse gradient: cheap to compress exactly
        self.fc1 = torch.nn.Linear(16, 64)
        self.fc2 = torch.nn.Linear(64, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.emb(ids))))


def _run(rank: int, levels: tuple[float, ...], default: float) -> dict:
    model, plain = _Net(), _Net()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    comp = apply_adaptive(ddp, levels=levels, default_level=default, error_budget=1.0, interval=2, bins=500)
    history, grads = [], []
    for step in range(5):
        history.append(comp.chosen_levels)  # levels this step uses (a solve applies from the next)
        gen = torch.Generator().manual_seed(10 * step + rank)
        ids, y = torch.randint(0, 200, (4,), generator=gen), torch.randn(4, 8, generator=gen)
        for m in (ddp, plain):
            m.zero_grad()
            torch.nn.functional.mse_loss(m(ids), y).backward()
        ref = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
        dist.all_reduce(ref)
        grads.append((torch.cat([p.grad.reshape(-1) for p in model.parameters()]), ref / WORLD))
    return {
        "history": history, "grads": grads, "solves": comp.solves, "budget": comp.last_budget,
        "error": comp.last_error, "bytes": comp.last_bytes, "uniform_bytes": comp.last_uniform_bytes,
        "wire": comp.wire_bytes, "dense": comp.dense_bytes,
    }


def _live_density_run(rank: int) -> dict:
    """A live comm.density change through the engine's apply_live_knobs between solves (issue 14:
    the next solve looked the new density up in the candidate levels and crashed)."""
    from types import SimpleNamespace

    from engine.train.comm_setup import apply_live_knobs
    from engine.config.schema import load_config

    model = _Net()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    comp = apply_adaptive(ddp, levels=(0.001, 0.01, 0.05), default_level=0.05, interval=2, bins=500)
    cfg = load_config(None, ["parallel.dp=2", "comm.compressor=topk", "comm.adaptive=true", "comm.density=0.05"])
    monitor = SimpleNamespace(compressor_state=comp, link=None)
    history = []
    for step in range(5):
        if step == 1:
            apply_live_knobs({"comm.density": 0.02}, start=cfg, now=cfg, comm=monitor)
        history.append(comp.chosen_levels)
        gen = torch.Generator().manual_seed(10 * step + rank)
        ddp.zero_grad()
        torch.nn.functional.mse_loss(ddp(torch.randint(0, 200, (4,), generator=gen)),
                                     torch.randn(4, 8, generator=gen)).backward()
    return {"history": history, "solves": comp.solves, "levels": comp.levels}


def _all_runs(rank: int, world: int) -> dict:
    return {"adaptive": _run(rank, (0.001, 0.01, 0.05, 0.2), 0.05), "lossless": _run(rank, (1.0,), 1.0),
            "live": _live_density_run(rank)}


@pytest.fixture(scope="module")
def runs() -> dict:
    return dict(enumerate(run_ranks(WORLD, _all_runs)))


@pytest.mark.slow
def test_adaptive_levels_shared_and_within_budget(runs: dict) -> None:
    a0, a1 = runs[0]["adaptive"], runs[1]["adaptive"]
    assert a0["history"] == a1["history"]  # same levels everywhere, or the all_gathers would break
    assert a0["solves"] == 3  # steps 0, 2, 4 with interval 2
    assert set(a0["history"][0].values()) == {0.05}  # before the first solve: uniform default
    assert len(set(a0["history"][-1].values())) > 1  # the solver chose per-layer levels
    assert a0["error"] <= a0["budget"] * (1 + 1e-9)
    assert a0["bytes"] <= a0["uniform_bytes"]
    assert 0 < a0["wire"] < a0["dense"]
    for step in range(5):
        assert torch.equal(a0["grads"][step][0], a1["grads"][step][0])


@pytest.mark.slow
def test_adaptive_lossless_level_equals_dense(runs: dict) -> None:
    for rank in range(WORLD):
        for got, ref in runs[rank]["lossless"]["grads"]:
            assert float((got - ref).abs().max()) <= 1e-6


@pytest.mark.slow
def test_live_density_change_survives_the_next_solve(runs: dict) -> None:
    live0, live1 = runs[0]["live"], runs[1]["live"]
    assert live0["solves"] == live1["solves"] == 3  # steps 0, 2, 4: the solves after the change ran
    assert live0["history"] == live1["history"]
    assert set(live0["history"][1].values()) == {0.02}  # the new density acts from the next step
    assert 0.02 in live0["levels"]
