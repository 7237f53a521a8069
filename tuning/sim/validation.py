"""Does the simulator pick the right configuration? Ranking per published table, held-out errors,
memory facts: the numbers `workbench simulate --validate` reports.

A ranked table is a group of rows of one source that measure several configurations of one model
at one sequence length on one cluster (`tuning.sim.published.group_key`): the choices a user would
make for that job. For each group with at least `MIN_RANKED` rows:
- `spearman`: Spearman's rho between the simulated and the published metric (TFLOP/s or MFU per
  GPU, higher is better; both are throughput per GPU of the same model, so the order is the order
  of GPU-time per sample);
- `top1_regret`: measured GPU-time per sample of the simulator's pick over the measured best's,
  minus one (0 when it picks the best);
- the median and largest absolute error of its held-out rows, and how many rows were calibration
  rows (a group made only of calibration rows is reported, but is no evidence).
`SEARCH_MIN_ROWS` and the targets below are the issue's done-when: on every search table with at
least 8 rows, rho >= 0.8 and regret <= 5%.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tuning.sim.cache import cache_path, cached_frame

MIN_RANKED = 3  # rows a group needs for a rank correlation to say anything
SEARCH_MIN_ROWS = 8  # a search table the targets apply to
TARGET_SPEARMAN = 0.8
TARGET_REGRET = 0.05


def spearman(a: Any, b: Any) -> float:
    """Spearman's rank correlation of two sequences (scipy, average ranks for ties); nan if constant."""
    from scipy.stats import spearmanr

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(a) < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(spearmanr(a, b).statistic)


def top1_regret(published: Any, simulated: Any) -> float:
    """Measured cost of the simulator's pick over the measured best's, minus one; the metric is a
    rate per GPU (higher is better), so cost = 1 / metric."""
    published, simulated = np.asarray(published, dtype=float), np.asarray(simulated, dtype=float)
    pick = int(np.argmax(simulated))
    return float(published.max() / published[pick] - 1.0)


def ranking(table: pd.DataFrame, sources: dict[str, dict[str, Any]] | None = None) -> pd.DataFrame:
    """One row per ranked group: rows, calibration rows, spearman, top1_regret, held-out median and
    max |error| (%), whether it is a search table the targets apply to, and whether it meets them."""
    out = []
    for group, g in table.groupby("group", sort=False):
        if len(g) < MIN_RANKED:
            continue
        held = g[~g["fitted"]]
        source = str(g["source"].iloc[0])
        search = bool((sources or {}).get(source, {}).get("search", True)) and len(g) >= SEARCH_MIN_ROWS
        rho, regret = spearman(g["simulated"], g["published"]), top1_regret(g["published"], g["simulated"])
        out.append({"group": group, "source": source, "rows": len(g), "calibration_rows": int(g["fitted"].sum()),
                    "spearman": rho, "top1_regret": regret,
                    "pick": str(g["layout"].iloc[int(np.argmax(g["simulated"].to_numpy()))]),
                    "best": str(g["layout"].iloc[int(np.argmax(g["published"].to_numpy()))]),
                    "held_out_median_abs_error_pct": float(held["error_pct"].abs().median()) if len(held) else float("nan"),
                    "held_out_max_abs_error_pct": float(held["error_pct"].abs().max()) if len(held) else float("nan"),
                    "search_table": search,
                    "meets_targets": (bool(rho >= TARGET_SPEARMAN and regret <= TARGET_REGRET) if search else None)})
    return pd.DataFrame(out)


def per_source(table: pd.DataFrame, sources: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """Per cited table: rows in the source, rows priced, rows excluded (with reasons in `sources`),
    calibration and held-out rows, held-out median |error| over all its rows."""
    out = []
    for key, src in sources.items():
        g = table[table["source"] == key]
        excluded = sum(int(e.get("count", 0)) for e in src.get("excluded") or [])
        held = g[~g["fitted"]]
        out.append({"source": key, "rows_in_source": int(src["rows_in_source"]), "priced": len(g),
                    "excluded": excluded, "calibration": int(g["fitted"].sum()), "held_out": len(held),
                    "held_out_median_abs_error_pct": float(held["error_pct"].abs().median()) if len(held) else float("nan")})
    return pd.DataFrame(out)


def memory_check(rows: list[Any]) -> pd.DataFrame:
    """Each memory fact against the simulator: did a layout that trained fit, did one that ran out
    not, and the predicted over the published peak (the sources read nvidia-smi: tensors, the allocator's
    cache and the CUDA context, which the prediction prices with the framework's fitted allocator_reserve)."""
    from tuning.sim.hardware import load_cluster
    from tuning.sim.simulator import simulate

    out = []
    for r in rows:
        res = simulate(r.model(), load_cluster(r.cluster), r.parallel())
        out.append({"id": r.id, "oom": r.oom, "published_gb": r.memory_gb, "simulated_gb": res.memory_per_gpu_gb,
                    "fits": res.fits, "agrees": res.fits != r.oom,
                    "ratio": (res.memory_per_gpu_gb / r.memory_gb) if r.memory_gb else float("nan")})
    return pd.DataFrame(out)


BASELINE_MFU = 0.5  # the flat baseline: FLOPs / (GPUs x peak x 0.5), llm-analysis's recommended efficiency


def baseline_metric(metric: str, peak_flops: float, *, value: float | None = None,
                    source_mfu: float | None = None) -> float:
    """The flat-MFU baseline's value of a row's metric: its FLOPs (as the source counts them) over
    GPUs x peak x 0.5 is a time whose rate is half the peak: 0.5 peak in TFLOP/s per GPU, 50% MFU; for
    tokens/s, the source's FLOPs per token (its MFU x peak / its tokens/s) at half the peak."""
    if metric == "tokens_per_s_per_gpu":
        return float(value) * 100.0 * BASELINE_MFU / float(source_mfu)
    return BASELINE_MFU * peak_flops / 1e12 if metric.endswith("tflops_per_gpu") else 100.0 * BASELINE_MFU


def _price(rows: list[Any], frameworks: Any) -> list[float]:
    from tuning.sim.hardware import load_cluster
    from tuning.sim.fit import row_metric

    return [float(np.asarray(row_metric(r, load_cluster(r.cluster), frameworks)).reshape(-1)[0]) for r in rows]


def loso(path: str | Path | None = None, *, zooms: int = 6) -> pd.DataFrame:
    """Every priced row predicted with the per-framework terms fitted on every source (`in_sample`)
    and fitted without any row of its own source (`loso`: leave-one-source-out; a term no other source's
    row informs takes its documented default, `tuning.sim.fit.term_defaults`, listed in `terms_at_default`),
    beside the flat baseline; errors in percent of the published value. Cached per data and code."""
    from tuning.sim.published import DATA

    path = Path(path or DATA)
    return cached_frame(cache_path("loso", path), lambda: _loso_table(path, zooms))


def out_of_sample_frameworks(path: Path, source: str, flavours: tuple[str, ...], zooms: int) -> tuple[Any, list[str]]:
    """The flavours priced without `source`: each fitted term of `flavours` refitted without its rows, or at
    its default where no row left informs it (never the shipped value); and the terms left at default."""
    from tuning.sim.fit import fit_terms, term_defaults, with_terms

    fitted = fit_terms(path, exclude_source=source, zooms=zooms, only=flavours)
    defaults = term_defaults(flavours)
    return with_terms({**defaults, **fitted}), [name for name in defaults if name not in fitted]


def _loso_table(path: Path, zooms: int) -> pd.DataFrame:
    from tuning.sim.fit import FRAMEWORK_FITS
    from tuning.sim.framework import FRAMEWORKS
    from tuning.sim.hardware import load_cluster
    from tuning.sim.published import calibration_rows, held_out_rows

    rows = calibration_rows(path) + held_out_rows(path)
    order = {r.id: i for i, r in enumerate(rows)}
    out = []
    for source in dict.fromkeys(r.source for r in rows):
        mine = [r for r in rows if r.source == source]
        refit = tuple(sorted({r.framework for r in mine if not r.fp8} & set(FRAMEWORK_FITS)))  # FP8: never fitted
        fws, held = out_of_sample_frameworks(path, source, refit, zooms) if refit else (FRAMEWORKS, [])
        for r, inside, outside in zip(mine, _price(mine, FRAMEWORKS), _price(mine, fws)):
            base = baseline_metric(r.metric, load_cluster(r.cluster).peak_flops, value=r.value, source_mfu=r.source_mfu)
            out.append({"id": r.id, "source": source, "published": r.value, "in_sample": inside, "loso": outside,
                        "baseline": base, "in_sample_error_pct": 100.0 * (inside / r.value - 1.0),
                        "loso_error_pct": 100.0 * (outside / r.value - 1.0),
                        "baseline_error_pct": 100.0 * (base / r.value - 1.0),
                        "terms_at_default": " ".join(t for t in held if t.startswith(f"{r.framework}."))})
    return pd.DataFrame(out).sort_values("id", key=lambda s: s.map(order)).reset_index(drop=True)


def loso_by_source(table: pd.DataFrame, loso_rows: pd.DataFrame, sources: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """Per cited source: rows priced, leave-one-source-out median and worst |error|, the flat baseline's
    median |error| beside it, the in-sample median, and where the source has a table of >= 8 layouts of
    one model on one cluster, Spearman's rho and top-1 regret of the leave-one-source-out prediction
    (the worst over such tables)."""
    merged = table.merge(loso_rows[["id", "loso"]], on="id")
    out = []
    for key in sources:
        g = loso_rows[loso_rows["source"] == key]
        ranked = [grp for _, grp in merged[merged["source"] == key].groupby("group") if len(grp) >= SEARCH_MIN_ROWS]
        rho = min((spearman(grp["loso"], grp["published"]) for grp in ranked), default=float("nan"))
        regret = max((top1_regret(grp["published"], grp["loso"]) for grp in ranked), default=float("nan"))
        med = lambda col: float(g[col].abs().median()) if len(g) else float("nan")  # noqa: E731
        out.append({"source": key, "rows": len(g), "loso_median_pct": med("loso_error_pct"),
                    "loso_worst_pct": float(g["loso_error_pct"].abs().max()) if len(g) else float("nan"),
                    "baseline_median_pct": med("baseline_error_pct"), "in_sample_median_pct": med("in_sample_error_pct"),
                    "spearman": rho, "top1_regret": regret,
                    "beats_baseline": bool(med("loso_error_pct") < med("baseline_error_pct")) if len(g) else None})
    return pd.DataFrame(out)


__all__ = ["BASELINE_MFU", "MIN_RANKED", "SEARCH_MIN_ROWS", "TARGET_REGRET", "TARGET_SPEARMAN", "baseline_metric",
           "loso", "loso_by_source", "memory_check", "out_of_sample_frameworks", "per_source", "ranking", "spearman",
           "top1_regret"]
