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


# Tables of one campaign, repository or report (issue 63 item 2): they share code, machines and authors, so a fit that
# leaves one out leaves its siblings out too (`loso(...)["lofo"]`, leave-one-family-out). A source named in none is
# a family of its own. Sources whose `where` is one file of one repository must share a family (tested).
FAMILIES = {
    "narayanan2021": ("narayanan2021-t1", "narayanan2021-t2"),  # one paper: Megatron-LM on Selene's A100s
    # one README (mosaicml/llm-foundry scripts/train/benchmarking/README.md), one launcher, one codebase
    "mosaicml": ("mosaicml-a100-80", "mosaicml-a100-40", "mosaicml-h100-80", "mosaicml-h100-large",
                 "mosaicml-h100-fp8"),
    "bigscience": ("bloom-0221", "bloom-0223", "bloom-0225"),  # one log: tr11-176B-ml/chronicles-prequel.md, Jean Zay
    # one repository and release: NVIDIA/dgxc-benchmarking v24.11.1, NeMo 24.05/24.09 on DGX Cloud H100s
    "dgxc": ("dgxc-llama31-8b", "dgxc-llama31-70b", "dgxc-llama31-405b", "dgxc-gpt3-175b", "dgxc-nemotron4-15b",
             "dgxc-nemotron4-340b", "dgxc-grok1-314b"),
    # NVIDIA/Megatron-LM's own READMEs (the 2022 MFU table, the 2024 Megatron-core scaling table, the MoE README)
    "megatron-lm-readmes": ("megatron-readme-mfu", "mcore-h100-weak", "mcore-moe-mixtral"),
}


def family_of(source: str) -> str:
    """The family of a source (`FAMILIES`), the source's own key where it is in none."""
    return next((name for name, members in FAMILIES.items() if source in members), source)


def loso(path: str | Path | None = None, *, zooms: int = 6) -> pd.DataFrame:
    """Every priced row predicted with the per-framework terms fitted on every source (`in_sample`), fitted
    without any row of its own source (`loso`: leave-one-source-out) and without any row of its family
    (`lofo`: leave-one-family-out, `FAMILIES`; the same as `loso` for a family of one); a term no row left
    informs takes its documented default (`tuning.sim.fit.term_defaults`, listed in `terms_at_default` and
    `lofo_terms_at_default`); beside the flat baseline; errors in percent of the published value. Cached per
    data and code."""
    from tuning.sim.published import DATA

    path = Path(path or DATA)
    return cached_frame(cache_path("loso", path), lambda: _loso_table(path, zooms))


def out_of_sample_frameworks(path: Path, left_out: str | tuple[str, ...], flavours: tuple[str, ...],
                             zooms: int) -> tuple[Any, list[str]]:
    """The flavours priced without `left_out` (a source or several): each fitted term of `flavours` refitted
    without their rows, or at its default where no row left informs it (never the shipped value); and the
    terms left at default."""
    from tuning.sim.fit import fit_terms, term_defaults, with_terms

    fitted = fit_terms(path, exclude_source=left_out, zooms=zooms, only=flavours)
    defaults = term_defaults(flavours)
    return with_terms({**defaults, **fitted}), [name for name in defaults if name not in fitted]


def _left_out(rows: list[Any], groups: dict[str, tuple[str, ...]], path: Path,
              zooms: int) -> dict[str, tuple[float, str]]:
    """Each row's metric priced with the terms fitted without its group's sources, and the terms at default."""
    from tuning.sim.fit import FRAMEWORK_FITS
    from tuning.sim.framework import FRAMEWORKS

    out = {}
    for members in groups.values():
        mine = [r for r in rows if r.source in members]
        refit = tuple(sorted({r.framework for r in mine if not r.fp8} & set(FRAMEWORK_FITS)))  # FP8: never fitted
        fws, held = out_of_sample_frameworks(path, members, refit, zooms) if refit else (FRAMEWORKS, [])
        for r, price in zip(mine, _price(mine, fws)):
            out[r.id] = (price, " ".join(t for t in held if t.startswith(f"{r.framework}.")))
    return out


# what a user who names only the hardware, the model, the layout and the framework (and the precision) sets
# (issue 63 item 3): the row's other knobs (its attention kernel, overlaps, optimizer, loss, ...) at its flavour's
# defaults (tuning/sim/framework.py FLAVOUR_DEFAULTS)
NAMED_BY_A_USER = ("dp", "tp", "pp", "virtual", "micro", "global_batch", "zero", "recompute", "sequence_parallel", "cp",
                   "cp_impl", "ep", "framework", "fp8")


def framework_only(rows: list[Any]) -> list[float]:
    """Each row's metric priced with the shipped terms from only NAMED_BY_A_USER (and its model's MoE padding)."""
    from tuning.sim.hardware import load_cluster
    from tuning.sim.published import metric_of
    from tuning.sim.simulator import simulate
    from tuning.sim.spec import parallel_spec

    out = []
    for r in rows:
        cluster = load_cluster(r.cluster)
        par = parallel_spec(**{k: getattr(r, k) for k in NAMED_BY_A_USER}, moe_padded=r.capacity_factor > 0)
        out.append(float(metric_of(r.metric, simulate(r.model(), cluster, par), r.gpus, cluster.peak_flops)))
    return out


def _loso_table(path: Path, zooms: int) -> pd.DataFrame:
    from tuning.sim.framework import FRAMEWORKS
    from tuning.sim.hardware import load_cluster
    from tuning.sim.published import calibration_rows, held_out_rows

    rows = calibration_rows(path) + held_out_rows(path)
    present = list(dict.fromkeys(r.source for r in rows))
    by_source = _left_out(rows, {s: (s,) for s in present}, path, zooms)
    families: dict[str, tuple[str, ...]] = {}
    for source in present:
        families[family_of(source)] = families.get(family_of(source), ()) + (source,)
    by_family = {**by_source, **_left_out(rows, {k: v for k, v in families.items() if len(v) > 1}, path, zooms)}
    out = []
    for r, inside, named in zip(rows, _price(rows, FRAMEWORKS), framework_only(rows)):
        base = baseline_metric(r.metric, load_cluster(r.cluster).peak_flops, value=r.value, source_mfu=r.source_mfu)
        (outside, held), (family_out, family_held) = by_source[r.id], by_family[r.id]
        out.append({"id": r.id, "source": r.source, "family": family_of(r.source), "published": r.value,
                    "in_sample": inside, "loso": outside, "lofo": family_out, "baseline": base,
                    "in_sample_error_pct": 100.0 * (inside / r.value - 1.0),
                    "loso_error_pct": 100.0 * (outside / r.value - 1.0),
                    "lofo_error_pct": 100.0 * (family_out / r.value - 1.0),
                    "baseline_error_pct": 100.0 * (base / r.value - 1.0), "framework_only": named,
                    "framework_only_error_pct": 100.0 * (named / r.value - 1.0),
                    "terms_at_default": held, "lofo_terms_at_default": family_held})
    return pd.DataFrame(out)


def _ranked_worst(merged: pd.DataFrame, column: str) -> tuple[float, float]:
    """The worst Spearman's rho and top-1 regret of `column`'s prediction over the tables of >= 8 layouts of
    one model on one cluster in `merged` (nan where there is none)."""
    ranked = [grp for _, grp in merged.groupby("group") if len(grp) >= SEARCH_MIN_ROWS]
    rho = min((spearman(grp[column], grp["published"]) for grp in ranked), default=float("nan"))
    regret = max((top1_regret(grp["published"], grp[column]) for grp in ranked), default=float("nan"))
    return rho, regret


def _errors(g: pd.DataFrame, merged: pd.DataFrame, out_of_sample: str) -> dict[str, Any]:
    """Rows, the out-of-sample (`out_of_sample`: "loso" or "lofo") median and worst |error|, the baseline's and
    the in-sample median, the worst rho and regret over ranked tables, and whether it beats the baseline."""
    med = lambda col: float(g[col].abs().median()) if len(g) else float("nan")  # noqa: E731
    worst = float(g[f"{out_of_sample}_error_pct"].abs().max()) if len(g) else float("nan")
    rho, regret = _ranked_worst(merged, out_of_sample)
    return {"rows": len(g), f"{out_of_sample}_median_pct": med(f"{out_of_sample}_error_pct"),
            f"{out_of_sample}_worst_pct": worst,
            "baseline_median_pct": med("baseline_error_pct"), "in_sample_median_pct": med("in_sample_error_pct"),
            "spearman": rho, "top1_regret": regret,
            "beats_baseline": bool(med(f"{out_of_sample}_error_pct") < med("baseline_error_pct")) if len(g) else None}


def loso_by_source(table: pd.DataFrame, loso_rows: pd.DataFrame, sources: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """Per cited source: rows priced, leave-one-source-out median and worst |error|, the flat baseline's
    median |error| beside it, the in-sample median, and where the source has a table of >= 8 layouts of
    one model on one cluster, Spearman's rho and top-1 regret of the leave-one-source-out prediction
    (the worst over such tables); beside them its family and the leave-one-family-out median, rho and regret,
    and the framework-only reading's median (`framework_only`: what naming only the framework gets)."""
    merged = table.merge(loso_rows[["id", "loso", "lofo"]], on="id")
    out = []
    for key in sources:
        g, m = loso_rows[loso_rows["source"] == key], merged[merged["source"] == key]
        family = _errors(g, m, "lofo")
        out.append({"source": key, "family": family_of(key), **_errors(g, m, "loso"),
                    "lofo_median_pct": family["lofo_median_pct"], "lofo_spearman": family["spearman"],
                    "lofo_top1_regret": family["top1_regret"], "lofo_beats_baseline": family["beats_baseline"],
                    "framework_only_median_pct": float(g["framework_only_error_pct"].abs().median())
                    if len(g) else float("nan")})
    return pd.DataFrame(out)


def lofo_by_family(table: pd.DataFrame, loso_rows: pd.DataFrame, sources: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """Per family (`FAMILIES`) with a priced row: its sources, leave-one-family-out median and worst |error|,
    the baseline's and the in-sample median, the leave-one-source-out median over the same rows, and the
    worst rho and regret of the leave-one-family-out prediction over its ranked tables."""
    merged = table.merge(loso_rows[["id", "loso", "lofo"]], on="id")
    out = []
    for family in dict.fromkeys(family_of(key) for key in sources):
        members = [key for key in sources if family_of(key) == family]
        g = loso_rows[loso_rows["source"].isin(members)]
        if len(g):
            out.append({"family": family, "sources": " ".join(members), **_errors(g, merged[merged["source"].isin(
                members)], "lofo"), "loso_median_pct": float(g["loso_error_pct"].abs().median())})
    return pd.DataFrame(out)


__all__ = ["BASELINE_MFU", "FAMILIES", "MIN_RANKED", "SEARCH_MIN_ROWS", "TARGET_REGRET", "TARGET_SPEARMAN",
           "baseline_metric", "family_of", "lofo_by_family", "loso", "loso_by_source", "memory_check",
           "out_of_sample_frameworks", "per_source", "ranking", "spearman", "top1_regret"]
