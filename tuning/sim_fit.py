"""Fit the simulator's free constants on calibration rows only (`tuning.published.calibration_rows`).

Two fits, each a zooming grid over a handful of parameters (a few parameters and rows: an explicit
search needs no optimiser dependency, and every grid point of a row is priced in one vectorised
call, the parameters held as arrays in the cluster or framework fields):
- `fit_cluster(preset)`: a GPU preset's GEMM curve (`gemm_max_efficiency`, `gemm_half_flops`), the
  memory-bound efficiency (`hbm_efficiency`) and fused attention's efficiency
  (`attention_max_efficiency`), on that preset's calibration rows.
- `fit_frameworks()`: the framework flavours' fixed costs (`tuning.sim_framework`) on the calibration
  rows of that flavour, with the presets as they are.

The presets in `tuning.hardware` and the flavours in `tuning.sim_framework` hold the results;
tests/test_simulator_validation.py checks they equal what these fits return, and that the fits
return the same whatever the held-out rows say.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tuning.hardware import ClusterSpec, load_cluster
from tuning.published import DATA, PublishedRow, calibration_rows
from tuning.sim_core import evaluate_arrays
from tuning.sim_framework import FRAMEWORKS, Framework
from tuning.sim_spec import columns

FIT_FIELDS = ("gemm_max_efficiency", "gemm_half_flops", "hbm_efficiency", "attention_max_efficiency")


@dataclass(frozen=True, kw_only=True, slots=True)
class Param:
    """One fitted constant: a cluster field ("gemm_max_efficiency") or a framework field
    ("deepspeed.layer_microbatch_s"), searched in [lo, hi] (in log10 when `log`)."""

    name: str
    lo: float
    hi: float
    log: bool = False


def _apply(values: dict[str, np.ndarray], cluster: ClusterSpec,
           frameworks: dict[str, Framework]) -> tuple[ClusterSpec, dict[str, Framework]]:
    """The cluster and flavours with the parameters' (array) values in their fields."""
    cl_fields = {k: v for k, v in values.items() if "." not in k}
    fws = dict(frameworks)
    for key, v in values.items():
        if "." in key:
            name, field = key.split(".")
            fws[name] = dataclasses.replace(fws[name], **{field: v})
    return dataclasses.replace(cluster, **cl_fields), fws


def row_metric(row: PublishedRow, cluster: ClusterSpec, frameworks: dict[str, Framework] | None = None) -> np.ndarray:
    """The row's metric with cluster / framework fields that may hold arrays (one vectorised call)."""
    out = evaluate_arrays(row.model(), cluster, row.gpus, columns(row.parallel()), frameworks=frameworks)
    return out["tflops_per_gpu"] if row.metric == "tflops_per_gpu" else 100.0 * out["mfu"]


def grid_fit(rows: list[PublishedRow], params: list[Param], *, clusters: dict[str, ClusterSpec],
             frameworks: dict[str, Framework] | None = None, zooms: int = 6, points: int = 9) -> dict[str, float]:
    """Minimise the summed squared log error of the rows' metric over `params` by a grid that
    zooms in around its best point (each zoom narrows every axis to a third)."""
    if not rows:
        raise ValueError("no calibration row (fitted: true) to fit on")
    fws = dict(frameworks or FRAMEWORKS)
    lo = np.array([np.log10(p.lo) if p.log else p.lo for p in params])
    hi = np.array([np.log10(p.hi) if p.log else p.hi for p in params])
    center, span = (lo + hi) / 2.0, (hi - lo) / 2.0
    for _ in range(zooms):
        axes = [np.clip(np.linspace(c - w, c + w, points), a, b) for c, w, a, b in zip(center, span, lo, hi)]
        grid = np.array(np.meshgrid(*axes, indexing="ij")).reshape(len(params), -1)
        values = {p.name: (10.0 ** g if p.log else g) for p, g in zip(params, grid)}
        loss = np.zeros(grid.shape[1])
        for r in rows:
            cl, fw = _apply(values, clusters[r.cluster], fws)
            loss = loss + np.log(np.broadcast_to(row_metric(r, cl, fw), loss.shape) / r.value) ** 2
        center = grid[:, int(np.argmin(loss))]
        span = span / 3.0
    return {p.name: float(10.0 ** c if p.log else c) for p, c in zip(params, center)}


FRAMEWORK_FITS = {  # flavour: the fields fitted on that flavour's calibration rows
    "deepspeed": [Param(name="deepspeed.layer_microbatch_s", lo=0.0, hi=0.03),
                  Param(name="deepspeed.microbatch_s", lo=0.0, hi=0.3),
                  Param(name="deepspeed.dp_bw_efficiency", lo=0.01, hi=1.0, log=True),
                  Param(name="deepspeed.zero3_bw_efficiency", lo=0.01, hi=1.0, log=True),
                  Param(name="deepspeed.overlap_interference", lo=0.0, hi=1.0)],
}
# fields only ZeRO-3 rows inform (the block collectives that overlap compute), fitted on those rows alone
ZERO3_FIELDS = ("zero3_bw_efficiency", "overlap_interference")


def fit_cluster(cluster: str, path: str | Path = DATA, *, fixed: dict[str, float] | None = None,
                zooms: int = 6) -> dict[str, float]:
    """FIT_FIELDS of a preset on its calibration rows only (those of the flavours whose own costs are not
    fitted: Megatron-LM and FSDP); `fixed` pins fields (e.g. hbm_efficiency borrowed from another
    preset when the rows cannot fix it)."""
    rows = [r for r in calibration_rows(path) if r.cluster == cluster and r.framework not in FRAMEWORK_FITS]
    if not rows:
        raise ValueError(f"cluster={cluster!r}: no calibration row (fitted: true) to fit on")
    fixed = dict(fixed or {})
    base = dataclasses.replace(load_cluster(cluster), **fixed)
    params = [Param(name="gemm_max_efficiency", lo=0.25, hi=0.95), Param(name="gemm_half_flops", lo=1e7, hi=1e12, log=True),
              Param(name="hbm_efficiency", lo=0.05, hi=1.0), Param(name="attention_max_efficiency", lo=0.1, hi=0.95)]
    params = [p for p in params if p.name not in fixed]
    out = grid_fit(rows, params, clusters={cluster: base}, zooms=zooms)
    return {**fixed, **out}


def fit_frameworks(path: str | Path = DATA, *, zooms: int = 6) -> dict[str, float]:
    """Each flavour's fixed costs on its calibration rows (`FRAMEWORK_FITS`); the fields only some rows
    inform (`ZERO3_FIELDS`: ZeRO-3 rows) are fitted on those rows alone, the others first."""
    rows = calibration_rows(path)
    clusters = {r.cluster: load_cluster(r.cluster) for r in rows}
    out: dict[str, float] = {}
    for flavour, params in FRAMEWORK_FITS.items():
        mine = [r for r in rows if r.framework == flavour]
        zero3 = [r for r in mine if r.zero == 3]
        pipeline = [r for r in mine if r.zero != 3]
        first = [p for p in params if p.name.split(".")[1] not in ZERO3_FIELDS]
        out.update(grid_fit(pipeline, first, clusters=clusters, zooms=zooms))
        fws = {**FRAMEWORKS, flavour: dataclasses.replace(FRAMEWORKS[flavour], **{
            k.split(".")[1]: v for k, v in out.items() if k.startswith(flavour + ".")})}
        rest = [p for p in params if p.name.split(".")[1] in ZERO3_FIELDS]
        if rest and zero3:
            out.update(grid_fit(zero3, rest, clusters=clusters, frameworks=fws, zooms=zooms))
    return out


def fitted_rows(path: str | Path = DATA) -> dict[str, list[str]]:
    """Which calibration rows each fit reads (for the report and the docs)."""
    rows = calibration_rows(path)
    out: dict[str, list[str]] = {}
    for r in rows:
        key = f"framework {r.framework}" if r.framework in FRAMEWORK_FITS else f"preset {r.cluster}"
        out.setdefault(key, []).append(r.id)
    return out


__all__ = ["FIT_FIELDS", "FRAMEWORK_FITS", "Param", "ZERO3_FIELDS", "fit_cluster", "fit_frameworks", "fitted_rows", "grid_fit",
           "row_metric"]


def _demo() -> dict[str, Any]:  # pragma: no cover - `python -m tuning.sim_fit` prints every fit
    a100 = fit_cluster("dgx-a100-80gb")
    return {"dgx-a100-80gb": a100, "dgx-h100": fit_cluster("dgx-h100", fixed={"hbm_efficiency": a100["hbm_efficiency"]}),
            "frameworks": fit_frameworks()}


if __name__ == "__main__":  # pragma: no cover
    import json

    print(json.dumps(_demo(), indent=2))
