"""Memory facts: every published layout that ran, or ran out of memory, priced by the memory model.

Two files hold them: tuning/data/published.yaml (throughput rows, each of which ran, and its rows with a
measured `memory_gb` or `oom: true`; read through `tuning.sim.published`) and tuning/data/memory_facts.yaml
(layouts whose throughput is not priced: Llama 3's Table 4, NeMo's H100 recipes, torchtitan's memory
tables, BLOOM's 02-28 layout search). `walk()` prices all of them with `tuning.sim.simulator.simulate` and
says, for each, whether the model predicts it fits, the predicted GB, its largest term and the measured
GB where the source gives one. Nothing is fitted on whether a layout ran; the one memory term fitted on readings
(`allocator_reserve`, DeepSpeed's: `tuning.sim.memory_facts.fit_allocator_reserve`) is fitted on the nvidia-smi readings
of runs that ran, and `walk(leave_one_source_out=True)` prices each source with it refitted without that source.

A measured figure says what it measured (`memory_kind`, per source): `nvidia-smi` (the device memory in use:
tensors, the caching allocator's free cached blocks, the CUDA context, NCCL), `reserved` (torch's
max_memory_reserved: tensors and cached blocks) or `allocated` (max_memory_allocated: tensors). `walk()`
sets beside it the model's matching figure (`predicted_kind_gb`: the total for nvidia-smi, the tensor
categories for the other two; the allocator's cached blocks are in neither, so a reading at or above it is
consistent and the gap is that cache).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from tuning.sim.framework import with_terms
from tuning.sim.hardware import GIB, ClusterSpec, load_cluster
from tuning.sim.spec import ModelSpec, ParallelSpec

DATA = Path(__file__).parents[1] / "data" / "memory_facts.yaml"
_MODEL_KEYS = ("model", "heads", "seq")
_FACT_KEYS = ("id", "row", "outcome", "memory_gb", "memory_unit", "cluster", "cluster_memory_gb")
MEMORY_KINDS = ("nvidia-smi", "reserved", "allocated")
# flavours whose memory readings (nvidia-smi, of runs that ran) fit `allocator_reserve` (fit_allocator_reserve):
# DeepSpeed's are BigScience's 49; the other flavours have no nvidia-smi reading
RESERVE_FITS = ("deepspeed",)
RESERVE_TERMS = tuple(f"{name}.allocator_reserve" for name in RESERVE_FITS)


@dataclass(frozen=True, kw_only=True)
class MemoryFact:
    """One layout from a cited source that ran (`outcome` "ran") or ran out of memory ("oom")."""

    id: str
    source: str
    row: str
    model: ModelSpec
    parallel: ParallelSpec
    cluster: ClusterSpec
    outcome: str
    memory_gb: float | None = None  # measured peak per GPU in GB (1e9 B), converted from the source's unit
    memory_kind: str = ""  # what memory_gb measured: one of MEMORY_KINDS ("" where there is no figure)
    extra: dict[str, Any] = field(default_factory=dict)


@functools.lru_cache(maxsize=2)
def _raw(path: str) -> dict[str, Any]:
    data = yaml.safe_load(Path(path).read_text())
    ids = [r["id"] for block in data["facts"] for r in block["rows"]]
    if len(ids) != len(set(ids)):
        raise ValueError(f"{path}: duplicate fact ids")
    return data


def sources(path: str | Path = DATA) -> dict[str, dict[str, Any]]:
    """The `sources` block of the memory-facts file."""
    return _raw(str(path))["sources"]


def memory_kind(source: str, path: str | Path = DATA) -> str:
    """What the source's memory figures measured (the file's `memory_kinds`, by source key)."""
    kind = _raw(str(path)).get("memory_kinds", {}).get(source, "")
    if kind and kind not in MEMORY_KINDS:
        raise ValueError(f"{path}: memory_kinds[{source}]={kind!r} must be one of {MEMORY_KINDS}")
    return kind


def _model(models: dict[str, Any], name: str, seq: int, heads: int | None) -> ModelSpec:
    entry = models[name]
    spec = ModelSpec.from_hf(entry["hf"], seq=seq) if "hf" in entry else ModelSpec(**entry["spec"], seq=seq)
    return dataclasses.replace(spec, heads=heads) if heads else spec


def _cluster(name: str, memory_gb: float | None) -> ClusterSpec:
    cluster = load_cluster(name)
    return dataclasses.replace(cluster, memory_gb=memory_gb) if memory_gb else cluster


def facts(path: str | Path = DATA) -> list[MemoryFact]:
    """Every fact of the file, its model, layout and cluster built (ValueError names a bad row)."""
    data = _raw(str(path))
    out = []
    for block in data["facts"]:
        if block["source"] not in data["sources"]:
            raise ValueError(f"{path}: source={block['source']!r} is not in sources")
        for row in block["rows"]:
            r = {**block.get("defaults", {}), **row}
            if r.get("outcome") not in ("ran", "oom") or (r["outcome"] == "oom" and r.get("memory_gb") is not None):
                raise ValueError(f"{path}: fact {r['id']}: outcome must be ran or oom (an oom has no memory_gb)")
            layout = {k: v for k, v in r.items() if k not in _MODEL_KEYS + _FACT_KEYS}
            par = ParallelSpec(**layout)
            unit = GIB if r.get("memory_unit") == "GiB" else 1.0
            measured = float(r["memory_gb"]) * unit if r.get("memory_gb") is not None else None
            out.append(MemoryFact(id=r["id"], source=block["source"], row=r["row"],
                                  model=_model(data["models"], r["model"], int(r["seq"]), r.get("heads")),
                                  parallel=par, cluster=_cluster(r["cluster"], r.get("cluster_memory_gb")),
                                  outcome=r["outcome"], memory_gb=measured,
                                  memory_kind=memory_kind(block["source"], path) if measured is not None else ""))
    return out


def published_facts() -> list[MemoryFact]:
    """tuning/data/published.yaml's rows as memory facts: every throughput row ran; its `oom` rows did not."""
    from tuning.sim import published

    seen: set[str] = set()
    out = []
    for r in published.calibration_rows() + published.held_out_rows() + published.memory_facts():
        if r.id in seen:
            continue
        seen.add(r.id)
        out.append(MemoryFact(id=r.id, source=r.source, row=r.row, model=r.model(), parallel=r.parallel(),
                              cluster=load_cluster(r.cluster), outcome="oom" if r.oom else "ran",
                              memory_gb=r.memory_gb, memory_kind=memory_kind(r.source) if r.memory_gb else ""))
    return out


@functools.lru_cache(maxsize=1)
def _reserve_readings() -> tuple[tuple[str, str, float], ...]:
    """(source, flavour, share) of every reading `allocator_reserve` is fitted on: an nvidia-smi reading of a
    run that ran, of a flavour in RESERVE_FITS, up to ZeRO-2 (RESERVE_MAX_ZERO); share = (reading - runtime) /
    tensors - 1, with the model priced without any reserve."""
    from tuning.sim.memory import RESERVE_MAX_ZERO, TENSORS
    from tuning.sim.simulator import simulate

    base = with_terms(dict.fromkeys(RESERVE_TERMS, 0.0))
    out = []
    for f in published_facts() + facts():
        par = f.parallel
        if f.memory_kind != "nvidia-smi" or par.framework not in RESERVE_FITS or par.zero > RESERVE_MAX_ZERO:
            continue
        b = simulate(f.model, f.cluster, par, frameworks=base).memory_breakdown_gb
        out.append((f.source, par.framework, (f.memory_gb - b["runtime"]) / sum(b[c] for c in TENSORS) - 1.0))
    return tuple(out)


def source_set(exclude_source: str | tuple[str, ...] | None) -> frozenset[str]:
    """The sources a fit leaves out: one source's key, several (a family's), or none."""
    if exclude_source is None:
        return frozenset()
    return frozenset((exclude_source,) if isinstance(exclude_source, str) else exclude_source)


def fit_allocator_reserve(*, exclude_source: str | tuple[str, ...] | None = None) -> dict[str, float]:
    """Each flavour of RESERVE_FITS's `allocator_reserve`: the median share of its readings (`_reserve_readings`)
    without `exclude_source`'s (one source or several). An out-of-memory fact has no reading, so none is fitted
    on; a flavour with no reading left keeps 0 (it is not in the result)."""
    out: dict[str, float] = {}
    for flavour in RESERVE_FITS:
        left_out = source_set(exclude_source)
        shares = [share for source, name, share in _reserve_readings() if name == flavour and source not in left_out]
        if shares:
            out[f"{flavour}.allocator_reserve"] = float(np.median(shares))
    return out


def walk(path: str | Path = DATA, *, leave_one_source_out: bool = False) -> pd.DataFrame:
    """Every memory fact priced: outcome, predicted GB and fit, usable GB, measured GB, the largest term,
    the pipeline rank priced, the categories; `agrees` is True where the prediction matches the outcome.
    With `leave_one_source_out`, each fact is priced with the memory term fitted on readings
    (`allocator_reserve`) refitted without its source's readings; otherwise with the shipped fit."""
    from tuning.sim.memory import TENSORS
    from tuning.sim.simulator import simulate

    @functools.cache
    def without(source: str) -> Any:
        return with_terms({**dict.fromkeys(RESERVE_TERMS, 0.0), **fit_allocator_reserve(exclude_source=source)})

    rows = []
    for f in published_facts() + facts(path):
        fws = without(f.source) if leave_one_source_out else None
        res = simulate(f.model, f.cluster, f.parallel, frameworks=fws)
        usable = f.cluster.memory_gb * f.cluster.usable_memory_fraction
        tensors = sum(res.memory_breakdown_gb[k] for k in TENSORS)
        kind = {"nvidia-smi": res.memory_per_gpu_gb, "reserved": tensors, "allocated": tensors}.get(f.memory_kind)
        rows.append({"id": f.id, "source": f.source, "outcome": f.outcome, "predicted_gb": res.memory_per_gpu_gb,
                     "usable_gb": usable, "fits": res.fits, "agrees": res.fits == (f.outcome == "ran"),
                     "measured_gb": f.memory_gb, "memory_kind": f.memory_kind, "predicted_kind_gb": kind,
                     "dominant": res.extra["memory_dominant"], "stage": res.extra["memory_stage"],
                     "allocator_reserve_gb": res.extra["memory_terms_gb"]["allocator_reserve"],
                     **{f"{k}_gb": v for k, v in res.memory_breakdown_gb.items()}})
    return pd.DataFrame(rows)


__all__ = ["DATA", "MEMORY_KINDS", "RESERVE_FITS", "RESERVE_TERMS", "MemoryFact", "facts", "fit_allocator_reserve",
           "memory_kind", "published_facts", "source_set", "sources", "walk"]
