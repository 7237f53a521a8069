"""Where the simulator has been checked, and how far to trust a prediction outside it.

The validated domain is what the published rows (`tuning.sim.published`, calibration and held-out) cover:
for a prediction's hardware preset, framework flavour and strategy class (its *cell*), the range of
GPU counts, micro-batch sizes and model sizes of that cell's rows. A prediction inside every range of
a non-empty cell is *inside*; otherwise it is *extrapolated*, with the reasons and the nearest
validated rows.

Interval rule (documented in docs/simulator.md, "Domain of validity"): the measured iteration time
lies in [t (1 + lo), t (1 + hi)], where [lo, hi] is the band of the held-out relative errors
(simulated / published - 1) of the cell (10th-90th percentile from 10 rows, else min-max), or of the
class on any hardware, or of every held-out row, whichever first has MIN_BAND_ROWS rows. Outside
the domain the band widens with the extrapolation distance D: each numeric dimension adds the
doublings it lies beyond its range (|log2(value / nearest bound)|), each categorical dimension
without a validated row (hardware, framework, class) adds CATEGORY_DISTANCE; the band becomes
[lo (1 + D) - 0.1 D, hi (1 + D) + 0.1 D]. Inside, D = 0 and the band is the cell's.

Assessing a published row itself leaves it out (`exclude_id`): its own error never narrows its band.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tuning.sim.cache import cache_path, cached_frame
from tuning.sim.published import DATA, STRATEGY_CLASSES, strategy_class, validation_table

MIN_BAND_ROWS = 3  # held-out rows a band needs before a wider pool is borrowed
CATEGORY_DISTANCE = 2.0  # extrapolation distance of a hardware / framework / class with no validated row
WIDEN_PER_UNIT = 0.10  # extra half-width per unit of distance, whatever the band


_COLUMNS = ["id", "hardware", "framework", "class", "gpus", "micro", "seq", "params_n", "params", "layout", "error_pct", "fitted",
            "published", "simulated"]


@functools.lru_cache(maxsize=2)
def _table(path: str) -> pd.DataFrame:
    # the few columns the domain reads: boolean selections on the full table cost ms each
    return cached_frame(cache_path("validated", path),
                        lambda: validation_table(path)[_COLUMNS].reset_index(drop=True))


def validated(path: str | Path = DATA) -> pd.DataFrame:
    """Every priced published row (the validated domain: the columns it reads), cached per file."""
    return _table(str(path))


@dataclass(kw_only=True, slots=True)
class Domain:
    """Where one prediction stands against the validated rows."""

    inside: bool
    distance: float  # extrapolation distance D (0 inside)
    reasons: list[str] = field(default_factory=list)  # why it is extrapolated
    cell: str = ""  # hardware, framework, class
    nearest: list[dict[str, Any]] = field(default_factory=list)  # nearest validated rows

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (`simulate --json`)."""
        return {"inside": self.inside, "status": "inside" if self.inside else "extrapolated",
                "distance": self.distance, "reasons": list(self.reasons), "cell": self.cell,
                "nearest": list(self.nearest)}


def _doublings(value: float, lo: float, hi: float) -> float:
    if value < lo:
        return math.log2(lo / value)
    if value > hi:
        return math.log2(value / hi)
    return 0.0


def _pool(table: pd.DataFrame, hardware: str, framework: str, cls: str) -> tuple[pd.DataFrame, list[str], float]:
    """The narrowest non-empty set of rows (cell, then wider) and what is missing at each step."""
    reasons, distance = [], 0.0
    hw = table[table["hardware"] == hardware]
    if hw.empty:
        reasons.append(f"hardware {hardware} has no validated row")
        distance += CATEGORY_DISTANCE
        hw = table
    fw = hw[hw["framework"] == framework]
    if fw.empty:
        reasons.append(f"framework {framework} has no validated row on {hardware}")
        distance += CATEGORY_DISTANCE
        fw = hw
    cell = fw[fw["class"] == cls]
    if cell.empty:
        reasons.append(f"class {cls} has no validated row for {framework} on {hardware}")
        distance += CATEGORY_DISTANCE
        cell = fw
    return cell, reasons, distance


def assess(*, hardware: str, framework: str, cls: str, gpus: int, micro: int, params: float, seq: int = 0,
           table: pd.DataFrame | None = None, exclude_id: str | None = None, nearest: int = 3) -> Domain:
    """Inside or extrapolated, the distance D, the reasons and the `nearest` validated rows (nearest in
    log GPUs, micro-batch, model size and, when given, sequence length)."""
    table = validated() if table is None else table
    if exclude_id is not None:
        table = table[table["id"] != exclude_id]
    rows, reasons, distance = _pool(table, hardware, framework, cls)
    for name, value, col in (("GPUs", gpus, "gpus"), ("micro-batch", micro, "micro"), ("model size", params, "params_n")):
        lo, hi = float(rows[col].min()), float(rows[col].max())
        d = _doublings(float(value), lo, hi)
        if d > 0:
            reasons.append(f"{name} {value:,.0f} outside the validated {lo:,.0f}..{hi:,.0f}")
            distance += d
    dist = (np.log2(rows["gpus"] / gpus) ** 2 + np.log2(rows["micro"] / micro) ** 2
            + np.log2(rows["params_n"] / params) ** 2 + (np.log2(rows["seq"] / seq) ** 2 if seq else 0.0))
    near = rows.assign(_d=dist).nsmallest(nearest, "_d")
    return Domain(inside=not reasons, distance=round(distance, 3), reasons=reasons,
                  cell=f"{hardware}, {framework}, {cls}",
                  nearest=[{"id": r.id, "layout": r.layout, "params": r.params, "error_pct": round(float(r.error_pct), 1)}
                           for r in near.itertuples()])


def band(*, hardware: str, framework: str, cls: str, table: pd.DataFrame | None = None,
         exclude_id: str | None = None) -> tuple[float, float, int, str]:
    """(lo, hi) relative error of the held-out rows of the narrowest pool with MIN_BAND_ROWS rows (cell,
    class on any hardware, all), their count and the pool's name."""
    table = validated() if table is None else table
    held = table[~table["fitted"]]
    if exclude_id is not None:
        held = held[held["id"] != exclude_id]
    pools = [(f"cell {hardware}, {framework}, {cls}",
              held[(held["hardware"] == hardware) & (held["framework"] == framework) & (held["class"] == cls)]),
             (f"class {cls}", held[held["class"] == cls]), ("pooled", held)]
    name, rows = next((n, r) for n, r in pools if len(r) >= MIN_BAND_ROWS or n == "pooled")
    errs = rows["error_pct"].to_numpy() / 100.0
    lo, hi = (np.percentile(errs, [10, 90]) if errs.size >= 10 else (errs.min(), errs.max()))
    return float(lo), float(hi), int(errs.size), name


def interval(time_s: float, domain: Domain, lo: float, hi: float) -> tuple[float, float]:
    """Measured-time interval around predicted `time_s` (the module docstring's rule)."""
    d = domain.distance
    lo_w, hi_w = lo * (1 + d) - WIDEN_PER_UNIT * d, hi * (1 + d) + WIDEN_PER_UNIT * d
    return time_s * max(1.0 + lo_w, 0.05), time_s * (1.0 + hi_w)


def prediction(time_s: float, *, hardware: str, framework: str, tp: int, pp: int, virtual: int, zero: int,
               gpus: int, micro: int, params: float, seq: int = 0, exclude_id: str | None = None) -> dict[str, Any]:
    """Everything a caller prints next to one prediction: class, domain, interval and its basis."""
    cls = str(strategy_class(tp, pp, virtual, zero))
    dom = assess(hardware=hardware, framework=framework, cls=cls, gpus=gpus, micro=micro, params=params, seq=seq,
                 exclude_id=exclude_id)
    lo, hi, n, basis = band(hardware=hardware, framework=framework, cls=cls, exclude_id=exclude_id)
    t_lo, t_hi = interval(time_s, dom, lo, hi)
    widened = f", widened for extrapolation distance {dom.distance:g}" if not dom.inside else ""
    return {"strategy_class": cls, "domain": dom.to_dict(), "interval_s": [t_lo, t_hi],
            "interval_basis": f"{basis} ({n} held-out rows){widened}"}


def interval_fields(time_s: Any, tp: Any, pp: Any, virtual: Any, zero: Any, *, hardware: str = "",
                    framework: str = "megatron", gpus: Any = 0, micro: Any = 1, params: float = 0.0) -> dict[str, Any]:
    """`prediction` for arrays of configurations (a search's rows): strategy class, time interval,
    basis, and whether each row is extrapolated (vectorised over the few distinct cells)."""
    t = np.asarray(time_s, dtype=float)
    cls = np.asarray(strategy_class(tp, pp, virtual, zero))
    shape = np.broadcast(t, cls).shape
    t, cls = np.broadcast_to(t, shape), np.broadcast_to(cls, shape)
    gpus_a, micro_a = (np.broadcast_to(np.asarray(x), shape) for x in (gpus, micro))
    lo_t, hi_t = np.empty(shape), np.empty(shape)
    basis, extra = np.empty(shape, dtype=object), np.zeros(shape, dtype=bool)
    for key in set(zip(np.ravel(cls).tolist(), np.ravel(gpus_a).tolist(), np.ravel(micro_a).tolist())):
        mask = (cls == key[0]) & (gpus_a == key[1]) & (micro_a == key[2])
        dom = assess(hardware=hardware, framework=framework, cls=key[0], gpus=max(int(key[1]), 1),
                     micro=max(int(key[2]), 1), params=max(params, 1.0))
        lo, hi, n, name = band(hardware=hardware, framework=framework, cls=key[0])
        t_lo, t_hi = interval(1.0, dom, lo, hi)
        lo_t[mask], hi_t[mask] = t[mask] * t_lo, t[mask] * t_hi
        basis[mask] = f"{name} ({n} held-out rows)" + ("" if dom.inside else f", extrapolated D={dom.distance:g}")
        extra[mask] = not dom.inside
    return {"strategy_class": cls, "time_lo_s": lo_t, "time_hi_s": hi_t, "interval_basis": basis, "extrapolated": extra}


def held_out_coverage(path: str | Path = DATA) -> pd.DataFrame:
    """Every held-out row assessed leave-one-out: inside or extrapolated, its interval around the
    simulated time (from the metric: time = work / rate) and whether the measured time falls in it."""
    table = validated(path)
    out = []
    for r in table[~table["fitted"]].itertuples():
        pred = prediction(1.0, hardware=r.hardware, framework=r.framework, tp=int(r.layout.split()[0][2:]),
                          pp=int(r.layout.split()[1][2:]), virtual=_virtual(r.layout), zero=_zero(r.layout),
                          gpus=int(r.gpus), micro=int(r.micro), params=float(r.params_n), seq=int(r.seq),
                          exclude_id=r.id)
        measured = r.simulated / r.published  # measured time over predicted time, from the metric ratio
        lo, hi = pred["interval_s"]
        out.append({"id": r.id, "error_pct": r.error_pct, "inside": pred["domain"]["inside"],
                    "distance": pred["domain"]["distance"], "lo": lo, "hi": hi, "covered": lo <= measured <= hi})
    return pd.DataFrame(out)


def _virtual(layout: str) -> int:
    return next((int(p[1:]) for p in layout.split() if p.startswith("v") and p[1:].isdigit()), 1)


def _zero(layout: str) -> int:
    return next((int(p[4:]) for p in layout.split() if p.startswith("zero")), 0)


__all__ = ["CATEGORY_DISTANCE", "Domain", "MIN_BAND_ROWS", "STRATEGY_CLASSES", "assess", "band", "held_out_coverage",
           "interval", "interval_fields", "prediction", "validated"]
