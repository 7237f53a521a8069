"""Data parallelism and ZeRO in the simulator (engine/parallel/{data,zero}.py): gradient and
parameter traffic, what of it hides under compute, and the model-state bytes per GPU.

ZeRO-0 all-reduces gradients once; ZeRO-1 reduce-scatters them once and all-gathers the updated
parameters; ZeRO-2 reduce-scatters every micro-batch (gradients stay sharded) and gathers the
parameters once per step (after it in DeepSpeed, before the first forward in the engine; FSDP1 under
Composer re-gathers in every micro-batch, `Framework.zero2_gather_once`); ZeRO-3 also
all-gathers parameters before forward and backward of every micro-batch. With one micro-batch this
is 2, 2, 2 and 3 x Psi(n-1)/n bytes (ZeRO-3 = 1.5x, Rajbhandari et al. 2020). ZeRO-3 (and ZeRO-2 as
FSDP2 runs it) works block by block: one collective per block (FSDP's flat buffer) or one per
parameter tensor (DeepSpeed stage 3, `Framework.zero3_per_parameter`), each with its own latency,
the next block's prefetched under this block's compute, at the framework's fitted share of the
link's bandwidth (`Framework.zero3_bw_efficiency`).

Message sizes (`dp_messages`, also what tuning/sim/dryrun.py sets beside a dry run): the row's dtype per
element, but for the engine its parameters' and gradients' (`tuning.sim.spec.weight_bytes`, `comm_bytes`):
fp32 under autocast (ZeRO-0/1, fp32 runs), and at ZeRO-2/3 with bf16 FSDP2's MixedPrecisionPolicy gathers
bf16 copies (2 bytes) and reduce-scatters fp32 gradients (4 bytes). Under torch's pipelining the engine's FSDP2 keeps
each stage unsharded across its micro-batches (`backward_maybe_with_nosync`: no reshard after backward, no
gradient sync before the last micro-batch): every micro-batch's forward gathers the stage (ZeRO-3), the
first backward gathers it once more, and the gradients are reduce-scattered once.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from tuning.sim.hardware import ClusterSpec
from tuning.sim.comm import collective, link, nccl_collective
from tuning.sim.framework import per_row
from tuning.sim.spec import ModelSpec, engine_rows, reduce_bytes, weight_bytes


def _links(cl: ClusterSpec, gpus: int, c: dict[str, np.ndarray]) -> dict[str, Any]:
    """The dp group's (busbw, latency) for all-reduce, all-gather and reduce-scatter: ranks t apart
    (tp innermost), so a node holds gpus_per_node / t ranks of the group (its rails)."""
    d = c["dp"]
    per_node = np.clip(cl.gpus_per_node // c["tp"], 1, d)
    bw, lat = link(cl, gpus, c["tp"] * d <= cl.gpus_per_node, per_node)
    return {"ar": (bw, lat), "ag": cl.measured_link("allgather", (bw, lat)),
            "rs": cl.measured_link("reduce_scatter", (bw, lat)), "per_node": per_node}


def dp_comm(m: ModelSpec, cl: ClusterSpec, gpus: int, c: dict[str, np.ndarray], psi: np.ndarray,
            times: dict[str, np.ndarray], frameworks: Any = None) -> dict[str, np.ndarray]:
    """Data-parallel / ZeRO traffic per iteration: total and exposed seconds."""
    d, zero, nmb = c["dp"], c["zero"], c["num_mb"]
    lk = _links(cl, gpus, c)
    frac = (d - 1) / d
    fw = c.get("framework", np.asarray(0))
    eff = per_row(fw, "zero3_bw_efficiency", frameworks)
    interference = per_row(fw, "overlap_interference", frameworks)
    engine = engine_rows(c)
    el, gathered = reduce_bytes(c, engine), psi * weight_bytes(c, engine)
    grad_bytes = psi * el / c["compression_ratio"]
    # ZeRO-0/1/2's whole-model collectives at the framework's share of the bus bandwidth (fitted; 1 but
    # for DeepSpeed, whose stage 1/2 reduce in buckets through flatten/copy kernels)
    share = per_row(fw, "dp_bw_efficiency", frameworks)
    def nccl(nbytes: np.ndarray, op: str, key: str) -> np.ndarray:
        # NCCL's latency model (tuning.sim.comm) where the cluster runs NCCL; a host's in-situ alphas otherwise
        return nccl_collective(cl, nbytes, op, lk[key][0] * share, lk[key][1], d, lk["per_node"])

    # the gradients are reduced bucket by bucket, each bucket a collective with its own latency (at dp 512 across 64
    # nodes NCCL's fastest, the LL128 tree, pays 0.12 ms a call: tuning.sim.comm)
    buckets = np.maximum(grad_bytes / _bucket_bytes(c, fw, frameworks, el), 1.0)
    all_reduce = buckets * nccl(grad_bytes / buckets, "all_reduce", "ar")
    reduce_scatter = buckets * nccl(grad_bytes / buckets, "reduce_scatter", "rs")
    gather = nccl(gathered, "all_gather", "ag")
    last_bucket = np.minimum(1.0, c["bucket_mb"] * 1e6 / np.maximum(grad_bytes, 1.0))
    n_layers = m.layers / c["pp"]

    # each block's own collectives (ZeRO-3, FSDP ZeRO-2), priced only where some row runs them: one alpha
    # per FSDP unit (the blocks and the root), or per parameter tensor (DeepSpeed stage 3)
    @functools.cache
    def units() -> np.ndarray:
        return n_layers * np.where(per_row(fw, "zero3_per_parameter", frameworks) > 0, m.param_tensors_per_layer, 1)

    @functools.cache
    def block_gather() -> np.ndarray:
        return collective(gathered, frac, lk["ag"][0] * eff, lk["ag"][1], d) + units() * np.where(d > 1, lk["ag"][1], 0.0)

    @functools.cache
    def block_rs() -> np.ndarray:
        return collective(grad_bytes, frac, lk["rs"][0] * eff, lk["rs"][1], d) + units() * np.where(d > 1, lk["rs"][1], 0.0)

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
        hidden = (n_layers - 1) / n_layers * (np.maximum(cost - window, 0.0) + interference * np.minimum(cost, window))
        return overlapped(cost / n_layers + hidden, cost)

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

    @functools.cache
    def gather_fwd() -> np.ndarray:  # a block's gather under the previous block's forward
        return hide_blocks(block_gather(), times["fwd"])

    @functools.cache
    def both_bwd() -> np.ndarray:  # ZeRO-3's backward gather and reduce-scatter under the backward
        return hide_blocks(block_gather() + block_rs(), times["bwd"])

    grad_exposed = _select([(zero == 3, lambda: 0.0), (z2_fsdp, lambda: 0.0),  # ZeRO-3's: in its micro-batch terms
                            # ZeRO-2 (DeepSpeed) reduce-scatters every micro-batch
                            (zero == 2, lambda: nmb * hide(reduce_scatter, times["bwd"], last_bucket))], once)
    if np.any(c["co2"]):
        grad_exposed = np.where(c["co2"], 0.0, grad_exposed)
    # after the step: ZeRO-1 and DeepSpeed-style ZeRO-2 gather the updated shards (exposed)
    final_gather = np.where((zero == 1) | ((zero == 2) & ~z2_fsdp), gather, 0.0)
    if np.any(z1_ar):  # ZeroRedundancyOptimizer broadcasts its shards
        final_gather = np.where(z1_ar, collective(gathered, frac, lk["ar"][0] * share, lk["ar"][1], d), final_gather)
    # Megatron-core's --overlap-param-gather: the updated shards' all-gather runs bucket by bucket under
    # the next step's first forward (megatron/core/distributed/param_and_grad_buffer.py), the first exposed
    param_overlap = (per_row(fw, "overlap_param_gather", frameworks) > 0) & (zero == 1) & ~z1_ar
    final_exposed = np.where(param_overlap, hide(final_gather, times["fwd"], last_bucket), final_gather) \
        if np.any(param_overlap) else final_gather
    z3 = (zero == 3) & ~z3_kept
    kept = _pipelined_fsdp(c, engine) & z3  # the engine's ZeRO-3 under pipelining: nmb + 1 gathers, one reduce
    # the engine's ZeRO-2 gathers each block once per step, before the first micro-batch's forward
    # (engine/parallel/zero.py keep_gathered); FSDP1 as Composer runs it re-gathers every micro-batch
    once_z2 = z2_fsdp & (per_row(fw, "zero2_gather_once", frameworks) > 0)
    blockwise = (z2_fsdp & ~once_z2) | z3_kept
    total = _select([(kept, lambda: (nmb + 1) * block_gather() + block_rs()),
                     (z3, lambda: nmb * (2 * block_gather() + block_rs())),
                     (blockwise, lambda: nmb * (block_gather() + block_rs())),
                     (once_z2, lambda: block_gather() + nmb * block_rs()), (zero == 2, lambda: nmb * reduce_scatter)], sync)
    exposed = grad_exposed + final_exposed + _select([
        (kept, lambda: nmb * gather_fwd() + both_bwd()), (z3, lambda: nmb * (gather_fwd() + both_bwd())),
        (blockwise, lambda: nmb * (gather_fwd() + hide_blocks(block_rs(), times["bwd"]))),
        (once_z2, lambda: gather_fwd() + nmb * hide_blocks(block_rs(), times["bwd"]))], 0.0)
    return {"total": total + final_gather, "exposed": exposed}


def _bucket_bytes(c: dict[str, np.ndarray], fw: Any, frameworks: Any, el: Any) -> np.ndarray:
    """Bytes of one gradient bucket (`Framework.bucket_elems`): the framework's own rule where it has one; else the
    row's `bucket_mb` where the reduction overlaps the backward, and the whole buffer (infinite) where it does not."""
    per_dp_rank = per_row(fw, "bucket_elems_per_dp_rank", frameworks)
    own = np.maximum(per_row(fw, "bucket_elems", frameworks), per_dp_rank * c["dp"]) * el
    row = np.where(c["overlap_dp"], c["bucket_mb"] * 1e6, np.inf)
    # megatron-core without --overlap-grad-reduce reduces one bucket (bucket_size None)
    unbucketed = (per_dp_rank > 0) & ~np.asarray(c["overlap_dp"])
    return np.where(unbucketed, np.inf, np.where(own > 0, own, row))


def _select(choices: list[tuple[Any, Any]], default: Any) -> Any:
    """`np.select` over the (condition, value thunk) pairs that some row meets: a variant no row runs
    (a search runs few) is never priced; the first condition met wins, as in `np.select`."""
    met = [(condition, value()) for condition, value in choices if np.any(condition)]
    return np.select(*zip(*met), default) if met else default


def _pipelined_fsdp(c: dict[str, np.ndarray], engine: Any) -> Any:
    """Rows whose FSDP2 runs under torch's pipelining (the engine at pp > 1, ZeRO-2/3)."""
    if not np.any(engine):
        return False
    return engine & (np.asarray(c.get("pp", 1)) > 1) & (c["zero"] >= 2)


def dp_messages(c: dict[str, np.ndarray], psi: Any) -> dict[str, Any]:
    """Bytes one rank of the ZeRO group (`c["dp"]` ranks) moves per step, by collective, in nccl-tests sizes
    (an all-gather's output, a reduce-scatter's input, an all-reduce's buffer), for `psi` parameters on it:
    ZeRO-0 all-reduces the gradients once; ZeRO-1 reduce-scatters them and gathers the parameters (torch's
    ZeroRedundancyOptimizer, `zero1_allreduce`: all-reduce, then broadcast); ZeRO-2 gathers once (FSDP2 with
    `zero2_gather_once`; FSDP1 under Composer every micro-batch) and reduce-scatters every micro-batch;
    ZeRO-3 gathers twice per micro-batch (once without resharding) and reduce-scatters every micro-batch;
    the engine under pipelining as the module docstring says."""
    zero, nmb = c["zero"], c["num_mb"]
    engine = engine_rows(c)
    params = psi * weight_bytes(c, engine)
    grads = psi * reduce_bytes(c, engine) / c["compression_ratio"]
    z1_ar = (zero == 1) & np.asarray(c.get("zero1_allreduce", False))
    z2_fsdp = (zero == 2) & np.asarray(c.get("zero2_fsdp", False))
    z3_kept = (zero == 3) & ~np.asarray(c.get("reshard_after_forward", True))
    once_z2 = z2_fsdp & (per_row(c.get("framework", np.asarray(0)), "zero2_gather_once") > 0)
    pipelined = _pipelined_fsdp(c, engine)
    gathers = np.select([pipelined & (zero == 3) & ~z3_kept, pipelined, zero == 3, z2_fsdp & ~once_z2, zero >= 1],
                        [nmb + 1, 1, np.where(z3_kept, 1, 2) * nmb, nmb, np.where(z1_ar, 0, 1)], 0)
    scatters = np.select([pipelined, zero >= 2, zero == 1], [1, nmb, np.where(z1_ar, 0, 1)], 0)
    grouped = np.asarray(c["dp"]) > 1
    return {"all_gather": np.where(grouped, gathers * params, 0.0),
            "reduce_scatter": np.where(grouped, scatters * grads, 0.0),
            "all_reduce": np.where(grouped & ((zero == 0) | z1_ar), grads, 0.0),
            "broadcast": np.where(grouped & z1_ar, params, 0.0)}


def state_bytes(m: ModelSpec, c: dict[str, np.ndarray], psi: np.ndarray,
                frameworks: Any = None) -> dict[str, np.ndarray]:
    """Parameter, gradient and optimizer bytes per GPU (Rajbhandari et al. 2020): mixed-precision Adam
    16 bytes per parameter (fp32: 4 + 4 + 8), ZeRO sharding over dp; ZeRO-3 also holds the gathered
    current and prefetched unit and one unit of gradients: a block (FSDP's flat buffer), or the
    largest parameter tensor (DeepSpeed stage 3 gathers tensor by tensor)."""
    d, zero, db = c["dp"], c["zero"], c["dtype_bytes"]
    opt_bytes = np.where(db == 4, 8.0, 12.0)  # fp32: momentum + variance; 16-bit: + fp32 master
    # ZeRO-3 without resharding holds every gathered block from forward to backward (peak: unsharded)
    params = psi * db / np.where((zero >= 3) & np.asarray(c.get("reshard_after_forward", True)), d, 1)
    grads = psi * db / np.where(zero >= 2, d, 1)
    optimizer = psi * opt_bytes / np.where(zero >= 1, d, 1)
    largest = max(m.hidden * (m.q_dim + 2 * m.kv_dim), m.hidden * m.ffn * (2 if m.gated_mlp else 1))
    per_param = per_row(c.get("framework", np.asarray(0)), "zero3_per_parameter", frameworks) > 0
    layer = np.where(per_param, largest, m.dense_layer_params) / c["tp"] * db
    params = params + np.where((zero == 3) & (d > 1), 2.0 * layer, 0.0)
    grads = grads + np.where((zero == 3) & (d > 1), layer, 0.0)
    return {"params": params, "grads": grads, "optimizer": optimizer}


def engine_zero1_optimizer(m: ModelSpec, c: dict[str, np.ndarray], k: dict[str, np.ndarray], psi: Any,
                           even: Any) -> Any:
    """The optimizer states of the rank a dry run plays (rank 0) under the engine's ZeRO-1 (`even`: an even
    share, elsewhere). ZeroRedundancyOptimizer and DTensorZeroOptimizer (engine/parallel/zero.py) hand out whole
    local parameters, largest first onto the least-loaded rank, so rank 0 holds the largest tensor's states
    whenever it outweighs an even share: Llama-3.1-8B at dp x cp = 64 (`c["dp"]` is the ZeRO group) holds the
    525M-parameter embedding's, 4.2 GB, not 1.0 GB (measured by the dry run, engine/train/dryrun.py)."""
    largest = np.maximum(m.vocab * m.hidden, m.hidden * m.ffn) / c["tp"]
    whole = engine_rows(c) & (np.asarray(c["zero"]) == 1) & (np.asarray(c["dp"]) > 1) & (np.asarray(c["pp"]) == 1)
    return np.where(whole, k["optimizer"] * np.maximum(psi / c["dp"], largest), even)
