"""Issue 63 item 4: what full activation recomputation costs and what each recompute policy keeps, against the
published A100 measurements of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", arXiv:2205.05198) and the layouts Megatron-LM ran on 80 GB A100s.

Korthikanti et al.: Table 3 (the layouts: tp 8, sequence 2048, vocabulary 51200, Selene's 80 GB A100s), Table 4
(one 22B layer: forward 7.7 ms, backward 11.9 ms, 19.5 ms with full recompute: +39%; sec. 6.2 "36% overhead for full
recompute" for 530B and 1T), Table 5 (end-to-end seconds, full recompute without sequence parallelism 1.42 / 18.13 /
49.05 / 94.42 against selective + sequence parallel 1.10 / 13.75 / 37.83 / 71.49)."""
from __future__ import annotations

import dataclasses

import pytest

from tuning.sim.hardware import load_cluster
from tuning.sim.simulator import simulate
from tuning.sim.spec import ModelSpec, ParallelSpec

A100 = load_cluster("dgx-a100-80gb")


def gpt(layers: int, hidden: int, heads: int) -> ModelSpec:
    """Korthikanti et al.'s GPT shapes (Megatron-LM's GPT: sequence 2048, vocabulary 51200)."""
    return ModelSpec(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200)


# Table 3's layouts (no data parallelism)
TABLE3 = {
    "22B": (gpt(48, 6144, 64), dict(tp=8, pp=1, micro=4, global_batch=4)),
    "175B": (gpt(96, 12288, 96), dict(tp=8, pp=8, virtual=3, schedule="interleaved", micro=1, global_batch=64)),
    "530B": (gpt(105, 20480, 128), dict(tp=8, pp=35, virtual=3, schedule="interleaved", micro=1, global_batch=280)),
    "1T": (gpt(128, 25600, 160), dict(tp=8, pp=64, micro=1, global_batch=512)),
}


def run(model: ModelSpec, layout: dict, recompute: str, sequence_parallel: bool = False):
    return simulate(model, A100, ParallelSpec(dp=1, framework="megatron", recompute=recompute,
                                              sequence_parallel=sequence_parallel, **layout))


def layer_seconds(recompute: str) -> float:
    """One 22B layer's compute and tensor-parallel time per micro-batch (Table 4's measure): the difference of the
    22B at 48 and at 24 layers, over 24 (what is not in a layer -- logits, loss, optimizer -- cancels)."""
    model, layout = TABLE3["22B"]
    half = dataclasses.replace(model, layers=24)

    def busy(m: ModelSpec) -> float:
        b = run(m, layout, recompute).breakdown
        return b["compute"] + b["tp_comm"]
    return (busy(model) - busy(half)) / 24


def test_full_recompute_of_a_22b_layer_costs_what_korthikanti_measured() -> None:
    """Table 4: full recomputation adds 39% to one 22B layer's forward + backward (7.6 of 19.6 ms; more than the
    33% of a forward over a backward twice its length because Megatron-LM overlaps the backward's tensor-parallel
    all-reduce with the weight gradient, sec. 6.2). Priced: the recomputed forward at its own GEMM, attention and
    memory-bound rates, its two all-reduces and its share of the per-layer fixed cost; 29% before that share was
    replayed."""
    overhead = layer_seconds("full") / layer_seconds("none") - 1.0
    assert 0.34 <= overhead <= 0.44, overhead


def test_full_recompute_of_gpt3_on_a100_costs_34_to_38_pct() -> None:
    """The issue's measured range for full recomputation against none on GPT-3-class A100 layouts (+34-38%, priced
    +22-25% on the tables kept back), at GPT-3 175B's Table 3 layout: 27% before the fixed cost was replayed."""
    model, layout = TABLE3["175B"]
    ratio = run(model, layout, "full").iteration_time_s / run(model, layout, "none").iteration_time_s
    assert 1.34 <= ratio <= 1.38, ratio


@pytest.mark.parametrize("size", list(TABLE3))
def test_table3_layouts_ran_on_80gb_a100s_with_either_policy(size: str) -> None:
    """Table 5 ran every Table 3 layout on 80 GB A100s with full recomputation (no sequence parallelism) and with
    selective recomputation and sequence parallelism: both are priced as fitting; without recomputation or
    sequence parallelism the paper says none of them fits (sec. 6.1), and none is priced so."""
    model, layout = TABLE3[size]
    assert run(model, layout, "full").fits and run(model, layout, "selective", True).fits
    assert not run(model, layout, "none").fits


def test_one_stage_under_full_recompute_holds_layer_inputs_and_the_larger_of_loss_and_recomputed_layer() -> None:
    """The 22B of Table 3 on one stage (tp 8, micro-batch 4) under full recomputation: each of its 48 layers keeps
    its input, 2 s b h bytes (Korthikanti et al. Table 2, "full"), and the backward holds either the loss's logits
    (16-bit and the fp32 softmax, 6 bytes a logit over V / t) or one recomputed layer's whole set (eq. 2 over t, with
    the 5 a s / h scores of unfused attention: s b h (10 + 24 / t + 5 a s / (h t)) bytes), never both: the loss's
    backward frees the logits before the first layer is recomputed. The old sum counted the logits twice."""
    model, layout = TABLE3["22B"]
    s, b, h, a, t, v = 2048, 4, 6144, 64, 8, 51200
    inputs = 48 * 2 * s * b * h
    logits = 6 * s * b * v / t
    layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert layer > logits
    activations = run(model, layout, "full").memory_breakdown_gb["activations"]
    assert activations == pytest.approx((inputs + layer) / 1e9, rel=1e-3)


# Narayanan et al. 2021's experiments as Megatron-LM's examples/sc21 scripts run them (NVIDIA/Megatron-LM@79a3bb6:
# examples/sc21/run_figure_{12,13,16,17}.sh: --recompute-method uniform, micro-batch 1 unless named, Selene's 80 GB
# A100s); the figures report a throughput for each, so each ran
SC21 = {
    "figure 12, GPT-3 175B interleaved": (gpt(96, 12288, 96), dict(tp=8, pp=12, virtual=4, schedule="interleaved",
                                                                   global_batch=60)),
    "figure 13, 162B at pp 32 x tp 2": (gpt(32, 20480, 128), dict(tp=2, pp=32, global_batch=128)),
    "figure 16, 91B at micro-batch 8": (gpt(32, 15360, 128), dict(tp=8, pp=8, micro=8, global_batch=512)),
    "figure 17, 145B at batch 256": (gpt(80, 12288, 96), dict(tp=8, pp=16, global_batch=256)),
}


@pytest.mark.parametrize("name", list(SC21))
def test_megatron_lms_sc21_layouts_are_priced_as_fitting_80gb(name: str) -> None:
    """A guard (these fit before this change too): the layouts Megatron-LM ran on 80 GB A100s are never refused."""
    model, layout = SC21[name]
    assert run(model, {"micro": 1, **layout}, "full").fits
