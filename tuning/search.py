"""Frontier-style what-if searches over the simulator: exhaustive (vectorised) and Optuna.

`enumerate_configs` builds every valid (tp, pp, dp, virtual, micro, zero, recompute, sequence
parallel, schedule) for a model and GPU count as numpy arrays and prices them in one call of
`tuning.simulator.evaluate_arrays`; no Python loop runs per configuration.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from tuning.hardware import ClusterSpec, load_cluster
from tuning.simulator import (
    RECOMPUTE,
    SCHEDULES,
    ModelSpec,
    ParallelSpec,
    evaluate_arrays,
    simulate,
    validate_parallel,
)

UNITS = {
    "iteration_time_s": "s", "tokens_per_s": "tokens/s", "tflops_per_gpu": "TFLOP/s per GPU",
    "mfu": "fraction of peak", "memory_per_gpu_gb": "GB (1e9 B)", "compute_s": "s",
    "tp_comm_s": "s", "pp_comm_s": "s", "bubble_s": "s", "dp_comm_exposed_s": "s",
    "optimizer_s": "s", "bubble_fraction": "fraction of ideal pipeline time",
    "micro": "samples", "global_batch": "samples",
}
RESULT_COLUMNS = [
    "iteration_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "memory_per_gpu_gb", "fits",
    "compute_s", "tp_comm_s", "pp_comm_s", "bubble_s", "dp_comm_exposed_s", "optimizer_s",
    "bubble_fraction", "num_microbatches", "mem_params_gb", "mem_grads_gb",
    "mem_optimizer_gb", "mem_activations_gb", "dp_comm_total_s",
]


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def candidate_axes(model: ModelSpec, gpus: int, global_batch: int, *, max_micro: int = 64,
                   max_tp: int = 64) -> dict[str, list[Any]]:
    """Default values of each search axis for `model` on `gpus` GPUs."""
    return {
        "tp": _divisors(math.gcd(model.heads, gpus), max_tp),
        "pp": _divisors(math.gcd(model.layers, gpus)),
        "micro": _divisors(global_batch, max_micro),
        "virtual": [1, 2, 4, 8],
        "zero": [0, 1, 2, 3],
        "recompute": list(RECOMPUTE),
        "sequence_parallel": [False, True],
        "schedule": ["1f1b", "gpipe"],  # interleaved = 1f1b with virtual > 1
    }


_CATEGORIES = {name: pd.CategoricalDtype(pd.Index(list(values), dtype=object))
               for name, values in (("recompute", RECOMPUTE), ("schedule", SCHEDULES))}
LAYOUT_AXES = ("tp", "pp", "virtual", "micro", "schedule")  # validity depends on these together
KNOB_AXES = ("zero", "recompute", "sequence_parallel")  # then only on tp and dp


def _product(axes: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    mesh = np.meshgrid(*axes.values(), indexing="ij")
    return {k: m.ravel() for k, m in zip(axes, mesh)}


def _grid(axes: dict[str, list[Any]]) -> dict[str, np.ndarray]:
    """Cartesian product of the axes as flat arrays (codes for the string axes)."""
    coded = {k: np.asarray(v) for k, v in axes.items()}
    coded["recompute"] = np.asarray([RECOMPUTE.index(r) for r in axes["recompute"]])
    coded["schedule"] = np.asarray([SCHEDULES.index(s) for s in axes["schedule"]])
    return _product(coded)


def _valid_grid(model: ModelSpec, gpus: int, global_batch: int, axes: dict[str, list[Any]]) -> dict[str, np.ndarray]:
    """The valid rows of the product of `axes`, built in two stages so invalid layouts are
    dropped before they are multiplied by the knob axes (same rows as `_valid` on `_grid`)."""
    coded = _grid({k: axes[k] for k in LAYOUT_AXES} | {"zero": [0], "recompute": [axes["recompute"][0]],
                                                         "sequence_parallel": [False]})
    lay = {k: coded[k] for k in LAYOUT_AXES}
    tp, pp, v, micro = lay["tp"], lay["pp"], lay["virtual"], lay["micro"]
    ok = (gpus % (tp * pp) == 0) & (model.heads % tp == 0) & (model.layers % (pp * v) == 0)
    dp = np.maximum(gpus // (tp * pp), 1)
    ok &= global_batch % (dp * micro) == 0
    nmb = global_batch // (dp * micro)
    ok &= (v == 1) | ((pp > 1) & (lay["schedule"] == 0) & (nmb % pp == 0))
    ok &= ~((lay["schedule"] == 1) & (pp == 1))  # gpipe == 1f1b without a pipeline
    lay = {k: a[ok] for k, a in lay.items()}
    knobs = _product({"zero": np.asarray(axes["zero"]),
                      "recompute": np.asarray([RECOMPUTE.index(r) for r in axes["recompute"]]),
                      "sequence_parallel": np.asarray(axes["sequence_parallel"], dtype=bool)})
    n_lay, n_knob = lay["tp"].size, knobs["zero"].size
    g = {k: np.repeat(a, n_knob) for k, a in lay.items()}
    g.update({k: np.tile(a, n_lay) for k, a in knobs.items()})
    tp, dp = g["tp"], gpus // (g["tp"] * g["pp"])
    keep = (~g["sequence_parallel"] | ((tp > 1) & (model.seq % tp == 0))) & ((g["zero"] == 0) | (dp > 1))
    return {k: a[keep] for k, a in g.items()}


def _valid(model: ModelSpec, gpus: int, global_batch: int, g: dict[str, np.ndarray]) -> np.ndarray:
    """Rows `validate_parallel` accepts, without duplicates (e.g. ZeRO>0 at dp=1)."""
    tp, pp, v, micro = g["tp"], g["pp"], g["virtual"], g["micro"]
    ok = (gpus % (tp * pp) == 0) & (model.heads % tp == 0) & (model.layers % (pp * v) == 0)
    dp = np.maximum(gpus // (tp * pp), 1)
    ok &= global_batch % (dp * micro) == 0
    nmb = global_batch // (dp * micro)
    interleaved = v > 1
    ok &= ~interleaved | ((pp > 1) & (g["schedule"] == 0) & (nmb % pp == 0))
    ok &= ~((g["schedule"] == 1) & (pp == 1))  # gpipe == 1f1b without a pipeline
    ok &= ~g["sequence_parallel"] | ((tp > 1) & (model.seq % tp == 0))
    ok &= (g["zero"] == 0) | (dp > 1)
    return ok


def enumerate_configs(model: ModelSpec, cluster: ClusterSpec, gpus: int, global_batch: int, *,
                      axes: dict[str, list[Any]] | None = None, dtype_bytes: int = 2,
                      compression_ratio: float = 1.0, co2: bool = False,
                      overlap_dp: bool = True, bucket_mb: float = 25.0) -> pd.DataFrame:
    """Every valid configuration of `model` on `gpus` GPUs, priced; one row each.

    `axes` overrides `candidate_axes` per axis (e.g. {"zero": [0, 1]}). Columns: the settings
    (tp, pp, dp, virtual, micro, global_batch, zero, recompute, sequence_parallel, schedule,
    tp_spans_nodes) and RESULT_COLUMNS; units in `df.attrs["units"]`.
    """
    full_axes = candidate_axes(model, gpus, global_batch)
    full_axes.update(axes or {})
    g = _valid_grid(model, gpus, global_batch, full_axes)
    g["dp"] = gpus // (g["tp"] * g["pp"])
    g["schedule"] = np.where(g["virtual"] > 1, SCHEDULES.index("interleaved"), g["schedule"])
    n = g["tp"].size
    fixed = {"global_batch": global_batch, "dtype_bytes": dtype_bytes, "co2": co2,
             "compression_ratio": float(compression_ratio), "overlap_dp": overlap_dp,
             "bucket_mb": float(bucket_mb)}
    cols = {**g, **fixed}  # fixed settings stay scalars: numpy broadcasts them for free
    res = evaluate_arrays(model, cluster, gpus, cols)
    df = pd.DataFrame({
        "tp": g["tp"], "pp": g["pp"], "dp": g["dp"], "virtual": g["virtual"], "micro": g["micro"],
        "global_batch": np.full(n, global_batch), "zero": g["zero"],
        # categoricals: string values without building one Python string per row
        "recompute": pd.Categorical.from_codes(g["recompute"], dtype=_CATEGORIES["recompute"]),
        "sequence_parallel": g["sequence_parallel"].astype(bool),
        "schedule": pd.Categorical.from_codes(g["schedule"], dtype=_CATEGORIES["schedule"]),
        "tp_spans_nodes": g["tp"] > cluster.gpus_per_node,
        **{c: np.broadcast_to(res[c], (n,)) for c in RESULT_COLUMNS},
    }, copy=False)
    df["fits"] = df["fits"].astype(bool)
    df.attrs["units"] = dict(UNITS)
    df.attrs.update(cluster=cluster.name, gpus=gpus, model=str(model))
    return df


def row_to_spec(row: pd.Series | dict[str, Any], **fixed: Any) -> ParallelSpec:
    """The ParallelSpec of one `enumerate_configs` row (fixed: dtype_bytes, co2, ...)."""
    return ParallelSpec(
        dp=int(row["dp"]), tp=int(row["tp"]), pp=int(row["pp"]), virtual=int(row["virtual"]),
        micro=int(row["micro"]), global_batch=int(row["global_batch"]), zero=int(row["zero"]),
        recompute=str(row["recompute"]), sequence_parallel=bool(row["sequence_parallel"]),
        schedule=str(row["schedule"]), **fixed,
    )


def best_configs(df: pd.DataFrame, k: int = 10, *, fits_only: bool = True) -> pd.DataFrame:
    """The `k` fastest configurations (shortest iteration), fitting in memory by default."""
    pool = df[df["fits"]] if fits_only else df
    return pool.nsmallest(k, "iteration_time_s").reset_index(drop=True)


def add_uncertainty(df: pd.DataFrame) -> pd.DataFrame:
    """Add strategy_class, time_lo_s / time_hi_s (measured-time interval from the class's held-out
    residuals, tuning.published) and overlaps_best: the interval overlaps the best fitting one's,
    so the data cannot tell the two apart. Returns `df` (columns added in place)."""
    from tuning.published import interval_fields

    fields = interval_fields(df["iteration_time_s"].to_numpy(), df["tp"].to_numpy(), df["pp"].to_numpy(),
                             df["virtual"].to_numpy(), df["zero"].to_numpy())
    for key, values in fields.items():
        df[key] = values
    pool = df[df["fits"]]
    best_hi = pool.loc[pool["iteration_time_s"].idxmin(), "time_hi_s"] if len(pool) else -np.inf
    df["overlaps_best"] = df["fits"] & (df["time_lo_s"] <= best_hi)
    df.attrs.setdefault("units", {}).update(time_lo_s="s", time_hi_s="s")
    return df


FLIP_KNOBS = {  # what-if knob -> the ClusterSpec fields it scales together
    "bandwidth": ("intra_bw_gb_s", "inter_bw_gb_s"),
    "peak": ("peak_flops",),
    "memory": ("memory_gb",),
}
FLIP_FACTORS = (1.1, 1.25, 1.5, 2.0, 3.0, 4.0)


def _config_key(row: pd.Series) -> tuple:
    return tuple(row[k] for k in ("tp", "pp", "dp", "virtual", "micro", "zero", "recompute",
                                  "sequence_parallel", "schedule"))


def flip_parameter(model: ModelSpec, cluster: ClusterSpec, gpus: int, global_batch: int,
                   **kwargs: Any) -> dict[str, Any]:
    """The one hardware knob (bandwidth, peak, memory) whose smallest change flips the top choice.

    Scales each knob by FLIP_FACTORS up and down (bandwidth = intra- and inter-node together) and
    re-runs the exhaustive search; returns {knob, factor, best, new_best, tried} for the smallest
    change that makes another configuration the fastest fitting one (knob None when none does).
    """
    import dataclasses

    base = best_configs(enumerate_configs(model, cluster, gpus, global_batch, **kwargs), 1)
    if base.empty:
        return {"knob": None, "factor": None, "best": None, "new_best": None, "tried": []}
    key = _config_key(base.iloc[0])
    tried, found = [], []
    for factor in FLIP_FACTORS:
        for knob, fields in FLIP_KNOBS.items():
            for f in (factor, 1.0 / factor):
                spec = dataclasses.replace(cluster, **{x: getattr(cluster, x) * f for x in fields})
                top = best_configs(enumerate_configs(model, spec, gpus, global_batch, **kwargs), 1)
                flipped = not top.empty and _config_key(top.iloc[0]) != key
                tried.append({"knob": knob, "factor": f, "flips": flipped})
                if flipped:
                    found.append((knob, f, top.iloc[0]))
        if found:
            break
    knob, f, new = found[0] if found else (None, None, None)
    return {"knob": knob, "factor": f, "best": _plain(base.iloc[0]),
            "new_best": None if new is None else _plain(new), "tried": tried}


def _plain(row: pd.Series) -> dict[str, Any]:
    cols = ("tp", "pp", "dp", "virtual", "micro", "zero", "recompute", "sequence_parallel", "schedule")
    return {k: (row[k].item() if hasattr(row[k], "item") else row[k]) for k in cols}


def _best_by(df: pd.DataFrame, keys: list[str], cols: list[str]) -> pd.DataFrame:
    pool = df[df["fits"]]
    if pool.empty:
        return pd.DataFrame(columns=keys + cols)
    idx = pool.groupby(keys)["iteration_time_s"].idxmin()
    return pool.loc[idx, keys + cols].sort_values(keys).reset_index(drop=True)


def sensitivities(df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Small tables: the best fitting configuration per value of one knob.

    tp_placement (tp inside a node vs across nodes), micro_batch, bubble (pp x virtual with
    the bubble fraction) and zero (stage, with its memory). Each row is the best config with
    that value, so a row's distance from the overall best is the price of that choice.
    """
    base = ["iteration_time_s", "tflops_per_gpu", "memory_per_gpu_gb"]
    cfg = ["tp", "pp", "dp", "virtual", "micro", "zero", "recompute"]
    return {
        "tp_placement": _best_by(df, ["tp_spans_nodes", "tp"],
                                 base + ["tp_comm_s"] + [c for c in cfg if c != "tp"]),
        "micro_batch": _best_by(df, ["micro"], base + ["num_microbatches", "bubble_fraction"]
                                + [c for c in cfg if c != "micro"]),
        "bubble": _best_by(df, ["pp", "virtual"], base + ["bubble_fraction", "bubble_s", "pp_comm_s"]
                           + ["tp", "dp", "micro", "zero", "recompute"]),
        "zero": _best_by(df, ["zero"], base + ["dp_comm_exposed_s", "mem_optimizer_gb"]
                         + [c for c in cfg if c != "zero"]),
    }


def optuna_search(model: ModelSpec, cluster: ClusterSpec, gpus: int, *, global_batch: int,
                  n_trials: int = 100, seed: int = 0,
                  axes: dict[str, list[Any]] | None = None) -> Any:
    """Optuna (TPE) over the simulator, maximising tokens/s; returns the `optuna.Study`.

    Invalid configurations are pruned; ones that do not fit in memory score 0. Each trial keeps
    the simulated iteration time, TFLOP/s per GPU, memory and `fits` as user attributes.
    """
    import optuna  # lazy: searching without Optuna still works

    space = candidate_axes(model, gpus, global_batch)
    space.update(axes or {})

    def objective(trial: optuna.Trial) -> float:
        pick = {k: trial.suggest_categorical(k, v) for k, v in space.items()}
        tp, pp = pick["tp"], pick["pp"]
        par = ParallelSpec(dp=max(gpus // (tp * pp), 1), global_batch=global_batch, **pick)
        if validate_parallel(model, cluster, par, gpus=gpus):
            raise optuna.TrialPruned()
        res = simulate(model, cluster, par)
        for key in ("iteration_time_s", "tflops_per_gpu", "memory_per_gpu_gb", "fits"):
            trial.set_user_attr(key, getattr(res, key))
        return res.tokens_per_s if res.fits else 0.0

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.create_study(direction="maximize",
                                    sampler=optuna.samplers.TPESampler(seed=seed))
        study.optimize(objective, n_trials=n_trials)
    finally:
        optuna.logging.set_verbosity(verbosity)
    return study


def published_comparison() -> pd.DataFrame:
    """Simulated vs published throughput for every row of tuning/data/published.yaml.

    One row per measurement with its source, strategy class, `fitted` (calibration row) flag and
    error_pct; see `tuning.published.validation_table` and `summarize`.
    """
    from tuning.published import validation_table

    return validation_table()


def count_space(axes: dict[str, Sequence[Any]]) -> int:
    """Size of the cartesian product of `axes` before validity filtering."""
    return math.prod(len(v) for v in axes.values())


__all__ = [
    "add_uncertainty", "best_configs", "flip_parameter", "candidate_axes", "count_space", "enumerate_configs", "optuna_search",
    "published_comparison", "row_to_spec", "sensitivities",
]
