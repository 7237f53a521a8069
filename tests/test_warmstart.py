"""Learning from real trials: a short real warm-started study records, per trial, the simulator's
prediction (raw and corrected with the trials finished before it) next to the measured value."""
from __future__ import annotations

import math
import uuid

import pandas as pd
import pytest

from engine.config.schema import load_config
from tuning.sim.hardware import cpu_profile, save_cluster
from tuning.objective import Objective
from tuning.space import SearchSpace
from tuning.study import load_study, run_trials
from tuning.warmstart import enqueue_simulated, local_profile, prediction_trend, rank_space, trend_summary

pytestmark = pytest.mark.xdist_group("launch")

BASE = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=32", "train.steps=4",
        "batch.global=8", "batch.micro=4", "train.warmup_steps=0", "profile.host_interval_s=0",
        "profile.nvml_interval_s=0", "train.timeout_s=60"]


def test_warm_started_study_runs_the_simulator_top_first_records_predictions_and_corrects(tmp_path) -> None:
    """One real 2-trial study checked for the warm start (the simulator's best configs run first, in
    its order) and the correction (each trial's prediction corrected with the trials before it)."""
    # a made-up host profile, deliberately off (the mechanism under test, not the calibration)
    profile = cpu_profile(name="cpu-local-1", gemm_points=[(1e5, 5e9), (1e7, 2e10), (1e9, 4e10)],
                          intra=(1e-4, 0.5), gpus_per_node=1, memory_gb=8.0)
    save_cluster(profile, tmp_path / "hardware" / "cpu-local-1.yaml")
    base = load_config(None, BASE)
    space = SearchSpace.from_dict({"world_size": 1, "params": {"batch.micro": {"choices": [2, 4, 8]}}})
    study = load_study(f"w-{uuid.uuid4().hex[:6]}", f"sqlite:///{tmp_path}/studies.db", seed=0,
                       sampler="random", pruner="none")
    # two trials prove what a third would: the second's factor is refit from the first one's real
    # measurement read back from the study; the arithmetic over more trials and levels is tested
    # without launches in tests/test_search.py
    ranked = rank_space(space, base, local_profile(1, tmp_path))
    assert [v for v, _ in ranked] == sorted((v for v, _ in ranked), reverse=True) and len(ranked) == 3
    chosen = enqueue_simulated(study, space, base, top=2, home=tmp_path)
    assert chosen == [p for _, p in ranked[:2]]
    run_trials(study, Objective(base, space, home=tmp_path, cluster=local_profile(1, tmp_path)), 2)
    trials = sorted(study.get_trials(), key=lambda t: t.number)
    assert [t.state.name for t in trials] == ["COMPLETE"] * 2 and [t.params for t in trials] == chosen
    r0 = trials[0].user_attrs["tokens_per_s"] / trials[0].user_attrs["predicted_tokens_per_s"]
    # one class and compressor (1 rank, none): each level (sum log r + parent) / (n + 1), by hand:
    # overall log r0 / 2, class (1 + 1/2) log r0 / 2 = 3/4 log r0, cell (1 + 3/4) log r0 / 2 = 7/8 log r0
    for t, expected, level in zip(trials, [1.0, r0 ** 0.875], ["none", "cell"]):
        a = t.user_attrs
        assert a["predicted_tokens_per_s"] > 0 and a["predicted_step_time_s"] > 0 and a["tokens_per_s"] > 0
        assert a["correction_trials"] == t.number and a["correction_level"] == level
        assert (a["strategy_class"], a["compressor"]) == ("DP/ZeRO-1", "none")
        assert a["correction_factor"] == pytest.approx(expected, rel=1e-9)
        assert a["corrected_tokens_per_s"] == pytest.approx(a["predicted_tokens_per_s"] * expected, rel=1e-9)
        assert a["corrected_step_time_s"] == pytest.approx(a["predicted_step_time_s"] / expected, rel=1e-9)
    trend = prediction_trend(study)
    assert list(trend["trial"]) == [0, 1]
    for (_, row), t in zip(trend.iterrows(), trials):
        a = t.user_attrs
        assert row["corrected_error_pct"] == pytest.approx(100 * (a["corrected_tokens_per_s"] / a["tokens_per_s"] - 1))
        tokens = 8 * 32  # batch.global x seq_len per step
        assert row["measured_step_s"] == pytest.approx(tokens / a["tokens_per_s"], rel=1e-6)
    summary = trend_summary(trend, first=1)
    assert summary["first_median_abs_error_pct"] == pytest.approx(abs(trend["error_pct"].iloc[0]))
    assert math.isfinite(summary["last_median_abs_error_pct"])


def test_prediction_trend_figure_draws_measured_raw_corrected_and_the_error_trend() -> None:
    from workbench.plots import fig_prediction_trend

    trend = pd.DataFrame({"trial": [0, 1], "measured_step_s": [0.2, 0.1], "predicted_step_s": [0.1, 0.05],
                          "corrected_step_s": [0.1, 0.09], "trend_abs_error_pct": [50.0, 30.0]})
    fig = fig_prediction_trend(trend)
    assert [tr.name for tr in fig.data] == ["measured", "simulator (raw)", "simulator (corrected)",
                                            "median |error| so far (%)"]
    assert list(fig.data[0].y) == [0.2, 0.1] and fig.data[3].yaxis == "y2"
    assert "no trial" in fig_prediction_trend(trend.iloc[0:0]).layout.annotations[0].text
