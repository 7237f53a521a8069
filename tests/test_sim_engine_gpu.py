"""The engine flavour on a GPU preset against the engine's own runs on an H100 (measured, committed).

docs/data/gpu_microbatch_2026-11-28: bench/gpu_mfu.py's GPT-1B at micro-batch 1-8 and 1-16 micro-batches a step.
docs/data/gpu_llama1b_2026-11-27: `workbench plan`'s three picks for Llama-3.2-1B, run by the engine.
Neither was used to set any term: the engine takes eager PyTorch's fixed costs fitted on the `fsdp` rows.
"""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from bench.gpu_rates import GPT_1B  # bench/gpu_mfu.py's GPT, as the script that prices it states it

ROOT = Path(__file__).resolve().parent.parent
MICRO = ROOT / "docs" / "data" / "gpu_microbatch_2026-11-28" / "summary.txt"
RECOMPUTE = MICRO.with_name("summary-recompute.txt")  # the same GPT under full activation checkpointing
LLAMA = ROOT / "docs" / "data" / "gpu_llama1b_2026-11-27"
BOUND = 0.15  # issue 63: a source priced with only hardware, model, layout and framework named


def measured_gpt_steps(summary: Path = MICRO, *, runs: int = 8) -> dict[tuple[int, int], float]:
    """(micro, global) -> the engine's median step (s) with profilers off, as run.sh summarised each of its `runs`."""
    line = re.compile(r"micro (\d+) global (\d+) rc 0 .*?engine, profilers off\s+([\d.]+)")
    out = {(int(m), int(g)): float(ms) / 1e3 for m, g, ms in line.findall(summary.read_text())}
    assert len(out) == runs, out
    return out


def gpt(micro: int, global_batch: int, *, recompute: bool = False) -> dict:
    return {**GPT_1B, "batch": {"global": global_batch, "micro": micro}, "train": {"activation_checkpointing": recompute}}


def priced(cfg: dict) -> float:
    from tuning.sim.hardware import PRESETS
    from tuning.sim.simulator import from_run_config, simulate

    model, par = from_run_config(cfg)
    assert par.framework == "engine"
    return simulate(model, PRESETS["dgx-h100"], par).iteration_time_s


def test_the_engine_flavour_prices_the_engines_h100_steps_by_micro_batch() -> None:
    """Every one of the eight runs within the bound; micro-batches of 1 cost 1.40x micro-batches of 8 per
    sequence, which a price without eager PyTorch's per-layer fixed cost made 1.00x."""
    steps = measured_gpt_steps()
    price = {(m, g): priced(gpt(m, g)) for m, g in steps}
    errors = {k: price[k] / t - 1 for k, t in steps.items()}
    assert all(abs(e) <= BOUND for e in errors.values()), errors
    sweep = [(m, 8) for m in (1, 2, 4, 8)]
    assert [price[k] for k in sweep] == sorted((price[k] for k in sweep), reverse=True), price
    measured_ratio = steps[1, 8] / steps[8, 8]
    assert abs(price[1, 8] / price[8, 8] / measured_ratio - 1) <= BOUND, (price[1, 8] / price[8, 8], measured_ratio)


def test_the_engine_flavour_ranks_the_plans_llama_picks_as_they_ran() -> None:
    """The plan's three picks ran 0.750 (micro 8), 0.864 (micro 2) and 0.788 s (micro 4); priced within 0.2% of
    each other before (Spearman 0.5), now in the measured order."""
    from engine.config.schema import load_config

    runs = {1: "show-plan-1-expandable-segments.json", 2: "show-plan-2.json", 3: "show-plan-3.json"}
    measured, price = {}, {}
    for n, show in runs.items():
        steps = json.loads((LLAMA / show).read_text())["steps"]
        measured[n] = statistics.median(s["step_time(s)"] for s in steps[2:])
        price[n] = priced(load_config(LLAMA / f"plan-{n}.yaml").to_dict())
    assert sorted(runs, key=measured.get) == sorted(runs, key=price.get), (measured, price)


def test_full_recompute_at_micro_batch_4_is_priced_as_it_ran() -> None:
    """Micro-batch 4 under torch.utils.checkpoint: 366.5 ms measured (+22.5% over no recompute), within the bound."""
    step = measured_gpt_steps(RECOMPUTE, runs=2)[4, 8]
    assert abs(priced(gpt(4, 8, recompute=True)) / step - 1) <= BOUND, step


@pytest.mark.xfail(strict=True, reason="issue 63: not modelled. At micro-batch 1 the checkpointed step is host-bound: "
                   "its forward phase took 351.0 ms against 129.8 without checkpointing (at micro-batch 4, 92.5 against "
                   "91.1), so torch.utils.checkpoint's host work per layer call, hidden behind the GPU's where a call has "
                   "enough of it, is exposed (bench/gpu_checkpoint.py: 1.44 ms of host time per checkpointed layer call "
                   "against about 0.8 ms of device work); the simulator adds fixed costs to the kernels' time and has "
                   "no max(host, device): 924.1 ms measured, priced 549.5 (-41%)")
def test_full_recompute_at_micro_batch_1_is_priced_as_it_ran() -> None:
    step = measured_gpt_steps(RECOMPUTE, runs=2)[1, 8]
    assert abs(priced(gpt(1, 8, recompute=True)) / step - 1) <= BOUND, step
