"""Does the simulator pick the right configuration? Ranking per published table, held-out errors,
memory facts: the numbers `workbench simulate --validate` reports.

A ranked table is a group of rows of one source that measure several configurations of one model
at one sequence length on one cluster (`tuning.published.group_key`): the choices a user would
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

from typing import Any

import numpy as np
import pandas as pd

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
    not, and the predicted over the published peak (the sources read nvidia-smi: reserved memory,
    allocator cache and CUDA context included, so the prediction should not be above it)."""
    from tuning.hardware import load_cluster
    from tuning.simulator import simulate

    out = []
    for r in rows:
        res = simulate(r.model(), load_cluster(r.cluster), r.parallel())
        out.append({"id": r.id, "oom": r.oom, "published_gb": r.memory_gb, "simulated_gb": res.memory_per_gpu_gb,
                    "fits": res.fits, "agrees": res.fits != r.oom,
                    "ratio": (res.memory_per_gpu_gb / r.memory_gb) if r.memory_gb else float("nan")})
    return pd.DataFrame(out)


__all__ = ["MIN_RANKED", "SEARCH_MIN_ROWS", "TARGET_REGRET", "TARGET_SPEARMAN", "memory_check", "per_source",
           "ranking", "spearman", "top1_regret"]
