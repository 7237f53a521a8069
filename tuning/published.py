"""Published measurements as a validation set: calibration rows vs held-out rows, errors, intervals.

`tuning/data/published.yaml` holds every row with its source (paper or repository, table, row,
the configuration as published) and a `fitted` flag. Fitting code reads rows only through
`calibration_rows()`, which drops held-out rows before any row object exists; `held_out_rows()`
is for comparison only. `validation_table()` prices every row, `summarize()` gives the median
absolute error per strategy class, hardware and recompute mode, and `prediction_interval()`
turns a strategy class's held-out residuals into an interval around a prediction.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from tuning.hardware import ClusterSpec, load_cluster
from tuning.simulator import ModelSpec, ParallelSpec, format_count, simulate

DATA = Path(__file__).with_name("data") / "published.yaml"
# Layout classes (one per row); recompute mode and sequence parallelism are reported as their own
# groupings because they cut across layouts.
STRATEGY_CLASSES = ("DP/ZeRO-1", "ZeRO-2", "ZeRO-3/FSDP", "TP", "PP", "TP+PP", "interleaved")
MIN_CLASS_ROWS = 3  # a class with fewer held-out rows borrows the pooled residuals


@dataclass(kw_only=True, slots=True, frozen=True)
class PublishedRow:
    """One published measurement and the configuration it was taken with."""

    id: str
    source: str  # key of the file's `sources`
    row: str  # the row as the source labels it
    cluster: str  # tuning.hardware preset
    layers: int
    hidden: int
    heads: int
    seq: int = 2048
    vocab: int = 51200
    tp: int = 1
    pp: int = 1
    dp: int = 1
    virtual: int = 1
    micro: int = 1
    global_batch: int
    zero: int = 0
    recompute: str = "full"
    sequence_parallel: bool = False
    overlap_dp: bool = True
    flash_attention: bool = False  # fused attention kernel (MPT: attn_impl triton/flash)
    metric: str  # tflops_per_gpu (executed FLOPs, Megatron) | mfu (percent of peak, model FLOPs)
    value: float
    fitted: bool

    @property
    def gpus(self) -> int:
        """dp * tp * pp."""
        return self.dp * self.tp * self.pp

    def model(self) -> ModelSpec:
        """The model shape as a ModelSpec."""
        return ModelSpec(layers=self.layers, hidden=self.hidden, heads=self.heads, seq=self.seq, vocab=self.vocab)

    def parallel(self) -> ParallelSpec:
        """The published layout as a ParallelSpec (16-bit)."""
        return ParallelSpec(dp=self.dp, tp=self.tp, pp=self.pp, virtual=self.virtual, micro=self.micro,
                            global_batch=self.global_batch, zero=self.zero, recompute=self.recompute,
                            sequence_parallel=self.sequence_parallel, overlap_dp=self.overlap_dp,
                            flash_attention=self.flash_attention)


@functools.lru_cache(maxsize=4)
def _raw(path: str) -> dict[str, Any]:
    data = yaml.safe_load(Path(path).read_text())
    ids = [r["id"] for r in data["rows"]]
    if len(ids) != len(set(ids)):
        raise ValueError(f"{path}: duplicate row ids")
    for r in data["rows"]:
        if not isinstance(r.get("fitted"), bool):
            raise ValueError(f"{path}: row {r.get('id')}: fitted={r.get('fitted')!r} must be true or false")
        if r["source"] not in data["sources"]:
            raise ValueError(f"{path}: row {r['id']}: source={r['source']!r} is not in sources")
    return data


def sources(path: str | Path = DATA) -> dict[str, dict[str, str]]:
    """The `sources` block: paper, table, configuration and hardware per source key."""
    return _raw(str(path))["sources"]


def calibration_rows(path: str | Path = DATA) -> list[PublishedRow]:
    """Rows flagged `fitted: true`: the only rows fitting code may read."""
    return [PublishedRow(**r) for r in _raw(str(path))["rows"] if r["fitted"] is True]


def held_out_rows(path: str | Path = DATA) -> list[PublishedRow]:
    """Rows flagged `fitted: false`: compared with, never fitted on."""
    return [PublishedRow(**r) for r in _raw(str(path))["rows"] if r["fitted"] is False]


def strategy_class(tp: Any, pp: Any, virtual: Any, zero: Any) -> Any:
    """Layout class of one configuration or of arrays of them (numpy, vectorised)."""
    tp, pp, virtual, zero = (np.asarray(x) for x in (tp, pp, virtual, zero))
    model_parallel = (tp > 1) | (pp > 1)
    out = np.select(
        [(pp > 1) & (virtual > 1), (tp > 1) & (pp > 1), tp > 1, pp > 1,
         ~model_parallel & (zero == 3), ~model_parallel & (zero == 2)],
        ["interleaved", "TP+PP", "TP", "PP", "ZeRO-3/FSDP", "ZeRO-2"],
        "DP/ZeRO-1",
    )
    return out.item() if out.ndim == 0 else out


def simulated_metric(row: PublishedRow, cluster: ClusterSpec | None = None) -> float:
    """The simulator's value of the row's metric (TFLOP/s per GPU, or MFU in percent)."""
    res = simulate(row.model(), cluster or load_cluster(row.cluster), row.parallel())
    return res.tflops_per_gpu if row.metric == "tflops_per_gpu" else 100.0 * res.mfu


def validation_table(path: str | Path = DATA, *, clusters: dict[str, ClusterSpec] | None = None) -> pd.DataFrame:
    """Every row priced: published vs simulated, error_pct = (simulated - published) / published.

    A positive error means the simulator predicts a faster run than measured.
    """
    rows = calibration_rows(path) + held_out_rows(path)
    srcs = sources(path)
    out = []
    for r in sorted(rows, key=lambda r: [x["id"] for x in _raw(str(path))["rows"]].index(r.id)):
        cl = (clusters or {}).get(r.cluster) or load_cluster(r.cluster)
        sim = simulated_metric(r, cl)
        layout = f"tp{r.tp} pp{r.pp} dp{r.dp}" + (f" v{r.virtual}" if r.virtual > 1 else "") + (
            f" zero{r.zero}" if r.zero else "") + f" mb{r.micro} B{r.global_batch}"
        out.append({
            "id": r.id, "paper": srcs[r.source]["paper"].split(",")[0], "table": srcs[r.source]["table"].split(",")[0],
            "row": r.row, "hardware": r.cluster, "class": strategy_class(r.tp, r.pp, r.virtual, r.zero),
            "recompute": r.recompute, "sequence_parallel": r.sequence_parallel,
            "params": format_count(r.model().params), "gpus": r.gpus, "layout": layout, "metric": r.metric,
            "published": r.value, "simulated": sim, "error_pct": 100.0 * (sim - r.value) / r.value,
            "fitted": r.fitted,
        })
    return pd.DataFrame(out)


def summarize(table: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Held-out median/max |error| and row count: overall, per class, hardware and recompute mode."""
    held = table[~table["fitted"]].assign(abs_err=lambda d: d["error_pct"].abs())

    def agg(df: pd.DataFrame, key: str | None) -> pd.DataFrame:
        groups = [("all", df)] if key is None else list(df.groupby(key))
        return pd.DataFrame([{"group": name, "rows": len(g), "median_abs_error_pct": g["abs_err"].median(),
                              "max_abs_error_pct": g["abs_err"].max(),
                              "median_error_pct": g["error_pct"].median()} for name, g in groups])

    return {"overall": agg(held, None), "class": agg(held, "class"), "hardware": agg(held, "hardware"),
            "recompute": agg(held, "recompute"), "sequence_parallel": agg(held, "sequence_parallel")}


def unvalidated(table: pd.DataFrame) -> dict[str, list[str]]:
    """Strategy classes, recompute modes, sequence parallel settings and presets without a held-out row."""
    from tuning.hardware import PRESETS
    from tuning.simulator import RECOMPUTE

    held = table[~table["fitted"]]
    return {"class": [c for c in STRATEGY_CLASSES if c not in set(held["class"])],
            "recompute": [r for r in RECOMPUTE if r not in set(held["recompute"])],
            "sequence_parallel": [str(v) for v in (False, True) if v not in set(held["sequence_parallel"])],
            "hardware": [h for h in PRESETS if h not in set(held["hardware"])]}


@functools.lru_cache(maxsize=1)
def _class_residuals() -> dict[str, tuple[float, ...]]:
    held = validation_table().query("not fitted")
    out = {cls: tuple(g["error_pct"] / 100.0) for cls, g in held.groupby("class")}
    out["pooled"] = tuple(held["error_pct"] / 100.0)
    return out


def residual_band(cls: str) -> tuple[float, float, int, str]:
    """(low, high) relative error of the class's held-out rows, their count and the basis used.

    Uses the 10th-90th percentile with 10 or more rows, else min-max; a class with fewer than
    MIN_CLASS_ROWS held-out rows borrows the pooled residuals of all classes.
    """
    res = _class_residuals()
    basis = cls if len(res.get(cls, ())) >= MIN_CLASS_ROWS else "pooled"
    errs = np.asarray(res[basis])
    lo, hi = (np.percentile(errs, [10, 90]) if errs.size >= 10 else (errs.min(), errs.max()))
    return float(lo), float(hi), int(errs.size), basis


def prediction_interval(time_s: Any, cls: Any) -> tuple[np.ndarray, np.ndarray]:
    """Interval of the measured iteration time around predicted `time_s`, per strategy class.

    The simulator's throughput error e = sim/pub - 1 means measured time = predicted x (1 + e),
    so the class's residual band maps to [t (1 + low), t (1 + high)]. Vectorised over arrays.
    """
    t = np.asarray(time_s, dtype=float)
    classes = np.asarray(cls)
    lo, hi = np.empty_like(t), np.empty_like(t)
    for c in np.unique(classes):
        band = residual_band(str(c))
        mask = classes == c
        lo[mask] = t[mask] * (1 + band[0])
        hi[mask] = t[mask] * (1 + band[1])
    return lo, hi


FIT_FIELDS = ("gemm_max_efficiency", "gemm_half_flops", "hbm_efficiency")


def _row_metric_grid(row: PublishedRow, cluster: ClusterSpec) -> np.ndarray:
    """The row's metric for a cluster whose FIT_FIELDS hold equal-length arrays (one call)."""
    from tuning.simulator import _arrays, evaluate_arrays  # the vectorised core, shared on purpose

    out = evaluate_arrays(row.model(), cluster, row.gpus, _arrays(row.parallel()))
    return out["tflops_per_gpu"] if row.metric == "tflops_per_gpu" else 100.0 * out["mfu"]


def interval_fields(time_s: Any, tp: Any, pp: Any, virtual: Any, zero: Any) -> dict[str, Any]:
    """Strategy class, measured-time interval (s) and its basis for predictions (vectorised).

    The basis names the residuals used: the class's own held-out rows, or `pooled` (all held-out
    rows) when the class has fewer than MIN_CLASS_ROWS.
    """
    cls = np.asarray(strategy_class(tp, pp, virtual, zero))
    lo, hi = prediction_interval(np.broadcast_to(np.asarray(time_s, dtype=float), cls.shape), cls)
    basis = np.vectorize(lambda c: "{3} ({2} held-out rows)".format(*residual_band(str(c))), otypes=[object])(cls)
    return {"strategy_class": cls, "time_lo_s": lo, "time_hi_s": hi, "interval_basis": basis}


def fit_cluster(cluster: str, path: str | Path = DATA, *, fixed: dict[str, float] | None = None,
                zooms: int = 6) -> dict[str, float]:
    """Fit FIT_FIELDS of a preset to its calibration rows only (`fitted: true`).

    Minimises the summed squared log error of the rows' metric by a grid that zooms in around
    its best point (three parameters and a handful of rows: an explicit search needs no optimiser
    dependency; every grid point of a row is priced in one vectorised call). `fixed` pins fields
    (e.g. hbm_efficiency borrowed from another preset when too few rows). Raises if the cluster
    has no calibration row.
    """
    rows = [r for r in calibration_rows(path) if r.cluster == cluster]
    if not rows:
        raise ValueError(f"cluster={cluster!r}: no calibration row (fitted: true) to fit on")
    base, fixed = load_cluster(cluster), dict(fixed or {})
    # search space: efficiency, log10 half point, memory-bound efficiency
    center, span = np.array([0.6, 10.0, 0.6]), np.array([0.35, 2.0, 0.35])
    for _ in range(zooms):
        axes = [np.linspace(c - w, c + w, 9) for c, w in zip(center, span)]
        if "hbm_efficiency" in fixed:
            axes[2] = np.array([fixed["hbm_efficiency"]])
        grid = np.array(np.meshgrid(*axes, indexing="ij")).reshape(3, -1)
        grid = grid[:, (grid[0] > 0.05) & (grid[0] <= 1.0) & (grid[2] > 0.05) & (grid[2] <= 1.0)]
        cl = dataclasses.replace(base, gemm_max_efficiency=grid[0], gemm_half_flops=10.0 ** grid[1],
                                 hbm_efficiency=grid[2])
        loss = sum(np.log(_row_metric_grid(r, cl) / r.value) ** 2 for r in rows)
        center = grid[:, int(np.argmin(loss))]
        span = span / 3.0
    return {"gemm_max_efficiency": float(center[0]), "gemm_half_flops": float(10.0 ** center[1]),
            "hbm_efficiency": float(center[2])}


__all__ = [
    "DATA", "FIT_FIELDS", "PublishedRow", "STRATEGY_CLASSES", "calibration_rows", "fit_cluster", "held_out_rows",
    "interval_fields", "prediction_interval", "residual_band", "simulated_metric", "sources", "strategy_class", "summarize",
    "unvalidated", "validation_table",
]
