"""Tests of the vectorised enumeration, its agreement with simulate(), and the Optuna search."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from tuning.sim.hardware import load_cluster
from tuning.search import (
    RESULT_COLUMNS,
    best_configs,
    candidate_axes,
    enumerate_configs,
    optuna_search,
    row_to_spec,
    sensitivities,
)
from tuning.sim.simulator import ModelSpec, ParallelSpec, simulate, validate_parallel

A100 = load_cluster("dgx-a100-80gb")
GPT_1T = ModelSpec(layers=128, hidden=25600, heads=160, seq=2048, vocab=51200)
GPT_13B = ModelSpec(layers=40, hidden=5120, heads=32, seq=2048, vocab=51200)


@pytest.fixture(scope="module")
def df_13b():
    return enumerate_configs(GPT_13B, A100, 128, 512)


def test_vectorised_equals_scalar_on_random_rows(df_13b) -> None:
    rows = df_13b.sample(n=200, random_state=1)
    for _, row in rows.iterrows():
        res = simulate(GPT_13B, A100, row_to_spec(row), gpus=128)
        assert row["iteration_time_s"] == pytest.approx(res.iteration_time_s, rel=1e-12)
        assert row["memory_per_gpu_gb"] == pytest.approx(res.memory_per_gpu_gb, rel=1e-12)
        assert row["tflops_per_gpu"] == pytest.approx(res.tflops_per_gpu, rel=1e-12)
        assert row["mfu"] == pytest.approx(res.mfu, rel=1e-12)
        assert bool(row["fits"]) == res.fits
        for key, value in res.breakdown.items():
            assert row[f"{key}_s"] == pytest.approx(value, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("case", ["engine", "measured-host"])
def test_vectorised_equals_scalar_where_zero_changes_compute(case: str) -> None:
    """The search prices what ZeRO does not change once per layout (tuning.sim.core.ZERO_FREE_GROUP); where
    ZeRO-2/3 does change it (the engine's FSDP2 mixed precision makes hidden states bf16; a measured host's
    FSDP hooks cost time per layer) every row still prices as simulate() prices it alone."""
    import dataclasses

    if case == "engine":
        cluster, fixed = load_cluster("dgx-h100"), {"framework": "engine", "flash_attention": True}
    else:
        cluster, fixed = dataclasses.replace(A100, kernels="", overhead_layer_s=1e-3, overhead_fsdp_layer_s=2e-3), {}
    codes = {"framework": 3} if case == "engine" else {}
    df = enumerate_configs(GPT_13B, cluster, 64, 256, knobs={**codes, **{k: v for k, v in fixed.items() if k != "framework"}})
    for _, row in df.sample(n=120, random_state=2).iterrows():
        res = simulate(GPT_13B, cluster, row_to_spec(row, **fixed), gpus=64)
        assert row["iteration_time_s"] == pytest.approx(res.iteration_time_s, rel=1e-12)
        for key, value in res.breakdown.items():
            assert row[f"{key}_s"] == pytest.approx(value, rel=1e-12, abs=1e-15)


def test_enumeration_is_exactly_the_valid_set() -> None:
    """Brute force over the axes with validate_parallel gives the same rows (minus duplicates)."""
    model = ModelSpec(layers=8, hidden=256, heads=8, seq=256, vocab=512)
    gpus, batch = 16, 32
    axes = candidate_axes(model, gpus, batch, max_micro=8)
    expected = set()
    assert axes["cp"] == [1, 2, 4, 8] and axes["cp_impl"] == ["ulysses", "ring"] and axes["ep"] == [1]
    for combo in itertools.product(*axes.values()):
        pick = dict(zip(axes, combo))
        if gpus % (pick["tp"] * pick["pp"] * pick["cp"]):
            continue
        par = ParallelSpec(dp=gpus // (pick["tp"] * pick["pp"] * pick["cp"]), global_batch=batch, **pick)
        duplicate = ((pick["zero"] and par.dp * par.cp == 1) or (pick["sequence_parallel"] and pick["tp"] == 1)
                     or (pick["schedule"] == "gpipe" and pick["pp"] == 1)
                     or (pick["cp"] == 1 and pick["cp_impl"] != "ulysses"))
        if not duplicate and not validate_parallel(model, A100, par, gpus=gpus):
            expected.add((par.tp, par.pp, par.virtual, par.micro, par.zero, par.recompute,
                          par.sequence_parallel, par.schedule, par.cp, par.cp_impl, par.ep))
    df = enumerate_configs(model, A100, gpus, batch, axes=axes)
    got = set(zip(df.tp, df.pp, df.virtual, df.micro, df.zero, df.recompute,
                  df.sequence_parallel, df.schedule, df.cp, df.cp_impl, df.ep))
    assert len(df) == len(got) == len(expected) > 0
    assert got == expected


def test_1t_space_on_3072_gpus() -> None:
    """The whole space, priced; how long it takes is a timing claim: bench/timing_claims.py search."""
    df = enumerate_configs(GPT_1T, A100, 3072, 3072)
    assert len(df) >= 10_000
    assert (df.dp * df.tp * df.pp * df.cp == 3072).all()
    assert set(RESULT_COLUMNS) <= set(df.columns) and df.attrs["units"]["iteration_time_s"] == "s"
    assert df["fits"].any() and not df["fits"].all()
    best = best_configs(df, 5)
    assert best["fits"].all() and best["iteration_time_s"].is_monotonic_increasing
    assert best["iteration_time_s"].iloc[0] == df.loc[df.fits, "iteration_time_s"].min()
    # tp across nodes never wins on IB (it can rank lower in the top 5: 8 rails per node carry it)
    assert best["tp"].iloc[0] <= A100.gpus_per_node
    assert (best["tp"] <= A100.gpus_per_node).sum() >= 4  # tp16 fits where tp8 layouts do not (issue 49's memory)


def test_sensitivities_are_best_per_knob(df_13b) -> None:
    tables = sensitivities(df_13b)
    assert set(tables) == {"tp_placement", "micro_batch", "bubble", "zero"}
    overall = df_13b.loc[df_13b.fits, "iteration_time_s"].min()
    for name, table in tables.items():
        assert not table.empty, name
        assert table["iteration_time_s"].min() == pytest.approx(overall), name
    tp = tables["tp_placement"]
    assert set(tp["tp_spans_nodes"]) == {False, True}
    inside = tp.loc[~tp.tp_spans_nodes, "iteration_time_s"].min()
    assert tp.loc[tp.tp_spans_nodes, "iteration_time_s"].min() > inside
    zero = tables["zero"].set_index("zero")
    micro = df_13b[df_13b.fits].groupby("micro")["iteration_time_s"].min()
    assert np.allclose(tables["micro_batch"].set_index("micro")["iteration_time_s"], micro)
    assert list(zero.index) == [0, 1, 2, 3]


def test_optuna_search_never_beats_exhaustive_and_is_seeded() -> None:
    model = ModelSpec(layers=16, hidden=2048, heads=16, seq=1024, vocab=32000)
    axes = {"virtual": [1, 2], "micro": [1, 2, 4, 8]}
    df = enumerate_configs(model, A100, 32, 128, axes=axes)
    best = df.loc[df.fits, "tokens_per_s"].max()
    study = optuna_search(model, A100, 32, global_batch=128, n_trials=40, seed=3, axes=axes)
    again = optuna_search(model, A100, 32, global_batch=128, n_trials=40, seed=3, axes=axes)
    assert study.best_params == again.best_params
    assert 0 < study.best_value <= best * (1 + 1e-12)
    trial = study.best_trial
    par = ParallelSpec(dp=32 // (trial.params["tp"] * trial.params["pp"] * trial.params["cp"]), global_batch=128,
                       **trial.params)
    assert simulate(model, A100, par).tokens_per_s == pytest.approx(study.best_value)
    assert study.best_value >= 0.5 * best  # 40 TPE trials land within 2x of the optimum


# ---------------------------------------------------------------- uncertainty

def test_intervals_come_from_the_domain_and_mark_overlaps() -> None:
    from tuning.search import add_uncertainty
    from tuning.sim.domain import prediction

    df = add_uncertainty(enumerate_configs(GPT_13B, A100, 64, 256), hardware="dgx-a100-80gb", params=GPT_13B.params)
    row = df[(df["tp"] == 8) & (df["pp"] == 2) & (df["virtual"] == 1)].iloc[0]
    assert row["strategy_class"] == "TP+PP"
    # the published Megatron-LM TP+PP rows ran on 256-3072 GPUs: 64 is outside, so the row is flagged and its
    # interval is the one `prediction` gives the same configuration (widened for the distance)
    one = prediction(row["iteration_time_s"], hardware="dgx-a100-80gb", framework="megatron", tp=8, pp=2, virtual=1,
                     zero=int(row["zero"]), gpus=64, micro=int(row["micro"]), params=GPT_13B.params)
    assert row["extrapolated"] and not one["domain"]["inside"]
    assert [row["time_lo_s"], row["time_hi_s"]] == pytest.approx(one["interval_s"], rel=1e-9)
    assert row["time_lo_s"] < row["iteration_time_s"] < row["time_hi_s"]
    best = best_configs(df, 1).iloc[0]
    assert best["overlaps_best"]
    expected = df["fits"] & (df["time_lo_s"] <= best["time_hi_s"])
    assert (df["overlaps_best"] == expected).all() and 1 <= df["overlaps_best"].sum() < df["fits"].sum()
    assert not df.loc[~df["fits"], "overlaps_best"].any()


def test_flip_parameter_names_the_smallest_change_that_flips() -> None:
    import dataclasses as dc

    from tuning.search import FLIP_KNOBS, _config_key, flip_parameter

    res = flip_parameter(GPT_13B, A100, 64, 256)
    assert res["knob"] in FLIP_KNOBS and res["new_best"] != res["best"]
    spec = dc.replace(A100, **{f: getattr(A100, f) * res["factor"] for f in FLIP_KNOBS[res["knob"]]})
    top = best_configs(enumerate_configs(GPT_13B, spec, 64, 256), 1).iloc[0]
    assert _config_key(top) != _config_key(best_configs(enumerate_configs(GPT_13B, A100, 64, 256), 1).iloc[0])
    smaller = [t for t in res["tried"] if abs(np.log(t["factor"])) < abs(np.log(res["factor"])) - 1e-12]
    assert not any(t["flips"] for t in smaller)  # nothing smaller flipped (empty when the smallest step did)


# ---------------------------------------------------------------- learning from real trials

def test_warm_start_correction_learns_per_strategy_class() -> None:
    import optuna

    from tuning.warmstart import Correction, fit_correction, prediction_trend, refit_correction, trial_class

    dp = {"parallel": {"dp": 2}, "batch": {"global": 8, "micro": 4}}
    tp = {"parallel": {"tp": 2}, "batch": {"global": 8, "micro": 4}}
    assert trial_class(dp) == "DP/ZeRO-1" and trial_class(tp) == "TP"
    study = optuna.create_study(direction="maximize")
    truth = {"DP/ZeRO-1": 0.5, "TP": 0.8}  # the simulator is 2x / 1.25x too optimistic per class
    for i in range(8):
        cfg = dp if i % 2 == 0 else tp
        measured = 100.0 * truth[trial_class(cfg)]
        study.add_trial(optuna.trial.create_trial(value=measured, user_attrs={
            "config": cfg, "predicted_tokens_per_s": 100.0, "tokens_per_s": measured}))
    trend = prediction_trend(study)
    assert list(trend["error_pct"].round(6)) == [100.0, 25.0] * 4  # raw predictions never improve
    last = trend.iloc[-2:]
    assert (last["corrected_error_pct"].abs() < last["error_pct"].abs() / 3).all()
    assert trend["trend_abs_error_pct"].is_monotonic_decreasing and trend["trend_abs_error_pct"].iloc[-1] < 15
    correction = refit_correction(study)
    assert correction.factor("DP/ZeRO-1", "none") == pytest.approx(0.5, rel=0.15)
    assert correction.factor("TP", "none") == pytest.approx(0.8, rel=0.1)
    assert fit_correction([]) == Correction() and Correction().factor("TP", "none") == 1.0


def test_warm_start_correction_backs_off_from_compressor_to_class_to_overall() -> None:
    from tuning.warmstart import fit_correction

    # log2 ratios: DP+PowerSGD -1, TP -2. Each level = (sum + parent) / (n + 1), by hand:
    # overall (-3 + 0) / 3 = -1; class DP (-1 - 1) / 2 = -1, TP (-2 - 1) / 2 = -3/2;
    # cell (DP, powersgd) (-1 - 1) / 2 = -1, (TP, none) (-2 - 3/2) / 2 = -7/4
    c = fit_correction([("DP/ZeRO-1", "powersgd", 1.0, 2.0), ("TP", "none", 1.0, 4.0)])
    assert c.factor("TP", "none") == pytest.approx(2 ** -1.75) and c.level("TP", "none") == "cell"
    assert c.factor("DP/ZeRO-1", "powersgd") == pytest.approx(0.5)
    assert c.factor("TP", "fp16") == pytest.approx(2 ** -1.5) and c.level("TP", "fp16") == "class"
    assert c.factor("PP", "none") == pytest.approx(0.5) and c.level("PP", "none") == "overall"


def test_warm_start_correction_separates_compressors_of_one_class() -> None:
    """Alternating PowerSGD (simulator 2x too fast) and fp16 (simulator right) data-parallel trials:
    one factor per class sat between the two and never fell below ~30% error; per (class, compressor)
    each compressor's corrected error falls."""
    import optuna

    from tuning.warmstart import prediction_trend, trend_summary

    study = optuna.create_study(direction="maximize")
    for i in range(8):
        comp, measured = ("powersgd", 50.0) if i % 2 == 0 else ("fp16", 100.0)
        cfg = {"parallel": {"dp": 2}, "batch": {"global": 8, "micro": 4}, "comm": {"compressor": comp}}
        study.add_trial(optuna.trial.create_trial(value=measured, user_attrs={
            "config": cfg, "predicted_tokens_per_s": 100.0, "tokens_per_s": measured}))
    trend = prediction_trend(study)
    # log2 factors by hand, each level (sum of log2 ratios + parent) / (n + 1), PowerSGD log2 ratio -1, fp16 0:
    # t1 fp16 (class): overall -1/2, class (-1 - 1/2)/2 = -3/4
    # t2 psgd: overall -1/3, class (-1 - 1/3)/3 = -4/9, cell (-1 - 4/9)/2 = -13/18
    # t3 fp16: overall -2/4, class (-2 - 1/2)/4 = -5/8, cell (0 - 5/8)/2 = -5/16
    # t4 psgd: overall -2/5, class (-2 - 2/5)/5 = -12/25, cell (-2 - 12/25)/3 = -62/75
    # t5 fp16: overall -3/6, class (-3 - 1/2)/6 = -7/12, cell (0 - 7/12)/3 = -7/36
    # t6 psgd: overall -3/7, class (-3 - 3/7)/7 = -24/49, cell (-3 - 24/49)/4 = -171/196
    # t7 fp16: overall -4/8, class (-4 - 1/2)/8 = -9/16, cell (0 - 9/16)/4 = -9/64
    log2 = [0, -3 / 4, -13 / 18, -5 / 16, -62 / 75, -7 / 36, -171 / 196, -9 / 64]
    assert list(trend["correction_factor"]) == pytest.approx([2.0 ** x for x in log2])
    assert list(trend["correction_level"]) == ["none", "class"] + ["cell"] * 6
    assert list(trend["compressor"]) == ["powersgd", "fp16"] * 4
    # corrected / measured - 1: PowerSGD 2^(1 + x) - 1, fp16 2^x - 1
    errors = [100.0 * (2.0 ** (x + (1 if i % 2 == 0 else 0)) - 1) for i, x in enumerate(log2)]
    assert list(trend["corrected_error_pct"]) == pytest.approx(errors)
    assert [round(abs(e)) for e in errors] == [100, 41, 21, 19, 13, 13, 9, 9]  # falls for each compressor
    summary = trend_summary(trend)
    assert summary["first_median_abs_error_pct"] == pytest.approx(100 * (1 - 2 ** -0.75))  # 40.5%
    assert summary["last_median_abs_error_pct"] == pytest.approx(100 * (1 - 2 ** (-9 / 64)))  # 9.3%


def test_warm_start_corrects_the_order_of_trials_within_a_cell() -> None:
    """The simulator orders micro-batches backwards (predicts micro 8 fastest; this host ran micro 1 fastest):
    one factor per (class, compressor) cannot fix an order inside the cell, the order weights learnt on
    pairs of the other trials do. Issue 38 item 5: the correction also corrects the ranking."""
    import optuna

    from tuning.warmstart import fit_correction, order_features, pairwise_agreement, prediction_order

    study = optuna.create_study(direction="maximize")
    for micro in (1, 2, 4, 8, 1, 2, 4, 8):
        cfg = {"parallel": {"dp": 2}, "batch": {"global": 16, "micro": micro}}
        predicted, measured = 100.0 * micro ** 0.3, 80.0 * micro ** -0.3
        study.add_trial(optuna.trial.create_trial(value=measured, user_attrs={
            "config": cfg, "predicted_tokens_per_s": predicted, "tokens_per_s": measured}))
    order = prediction_order(study)
    assert order.attrs["raw_agreement"] < 0.2  # backwards (ties between repeats count half)
    assert order.attrs["corrected_agreement"] > 0.8
    assert list(order.sort_values("corrected", ascending=False)["measured_rank"].iloc[:2]) == [1, 1]  # micro 1 first
    # the weights: log(measured / predicted) falls by 0.6 ln 2 per doubling of micro (= accumulation halving)
    samples = [("DP/ZeRO-1", "none", 80.0 * m ** -0.3, 100.0 * m ** 0.3, order_features(
        {"parallel": {"dp": 2}, "batch": {"global": 16, "micro": m}})) for m in (1, 2, 4, 8)]
    c = fit_correction(samples)
    one, eight = (c.factor("DP/ZeRO-1", "none", s[4]) * s[3] for s in (samples[0], samples[3]))
    assert one > eight  # corrected: micro 1 now predicted faster than micro 8
    assert pairwise_agreement([1, 2, 3], [3, 2, 1]) == 0.0 and pairwise_agreement([1, 2, 3], [1, 2, 3]) == 1.0


def test_the_search_shortcuts_agree_with_numpy() -> None:
    """The search's faster forms (bench/simulator.py) give numpy's answers: grouping rows by a small key
    without a sort, summing terms in place without touching them, selecting only the variants rows run."""
    from tuning.sim.groups import row_groups
    from tuning.sim.memory import total_of
    from tuning.sim.zero import _select

    rng = np.random.default_rng(0)
    for key in (rng.integers(0, 50, 1000), rng.integers(0, 10**9, 1000), np.array([7, 7, 7])):
        first, inverse = row_groups(key)
        values, np_inverse = np.unique(key, return_inverse=True)
        assert (key[first] == values).all() and (inverse == np_inverse).all()
    terms = [rng.random(100), 0.0, rng.random(100), np.float64(2.0), rng.random(100)]
    kept = [np.copy(t) for t in terms]
    assert np.array_equal(total_of(terms), (((terms[0] + terms[2]) + 2.0) + terms[4]))
    assert all(np.array_equal(a, b) for a, b in zip(terms, kept)) and total_of([0.0, 0.0]) == 0.0
    cond = rng.integers(0, 3, 100)
    never = np.zeros(100, dtype=bool)
    called = []
    choices = [(cond == 0, lambda: np.full(100, 1.0)), (never, lambda: called.append(1)), (cond == 1, lambda: 2.0)]
    assert np.array_equal(_select(choices, 3.0), np.select([cond == 0, cond == 1], [1.0, 2.0], 3.0)) and not called
