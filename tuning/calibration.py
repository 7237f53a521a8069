"""Calibrate the simulator on this machine (CPU, gloo) and map engine run configs onto it.

`calibrate_local(world)` measures what the simulator's CPU model needs with micro-benchmarks
only: GEMM rates at the engine's shapes (forward + both backward GEMMs of a linear layer), the
bandwidth of the memory-bound kernels (LayerNorm, GELU, residual add), the AdamW step rate, a
gloo all-reduce alpha-beta fit, and the framework overhead (eager dispatch and autograd) fitted
from tiny in-process training runs of the engine's model (d_model 32, seq 16) that are not in
the validation set. `predict_run(cfg, cluster)` prices an engine `RunConfig` on that profile:
fp32 (4 bytes), one "GPU" per rank, one node. `compare_measured` launches real runs and
returns the simulated-vs-measured table (bench/simulator.py prints it, docs/simulator.md
records it). No parameter is ever fitted to the validation configs.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tuning.hardware import ClusterSpec, cpu_profile, fit_alpha_beta, table_rate
from tuning.simulator import SimResult, from_run_config, simulate

if TYPE_CHECKING:
    import pandas as pd

OPTIMIZER_BYTES_PER_PARAM = 28.0  # the simulator's AdamW traffic per parameter (simulator.py)
CALIBRATION_TOKENS = (64, 128, 256, 512, 1024, 2048)  # GEMM rows b*s swept by calibration
CALIBRATION_HIDDEN = (64, 128, 256)  # d_model values swept (the engine's range here)
OVERHEAD_RUNS = ((1, 1), (3, 1), (1, 3), (3, 3))  # (layers, micro-batches) of the tiny fit runs


BASE_OVERRIDES: list[str] = [
    "train.steps=32", "profile.warmup_steps=2", "profile.host_interval_s=0", "profile.nvml_interval_s=0",
    "train.eval_interval=0", "data.source=synthetic", "train.warmup_steps=0",
]
"""Overrides every validation run shares: 32 steps (2 warm-up + 30 steady; on 2 shared cores the
median of 6 steady steps moved by 10-30% between rounds), samplers and eval off."""

VALIDATION_CONFIGS: dict[str, list[str]] = {
    "1r l2 d64 s64 b8/m4": ["model.layers=2", "model.d_model=64", "model.seq_len=64",
                            "batch.global=8", "batch.micro=4"],
    "1r l4 d256 s128 b8/m8": ["model.layers=4", "model.d_model=256", "model.seq_len=128",
                              "batch.global=8", "batch.micro=8"],
    "1r l3 d128 s128 b16/m4": ["model.layers=3", "model.d_model=128", "model.seq_len=128",
                               "batch.global=16", "batch.micro=4"],
    "dp2 l4 d128 s64 b16/m8": ["parallel.dp=2", "model.layers=4", "model.d_model=128", "model.seq_len=64",
                               "batch.global=16", "batch.micro=8"],
    "dp2 l2 d256 s128 b16/m4": ["parallel.dp=2", "model.layers=2", "model.d_model=256", "model.seq_len=128",
                                "batch.global=16", "batch.micro=4"],
    "tp2 l4 d128 s64 b8/m4": ["parallel.tp=2", "model.layers=4", "model.d_model=128", "model.seq_len=64",
                              "batch.global=8", "batch.micro=4"],
    "pp2 1f1b l4 d128 s128 b16/m4": ["parallel.pp=2", "parallel.schedule=1f1b", "model.layers=4",
                                     "model.d_model=128", "model.seq_len=128", "batch.global=16",
                                     "batch.micro=4"],
    "pp2 gpipe l4 d128 s64 b8/m2": ["parallel.pp=2", "parallel.schedule=gpipe", "model.layers=4",
                                    "model.d_model=128", "model.seq_len=64", "batch.global=8",
                                    "batch.micro=2"],
    "zero1 dp2 l4 d128 s64 b16/m8": ["parallel.dp=2", "parallel.zero=1", "model.layers=4",
                                     "model.d_model=128", "model.seq_len=64", "batch.global=16",
                                     "batch.micro=8"],
    "zero3 dp2 l2 d128 s128 b8/m4": ["parallel.dp=2", "parallel.zero=3", "model.layers=2",
                                     "model.d_model=128", "model.seq_len=128", "batch.global=8",
                                     "batch.micro=4"],
    "dp4 l2 d128 s64 b16/m4": ["parallel.dp=4", "model.layers=2", "model.d_model=128", "model.seq_len=64",
                               "batch.global=16", "batch.micro=4"],
    "dp2 tp2 l4 d128 s64 b16/m4": ["parallel.dp=2", "parallel.tp=2", "model.layers=4", "model.d_model=128",
                                   "model.seq_len=64", "batch.global=16", "batch.micro=4"],
    "pp4 1f1b l4 d64 s64 b16/m2": ["parallel.pp=4", "parallel.schedule=1f1b", "model.layers=4",
                                   "model.d_model=64", "model.seq_len=64", "batch.global=16",
                                   "batch.micro=2"],
    "dp2 pp2 l4 d128 s64 b16/m4": ["parallel.dp=2", "parallel.pp=2", "model.layers=4", "model.d_model=128",
                                   "model.seq_len=64", "batch.global=16", "batch.micro=4"],
}


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


def _tiny_overrides(layers: int, microbatches: int) -> list[str]:
    """A calibration run of the engine's model where compute is small next to dispatch."""
    return ["model.layers=%d" % layers, "model.d_model=32", "model.heads=4", "model.seq_len=16",
            "batch.micro=1", "batch.global=%d" % microbatches, "train.steps=24", "data.source=synthetic",
            "profile.host_interval_s=0", "profile.nvml_interval_s=0", "train.eval_interval=0"]


def measure_overheads(base: ClusterSpec, *, runs: Sequence[tuple[int, int]] = OVERHEAD_RUNS) -> dict[str, float]:
    """Fit the framework overhead from tiny in-process training runs of the engine (1 rank).

    Each run's median steady step time minus what `base` (no overheads) predicts for it is the
    host-side time; least squares over the runs fits residual = step + m (microbatch + l layer)
    with l layers and m micro-batches (negative terms are dropped and the rest refitted).
    """
    import torch

    from engine.config import load_config
    from engine.train import Trainer

    rows, residuals = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread per rank, as the launcher runs them
    try:
        for layers, mbs in runs:
            cfg = load_config(None, _tiny_overrides(layers, mbs))
            steps = [m.step_time_s for m in Trainer(cfg, device=torch.device("cpu")).run()]
            measured = statistics.median(steps[2:])
            residuals.append(measured - predict_run(cfg, base).iteration_time_s)
            rows.append([1.0, mbs, mbs * layers])
    finally:
        torch.set_num_threads(threads)
    names = ["overhead_step_s", "overhead_microbatch_s", "overhead_layer_s"]
    a, r = np.asarray(rows, dtype=float), np.asarray(residuals)
    keep = list(range(3))
    while True:
        coef = np.linalg.lstsq(a[:, keep], r, rcond=None)[0]
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    out = dict.fromkeys(names, 0.0)
    out.update({names[k]: max(float(c), 0.0) for k, c in zip(keep, coef)})
    return out


def measure_host(progress: Callable[[str], None] = lambda _: None) -> HostProfile:
    """Run every single-process micro-benchmark (about 10 s on an idle 2-core host); `progress`
    hears the name of each one as it starts."""
    import torch

    load1 = os.getloadavg()[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        progress("GEMMs at the engine's shapes")
        gemm = measure_linear_gemms()
        progress("attention at the engine's shapes")
        attention = measure_attention()
        progress("memory-bound ops")
        nongemm = measure_nongemm_bandwidth()
        progress("optimizer rate (clip + AdamW)")
        optimizer = measure_optimizer_rate()
        progress("weight streaming of few-token linear layers")
        weight = measure_weight_stream()
    finally:
        torch.set_num_threads(threads)
    host = HostProfile(gemm_points=gemm, nongemm_gb_s=nongemm, optimizer_gb_s=optimizer,
                       overheads={}, cpus=len(os.sched_getaffinity(0)), load1=load1, attention_points=attention,
                       weight_gb_s=weight)
    base = _profile(host, world=1, allreduce=(0.0, 1.0), overheads=False)
    progress("framework overhead (tiny runs)")
    host.overheads = measure_overheads(base)
    return host


IN_SITU_WORK_S = 0.005  # host compute before each timed collective (`commbench(work_s=...)`)


def measure_allreduce(world: int, *, max_bytes: int = 16 << 20, iters: int = 20, repeats: int = 3,
                      work_s: float = IN_SITU_WORK_S) -> tuple[float, float]:
    """(alpha s, busbw GB/s) of gloo all_reduce over `world` processes (commbench, relative fit).

    Timed in situ: every call follows `work_s` of compute on each rank, as in a training step, and
    the compute's own time is subtracted. Back to back, the ranks stay in lockstep and the gloo
    threads awake; after compute they are not: on this 2-core host a small all-reduce cost 2-4 ms
    in situ against 1-2 ms back to back, and the engine's runs saw about 2 ms per tensor-parallel
    all-reduce and 3.4 ms per FSDP2 collective. The per-size median over `repeats` spawns is fitted
    (each in-situ time is a difference of two noisy loops). `work_s=0`: the back-to-back loop.
    """
    from profilers.collectives import bus_factor

    return _fit_in_situ("all_reduce", world, bus_factor("all_reduce", world), max_bytes=max_bytes, iters=iters,
                        repeats=repeats, work_s=work_s)


def measure_p2p(*, max_bytes: int = 4 << 20, iters: int = 20, repeats: int = 3,
                work_s: float = IN_SITU_WORK_S) -> tuple[float, float]:
    """(alpha s, GB/s) of a gloo send/recv between 2 processes: what a pipeline stage boundary costs.
    In situ, as `measure_allreduce` (back to back the alpha came out anywhere in 0.2-2.4 ms)."""
    return _fit_in_situ("sendrecv", 2, 1.0, max_bytes=max_bytes, iters=iters, repeats=repeats, work_s=work_s)


def measure_fsdp_collectives(world: int, *, max_bytes: int = 4 << 20, iters: int = 20, repeats: int = 3,
                             work_s: float = IN_SITU_WORK_S) -> dict[str, float]:
    """FSDP's two collectives at `world` ranks, in situ as `measure_allreduce`: the `ClusterSpec` fields
    (alpha s, busbw GB/s) of all_gather_into_tensor and reduce_scatter_tensor. On gloo they are not the
    all-reduce: at 2 ranks a 1 MB reduce-scatter cost 4.2 ms where the 1 MB all-reduce (twice the bus bytes)
    cost 3.0 ms, and the engine's ZeRO-3 runs recorded about 3.4 ms per FSDP2 collective."""
    from profilers.collectives import bus_factor

    out = {}
    for op, key in (("all_gather", "allgather"), ("reduce_scatter", "reduce_scatter")):
        alpha, busbw = _fit_in_situ(op, world, bus_factor(op, world), max_bytes=max_bytes, iters=iters,
                                    repeats=repeats, work_s=work_s)
        out.update({f"{key}_latency_s": alpha, f"{key}_bw_gb_s": busbw})
    return out


def _fit_in_situ(op: str, world: int, factor: float, *, max_bytes: int, iters: int, repeats: int,
                 work_s: float) -> tuple[float, float]:
    """(alpha s, GB/s) of `op` at `world` ranks: the per-size median over `repeats` commbench
    spawns (`work_s` of compute before each call), fitted on relative error."""
    from profilers.collectives import spawn_commbench, sweep_sizes

    samples: dict[int, list[float]] = {}
    for _ in range(repeats):
        for r in spawn_commbench(world, [op], sweep_sizes(4096, max_bytes, 4), iters, work_s=work_s):
            samples.setdefault(r["size"], []).append(r["time(s)"])
    sizes = sorted(samples)
    return fit_alpha_beta(sizes, [max(statistics.median(samples[n]), 1e-5) for n in sizes], factor, relative=True)


def measure_parallel_overheads(profile: ClusterSpec, *, layers: tuple[int, int] = (1, 3),
                               microbatches: int = 4) -> dict[str, float]:
    """Extra host time per layer and micro-batch of tensor parallelism (DTensor dispatch) and of
    FSDP2 (ZeRO-2/3 hooks), from tiny 2-rank runs of the engine (d_model 32, seq 16: dispatch
    dominates): the growth of (measured - predicted) step time from `layers[0]` to `layers[1]`
    layers, divided by the added layer-micro-batches. `profile` is the 2-rank profile without them.
    """
    from engine.config import load_config

    out = {}
    for key, extra in (("overhead_tp_layer_s", ["parallel.tp=2"]),
                       ("overhead_fsdp_layer_s", ["parallel.dp=2", "parallel.zero=3"])):
        residual = _tiny_residuals(profile, layers, microbatches * (2 if "parallel.dp=2" in extra else 1), extra)
        out[key] = max(0.0, layer_growth(layers, residual, microbatches)[0])
    return out


def _tiny_residuals(profile: ClusterSpec, layers: Sequence[int], global_batch: int, extra: list[str]) -> list[float]:
    """Measured minus predicted step time of tiny launched runs with `layers[i]` layers."""
    from engine.config import load_config

    residual = []
    for n in layers:
        cfg = load_config(None, _tiny_overrides(n, global_batch) + extra)
        residual.append(measure_run(cfg)["step_time_s"] - predict_run(cfg, profile).iteration_time_s)
    return residual


def layer_growth(layers: Sequence[int], residuals: Sequence[float], microbatches: int) -> tuple[float, float]:
    """(per layer and micro-batch, per step) seconds from the residuals of runs with two layer counts:
    the slope over the added layer-micro-batches, and what is left at zero layers (the intercept)."""
    per_layer = (residuals[1] - residuals[0]) / ((layers[1] - layers[0]) * microbatches)
    return per_layer, residuals[0] - per_layer * layers[0] * microbatches


def measure_rank_overheads(profile: ClusterSpec, world: int, *, layers: tuple[int, int] = (1, 3),
                           microbatches: int = 4) -> dict[str, float]:
    """Host time a launched `world`-rank data-parallel run spends beyond the 1-rank in-process model,
    from tiny dp=`world` runs (d_model 32, seq 16, `microbatches` per rank, `layers` layers; `profile`
    without these terms prices them): per step (DDP bucket copies, the loss all-reduce, the launcher's
    and gloo's threads on the same cores, per-step bookkeeping of a launched rank) and per layer and
    micro-batch (DDP's per-parameter autograd hooks). Negative parts are 0 (ours: an intercept/slope
    split of two runs, as `measure_parallel_overheads`)."""
    residual = _tiny_residuals(profile, layers, microbatches * world, [f"parallel.dp={world}"])
    per_layer, per_step = layer_growth(layers, residual, microbatches)
    return {"overhead_rank_layer_s": max(0.0, per_layer), "overhead_rank_step_s": max(0.0, per_step)}


def _profile(host: HostProfile, *, world: int, allreduce: tuple[float, float], share: float = 1.0,
             overheads: bool = True, rank: dict[str, float] | None = None) -> ClusterSpec:
    # Ranks time-share the cores (with each other and with other users): each rank's compute
    # and host-side work runs at `share` of the single-process rate (measure_rate_share). `rank`
    # adds what a launched multi-rank run costs beyond that (measure_rank_overheads, already at world).
    ovh = {k: v / share for k, v in host.overheads.items()} if overheads else {}
    if overheads and rank:
        ovh["overhead_step_s"] = ovh.get("overhead_step_s", 0.0) + rank.get("overhead_rank_step_s", 0.0)
        ovh["overhead_layer_s"] = ovh.get("overhead_layer_s", 0.0) + rank.get("overhead_rank_layer_s", 0.0)
    return cpu_profile(
        name=f"cpu-local-{world}", gemm_points=[(f, r * share) for f, r in host.gemm_points],
        attention_points=[(f, r * share) for f, r in host.attention_points],
        intra=allreduce, gpus_per_node=world, memory_gb=_memory_gb() / world,
        hbm_gb_s=host.nongemm_gb_s * share, weight_stream_gb_s=host.weight_gb_s * share,
        overheads={**ovh, "optimizer_gb_s": host.optimizer_gb_s * share},
    )


def _check_load(profile: ClusterSpec, host: HostProfile, world: int, share: float) -> ClusterSpec:
    """Measure each rank's real CPU share, record it with the load, warn when the host is busy."""
    import warnings

    measured = measure_cpu_share(world) / max(measure_cpu_share(1), 1e-9)
    even = cpu_share(world, cpus=host.cpus, background=host.load1 - 1.0)  # what a quiet host should give
    reason = busy_reason(load1=host.load1, cpus=host.cpus, measured_share=min(measured, 1.0), model_share=even)
    if reason:
        warnings.warn(f"calibration on a busy machine: {reason}; rerun `workbench calibrate` when it is quiet",
                      RuntimeWarning, stacklevel=3)
    return dataclasses.replace(profile, calibration_load1=host.load1, calibration_cpu_share=min(measured, 1.0))


def _memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError):
        return 8.0


def calibrate_local(world: int, *, host: HostProfile | None = None,
                    allreduce: tuple[float, float] | None = None, share: float | None = None,
                    parallel: bool = True, progress: Callable[[str], None] = lambda _: None) -> ClusterSpec:
    """A `cpu-local-{world}` profile: `world` ranks ("GPUs") on this one node, fp32 rates.

    Measures what is not given: the host (`measure_host`) and the gloo all-reduce at `world`
    ranks (`measure_allreduce`; unused at world 1). The compute share per rank is measured with
    `world` processes running the engine's kernel mix together (`measure_rate_share`); tiny launched
    data-parallel runs add the multi-rank per-step and per-layer host time (`measure_rank_overheads`).
    """
    if world < 1:
        raise ValueError(f"world={world} must be >= 1")
    host = host or measure_host(progress)  # `progress` hears each measurement's name as it starts
    if allreduce is None and world > 1:
        progress(f"gloo all-reduce at {world} ranks")
    if allreduce is None:
        allreduce = measure_allreduce(world) if world > 1 else (0.0, 1.0)
    if share is None:
        share = _measured_share(host, world, progress)
    profile = _profile(host, world=world, allreduce=allreduce, share=share)
    if world > 1 and parallel:
        if world not in host.rank_overheads:
            progress(f"multi-rank step overhead (tiny {world}-rank runs)")
            host.rank_overheads[world] = measure_rank_overheads(profile, world)
        profile = _profile(host, world=world, allreduce=allreduce, share=share, rank=host.rank_overheads[world])
    profile = _check_load(profile, host, world, share)
    if world == 1 or not parallel:
        return profile
    if host.parallel is None:  # measured once at 2 ranks, scaled to `world` by the CPU share
        two_ar = allreduce if world == 2 else measure_allreduce(2)
        two_share_ = _measured_share(host, 2, progress)
        if 2 not in host.rank_overheads:
            progress("multi-rank step overhead (tiny 2-rank runs)")
            host.rank_overheads[2] = measure_rank_overheads(_profile(host, world=2, allreduce=two_ar,
                                                                     share=two_share_), 2)
        two = _profile(host, world=2, allreduce=two_ar, share=two_share_, rank=host.rank_overheads[2])
        two = dataclasses.replace(two, **_fsdp_links(host, 2, progress))
        progress("tensor-parallel and FSDP dispatch, pipeline sends (2-rank runs)")
        host.parallel = {**measure_parallel_overheads(two), "share": two_share_}
        host.p2p = measure_p2p()
    scale = host.parallel["share"] / share
    return dataclasses.replace(
        profile, **_fsdp_links(host, world, progress), overhead_tp_layer_s=host.parallel["overhead_tp_layer_s"] * scale,
        overhead_fsdp_layer_s=host.parallel["overhead_fsdp_layer_s"] * scale,
        p2p_latency_s=host.p2p[0], p2p_bw_gb_s=host.p2p[1] * share)


def _fsdp_links(host: HostProfile, world: int, progress: Callable[[str], None]) -> dict[str, float]:
    """FSDP's all-gather and reduce-scatter alpha-beta at `world` ranks, measured once per host profile."""
    if world not in host.fsdp_links:
        progress(f"gloo all-gather and reduce-scatter at {world} ranks")
        host.fsdp_links[world] = measure_fsdp_collectives(world)
    return host.fsdp_links[world]


def _measured_share(host: HostProfile, world: int, progress: Callable[[str], None]) -> float:
    """The per-rank compute share at `world` ranks, measured once per host profile (1.0 at one rank),
    made consistent with the shares measured at the profile's other world sizes (`consistent_shares`)."""
    if world not in host.shares:
        if world > 1:
            progress(f"per-rank compute share ({world} processes together)")
        host.shares[world] = measure_rate_share(world)
    return consistent_shares(host.shares)[world]


def consistent_shares(shares: Mapping[int, float]) -> dict[int, float]:
    """Measured per-rank shares by world size, each raised to what a larger world's measurement
    implies (ours): `w` ranks on the cores that `v > w` ranks shared get at least the throughput the
    `v` ranks got together, so share(w) >= min(1, v * share(v) / w). One measurement is a ~10 s
    sample of a host whose phases last longer: on a quiet host here 2 ranks measured 0.98, 0.91 and
    0.52 back to back, and a calibration measured 0.55 at 2 ranks beside 0.50 at 4 (4 x 0.50 = 2.0
    cores of throughput, so 2 ranks get 1.0 each); 6 of its 7 world-2 runs were priced too slow."""
    return {w: max(s, min(1.0, max([v * shares[v] / w for v in shares if v > w], default=0.0)))
            for w, s in shares.items()}


def _spin(seconds: float, barrier: Any, out: Any) -> None:
    """Worker of measure_cpu_share: busy-loop for `seconds` of wall time, report (cpu s, wall s)."""
    barrier.wait()
    t0, c0, x = time.perf_counter(), time.process_time(), 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(2000):
            x += 1
    out.put((time.process_time() - c0, time.perf_counter() - t0))


def measure_cpu_share(world: int, *, seconds: float = 0.5) -> float:
    """Median share of a core that each of `world` concurrent busy processes really got.

    CPU time over wall time of `world` processes started together (one in-process at world 1): on
    a quiet 2-core host 1.0 up to 2 processes; under other users' load it drops. Calibration compares
    it with the even-share model (`cpu_share`) and warns when they disagree or the host is busy.
    """
    import multiprocessing as mp

    if world == 1:
        ctx_queue: Any = __import__("queue").Queue()
        _spin(seconds, type("NoBarrier", (), {"wait": staticmethod(lambda: None)})(), ctx_queue)
        cpu, wall = ctx_queue.get()
        return min(1.0, cpu / wall)
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=_spin, args=(seconds, barrier, out)) for _ in range(world)]
    for p in procs:
        p.start()
    shares = [min(1.0, cpu / wall) for cpu, wall in (out.get(timeout=120) for _ in procs)]
    for p in procs:
        p.join(timeout=30)
    return statistics.median(shares)


def _kernel_worker(inbox: Any, out: Any) -> None:
    """Worker of measure_rate_share: the engine's kernel mix (a linear layer's three GEMMs, LayerNorm,
    GELU, an add) on one thread. Each message (loops, start_at) runs it `loops` times from `start_at`
    and reports the (start, end) perf_counter (CLOCK_MONOTONIC: one clock for every process on the host);
    None ends the worker."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    x, w, dy = torch.randn(512, 128), torch.randn(512, 128), torch.randn(512, 512)

    def step() -> None:
        x @ w.T, dy @ w, dy.T @ x, F.layer_norm(dy, (512,)), F.gelu(dy), dy + dy

    for _ in range(3):
        step()  # warm-up
    out.put(None)  # ready
    while (msg := inbox.get()) is not None:
        loops, start_at = msg
        time.sleep(max(0.0, start_at - time.perf_counter()))
        t0 = time.perf_counter()
        for _ in range(loops):
            step()
        out.put((t0, time.perf_counter()))


def lockstep_rate(loops: int, spans: Sequence[tuple[float, float]]) -> float:
    """Rate of ranks that each ran `loops` in their (start, end) spans, as ranks in lockstep see it:
    every rank waits for the last, so the work takes from the first start to the last end. Each rank's
    own window would overstate it: one scheduled late runs alone at the end (seen: 179 against 66-108
    loops/s at 4 ranks on 2 cores, a median share of 0.81 above the cores' 0.5)."""
    return loops / (max(end for _, end in spans) - min(start for start, _ in spans))


def rate_share(alone: Sequence[float], together: Sequence[float], *, world: int, cpus: int) -> float:
    """Throughput share of each concurrent rank: the median over paired repeats of (rate of the ranks
    run together / rate of one process alone just before), at most min(1, cpus / world): `world`
    one-thread ranks cannot get more than the cores. Pairs cancel the host's drift between repeats
    (one process alone ran at 89-204 loops/s within two minutes here). Unlike the even-share model it
    includes what busy loops do not see: cores that are hardware threads of one physical core, shared
    caches and memory bandwidth, and the load of other users at that moment."""
    ratios = [t / a for a, t in zip(alone, together, strict=True)]
    return min(1.0, cpus / world, statistics.median(ratios))


def measure_rate_share(world: int, *, seconds: float = 0.5, repeats: int = 8) -> float:
    """Measured per-rank compute share at `world` ranks (`rate_share`): `world` workers started once;
    in each of `repeats` pairs, one runs the kernel mix alone, then all run it together, timed in
    lockstep (`lockstep_rate`), each a fixed amount of work: about `seconds` alone. 1.0 at world 1."""
    import multiprocessing as mp

    if world == 1:
        return 1.0
    ctx = mp.get_context("spawn")
    inboxes, out = [ctx.Queue() for _ in range(world)], ctx.Queue()
    procs = [ctx.Process(target=_kernel_worker, args=(inbox, out), daemon=True) for inbox in inboxes]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            out.get(timeout=300)

        def rate(ranks: int, loops: int) -> float:
            start_at = time.perf_counter() + 0.05
            for inbox in inboxes[:ranks]:
                inbox.put((loops, start_at))
            return lockstep_rate(loops, [out.get(timeout=300) for _ in range(ranks)])

        loops = max(20, round(rate(1, 30) * seconds))  # size the work on this host's speed
        alone, together = [], []
        for _ in range(repeats):
            alone.append(rate(1, loops))
            together.append(rate(world, loops))
    finally:
        for inbox in inboxes:
            inbox.put(None)
        for p in procs:
            p.join(timeout=30)
    return rate_share(alone, together, world=world, cpus=len(os.sched_getaffinity(0)))


def busy_reason(*, load1: float, cpus: int, measured_share: float, model_share: float) -> str | None:
    """Why this host is too busy for a trustworthy calibration, or None.

    Busy: other users' load (the 1-min load minus our own calibration process) above half the
    cores, or the measured per-rank CPU share more than 25% away from the even-share model.
    """
    background = load1 - 1.0
    if background > 0.5 * cpus:
        return (f"load1={load1:.1f} on {cpus} cpus: other processes hold the cores; calibrated rates will "
                f"not match a quiet machine (each rank measured {measured_share:.2f} of a core)")
    if abs(measured_share - model_share) > 0.25 * model_share:
        return (f"each rank got {measured_share:.2f} of its share of a core, the even-share model expects "
                f"{model_share:.2f}: the machine's load changed while calibrating")
    return None


def two_share(host: HostProfile) -> float:
    return cpu_share(2, cpus=host.cpus, background=host.load1 - 1.0)


def predict_run(cfg: Any, cluster: ClusterSpec) -> SimResult:
    """Simulate one engine `RunConfig` on `cluster`: one "GPU" per rank, fp32 unless bf16."""
    model, par = from_run_config(cfg.to_dict())
    return simulate(model, cluster, par, gpus=cfg.world_size)


def cpu_share(world: int, *, cpus: int, background: float) -> float:
    """Compute share of each of `world` ranks relative to the single calibration process.

    Runnable tasks share the cores evenly (the Linux CFS ideal): with `background` tasks of
    other users, a process gets min(1, cpus / (background + n)) of a core when n of ours run.
    The host was measured with n = 1, the ranks run with n = world.
    """
    def alone(n: int) -> float:
        return min(1.0, cpus / (max(background, 0.0) + n))

    return alone(world) / alone(1)


def measure_run(cfg: Any, *, home: str | Path | None = None) -> dict[str, Any]:
    """Launch one real run; its median steady step time (s), every step time and the load."""
    from engine.launch import launch

    load1 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="calib-") as tmp:
        result = launch(cfg, home=home or tmp)
    return {"step_time_s": float(result.summary["step_time_s"]),
            "steps": [s["step_time_s"] for s in result.steps], "load1": load1}


CHECK_THRESHOLD = 0.25  # a calibration whose check run is off by more is not saved (`workbench calibrate`)
CHECK_STEPS = 20  # steps of that check run


def check_overrides(world: int) -> list[str]:
    """The short real run a calibration is checked against: data parallel over `world` ranks, 3 layers,
    d_model 64, seq 32, 2 micro-batches of 2 per rank, `CHECK_STEPS` steps (not one of `VALIDATION_CONFIGS`)."""
    return ["model.layers=3", "model.d_model=64", "model.heads=4", "model.seq_len=32", "batch.micro=2",
            f"batch.global={4 * world}", f"parallel.dp={world}", f"train.steps={CHECK_STEPS}", "data.source=synthetic",
            "profile.host_interval_s=0", "profile.nvml_interval_s=0", "train.eval_interval=0",
            "train.warmup_steps=0"]


def check_error(*, predicted_s: float, measured_s: float, threshold: float = CHECK_THRESHOLD) -> dict[str, Any]:
    """The check's verdict: error = predicted / measured - 1; `ok` when |error| <= threshold."""
    error = predicted_s / measured_s - 1.0
    return {"predicted_s": predicted_s, "measured_s": measured_s, "error_pct": 100.0 * error,
            "threshold_pct": 100.0 * threshold, "ok": abs(error) <= threshold}


def check_calibration(cluster: ClusterSpec, world: int, *, threshold: float = CHECK_THRESHOLD,
                      home: str | Path | None = None) -> dict[str, Any]:
    """Run the short real check run (`check_overrides`) and compare its median steady step time with
    what `cluster` predicts for it (`check_error`, plus the config and the load while it ran)."""
    from engine.config import load_config

    cfg = load_config(None, check_overrides(world))
    run = measure_run(cfg, home=home)
    return {"config": " ".join(check_overrides(world)[:6]), "load1": run["load1"],
            **check_error(predicted_s=predict_run(cfg, cluster).iteration_time_s, measured_s=run["step_time_s"],
                          threshold=threshold)}


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


def compare_measured(configs: dict[str, list[str]] | None = None, *, rounds: int = 2,
                     host: HostProfile | None = None,
                     on_row: Callable[[dict[str, Any]], None] | None = None) -> pd.DataFrame:
    """Simulated vs measured step time of engine configs on this machine.

    Calibrates first (host micro-benchmarks, then per world size the CPU share and the gloo
    all-reduce), then launches every config `rounds` times, interleaved (round 1 of every
    config, then round 2, ...) so slow phases of a shared machine spread over all of them.
    Columns: config, world, measured_s (median over rounds of each run's median steady step),
    simulated_s, error_pct ((sim - meas) / meas), load1 (mean 1-min load during its runs), speed
    (median `speed_index` taken just before its runs) and error_at_speed_pct (the error of
    simulated_s / speed: the model's error with the host's drift since calibration taken out).
    `table.attrs` holds the host profile, the cluster profile per world size and every run.
    """
    import pandas as pd

    from engine.config import load_config

    configs = configs or VALIDATION_CONFIGS
    cfgs = {name: load_config(None, BASE_OVERRIDES + ov) for name, ov in configs.items()}
    host = host or measure_host()
    worlds = sorted({c.world_size for c in cfgs.values()})
    for w in worlds:  # every share first, so each world's is consistent with the others' (consistent_shares)
        _measured_share(host, w, lambda _: None)
    clusters = {w: calibrate_local(w, host=host) for w in worlds}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cfgs}
    for _ in range(rounds):
        for name, cfg in cfgs.items():
            speed = speed_index(host)
            runs[name].append({**measure_run(cfg), "speed": speed})
            if on_row is not None:
                on_row({"config": name, **runs[name][-1]})
    rows = []
    for name, cfg in cfgs.items():
        measured = statistics.median(r["step_time_s"] for r in runs[name])
        simulated = predict_run(cfg, clusters[cfg.world_size]).iteration_time_s
        speed = statistics.median(r["speed"] for r in runs[name])
        rows.append({"config": name, "world": cfg.world_size, "measured_s": measured,
                     "simulated_s": simulated, "error_pct": 100.0 * (simulated - measured) / measured,
                     "load1": statistics.mean(r["load1"] for r in runs[name]), "speed": speed,
                     "error_at_speed_pct": 100.0 * (simulated / speed - measured) / measured})
    table = pd.DataFrame(rows)
    table.attrs.update(host=host, clusters=clusters, runs=runs)
    return table
