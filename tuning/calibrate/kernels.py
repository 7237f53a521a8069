"""Single-process micro-benchmarks of this host for the simulator's CPU profile (`tuning.calibrate.calibration`):
GEMM rates at the engine's shapes, fused attention, the memory-bound kernels, few-token weight
streaming and the optimizer phase, each timed as the median of repeated batches of calls."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tuning.sim.hardware import table_rate


OPTIMIZER_BYTES_PER_PARAM = 28.0  # the simulator's AdamW traffic per parameter (simulator.py)

CALIBRATION_TOKENS = (64, 128, 256, 512, 1024, 2048)  # GEMM rows b*s swept by calibration

CALIBRATION_HIDDEN = (64, 128, 256)  # d_model values swept (the engine's range here)


@dataclass(kw_only=True, slots=True)
class HostProfile:
    """Single-process micro-benchmark results of this host (one thread, fp32)."""

    gemm_points: list[tuple[float, float]]  # (forward GEMM FLOPs, fwd+bwd FLOP/s), binned
    nongemm_gb_s: float  # LayerNorm + GELU + add, bytes read and written / s
    optimizer_gb_s: float  # AdamW: 28 bytes per parameter / seconds per parameter
    overheads: dict[str, float]  # overhead_layer_s, overhead_microbatch_s, overhead_step_s
    cpus: int  # cores this process may run on
    load1: float  # 1-minute load average when the measurement started
    measured_at: float = field(default_factory=time.time)  # Unix seconds
    parallel: dict[str, float] | None = None  # TP / FSDP per-layer overheads at 2 ranks (+ "share")
    p2p: tuple[float, float] | None = None  # send/recv (alpha s, GB/s) at 2 ranks
    shares: dict[int, float] = field(default_factory=dict)  # measured per-rank compute share by world size
    rank_overheads: dict[int, dict[str, float]] = field(default_factory=dict)  # multi-rank extras by world size
    attention_points: list[tuple[float, float]] = field(default_factory=list)  # (attention GEMM FLOPs, FLOP/s)
    weight_gb_s: float = 0.0  # few-row linear layers, fwd + bwd with gradient accumulation: 3 x weight bytes / s
    fsdp_links: dict[int, dict[str, float]] = field(default_factory=dict)  # FSDP's collectives in situ, by world size


def _time_call(fn: Callable[[], Any], *, min_time_s: float = 0.01, repeats: int = 3,
               sync: Callable[[], Any] = lambda: None) -> float:
    """Median seconds per call over `repeats` batches of calls lasting about `min_time_s` each;
    `sync` waits for the device (CUDA kernels return to the host at launch)."""
    fn()  # warm-up: allocation and kernel choice
    sync()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_time_s or calls < 1:
        fn()
        sync()
        calls += 1
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def _device_sync(device: str) -> Callable[[], Any]:
    import torch

    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def _bin_points(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge points into factor-2 FLOP bins: (geometric mean size, median rate) per bin."""
    bins: dict[int, list[tuple[float, float]]] = {}
    for flops, rate in points:
        bins.setdefault(round(float(np.log2(flops))), []).append((flops, rate))
    return [(float(np.exp(np.mean(np.log([f for f, _ in pts])))), statistics.median(r for _, r in pts))
            for _, pts in sorted(bins.items())]


def measure_linear_gemms(*, tokens: Sequence[int] = CALIBRATION_TOKENS,
                         hiddens: Sequence[int] = CALIBRATION_HIDDEN, vocab: int = 256,
                         mlp_ratio: int = 4, device: str = "cpu",
                         dtype: str = "float32") -> list[tuple[float, float]]:
    """Rates of the engine's linear-layer GEMMs: y = x W^T, dx = dy W, dW = dy^T x (fp32 on the
    CPU; `device`/`dtype` time them elsewhere, e.g. "cuda" and "bfloat16").

    Shapes: rows M = b*s tokens, (K, N) = (h, h), (h, 4h), (4h, h) and (h, V), as in the GPT
    blocks and the tied head. Returns (forward FLOPs 2MKN, 3 x 2MKN / time of the three GEMMs),
    binned by size: the simulator prices backward as twice forward at the same rate.
    """
    import torch

    like, sync = {"device": device, "dtype": getattr(torch, dtype)}, _device_sync(device)
    points = []
    for h in hiddens:
        for rows in tokens:
            for k, n in ((h, h), (h, mlp_ratio * h), (mlp_ratio * h, h), (h, vocab)):
                x, w, dy = torch.randn(rows, k, **like), torch.randn(n, k, **like), torch.randn(rows, n, **like)
                seconds = _time_call(lambda: (x @ w.T, dy @ w, dy.T @ x), sync=sync)
                flops = 2.0 * rows * k * n
                points.append((flops, 3.0 * flops / seconds))
    return _bin_points(points)


def measure_attention(*, hiddens: Sequence[int] = CALIBRATION_HIDDEN, heads: int = 4,
                      seqs: Sequence[int] = (32, 64, 128, 256), batches: Sequence[int] = (1, 4, 16),
                      max_tokens: int = 4096, device: str = "cpu",
                      dtype: str = "float32") -> list[tuple[float, float]]:
    """Rates of the engine's attention: causal `scaled_dot_product_attention`, forward + backward
    (fp32 on the CPU; `device`/`dtype` time it elsewhere).

    The simulator prices attention as two GEMMs of 2 b s^2 h FLOPs each (Q K^T, scores x V), run
    once forward, twice backward and Q K^T once more (the fused backward recomputes it), 7 x
    2 b s^2 h in all. Returns (2 b s^2 h, 7 x 2 b s^2 h / time), binned by size: the softmax, the
    causal mask and the kernel's small head dims are in the rate, not in extra terms.
    """
    import torch
    import torch.nn.functional as F

    like, sync = {"device": device, "dtype": getattr(torch, dtype)}, _device_sync(device)
    points = []
    for h in hiddens:
        for s in seqs:
            for b in (b for b in batches if b * s <= max_tokens):
                q, k, v = (torch.randn(b, heads, s, h // heads, requires_grad=True, **like) for _ in range(3))
                dy = torch.randn(b, heads, s, h // heads, **like)

                def step() -> None:
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dy)

                seconds = _time_call(step, sync=sync)
                flops = 2.0 * b * s * s * h
                points.append((flops, 7.0 * flops / seconds))
    return _bin_points(points)


def measure_nongemm_bandwidth(*, elements: Sequence[int] = (1 << 15, 1 << 17, 1 << 19),
                              width: int = 128) -> float:
    """GB/s of the memory-bound kernels of a block: LayerNorm, GELU and the residual add (fp32).

    Bytes count each tensor read and written once: 8 per element for LayerNorm and GELU, 12
    for the add. Median over activation sizes spanning the engine's (b*s*h).
    """
    import torch
    import torch.nn.functional as F

    rates = []
    for n in elements:
        x, y = torch.randn(n // width, width), torch.randn(n // width, width)
        seconds = _time_call(lambda: (F.layer_norm(x, (width,)), F.gelu(x), x + y))
        rates.append(28.0 * n / seconds / 1e9)
    return statistics.median(rates)


def measure_weight_stream(*, hiddens: Sequence[int] = (512, 1024), rows: Sequence[int] = (1, 4),
                          blocks: int = 2, micro: int = 4, repeats: int = 5) -> float:
    """GB/s at which the engine's linear layers stream their weights when a micro-batch has only a
    few tokens (the regime where the simulator's roofline floor binds, not the FLOP rate).

    `blocks` blocks' weights (h x 3h, h x h, h x 4h, 4h x h each; with their gradients more than a
    32 MB last-level cache, as a model whose floor binds has) as parameters, `micro` micro-batches
    of `rows` tokens through `F.linear` forward and backward, gradients set to None once per step
    and accumulated over the micro-batches, as the engine trains. Counted as 3 x the weight bytes per
    micro-batch (forward reads W, backward reads W for dx and produces dW), so the rate includes what
    that count leaves out: the fresh dW buffers and the accumulation's read-modify-write (on this host
    5-9 GB/s where LayerNorm/GELU stream at 11-17). Median over `hiddens` x `rows`.
    """
    import torch
    import torch.nn.functional as F

    rates = []
    for h in hiddens:
        shapes = [(h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)] * blocks
        weights = [torch.nn.Parameter(torch.randn(n, k) * 0.02) for k, n in shapes]
        for m in rows:
            inputs = [torch.randn(m, w.shape[1], requires_grad=True) for w in weights]

            def step() -> None:
                for w in weights:
                    w.grad = None
                for _ in range(micro):
                    sum(F.linear(x, w).sum() for x, w in zip(inputs, weights)).backward()

            seconds = _time_call(step, min_time_s=0.0, repeats=repeats)
            rates.append(3.0 * 4 * sum(w.numel() for w in weights) * micro / seconds / 1e9)
    return statistics.median(rates)


def measure_optimizer_rate(*, sizes: Sequence[int] = (1 << 18, 1 << 20, 1 << 21), tensors: int = 8) -> float:
    """Effective GB/s of the engine's optimizer phase on fp32 parameters, counted as 28 bytes per
    parameter: the gradient clipping the engine runs before every step (`clip_grad_norm`, max norm
    1.0: the norm reads every gradient, the scale reads and writes it) and the step of the engine's
    AdamW (`engine.parallel.zero.build_optimizer`: fused where torch has the kernel).

    The slope of the phase's time over parameter count (least squares over `sizes`) gives the per-
    parameter cost; the per-tensor constant is left to the overhead fit.
    """
    import torch

    from engine.parallel.data import clip_grad_norm
    from engine.parallel.zero import build_optimizer

    times = []
    for total in sizes:
        params = [torch.nn.Parameter(torch.randn(total // tensors)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = build_optimizer(params, stage=0, lr=1e-3)

        def phase() -> None:
            clip_grad_norm(params, 1.0)  # random gradients: norm far above 1, so the scale runs
            opt.step()

        times.append(_time_call(phase, min_time_s=0.02))
    slope = float(np.polyfit(np.asarray(sizes, dtype=float), np.asarray(times), 1)[0])
    slope = slope if slope > 0 else times[-1] / sizes[-1]
    return OPTIMIZER_BYTES_PER_PARAM / slope / 1e9


def speed_index(host: HostProfile, *, tokens: Sequence[int] = (256, 1024), hiddens: Sequence[int] = (64, 128, 256)) -> float:
    """This host's speed now relative to when `host` was measured: the median over a few of the
    calibration's GEMM shapes of (rate now / calibrated rate at that size), about 1.5 s.

    On a shared VM the same single-thread GEMMs ran 10-25% slower a few minutes after a calibration
    (2026-11-23, load 1, nothing else of ours running): `compare_measured` records this index
    before every run so the model's error can be told apart from the machine's drift."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        now = measure_linear_gemms(tokens=tokens, hiddens=hiddens)
    finally:
        torch.set_num_threads(threads)
    then = table_rate(host.gemm_points, [f for f, _ in now])
    return float(np.median([r / t for (_, r), t in zip(now, then)]))
