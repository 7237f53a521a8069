"""Fit the simulator's few free constants -- per-framework fixed costs -- on published end-to-end rows.

Kernel rates are hardware facts (`tuning.sim.kernels`, tuning/data/kernels.yaml): no GEMM or
attention rate is fitted to a training row. What end-to-end rows do fit are the per-framework terms of
`FRAMEWORK_FITS` (`FITTED_TERMS` names them: host/launch seconds per layer and micro-batch, the bytes
its memory-bound kernels move per counted activation byte, and for DeepSpeed the share of the link
its ZeRO collectives reach and how much of the compute under them they take), all of a flavour's terms
fitted jointly on the rows of its own framework by a zooming grid (a few parameters and rows: an explicit
search needs no optimiser dependency; every grid point of a row is priced in one vectorised call). A term
no row left informs (`informed`: no row's metric moves between the term's bounds -- ZeRO-3's, without a
ZeRO-3 row) is not fitted: it takes its documented default, the `Framework` dataclass default, and so does
every term of a flavour with no row left. The shipped values are never a fit's starting point, so a
leave-one-out fit holds nothing fitted on the source it leaves out. One term is fitted on memory
readings instead: `allocator_reserve` of the flavours in RESERVE_FITS, the median share their nvidia-smi
readings of runs that ran sit above the tensors the memory model counts (`fit_allocator_reserve`; an
out-of-memory fact has no reading and is never fitted on).

Every published row with a measured value is fitted on (`fit_rows`: the `fitted` flag of published.yaml
marks the rows a table was first calibrated with; the fit reads held-out rows too, so in-sample figures
are not held-out ones). `fit_frameworks(exclude_source=...)` leaves one source's rows out:
`tuning.sim.validation.loso` refits without each source in turn and prices that source with the result
(leave-one-source-out). The flavours in `tuning.sim.framework` hold the fit on every source;
tests/test_simulator_validation.py checks they equal what `fit_frameworks()` returns.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tuning.sim.hardware import ClusterSpec, load_cluster
from tuning.sim.published import DATA, PublishedRow, calibration_rows, held_out_rows, metric_of
from tuning.sim.core import evaluate_arrays
from tuning.sim.framework import FRAMEWORKS, Framework, with_terms
from tuning.sim.memory_facts import RESERVE_TERMS, fit_allocator_reserve, source_set
from tuning.sim.spec import columns



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
    fws = with_terms({k: v for k, v in values.items() if "." in k}, frameworks)
    return dataclasses.replace(cluster, **cl_fields), fws


def row_metric(row: PublishedRow, cluster: ClusterSpec, frameworks: dict[str, Framework] | None = None) -> np.ndarray:
    """The row's metric with cluster / framework fields that may hold arrays (one vectorised call)."""
    out = evaluate_arrays(row.model(), cluster, row.gpus, columns(row.parallel()), frameworks=frameworks)
    return metric_of(row.metric, out, row.gpus, cluster.peak_flops)


def grid_fit(rows: list[PublishedRow], params: list[Param], *, clusters: dict[str, ClusterSpec],
             frameworks: dict[str, Framework] | None = None, zooms: int = 6, points: int = 9) -> dict[str, float]:
    """Minimise the summed absolute log error of the rows' metric over `params` (a median-seeking fit: the
    figure reported is the median error, and a few rows the terms cannot explain do not pull it) by a
    grid that zooms in around its best point (each zoom narrows every axis to a third)."""
    if not rows:
        raise ValueError("no published row to fit on")
    fws = dict(frameworks or FRAMEWORKS)
    lo = np.array([np.log10(p.lo) if p.log else p.lo for p in params])
    hi = np.array([np.log10(p.hi) if p.log else p.hi for p in params])
    center, span = (lo + hi) / 2.0, (hi - lo) / 2.0
    same_fit = (tuple(params), tuple(sorted(fws.items())))
    for _ in range(zooms):
        axes = [np.clip(np.linspace(c - w, c + w, points), a, b) for c, w, a, b in zip(center, span, lo, hi)]
        grid = np.array(np.meshgrid(*axes, indexing="ij")).reshape(len(params), -1)
        values = {p.name: (10.0 ** g if p.log else g) for p, g in zip(params, grid)}
        loss = np.zeros(grid.shape[1])
        for r in rows:
            loss = loss + _grid_loss(r, clusters[r.cluster], fws, values, (same_fit, grid.tobytes()))
        center = grid[:, int(np.argmin(loss))]
        span = span / 3.0
    return {p.name: float(10.0 ** c if p.log else c) for p, c in zip(params, center)}


# each row's loss on a grid, kept for the process: the leave-one-out walk refits a flavour once per source left
# out, and each of those fits prices the rows it keeps on the grid every other fit of that flavour starts from
# (and zooms on alike while the left-out rows do not move its best point). Measured on a cold cache here:
# `tuning.sim.validation.loso` 72 -> 50 s of CPU, the same table to the bit. Bounded: the oldest entries go first.
_GRID_LOSSES: dict[Any, np.ndarray] = {}
GRID_LOSS_BYTES = 256 * 2**20
_grid_loss_bytes = [0]


def _grid_loss(row: PublishedRow, cluster: ClusterSpec, frameworks: dict[str, Framework],
               values: dict[str, np.ndarray], grid_key: Any) -> np.ndarray:
    """|log(priced / published)| of `row` at every grid point of `values` (`grid_key` names the grid, the
    params and the flavours it is priced with; each of those, the row and the cluster are immutable)."""
    key = (row, cluster, grid_key)
    loss = _GRID_LOSSES.get(key)
    if loss is None:
        n = len(next(iter(values.values())))
        cl, fw = _apply(values, cluster, frameworks)
        loss = np.abs(np.log(np.broadcast_to(row_metric(row, cl, fw), (n,)) / row.value))
        while _GRID_LOSSES and _grid_loss_bytes[0] + loss.nbytes > GRID_LOSS_BYTES:
            _grid_loss_bytes[0] -= _GRID_LOSSES.pop(next(iter(_GRID_LOSSES))).nbytes
        _GRID_LOSSES[key] = loss
        _grid_loss_bytes[0] += loss.nbytes
    return loss


FRAMEWORK_FITS = {  # flavour: the fields fitted on that flavour's rows
    "megatron": [Param(name="megatron.layer_microbatch_s", lo=0.0, hi=0.02),
                 Param(name="megatron.elementwise_traffic", lo=0.5, hi=16.0, log=True)],
    "megatron-core": [Param(name="megatron-core.layer_microbatch_s", lo=0.0, hi=0.02),
                      Param(name="megatron-core.elementwise_traffic", lo=0.5, hi=16.0, log=True),
                      Param(name="megatron-core.microbatch_s", lo=0.0, hi=0.5)],
    "fsdp": [Param(name="fsdp.layer_microbatch_s", lo=0.0, hi=0.02),
             Param(name="fsdp.elementwise_traffic", lo=0.5, hi=16.0, log=True),
             Param(name="fsdp.zero3_bw_efficiency", lo=0.05, hi=1.0, log=True),
             Param(name="fsdp.overlap_interference", lo=0.0, hi=1.0)],
    "deepspeed": [Param(name="deepspeed.layer_microbatch_s", lo=0.0, hi=0.03),
                  Param(name="deepspeed.elementwise_traffic", lo=0.5, hi=16.0, log=True),
                  Param(name="deepspeed.dp_bw_efficiency", lo=0.01, hi=1.0, log=True),
                  Param(name="deepspeed.zero3_bw_efficiency", lo=0.01, hi=1.0, log=True),
                  Param(name="deepspeed.overlap_interference", lo=0.0, hi=1.0)],
}
FITTED_TERMS = tuple(p.name for params in FRAMEWORK_FITS.values() for p in params) + RESERVE_TERMS
INFORMED_REL = 1e-6  # a row informs a term when its metric at the term's two bounds differs by more than this


def term_defaults(flavours: tuple[str, ...] | None = None) -> dict[str, float]:
    """The documented default (the `Framework` dataclass default) of every fitted term of `flavours` (all
    when None): what a term takes when no row is left to fit it on."""
    defaults = {f.name: f.default for f in dataclasses.fields(Framework)}
    return {name: float(defaults[name.split(".")[1]]) for name in FITTED_TERMS
            if flavours is None or name.split(".")[0] in flavours}


def informed(rows: list[PublishedRow], params: list[Param], *, clusters: dict[str, ClusterSpec],
             frameworks: dict[str, Framework]) -> list[Param]:
    """The params some row's metric moves with: each priced at its bounds, the others at their values in
    `frameworks` (one vectorised call per row)."""
    names = [p.name.split(".") for p in params]
    values = {}
    for i, p in enumerate(params):
        flavour, field = names[i]
        column = np.full(2 * len(params), float(getattr(frameworks[flavour], field)))
        column[2 * i:2 * i + 2] = (p.lo, p.hi)
        values[p.name] = column
    moved = np.zeros(len(params), dtype=bool)
    for r in rows:
        cl, fw = _apply(values, clusters[r.cluster], frameworks)
        pairs = np.broadcast_to(row_metric(r, cl, fw), (2 * len(params),)).reshape(len(params), 2)
        moved |= np.abs(pairs[:, 1] / pairs[:, 0] - 1.0) > INFORMED_REL
    return [p for p, m in zip(params, moved) if m]


def fit_rows(path: str | Path = DATA, exclude_source: str | tuple[str, ...] | None = None) -> list[PublishedRow]:
    """Every published row with a measured value, less those of `exclude_source` (one source or several)
    and the FP8 rows (priced for validation only: no term is fitted on a Transformer Engine FP8 run)."""
    left_out = source_set(exclude_source)
    return [r for r in calibration_rows(path) + held_out_rows(path) if r.source not in left_out and not r.fp8]


def fit_frameworks(path: str | Path = DATA, *, exclude_source: str | tuple[str, ...] | None = None, zooms: int = 6,
                   only: tuple[str, ...] | None = None) -> dict[str, float]:
    """Every fitted term of each flavour (`FITTED_TERMS`; `only` limits the flavours): fitted on the flavour's
    rows without `exclude_source`'s where a row left informs it (`fit_terms`), else its documented default
    (`term_defaults`); never the shipped value, which may hold the left-out source."""
    return {**term_defaults(only), **fit_terms(path, exclude_source=exclude_source, zooms=zooms, only=only)}


def fit_terms(path: str | Path = DATA, *, exclude_source: str | tuple[str, ...] | None = None, zooms: int = 6,
              only: tuple[str, ...] | None = None) -> dict[str, float]:
    """Only the terms some row left informs (`informed`), each flavour's fitted jointly on its rows; a term
    no row informs is absent."""
    rows = fit_rows(path, exclude_source)
    clusters = {r.cluster: load_cluster(r.cluster) for r in rows}
    base = with_terms(term_defaults())  # never the shipped values
    out: dict[str, float] = {}
    for flavour, params in FRAMEWORK_FITS.items():
        mine = [r for r in rows if r.framework == flavour]
        if (only is not None and flavour not in only) or not mine:
            continue
        moved = informed(mine, params, clusters=clusters, frameworks=base)
        if moved:
            out.update(grid_fit(mine, moved, clusters=clusters, frameworks=base, zooms=zooms))
    reserve = fit_allocator_reserve(exclude_source=exclude_source)
    out.update({k: v for k, v in reserve.items() if only is None or k.split(".")[0] in only})
    return out


def fitted_rows(path: str | Path = DATA) -> dict[str, list[str]]:
    """Which rows each flavour's terms are fitted on (all sources; leave-one-source-out drops one)."""
    out: dict[str, list[str]] = {}
    for r in fit_rows(path):
        if r.framework in FRAMEWORK_FITS:
            out.setdefault(f"framework {r.framework}", []).append(r.id)
    return out


__all__ = ["FITTED_TERMS", "FRAMEWORK_FITS", "INFORMED_REL", "Param", "fit_frameworks", "fit_rows", "fit_terms",
           "fitted_rows", "grid_fit", "informed", "row_metric", "term_defaults", "with_terms"]


if __name__ == "__main__":  # pragma: no cover - `python -m tuning.sim.fit` prints the fit on every source
    import json

    print(json.dumps(fit_frameworks(), indent=2))
