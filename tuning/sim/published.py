"""Published measurements as a validation set: calibration rows vs held-out rows, priced.

`tuning/data/published.yaml` holds every row of every cited table with its source (paper or
repository, table, the configuration as published, the framework) and a `fitted` flag; tables
or rows that cannot be priced are listed as `excluded` with the reason. The `fitted` flag marks the
rows a table was first calibrated with; the per-framework fit (`tuning.sim.fit.fit_rows`) reads
`calibration_rows()` and `held_out_rows()` alike, so only leave-one-source-out figures
(`tuning.sim.validation.loso`) are out of sample. `validation_table()` prices every row;
`summarize()` gives the median absolute error of the rows flagged `fitted: false` by group;
ranking per table is `tuning.sim.validation`; intervals and the domain of validity are `tuning.sim.domain`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from engine.mesh import world_size
from tuning.sim.hardware import ClusterSpec, load_cluster
from tuning.sim.simulator import ModelSpec, ParallelSpec, format_count, simulate
from tuning.sim.spec import parallel_spec

DATA = Path(__file__).parents[1] / "data" / "published.yaml"
# Layout classes (one per row); recompute mode and sequence parallelism are reported as their own
# groupings because they cut across layouts.
STRATEGY_CLASSES = ("DP/ZeRO-1", "ZeRO-2", "ZeRO-3/FSDP", "TP", "PP", "TP+PP", "interleaved")


@dataclass(kw_only=True, slots=True, frozen=True)
class PublishedRow:
    """One published measurement and the configuration it was taken with."""

    id: str
    source: str  # key of the file's `sources`
    row: str  # the row as the source labels it
    cluster: str  # tuning.sim.hardware preset
    layers: int
    hidden: int
    heads: int
    seq: int = 2048
    vocab: int = 51200
    kv_heads: int = 0  # 0 = heads
    ffn_hidden: int = 0  # 0 = 4 hidden
    gated_mlp: bool = False
    biases: bool = True  # biases on every linear layer (Megatron-LM GPT; MPT's default no_bias False)
    learned_positions: bool = True  # a learned position table (Megatron-LM GPT; MPT's default learned_pos_emb)
    dropout: bool = True  # Megatron-LM GPT: dropout 0.1; MPT: none
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
    attention: str = ""  # the fused kernel the run called where the source says (NVTE_FUSED_ATTN, attn_impl): fa2 | cudnn | triton
    framework: str = "megatron"  # tuning/sim/framework.py flavour
    # Megatron-core 2024+ rows: norms, experts, context and expert parallelism, TE's tp overlap
    norm_params: int = 2  # 1 RMSNorm, 2 LayerNorm
    tied_embeddings: bool = True
    experts: int = 0
    top_k: int = 2
    capacity_factor: float = 1.25  # 0 = dropless
    cp: int = 1
    cp_impl: str = "ring"  # Megatron-core's context parallelism passes K/V blocks around a ring
    ep: int = 1
    tp_comm_overlap: bool = False
    grad_accum_fp32: int = -1  # 0: NeMo's distributed_fused_adam with grad_sync_dtype bf16 (16-bit gradient buffer)
    dist_adam: int = 0  # NeMo's distributed_fused_adam: its optim.dtype in bytes (4 by default, 2 bf16)
    defer_embedding_wgrad: int = 0  # defer_embedding_wgrad_compute's wgrad_deferral_limit (pipelined rows)
    attention_unpad: bool = False  # FlashAttention's varlen kernel behind bert_padding (llm-foundry's flash)
    unfused_loss: bool = False  # Megatron's vocab-parallel cross-entropy without --cross-entropy-loss-fusion
    reduce_bytes: int = 0  # bytes the gradients are reduced in where the source's software says (0: the dtype)
    fp8: bool = False  # Transformer Engine FP8 linear layers (NeMo's fp8, llm-foundry's amp_fp8)
    metric: str  # METRICS
    value: float | None = None  # None for a layout that ran out of memory (`oom`)
    source_mfu: float | None = None  # the source's own MFU (%) of a tokens row: its FLOPs per token for the baseline
    fitted: bool
    memory_gb: float | None = None  # the source's measured peak memory per GPU, where it gives one
    oom: bool = False  # the source says this layout ran out of memory

    @property
    def gpus(self) -> int:
        """dp * tp * pp * cp."""
        return world_size(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp)

    def model(self) -> ModelSpec:
        """The model shape as a ModelSpec."""
        return ModelSpec(layers=self.layers, hidden=self.hidden, heads=self.heads, seq=self.seq, vocab=self.vocab,
                         kv_heads=self.kv_heads, ffn_hidden=self.ffn_hidden, gated_mlp=self.gated_mlp,
                         biases=self.biases, learned_positions=self.learned_positions, dropout=self.dropout,
                         norm_params=self.norm_params, tied_embeddings=self.tied_embeddings, experts=self.experts,
                         top_k=self.top_k, capacity_factor=self.capacity_factor)

    def parallel(self) -> ParallelSpec:
        """The published layout as a ParallelSpec (16-bit) on its flavour's defaults (`spec.parallel_spec`: FSDP's
        ZeRO-2 is SHARD_GRAD_OP, per-block gathers kept until backward); every other knob is the row's own."""
        return parallel_spec(dp=self.dp, tp=self.tp, pp=self.pp, virtual=self.virtual, micro=self.micro,
                             global_batch=self.global_batch, zero=self.zero, recompute=self.recompute,
                             sequence_parallel=self.sequence_parallel, overlap_dp=self.overlap_dp,
                             flash_attention=self.flash_attention, framework=self.framework,
                             attention_kernel=self.attention,
                             cp=self.cp, cp_impl=self.cp_impl, ep=self.ep, tp_comm_overlap=self.tp_comm_overlap,
                             moe_padded=self.capacity_factor > 0, grad_accum_fp32=self.grad_accum_fp32,
                             dist_adam=self.dist_adam, defer_embedding_wgrad=self.defer_embedding_wgrad,
                             attention_unpad=self.attention_unpad, unfused_loss=self.unfused_loss,
                             reduce_bytes=self.reduce_bytes, fp8=self.fp8)


@functools.lru_cache(maxsize=4)
def _raw(path: str) -> dict[str, Any]:
    # libyaml's loader where PyYAML was built with it: the pure-Python one takes seconds on this file
    text = Path(path).read_text()
    data = yaml.load(text, Loader=yaml.CSafeLoader) if hasattr(yaml, "CSafeLoader") else yaml.safe_load(text)
    ids = [r["id"] for r in data["rows"]]
    if len(ids) != len(set(ids)):
        raise ValueError(f"{path}: duplicate row ids")
    for r in data["rows"]:
        if not isinstance(r.get("fitted"), bool):
            raise ValueError(f"{path}: row {r.get('id')}: fitted={r.get('fitted')!r} must be true or false")
        if r["source"] not in data["sources"]:
            raise ValueError(f"{path}: row {r['id']}: source={r['source']!r} is not in sources")
        if bool(r.get("oom")) == ("value" in r):
            raise ValueError(f"{path}: row {r['id']}: a row has a value or oom: true, not both")
        if r.get("metric") not in METRICS:
            raise ValueError(f"{path}: row {r['id']}: metric={r.get('metric')!r} must be one of {METRICS}")
        if r["metric"] == "tokens_per_s_per_gpu" and not r.get("source_mfu"):
            raise ValueError(f"{path}: row {r['id']}: a tokens_per_s_per_gpu row needs source_mfu (the baseline's FLOPs)")
    return data


def sources(path: str | Path = DATA) -> dict[str, dict[str, Any]]:
    """The `sources` block: paper, table, where, hardware, framework, row counts, exclusions."""
    return _raw(str(path))["sources"]


def _rows(path: str | Path, fitted: bool) -> list[PublishedRow]:
    return [PublishedRow(**r) for r in _raw(str(path))["rows"] if r["fitted"] is fitted and not r.get("oom")]


def calibration_rows(path: str | Path = DATA) -> list[PublishedRow]:
    """Rows flagged `fitted: true` with a measured value."""
    return _rows(path, True)


def held_out_rows(path: str | Path = DATA) -> list[PublishedRow]:
    """Rows flagged `fitted: false` with a measured value (the fit reads them too: `tuning.sim.fit.fit_rows`)."""
    return _rows(path, False)


def memory_facts(path: str | Path = DATA) -> list[PublishedRow]:
    """Rows that say how much memory a layout took (`memory_gb`) or that it ran out (`oom`)."""
    return [PublishedRow(**r) for r in _raw(str(path))["rows"] if r.get("oom") or r.get("memory_gb") is not None]


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


# What a row's value measures: executed TFLOP/s per GPU (recomputation counted, as Megatron-LM and
# Megatron-DeepSpeed report), model TFLOP/s per GPU (no recomputation: Megatron-core's
# num_floating_point_operations, NeMo), MFU in percent (model FLOPs, MosaicML), or tokens/s per GPU (the
# source's step time; free of any FLOP convention).
METRICS = ("tflops_per_gpu", "model_tflops_per_gpu", "mfu", "tokens_per_s_per_gpu")


def metric_of(metric: str, out: Any, gpus: int, peak_flops: float) -> Any:
    """A row's metric from the simulator's outputs (`evaluate_arrays`' dict or a SimResult's fields)."""
    get = out.get if isinstance(out, dict) else lambda k: getattr(out, k)
    if metric == "tflops_per_gpu":
        return get("tflops_per_gpu")
    if metric == "model_tflops_per_gpu":
        return get("mfu") * peak_flops / 1e12
    if metric == "tokens_per_s_per_gpu":
        return get("tokens_per_s") / gpus
    return 100.0 * get("mfu")


def simulated_metric(row: PublishedRow, cluster: ClusterSpec | None = None) -> float:
    """The simulator's value of the row's metric (METRICS)."""
    cl = cluster or load_cluster(row.cluster)
    return float(metric_of(row.metric, simulate(row.model(), cl, row.parallel()), row.gpus, cl.peak_flops))


def group_key(row: PublishedRow) -> str:
    """The table a row is ranked in: one model at one sequence length on one cluster in one source
    (the configurations a user would choose between for that job)."""
    return (f"{row.source}: {format_count(row.model().params)} ({row.layers} x {row.hidden}, s {row.seq}) "
            f"on {row.cluster}")


def _layout(r: PublishedRow) -> str:
    return (f"tp{r.tp} pp{r.pp} dp{r.dp}" + (f" v{r.virtual}" if r.virtual > 1 else "")
            + (f" zero{r.zero}" if r.zero else "") + f" mb{r.micro} B{r.global_batch}")


def validation_table(path: str | Path = DATA, *, clusters: dict[str, ClusterSpec] | None = None) -> pd.DataFrame:
    """Every row with a measured value priced: published vs simulated, error_pct = (simulated -
    published) / published. A positive error means the simulator predicts a faster run than measured."""
    order = [x["id"] for x in _raw(str(path))["rows"]]
    rows = sorted(calibration_rows(path) + held_out_rows(path), key=lambda r: order.index(r.id))
    srcs = sources(path)
    out = []
    for r in rows:
        cl = (clusters or {}).get(r.cluster) or load_cluster(r.cluster)
        res = simulate(r.model(), cl, r.parallel())
        sim = float(metric_of(r.metric, res, r.gpus, cl.peak_flops))
        out.append({
            "id": r.id, "source": r.source, "paper": srcs[r.source]["paper"].split(",")[0],
            "table": srcs[r.source]["table"].split(",")[0], "group": group_key(r),
            "row": r.row, "hardware": r.cluster, "framework": r.framework,
            "class": strategy_class(r.tp, r.pp, r.virtual, r.zero), "recompute": r.recompute,
            "sequence_parallel": r.sequence_parallel, "params": format_count(r.model().params), "gpus": r.gpus,
            "micro": r.micro, "seq": r.seq, "params_n": r.model().params, "layout": _layout(r), "metric": r.metric,
            "published": r.value, "simulated": sim, "error_pct": 100.0 * (sim - r.value) / r.value,
            "fitted": r.fitted, "memory_gb": r.memory_gb, "sim_memory_gb": res.memory_per_gpu_gb, "fits": res.fits,
        })
    return pd.DataFrame(out)


def summarize(table: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Median/max |error| and row count of the rows `table` flags `fitted: false`: overall, per class,
    hardware, framework, recompute mode and source (out of sample only where `table` is priced so)."""
    held = table[~table["fitted"]].assign(abs_err=lambda d: d["error_pct"].abs())

    def agg(df: pd.DataFrame, key: str | None) -> pd.DataFrame:
        groups = [("all", df)] if key is None else list(df.groupby(key))
        return pd.DataFrame([{"group": name, "rows": len(g), "median_abs_error_pct": g["abs_err"].median(),
                              "max_abs_error_pct": g["abs_err"].max(),
                              "median_error_pct": g["error_pct"].median()} for name, g in groups])

    return {"overall": agg(held, None), "source": agg(held, "source"), "class": agg(held, "class"),
            "hardware": agg(held, "hardware"), "framework": agg(held, "framework"),
            "recompute": agg(held, "recompute"), "sequence_parallel": agg(held, "sequence_parallel")}


def unvalidated(table: pd.DataFrame) -> dict[str, list[str]]:
    """Strategy classes, recompute modes, sequence parallel settings, presets and frameworks
    without a held-out row."""
    from tuning.sim.hardware import PRESETS
    from tuning.sim.simulator import RECOMPUTE
    from tuning.sim.framework import FRAMEWORK_NAMES

    held = table[~table["fitted"]]
    return {"class": [c for c in STRATEGY_CLASSES if c not in set(held["class"])],
            "recompute": [r for r in RECOMPUTE if r not in set(held["recompute"])],
            "sequence_parallel": [str(v) for v in (False, True) if v not in set(held["sequence_parallel"])],
            "hardware": [h for h in PRESETS if h not in set(held["hardware"])],
            "framework": [f for f in FRAMEWORK_NAMES if f != "engine" and f not in set(held["framework"])]}


__all__ = [
    "DATA", "METRICS", "PublishedRow", "STRATEGY_CLASSES", "calibration_rows", "metric_of", "group_key", "held_out_rows", "memory_facts",
    "simulated_metric", "sources", "strategy_class", "summarize", "unvalidated", "validation_table",
]
