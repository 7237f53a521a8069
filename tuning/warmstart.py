"""Multi-fidelity tuning: the simulator ranks the space first, real runs then measure.

`enqueue_simulated` puts the simulator's top-k configs for this machine at the front of a real
study; `predicted_tokens_per_s` is recorded next to the measured value of every trial. As trials
finish, `refit_correction` learns a measured/predicted factor per (strategy class, compressor) and,
for the order within them, weights on the layout's knobs (micro-batch, accumulation, tp, pp, dp)
fitted on the pairwise differences of finished trials (`fit_order`); `prediction_trend` shows the
prediction error falling over the study (each trial corrected with the trials before it),
`prediction_order` the predicted vs measured order of finished trials (raw and corrected, each trial
corrected without its own measurement), and `rerank_simulated` re-ranks the space with the correction.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna

from engine.config.schema import RunConfig, replace
from engine.errors import ConfigError
from profilers.store import default_home
from tuning.space import SearchSpace

if TYPE_CHECKING:
    import pandas as pd

MAX_CANDIDATES = 2000


def local_profile(world: int, home: str | Path | None = None):
    """The calibrated profile of this machine for `world` ranks (`workbench calibrate --world`), or None."""
    from tuning.sim.hardware import load_cluster

    path = (Path(home) if home else default_home()) / "hardware" / f"cpu-local-{world}.yaml"
    return load_cluster(path) if path.is_file() else None


def predict_tokens_per_s(cfg: RunConfig, cluster) -> float | None:
    from tuning.calibrate.calibration import predict_run

    try:
        return float(predict_run(cfg, cluster).tokens_per_s)
    except ValueError:  # a config the simulator cannot price
        return None


def rank_space(space: SearchSpace, base: RunConfig, cluster, *, seed: int = 0) -> list[tuple[float, dict[str, Any]]]:
    """(predicted tokens/s, params) for valid combinations of the space, best first."""
    combos = space.grid()
    if len(combos) > MAX_CANDIDATES:
        combos = random.Random(seed).sample(combos, MAX_CANDIDATES)
    ranked = []
    for params in combos:
        try:
            cfg = replace(base, space.to_overrides(params, base))
        except ConfigError:
            continue
        value = predict_tokens_per_s(cfg, cluster)
        if value is not None:
            ranked.append((value, params))
    return sorted(ranked, key=lambda item: -item[0])


def _local_cluster(space: SearchSpace, base: RunConfig, top: int, home: str | Path | None):
    """This machine's calibrated profile for the space's world size, or a ConfigError saying how to make it."""
    world = space.world_size or base.world_size
    cluster = local_profile(world, home)
    if cluster is None:
        raise ConfigError("--warm-start", top, f"needs this machine's hardware profile: run "
                          f"`workbench calibrate --world {world}` first")
    return cluster


def enqueue_simulated(study: optuna.Study, space: SearchSpace, base: RunConfig, *, top: int,
                      home: str | Path | None = None) -> list[dict[str, Any]]:
    """Enqueue the simulator's best `top` configs; needs a calibrated profile of this machine."""
    cluster = _local_cluster(space, base, top, home)
    chosen = [params for _, params in rank_space(space, base, cluster)[:top]]
    for params in chosen:
        study.enqueue_trial(params, skip_if_exists=True)
    return chosen


# ---------------------------------------------------------------- learning from finished trials

SHRINK_ROWS = 1.0  # each level's correction counts its parent's as this many trials (shrinkage)
ORDER_FEATURES = ("micro", "accum", "tp", "pp", "dp")  # log2 of each: the knobs that order trials within a cell
ORDER_RIDGE = 1.0  # ridge weight per trial on the order weights (shrinks them toward 0 with few trials)
MIN_ORDER_TRIALS = 3  # finished trials before any order weight is learnt


@dataclass(frozen=True)
class Correction:
    """Factors measured/predicted tokens/s learnt from finished trials, at three levels: per
    (strategy class, compressor) cell, per strategy class and overall. `factor` uses the most
    specific level that has trials (a cell never tried backs off to its class, a class never tried
    to the overall factor; 1 before any trial), times exp(sum w_k (x_k - center_k)) over the order
    features when they are given (`fit_order`)."""

    overall: float = 1.0
    classes: dict[str, float] = field(default_factory=dict)
    cells: dict[tuple[str, str], float] = field(default_factory=dict)
    order: dict[str, float] = field(default_factory=dict)  # log factor per log2 unit of each feature
    center: dict[str, float] = field(default_factory=dict)  # the features' mean over the trials fitted on

    def level(self, cls: str, compressor: str) -> str:
        """Which factor applies: "cell", "class", "overall" or "none" (no trial yet)."""
        if (cls, compressor) in self.cells:
            return "cell"
        return "class" if cls in self.classes else ("overall" if self.classes else "none")

    def factor(self, cls: str, compressor: str, features: dict[str, float] | None = None) -> float:
        """The correction for a trial of this class and compressor (multiply predicted tokens/s); with its
        order `features`, the within-cell order term too."""
        base = self.cells.get((cls, compressor), self.classes.get(cls, self.overall))
        if not features or not self.order:
            return base
        return base * math.exp(sum(w * (features[k] - self.center.get(k, 0.0)) for k, w in self.order.items()))


def trial_class(cfg: dict[str, Any]) -> str:
    """The simulator's strategy class of a trial's run config (`user_attrs['config']`)."""
    from tuning.sim.published import strategy_class
    from tuning.sim.simulator import from_run_config

    _, par = from_run_config(cfg)
    return str(strategy_class(par.tp, par.pp, par.virtual, par.zero))


def trial_compressor(cfg: dict[str, Any]) -> str:
    """The gradient compressor of a trial's run config (`comm.compressor`, "none" when absent)."""
    return str((cfg.get("comm") or {}).get("compressor", "none"))


def order_features(cfg: dict[str, Any]) -> dict[str, float]:
    """log2 of the layout knobs that order trials within a (class, compressor) cell: micro-batch, gradient
    accumulation steps, tp, pp and dp (the simulator misprices micro-batching on a loaded host, docs)."""
    par, batch = cfg.get("parallel") or {}, cfg.get("batch") or {}
    dp, micro = int(par.get("dp", 1)), int(batch.get("micro", 4))
    accum = max(int(batch.get("global", 8)) // max(dp * micro, 1), 1)
    values = {"micro": micro, "accum": accum, "tp": int(par.get("tp", 1)), "pp": int(par.get("pp", 1)), "dp": dp}
    return {k: math.log2(max(v, 1)) for k, v in values.items()}


def _finished(study: optuna.Study) -> list[tuple[int, str, str, float, float, dict[str, float]]]:
    """(trial number, class, compressor, measured, predicted tokens/s, order features) of complete trials
    with a prediction."""
    out = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        predicted = t.user_attrs.get("predicted_tokens_per_s")
        measured = t.user_attrs.get("tokens_per_s", t.values[0] if t.values else None)
        cfg = t.user_attrs.get("config")
        if predicted and measured and cfg:
            out.append((t.number, trial_class(cfg), trial_compressor(cfg), float(measured), float(predicted),
                        order_features(cfg)))
    return sorted(out, key=lambda item: item[0])


def _shrunk(logs: list[float], parent: float) -> float:
    """log factor of one level: the mean of its log-ratios shrunk toward its parent's log factor,
    (sum + SHRINK_ROWS parent) / (n + SHRINK_ROWS)."""
    return (sum(logs) + SHRINK_ROWS * parent) / (len(logs) + SHRINK_ROWS)


def fit_correction(samples: list[tuple[str, str, float, float]]) -> Correction:
    """The correction learnt from (class, compressor, measured, predicted) samples (ours).

    Per level, the mean of log(measured / predicted) (a geometric mean of the ratios) shrunk toward
    the level above, which counts as SHRINK_ROWS trials: overall toward 0 (factor 1), a class toward
    the overall factor, a (class, compressor) cell toward its class. The compressor is a level of its
    own because the simulator misprices compressors differently (one class factor learnt on PowerSGD
    trials made fp16 trials worse). A mean rather than a median: in a class mixing compressors the
    median takes the majority compressor's error and drags the minority's cells toward it.
    """
    if not samples:
        return Correction()
    logs = [(s[0], s[1], math.log(s[2] / s[3])) for s in samples]
    overall = _shrunk([x for _, _, x in logs], 0.0)
    classes = {cls: _shrunk([x for c, _, x in logs if c == cls], overall) for cls, _, _ in logs}
    cells = {(cls, comp): _shrunk([x for c, k, x in logs if (c, k) == (cls, comp)], classes[cls])
             for cls, comp, _ in logs}
    levels = Correction(math.exp(overall), {c: math.exp(v) for c, v in classes.items()},
                        {k: math.exp(v) for k, v in cells.items()})
    features = [s[4] for s in samples if len(s) > 4]
    if len(features) != len(samples):
        return levels
    order, center = fit_order(samples, levels)
    return Correction(levels.overall, levels.classes, levels.cells, order, center)


def fit_order(samples: list[tuple], levels: Correction) -> tuple[dict[str, float], dict[str, float]]:
    """Order weights (ours): what the level factors leave, r = log(measured / predicted) - log(factor),
    regressed on the order features over every pair of trials, r_i - r_j ~ w (x_i - x_j) (a pair's common
    offset cancels, so only the order is learnt), ridge-shrunk toward 0 by ORDER_RIDGE per trial.
    Features that no two trials differ in get no weight. Returns (weights, the features' mean)."""
    import numpy as np

    if len(samples) < MIN_ORDER_TRIALS:
        return {}, {}
    x = np.array([[s[4][k] for k in ORDER_FEATURES] for s in samples])
    r = np.array([math.log(s[2] / s[3]) - math.log(levels.factor(s[0], s[1])) for s in samples])
    i, j = np.triu_indices(len(samples), k=1)
    d, y = x[i] - x[j], r[i] - r[j]
    varied = np.ptp(x, axis=0) > 0
    if not varied.any():
        return {}, {}
    dv = d[:, varied]
    w = np.linalg.solve(dv.T @ dv + ORDER_RIDGE * len(samples) * np.eye(dv.shape[1]), dv.T @ y)
    names = [k for k, v in zip(ORDER_FEATURES, varied) if v]
    return ({k: float(v) for k, v in zip(names, w)}, {k: float(x[:, ORDER_FEATURES.index(k)].mean()) for k in names})


def refit_correction(study: optuna.Study) -> Correction:
    """The correction learnt from every finished trial of `study`."""
    return fit_correction([(cls, comp, m, p, f) for _, cls, comp, m, p, f in _finished(study)])


def record_prediction(trial: optuna.trial.Trial, cfg: RunConfig, cluster) -> None:
    """Record the simulator's prediction for a trial about to run, raw and corrected with every trial
    finished so far (`refit_correction`): tokens/s and step time (s), the strategy class and
    compressor, the factor applied, its level and how many finished trials it was learnt from. A
    config the simulator cannot price records nothing."""
    from tuning.calibrate.calibration import predict_run

    try:
        result = predict_run(cfg, cluster)
    except ValueError:
        return
    cls, comp = trial_class(cfg.to_dict()), trial_compressor(cfg.to_dict())
    samples = [(c, k, m, p, f) for _, c, k, m, p, f in _finished(trial.study)]
    correction = fit_correction(samples)
    factor = correction.factor(cls, comp, order_features(cfg.to_dict()))
    step = float(result.iteration_time_s)
    for key, value in {"predicted_tokens_per_s": float(result.tokens_per_s), "predicted_step_time_s": step,
                       "strategy_class": cls, "compressor": comp, "correction_factor": factor,
                       "correction_level": correction.level(cls, comp), "correction_trials": len(samples),
                       "corrected_tokens_per_s": float(result.tokens_per_s) * factor,
                       "corrected_step_time_s": step / factor}.items():
        trial.set_user_attr(key, value)


TREND_COLUMNS = ["trial", "strategy_class", "compressor", "measured", "predicted", "corrected", "error_pct",
                 "corrected_error_pct", "measured_step_s", "predicted_step_s", "corrected_step_s",
                 "correction_factor", "correction_level", "correction_trials"]


def prediction_trend(study: optuna.Study) -> pd.DataFrame:
    """Predicted vs measured per finished trial, raw and corrected with the trials before it.

    Columns: trial, strategy_class, compressor, measured, predicted, corrected (tokens/s), error_pct
    and corrected_error_pct (prediction / measured - 1, in tokens/s), the same as step times
    (measured_step_s, predicted_step_s, corrected_step_s), correction_factor, correction_level
    (cell, class, overall or none) and correction_trials (the finished trials it came from),
    trend_abs_error_pct (running median of |corrected error|): the data of the Tune page's
    predicted-vs-measured plot and its error trend. A trial that recorded its corrected prediction
    when it started (`record_prediction`) shows that; older trials are corrected here with the
    trials finished before them in number order.
    """
    import pandas as pd

    attrs = {t.number: t.user_attrs for t in study.get_trials(deepcopy=False)}
    rows, seen = [], []
    for number, cls, comp, measured, predicted, features in _finished(study):
        rec = attrs[number]
        if "correction_factor" in rec:
            factor, learnt = float(rec["correction_factor"]), int(rec.get("correction_trials", 0))
            level = rec.get("correction_level", "class" if learnt else "none")
        else:
            correction = fit_correction(seen)
            factor = correction.factor(cls, comp, features)
            level, learnt = correction.level(cls, comp), len(seen)
        corrected = predicted * factor
        step = rec.get("predicted_step_time_s")
        rows.append({"trial": number, "strategy_class": cls, "compressor": comp, "measured": measured,
                     "predicted": predicted, "corrected": corrected, "error_pct": 100.0 * (predicted / measured - 1),
                     "corrected_error_pct": 100.0 * (corrected / measured - 1),
                     # tokens per step are fixed within a trial: step time scales as 1 / tokens/s
                     "measured_step_s": step * predicted / measured if step else None,
                     "predicted_step_s": step, "corrected_step_s": step / factor if step else None,
                     "correction_factor": factor, "correction_level": level, "correction_trials": learnt})
        seen.append((cls, comp, measured, predicted, features))
    df = pd.DataFrame(rows, columns=TREND_COLUMNS)
    df["trend_abs_error_pct"] = df["corrected_error_pct"].abs().expanding().median()
    return df


def trend_summary(trend: pd.DataFrame, *, first: int = 3) -> dict[str, Any]:
    """Median |error| of the corrected predictions over the first and the last `first` trials (and
    of the raw ones over all trials): the figure that says whether the study's predictions improved."""
    if trend.empty:
        return {"trials": 0}
    head, tail = trend.head(first), trend.tail(first)
    return {"trials": len(trend), "first_trials": [int(x) for x in head["trial"]],
            "last_trials": [int(x) for x in tail["trial"]],
            "first_median_abs_error_pct": float(head["corrected_error_pct"].abs().median()),
            "last_median_abs_error_pct": float(tail["corrected_error_pct"].abs().median()),
            "raw_median_abs_error_pct": float(trend["error_pct"].abs().median())}


def rerank_simulated(study: optuna.Study, space: SearchSpace, base: RunConfig, *, top: int,
                     home: str | Path | None = None) -> list[dict[str, Any]]:
    """Re-rank the space with the correction learnt so far and enqueue the best `top` not yet tried."""
    cluster = _local_cluster(space, base, top, home)
    correction = refit_correction(study)
    tried = [t.params for t in study.get_trials(deepcopy=False)]
    ranked = []
    for value, params in rank_space(space, base, cluster):
        cfg = replace(base, space.to_overrides(params, base)).to_dict()
        ranked.append((value * correction.factor(trial_class(cfg), trial_compressor(cfg), order_features(cfg)), params))
    chosen = [p for _, p in sorted(ranked, key=lambda item: -item[0]) if p not in tried][:top]
    for params in chosen:
        study.enqueue_trial(params, skip_if_exists=True)
    return chosen


def pairwise_agreement(predicted: Any, measured: Any) -> float:
    """Share of pairs of trials the prediction orders as measured (ties in either count half); nan under two."""
    import numpy as np

    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    i, j = np.triu_indices(len(p), k=1)
    if not len(i):
        return float("nan")
    agree = np.sign(p[i] - p[j]) * np.sign(m[i] - m[j])
    return float(np.mean(np.where(agree == 0, 0.5, agree > 0)))


def prediction_order(study: optuna.Study) -> pd.DataFrame:
    """Predicted vs measured order of the finished trials (the Tune page's order table): per trial its
    measured tokens/s and rank, the raw prediction and its rank, and the corrected prediction and its
    rank, each trial corrected with a correction learnt from every *other* finished trial (its own
    measurement never orders it). `df.attrs` holds the pairwise agreement of raw and corrected order."""
    import pandas as pd

    done = _finished(study)
    rows = []
    for number, cls, comp, measured, predicted, features in done:
        others = [(c, k, m, p, f) for n, c, k, m, p, f in done if n != number]
        factor = fit_correction(others).factor(cls, comp, features)
        rows.append({"trial": number, "strategy_class": cls, "compressor": comp, "measured": measured,
                     "predicted": predicted, "corrected": predicted * factor})
    df = pd.DataFrame(rows, columns=["trial", "strategy_class", "compressor", "measured", "predicted", "corrected"])
    for col in ("measured", "predicted", "corrected"):
        df[f"{col}_rank"] = df[col].rank(ascending=False, method="min").astype("Int64")
    df.attrs["raw_agreement"] = pairwise_agreement(df["predicted"], df["measured"])
    df.attrs["corrected_agreement"] = pairwise_agreement(df["corrected"], df["measured"])
    return df
