"""Bidirectional compression (MASHA-style, engine/comm/bidirectional.py): hand-computed results
on small tensors at 2 real ranks, and the bytes of each leg measured by the CollectiveProfiler
at dp=2 and dp=4."""
from __future__ import annotations

import pytest
import torch

from engine.comm.bidirectional import (
    BidirectionalState,
    bidirectional_mean,
    leg_ratio,
    make_bidirectional_hook,
    rowwise_error_feedback,
    shard_size,
)
from parallel_harness import run_ranks

# ---- pure ------------------------------------------------------------------------------------


def test_shard_size_pads_to_equal_shards() -> None:
    assert shard_size(4, 2) == 2 and shard_size(5, 2) == 3 and shard_size(1, 4) == 1


def test_rowwise_error_feedback_keeps_largest_and_conserves() -> None:
    acc = torch.tensor([[4.0, 1.0], [-3.0, 2.0]])
    values, indices, residual = rowwise_error_feedback(acc, 1)
    assert values.tolist() == [[4.0], [-3.0]] and indices.tolist() == [[0], [0]]
    assert residual.tolist() == [[0.0, 1.0], [0.0, 2.0]]


def test_leg_ratio_is_density_per_value() -> None:
    # 4000 entries over 4 ranks: shards of 1000, k = 100 at density 0.1
    assert leg_ratio("randk", 4000, 4, 0.1) == pytest.approx(0.1)
    assert leg_ratio("topk", 4000, 4, 0.1) == pytest.approx(0.2)  # + an int32 index per value


def test_refuses_a_compressor_without_a_bidirectional_form() -> None:
    with pytest.raises(ValueError, match="comm.bidirectional needs comm.compressor in randk, topk"):
        make_bidirectional_hook("powersgd")


def test_validate_names_the_rules() -> None:
    from engine.config.schema import load_config
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="comm.bidirectional.*needs comm.compressor in randk, topk"):
        load_config(None, ["comm.bidirectional=true", "comm.compressor=int8"])
    with pytest.raises(ConfigError, match="comm.compressor.*powersgd.*parallel.zero=2.*without their shapes"):
        load_config(None, ["comm.compressor=powersgd", "parallel.dp=2", "parallel.zero=2", "batch.global=8"])
    with pytest.raises(ConfigError, match="comm.bidirectional.*zero=0 or 1, not 3.*all-gathers parameters"):
        load_config(None, ["comm.compressor=topk", "comm.bidirectional=true", "parallel.dp=2", "parallel.zero=3",
                           "batch.global=8"])
    load_config(None, ["comm.compressor=randk", "parallel.dp=2", "parallel.zero=2", "batch.global=8"])
    load_config(None, ["comm.compressor=powersgd", "parallel.dp=2", "parallel.zero=1"])  # composes now


# ---- real ranks ----------------------------------------------------------------------------

GRADS = ([4.0, 1.0, -3.0, 2.0], [0.0, 3.0, 1.0, 5.0])  # rank 0, rank 1; mean [2, 2, -1, 3.5]


def _hand_topk(rank: int, world: int) -> list[list[float]]:
    state = BidirectionalState(compressor="topk", density=0.5)  # shards of 2, k = 1
    out = []
    for _ in range(2):
        t = torch.tensor(GRADS[rank])
        bidirectional_mean(state, t, index=0).wait()
        out.append(t.tolist())
    return out + [state.worker_residuals[0].reshape(-1).tolist(), state.server_residuals[0].reshape(-1).tolist()]


def _hand_randk(rank: int, world: int) -> list[list[float]]:
    out = []
    for density in (0.5, 1.0):
        state = BidirectionalState(compressor="randk", density=density, seed=3)
        t = torch.tensor(GRADS[rank])
        bidirectional_mean(state, t).wait()
        out.append(t.tolist())
    return out


@pytest.mark.slow
def test_topk_both_legs_with_error_feedback_by_hand() -> None:
    results = run_ranks(2, _hand_topk)
    # call 1. workers keep the top-1 of each 2-entry shard: rank 0 [4, 0 | -3, 0], rank 1
    # [0, 3 | 0, 5]. owner 0: mean [2, 1.5] -> sends 2 at 0, keeps [0, 1.5]; owner 1: mean
    # [-1.5, 2.5] -> sends 2.5 at 1, keeps [-1.5, 0].
    # call 2 (same gradients + worker residuals [0, 1, 0, 2] and [0, 0, 1, 0]): rank 0 acc
    # [4, 2, -3, 4] sends [4, 0 | 0, 4]; rank 1 acc [0, 3, 2, 5] sends [0, 3 | 0, 5]. owner 0:
    # [2, 1.5] + [0, 1.5] = [2, 3] -> 3 at 1, keeps [2, 0]; owner 1: [0, 4.5] + [-1.5, 0] -> 4.5.
    want = [[2.0, 0.0, 0.0, 2.5], [0.0, 3.0, 0.0, 4.5]]
    assert results[0][:2] == want and results[1][:2] == want
    assert results[0][2] == [0.0, 2.0, -3.0, 0.0] and results[1][2] == [0.0, 0.0, 2.0, 0.0]
    assert results[0][3] == [2.0, 0.0] and results[1][3] == [-1.5, 0.0]
    # mass: sent [2, 3, 0, 7] + mean worker residual [0, 1, -0.5, 0] + owners' [2, 0, -1.5, 0]
    # = 2 x the mean gradient [4, 4, -2, 7]


@pytest.mark.slow
def test_randk_both_legs_unbiased_shared_indices_by_hand() -> None:
    half, full = zip(*run_ranks(2, _hand_randk))
    assert half[0] == half[1] and full[0] == full[1] == [2.0, 2.0, -1.0, 3.5]  # density 1: the mean
    # density 0.5: one entry per 2-entry shard, the mean scaled by shard/k = 2, the other 0
    got = half[0]
    for shard in (got[:2], got[2:]):
        assert sorted(x != 0.0 for x in shard) == [False, True]
    assert all(g in (0.0, 2 * m) for g, m in zip(got, [2.0, 2.0, -1.0, 3.5]))


def _hand_on_older_torch(rank: int, world: int) -> tuple[list[list[float]], list[list[float]]]:
    import torch.distributed as dist

    # only the public names: torch 2.13's own *_tensor collectives call c10d's *_single ones
    for name in ("all_gather_single", "reduce_scatter_single"):
        if hasattr(dist, name):
            delattr(dist, name)
    return _hand_topk(rank, world), _hand_randk(rank, world)


@pytest.mark.slow
def test_both_legs_on_torch_without_the_single_collectives() -> None:
    """Older torch (2.11 here) has only all_gather_into_tensor / reduce_scatter_tensor: on torch 2.11 both
    legs failed with "no attribute 'reduce_scatter_single'"; the hand-worked results must hold."""
    topk, randk = zip(*run_ranks(2, _hand_on_older_torch))
    want = [[2.0, 0.0, 0.0, 2.5], [0.0, 3.0, 0.0, 4.5]]
    assert topk[0][:2] == want and topk[1][:2] == want
    assert randk[0][1] == randk[1][1] == [2.0, 2.0, -1.0, 3.5]


NUMEL, DENSITY = 4000, 0.1


def _measured_legs(rank: int, world: int, compressor: str) -> dict:
    from profilers.collectives import CollectiveProfiler

    state = BidirectionalState(compressor=compressor, density=DENSITY, seed=1)
    t = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
    import time

    with CollectiveProfiler() as prof:
        bidirectional_mean(state, t).wait()
        # the profiler records an async collective from its completion callback, which may run
        # just after the chained future returns: collect until both legs are in (10 s at most)
        events, deadline = prof.drain(), time.monotonic() + 10
        while len(events) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            events += prof.drain()
    return {"ops": {e["op"]: e["bytes"] for e in events}, "count": len(events),
            "legs": {k: list(v) for k, v in state.legs.items()}}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_each_leg_cut_by_the_configured_ratio_measured(world: int) -> None:
    for compressor, reduce_op, per_value in (("randk", "reduce_scatter", 1), ("topk", "all_to_all", 2)):
        for r in run_ranks(world, _measured_legs, compressor):
            assert r["count"] == 2, r  # one collective per leg
            dense = NUMEL * 4  # a dense fp32 reduce-scatter's input / all-gather's output
            # the profiler's nccl-tests bytes of each leg's collective, against the dense leg
            assert r["ops"][reduce_op] / dense == pytest.approx(DENSITY * per_value)
            assert r["ops"]["all_gather"] / dense == pytest.approx(DENSITY * per_value)
            for leg in ("reduce", "broadcast"):  # the wire bytes the state counted (bus factors)
                wire, dense_wire = r["legs"][leg]
                assert wire / dense_wire == pytest.approx(DENSITY * per_value, rel=1e-3)


# ---- FSDP2 (ZeRO-2/3): the reduce leg as torch's custom reduce-scatter -------------------------


def _fsdp_grads(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from engine.comm.fsdp_compress import apply_fsdp_compression
    from profilers.collectives import CollectiveProfiler

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    out = {}
    for case in ("dense", "randk@1", "topk@1", "randk@0.25", "topk@0.25"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if case != "dense":
            name, density = case.split("@")
            apply_fsdp_compression([model[0], model[2]], name, process_group=mesh.get_group(),
                                   density=float(density), seed=2)
        with CollectiveProfiler() as prof:
            model(x).square().sum().backward()
        events = prof.drain()
        out[case] = {"grad": torch.cat([p.grad.full_tensor().reshape(-1) for p in model.parameters()]),
                     "grad_bytes": sum(e["bytes"] for e in events if e["op"] in ("reduce_scatter", "all_to_all"))}
    return out


@pytest.mark.slow
def test_fsdp2_custom_reduce_scatter_compresses_the_gradient() -> None:
    for r in run_ranks(2, _fsdp_grads):
        dense = r["dense"]["grad"]
        for case in ("randk@1", "topk@1"):  # density 1 keeps everything: the exact mean
            assert torch.allclose(r[case]["grad"], dense, atol=1e-6), case
        assert r["randk@0.25"]["grad_bytes"] < 0.3 * r["dense"]["grad_bytes"]
        assert r["topk@0.25"]["grad_bytes"] < 0.6 * r["dense"]["grad_bytes"]  # values + int32 indices
        kept = (r["randk@0.25"]["grad"] != 0).float().mean()
        assert 0.15 < kept < 0.35, kept  # a quarter of each shard survives
