"""Tensor parallelism in the simulator (engine/parallel/tensor.py): the per-layer collectives.

Each layer does 4 all-reduces of b s h x dtype bytes (2 forward, 2 backward; Shoeybi et al.
2019), 2 more when full recomputation replays the forward; with sequence parallelism each becomes
a reduce-scatter + all-gather of the same bytes and twice the latency (Korthikanti et al. 2022).
The group is on NVLink while t <= gpus_per_node, otherwise across nodes; on an NCCL cluster each collective takes
NCCL's own cost model (`tuning.sim.comm.nccl_collective`: a tp 8 all-reduce of 4 MB on NVLink 71 us, at tp 2 33 us).

The engine (engine/parallel/tensor.py: q, k, v, gate and up column-parallel, o and down row-parallel, DTensor
plans) reduces in forward the two row-parallel outputs in the run's dtype and in backward each column-parallel
projection's input gradient on its own, in its hidden states' dtype (`tuning.sim.spec.weight_bytes`: fp32
under autocast over fp32 parameters, which casts the gradient back to its fp32 input; bf16 where FSDP2's
mixed precision computes on bf16 weights): 3 + (MLP matrices - 1) of them. Under activation checkpointing
torch's non-reentrant checkpoint replays the layer only until its saved tensors are back (early stop), which
redoes the attention output's all-reduce and not the MLP's: one more forward all-reduce (a 1-layer tp2 dry
run: 2 + 5 without, 3 + 5 with, `tests/test_sim_vs_dryrun.py`).

With Megatron-core's --tp-comm-overlap (`tp_comm_overlap`, sequence parallelism on), Transformer
Engine's userbuffers split each all-gather into t ring-exchange chunks consumed by the GEMM it feeds
and each reduce-scatter into chunks that follow the GEMM producing them (TE's ub_tp_comm_overlap_cfg:
ring_exchange / pipeline methods; Wang et al. 2023, "Overlap communication with dependent computation
via decomposition"): one chunk in t stays exposed, and the rest whatever the layer's GEMMs cannot cover.
"""
from __future__ import annotations

import numpy as np

from tuning.sim.hardware import ClusterSpec
from tuning.sim.comm import link, nccl_collective
from tuning.sim.spec import ModelSpec, engine_rows, weight_bytes


def tp_comm_time(m: ModelSpec, cl: ClusterSpec, gpus: int, c: dict[str, np.ndarray],
                 gemm: np.ndarray | None = None) -> np.ndarray:
    """Exposed tensor-parallel collective seconds per micro-batch on one stage; `gemm` is the stage's
    dense GEMM seconds per micro-batch, the window overlapped collectives (`tp_comm_overlap`) run under."""
    t = c["tp"]
    per_node = np.minimum(t, cl.gpus_per_node)
    bw, lat = link(cl, gpus, t <= cl.gpus_per_node, per_node)
    total = 0.0
    for n_ar, act in tp_messages(m, c):
        per_ar = np.where(c["sequence_parallel"],
                          nccl_collective(cl, act, "reduce_scatter", bw, lat, t, per_node)
                          + nccl_collective(cl, act, "all_gather", bw, lat, t, per_node),
                          nccl_collective(cl, act, "all_reduce", bw, lat, t, per_node))
        total = total + m.layers / c["pp"] * n_ar * per_ar
    overlap = np.asarray(c.get("tp_comm_overlap", False)) & np.asarray(c["sequence_parallel"]) & (t > 1)
    if gemm is None or not np.any(overlap):
        return total
    return np.where(overlap, np.maximum(total / t, total - gemm), total)


def tp_messages(m: ModelSpec, c: dict[str, np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(all-reduces per layer and micro-batch, bytes of each: b s h x the element size) on a tp rank; each
    is a reduce-scatter + all-gather of the same bytes with sequence parallelism (the module docstring)."""
    act = c["micro"] * m.seq * m.hidden * c["dtype_bytes"]
    n_ar = 4 + 2 * (c["recompute"] == 2)
    engine = engine_rows(c)
    if not np.any(engine):
        return [(n_ar, act)]
    forward = np.where(engine, 2 + (c["recompute"] == 2), n_ar)
    backward = np.where(engine, 3 + m.mlp_mats - 1, 0)
    return [(forward, act), (backward, c["micro"] * m.seq * m.hidden * weight_bytes(c, engine))]
