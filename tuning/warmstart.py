"""Multi-fidelity tuning: the simulator ranks the space first, real runs then measure.

`enqueue_simulated` puts the simulator's top-k configs for this machine at the front of a real
study; `predicted_tokens_per_s` is recorded next to the measured value of every trial. As trials
finish, `refit_correction` learns a measured/predicted factor per (strategy class, compressor),
`prediction_trend` shows the prediction error falling over the study (each trial corrected with the
trials before it) and `rerank_simulated` re-ranks the space with the correction.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna

from engine.config import RunConfig, replace
from engine.errors import ConfigError
from profilers.store import default_home
from tuning.space import SearchSpace

if TYPE_CHECKING:
    import pandas as pd

MAX_CANDIDATES = 2000


def local_profile(world: int, home: str | Path | None = None):
    """The calibrated profile of this machine for `world` ranks (`workbench calibrate --world`), or None."""
    from tuning.hardware import load_cluster

    path = (Path(home) if home else default_home()) / "hardware" / f"cpu-local-{world}.yaml"
    return load_cluster(path) if path.is_file() else None


def predict_tokens_per_s(cfg: RunConfig, cluster) -> float | None:
    from tuning.calibration import predict_run

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


@dataclass(frozen=True)
class Correction:
    """Factors measured/predicted tokens/s learnt from finished trials, at three levels: per
    (strategy class, compressor) cell, per strategy class and overall. `factor` uses the most
    specific level that has trials (a cell never tried backs off to its class, a class never tried
    to the overall factor; 1 before any trial)."""

    overall: float = 1.0
    classes: dict[str, float] = field(default_factory=dict)
    cells: dict[tuple[str, str], float] = field(default_factory=dict)

    def level(self, cls: str, compressor: str) -> str:
        """Which factor applies: "cell", "class", "overall" or "none" (no trial yet)."""
        if (cls, compressor) in self.cells:
            return "cell"
        return "class" if cls in self.classes else ("overall" if self.classes else "none")

    def factor(self, cls: str, compressor: str) -> float:
        """The correction for a trial of this class and compressor (multiply predicted tokens/s)."""
        return self.cells.get((cls, compressor), self.classes.get(cls, self.overall))


def trial_class(cfg: dict[str, Any]) -> str:
    """The simulator's strategy class of a trial's run config (`user_attrs['config']`)."""
    from tuning.published import strategy_class
    from tuning.simulator import from_run_config

    _, par = from_run_config(cfg)
    return str(strategy_class(par.tp, par.pp, par.virtual, par.zero))


def trial_compressor(cfg: dict[str, Any]) -> str:
    """The gradient compressor of a trial's run config (`comm.compressor`, "none" when absent)."""
    return str((cfg.get("comm") or {}).get("compressor", "none"))


def _finished(study: optuna.Study) -> list[tuple[int, str, str, float, float]]:
    """(trial number, class, compressor, measured, predicted tokens/s) of complete trials with a prediction."""
    out = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        predicted = t.user_attrs.get("predicted_tokens_per_s")
        measured = t.user_attrs.get("tokens_per_s", t.values[0] if t.values else None)
        cfg = t.user_attrs.get("config")
        if predicted and measured and cfg:
            out.append((t.number, trial_class(cfg), trial_compressor(cfg), float(measured), float(predicted)))
    return sorted(out)


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
    logs = [(cls, comp, math.log(measured / predicted)) for cls, comp, measured, predicted in samples]
    overall = _shrunk([x for _, _, x in logs], 0.0)
    classes = {cls: _shrunk([x for c, _, x in logs if c == cls], overall) for cls, _, _ in logs}
    cells = {(cls, comp): _shrunk([x for c, k, x in logs if (c, k) == (cls, comp)], classes[cls])
             for cls, comp, _ in logs}
    return Correction(math.exp(overall), {c: math.exp(v) for c, v in classes.items()},
                      {k: math.exp(v) for k, v in cells.items()})


def refit_correction(study: optuna.Study) -> Correction:
    """The correction learnt from every finished trial of `study`."""
    return fit_correction([(cls, comp, m, p) for _, cls, comp, m, p in _finished(study)])


def record_prediction(trial: optuna.trial.Trial, cfg: RunConfig, cluster) -> None:
    """Record the simulator's prediction for a trial about to run, raw and corrected with every trial
    finished so far (`refit_correction`): tokens/s and step time (s), the strategy class and
    compressor, the factor applied, its level and how many finished trials it was learnt from. A
    config the simulator cannot price records nothing."""
    from tuning.calibration import predict_run

    try:
        result = predict_run(cfg, cluster)
    except ValueError:
        return
    cls, comp = trial_class(cfg.to_dict()), trial_compressor(cfg.to_dict())
    samples = [(c, k, m, p) for _, c, k, m, p in _finished(trial.study)]
    correction = fit_correction(samples)
    factor = correction.factor(cls, comp)
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
    for number, cls, comp, measured, predicted in _finished(study):
        rec = attrs[number]
        if "correction_factor" in rec:
            factor, learnt = float(rec["correction_factor"]), int(rec.get("correction_trials", 0))
            level = rec.get("correction_level", "class" if learnt else "none")
        else:
            correction = fit_correction(seen)
            factor, level, learnt = correction.factor(cls, comp), correction.level(cls, comp), len(seen)
        corrected = predicted * factor
        step = rec.get("predicted_step_time_s")
        rows.append({"trial": number, "strategy_class": cls, "compressor": comp, "measured": measured,
                     "predicted": predicted, "corrected": corrected, "error_pct": 100.0 * (predicted / measured - 1),
                     "corrected_error_pct": 100.0 * (corrected / measured - 1),
                     # tokens per step are fixed within a trial: step time scales as 1 / tokens/s
                     "measured_step_s": step * predicted / measured if step else None,
                     "predicted_step_s": step, "corrected_step_s": step / factor if step else None,
                     "correction_factor": factor, "correction_level": level, "correction_trials": learnt})
        seen.append((cls, comp, measured, predicted))
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
        ranked.append((value * correction.factor(trial_class(cfg), trial_compressor(cfg)), params))
    chosen = [p for _, p in sorted(ranked, key=lambda item: -item[0]) if p not in tried][:top]
    for params in chosen:
        study.enqueue_trial(params, skip_if_exists=True)
    return chosen
