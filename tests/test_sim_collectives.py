"""The simulator's collectives on NCCL clusters (issue 63 item 4): NCCL's own latency model, per ring step and
per tree level, in place of one flat alpha per collective. The expected values are worked by hand from the
constants of NVIDIA/nccl@01afd20a77b5804e0ecf1042509dd9d20ebf9e93 src/graph/tuning.cc (Simple protocol): ring
base 8.4 us, 3.4 us per NVLink step, 9.6 us per network step, x 1.9 for a multi-node ring all-reduce; tree
2 ((ranks per node - 1) x 28 us + log2(nodes) x 50 us) at half of min(0.9 busbw, 80 GB/s above two nodes)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tuning.sim.hardware import load_cluster
from tuning.sim.simulator import ModelSpec, ParallelSpec, simulate

US = 1e-6


def test_a_tensor_parallel_all_reduce_pays_nccl_latency_for_each_ring_step() -> None:
    """Megatron's 4 all-reduces per layer (no sequence parallelism) on an 8-way NVLink ring take 2 x 7 steps, on a
    2-way ring 2: 8.4 + 14 x 3.4 = 56 us and 8.4 + 2 x 3.4 = 15.2 us of latency, beside b s h x 2 bytes at 240 GB/s
    bus bandwidth. The flat 10 us alpha priced both alike."""
    a100 = load_cluster("dgx-a100-80gb")
    model = ModelSpec(layers=4, hidden=1024, heads=16, seq=1024, vocab=32000)
    nbytes = 2 * 1024 * 1024 * 2  # micro 2 x seq x hidden x bf16
    for tp, latency in ((8, (8.4 + 14 * 3.4) * US), (2, (8.4 + 2 * 3.4) * US)):
        par = ParallelSpec(tp=tp, micro=2, global_batch=8, framework="megatron")
        per_ar = latency + nbytes * 2 * (tp - 1) / tp / 240e9
        tp_comm = simulate(model, a100, par).breakdown["tp_comm"]
        assert tp_comm == pytest.approx(4 * 4 * 4 * per_ar, rel=1e-6), tp  # 4 micro-batches x 4 layers x 4 all-reduces
    # with sequence parallelism each all-reduce is a reduce-scatter and an all-gather of 7 steps each
    sp = simulate(model, a100, ParallelSpec(tp=8, micro=2, global_batch=8, framework="megatron",
                                            sequence_parallel=True)).breakdown["tp_comm"]
    assert sp == pytest.approx(64 * 2 * ((8.4 + 7 * 3.4) * US + nbytes * 7 / 8 / 240e9), rel=1e-6)


def test_an_all_reduce_across_nodes_takes_the_faster_of_ring_and_tree() -> None:
    """512 ranks, 8 a node on 64 nodes: the ring's 2 x 511 steps (2 x 63 across the network) cost 8.1 ms of
    latency, the tree's 2 (7 x 28 + 6 x 50) us = 0.99 ms; a 25 MB bucket takes the tree, a 2 GB buffer the ring."""
    from tuning.sim.comm import nccl_collective

    a100 = load_cluster("dgx-a100-80gb")
    ring_lat = 1.9 * (8.4 + (1022 - 126) * 3.4 + 126 * 9.6) * US
    tree_lat = 2 * (7 * 28 + 6 * 50) * US
    for nbytes, expected in ((25e6, tree_lat + 2 * 25e6 / 80e9), (2e9, ring_lat + 2e9 * 2 * 511 / 512 / 180e9)):
        got = nccl_collective(a100, nbytes, "all_reduce", 180.0, 20 * US, 512, 8)
        assert float(got) == pytest.approx(expected, rel=1e-9), nbytes
    # two nodes: the tree's bandwidth cap is 110 GB/s, its depth log2(2) = 1
    two = nccl_collective(a100, 25e6, "all_reduce", 180.0, 20 * US, 16, 8)
    ring = 1.9 * (8.4 + 28 * 3.4 + 2 * 9.6) * US + 25e6 * 2 * 15 / 16 / 180e9
    assert float(two) == pytest.approx(min(ring, 2 * (7 * 28 + 50) * US + 2 * 25e6 / 110e9), rel=1e-9)
    # an all-gather is a ring only: 511 steps, 63 of them across the network, no plateau factor
    gather = nccl_collective(a100, 25e6, "all_gather", 180.0, 20 * US, 512, 8)
    assert float(gather) == pytest.approx((8.4 + 448 * 3.4 + 63 * 9.6) * US + 25e6 * 511 / 512 / 180e9, rel=1e-9)
    assert float(nccl_collective(a100, 25e6, "all_reduce", 180.0, 20 * US, 1, 8)) == 0.0


def test_a_host_that_does_not_run_nccl_keeps_its_measured_alpha() -> None:
    """A calibrated CPU host's collectives are gloo, measured in situ (fit_alpha_beta): its flat alpha stays."""
    from tuning.sim.comm import collective, nccl_collective
    from tuning.sim.hardware import cpu_profile

    host = cpu_profile(name="host", gemm_points=[(1e6, 1e9), (1e9, 2e9)], intra=(50 * US, 2.0), gpus_per_node=4,
                       memory_gb=16.0)
    assert not host.nccl_tuning
    got = nccl_collective(host, 1e6, "all_reduce", 2.0, 50 * US, 4, 4)
    assert float(got) == pytest.approx(float(collective(1e6, 2 * 3 / 4, 2.0, 50 * US, 4)))


# GPT-3 13B (Brown et al. 2020 Table 2.1 as Megatron-LM shapes it: 40 layers, hidden 5120, 40 heads, seq 2048)
GPT3_13B = ModelSpec(layers=40, hidden=5120, heads=40, seq=2048, vocab=51200)


@pytest.mark.xfail(strict=True, reason="issue 63 item 4 (a) still open: NCCL's latency per ring step moves the "
                   "ratio 1.32 -> 1.34; the tensor-parallel collectives are ~10% of the tp8 step by NCCL's model, so "
                   "the measured 1.55-2.0 is not in their latency or bandwidth")
def test_tensor_parallel_8_against_2_costs_what_the_kept_back_a100_tables_measured() -> None:
    """Issue 63's kept-back A100 tables: a GPT-3-class layout at tp 8 takes 1.55-2.0x the time of its tp 2 twin
    (same GPUs, pipeline and batch; dp 4x smaller)."""
    a100 = load_cluster("dgx-a100-80gb")
    base = ParallelSpec(pp=4, micro=2, global_batch=512, zero=1, recompute="full", framework="megatron",
                        overlap_dp=False)
    t8, t2 = (simulate(GPT3_13B, a100, dataclasses.replace(base, tp=tp, dp=256 // 4 // tp)).iteration_time_s
              for tp in (8, 2))
    assert 1.55 <= t8 / t2 <= 2.0, t8 / t2


def test_nccl_latency_prices_the_gradient_all_reduce_of_512_ranks_above_its_flat_alpha() -> None:
    """A data-parallel all-reduce over 64 DGX A100 nodes is NCCL's tree (0.99 ms of latency), not one 20 us alpha."""
    a100 = load_cluster("dgx-a100-80gb")
    par = ParallelSpec(dp=512, micro=1, global_batch=512, zero=0, framework="megatron", overlap_dp=False)
    total = simulate(GPT3_13B, a100, par).dp_comm_total_s
    nbytes = GPT3_13B.params * 2
    ring = 1.9 * (8.4 + 896 * 3.4 + 126 * 9.6) * US + nbytes * 2 * 511 / 512 / 180e9
    tree = 2 * (7 * 28 + 6 * 50) * US + nbytes * 2 / 80e9
    assert total == pytest.approx(min(ring, tree), rel=1e-6)
    assert np.isfinite(total)
