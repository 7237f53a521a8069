"""Compressor math (pure) and the hooks in a real 2-rank gloo DDP run."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from parallel_harness import run_ranks

from engine.comm.compress import (
    apply_compression,
    densify,
    dequantize_int8,
    error_feedback,
    int8_scale,
    k_for,
    make_comm_hook,
    quantize_int8,
    randk_compress,
    randk_indices,
    topk_compress,
)

WORLD = 2


# ---- pure math ---------------------------------------------------------------------------


def test_topk_keeps_exactly_k_largest() -> None:
    gen = torch.Generator().manual_seed(1)
    t = torch.randn(1000, generator=gen)
    for k in (1, 7, 100, 1000):
        values, indices = topk_compress(t, k)
        assert values.numel() == k and indices.unique().numel() == k
        kept = t.abs()[indices]
        dropped = torch.ones(1000, dtype=torch.bool)
        dropped[indices] = False
        if k < 1000:
            assert kept.min() >= t.abs()[dropped].max()
        assert torch.equal(values, t[indices])


def test_error_feedback_conserves_residual() -> None:
    gen = torch.Generator().manual_seed(2)
    residual = None
    for _ in range(5):
        grad = torch.randn(500, generator=gen)
        old = torch.zeros(500) if residual is None else residual.clone()
        values, indices, residual = error_feedback(grad, residual, 10)
        sent = densify(values, indices, 500)
        assert torch.count_nonzero(sent) <= 10
        torch.testing.assert_close(sent + residual, grad + old, rtol=0, atol=1e-6)
        assert torch.all(residual[indices] == 0)


def test_k_for_bounds() -> None:
    assert k_for(1000, 0.01) == 10
    assert k_for(10, 0.001) == 1
    assert k_for(10, 1.0) == 10


def test_randk_shared_seed_and_distinct() -> None:
    a, b = randk_indices(10_000, 100, seed=5), randk_indices(10_000, 100, seed=5)
    assert torch.equal(a, b)
    assert a.unique().numel() == 100
    assert not torch.equal(a, randk_indices(10_000, 100, seed=6))


def test_randk_unbiased() -> None:
    # Each entry's estimate is x_i * (n/k) * Bernoulli(k/n): mean x_i, variance x_i^2 (n/k - 1).
    # Over S seeds the mean's standard error is |x_i| sqrt((n/k - 1)/S); allow 5 of them
    # (|z| > 5 has probability 6e-7 per entry, 3e-5 over the 50 entries).
    n, k, seeds = 50, 5, 4000
    x = torch.linspace(-2.0, 3.0, n, dtype=torch.float64)
    total = torch.zeros(n, dtype=torch.float64)
    for s in range(seeds):
        values, indices = randk_compress(x, k, seed=s)
        total += densify(values, indices, n)
    mean = total / seeds
    stderr = x.abs() * math.sqrt((n / k - 1) / seeds)
    assert torch.all((mean - x).abs() <= 5 * stderr + 1e-12)
    # and it is not trivially exact: a single draw is far from x
    one = densify(*randk_compress(x, k, seed=0), n)
    assert (one - x).abs().max() > 0.5


def test_int8_round_trip_error_bounded() -> None:
    gen = torch.Generator().manual_seed(3)
    t = torch.randn(10_000, generator=gen) * 3
    scale = int8_scale(float(t.abs().max()))
    q = quantize_int8(t, scale)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    err = (dequantize_int8(q, scale) - t).abs()
    assert float(err.max()) <= scale / 2 + 1e-6
    assert float(err.max()) > scale / 4  # real rounding happens


def test_unknown_compressor_message() -> None:
    with pytest.raises(ValueError, match="comm.compressor='zip' is not one of none, fp16"):
        make_comm_hook("zip")


# ---- 2-rank gloo DDP ---------------------------------------------------------------------


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 16),
    )


def _flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


CASES = [
    ("none", 0.01),
    ("fp16", 0.01),
    ("bf16", 0.01),
    ("int8", 0.01),
    ("topk", 0.01),
    ("topk", 1.0),
    ("randk", 0.01),
    ("randk", 1.0),
]


def _run_case(rank: int, compressor: str, density: float) -> dict:
    model, plain = _mlp(), _mlp()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    per_step: list[tuple[int, int]] = []
    state = apply_compression(
        ddp, compressor, density=density, seed=7, on_bytes=lambda w, d: per_step.append((w, d))
    )
    steps = []
    for step in range(2):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 16, generator=gen)
        for m in (ddp, plain):
            m.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
        ref = _flat_grad(plain)
        dist.all_reduce(ref)
        steps.append((_flat_grad(model).clone(), ref / WORLD))
    return {"steps": steps, "wire": state.wire_bytes, "dense": state.dense_bytes, "calls": per_step}


def _run_powersgd(rank: int) -> dict:
    # batch of 2 => each weight gradient has rank <= 2; the same x on both ranks and a loss
    # scaled by (rank + 1) keep the rank-averaged gradient (1.5 x the unscaled one) rank 2
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    plain = torch.nn.Sequential(torch.nn.Linear(24, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    plain.load_state_dict(model.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)  # 2+ buckets
    state = apply_compression(ddp, "powersgd", rank=2, seed=3)
    gen = torch.Generator().manual_seed(11)
    x, y = torch.randn(2, 24, generator=gen), torch.randn(2, 8, generator=gen)
    out = []
    for step in range(5):
        if step == 4:
            state.set_level(rank=1)
        before = state.wire_bytes
        for m, scale in ((ddp, rank + 1.0), (plain, 1.5)):
            m.zero_grad()
            ((m(x) * y).sum() * scale).backward()
        out.append({"got": _flat_grad(model).clone(), "want": _flat_grad(plain).clone(),
                    "wire": state.wire_bytes - before})
    return {"steps": out, "dense_per_step": state.dense_bytes // 5}


def _all_cases(rank: int, world: int) -> dict:
    results = {f"{c}@{d}": _run_case(rank, c, d) for c, d in CASES}
    results["powersgd"] = _run_powersgd(rank)
    return results


@pytest.fixture(scope="module")
def ddp_results() -> dict:
    return dict(enumerate(run_ranks(WORLD, _all_cases)))


def _cases_without_all_gather_single(rank: int, world: int) -> dict:
    """The sparse and int8 hooks on a torch without `dist.all_gather_single` (it came in 2.13)."""
    # only the public name: torch 2.13's own all_gather_into_tensor calls c10d's all_gather_single
    if hasattr(dist, "all_gather_single"):
        delattr(dist, "all_gather_single")
    return {f"{c}@{d}": _run_case(rank, c, d) for c, d in (("int8", 0.01), ("topk", 0.01), ("randk", 0.01))}


@pytest.mark.slow
def test_hooks_run_on_torch_without_all_gather_single(ddp_results: dict) -> None:
    """Older torch (the H100 image's 2.11) has only `all_gather_into_tensor`: the hooks
    failed there with "no attribute 'all_gather_single'"; they must give the same result."""
    for rank, out in enumerate(run_ranks(WORLD, _cases_without_all_gather_single)):
        for case, got in out.items():
            want = ddp_results[rank][case]
            assert got["wire"] == want["wire"], case
            for (g, _), (w, _) in zip(got["steps"], want["steps"], strict=True):
                assert torch.equal(g, w), case


def _max_err(result: dict, step: int) -> float:
    got, ref = result["steps"][step]
    return float((got - ref).abs().max())


@pytest.mark.slow
def test_lossless_hooks_equal_dense_allreduce(ddp_results: dict) -> None:
    for rank in range(WORLD):
        for case in ("none@0.01", "topk@1.0", "randk@1.0"):
            for step in range(2):
                assert _max_err(ddp_results[rank][case], step) <= 1e-6, (case, step)


@pytest.mark.slow
def test_cast_hooks_within_tolerance(ddp_results: dict) -> None:
    for case, rtol in (("fp16@0.01", 2e-3), ("bf16@0.01", 1e-2)):
        for step in range(2):
            got, ref = ddp_results[0][case]["steps"][step]
            assert float((got - ref).abs().max()) <= rtol * float(ref.abs().max()), case
            assert not torch.equal(got, ref)  # it really went through 16 bits


@pytest.mark.slow
def test_int8_within_half_scale(ddp_results: dict) -> None:
    got, ref = ddp_results[0]["int8@0.01"]["steps"][0]
    # every bucket's scale is at most the global max |g| over ranks / 127
    local_max = max(float(r["int8@0.01"]["steps"][0][1].abs().max()) for r in ddp_results.values())
    assert float((got - ref).abs().max()) > 0
    assert float((got - ref).abs().max()) <= (WORLD * local_max / 127) / 2 + 1e-7


@pytest.mark.slow
def test_all_ranks_agree(ddp_results: dict) -> None:
    for case in ddp_results[0]:
        if case == "powersgd":
            continue
        for step in range(2):
            got0, got1 = (ddp_results[r][case]["steps"][step][0] for r in range(WORLD))
            assert torch.equal(got0, got1), case


@pytest.mark.slow
def test_wire_bytes_really_change(ddp_results: dict) -> None:
    r = ddp_results[0]
    ratio = {case: r[case]["wire"] / r[case]["dense"] for case in r if case != "powersgd"}
    assert ratio["none@0.01"] == 1.0
    assert ratio["fp16@0.01"] == pytest.approx(0.5, abs=1e-9)
    assert ratio["bf16@0.01"] == pytest.approx(0.5, abs=1e-9)
    # int8 all_gather at n=2: n/8 of dense, plus 4 bytes of scale per bucket
    assert 0.25 <= ratio["int8@0.01"] <= 0.26
    # Top-k 1%: values + int32 indices = 2% at n=2 (k rounds up per bucket)
    assert 0.02 <= ratio["topk@0.01"] <= 0.025
    assert 0.01 <= ratio["randk@0.01"] <= 0.0125
    assert ratio["topk@1.0"] == pytest.approx(2.0, rel=1e-9)  # density 1 costs 2x: honest
    # DDP rebuilds buckets after step 0 (here 1, then 2 of them): each call was counted
    assert len(r["topk@0.01"]["calls"]) >= 3
    assert sum(d for _, d in r["topk@0.01"]["calls"]) == r["topk@0.01"]["dense"]


@pytest.mark.slow
def test_topk_sparse_result(ddp_results: dict) -> None:
    got, ref = ddp_results[0]["topk@0.01"]["steps"][0]
    numel = got.numel()
    nonzero = int(torch.count_nonzero(got))
    assert 0 < nonzero <= WORLD * (k_for(numel, 0.01) + 8)  # + ceil per bucket
    assert _max_err(ddp_results[0]["topk@0.01"], 0) > 0


@pytest.mark.slow
def test_powersgd_exact_on_rank_r_and_bytes(ddp_results: dict) -> None:
    res = ddp_results[0]["powersgd"]
    dense = res["dense_per_step"]
    for step, s in enumerate(res["steps"][:4]):
        # rank 2 reproduces the rank-2 gradient exactly (steps 0, 1 are torch's vanilla warm-up)
        torch.testing.assert_close(s["got"], s["want"], rtol=1e-4, atol=1e-5)
    assert [s["wire"] for s in res["steps"][:2]] == [dense, dense]  # start_powerSGD_iter = 2
    # n=2 all_reduce factor 1; floats: biases 16 + 8, P 16x2 + 8x2, Q 24x2 + 16x2
    assert res["steps"][2]["wire"] == res["steps"][3]["wire"] == (24 + 48 + 80) * 4
    assert res["steps"][4]["wire"] == (24 + 24 + 40) * 4  # after set_level(rank=1)
    last = res["steps"][4]
    assert float((last["got"] - last["want"]).abs().max()) > 1e-3  # rank 1 < 2 loses detail
    for r in range(1, WORLD):
        assert torch.equal(ddp_results[r]["powersgd"]["steps"][4]["got"], last["got"])
