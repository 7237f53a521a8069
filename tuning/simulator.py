"""Analytical performance model of one training iteration of a GPT model (pure functions).

`simulate(model, cluster, par)` prices one configuration; `evaluate_arrays` prices many at once
(numpy arrays of parallel settings, used by `tuning.search`). Both run the same arithmetic, so
the scalar and vectorised answers agree by construction; `simulate` adds validation.

Sources (docs/simulator.md gives the equations):
- FLOPs per layer and per iteration: Narayanan et al. 2021, sec. 5.1 (formulas.md).
- Pipeline bubble (p-1)/m and (p-1)/(v m): same paper, sec. 2.2.
- Tensor-parallel all-reduces per layer: Shoeybi et al. 2019; sequence parallel: Korthikanti
  et al. 2022.
- Model-state memory by ZeRO stage: Rajbhandari et al. 2020; activations: Korthikanti et al.
  2022, eqs. 1-3 and sec. 4.2.3 (interleaved first stage).
- Collective times: alpha-beta model with nccl-tests bus factors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.validate import divisors as _divisors
from engine.validate import V_SCHEDULES, VIRTUAL_SCHEDULES
from tuning.hardware import GB, ClusterSpec
from tuning.sim_schedule import schedule_bubble

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "gpipe", "interleaved", "looped_bfs", "modular", "zero_bubble", "zbv", "dualpipev", "skip")
# Adam step traffic per parameter: fp32 master, momentum, variance read + written (24 B),
# the gradient read and the 16-bit weight written (4 B). The step is memory-bound.
OPTIMIZER_BYTES_PER_PARAM = 28.0
# Non-GEMM kernels (norms, softmax, dropout, GeLU, residuals) are memory-bound: forward moves
# about the bytes of activations it produces, backward twice that (roofline assumption).
NONGEMM_BWD_FACTOR = 2.0


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelSpec:
    """A GPT model; names follow the run config's `model.*` keys (hidden = model.d_model)."""

    layers: int  # transformer blocks (model.layers)
    hidden: int  # hidden size h (model.d_model)
    heads: int  # attention heads a (model.heads)
    seq: int  # sequence length s (model.seq_len)
    vocab: int  # vocabulary size V (model.vocab)
    experts: int = 0  # experts per MoE block, 0 = dense (model.experts; tuning/sim_moe.py)
    moe_every: int = 1  # every moe_every-th block is MoE (model.moe_every)
    top_k: int = 2  # experts per token (model.top_k)
    capacity_factor: float = 1.25  # expert capacity / mean share, 0 = unlimited (model.capacity_factor)

    @property
    def params(self) -> int:
        """Parameters: 12 l h^2 + 13 l h + V h + s h (Narayanan et al. 2021, sec. 5.1); MoE: every expert."""
        lyr, h = self.layers, self.hidden
        return 12 * lyr * h * h + 13 * lyr * h + self.vocab * h + self.seq * h + int(self._moe()["total"])

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: `params` with top_k experts per MoE block."""
        return self.params - int(self._moe()["total"]) + int(self._moe()["active"])

    def _moe(self) -> dict[str, float]:
        from tuning.sim_moe import param_counts

        return param_counts(layers=self.layers, hidden=self.hidden, experts=self.experts,
                            moe_every=self.moe_every, top_k=self.top_k)


def format_count(n: float) -> str:
    """A parameter count in the unit that fits: 3.3M, 1.7B, 1.0T (3 significant digits below 10)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.1f}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return f"{n:.0f}"


@dataclass(kw_only=True, slots=True)
class ParallelSpec:
    """One parallel configuration; names follow `parallel.*` and `batch.*` of the run config."""

    dp: int = 1  # data-parallel degree
    tp: int = 1  # tensor-parallel degree
    pp: int = 1  # pipeline-parallel degree
    virtual: int = 1  # model chunks per pipeline rank (>1 means the interleaved schedule)
    micro: int = 1  # micro-batch size, samples (batch.micro)
    global_batch: int = 1  # samples per optimizer step (batch.global)
    zero: int = 0  # ZeRO stage 0-3
    recompute: str | bool = "none"  # activation recomputation: none | selective | full (bool ok)
    sequence_parallel: bool = False  # shard norms/dropout activations over tp
    compression_ratio: float = 1.0  # dense all_reduce / wire bytes of the gradient collective at this dp
    co2: bool = False  # CO2: the gradient all-reduce is asynchronous and fully hidden
    schedule: str = "1f1b"  # 1f1b | gpipe | interleaved
    dtype_bytes: int = 2  # bytes per parameter, gradient and activation (2 = bf16/fp16)
    overlap_dp: bool = True  # overlap gradient collectives with backward (DDP buckets)
    bucket_mb: float = 25.0  # gradient bucket size, MB (the last bucket is never hidden)
    zero1_allreduce: bool = False  # ZeRO-1 as torch's ZeroRedundancyOptimizer: all-reduce, then broadcast shards
    zero2_fsdp: bool = False  # ZeRO-2 as FSDP2 with reshard_after_forward=False: per-block gather in forward, RS in backward
    flash_attention: bool = False  # fused attention: no s x s scores in memory; backward recomputes Q K^T
    reshard_after_forward: bool = True  # ZeRO-3: free gathered blocks after forward (False: no backward gather)
    # issue 18, MoE (tuning/sim_moe.py)
    ep: int = 1  # expert-parallel degree, carved from dp (divides dp and model.experts)
    moe_hierarchical: bool = False  # all_to_all inside the node first, then across nodes
    moe_a2a_ratio: float = 1.0  # dense / wire bytes of the MoE all_to_all (LSH-MoE compression)
    moe_padded: bool = True  # capacity-padded expert buffers (GShard, DeepSpeed); False: variable splits (the engine)
    moe_imbalance: float = 1.0  # routed tokens of the busiest expert rank / the mean
    # issue 19, context parallelism (tuning/sim_context.py)
    cp: int = 1  # context-parallel degree: each sequence over cp ranks (world = dp tp pp cp)
    cp_impl: str = "ulysses"  # ulysses (all-to-all) | ring (K/V blocks, overlapped)
    attn_density: float = 1.0  # computed share of the s x s attention (packed long-tail batches)
    adaptive_sp: bool = False  # FlexSP per-step groups (engine); priced as the static cp (not modelled)
    skip_ratio: float = 0.0  # schedule=skip: fraction of middle stages a micro-batch skips (SkipPipe)

    def __post_init__(self) -> None:
        if isinstance(self.recompute, bool):
            self.recompute = "full" if self.recompute else "none"
        if self.virtual > 1 and self.schedule == "1f1b":
            self.schedule = "interleaved"

    @property
    def gpus(self) -> int:
        """dp * tp * pp * cp."""
        return self.dp * self.tp * self.pp * self.cp


@dataclass(kw_only=True, slots=True)
class SimResult:
    """Simulated iteration; times in s, memory in GB (1e9 bytes), rates per GPU."""

    iteration_time_s: float
    breakdown: dict[str, float]  # compute, tp_comm, pp_comm, bubble, dp_comm_exposed, optimizer (s)
    tokens_per_s: float
    tflops_per_gpu: float  # executed FLOPs (recomputation included, as Megatron reports) / s / GPU
    mfu: float  # model FLOPs (no recomputation) / (time * gpus * peak)
    memory_per_gpu_gb: float  # the most loaded pipeline stage
    memory_breakdown_gb: dict[str, float]  # params, grads, optimizer, activations
    fits: bool  # memory_per_gpu_gb <= usable device memory
    flops_per_iteration: float  # executed FLOPs of one iteration, all GPUs
    model_flops_per_iteration: float  # without recomputation
    num_microbatches: int  # per pipeline (gradient accumulation steps)
    bubble_fraction: float  # bubble time / ideal pipeline time
    dp_comm_total_s: float  # data-parallel traffic time before overlap
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (used by `workbench simulate --json`)."""
        return {name: getattr(self, name) for name in self.__slots__}


# ---------------------------------------------------------------- validation

def _choices(values: list[int]) -> str:
    shown = [str(v) for v in values[:8]]
    return ", ".join(shown[:-1]) + f" or {shown[-1]}" if len(shown) > 1 else shown[0]


def validate_parallel(
    model: ModelSpec, cluster: ClusterSpec, par: ParallelSpec, *, gpus: int | None = None
) -> list[str]:
    """Every reason `par` cannot run `model` on `cluster` (empty when valid)."""
    reasons = [f"{k}={v} must be >= 1" for k, v in
               (("parallel.dp", par.dp), ("parallel.tp", par.tp), ("parallel.pp", par.pp),
                ("parallel.virtual", par.virtual), ("batch.micro", par.micro),
                ("batch.global", par.global_batch)) if v < 1]
    if reasons:
        return reasons
    if gpus is not None and par.gpus != gpus:
        cp = f" * cp({par.cp})" if par.cp != 1 else ""
        reasons.append(f"dp({par.dp}) * tp({par.tp}) * pp({par.pp}){cp} = {par.gpus} != gpus({gpus})")
    if cluster.total_gpus is not None and par.gpus > cluster.total_gpus:
        reasons.append(f"{par.gpus} GPUs asked but cluster {cluster.name} has {cluster.total_gpus}")
    if model.heads % par.tp:
        reasons.append(f"parallel.tp={par.tp} must divide model.heads={model.heads}; "
                       f"try {_choices(_divisors(model.heads))}")
    if model.hidden % model.heads:
        reasons.append(f"model.heads={model.heads} must divide model.d_model={model.hidden}")
    chunks = par.pp * par.virtual
    if model.layers % chunks:
        reasons.append(f"model.layers={model.layers} must be divisible by parallel.pp * "
                       f"parallel.virtual = {par.pp} * {par.virtual} = {chunks}")
    if par.global_batch % (par.dp * par.micro):
        reasons.append(f"batch.global={par.global_batch} must be divisible by parallel.dp * "
                       f"batch.micro = {par.dp} * {par.micro} = {par.dp * par.micro}")
    elif par.schedule in ("interleaved", "modular", "zero_bubble") and (par.global_batch // (par.dp * par.micro)) % par.pp:
        reasons.append(f"{par.schedule} schedule needs the micro-batch count "
                       f"{par.global_batch // (par.dp * par.micro)} divisible by parallel.pp={par.pp}")
    elif par.schedule == "dualpipev" and par.global_batch // (par.dp * par.micro) < 2 * par.pp:
        reasons.append(f"dualpipev needs at least 2 * parallel.pp = {2 * par.pp} micro-batches")
    if par.schedule in ("zbv", "dualpipev") and model.layers % (2 * par.pp):
        reasons.append(f"{par.schedule} needs model.layers={model.layers} divisible by 2 * parallel.pp = {2 * par.pp}")
    if par.schedule not in ("1f1b", "gpipe", "interleaved") and par.pp == 1:
        reasons.append(f"parallel.schedule={par.schedule!r} needs parallel.pp > 1")
    if par.schedule == "skip" and par.pp < 3:
        reasons.append("parallel.schedule='skip' needs parallel.pp >= 3")
    reasons += _validate_knobs(model, par)
    from tuning import sim_context, sim_moe

    return reasons + sim_moe.validate(model, par) + sim_context.validate(model, par)


def _validate_knobs(model: ModelSpec, par: ParallelSpec) -> list[str]:
    reasons = []
    if par.zero not in (0, 1, 2, 3):
        reasons.append(f"parallel.zero={par.zero} must be 0, 1, 2 or 3")
    if par.recompute not in RECOMPUTE:
        reasons.append(f"recompute={par.recompute!r} must be one of {RECOMPUTE}")
    if par.schedule not in SCHEDULES:
        reasons.append(f"parallel.schedule={par.schedule!r} must be one of {SCHEDULES}")
    if par.virtual > 1 and par.schedule not in VIRTUAL_SCHEDULES:
        reasons.append(f"parallel.virtual={par.virtual} needs parallel.schedule in {VIRTUAL_SCHEDULES}")
    if par.virtual > 1 and par.pp == 1:
        reasons.append(f"parallel.virtual={par.virtual} needs parallel.pp > 1")
    if par.sequence_parallel and model.seq % par.tp:
        reasons.append(f"sequence parallel needs parallel.tp={par.tp} to divide model.seq_len={model.seq}")
    if not par.compression_ratio > 0.0:  # < 1: an all_gather compressor at large dp sends more than dense
        reasons.append(f"compression_ratio={par.compression_ratio} must be > 0")
    if par.dtype_bytes not in (1, 2, 4):
        reasons.append(f"dtype_bytes={par.dtype_bytes} must be 1, 2 or 4")
    return reasons


# ---------------------------------------------------------------- vectorised model

def _arrays(par: ParallelSpec) -> dict[str, np.ndarray]:
    """One configuration as the 0-d arrays `evaluate_arrays` takes."""
    return {
        "tp": np.asarray(par.tp), "pp": np.asarray(par.pp), "dp": np.asarray(par.dp),
        "virtual": np.asarray(par.virtual), "micro": np.asarray(par.micro),
        "global_batch": np.asarray(par.global_batch), "zero": np.asarray(par.zero),
        "recompute": np.asarray(RECOMPUTE.index(str(par.recompute))),
        "sequence_parallel": np.asarray(par.sequence_parallel),
        "compression_ratio": np.asarray(float(par.compression_ratio)),
        "co2": np.asarray(par.co2), "schedule": np.asarray(SCHEDULES.index(par.schedule)),
        "dtype_bytes": np.asarray(par.dtype_bytes), "overlap_dp": np.asarray(par.overlap_dp),
        "bucket_mb": np.asarray(float(par.bucket_mb)),
        "zero1_allreduce": np.asarray(par.zero1_allreduce),
        "zero2_fsdp": np.asarray(par.zero2_fsdp), "flash_attention": np.asarray(par.flash_attention),
        "reshard_after_forward": np.asarray(par.reshard_after_forward),
        "ep": np.asarray(par.ep), "moe_hierarchical": np.asarray(par.moe_hierarchical),
        "moe_a2a_ratio": np.asarray(float(par.moe_a2a_ratio)), "moe_padded": np.asarray(par.moe_padded),
        "moe_imbalance": np.asarray(float(par.moe_imbalance)), "cp": np.asarray(par.cp),
        "cp_impl": np.asarray(_cp_code(par.cp_impl)), "attn_density": np.asarray(float(par.attn_density)),
        "skip_ratio": np.asarray(float(par.skip_ratio)),
    }


def _cp_code(impl: str) -> int:
    from tuning.sim_context import CP_IMPLS

    return CP_IMPLS.index(impl) if impl in CP_IMPLS else -1


def _collective(nbytes: np.ndarray, factor: np.ndarray, bw_gb_s: np.ndarray,
                alpha_s: np.ndarray, n: np.ndarray) -> np.ndarray:
    """alpha + bytes * factor / busbw (formulas.md); zero for a group of one."""
    return np.where(n > 1, alpha_s + nbytes * factor / (bw_gb_s * GB), 0.0)


def _link(cluster: ClusterSpec, gpus: int, intra: np.ndarray,
          rails: np.ndarray | int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(busbw GB/s, latency s) of a group; `rails` = the group's ranks per node.

    Across nodes NCCL runs one ring per NIC, so a group with r ranks in each node drives r NICs
    at once: its bus bandwidth is r x the per-GPU NIC rate, at most the intra-node rate (a DP
    group at tp=1 uses all 8 NICs of a DGX node; at tp=8 it has one rank, one NIC, per node).
    """
    inter_bw, inter_lat = cluster.inter_link(gpus)
    inter_bw = np.minimum(inter_bw * np.maximum(rails, 1), max(cluster.intra_bw_gb_s, inter_bw))
    return (np.where(intra, cluster.intra_bw_gb_s, inter_bw),
            np.where(intra, cluster.intra_latency_s, inter_lat))


def _activation_bytes(m: ModelSpec, c: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per layer and micro-batch, bytes (Korthikanti et al. 2022, eqs. 1-3, 16-bit based)."""
    t, sp = c["tp"], c["sequence_parallel"]
    sbh = m.seq * c["micro"] * m.hidden * c["dtype_bytes"] / 2.0
    # softmax/dropout of the s x s scores; fused (flash) attention never materialises them
    attn = np.where(c.get("flash_attention", False), 0.0, 5.0 * m.heads * m.seq / (m.hidden * t))
    linear = np.where(sp, 34.0 / t, 10.0 + 24.0 / t)  # sp shards the 10 sbh of norms/dropout
    full = sbh * (linear + attn)
    stored = np.select(
        [c["recompute"] == 2, c["recompute"] == 1],
        [2.0 * sbh / np.where(sp, t, 1), sbh * linear],  # full keeps the layer input only
        full,
    )
    return {"full": full, "attn": sbh * attn, "stored": stored}


def _compute_times(m: ModelSpec, cl: ClusterSpec, c: dict[str, np.ndarray],
                   act: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per micro-batch on the slowest (last) stage: forward, backward, recompute seconds."""
    s, h = m.seq, m.hidden
    # Every GEMM's size is a multiple of b/t: price each distinct b/t once (a search has few).
    ratio = np.asarray(c["micro"] / c["tp"], dtype=float)
    bt, inverse = np.unique(ratio, return_inverse=True) if ratio.size > 64 else (ratio, None)
    # Forward GEMMs of one layer per GPU (Narayanan et al. 2021: 24 b s h^2 + 4 b s^2 h, / t).
    dense = [6 * bt * s * h * h, 2 * bt * s * h * h, 8 * bt * s * h * h, 8 * bt * s * h * h]
    attn = [2 * bt * s * s * h, 2 * bt * s * s * h]  # Q K^T and scores x V, batched over heads
    t_dense = sum(f / cl.gemm_rate(f) for f in dense)
    t_attn = sum(f / cl.attention_rate(f) for f in attn)
    logit = 2 * bt * s * h * m.vocab
    t_logit = logit / cl.gemm_rate(logit)
    if inverse is not None:
        t_dense, t_attn, t_logit = (np.asarray(x)[inverse.reshape(ratio.shape)] for x in (t_dense, t_attn, t_logit))
    hbm = cl.hbm_gb_s * cl.hbm_efficiency * GB
    # Roofline floor: a GEMM cannot run faster than it streams its weights (12 h^2 / t per layer,
    # vocab h / t for the logits) from memory; binding only at a few tokens per micro-batch. The
    # backward streams them twice (input gradient reads W, weight gradient writes dW). Measured
    # hosts stream them at their own few-token rate (`weight_stream_gb_s`), not the elementwise one.
    stream = cl.weight_stream_gb_s * GB if cl.weight_stream_gb_s > 0 else hbm
    w_dense = 12.0 * h * h / c["tp"] * c["dtype_bytes"] / stream
    w_logit = m.vocab * h / c["tp"] * c["dtype_bytes"] / stream
    t_logit = np.maximum(t_logit, w_logit)
    fwd_layer = np.maximum(t_dense, w_dense) + t_attn + act["full"] / hbm
    # Flash attention's backward recomputes Q K^T (one of the two attention GEMMs) from Q and K.
    t_flash = np.where(c.get("flash_attention", False), 0.5 * t_attn, 0.0)
    bwd_layer = (2.0 * np.maximum(t_dense, w_dense) + 2.0 * t_attn + t_flash
                 + NONGEMM_BWD_FACTOR * act["full"] / hbm)
    rc = c["recompute"]
    re_layer = np.select([rc == 2, rc == 1], [fwd_layer, t_attn + act["attn"] / hbm], 0.0)
    per_stage = m.layers / c["pp"]
    # Host-side framework time (eager dispatch, autograd; 0 on GPU presets), split 1:2 between
    # forward and backward as the GEMMs are; full recomputation replays the forward's share.
    layer_ovh = (cl.overhead_layer_s + np.where(c["tp"] > 1, cl.overhead_tp_layer_s, 0.0)
                 + np.where(c["zero"] >= 2, cl.overhead_fsdp_layer_s, 0.0))
    ovh = per_stage * layer_ovh + cl.overhead_microbatch_s
    re_ovh = np.where(rc == 2, per_stage * cl.overhead_layer_s / 3.0, 0.0)
    return {
        "fwd": per_stage * fwd_layer + t_logit + ovh / 3.0,
        "bwd": per_stage * (bwd_layer + re_layer) + 2.0 * t_logit + 2.0 * ovh / 3.0 + re_ovh,
    }


def _tp_pp_comm(m: ModelSpec, cl: ClusterSpec, gpus: int, c: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per micro-batch: tensor-parallel collectives and pipeline send/recv, seconds."""
    t, b = c["tp"], c["micro"]
    act = b * m.seq * m.hidden * c["dtype_bytes"]
    bw, lat = _link(cl, gpus, t <= cl.gpus_per_node, np.minimum(t, cl.gpus_per_node))
    # 2 all-reduces forward + 2 backward per layer (Shoeybi et al. 2019), 2 more when the full
    # recomputation replays the forward; sp turns each into reduce-scatter + all-gather.
    n_ar = 4 + 2 * (c["recompute"] == 2)
    per_ar = np.where(c["sequence_parallel"],
                      2 * _collective(act, (t - 1) / t, bw, lat, t),
                      _collective(act, 2 * (t - 1) / t, bw, lat, t))
    tp = m.layers / c["pp"] * n_ar * per_ar
    # One activation out and one gradient back per chunk boundary; with the scatter/gather
    # optimisation each tp rank sends 1/t of it (Narayanan et al. 2021, sec. 4.1).
    pbw, plat = cl.measured_link("p2p", _link(cl, gpus, np.full(np.shape(t), gpus <= cl.gpus_per_node)))
    p2p = np.where(c["pp"] > 1, plat + act / t / (pbw * GB), 0.0)
    # Once per step after the schedule: the first and the last stage sum the tied word-embedding
    # gradients (Megatron's embedding group: V h / t bytes over 2 ranks, bus factor 1; V schedules
    # hold both stages on one rank), and the stages sum the gradient norm's squares (one scalar).
    v_shaped = np.isin(c["schedule"], [SCHEDULES.index(name) for name in V_SCHEDULES])
    embedding = np.where(v_shaped, 0.0, _collective(m.vocab * m.hidden / t * c["dtype_bytes"], 1.0, pbw, plat, 2))
    return {"tp": tp, "pp": 2.0 * c["virtual"] * p2p, "step_sync": np.where(c["pp"] > 1, embedding + plat, 0.0)}


def _stage_params(m: ModelSpec, c: dict[str, np.ndarray]) -> np.ndarray:
    """Parameters per GPU of the first stage (it also holds the embeddings)."""
    per_layer = 12.0 * m.hidden**2 + 13.0 * m.hidden
    return m.layers / c["pp"] * per_layer / c["tp"] + m.vocab * m.hidden / c["tp"] + m.seq * m.hidden


def _dp_comm(m: ModelSpec, cl: ClusterSpec, gpus: int, c: dict[str, np.ndarray],
             psi: np.ndarray, times: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Data-parallel / ZeRO traffic per iteration: total and exposed seconds.

    ZeRO-0 all-reduces gradients once; ZeRO-1 reduce-scatters them once and all-gathers the
    updated parameters; ZeRO-2 reduce-scatters every micro-batch (gradients stay sharded);
    ZeRO-3 also all-gathers parameters before forward and backward of every micro-batch. With
    one micro-batch this is 2, 2, 2 and 3 x Psi(n-1)/n bytes (ZeRO-3 = 1.5x, Rajbhandari 2020).
    Overlap: a gradient collective hides under the backward it follows, all but the last bucket.
    ZeRO-3 (and ZeRO-2 as FSDP2 runs it) works block by block: one collective per layer, each
    launched with its own latency, the next block's prefetched under this block's compute.
    """
    d, zero, nmb = c["dp"], c["zero"], c["num_mb"]
    # ranks t apart (tp innermost): a node holds gpus_per_node / t ranks of the group (its rails)
    bw, lat = _link(cl, gpus, c["tp"] * d <= cl.gpus_per_node,
                    np.clip(cl.gpus_per_node // c["tp"], 1, d))
    frac = (d - 1) / d
    ag_bw, ag_lat = cl.measured_link("allgather", (bw, lat))
    rs_bw, rs_lat = cl.measured_link("reduce_scatter", (bw, lat))
    grad_bytes = psi * c["dtype_bytes"] / c["compression_ratio"]
    all_reduce = _collective(grad_bytes, 2 * frac, bw, lat, d)
    reduce_scatter = _collective(grad_bytes, frac, rs_bw, rs_lat, d)
    gather = _collective(psi * c["dtype_bytes"], frac, ag_bw, ag_lat, d)
    broadcast = _collective(psi * c["dtype_bytes"], frac, bw, lat, d)  # ZeroRedundancyOptimizer's shards
    last_bucket = np.minimum(1.0, c["bucket_mb"] * 1e6 / np.maximum(grad_bytes, 1.0))
    n_layers = m.layers / c["pp"]
    # one alpha per FSDP unit, not per model: the blocks and the root (embeddings, head)
    layer_gather = gather + n_layers * np.where(d > 1, ag_lat, 0.0)
    layer_rs = reduce_scatter + n_layers * np.where(d > 1, rs_lat, 0.0)
    ovl = c["overlap_dp"]

    def overlapped(hidden: np.ndarray, cost: np.ndarray) -> np.ndarray:
        if np.ndim(ovl) == 0:  # one setting for every row (a search): skip the select
            return hidden if bool(ovl) else cost
        return np.where(ovl, hidden, cost)

    def hide(cost: np.ndarray, window: np.ndarray, floor: np.ndarray) -> np.ndarray:
        return overlapped(np.maximum(cost - window, cost * floor), cost)

    def hide_blocks(cost: np.ndarray, window: np.ndarray) -> np.ndarray:
        # block i+1's collective runs under block i's compute; the first block's is exposed
        if not cl.fsdp_overlap:  # FSDP2 without device streams: every collective is synchronous
            return cost
        return overlapped(cost / n_layers + (n_layers - 1) / n_layers * np.maximum(cost - window, 0.0), cost)

    # Each compute window hides at most one stream of traffic: ZeRO-3's backward gather and
    # gradient reduce-scatter share the backward (so faster compute can never cost more).
    # ZeRO-1 reduce-scatters (Megatron's distributed optimizer, DeepSpeed); torch's
    # ZeroRedundancyOptimizer behind DDP all-reduces the full gradient, then broadcasts the shards
    z1_ar = (zero == 1) & np.asarray(c.get("zero1_allreduce", False))
    z2_fsdp = (zero == 2) & np.asarray(c.get("zero2_fsdp", False))
    # ZeRO-3 that keeps the gathered blocks until backward moves ZeRO-2 (FSDP2) traffic
    z3_kept = (zero == 3) & ~np.asarray(c.get("reshard_after_forward", True))
    sync = np.where((zero == 0) | z1_ar, all_reduce, reduce_scatter)
    once = hide(sync, times["bwd"], last_bucket)
    rs_mb = hide(reduce_scatter, times["bwd"], last_bucket)  # ZeRO-2 (DeepSpeed), every micro-batch
    z3_mb = hide_blocks(layer_gather, times["fwd"]) + hide_blocks(layer_gather + layer_rs, times["bwd"])
    z2f_mb = hide_blocks(layer_gather, times["fwd"]) + hide_blocks(layer_rs, times["bwd"])
    grad_exposed = np.select([zero == 3, z2_fsdp, zero == 2], [0.0, 0.0, nmb * rs_mb], once)  # z3: in z3_mb
    grad_exposed = np.where(c["co2"], 0.0, grad_exposed)
    # after the step: ZeRO-1 and DeepSpeed-style ZeRO-2 gather the updated shards (exposed)
    final_gather = np.where(z1_ar, broadcast, np.where((zero == 1) | ((zero == 2) & ~z2_fsdp), gather, 0.0))
    z3 = (zero == 3) & ~z3_kept
    blockwise = z2_fsdp | z3_kept
    total = np.select([z3, blockwise, zero == 2],
                      [nmb * (2 * layer_gather + layer_rs), nmb * (layer_gather + layer_rs), nmb * reduce_scatter],
                      sync)
    exposed = grad_exposed + final_gather + nmb * np.select([z3, blockwise], [z3_mb, z2f_mb], 0.0)
    return {"total": total + final_gather, "exposed": exposed}


def _memory(m: ModelSpec, cl: ClusterSpec, c: dict[str, np.ndarray], psi: np.ndarray,
            act: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Bytes per GPU on the most loaded stage (ZeRO: Rajbhandari et al. 2020)."""
    d, zero, db = c["dp"], c["zero"], c["dtype_bytes"]
    opt_bytes = np.where(db == 4, 8.0, 12.0)  # fp32: momentum + variance; 16-bit: + fp32 master
    # ZeRO-3 without resharding holds every gathered block from forward to backward (peak: unsharded)
    params = psi * db / np.where((zero >= 3) & np.asarray(c.get("reshard_after_forward", True)), d, 1)
    grads = psi * db / np.where(zero >= 2, d, 1)
    optimizer = psi * opt_bytes / np.where(zero >= 1, d, 1)
    p, v, nmb = c["pp"], c["virtual"], c["num_mb"]
    # 1F1B keeps min(p, m) micro-batches in flight on the first stage, GPipe all m; the
    # interleaved schedule (1 + (p-1)/(p v)) times more (Korthikanti et al. 2022, sec. 4.2.3).
    in_flight = np.where(p == 1, 1, np.where(c["schedule"] == 1, nmb, np.minimum(nmb, p)))
    in_flight = in_flight * np.where(v > 1, 1 + (p - 1) / (p * v), 1.0)
    logits = 4.0 * c["micro"] * m.seq * m.vocab / c["tp"]  # fp32 logits for the loss
    per_stage = m.layers / p
    first = per_stage * in_flight * act["stored"] + np.where(p == 1, logits, 0.0)
    last = per_stage * act["stored"] + logits
    working = np.where(c["recompute"] == 2, act["full"], 0.0)  # one layer replayed in backward
    activations = np.maximum(first, last) + working
    # ZeRO-3 holds the gathered current and prefetched layer and one layer's full gradients.
    layer = (12.0 * m.hidden**2 + 13.0 * m.hidden) / c["tp"] * db
    params = params + np.where((zero == 3) & (d > 1), 2.0 * layer, 0.0)
    grads = grads + np.where((zero == 3) & (d > 1), layer, 0.0)
    total = params + grads + optimizer + activations
    return {"params": params, "grads": grads, "optimizer": optimizer,
            "activations": activations, "total": total,
            "fits": total <= cl.memory_gb * cl.usable_memory_fraction * GB}


def _flops(m: ModelSpec, c: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(executed, model) FLOPs per iteration (Narayanan et al. 2021, sec. 5.1).

    Per sample and layer, forward: 24 s h^2 + 4 s^2 h; logits 2 s h V; backward is twice the
    forward. Full recomputation replays each layer's forward (-> the 96 B s l h^2 (1 + s/6h +
    V/16lh) formula); selective replays only the attention core (4 s^2 h).
    """
    s, h, lyr = m.seq, m.hidden, m.layers
    layer = 24.0 * s * h * h + 4.0 * s * s * h
    model = c["global_batch"] * (3.0 * lyr * layer + 3.0 * 2.0 * s * h * m.vocab)
    extra = np.select([c["recompute"] == 2, c["recompute"] == 1], [lyr * layer, lyr * 4.0 * s * s * h], 0.0)
    return model + c["global_batch"] * extra, model


def _cp_degree(c: dict[str, np.ndarray]) -> int | None:
    """The rows' context-parallel degree; None when the rows hold several."""
    cp = c.get("cp")
    if cp is None or cp.size == 0:
        return 1
    first = int(cp.flat[0])
    return first if cp.ndim == 0 or not (cp != first).any() else None


def _extend_activations(model: ModelSpec, local: ModelSpec, c: dict[str, np.ndarray],
                        act: dict[str, np.ndarray], cp: int) -> dict[str, np.ndarray]:
    """Issues 18/19: attention scores under cp / long-tail batches, MoE blocks' expert activations."""
    from tuning import sim_context, sim_moe

    act = dict(act)
    extra = act["attn"] * (sim_context.score_memory_scale(c, cp) - 1.0)
    act["attn"], act["full"] = act["attn"] + extra, act["full"] + extra
    act["stored"] = act["stored"] + np.where(c["recompute"] == 0, extra, 0.0)
    if model.experts:  # per layer on average: a stage's MoE blocks / its layers
        moe = sim_moe.activation_delta(local, c) * sim_moe.moe_layer_count(
            model.layers, model.experts, model.moe_every) / model.layers
        act["full"] = act["full"] + moe
        act["stored"] = act["stored"] + np.where(c["recompute"] == 2, 0.0, moe)
    return act


def _extend_times(model: ModelSpec, local: ModelSpec, cluster: ClusterSpec, gpus: int, c: dict[str, np.ndarray],
                  times: dict[str, np.ndarray], cp: int) -> tuple[dict[str, np.ndarray], ...]:
    """Issues 18/19, per micro-batch: (times with attention over cp and expert GEMMs, the compute
    windows other traffic may hide under, all_to_all s, cp comm s)."""
    from tuning import sim_context, sim_moe

    times = sim_context.add_attention(times, local, cluster, c, cp)
    cp_comm, ring_hidden = sim_context.cp_comm_time(local, cluster, gpus, c, cp)
    a2a = np.zeros(np.shape(c["tp"]))
    if model.experts:
        blocks = sim_moe.moe_layer_count(model.layers, model.experts, model.moe_every) / c["pp"]
        delta = blocks * sim_moe.expert_compute_delta(local, cluster, c)
        times = {**times, "fwd": times["fwd"] + delta, "bwd": times["bwd"] + delta * (2.0 + (c["recompute"] == 2))}
        a2a = sim_moe.a2a_time(local, cluster, gpus, c, cp)
    windows = {**times, "fwd": times["fwd"] - ring_hidden["fwd"], "bwd": times["bwd"] - ring_hidden["bwd"]}
    return times, windows, a2a, cp_comm


def evaluate_arrays(model: ModelSpec, cluster: ClusterSpec, gpus: int,
                    cols: dict[str, Any]) -> dict[str, np.ndarray]:
    """Price many configurations at once; `cols` holds equal-length arrays of ParallelSpec fields.

    Codes: recompute 0 none / 1 selective / 2 full (RECOMPUTE); schedule 0 1f1b / 1 gpipe /
    2 interleaved (SCHEDULES). No validation: pass valid rows (see `tuning.search`).
    """
    c = {k: np.asarray(v) for k, v in cols.items()}
    cp = _cp_degree(c)
    if cp is None:  # several cp degrees: one pass each (tuning/sim_context.py)
        from tuning.sim_context import by_degree

        return by_degree(evaluate_arrays, model, cluster, gpus, c)
    c["num_mb"] = c["global_batch"] // (c["dp"] * c["micro"])
    nmb, p, v = c["num_mb"], c["pp"], c["virtual"]
    # issues 18/19: MoE blocks, context parallelism (a rank holds s/cp tokens), long-tail attention
    extended = model.experts > 0 or cp > 1 or bool(np.any(c.get("attn_density", 1.0) != 1.0))
    local = model
    if extended:
        from tuning import sim_context

        local = sim_context.local_model(model, cp)
    act = _activation_bytes(local, c)
    a2a_mb = cp_mb = np.zeros(())
    if extended:
        act = _extend_activations(model, local, c, act, cp)
    times = windows = _compute_times(local, cluster, c, act)
    if extended:
        times, windows, a2a_mb, cp_mb = _extend_times(model, local, cluster, gpus, c, times, cp)
    comm = _tp_pp_comm(local, cluster, gpus, c)
    psi = _stage_params(model, c)
    cg = c if cp == 1 else {**c, "dp": c["dp"] * cp}  # gradients are reduced over dp x cp ranks
    if model.experts:
        from tuning.sim_moe import dp_and_memory

        dp, mem, psi_opt = dp_and_memory(model, local, cluster, gpus, cg, psi, act, windows)
    else:
        dp = _dp_comm(model, cluster, gpus, cg, psi, windows)
        mem = _memory(local, cluster, cg, psi, act)
        psi_opt = psi / np.where(c["zero"] >= 1, cg["dp"], 1)
    per_mb = times["fwd"] + times["bwd"] + comm["tp"] + comm["pp"]
    per_mb = per_mb + a2a_mb + cp_mb
    bubble = schedule_bubble(c["schedule"], p, nmb, v, model.layers, c.get("skip_ratio", 0.0))
    out = {
        "compute_s": nmb * (times["fwd"] + times["bwd"]),
        "tp_comm_s": nmb * comm["tp"],
        "pp_comm_s": nmb * comm["pp"] + comm["step_sync"],  # sends per micro-batch, syncs per step
        # bubble / ideal time from walking the schedule's action list (tuning/sim_schedule.py)
        "bubble_s": bubble * nmb * per_mb,
        "dp_comm_exposed_s": dp["exposed"],
        "optimizer_s": psi_opt * OPTIMIZER_BYTES_PER_PARAM
        / ((cluster.optimizer_gb_s or cluster.hbm_gb_s * cluster.hbm_efficiency) * GB) + cluster.overhead_step_s,
        "all_to_all_s": nmb * a2a_mb,  # MoE dispatch/combine (tuning/sim_moe.py)
        "cp_comm_s": nmb * cp_mb,  # context-parallel exposed communication (tuning/sim_context.py)
    }
    iteration = sum(out.values())
    executed, model_flops = _flops(model, c)
    if extended:
        from tuning import sim_context, sim_moe

        for delta in (sim_moe.flops_delta(model, c), sim_context.flops_delta(model, c)):
            executed, model_flops = executed + delta[0], model_flops + delta[1]
    total_gpus = c["dp"] * c["tp"] * p * cp
    out.update({
        "iteration_time_s": iteration,
        "tokens_per_s": c["global_batch"] * model.seq / iteration,
        "tflops_per_gpu": executed / (iteration * total_gpus) / 1e12,
        "mfu": model_flops / (iteration * total_gpus * cluster.peak_flops),
        "memory_per_gpu_gb": mem["total"] / GB, "fits": mem["fits"],
        "mem_params_gb": mem["params"] / GB, "mem_grads_gb": mem["grads"] / GB,
        "mem_optimizer_gb": mem["optimizer"] / GB, "mem_activations_gb": mem["activations"] / GB,
        "num_microbatches": nmb,
        "bubble_fraction": bubble,
        "dp_comm_total_s": dp["total"], "flops_per_iteration": executed,
        "model_flops_per_iteration": model_flops, "params_per_gpu": psi,
        "expert_params_per_gpu": dp.get("expert_params", np.zeros(())),
    })
    return out


_BREAKDOWN = ("compute", "tp_comm", "pp_comm", "bubble", "dp_comm_exposed", "optimizer")
_MEMORY = ("params", "grads", "optimizer", "activations")


def simulate(model: ModelSpec, cluster: ClusterSpec, par: ParallelSpec, *,
             gpus: int | None = None) -> SimResult:
    """Simulate one iteration of `par`; raises ValueError listing every reason it is invalid."""
    reasons = validate_parallel(model, cluster, par, gpus=gpus)
    if reasons:
        raise ValueError("invalid parallel config: " + "; ".join(reasons))
    r = {k: np.asarray(v).item() for k, v in evaluate_arrays(model, cluster, par.gpus, _arrays(par)).items()}
    result = SimResult(
        iteration_time_s=r["iteration_time_s"],
        breakdown={k: r[f"{k}_s"] for k in _BREAKDOWN},
        tokens_per_s=r["tokens_per_s"], tflops_per_gpu=r["tflops_per_gpu"], mfu=r["mfu"],
        memory_per_gpu_gb=r["memory_per_gpu_gb"],
        memory_breakdown_gb={k: r[f"mem_{k}_gb"] for k in _MEMORY},
        fits=bool(r["fits"]), flops_per_iteration=r["flops_per_iteration"],
        model_flops_per_iteration=r["model_flops_per_iteration"],
        num_microbatches=int(r["num_microbatches"]), bubble_fraction=r["bubble_fraction"],
        dp_comm_total_s=r["dp_comm_total_s"],
        extra={"params_per_gpu": r["params_per_gpu"], "params_total": model.params},
    )
    if model.experts:  # issue 18: the MoE all_to_all as its own entry, active vs total parameters
        result.breakdown["all_to_all"] = r["all_to_all_s"]
        result.extra.update(params_active=model.active_params, expert_params_per_gpu=r["expert_params_per_gpu"])
    if par.cp > 1:  # issue 19: context-parallel communication (exposed)
        result.breakdown["cp_comm"] = r["cp_comm_s"]
    return result


# ---------------------------------------------------------------- run config mapping

_PRECISION_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "fp16": 2, "float16": 2, "bfloat16": 2, "fp8": 1}


def compression_wire_bytes(cfg: dict[str, Any]) -> tuple[float, float]:
    """(wire, dense) bytes one dp rank sends per step for the gradients of the run config `cfg`:
    the engine's own accounting (engine.comm.compress.step_wire_bytes: the same collective,
    all_gather or all_reduce, and bytes as its hooks send) over the engine GPT's parameters
    in DDP's buckets. Top-k and int8 are all_gathers, so their bytes grow with dp - 1."""
    import torch

    from engine.comm.compress import step_wire_bytes
    from engine.config import ModelConfig
    from engine.model import GPT

    mdl, comm = cfg.get("model", {}), cfg.get("comm", {})
    keys = ("layers", "d_model", "heads", "seq_len", "vocab", "mlp_ratio")
    with torch.device("meta"):  # shapes only, no memory
        model = GPT(ModelConfig(**{k: mdl[k] for k in keys if k in mdl}))
    shapes = [tuple(p.shape) for p in model.parameters()]  # parameters(): the tied weight once
    return step_wire_bytes(str(comm.get("compressor", "none")), shapes, int(cfg.get("parallel", {}).get("dp", 1)),
                           density=float(comm.get("density", 0.01)), rank=int(comm.get("rank", 4)),
                           bucket_cap_mb=float(cfg.get("ddp", {}).get("bucket_cap_mb", 25.0)))


def _compression_ratio(cfg: dict[str, Any]) -> float:
    """Dense / wire bytes of the gradient collective at the config's dp (below 1 when an
    all_gather compressor sends more than a dense all_reduce would)."""
    if cfg.get("comm", {}).get("compressor", "none") == "none" or int(cfg.get("parallel", {}).get("dp", 1)) < 2:
        return 1.0
    wire, dense = compression_wire_bytes(cfg)
    return dense / wire if wire > 0 else 1.0


def from_run_config(cfg: dict[str, Any]) -> tuple[ModelSpec, ParallelSpec]:
    """Map a plain nested run-config dict (engine/config.py key names) to the simulator's inputs.

    Reads model.{layers,d_model,heads,seq_len,vocab}, parallel.{dp,tp,pp,zero,virtual,schedule,
    sequence_parallel,reshard_after_forward}, batch.{global,micro}, train.activation_checkpointing, precision,
    comm.{compressor,density,rank}, co2.enabled, ddp.bucket_cap_mb; missing keys take the
    engine's defaults. Issue 18: model.{experts,moe_every,top_k,capacity_factor}, parallel.ep,
    comm.{moe_hierarchical,moe_compression}; issue 19: parallel.{cp,cp_impl,adaptive_sp} and
    data.{lengths,length_mean,length_sigma,length_max} (the long-tail attention density).
    """
    mdl, par, batch = cfg.get("model", {}), cfg.get("parallel", {}), cfg.get("batch", {})
    train, comm, ddp = cfg.get("train", {}), cfg.get("comm", {}), cfg.get("ddp", {})
    model = ModelSpec(layers=int(mdl.get("layers", 2)), hidden=int(mdl.get("d_model", 64)),
                      heads=int(mdl.get("heads", 4)), seq=int(mdl.get("seq_len", 64)),
                      vocab=int(mdl.get("vocab", 256)), experts=int(mdl.get("experts", 0)),
                      moe_every=int(mdl.get("moe_every", 1)), top_k=int(mdl.get("top_k", 2)),
                      capacity_factor=float(mdl.get("capacity_factor", 1.25)))
    spec = ParallelSpec(
        dp=int(par.get("dp", 1)), tp=int(par.get("tp", 1)), pp=int(par.get("pp", 1)),
        virtual=int(par.get("virtual", 1)), zero=int(par.get("zero", 0)),
        schedule=str(par.get("schedule", "1f1b")),
        sequence_parallel=bool(par.get("sequence_parallel", False)),
        micro=int(batch.get("micro", 4)), global_batch=int(batch.get("global", 8)),
        recompute=bool(train.get("activation_checkpointing", False)),
        dtype_bytes=_PRECISION_BYTES.get(str(cfg.get("precision", "fp32")), 4),
        compression_ratio=_compression_ratio(cfg),
        co2=bool(cfg.get("co2", {}).get("enabled", False)),
        bucket_mb=float(ddp.get("bucket_cap_mb", 25.0)),
        zero1_allreduce=True,  # the engine's ZeRO-1 is ZeroRedundancyOptimizer behind DDP
        zero2_fsdp=True,  # the engine's ZeRO-2 is FSDP2 per block with reshard_after_forward=False
        flash_attention=True,  # the engine's attention is scaled_dot_product_attention (fused, no s x s scores)
        reshard_after_forward=bool(par.get("reshard_after_forward", True)),
    )
    from tuning import sim_context, sim_moe

    spec.ep, spec.cp, spec.cp_impl = int(par.get("ep", 1)), int(par.get("cp", 1)), str(par.get("cp_impl", "ulysses"))
    spec.adaptive_sp = bool(par.get("adaptive_sp", False))
    spec.moe_hierarchical = bool(comm.get("moe_hierarchical", False))
    spec.moe_a2a_ratio = sim_moe.LSH_A2A_RATIO if comm.get("moe_compression", "none") == "lsh" else 1.0
    spec.moe_padded = False  # the engine dispatches with variable splits, dropping beyond capacity
    spec.attn_density = sim_context.density_from_config(cfg.get("data", {}), model.seq)
    return model, spec
