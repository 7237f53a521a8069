"""Pure unit tests of the performance simulator and the hardware profiles (no processes)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from tuning.sim.hardware import (
    PRESETS,
    ClusterSpec,
    NodeGroup,
    fit_alpha_beta,
    fit_gemm_curve,
    load_cluster,
    measure_gemm_rates,
    save_cluster,
)
from tuning.search import enumerate_configs, row_to_spec
from tuning.sim.simulator import ModelSpec, ParallelSpec, from_run_config, simulate, validate_parallel

A100 = load_cluster("dgx-a100-80gb")
GPT_1T = ModelSpec(layers=128, hidden=25600, heads=160, seq=2048, vocab=51200)
GPT_6B = ModelSpec(layers=32, hidden=4096, heads=32, seq=2048, vocab=51200)


def _narayanan(B: int, m: ModelSpec, factor: float) -> float:
    """96 (or 72) B s l h^2 (1 + s/6h + V/(16 l h)) -- V term 12 l h for 72 (see docs)."""
    s, lyr, h, v = m.seq, m.layers, m.hidden, m.vocab
    v_den = 16 if factor == 96 else 12
    return factor * B * s * lyr * h * h * (1 + s / (6 * h) + v / (v_den * lyr * h))


# ---------------------------------------------------------------- FLOPs

def test_flops_tiny_model_by_hand() -> None:
    # l=2, h=4, s=8, V=16, B=1: per layer fwd 24*8*16 + 4*64*4 = 4096; x4 (fwd, 2 bwd, recompute)
    # x 2 layers = 32768; logits 2*8*4*16 = 1024, x3 = 3072; total 35840.
    tiny = ModelSpec(layers=2, hidden=4, heads=2, seq=8, vocab=16)
    res = simulate(tiny, A100, ParallelSpec(global_batch=1, recompute="full"))
    assert res.flops_per_iteration == pytest.approx(35840.0, rel=1e-12)
    assert res.model_flops_per_iteration == pytest.approx(35840.0 - 2 * 4096, rel=1e-12)


@pytest.mark.parametrize("model,par", [
    (GPT_1T, ParallelSpec(dp=6, tp=8, pp=64, global_batch=3072, recompute="full")),
    (GPT_6B, ParallelSpec(dp=4, tp=2, pp=4, micro=2, global_batch=64, recompute="full")),
])
def test_flops_equal_narayanan_formula(model: ModelSpec, par: ParallelSpec) -> None:
    res = simulate(model, A100, par)
    assert res.flops_per_iteration == pytest.approx(_narayanan(par.global_batch, model, 96), rel=1e-12)
    no_rc = simulate(model, A100, dataclasses.replace(par, recompute="none"))
    assert no_rc.flops_per_iteration == pytest.approx(_narayanan(par.global_batch, model, 72), rel=1e-12)
    assert res.model_flops_per_iteration == pytest.approx(no_rc.flops_per_iteration, rel=1e-12)
    gpus = par.gpus
    assert res.tflops_per_gpu == pytest.approx(res.flops_per_iteration / res.iteration_time_s / gpus / 1e12)
    assert res.mfu == pytest.approx(no_rc.flops_per_iteration / (res.iteration_time_s * gpus * A100.peak_flops))


def test_params_formula() -> None:
    # Narayanan et al. 2021 Table 1: 1008.0 B parameters for the 1T model.
    assert GPT_1T.params / 1e9 == pytest.approx(1008.0, abs=0.05)


# ---------------------------------------------------------------- pipeline bubble

@pytest.mark.parametrize("schedule,virtual,expected", [
    ("gpipe", 1, 3 / 8), ("1f1b", 1, 3 / 8), ("interleaved", 2, 3 / 16), ("interleaved", 4, 3 / 32),
])
def test_bubble_fraction(schedule: str, virtual: int, expected: float) -> None:
    par = ParallelSpec(pp=4, micro=1, global_batch=8, schedule=schedule, virtual=virtual)
    res = simulate(GPT_6B, A100, par)
    assert res.num_microbatches == 8
    assert res.bubble_fraction == pytest.approx(expected)
    b = res.breakdown
    # pp_comm also holds the once-per-step syncs (test_pipeline_step_syncs_...): not in the bubble
    syncs = 2 * 10e-6 + GPT_6B.vocab * GPT_6B.hidden * 2 / 240e9  # A100: 10 us alpha, 240 GB/s NVLink
    assert b["bubble"] == pytest.approx(expected * (b["compute"] + b["tp_comm"] + b["pp_comm"] - syncs), rel=1e-9)


def test_pipeline_step_syncs_tied_embeddings_and_the_norm_once_per_step() -> None:
    """Megatron's embedding group all-reduces V h / t bytes between the first and last stage, and the
    norm's squares are summed over the stages: two alphas and the embedding bytes, once per step."""
    def per_step(**kw) -> float:  # pp_comm = m x per-micro-batch sends + the per-step syncs
        one, two = (simulate(GPT_6B, A100, ParallelSpec(pp=4, micro=1, global_batch=g, **kw)).breakdown["pp_comm"]
                    for g in (8, 16))
        return 2 * one - two

    # GPT_6B: V 51200 x h 4096 x 2 B = 419.4304 MB on A100's 240 GB/s NVLink, plus 2 x 10 us
    assert per_step() == pytest.approx(2 * 10e-6 + 419.4304e6 / 240e9, rel=1e-9)
    assert per_step(tp=2) == pytest.approx(2 * 10e-6 + 209.7152e6 / 240e9, rel=1e-9)  # a vocab-parallel shard
    assert per_step(schedule="zbv") == pytest.approx(10e-6, rel=1e-9)  # both ends on rank 0


def test_no_pipeline_no_bubble() -> None:
    res = simulate(GPT_6B, A100, ParallelSpec(dp=8, global_batch=64, micro=2))
    assert res.bubble_fraction == 0 and res.breakdown["bubble"] == 0 and res.breakdown["pp_comm"] == 0


# ---------------------------------------------------------------- memory

@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_model_state_bytes(zero: int) -> None:
    nd = 8
    res = simulate(GPT_6B, A100, ParallelSpec(dp=nd, global_batch=64, zero=zero))
    psi = GPT_6B.params  # tp = pp = 1: the one stage holds every parameter
    # Megatron-LM (the default flavour): bf16 weights, fp32 main grads, fp32 master + Adam: 18 bytes, 6 + 12/d
    # with the distributed optimizer (docs/source/api-guide/dist_optimizer.md); ZeRO-2/3 shard grads / weights
    expected = {0: 18 * psi, 1: 6 * psi + 12 * psi / nd, 2: 2 * psi + 16 * psi / nd, 3: 18 * psi / nd}[zero]
    if zero == 3:  # plus the gathered current + prefetched layer and one layer of gradients
        expected += 3 * 2 * (12 * GPT_6B.hidden**2 + 13 * GPT_6B.hidden)
    mem = res.memory_breakdown_gb
    assert (mem["params"] + mem["grads"] + mem["optimizer"]) * 1e9 == pytest.approx(expected, rel=1e-12)


def _act_layer(m: ModelSpec, b: int) -> float:
    return m.seq * b * m.hidden * (34 + 5 * m.heads * m.seq / m.hidden)  # Korthikanti eq. 1


def test_activation_memory_by_hand() -> None:
    m, b = GPT_6B, 2
    logits = (2 + 4) * b * m.seq * m.vocab  # the 16-bit logits and the loss's fp32 softmax
    res = simulate(m, A100, ParallelSpec(micro=b, global_batch=8))
    assert res.memory_breakdown_gb["activations"] * 1e9 == pytest.approx(m.layers * _act_layer(m, b) + logits)
    full = simulate(m, A100, ParallelSpec(micro=b, global_batch=8, recompute="full"))
    # the layer inputs kept, then the larger of the loss's logits and the one layer replayed: the backward frees a
    # micro-batch's logits before the first checkpointed layer replays its forward (they never meet)
    expected = m.layers * 2 * m.seq * b * m.hidden + max(_act_layer(m, b), logits)
    assert full.memory_breakdown_gb["activations"] * 1e9 == pytest.approx(expected)
    sp = simulate(m, A100, ParallelSpec(tp=4, micro=b, global_batch=8, sequence_parallel=True))
    act_sp = m.seq * b * m.hidden * (34 / 4 + 5 * m.heads * m.seq / (m.hidden * 4))
    assert sp.memory_breakdown_gb["activations"] * 1e9 == pytest.approx(m.layers * act_sp + logits / 4)


def test_in_flight_microbatches_by_schedule() -> None:
    m, p = GPT_6B, 4
    acts = {}
    for sched in ("1f1b", "gpipe"):
        res = simulate(m, A100, ParallelSpec(pp=p, micro=1, global_batch=16, schedule=sched))
        acts[sched] = res.memory_breakdown_gb["activations"] * 1e9
    per_stage = m.layers / p * _act_layer(m, 1)
    assert acts["1f1b"] == pytest.approx(p * per_stage)  # min(p, m) = 4 in flight on the first stage
    # all m = 16 on every stage; the last also keeps the loss's logits of all 16 until their backward
    assert acts["gpipe"] == pytest.approx(16 * per_stage + 16 * (2 + 4) * m.seq * m.vocab)


def test_fits_flag() -> None:
    assert not simulate(GPT_1T, A100, ParallelSpec(tp=8, global_batch=8)).fits
    assert simulate(GPT_1T, A100, ParallelSpec(dp=6, tp=8, pp=64, global_batch=3072, recompute="full")).fits


# ---------------------------------------------------------------- monotonicity

def _sample_rows(n: int = 150, seed: int = 0) -> list[ParallelSpec]:
    df = enumerate_configs(GPT_6B, A100, 64, 256)
    rows = df.sample(n=n, random_state=seed)
    return [row_to_spec(r) for _, r in rows.iterrows()]


@pytest.mark.parametrize("field,scale", [
    ("inter_bw_gb_s", 2.0), ("intra_bw_gb_s", 2.0), ("peak_flops", 2.0), ("hbm_gb_s", 2.0),
    ("inter_latency_s", 0.5), ("intra_latency_s", 0.5),
])
def test_faster_hardware_never_slower(field: str, scale: float) -> None:
    better = dataclasses.replace(A100, **{field: getattr(A100, field) * scale})
    for par in _sample_rows():
        base, fast = simulate(GPT_6B, A100, par), simulate(GPT_6B, better, par)
        assert fast.iteration_time_s <= base.iteration_time_s * (1 + 1e-12), par


def test_tp_inside_node_beats_tp_across_nodes() -> None:
    par = ParallelSpec(dp=4, tp=16, global_batch=64, micro=2)
    wide = dataclasses.replace(A100, gpus_per_node=16)
    across = simulate(GPT_6B, A100, par)  # tp=16 over two 8-GPU nodes
    inside = simulate(GPT_6B, wide, par)
    assert inside.breakdown["tp_comm"] < across.breakdown["tp_comm"]
    assert inside.iteration_time_s < across.iteration_time_s


def test_heterogeneous_groups_slowest_nic_rules() -> None:
    groups = (NodeGroup(name="ndr", nodes=2, inter_bw_gb_s=45.0, inter_latency_s=1e-5),
              NodeGroup(name="hdr", nodes=8, inter_bw_gb_s=10.0, inter_latency_s=2e-5))
    het = dataclasses.replace(A100, node_groups=groups)
    par_small = ParallelSpec(dp=16, global_batch=64)  # 2 nodes: the fast group only
    par_big = ParallelSpec(dp=32, global_batch=64)  # 4 nodes: spans the slow group
    assert het.inter_link(16) == (45.0, 1e-5) and het.inter_link(32) == (10.0, 2e-5)
    assert het.total_gpus == 80
    fast = dataclasses.replace(A100, inter_bw_gb_s=45.0, inter_latency_s=1e-5)
    assert simulate(GPT_6B, het, par_big).dp_comm_total_s > simulate(GPT_6B, fast, par_big).dp_comm_total_s
    assert simulate(GPT_6B, het, par_small).dp_comm_total_s == pytest.approx(
        simulate(GPT_6B, fast, par_small).dp_comm_total_s)
    assert validate_parallel(GPT_6B, het, ParallelSpec(dp=128, global_batch=128))


def test_co2_and_compression_cut_exposed_dp() -> None:
    par = ParallelSpec(dp=64, global_batch=64, overlap_dp=False)
    base = simulate(GPT_6B, A100, par)
    assert base.breakdown["dp_comm_exposed"] > 0
    assert simulate(GPT_6B, A100, dataclasses.replace(par, co2=True)).breakdown["dp_comm_exposed"] == 0
    comp = simulate(GPT_6B, A100, dataclasses.replace(par, compression_ratio=4.0))
    assert comp.breakdown["dp_comm_exposed"] < base.breakdown["dp_comm_exposed"]
    overlapped = simulate(GPT_6B, A100, dataclasses.replace(par, overlap_dp=True))
    assert overlapped.breakdown["dp_comm_exposed"] < base.breakdown["dp_comm_exposed"]


def test_small_gemms_run_less_efficiently() -> None:
    rates = A100.gemm_rate(np.array([1e6, 1e9, 1e12]))
    assert np.all(np.diff(rates) > 0) and rates[-1] <= A100.peak_flops
    big = simulate(GPT_6B, A100, ParallelSpec(micro=8, global_batch=64))
    small = simulate(GPT_6B, A100, ParallelSpec(tp=8, micro=1, global_batch=64))
    assert small.tflops_per_gpu < big.tflops_per_gpu


# ---------------------------------------------------------------- validation

def test_invalid_configs_report_every_reason() -> None:
    bad = ParallelSpec(dp=3, tp=3, pp=5, micro=4, global_batch=10, zero=5, recompute="some")
    reasons = validate_parallel(GPT_6B, A100, bad, gpus=64)
    text = "\n".join(reasons)
    assert "dp(3) * tp(3) * pp(5) = 45 != gpus(64)" in text
    assert "parallel.tp=3 must divide model.heads=32; try 1, 2, 4, 8, 16 or 32" in text
    assert "model.layers=32 must be divisible by parallel.pp * parallel.virtual" in text
    assert "batch.global=10 must be divisible by parallel.dp * batch.micro = 3 * 4 = 12" in text
    assert "parallel.zero=5" in text and "recompute='some'" in text
    with pytest.raises(ValueError, match="must divide model.heads"):
        simulate(GPT_6B, A100, bad)


def test_virtual_stage_rules() -> None:
    assert any("needs parallel.pp > 1" in r for r in validate_parallel(
        GPT_6B, A100, ParallelSpec(virtual=2, global_batch=8)))
    assert any("needs parallel.schedule in" in r for r in validate_parallel(
        GPT_6B, A100, ParallelSpec(pp=2, virtual=2, global_batch=8, schedule="gpipe")))
    assert any("divisible by parallel.pp" in r for r in validate_parallel(
        GPT_6B, A100, ParallelSpec(pp=4, virtual=2, global_batch=6)))
    assert validate_parallel(GPT_6B, A100, ParallelSpec(pp=4, virtual=2, global_batch=8)) == []


# ---------------------------------------------------------------- published results

def test_strategy_classes() -> None:
    from tuning.sim.published import strategy_class

    assert strategy_class(1, 1, 1, 0) == "DP/ZeRO-1" and strategy_class(1, 1, 1, 3) == "ZeRO-3/FSDP"
    assert strategy_class(8, 1, 1, 0) == "TP" and strategy_class(1, 4, 1, 0) == "PP"
    assert strategy_class(8, 4, 1, 1) == "TP+PP" and strategy_class(8, 4, 2, 0) == "interleaved"
    assert list(strategy_class(np.array([1, 2]), np.array([1, 1]), np.array([1, 1]), np.array([2, 0]))) == [
        "ZeRO-2", "TP"]


def test_data_parallel_group_drives_one_nic_per_rank_in_a_node() -> None:
    # DGX A100: 8 x 25 GB/s NICs per node. A tp=1 DP group has 8 ranks per node, so NCCL runs 8
    # rings at once (busbw 8 x 22.5 = 180 GB/s, capped by NVLink); at tp=8 one rank per node uses one NIC.
    par1 = ParallelSpec(dp=32, global_batch=64, overlap_dp=False)
    res1 = simulate(GPT_6B, A100, par1)
    grad = GPT_6B.params * 2
    ring = 2 * 31 / 32 * grad
    # NCCL's latency model (tests/test_sim_collectives.py): 2 x 31 ring steps, 2 x 3 of them across the 4 nodes,
    # x 1.9 for a multi-node ring all-reduce; the tree (2 (7 x 28 + 2 x 50) us at 80 GB/s) is slower for 12 GB
    latency = 1.9 * (8.4 + 56 * 3.4 + 6 * 9.6) * 1e-6
    assert res1.dp_comm_total_s == pytest.approx(latency + ring / (8 * A100.inter_bw_gb_s * 1e9), rel=1e-9)
    par8 = ParallelSpec(dp=32, tp=8, global_batch=64, overlap_dp=False)
    res8 = simulate(GPT_6B, A100, par8)
    psi8 = (GPT_6B.layers * (12 * GPT_6B.hidden**2 + 13 * GPT_6B.hidden) + GPT_6B.vocab * GPT_6B.hidden) / 8 \
        + GPT_6B.seq * GPT_6B.hidden + 2 * GPT_6B.hidden  # positions and the final LayerNorm are replicated
    assert res8.dp_comm_total_s == pytest.approx(  # one rank a node: all 2 x 31 steps cross the network
        1.9 * (8.4 + 62 * 9.6) * 1e-6 + 2 * 31 / 32 * psi8 * 2 / (A100.inter_bw_gb_s * 1e9), rel=1e-9)


def test_zero3_collectives_are_per_block() -> None:
    # FSDP gathers / reduce-scatters one unit at a time: each of the l blocks and the root (embeddings,
    # head) pays its own latency (3 per micro-batch: forward gather, backward gather, reduce-scatter).
    par = ParallelSpec(dp=8, zero=3, global_batch=16, micro=1)
    slow = dataclasses.replace(A100, intra_latency_s=A100.intra_latency_s + 1e-3)
    extra = simulate(GPT_6B, slow, par).dp_comm_total_s - simulate(GPT_6B, A100, par).dp_comm_total_s
    nmb = 16 // 8
    assert extra == pytest.approx(nmb * 3 * (GPT_6B.layers + 1) * 1e-3, rel=1e-9)


def test_engine_zero2_is_fsdp2_without_backward_gather(monkeypatch) -> None:
    from tuning.sim.framework import FRAMEWORKS

    # the structure (which gathers run when), not FSDP's fitted bandwidth share: both flavours at the link's rate
    monkeypatch.setitem(FRAMEWORKS, "fsdp", dataclasses.replace(FRAMEWORKS["fsdp"], zero3_bw_efficiency=1.0))
    cfg = {"model": {"layers": 4, "d_model": 256, "heads": 8, "seq_len": 128, "vocab": 256},
           "parallel": {"dp": 4, "zero": 2}, "batch": {"global": 16, "micro": 2}, "precision": "fp32"}
    model, par = from_run_config(cfg)
    assert par.zero2_fsdp and par.framework == "engine"
    engine = simulate(model, A100, par)
    z3 = simulate(model, A100, dataclasses.replace(par, zero=3))
    # the engine's fp32 parameters: FSDP2 moves fp32, as FSDP1 does at fp32
    fsdp1 = simulate(model, A100, dataclasses.replace(par, framework="fsdp", dtype_bytes=4))
    deepspeed = simulate(model, A100, dataclasses.replace(par, zero2_fsdp=False))
    nmb, layers = 2, 4
    # ZeRO-3 gathers twice per micro-batch, FSDP1 (Composer) ZeRO-2 once: the difference is one gather each
    gather = (z3.dp_comm_total_s - fsdp1.dp_comm_total_s) / nmb
    assert fsdp1.dp_comm_total_s == pytest.approx(nmb * 2 * gather, rel=1e-9)
    # the engine gathers once per step, and reduce-scatters every micro-batch
    assert engine.dp_comm_total_s == pytest.approx(gather + nmb * gather, rel=1e-9)
    # DeepSpeed-style ZeRO-2: a reduce-scatter per micro-batch and one gather after the step, each one whole-model
    # collective at NCCL's cost (tests/test_sim_collectives.py): its Simple ring on 4 NVLink ranks, 8.4 + 3 x 3.4 us,
    # at sm80's 235 GB/s, where a block's collective pays one alpha per unit at the preset's 240
    whole = (gather - (layers + 1) * A100.intra_latency_s) * 240 / 235 + (8.4 + 3 * 3.4) * 1e-6
    assert deepspeed.dp_comm_total_s == pytest.approx(nmb * whole + whole, rel=1e-9)
    # at bf16 FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) (engine/parallel/parallelize.py
    # fsdp_mp_policy) gathers bf16 copies of the fp32 shards and reduce-scatters fp32 gradients
    from tuning.sim.spec import columns
    from tuning.sim.zero import dp_messages

    sent = {p.dtype_bytes: dp_messages({**columns(p), "num_mb": np.asarray(nmb)}, model.params)
            for p in (par, dataclasses.replace(par, dtype_bytes=2))}
    assert sent[2]["all_gather"] == sent[4]["all_gather"] / 2 == model.params * 2
    assert sent[2]["reduce_scatter"] == sent[4]["reduce_scatter"] == nmb * model.params * 4


def test_fsdp_reduce_dtype_sets_the_reduce_scatter_bytes() -> None:
    """Composer >= 0.16.4's FSDP mixed precision DEFAULT (MixedPrecision(param_dtype=bf16, reduce_dtype=fp32),
    composer d745fcb1b) gathers bf16 parameters and reduce-scatters fp32 gradients: `reduce_bytes=4` doubles
    the reduce-scatter's bytes and leaves the gathers', and the step's traffic grows by what it adds."""
    from tuning.sim.spec import columns
    from tuning.sim.zero import dp_messages

    model = ModelSpec(layers=4, hidden=1024, heads=8, seq=1024, vocab=32000)
    par = ParallelSpec(dp=64, micro=2, global_batch=256, zero=3, framework="fsdp", zero2_fsdp=True)
    fp32 = dataclasses.replace(par, reduce_bytes=4)
    nmb = 2
    sent = {p.reduce_bytes: dp_messages({**columns(p), "num_mb": np.asarray(nmb)}, model.params) for p in (par, fp32)}
    assert sent[0]["all_gather"] == sent[4]["all_gather"] == 2 * nmb * model.params * 2
    assert sent[0]["reduce_scatter"] == nmb * model.params * 2 and sent[4]["reduce_scatter"] == nmb * model.params * 4
    h100 = load_cluster("dgx-h100")
    assert simulate(model, h100, fp32, gpus=64).dp_comm_total_s > simulate(model, h100, par, gpus=64).dp_comm_total_s


def _collective_counts(model: ModelSpec, par: ParallelSpec) -> dict[str, float]:
    """All-gathers and reduce-scatters per step the simulator prices: each collective pays its
    op's latency once, so a 1 ms longer latency adds 1 ms per collective."""
    base = dataclasses.replace(A100, allgather_latency_s=1e-3, allgather_bw_gb_s=100.0,
                               reduce_scatter_latency_s=1e-3, reduce_scatter_bw_gb_s=100.0)
    total = simulate(model, base, par).dp_comm_total_s
    counts = {}
    for op in ("allgather", "reduce_scatter"):
        slow = dataclasses.replace(base, **{f"{op}_latency_s": 2e-3})
        counts[op] = round((simulate(model, slow, par).dp_comm_total_s - total) / 1e-3, 6)
    return counts


def test_engine_zero2_collective_counts_match_the_engines() -> None:
    # tests/test_engine_layouts.py::test_zero2_gathers_parameters_once_per_step_at_any_accumulation
    # counts a real dp=2 ZeRO-2 run of 4 blocks (5 FSDP groups with the root): all-gathers per step
    # {accumulation 1: 5, 4: 5} (plus the evaluation's), reduce-scatters {1: 5, 4: 20}
    counts = {}
    for micro in (4, 1):
        cfg = {"model": {"layers": 4, "d_model": 32, "heads": 4, "seq_len": 16},
               "parallel": {"dp": 2, "zero": 2}, "batch": {"global": 8, "micro": micro}}
        model, par = from_run_config(cfg)
        counts[8 // (2 * micro)] = _collective_counts(model, par)
    assert counts == {1: {"allgather": 5, "reduce_scatter": 5}, 4: {"allgather": 5, "reduce_scatter": 20}}


def test_flash_attention_drops_the_score_matrices() -> None:
    par = ParallelSpec(micro=2, global_batch=8)
    plain, flash = simulate(GPT_6B, A100, par), simulate(GPT_6B, A100, dataclasses.replace(par, flash_attention=True))
    m, b = GPT_6B, 2
    logits = (2 + 4) * b * m.seq * m.vocab
    assert flash.memory_breakdown_gb["activations"] * 1e9 == pytest.approx(m.layers * m.seq * b * m.hidden * 34 + logits)
    assert plain.memory_breakdown_gb["activations"] > flash.memory_breakdown_gb["activations"]
    assert flash.breakdown["compute"] < plain.breakdown["compute"]  # no s x s softmax/dropout traffic


# ---------------------------------------------------------------- run config + hardware

def test_from_run_config_maps_engine_keys() -> None:
    cfg = {"model": {"layers": 4, "d_model": 256, "heads": 8, "seq_len": 128, "vocab": 256},
           "parallel": {"dp": 2, "tp": 2, "pp": 2, "zero": 1, "virtual": 2, "sequence_parallel": True},
           "batch": {"global": 16, "micro": 2}, "train": {"activation_checkpointing": True},
           "precision": "bf16", "comm": {"compressor": "int8"}, "co2": {"enabled": True}}
    model, par = from_run_config(cfg)
    from engine.model.shapes import from_gpt

    # the engine's GPT: no biases on its linear layers, so its count is engine/model/shapes.py's, not Megatron's
    assert (model.layers, model.hidden, model.heads, model.seq, model.vocab, model.biases) == (4, 256, 8, 128, 256, False)
    assert model.params == from_gpt(layers=4, d_model=256, heads=8, seq_len=128, vocab=256).params
    assert (par.dp, par.tp, par.pp, par.zero, par.virtual, par.schedule) == (2, 2, 2, 1, 2, "interleaved")
    assert (par.global_batch, par.micro, par.recompute, par.dtype_bytes) == (16, 2, "full", 2)
    # int8 at dp=2: an all_gather of 1 byte per entry (+ a 4-byte scale) against 4 of dense fp32
    assert par.compression_ratio == pytest.approx(4.0, rel=1e-3) and par.co2 and par.sequence_parallel
    assert validate_parallel(model, A100, par) == []


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_profile_round_trip(tmp_path, suffix: str) -> None:
    spec = dataclasses.replace(PRESETS["frontier"], name="mine", gemm_table=((1e6, 1e9), (1e9, 5e10)),
                               node_groups=(NodeGroup(nodes=2, inter_bw_gb_s=5.0, inter_latency_s=1e-4),))
    path = save_cluster(spec, tmp_path / f"c{suffix}")
    assert load_cluster(path) == spec
    if suffix == ".json":
        json.loads(path.read_text())


def test_load_cluster_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="did you mean 'dgx-h100'"):
        load_cluster("dgx-h10")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ngpus_per_nod: 8\n")
    with pytest.raises(ValueError, match="gpus_per_node"):
        load_cluster(bad)


def test_presets_cite_datasheet_peaks() -> None:
    assert PRESETS["dgx-a100-80gb"].peak_flops == 312e12 and PRESETS["dgx-h100"].peak_flops == 989e12
    assert PRESETS["frontier"].peak_flops == 191.5e12 and PRESETS["frontier"].memory_gb == 68.7  # 64 GiB
    assert PRESETS["frontier"].inter_bw_gb_s < 12.5  # 4 x 25 GB/s NICs shared by 8 GCDs


def test_fit_alpha_beta_recovers_synthetic_link() -> None:
    sizes = np.logspace(3, 8, 12)
    factor = 2 * 3 / 4  # all_reduce on 4 ranks
    times = 50e-6 + sizes * factor / 12e9
    alpha, beta = fit_alpha_beta(sizes, times, factor)
    assert alpha == pytest.approx(50e-6, rel=1e-6) and beta == pytest.approx(12.0, rel=1e-6)
    noisy = times * (1 + 0.05 * np.random.default_rng(0).standard_normal(sizes.size))
    assert fit_alpha_beta(sizes, noisy, factor)[1] == pytest.approx(12.0, rel=0.1)


def test_fit_gemm_curve_recovers_saturation() -> None:
    sizes = np.logspace(5, 11, 10)
    rates = 2e11 * sizes / (sizes + 3e7)
    rmax, half = fit_gemm_curve(sizes, rates)
    assert rmax == pytest.approx(2e11, rel=1e-6) and half == pytest.approx(3e7, rel=1e-6)


def test_measure_gemm_rates_on_this_cpu() -> None:
    points = measure_gemm_rates([32, 128], min_time_s=0.01, repeats=2)
    assert [p[0] for p in points] == [2 * 32**3, 2 * 128**3]
    assert all(rate > 1e6 for _, rate in points)
    table = ClusterSpec(name="cpu", gpus_per_node=2, peak_flops=max(r for _, r in points), memory_gb=24,
                        hbm_gb_s=10, intra_bw_gb_s=1, intra_latency_s=1e-4, inter_bw_gb_s=1,
                        inter_latency_s=1e-4, gemm_table=tuple(points))
    assert table.gemm_rate(points[0][0]) == pytest.approx(points[0][1])


def test_result_serialises_for_the_cli() -> None:
    res = simulate(GPT_6B, A100, ParallelSpec(dp=2, tp=2, pp=2, global_batch=8, recompute=True))
    data = json.loads(json.dumps(res.to_dict()))
    for key in ("iteration_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "memory_per_gpu_gb", "fits"):
        assert key in data
    assert set(data["breakdown"]) == {"compute", "tp_comm", "pp_comm", "bubble", "dp_comm_exposed", "optimizer", "straggler"}
    assert sum(data["breakdown"].values()) == pytest.approx(data["iteration_time_s"])
    assert data["tokens_per_s"] == pytest.approx(8 * GPT_6B.seq / data["iteration_time_s"])


def test_simulate_json_interval_cli() -> None:
    import subprocess
    import sys

    one = subprocess.run([sys.executable, "-m", "workbench.cli", "simulate", "--gpus", "64", "--model", "22b",
                          "--config", "tp=8,pp=2,dp=4,micro=1,global_batch=64", "--json"],
                         capture_output=True, text=True, timeout=300)
    data = json.loads(one.stdout)
    lo, hi = data["interval_s"]
    assert data["strategy_class"] == "TP+PP" and "held-out rows" in data["interval_basis"]
    assert data["domain"]["status"] in ("inside", "extrapolated") and data["domain"]["nearest"]
    assert lo < data["iteration_time_s"] < hi
    bad = subprocess.run([sys.executable, "-m", "workbench.cli", "simulate", "--gpus", "8"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode != 0 and "--gpus and --model are required unless --validate" in bad.stderr


def test_parameter_counts_print_in_the_unit_that_fits() -> None:
    from tuning.sim.simulator import format_count

    assert format_count(3_300_000) == "3.3M" and format_count(1.7e9) == "1.7B" and format_count(GPT_1T.params) == "1.0T"
    assert format_count(175e9) == "175B" and format_count(950) == "950" and format_count(12_500) == "12.5K"
    tiny = ModelSpec(layers=2, hidden=64, heads=4, seq=64, vocab=256)  # the engine's default example
    assert tiny.params == 120_576 and format_count(tiny.params) == "121K"  # not "0.0B" (with the final LayerNorm)


def test_engine_zero3_without_resharding_skips_the_backward_gather() -> None:
    cfg = {"model": {"layers": 4, "d_model": 256, "heads": 8, "seq_len": 128, "vocab": 256},
           "parallel": {"dp": 4, "zero": 3, "reshard_after_forward": False}, "batch": {"global": 16, "micro": 2},
           "precision": "bf16"}
    model, kept = from_run_config(cfg)
    assert not kept.reshard_after_forward
    resharded = dataclasses.replace(kept, reshard_after_forward=True)
    z2 = dataclasses.replace(kept, zero=2)
    a, b = simulate(model, A100, kept), simulate(model, A100, resharded)
    # the engine's ZeRO-3 gathers each block once per micro-batch (resharding gathers twice); its ZeRO-2
    # once per step (keep_gathered): with 2 micro-batches, kept - ZeRO-2 = one gather = (resharded - kept) / 2
    nmb, z2_total = 2, simulate(model, A100, z2).dp_comm_total_s
    assert a.dp_comm_total_s - z2_total == pytest.approx((b.dp_comm_total_s - a.dp_comm_total_s) * (nmb - 1) / nmb,
                                                         rel=1e-9)
    assert z2_total < a.dp_comm_total_s < b.dp_comm_total_s
    # the gathered blocks stay until backward: every block's bf16 copy at the peak (at bf16 FSDP2's
    # MixedPrecisionPolicy gathers bf16 copies of the engine's fp32 shards), where resharding holds the current
    # block and the root unit (embedding, head, final norm) in the backward; the fp32 sharded weights are the same
    psi, unit = model.params, model.dense_layer_params * 2  # tp = pp = 1: the one stage holds every parameter
    root = 2 * (model.vocab * model.hidden * (1 if model.tied_embeddings else 2) + model.norm_params * model.hidden)
    assert (a.memory_breakdown_gb["params"] - b.memory_breakdown_gb["params"]) * 1e9 == pytest.approx(
        psi * 2 - unit - root)


def test_a_few_tokens_per_micro_batch_cost_at_least_streaming_the_weights() -> None:
    """Roofline floor: with one token per micro-batch the GEMMs are memory-bound. Forward streams
    the layer's 12 h^2 weights and the vocab x h logit weights once, backward twice: at 1 GB/s and
    fp32, 3 x (12 * 256^2 + 256 * 256) x 4 B = 10.2 ms, whatever the (here absurdly high) GEMM rate."""
    from tuning.sim.hardware import cpu_profile
    from tuning.sim.simulator import ModelSpec, ParallelSpec, simulate

    fast = cpu_profile(name="t", gemm_points=[(1e3, 1e18), (1e12, 1e18)], intra=(1e-6, 100.0),
                       gpus_per_node=1, memory_gb=8.0, hbm_gb_s=1.0)
    model = ModelSpec(layers=1, hidden=256, heads=4, seq=1, vocab=256)
    # the engine's flavour: a CPU profile's host costs are its own (no GPU framework's fitted costs)
    compute = simulate(model, fast, ParallelSpec(micro=1, global_batch=1, dtype_bytes=4,
                                                 framework="engine")).breakdown["compute"]
    floor = 3 * (12 * 256**2 + 256 * 256) * 4 / 1e9
    assert floor <= compute <= 1.05 * floor, (compute, floor)


def test_a_measured_host_streams_few_token_weights_at_its_measured_rate() -> None:
    """Few-token linear layers on a CPU host stream their weights at about half the elementwise
    bandwidth (fresh dW buffers, gradient accumulation): a 2-layer h 512, 4-token model measured
    0.050 s for fwd + bwd of 4 micro-batches, priced 0.023 s at the elementwise 17 GB/s. With the
    measured rate (`weight_stream_gb_s`, here 0.5 GB/s against hbm 1 GB/s) the floor is 3 x (12 x 256^2
    + 256 x 256) x 4 B / 0.5 GB/s = 20.4 ms for one layer and one token."""
    from tuning.sim.hardware import cpu_profile
    from tuning.sim.simulator import ModelSpec, ParallelSpec, simulate

    streamed = cpu_profile(name="t", gemm_points=[(1e3, 1e18), (1e12, 1e18)], intra=(1e-6, 100.0),
                           gpus_per_node=1, memory_gb=8.0, hbm_gb_s=1.0, weight_stream_gb_s=0.5)
    model = ModelSpec(layers=1, hidden=256, heads=4, seq=1, vocab=256)
    compute = simulate(model, streamed, ParallelSpec(micro=1, global_batch=1, dtype_bytes=4,
                                                     framework="engine")).breakdown["compute"]
    floor = 3 * (12 * 256**2 + 256 * 256) * 4 / 0.5e9
    assert floor <= compute <= 1.03 * floor, (compute, floor)


def test_the_simulator_prices_without_importing_torch() -> None:
    """torch (with its pipelining schedules) took ~4 s to import on every `workbench simulate`, even to
    print a one-line input error; only walking a pipeline schedule needs it."""
    import subprocess
    import sys

    code = ("import sys; from tuning.sim.simulator import ModelSpec, ParallelSpec, simulate; "
            "from tuning.sim.hardware import PRESETS; "
            "simulate(ModelSpec(layers=2, hidden=64, heads=4, seq=64, vocab=256), PRESETS['dgx-a100-80gb'], "
            "ParallelSpec(tp=2, dp=4, micro=1, global_batch=8)); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_fsdp_collectives_on_a_cpu_host_are_all_exposed() -> None:
    """FSDP2 calls every all-gather and reduce-scatter synchronously where the device has no streams
    (`_fsdp_collectives.py`: `async_op` False; its backward "prefetch" is a blocking all-gather), so on
    a CPU host none hides under compute. ZeRO-3 at dp 2, 2 layers, one micro-batch: 3 collectives
    (forward gather, backward gather, reduce-scatter) x 3 units (2 blocks + the root) = 9 alphas, plus
    3 x Psi x 4 B x 1/2 at 1 GB/s; Psi = 2 (12 h^2 + 13 h) + V h + s h + 2 h at h 64, V 256, s 128."""
    from tuning.sim.hardware import cpu_profile
    from tuning.sim.simulator import ModelSpec, ParallelSpec, simulate

    host = cpu_profile(name="t", gemm_points=[(1e3, 1e8), (1e12, 1e8)], intra=(1e-3, 1.0),
                       gpus_per_node=2, memory_gb=8.0, hbm_gb_s=1.0)
    model = ModelSpec(layers=2, hidden=64, heads=4, seq=128, vocab=256)
    par = ParallelSpec(dp=2, zero=3, micro=4, global_batch=8, dtype_bytes=4)
    psi = 2 * (12 * 64**2 + 13 * 64) + 256 * 64 + 128 * 64 + 2 * 64  # with the final LayerNorm
    on_cpu = simulate(model, host, par)
    assert on_cpu.dp_comm_total_s == pytest.approx(9e-3 + 3 * psi * 4 * 0.5 / 1e9, rel=1e-9)
    assert on_cpu.breakdown["dp_comm_exposed"] == pytest.approx(on_cpu.dp_comm_total_s, rel=1e-9)
    with_streams = simulate(model, dataclasses.replace(host, fsdp_overlap=True), par)  # a GPU's FSDP2
    # with streams the first block's collectives are exposed, the second's hidden under a long compute
    assert with_streams.breakdown["dp_comm_exposed"] == pytest.approx(0.5 * on_cpu.dp_comm_total_s, rel=1e-9)


def test_fsdp_collectives_use_the_hosts_measured_gather_and_reduce_scatter() -> None:
    """A measured host prices FSDP's all-gathers and reduce-scatters at their own in-situ alpha-beta (on
    gloo a reduce-scatter is slower than the all-reduce's bytes say); DDP's all-reduce keeps the link's.
    ZeRO-3, dp 2, 2 layers, one micro-batch: 2 gathers x 3 units x 2 ms + 2 x Psi x 4 B x 1/2 at 0.5 GB/s,
    plus 3 reduce-scatters x 3 ms + Psi x 4 B x 1/2 at 0.25 GB/s."""
    from tuning.sim.hardware import cpu_profile
    from tuning.sim.simulator import ModelSpec, ParallelSpec, simulate

    host = cpu_profile(name="t", gemm_points=[(1e3, 1e8), (1e12, 1e8)], intra=(1e-3, 1.0),
                       gpus_per_node=2, memory_gb=8.0, hbm_gb_s=1.0,
                       overheads={"allgather_latency_s": 2e-3, "allgather_bw_gb_s": 0.5,
                                  "reduce_scatter_latency_s": 3e-3, "reduce_scatter_bw_gb_s": 0.25})
    model = ModelSpec(layers=2, hidden=64, heads=4, seq=128, vocab=256)
    par = ParallelSpec(dp=2, zero=3, micro=4, global_batch=8, dtype_bytes=4)
    psi = 2 * (12 * 64**2 + 13 * 64) + 256 * 64 + 128 * 64 + 2 * 64  # with the final LayerNorm
    z3 = simulate(model, host, par).dp_comm_total_s
    assert z3 == pytest.approx(6 * 2e-3 + 2 * psi * 2 / 0.5e9 + 3 * 3e-3 + psi * 2 / 0.25e9, rel=1e-9)
    ddp = simulate(model, host, dataclasses.replace(par, zero=0)).dp_comm_total_s
    assert ddp == pytest.approx(1e-3 + psi * 4 / 1e9, rel=1e-9)  # the all-reduce: the link's alpha-beta
