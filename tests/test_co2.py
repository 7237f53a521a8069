"""CO2 outer loop in real 2-rank gloo runs: exact synchronous DP limit, staleness, bytes, knobs."""

from __future__ import annotations

import pytest
import torch
from parallel_harness import run_ranks

from engine.comm.co2 import CO2

WORLD = 2
STEPS = 6


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


def _local_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()


def _vec(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def _sync_vs_dp(rank: int) -> dict:
    dp_model, co2_model = _mlp(), _mlp()
    ddp = torch.nn.parallel.DistributedDataParallel(dp_model)
    dp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    co2_opt = torch.optim.SGD(co2_model.parameters(), lr=0.1)
    co2 = CO2(co2_model, co2_opt, tau=1, outer_lr=1.0, outer_momentum=0.0, staleness_penalty=False,
              async_op=False)
    diffs = []
    for step in range(STEPS):
        _local_step(ddp, dp_opt, rank, step)
        dp_opt.step()
        _local_step(co2_model, co2_opt, rank, step)
        co2.step(step)
        diffs.append(float((_vec(dp_model) - _vec(co2_model)).abs().max()))
    moved = float((_vec(dp_model) - _vec(_mlp())).abs().max())
    return {"diffs": diffs, "moved": moved, "wire": co2.wire_bytes, "dense": co2.dense_bytes}


def _async_run(rank: int) -> dict:
    model = _mlp()
    init = _vec(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    bytes_log: list[tuple[int, int]] = []
    co2 = CO2(model, opt, tau=2, outer_lr=0.8, outer_momentum=0.5, nesterov=True, clip=0.05,
              staleness_penalty=True, async_op=True, on_bytes=lambda w, d: bytes_log.append((w, d)))
    after_round, penalties, momentum_norms, outer = [], [], [], []
    for step in range(4 * 2 + 3):
        if step == 8:
            co2.set_knobs(tau=3, outer_lr=1.0)
        _local_step(model, opt, rank, step)
        if co2.step(step):
            outer.append(step)
            after_round.append(_vec(model))
            penalties.append(list(co2.last_penalty))
            momentum_norms.append(float(co2.momentum.norm()))
    before_flush = _vec(model)
    co2.flush()
    return {
        "init": init, "after_round": after_round, "penalties": penalties, "outer": outer,
        "momentum_norms": momentum_norms, "before_flush": before_flush, "final": _vec(model),
        "bytes": bytes_log, "wire": co2.wire_bytes, "dense": co2.dense_bytes,
    }


def _link_run(rank: int) -> dict:
    import time

    from engine.comm.link import LinkEmulator

    out = {}
    for async_op in (False, True):
        model = _mlp()
        nbytes = sum(p.numel() for p in model.parameters()) * 4
        link = LinkEmulator(gbps=nbytes * 8 / 1e9 / 0.3)  # each outer all-reduce: 300 ms
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        co2 = CO2(model, opt, tau=1, async_op=async_op, staleness_penalty=False, link=link)
        took = []
        for step in range(3):
            _local_step(model, opt, rank, step)
            time.sleep(0.35)  # "compute" longer than the link needs
            start = time.perf_counter()
            co2.step(step)
            took.append(time.perf_counter() - start)
        co2.flush()
        out[async_op] = took
    return out


def _all_runs(rank: int, world: int) -> dict:
    return {"sync": _sync_vs_dp(rank), "async": _async_run(rank), "link": _link_run(rank)}


@pytest.fixture(scope="module")
def runs() -> dict:
    return dict(enumerate(run_ranks(WORLD, _all_runs)))


@pytest.mark.slow
def test_tau1_sync_equals_data_parallel(runs: dict) -> None:
    for rank in range(WORLD):
        res = runs[rank]["sync"]
        assert res["moved"] > 1e-3  # the models really trained
        assert max(res["diffs"]) <= 1e-6, res["diffs"]
        assert res["wire"] == res["dense"]  # tau=1 sends as much as DP


@pytest.mark.slow
def test_async_rounds_are_stale_and_shared(runs: dict) -> None:
    a0, a1 = runs[0]["async"], runs[1]["async"]
    assert a0["outer"] == [1, 3, 5, 7, 10]  # tau 2, then 3 from step 8
    # every rank restarts each round from the same point
    for v0, v1 in zip(a0["after_round"] + [a0["final"]], a1["after_round"] + [a1["final"]]):
        assert torch.equal(v0, v1)
    # round 0's average is still in flight at its end: the start point is unchanged
    assert torch.equal(a0["after_round"][0], a0["init"])
    assert not torch.equal(a0["after_round"][1], a0["init"])
    # flush applies the last in-flight round
    assert not torch.equal(a0["final"], a0["before_flush"])


@pytest.mark.slow
def test_async_penalty_clip_and_bytes(runs: dict) -> None:
    a = runs[0]["async"]
    assert a["penalties"][0] == []  # nothing applied in round 0
    first = a["penalties"][1]
    assert first and all(f == 1.0 for f in first)  # round 1 applies round 0 at the same start point
    later = [f for p in a["penalties"][2:] for f in p]
    assert later and all(0.0 < f < 1.0 for f in later)  # the start point moved: penalised
    assert max(a["momentum_norms"]) <= 0.05 + 1e-6
    assert max(a["momentum_norms"]) > 0.0
    steps = len(a["bytes"])
    assert a["dense"] == sum(d for _, d in a["bytes"]) and a["wire"] == sum(w for w, _ in a["bytes"])
    # 5 rounds over 11 steps: wire = 5/11 of what DP would send
    assert a["wire"] * steps == pytest.approx(a["dense"] * len(a["outer"]), rel=1e-9)


def test_knob_validation_messages() -> None:
    obj = CO2.__new__(CO2)
    with pytest.raises(ValueError, match="co2.tau=0 must be >= 1"):
        CO2.set_knobs(obj, tau=0)
    with pytest.raises(ValueError, match="co2.outer_momentum=1.0 must be in"):
        CO2.set_knobs(obj, outer_momentum=1.0)


@pytest.mark.slow
def test_link_delay_hidden_only_when_async(runs: dict) -> None:
    took = runs[0]["link"]
    assert min(took[False]) >= 0.3  # a blocking outer all-reduce pays the whole link time
    assert max(took[True]) < 0.2  # launched a round earlier, it finished behind the compute
