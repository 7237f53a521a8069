"""Hardware profiles for the performance simulator: presets, profile files, calibration fits.

A `ClusterSpec` holds what the simulator needs to know about a machine: per-GPU peak rate and
memory, the achieved-rate curve of GEMMs, HBM bandwidth, and an alpha-beta model per link class
(intra-node, inter-node), optionally with node groups whose NICs differ.

Bandwidths are *bus* bandwidths in GB/s per GPU (nccl-tests doc/PERFORMANCE.md definition), so a
collective of `bytes` per rank costs `alpha + bytes * factor / busbw` (formulas.md).
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from engine.peaks import peak_bf16
from tuning.sim.stragglers import GPU_SPEED_SD

GB = 1e9
GIB = 2**30 / GB  # GB per GiB


@dataclass(kw_only=True, slots=True, frozen=True)
class NodeGroup:
    """A run of nodes sharing one NIC type (heterogeneous clusters list several)."""

    name: str = "group"  # label shown in reports
    nodes: int  # number of nodes in this group
    inter_bw_gb_s: float  # inter-node bus bandwidth per GPU, GB/s
    inter_latency_s: float  # inter-node collective latency (alpha), s


def table_rate(table: Sequence[tuple[float, float]], flops: np.ndarray | float) -> np.ndarray:
    """FLOP/s at `flops` from measured (FLOPs, FLOP/s) points: log-linear interpolation, clamped."""
    x = np.maximum(np.asarray(flops, dtype=float), 1.0)
    sizes, rates = np.array(table, dtype=float).T
    order = np.argsort(sizes)
    return np.interp(np.log(x), np.log(sizes[order]), rates[order])


@dataclass(kw_only=True, slots=True, frozen=True)
class ClusterSpec:
    """A cluster as the simulator sees it; every rate is per GPU (per GCD on MI250X)."""

    name: str  # preset or profile name
    gpus_per_node: int  # accelerators per node sharing the intra-node link
    peak_flops: float  # dense 16-bit matrix peak, FLOP/s per GPU (MFU denominator)
    memory_gb: float  # device memory per GPU, GB (1e9 bytes)
    hbm_gb_s: float  # device memory bandwidth, GB/s (bounds non-GEMM kernels and the optimizer)
    intra_bw_gb_s: float  # intra-node bus bandwidth per GPU, GB/s
    intra_latency_s: float  # intra-node collective latency (alpha), s
    inter_bw_gb_s: float  # inter-node bus bandwidth per GPU, GB/s (all nodes, if no groups)
    inter_latency_s: float  # inter-node collective latency (alpha), s
    num_nodes: int | None = None  # nodes available; None = as many as asked for
    node_groups: tuple[NodeGroup, ...] = ()  # heterogeneous NICs, allocated in this order
    gemm_max_efficiency: float = 0.8  # achieved/peak of a very large GEMM
    gemm_half_flops: float = 1e9  # GEMM size (FLOPs) reaching half of the max efficiency
    gemm_table: tuple[tuple[float, float], ...] = ()  # measured (GEMM FLOPs, FLOP/s); overrides the curve
    # attention's max efficiency on the GEMM curve's shape (a profile's own; no preset sets it: their attention
    # is the measured kernels of `kernels`); 0 = the GEMM curve's own (attention priced as GEMMs)
    attention_max_efficiency: float = 0.0
    # measured fused attention (one of its two GEMMs' FLOPs, FLOP/s); empty = attention at the GEMM rate
    attention_table: tuple[tuple[float, float], ...] = ()
    usable_memory_fraction: float = 0.95  # share of memory_gb usable; 1 where the runtime below is modelled
    # What a process holds beyond its tensors (tuning/sim/memory.py, category `runtime`): the CUDA context
    # with the kernels loaded (GB, measured per GPU and software generation) and NCCL's channels per
    # communicator (its buffers: channels x 2 connections x NCCL's default FIFOs); 0 = not modelled
    cuda_context_gb: float = 0.0
    nccl_channels: int = 0
    # Achieved share of hbm_gb_s in memory-bound kernels (norms, softmax, dropout, GeLU, Adam): they
    # read and write more than the activation bytes the model counts. Not fitted: GPU presets take the
    # measured streaming rate of `kernels` (tuning.sim.kernels.memory_bandwidth) and leave it at 1, as do
    # measured hosts, whose hbm_gb_s is itself a kernel measurement.
    hbm_efficiency: float = 1.0
    # Measured hosts: GB/s at which few-token linear layers stream their weights, forward + backward
    # with gradient accumulation (tuning.calibrate.calibration.measure_weight_stream); 0 = hbm_gb_s x hbm_efficiency.
    weight_stream_gb_s: float = 0.0
    # Host-side framework time, measured on CPU hosts (tuning/calibrate/calibration.py); 0 on GPU presets,
    # where kernels are launched asynchronously and this time hides behind device work.
    overhead_layer_s: float = 0.0  # per transformer layer and micro-batch, forward + backward, s
    overhead_microbatch_s: float = 0.0  # per micro-batch besides the layers (embedding, loss), s
    overhead_step_s: float = 0.0  # per optimizer step (clip, zero_grad, loss sync, data), s
    optimizer_gb_s: float = 0.0  # effective bandwidth of the optimizer step, GB/s; 0 = hbm_gb_s
    overhead_tp_layer_s: float = 0.0  # extra per layer and micro-batch when tp > 1 (DTensor dispatch), s
    overhead_fsdp_layer_s: float = 0.0  # extra per layer and micro-batch under ZeRO-2/3 (FSDP2 hooks), s
    p2p_latency_s: float = 0.0  # pipeline send/recv alpha, s; 0 = the collective latency of the link
    p2p_bw_gb_s: float = 0.0  # pipeline send/recv bandwidth, GB/s; 0 = the collective bus bandwidth
    # Measured hosts: FSDP's own collectives, in situ (tuning.calibrate.calibration.measure_fsdp_collectives: on gloo
    # they are slower than the all-reduce's bytes say); 0 = the link's all-reduce alpha-beta.
    allgather_latency_s: float = 0.0
    allgather_bw_gb_s: float = 0.0
    reduce_scatter_latency_s: float = 0.0
    reduce_scatter_bw_gb_s: float = 0.0
    # FSDP2 hides a block's all-gather / reduce-scatter under compute only with device streams: on a
    # CPU host it calls each one synchronously (`async_op` False, no streams), so none hides.
    fsdp_overlap: bool = True
    calibration_load1: float = 0.0  # measured hosts: 1-min load average while calibrating
    calibration_cpu_share: float = 0.0  # measured hosts: share of a core each rank really got (0 = not measured)
    # GPU presets: the kind whose measured kernel rates price every GEMM, attention and memory-bound
    # kernel (tuning/data/kernels.yaml, tuning.sim.kernels); "" = the curve / tables above (CPU profiles)
    kernels: str = ""
    # standard deviation of one GPU's sustained compute speed across the cluster's GPUs, a share of the
    # median's: the job's compute runs at its slowest GPU's pace (tuning.sim.stragglers; 0 = all equal)
    gpu_speed_sd: float = 0.0
    # its collectives run on NCCL 2.7's cost model: an all-reduce / all-gather / reduce-scatter at the fastest of NCCL's
    # rings and trees over its protocols (tuning.sim.comm.nccl_collective) in place of the flat alphas above
    nccl_tuning: bool = False

    @property
    def total_gpus(self) -> int | None:
        """GPUs in the cluster, or None when the node count is open."""
        nodes = self.num_nodes or sum(g.nodes for g in self.node_groups) or None
        return None if nodes is None else nodes * self.gpus_per_node

    @property
    def fp8_peak_flops(self) -> float:
        """Dense FP8 tensor-core peak FLOP/s of this cluster's GPU (tuning/data/kernels.yaml `fp8`); 0 where it has
        none (A100, MI250X, CPU profiles): `ParallelSpec.fp8` is refused there (`tuning.sim.kernels.fp8_facts`)."""
        if not self.kernels:
            return 0.0
        from tuning.sim.kernels import gpu_facts

        facts = gpu_facts(self.kernels)
        return facts.fp8_peak_tflops * 1e12 if facts.fp8_speedup > 0 else 0.0

    def gemm_rate(self, flops: np.ndarray | float) -> np.ndarray:
        """Achieved FLOP/s of one GEMM of `flops` FLOPs (vectorised).

        Without a measured table: peak * max_eff * x / (x + x_half), a saturating curve
        (small GEMMs cannot fill the device; see Narayanan et al. 2021, sec. 3.4, micro-batch
        size and arithmetic intensity). With a table: log-linear interpolation, clamped.
        """
        if self.gemm_table:
            return table_rate(self.gemm_table, flops)
        if self.kernels:  # a cube of these FLOPs at the GPU's measured rate (tuning.sim.kernels)
            from tuning.sim.kernels import gemm_seconds, gpu_facts

            x = np.maximum(np.asarray(flops, dtype=float), 1.0)
            side = np.cbrt(x / 2.0)
            return x / gemm_seconds(gpu_facts(self.kernels), self.peak_flops, side, side, side)
        x = np.maximum(np.asarray(flops, dtype=float), 1.0)
        return self.peak_flops * self.gemm_max_efficiency * x / (x + self.gemm_half_flops)

    def attention_rate(self, flops: np.ndarray | float) -> np.ndarray:
        """Achieved FLOP/s of one attention GEMM (Q K^T or scores x V) of `flops` FLOPs of work done:
        the measured fused-attention table where there is one (CPU hosts, `tuning.calibrate.calibration`), else
        the GEMM curve at `attention_max_efficiency` (a profile's own, not fitted; a fused kernel's softmax
        and its backward's recomputation keep it below the GEMMs' rate). GPU presets' fused attention is
        priced from tuning/data/kernels.yaml's measurements (`tuning.sim.kernels`), not here."""
        if self.attention_table:
            return table_rate(self.attention_table, flops)
        eff = self.attention_max_efficiency
        if np.ndim(eff) == 0 and eff == 0:
            return self.gemm_rate(flops)
        x = np.maximum(np.asarray(flops, dtype=float), 1.0)
        return self.peak_flops * eff * x / (x + self.gemm_half_flops)

    def measured_link(self, op: str, link: tuple[Any, Any]) -> tuple[Any, Any]:
        """(busbw GB/s, latency s) of `op` ("p2p", "allgather", "reduce_scatter") as a calibrated host
        measured it in situ (`{op}_latency_s` > 0), else `link`, the topology's (busbw, latency)."""
        alpha = getattr(self, f"{op}_latency_s")
        return (getattr(self, f"{op}_bw_gb_s"), alpha) if alpha > 0 else link

    def inter_link(self, gpus: int) -> tuple[float, float]:
        """(busbw GB/s, latency s) of the inter-node link for a job of `gpus` GPUs.

        Nodes are taken from the groups in order; a ring spanning several groups runs at the
        slowest NIC's rate and pays the largest latency.
        """
        if not self.node_groups:
            return self.inter_bw_gb_s, self.inter_latency_s
        nodes_left = -(-gpus // self.gpus_per_node)
        bws, lats = [], []
        for group in self.node_groups:
            if nodes_left <= 0:
                break
            bws.append(group.inter_bw_gb_s)
            lats.append(group.inter_latency_s)
            nodes_left -= group.nodes
        return min(bws), max(lats)


# ---------------------------------------------------------------- presets
# Bandwidths below are per GPU and per direction (what a ring all-reduce's busbw approaches).
# The link efficiency (achieved busbw / link peak) is an assumption of this profile, stated
# per preset, not a published figure.

_A100 = ClusterSpec(
    name="dgx-a100-80gb",
    gpus_per_node=8,
    peak_flops=peak_bf16("A100 SXM"),  # 312 TFLOP/s dense bf16/fp16 (engine/peaks.py)
    memory_gb=85.9,  # A100 80GB: 80 GiB HBM2e (nvidia-smi: 81920 MiB) = 85.9 GB
    hbm_gb_s=2039.0,  # A100 80GB SXM datasheet: 2,039 GB/s
    # NVLink 3 via NVSwitch: 600 GB/s per GPU bidirectional = 300 GB/s per direction;
    # assumed 80% achievable busbw.
    intra_bw_gb_s=240.0,
    intra_latency_s=10e-6,  # assumed NCCL launch + NVLink hop
    # DGX A100: 8 x 200 Gb/s HDR InfiniBand compute NICs = 25 GB/s per GPU; assumed 90%.
    inter_bw_gb_s=22.5,
    inter_latency_s=20e-6,  # assumed IB round through the fat tree
    # NCCL 2.7's cost model of its rings and trees (tuning.sim.comm), the NCCL of the 2020-22 A100 runs; the alphas
    # above still price the pipeline's sends and ZeRO-3's per-block collectives
    nccl_tuning=True,
    kernels="a100",  # GEMM, attention and memory-bound rates as measured (tuning/data/kernels.yaml)
    # CUDA context + PyTorch's kernels on an A100 80GB, pytorch 1.13.1, all kernels loaded: 0.90 GiB
    # (stas00/ml-engineering training/performance/README.md, "Preloaded CUDA kernels memory usage")
    cuda_context_gb=0.90 * GIB,
    # NCCL on an NVSwitch A100 node: 12 rings found, doubled to 24 channels ("Pattern 4, crossNic 0,
    # nChannels 12 ... Channel 00/24" in NCCL_DEBUG=INFO logs; src/graph/search.cc dupChannels)
    nccl_channels=24,
    usable_memory_fraction=1.0,  # context and NCCL are terms of the model, not an allowance
    gpu_speed_sd=GPU_SPEED_SD,  # Sinha et al. SC22: 8% whisker span across a cluster's GPUs (tuning.sim.stragglers)
)

_H100 = ClusterSpec(
    name="dgx-h100",
    gpus_per_node=8,
    peak_flops=peak_bf16("H100 SXM"),  # ~989 TFLOP/s dense bf16 (engine/peaks.py)
    memory_gb=85.5,  # H100 SXM: 80 GB HBM3 (nvidia-smi: 81559 MiB) = 85.5 GB
    hbm_gb_s=3350.0,  # H100 SXM datasheet: 3.35 TB/s
    # NVLink 4: 900 GB/s per GPU bidirectional = 450 per direction; assumed 80%.
    intra_bw_gb_s=360.0,
    intra_latency_s=10e-6,
    # DGX H100: 8 x 400 Gb/s NDR ConnectX-7 = 50 GB/s per GPU; assumed 90%.
    inter_bw_gb_s=45.0,
    inter_latency_s=20e-6,
    kernels="h100",
    # nccl_tuning off: the H100 runs (2023-24) ran NCCL >= 2.18, whose model differs from the constants of
    # tuning.sim.comm (14 us a network step, the ring plateau 1.4, NVLink SHARP all-reduces on NVSwitch 3, PAT
    # gathers; NVIDIA/nccl@ab2b89c4 src/graph/tuning.cc, 2.21.5): not modelled, the flat alphas stay
    # CUDA context with lazy module loading (CUDA >= 11.7, PyTorch 2's default), pytorch 2.1.1+cu121:
    # 0.47 GiB; loading every kernel eagerly takes 0.92 GiB, "the actual memory ... will be somewhere between"
    # (stas00/ml-engineering training/performance/README.md): the lazy floor, since a training step loads
    # only its own kernels
    cuda_context_gb=0.47 * GIB,
    nccl_channels=32,  # NCCL on an NVSwitch H100 node: "32 coll channels" (NCCL_DEBUG=INFO; NVIDIA/nccl#1685)
    usable_memory_fraction=1.0,
    gpu_speed_sd=GPU_SPEED_SD,
)

_FRONTIER = ClusterSpec(
    name="frontier",
    gpus_per_node=8,  # 4 MI250X = 8 GCDs per node; one "GPU" here is one GCD
    peak_flops=peak_bf16("MI250X"),  # 383 TFLOP/s bf16 per package of 2 GCDs: 191.5 per GCD (engine/peaks.py)
    memory_gb=68.7,  # MI250X: 128 GiB HBM2e per package = 64 GiB per GCD = 68.7 GB
    hbm_gb_s=1638.0,  # MI250X: 3.2768 TB/s per package = 1.64 TB/s per GCD
    # Infinity Fabric between GCDs of different packages: 50 GB/s per direction per link
    # (OLCF Frontier user guide); a ring is held to that link; assumed 80%.
    intra_bw_gb_s=40.0,
    intra_latency_s=15e-6,
    # 4 Slingshot-11 NICs at 25 GB/s each per node = 12.5 GB/s per GCD; assumed 80%.
    inter_bw_gb_s=10.0,
    inter_latency_s=30e-6,
    kernels="mi250x",  # MAMF per GCD; no fused-attention measurement: attention priced as GEMMs
    gpu_speed_sd=GPU_SPEED_SD,  # Sinha et al.: the same 8% "regardless of ... GPU vendor" (MI60 on Corona)
)

# A100 40GB SXM: same GPU and network as the 80GB node (MosaicML's benchmark tables run both on
# 1600 Gb/s per node); 40 GiB HBM2 (42.9 GB) at 1,555 GB/s (datasheet).
_A100_40 = dataclasses.replace(_A100, name="dgx-a100-40gb", memory_gb=42.9, hbm_gb_s=1555.0, kernels="a100-40")

# Jean Zay gpu_p5 (IDRIS), where BigScience searched BLOOM-176B's layout: the same A100 80GB SXM
# (the same measured kernels, `kernels="a100"`), 8 per node on NVLink (assumed switched as in a DGX), and
# "4 OmniPath links" of 100 Gb/s per node (bigscience train/tr11-176B-ml/README.md, Hardware):
# 4 x 12.5 GB/s shared by 8 GPUs = 6.25 GB/s per GPU; assumed 90%.
_JEAN_ZAY = dataclasses.replace(_A100, name="jean-zay-a100", inter_bw_gb_s=5.625,
                                # BigScience's own reading in 2022 (PyTorch 1.11, every kernel loaded):
                                # "40GB A100 takes 1573MiB for cuda kernels (probably about the same for
                                # 80GB?)" (train/tr11-176B-ml/chronicles-prequel.md)
                                cuda_context_gb=1573 * 2**20 / 1e9)

PRESETS: dict[str, ClusterSpec] = {c.name: c for c in (_A100, _A100_40, _H100, _FRONTIER, _JEAN_ZAY)}


# ---------------------------------------------------------------- profile files

def _from_dict(data: dict[str, Any]) -> ClusterSpec:
    fields = {f.name for f in dataclasses.fields(ClusterSpec)}
    unknown = sorted(set(data) - fields)
    if unknown:
        hints = {k: difflib.get_close_matches(k, fields, n=1) for k in unknown}
        raise ValueError(
            f"unknown cluster profile keys {unknown}; close matches {hints}; valid keys: {sorted(fields)}"
        )
    data = dict(data)
    data["node_groups"] = tuple(NodeGroup(**g) for g in data.get("node_groups") or ())
    for key in ("gemm_table", "attention_table"):
        data[key] = tuple((float(a), float(b)) for a, b in data.get(key) or ())
    return ClusterSpec(**data)


def load_cluster(name_or_path: str | Path) -> ClusterSpec:
    """A preset by name (`dgx-a100-80gb`, `dgx-h100`, `frontier`) or a YAML/JSON profile file."""
    key = str(name_or_path)
    if key in PRESETS:
        return PRESETS[key]
    path = Path(key)
    if not path.is_file():
        close = difflib.get_close_matches(key, PRESETS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"cluster {key!r} is neither a preset {sorted(PRESETS)} nor a file{hint}")
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"cluster profile {path} must hold a mapping, got {type(data).__name__}")
    kernels = str(data.get("kernels") or "")
    if kernels.endswith((".yaml", ".yml")) and not Path(kernels).is_absolute():  # a measured kernel profile beside it
        data = {**data, "kernels": str((path.parent / kernels).resolve())}
    return _from_dict(data)


def cluster_to_dict(spec: ClusterSpec) -> dict[str, Any]:
    """Plain dict of a profile (lists instead of tuples), as written by `save_cluster`."""
    data = dataclasses.asdict(spec)
    data["node_groups"] = [dict(g) for g in data["node_groups"]]
    for key in ("gemm_table", "attention_table"):
        data[key] = [list(p) for p in data[key]]
    return data


def save_cluster(spec: ClusterSpec, path: str | Path) -> Path:
    """Write a profile as JSON (`.json`) or YAML (anything else); `load_cluster` reads it back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = cluster_to_dict(spec)
    text = json.dumps(data, indent=2) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
    path.write_text(text)
    return path


# ---------------------------------------------------------------- calibration fits

def fit_alpha_beta(
    sizes_bytes: Sequence[float], times_s: Sequence[float], factor: float | Sequence[float],
    *, relative: bool = False,
) -> tuple[float, float]:
    """Least-squares alpha-beta fit of `time = alpha + bytes * factor / busbw`.

    `factor` is the nccl-tests bus factor of the op (all_reduce 2(n-1)/n, ...), one value or one
    per sample. Returns (alpha in s, busbw in GB/s). alpha is clamped at 0 (then the slope is
    refitted through the origin), since a negative latency only fits noise. `relative=True`
    minimises relative errors (weights 1/time), so small, latency-bound messages count as much
    as large ones (what small models on a CPU host send).
    """
    x = np.asarray(sizes_bytes, dtype=float) * np.asarray(factor, dtype=float)
    t = np.asarray(times_s, dtype=float)
    if x.size < 2 or np.ptp(x) == 0:
        raise ValueError("fit_alpha_beta needs at least two distinct message sizes")
    slope, alpha = np.polyfit(x, t, 1, w=1.0 / t if relative else None)
    if alpha < 0 or slope <= 0:
        alpha = 0.0
        slope = float(np.dot(x, t) / np.dot(x, x))
    if slope <= 0:
        raise ValueError("times do not grow with size; cannot fit a bandwidth")
    return float(alpha), float(1.0 / slope / GB)


def fit_gemm_curve(sizes: Sequence[float], flops_per_s: Sequence[float]) -> tuple[float, float]:
    """Fit rate(x) = rate_max * x / (x + x_half) to measured (GEMM FLOPs, FLOP/s) points.

    Linear least squares on 1/rate = 1/rate_max + (x_half/rate_max) / x (weighted by rate^2 so
    the large, reliable GEMMs count most). Returns (rate_max FLOP/s, x_half FLOPs).
    """
    x = np.asarray(sizes, dtype=float)
    r = np.asarray(flops_per_s, dtype=float)
    if x.size < 2 or np.ptp(x) == 0:
        raise ValueError("fit_gemm_curve needs at least two distinct GEMM sizes")
    slope, intercept = np.polyfit(1.0 / x, 1.0 / r, 1, w=r)
    if intercept <= 0:  # rate still rising at the largest size: take the best seen as the max
        return float(r.max()), float(max(slope * r.max(), 0.0))
    rate_max = 1.0 / intercept
    return float(rate_max), float(max(slope * rate_max, 0.0))


def measure_gemm_rates(
    sizes: Sequence[int], *, dtype: str = "float32", min_time_s: float = 0.05, repeats: int = 5
) -> list[tuple[float, float]]:
    """Time n x n x n torch matmuls on this CPU; returns [(GEMM FLOPs = 2n^3, median FLOP/s)]."""
    import torch  # lazy: profiles load without torch

    out: list[tuple[float, float]] = []
    for n in sizes:
        a = torch.randn(n, n, dtype=getattr(torch, dtype))
        b = torch.randn(n, n, dtype=getattr(torch, dtype))
        torch.matmul(a, b)  # warm-up: first call allocates and picks a kernel
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < min_time_s / repeats or calls < 1:
            torch.matmul(a, b)
            calls += 1
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                torch.matmul(a, b)
            samples.append((time.perf_counter() - t0) / calls)
        flops = 2.0 * n**3
        out.append((flops, flops / statistics.median(samples)))
    return out


def cpu_profile(
    *,
    name: str,
    gemm_points: Sequence[tuple[float, float]],
    intra: tuple[float, float],
    inter: tuple[float, float] | None = None,
    gpus_per_node: int,
    memory_gb: float,
    hbm_gb_s: float = 10.0,
    weight_stream_gb_s: float = 0.0,
    overheads: dict[str, float] | None = None,
    attention_points: Sequence[tuple[float, float]] = (),
) -> ClusterSpec:
    """A profile of a measured host (e.g. `cpu-local`): one 'GPU' per rank, one node.

    `gemm_points` from `measure_gemm_rates`; `intra`/`inter` are (alpha s, busbw GB/s) from
    `fit_alpha_beta`. The measured table drives the GEMM rate; its best point is the peak.
    `overheads` sets the host-side fields (`overhead_layer_s`, `overhead_microbatch_s`,
    `overhead_step_s`, `optimizer_gb_s`) measured by `tuning.calibrate.calibration`; `attention_points`
    the fused-attention rates (`tuning.calibrate.calibration.measure_attention`).
    """
    rates = [rate for _, rate in gemm_points]
    inter = inter or intra
    return ClusterSpec(
        name=name,
        gpus_per_node=gpus_per_node,
        peak_flops=max(rates),
        memory_gb=memory_gb,
        hbm_gb_s=hbm_gb_s,
        weight_stream_gb_s=weight_stream_gb_s,
        intra_bw_gb_s=intra[1],
        intra_latency_s=intra[0],
        inter_bw_gb_s=inter[1],
        inter_latency_s=inter[0],
        num_nodes=1,
        gemm_max_efficiency=1.0,
        gemm_table=tuple((float(f), float(r)) for f, r in gemm_points),
        attention_table=tuple((float(f), float(r)) for f, r in attention_points),
        fsdp_overlap=False,  # a CPU host: no streams
        **{k: float(v) for k, v in (overheads or {}).items()},
    )
