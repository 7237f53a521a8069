"""Issue 63 item 4 (a) and (c) on the published A100 series the stored tables hold: how the price of a layout moves
with the tensor-parallel degree and with strong scaling, against what the same runs measured. The issue's own
bounds (tp 8 / tp 2 1.55-2.0, 16-22% per-GPU loss in strong scaling) come from tables kept back; these are the
published pairs and series of the same kind that we can read, so a change chasing those bounds must keep them.

- tp 8 against tp 2 at the same pipeline, micro-batch, batch and GPUs: BLOOM's layout search on 384 Jean Zay A100s
  (bigscience tr11-176B-ml chronicles-prequel, Megatron-DeepSpeed), NHIDDEN 14336 x 72 layers, pp 12, MBS 2,
  GBS 2048: DP 4 TP 8 128.82 s/it, DP 16 TP 2 112.5 s/it, 1.145.
- Strong scaling at a fixed batch: Narayanan et al. 2021 Table 2 (PTD-P, 175B on 384 -> 1536 GPUs: 153 -> 141
  TFLOP/s per GPU; 530B on 560 -> 2240: 171 -> 159) and Smith et al. 2022 (MT-NLG 530B on 2240 -> 3360: 126 -> 113),
  the micro-batches per pipeline falling 384 -> 96, 1120 -> 280 and 240 -> 160.
"""
from __future__ import annotations

import functools

import pytest

from tuning.sim.published import PublishedRow, calibration_rows, held_out_rows, simulated_metric


@functools.cache
def _rows() -> dict[str, PublishedRow]:
    return {r.id: r for r in calibration_rows() + held_out_rows()}


def test_tensor_parallel_8_against_2_costs_what_blooms_a100_pair_measured() -> None:
    """The same 384 GPUs, pipeline, micro-batch and batch at tp 8 (dp 4) and tp 2 (dp 16): the time ratio is the
    inverse ratio of the TFLOP/s per GPU (same FLOPs per iteration); priced within 10% of the measured 1.145."""
    tp8, tp2 = (_rows()[f"bloom-0225-72x14336-dp{dp}tp{tp}pp12-mb2-b2048"] for dp, tp in ((4, 8), (16, 2)))
    measured = tp2.value / tp8.value
    priced = simulated_metric(tp2) / simulated_metric(tp8)
    assert measured == pytest.approx(128.82 / 112.5, rel=0.01)  # the chronicles' s/it, as stored
    assert priced == pytest.approx(measured, rel=0.10), priced


@pytest.mark.parametrize("small, large", [("nar-t2-ptdp-175b-384", "nar-t2-ptdp-175b-1536"),
                                          ("nar-t2-ptdp-530b-560", "nar-t2-ptdp-530b-2240"),
                                          ("mtnlg-530b-2240", "mtnlg-530b-3360")])
def test_strong_scaling_loses_the_per_gpu_throughput_the_published_series_lost(small: str, large: str) -> None:
    """Per-GPU throughput lost from the smallest to the largest GPU count of a fixed-batch series: priced between
    half and 1.5x the measured loss (7.8%, 7.0%, 10.3%). A simulator that priced the loss at a fifth of the
    measured one, as the issue reports on the tables kept back (about 3% for 16-22%), fails here."""
    lo, hi = _rows()[small], _rows()[large]
    assert lo.global_batch == hi.global_batch and lo.gpus < hi.gpus
    measured = 1.0 - hi.value / lo.value
    priced = 1.0 - simulated_metric(hi) / simulated_metric(lo)
    assert 0.5 * measured <= priced <= 1.5 * measured, (measured, priced)
