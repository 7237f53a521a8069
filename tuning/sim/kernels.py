"""Kernel costs from hardware facts (issue 49): a GEMM by its shape, fused attention by its measured
rate, memory-bound work at measured bandwidth; every number from `tuning/data/kernels.yaml`, which
cites its source. Nothing here is fitted to a training run.

- **GEMM** (M x N output, K reduction, `batch` of them): the library's best output tile among the
  cited shapes fills `sms` multiprocessors in waves; the GEMM runs at peak x MAMF efficiency x
  (useful tiles / tile slots of its waves) -- tile and wave quantisation -- and never faster than it
  streams its operands and result, 2 (MK + KN + MN) bytes, at the measured bandwidth (small GEMMs
  are memory-bound).
- **Fused attention**: FlashAttention-2 / cuDNN forward and backward rates by head dim, sequence
  length and causality, as the papers measured them (FlashAttention's FLOP convention: forward
  4 s^2 d per head, backward 2.5x, causal half).
- **Memory-bound kernels** (norms, activations, dropout, rotary, casts, the loss, the optimizer) at
  the measured streaming bandwidth.
- **FP8 GEMMs** (Transformer Engine's linear layers, `ParallelSpec.fp8`): the GPU's cited FP8 / BF16 rate
  ratio on the same shapes (`fp8_speedup` in kernels.yaml) over the BF16 compute time, 1-byte operands and a
  16-bit output streamed; a GPU without that fact has no FP8 (`fp8_facts` refuses it).

A cluster names its GPU's facts in `ClusterSpec.kernels` ("a100", "h100", ...); CPU profiles
(`tuning.calibrate.calibration`) leave it empty and keep their measured tables.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

GB = 1e9
KERNELS = Path(__file__).parents[1] / "data" / "kernels.yaml"


@dataclass(frozen=True)
class AttentionTable:
    """One fused-attention kernel's measured rates (FLOP/s) at `seq` lengths, keyed (hd, causal, pass)."""

    seq: np.ndarray
    rates: dict[tuple[int, bool, str], np.ndarray] = field(default_factory=dict)

    def rate(self, head_dim: int, causal: bool, kind: str, seq: Any) -> np.ndarray:
        """FLOP/s at `seq` for the nearest measured head dim: log(seq) interpolation, held at the ends."""
        dims = sorted({d for d, _, _ in self.rates})
        hd = min(dims, key=lambda d: (abs(np.log(d / head_dim)), -d))
        x = np.log(np.maximum(np.asarray(seq, dtype=float), 1.0))
        return np.interp(x, np.log(self.seq), self.rates[(hd, causal, kind)])


@dataclass(frozen=True)
class GpuFacts:
    """What one GPU kind is measured to do (tuning/data/kernels.yaml `gpus.<kind>`)."""

    kind: str
    sms: int
    gemm_efficiency: float
    tiles: tuple[tuple[int, int], ...]
    hbm_gb_s: float
    attention: dict[str, AttentionTable] = field(default_factory=dict)
    fp8_peak_tflops: float = 0.0  # dense FP8 tensor-core peak (0: no FP8)
    fp8_speedup: float = 0.0  # achieved FP8 / BF16 rate of the same GEMMs (0: no FP8)


def _table(raw: dict[str, Any], like: AttentionTable | None) -> AttentionTable:
    """Rates in FLOP/s; what is missing is derived from `like` (the same kernel on another GPU): a
    kernel measured only forward + backward (`fwd_bwd`) is split by `like`'s backward / forward ratio; a
    non-causal backward from its backward / forward ratio at the same head dim and lengths, a head
    dim it has and this table lacks from its ratio to the nearest measured one; a causal backward is
    causal forward x non-causal backward / forward."""
    seq = np.asarray(raw["seq"], dtype=float)
    rates: dict[tuple[int, bool, str], np.ndarray] = {}
    raw = dict(raw)

    def like_ratio(hd: int, causal: bool) -> np.ndarray:  # `like`'s backward / forward rate
        return like.rate(hd, causal, "bwd", seq) / like.rate(hd, causal, "fwd", seq)

    for hd in sorted({d for d, _, _ in like.rates} if like else ()):
        if f"hd{hd}" not in raw:
            near = min((int(k[2:]) for k in raw if k.startswith("hd")), key=lambda d: abs(np.log(d / hd)))
            raw[f"hd{hd}"] = {mask: {kind: np.asarray(v) * like.rate(hd, mask == "causal", kind, seq)
                                     / like.rate(near, mask == "causal", kind, seq) for kind, v in passes.items()}
                              for mask, passes in raw[f"hd{near}"].items()}
    for key, by_mask in raw.items():
        if not key.startswith("hd"):
            continue
        hd = int(key[2:])
        for mask, passes in by_mask.items():
            causal = mask == "causal"
            if "fwd_bwd" in passes:  # one forward + backward rate R: split so that W/fwd + 2.5W/bwd = 3.5W/R
                ratio = like_ratio(hd, causal)
                fwd = np.asarray(passes["fwd_bwd"], dtype=float) * (1.0 + 2.5 / ratio) / 3.5
                passes = {"fwd": fwd, "bwd": fwd * ratio}
            for kind, values in passes.items():
                rates[(hd, causal, kind)] = np.asarray(values, dtype=float) * 1e12
        if (hd, False, "bwd") not in rates and like is not None:
            rates[(hd, False, "bwd")] = rates[(hd, False, "fwd")] * like_ratio(hd, False)
        if (hd, True, "bwd") not in rates:
            rates[(hd, True, "bwd")] = rates[(hd, True, "fwd")] * rates[(hd, False, "bwd")] / rates[(hd, False, "fwd")]
    return AttentionTable(seq=seq, rates=rates)


def _fields(gpus: dict[str, Any], kind: str) -> dict[str, Any]:
    """Kind's fields: those of the kind it is `like` (itself maybe like another), overridden by its own;
    attention kernel by kernel (its own first: the first is the fallback)."""
    raw = dict(gpus[kind])
    if "like" not in raw:
        return raw
    base = _fields(gpus, raw.pop("like"))
    attention = {**(raw.get("attention") or {}), **{k: v for k, v in (base.get("attention") or {}).items()
                                                   if k not in (raw.get("attention") or {})}}
    return {**base, **raw, "attention": attention}


@functools.lru_cache(maxsize=8)
def gpu_facts(kind: str, path: str = str(KERNELS)) -> GpuFacts:
    """The facts of GPU `kind`; a kind `like` another takes its fields and overrides some. A `kind`
    naming a .yaml file is a measured profile (`workbench calibrate --gpu`): the one GPU it holds."""
    if kind.endswith((".yaml", ".yml")):
        path = kind
        kind = next(iter(yaml.safe_load(Path(path).read_text())["gpus"]))
    gpus = yaml.safe_load(Path(path).read_text())["gpus"]
    if kind not in gpus:
        raise ValueError(f"kernels={kind!r} must be one of {', '.join(gpus)} (tuning/data/kernels.yaml)")
    raw = _fields(gpus, kind)
    attention: dict[str, AttentionTable] = {}
    tables = raw.get("attention") or {}
    for impl in sorted(tables, key=lambda name: "bwd_like" in tables[name]):  # a table another one is like first
        like = None
        if "bwd_like" in tables[impl]:
            other, other_impl = tables[impl]["bwd_like"]
            home = path if other in gpus else str(KERNELS)  # a measured profile's `like` is a kernels.yaml GPU
            like = attention[other_impl] if other == kind else gpu_facts(other, home).attention[other_impl]
        attention[impl] = _table(tables[impl], like)
    attention = {impl: attention[impl] for impl in tables}  # the file's order: the first is the fallback
    return GpuFacts(kind=kind, sms=int(raw["sms"]), gemm_efficiency=float(raw["gemm_efficiency"]),
                    tiles=tuple((int(a), int(b)) for a, b in raw["tiles"]), hbm_gb_s=float(raw["hbm_gb_s"]),
                    attention=attention, fp8_peak_tflops=float((raw.get("fp8") or {}).get("peak_tflops", 0.0)),
                    fp8_speedup=float((raw.get("fp8") or {}).get("speedup", 0.0)))


def quantisation(facts: GpuFacts, m: Any, n: Any, batch: Any = 1) -> np.ndarray:
    """Useful share of the tile slots of the best tile's waves (tile and wave quantisation), in (0, 1]."""
    m, n, batch = (np.asarray(x, dtype=float) for x in (m, n, batch))
    best = np.zeros(np.broadcast(m, n, batch).shape)
    for tm, tn in facts.tiles:
        tiles = np.ceil(m / tm) * np.ceil(n / tn) * batch
        slots = np.ceil(tiles / facts.sms) * facts.sms * tm * tn
        best = np.maximum(best, m * n * batch / slots)
    return best


def gemm_seconds(facts: GpuFacts, peak: float, m: Any, n: Any, k: Any, batch: Any = 1,
                 dtype_bytes: float = 2.0, fp8: bool = False) -> np.ndarray:
    """Seconds of `batch` GEMMs of an M x N output over K: compute at the quantised MAMF rate, or
    streaming the operands at the measured bandwidth, whichever is slower. `fp8`: an FP8 GEMM
    (`fp8_facts`' speedup over the 16-bit compute time; 1-byte operands, a 16-bit output)."""
    m, n, k, batch = (np.asarray(x, dtype=float) for x in (m, n, k, batch))
    compute = 2.0 * m * n * k * batch / (peak * facts.gemm_efficiency * quantisation(facts, m, n, batch))
    if fp8:
        compute = compute / fp8_facts(facts)[1]
        return np.maximum(compute, batch * (m * k + k * n + dtype_bytes * m * n) / (facts.hbm_gb_s * GB))
    memory = dtype_bytes * batch * (m * k + k * n + m * n) / (facts.hbm_gb_s * GB)
    return np.maximum(compute, memory)


def fp8_facts(facts: GpuFacts, cluster: str = "") -> tuple[float, float]:
    """(dense FP8 peak FLOP/s, FP8 / BF16 GEMM rate ratio) of this GPU; ValueError naming the GPU where
    kernels.yaml cites no FP8 rate for it (A100 has no FP8 tensor cores)."""
    if facts.fp8_speedup <= 0 or facts.fp8_peak_tflops <= 0:
        where = f" (cluster {cluster})" if cluster else ""
        raise ValueError(f"fp8=true: GPU {facts.kind!r}{where} has no FP8 GEMM rate in tuning/data/kernels.yaml "
                         "(FP8 tensor cores start with Hopper/Ada); use fp8=false")
    return facts.fp8_peak_tflops * 1e12, facts.fp8_speedup


def fwd_bwd_gemm_seconds(facts: GpuFacts, peak: float, m: Any, n: Any, k: Any,
                         fp8: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of a linear layer's GEMM (M x N over K): backward is the input
    gradient (M x K over N) and the weight gradient (K x N over M); `fp8`: all three in FP8 (Transformer
    Engine's fprop, dgrad and wgrad under its default recipe)."""
    return (gemm_seconds(facts, peak, m, n, k, fp8=fp8),
            gemm_seconds(facts, peak, m, k, n, fp8=fp8) + gemm_seconds(facts, peak, k, n, m, fp8=fp8))


def gemm_pairs(facts: GpuFacts, peak: float, shapes: list[tuple[Any, Any, Any]],
               fp8: bool = False) -> tuple[list, list]:
    """(forward, backward) seconds (`fwd_bwd_gemm_seconds`) of each (M, N, K) in `shapes`, one entry per
    shape, priced in one vectorised call (a search prices all its rows' GEMMs at once)."""
    cols = np.broadcast_arrays(*(np.asarray(x, dtype=float) for shape in shapes for x in shape))
    fwd, bwd = fwd_bwd_gemm_seconds(facts, peak, *(np.stack(cols[j::3]) for j in range(3)), fp8=fp8)
    return list(fwd), list(bwd)


def attention_impls(facts: GpuFacts) -> tuple[str, ...]:
    """The fused-attention kernels this GPU has measured rates for."""
    return tuple(facts.attention)


def fused_attention_seconds(facts: GpuFacts, impl: str, *, heads: Any, seq_q: Any, seq_k: Any, head_dim: int,
                            causal: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """(forward, backward) seconds of fused attention over `heads` (batch x heads) query blocks of
    `seq_q` tokens against `seq_k` keys, at the rate measured at `seq_k`; None when this GPU has no
    fused-attention measurement (priced as GEMMs). `impl` falls back to any measured kernel."""
    if not facts.attention:
        return None
    table = facts.attention.get(impl) or next(iter(facts.attention.values()))
    work = 4.0 * np.asarray(heads, dtype=float) * np.asarray(seq_q, dtype=float) * np.asarray(seq_k, dtype=float) \
        * head_dim * (0.5 if causal else 1.0)
    return (work / table.rate(head_dim, causal, "fwd", seq_k),
            2.5 * work / table.rate(head_dim, causal, "bwd", seq_k))


def memory_bandwidth(cluster: Any) -> float:
    """Bytes/s of memory-bound kernels: the GPU's measured streaming rate, or a CPU profile's own
    (`hbm_gb_s` x `hbm_efficiency`)."""
    if getattr(cluster, "kernels", ""):
        return gpu_facts(cluster.kernels).hbm_gb_s * GB
    return cluster.hbm_gb_s * cluster.hbm_efficiency * GB


__all__ = ["AttentionTable", "GpuFacts", "KERNELS", "attention_impls", "fp8_facts", "fused_attention_seconds",
           "fwd_bwd_gemm_seconds", "gemm_seconds", "gpu_facts", "memory_bandwidth", "quantisation"]
