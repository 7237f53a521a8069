"""Frontier-style what-if searches over the simulator: exhaustive (vectorised) and Optuna.

`enumerate_configs` builds every valid (tp, pp, dp, virtual, micro, zero, recompute, sequence
parallel, schedule, context parallel cp and its implementation, expert parallel ep) for a model
and GPU count as numpy arrays and prices them in one call of
`tuning.sim.simulator.evaluate_arrays`; no Python loop runs per configuration.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from tuning.sim.hardware import ClusterSpec
from tuning.sim.context import CP_IMPLS
from tuning.sim.core import ZERO_FREE_GROUP
from tuning.sim.simulator import (
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
    "micro": "samples", "global_batch": "samples", "all_to_all_s": "s", "cp_comm_s": "s", "straggler_s": "s",
}
RESULT_COLUMNS = [
    "iteration_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "memory_per_gpu_gb", "fits",
    "compute_s", "tp_comm_s", "pp_comm_s", "bubble_s", "dp_comm_exposed_s", "optimizer_s",
    "bubble_fraction", "num_microbatches", "mem_params_gb", "mem_grads_gb",
    "mem_optimizer_gb", "mem_activations_gb", "dp_comm_total_s", "all_to_all_s", "cp_comm_s", "straggler_s",
]


ALL_SCHEDULE_AXIS = ["1f1b", "gpipe", "looped_bfs", "modular", "zero_bubble", "zbv", "dualpipev", "skip"]
SEARCH_SKIP_RATIO = 0.33  # SkipPipe is searched at this skip ratio (tuning/space.py tunes it per trial)


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def candidate_axes(model: ModelSpec, gpus: int, global_batch: int, *, max_micro: int = 64,
                   max_tp: int = 64, max_cp: int = 8) -> dict[str, list[Any]]:
    """Default values of each search axis for `model` on `gpus` GPUs."""
    return {
        "tp": _divisors(math.gcd(model.heads, gpus), max_tp),
        "pp": _divisors(math.gcd(model.layers, gpus)),
        "micro": _divisors(global_batch, max_micro),
        "virtual": [1, 2, 4, 8],
        "zero": [0, 1, 2, 3],
        "recompute": list(RECOMPUTE),
        "sequence_parallel": [False, True],
        # interleaved = 1f1b with virtual > 1; the other schedules (ALL_SCHEDULE_AXIS) are
        # searched when asked for: axes={"schedule": ALL_SCHEDULE_AXIS} (each walk costs time)
        "schedule": ["1f1b", "gpipe"],
        "cp": _divisors(math.gcd(model.seq, gpus), max_cp),  # context parallel (issue 19)
        "cp_impl": list(CP_IMPLS),
        "ep": [e for e in _divisors(model.experts) if e <= gpus] if model.experts else [1],  # issue 18
    }


_CATEGORIES = {name: pd.CategoricalDtype(pd.Index(list(values), dtype=object))
               for name, values in (("recompute", RECOMPUTE), ("schedule", SCHEDULES), ("cp_impl", CP_IMPLS))}
# validity depends on these together; cp first (slowest): rows of one cp degree are contiguous
LAYOUT_AXES = ("cp", "cp_impl", "tp", "pp", "virtual", "micro", "schedule")
KNOB_AXES = ("zero", "recompute", "sequence_parallel", "ep")  # then only on tp and dp


def _product(axes: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    mesh = np.meshgrid(*axes.values(), indexing="ij")
    return {k: m.ravel() for k, m in zip(axes, mesh)}


def _grid(axes: dict[str, list[Any]]) -> dict[str, np.ndarray]:
    """Cartesian product of the axes as flat arrays (codes for the string axes)."""
    coded = {k: np.asarray(v) for k, v in axes.items()}
    coded["recompute"] = np.asarray([RECOMPUTE.index(r) for r in axes["recompute"]])
    coded["schedule"] = np.asarray([SCHEDULES.index(s) for s in axes["schedule"]])
    if "cp_impl" in axes:
        coded["cp_impl"] = np.asarray([CP_IMPLS.index(s) for s in axes["cp_impl"]])
    return _product(coded)


def _layout_ok(model: ModelSpec, gpus: int, global_batch: int, g: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(valid layout rows, dp) for tp, pp, virtual, micro, schedule, cp, cp_impl: the rules of
    `validate_parallel` (cp: tuning/sim/context.py validate), without duplicates (one cp_impl at cp=1,
    GPipe = 1F1B without a pipeline)."""
    tp, pp, v, micro, cp = g["tp"], g["pp"], g["virtual"], g["micro"], g["cp"]
    ok = (gpus % (tp * pp * cp) == 0) & (model.heads % tp == 0) & (model.layers % (pp * v) == 0)
    ok &= (model.seq % cp == 0) & ((cp > 1) | (g["cp_impl"] == 0))
    ok &= (g["cp_impl"] != CP_IMPLS.index("ulysses")) | (model.heads % (tp * cp) == 0)
    dp = np.maximum(gpus // (tp * pp * cp), 1)
    ok &= global_batch % (dp * micro) == 0
    nmb = global_batch // (dp * micro)
    ok &= schedule_rows_ok(g["schedule"], pp, v, nmb, model.layers)  # gpipe etc. need a pipeline
    return ok, dp


def _valid_grid(model: ModelSpec, gpus: int, global_batch: int, axes: dict[str, list[Any]]) -> dict[str, np.ndarray]:
    """The valid rows of the product of `axes`, built in two stages so invalid layouts are
    dropped before they are multiplied by the knob axes (same rows as `_valid` on `_grid`)."""
    axes = {"cp": [1], "cp_impl": [CP_IMPLS[0]], "ep": [1]} | axes  # callers' axes without the new ones
    # stage 1: (cp, cp_impl) pairs x tp x pp, the divisibility rules (one cp_impl at cp = 1)
    # (at cp = 1 the implementation is moot: code 0, as `_layout_ok` keeps it, whatever the axis lists)
    pairs = [(cp, CP_IMPLS.index(i) if cp > 1 else 0) for cp in axes["cp"] for i in axes["cp_impl"]
             if cp > 1 or i == axes["cp_impl"][0]]
    base = _product({"pair": np.arange(len(pairs)), "tp": np.asarray(axes["tp"]), "pp": np.asarray(axes["pp"])})
    pair = base.pop("pair")
    base["cp"], base["cp_impl"] = (np.asarray([p[j] for p in pairs], dtype=int)[pair] for j in (0, 1))
    tp, cp = base["tp"], base["cp"]
    ok = (gpus % (tp * base["pp"] * cp) == 0) & (model.heads % tp == 0) & (model.seq % cp == 0)
    ok &= (base["cp_impl"] != CP_IMPLS.index("ulysses")) | (model.heads % (tp * cp) == 0)
    base = {k: a[ok] for k, a in base.items()}
    # stage 2: x virtual, micro, schedule; the rules of `_layout_ok` (a test checks both give the same rows)
    rest = _grid({"virtual": axes["virtual"], "micro": axes["micro"], "schedule": axes["schedule"],
                  "recompute": [axes["recompute"][0]]})
    bi, ri = (m.ravel() for m in np.meshgrid(np.arange(base["tp"].size), np.arange(rest["micro"].size), indexing="ij"))
    lay = {k: base[k][bi] for k in ("cp", "cp_impl", "tp", "pp")} | {k: rest[k][ri] for k in ("virtual", "micro", "schedule")}
    ok, _ = _layout_ok(model, gpus, global_batch, lay)
    lay = {k: a[ok] for k, a in lay.items()}
    knobs = _product({"zero": np.asarray(axes["zero"]),
                      "recompute": np.asarray([RECOMPUTE.index(r) for r in axes["recompute"]]),
                      "sequence_parallel": np.asarray(axes["sequence_parallel"], dtype=bool),
                      "ep": np.asarray(axes["ep"])})
    # layouts x knobs as a 2-D mask, then one gather per column (row order: layout-major)
    tp, cp = lay["tp"][:, None], lay["cp"][:, None]
    dp = gpus // (tp * lay["pp"][:, None] * cp)
    sp, zero, ep = (knobs[k][None, :] for k in ("sequence_parallel", "zero", "ep"))
    keep = (~sp | ((tp > 1) & (model.seq % tp == 0))) & ((zero == 0) | (dp * cp > 1))
    # ep is carved from dp and divides the experts (ZeRO shards over dp x cp ranks)
    keep &= (dp % ep == 0) & ((ep == 1) | ((model.experts > 0) & (model.experts % ep == 0)))
    li, ki = np.nonzero(keep)
    # rows that differ only in zero (the slowest knob) share a group: the simulator prices what ZeRO
    # does not change once per group (tuning.sim.core.ZERO_FREE_GROUP)
    per_zero = keep.shape[1] // len(axes["zero"])
    return {k: a[li] for k, a in lay.items()} | {k: a[ki] for k, a in knobs.items()} \
        | {ZERO_FREE_GROUP: li * per_zero + ki % per_zero}


def _valid(model: ModelSpec, gpus: int, global_batch: int, g: dict[str, np.ndarray]) -> np.ndarray:
    """Rows `validate_parallel` accepts, without duplicates (e.g. ZeRO>0 at dp=1)."""
    g = {"cp": np.ones_like(g["tp"]), "cp_impl": np.zeros_like(g["tp"]), "ep": np.ones_like(g["tp"])} | g
    ok, dp = _layout_ok(model, gpus, global_batch, g)
    tp, ep = g["tp"], g["ep"]
    ok &= ~g["sequence_parallel"] | ((tp > 1) & (model.seq % tp == 0))
    ok &= (g["zero"] == 0) | (dp * g["cp"] > 1)
    ok &= (dp % ep == 0) & ((ep == 1) | ((model.experts > 0) & (model.experts % ep == 0)))
    return ok


def schedule_rows_ok(code: np.ndarray, pp: np.ndarray, v: np.ndarray, nmb: np.ndarray, layers: int) -> np.ndarray:
    """Rows whose schedule runs (the rules of `validate_parallel`, vectorised): virtual > 1 only for
    1f1b (= interleaved), looped_bfs and zero_bubble, with m a multiple of pp (but looped_bfs); every schedule but
    1f1b needs a pipeline (pp > 1; skip pp >= 3); zbv / dualpipev hold 2 chunks per rank."""
    name = {s: SCHEDULES.index(s) for s in SCHEDULES}
    virtual_ok = np.isin(code, [name["1f1b"], name["looped_bfs"], name["zero_bubble"]])
    ok = (v == 1) | ((pp > 1) & virtual_ok & ((code == name["looped_bfs"]) | (nmb % pp == 0)))
    ok &= (code == name["1f1b"]) | (pp > 1)
    ok &= (code != name["skip"]) | (pp >= 3)
    ok &= ~np.isin(code, [name["modular"], name["zero_bubble"]]) | (nmb % pp == 0)
    v_shaped = np.isin(code, [name["zbv"], name["dualpipev"]])
    ok &= ~v_shaped | (layers % (2 * pp) == 0)
    ok &= (code != name["dualpipev"]) | (nmb >= 2 * pp)
    return ok


def enumerate_configs(model: ModelSpec, cluster: ClusterSpec, gpus: int, global_batch: int, *,
                      axes: dict[str, list[Any]] | None = None, dtype_bytes: int = 2,
                      compression_ratio: float = 1.0, co2: bool = False,
                      overlap_dp: bool = True, bucket_mb: float = 25.0,
                      knobs: dict[str, Any] | None = None) -> pd.DataFrame:
    """Every valid configuration of `model` on `gpus` GPUs, priced; one row each.

    `axes` overrides `candidate_axes` per axis (e.g. {"zero": [0, 1]}). `knobs`: more ParallelSpec
    fields fixed for every row (e.g. {"moe_hierarchical": True}). Columns: the settings (tp, pp, dp,
    virtual, micro, global_batch, zero, recompute, sequence_parallel, schedule, cp, cp_impl, ep,
    tp_spans_nodes) and RESULT_COLUMNS; units in `df.attrs["units"]`.
    """
    full_axes = candidate_axes(model, gpus, global_batch)
    full_axes.update(axes or {})
    g = _valid_grid(model, gpus, global_batch, full_axes)
    g["dp"] = gpus // (g["tp"] * g["pp"] * g["cp"])
    g["schedule"] = np.where((g["virtual"] > 1) & (g["schedule"] == SCHEDULES.index("1f1b")),
                             SCHEDULES.index("interleaved"), g["schedule"])
    n = g["tp"].size
    fixed = {"global_batch": global_batch, "dtype_bytes": dtype_bytes, "co2": co2,
             "compression_ratio": float(compression_ratio), "overlap_dp": overlap_dp,
             "bucket_mb": float(bucket_mb), **(knobs or {})}
    cols = {**g, **fixed}  # fixed settings stay scalars: numpy broadcasts them for free
    cols["skip_ratio"] = np.where(g["schedule"] == SCHEDULES.index("skip"), SEARCH_SKIP_RATIO, 0.0)
    res = evaluate_arrays(model, cluster, gpus, cols)
    df = pd.DataFrame({
        "tp": g["tp"], "pp": g["pp"], "dp": g["dp"], "virtual": g["virtual"], "micro": g["micro"],
        "global_batch": np.full(n, global_batch), "zero": g["zero"],
        # categoricals: string values without building one Python string per row
        "recompute": pd.Categorical.from_codes(g["recompute"], dtype=_CATEGORIES["recompute"]),
        "sequence_parallel": g["sequence_parallel"].astype(bool),
        "schedule": pd.Categorical.from_codes(g["schedule"], dtype=_CATEGORIES["schedule"]),
        "cp": g["cp"], "cp_impl": pd.Categorical.from_codes(g["cp_impl"], dtype=_CATEGORIES["cp_impl"]),
        "ep": g["ep"],
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
        schedule=str(row["schedule"]), ep=int(row.get("ep", 1)), cp=int(row.get("cp", 1)),
        cp_impl=str(row.get("cp_impl", CP_IMPLS[0])),
        **({"skip_ratio": SEARCH_SKIP_RATIO} if str(row["schedule"]) == "skip" else {}), **fixed,
    )


def best_configs(df: pd.DataFrame, k: int = 10, *, fits_only: bool = True) -> pd.DataFrame:
    """The `k` fastest configurations (shortest iteration), fitting in memory by default."""
    pool = df[df["fits"]] if fits_only else df
    return pool.nsmallest(k, "iteration_time_s").reset_index(drop=True)


def add_uncertainty(df: pd.DataFrame, *, hardware: str = "", framework: str = "megatron",
                    params: float = 0.0) -> pd.DataFrame:
    """Add strategy_class, time_lo_s / time_hi_s (measured-time interval from held-out residuals,
    widened outside the validated domain: tuning/sim/domain.py), extrapolated (outside the domain of
    `hardware` / `framework` / the class at this GPU count, micro-batch and model size of `params`)
    and overlaps_best: the interval overlaps the best fitting one's, so the data cannot tell the two
    apart. Returns `df` (columns added in place)."""
    from tuning.sim.domain import interval_fields

    gpus = df["dp"].to_numpy() * df["tp"].to_numpy() * df["pp"].to_numpy() * df.get("cp", pd.Series(1, index=df.index)).to_numpy()
    fields = interval_fields(df["iteration_time_s"].to_numpy(), df["tp"].to_numpy(), df["pp"].to_numpy(),
                             df["virtual"].to_numpy(), df["zero"].to_numpy(), hardware=hardware, framework=framework,
                             gpus=gpus, micro=df["micro"].to_numpy(), params=params)
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
                                  "sequence_parallel", "schedule", "cp", "cp_impl", "ep"))


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
    cols = ("tp", "pp", "dp", "virtual", "micro", "zero", "recompute", "sequence_parallel", "schedule",
            "cp", "cp_impl", "ep")
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
        par = ParallelSpec(dp=max(gpus // (tp * pp * pick.get("cp", 1)), 1), global_batch=global_batch, **pick)
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
    error_pct; see `tuning.sim.published.validation_table` and `summarize`.
    """
    from tuning.sim.published import validation_table

    return validation_table()


def count_space(axes: dict[str, Sequence[Any]]) -> int:
    """Size of the cartesian product of `axes` before validity filtering."""
    return math.prod(len(v) for v in axes.values())


__all__ = [
    "add_uncertainty", "best_configs", "flip_parameter", "candidate_axes", "count_space", "enumerate_configs", "optuna_search",
    "published_comparison", "row_to_spec", "sensitivities",
]
