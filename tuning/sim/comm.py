"""Collective costs of the simulator: the alpha-beta model with nccl-tests bus factors (formulas.md).

Every technique module prices its traffic with these: a collective of `bytes` per rank over a
group of n ranks costs alpha + bytes x factor / busbw; `link` picks the group's bus bandwidth and
latency from where its ranks sit (inside a node, or across nodes on as many NICs as the group has
ranks per node); `all_to_all_time` prices the MoE and Ulysses all-to-alls. On clusters that run NCCL (`ClusterSpec.nccl_tuning`)
an all-reduce, all-gather or reduce-scatter takes NCCL's own latency model instead of one flat alpha
(`nccl_collective`): a ring's latency grows with its steps, and an all-reduce across nodes takes the faster of
the ring and the tree, as NCCL's tuner picks.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from tuning.sim.hardware import GB, ClusterSpec


def collective(nbytes: Any, factor: Any, bw_gb_s: Any, alpha_s: Any, n: Any) -> np.ndarray:
    """alpha + bytes * factor / busbw (formulas.md); zero for a group of one."""
    return np.where(np.asarray(n) > 1, alpha_s + nbytes * factor / (bw_gb_s * GB), 0.0)


# NCCL's cost model of its collectives, NVIDIA/nccl@01afd20a77b5804e0ecf1042509dd9d20ebf9e93 src/graph/tuning.cc
# (ncclTopoTuneModel, NCCL 2.7.5, June 2020, the NCCL the first A100 clusters ran; the ring's constants stay the same
# through 2.15, the tree's network step became 28 us in 2.9), Simple protocol (the one large messages use):
# a ring of n ranks on N nodes takes nsteps = 2(n-1) steps for an all-reduce, n-1 for an all-gather or reduce-scatter,
# of which 2(N-1) (N-1) cross the network; latency = baseLat[Ring][Simple] 8.4 us + intra steps x hwLat[NVLink][Ring]
# [Simple] 3.4 us + inter steps x hwLat[NET][Ring][Simple] 9.6 us, x 1.9 for a multi-node ring all-reduce ("plateau
# effect of ring", ncclTopoGetAlgoTime). The tree (all-reduce only): 2 ((n/N - 1) x 28 us + log2(N) x 50 us), its
# algorithm bandwidth half of min(0.9 busBw, 80 GB/s above 2 nodes, 110 GB/s at 2): bytes x 2 / that.
NCCL_RING_BASE_S = 8.4e-6
NCCL_RING_STEP_S = {"nvlink": 3.4e-6, "net": 9.6e-6}
NCCL_RING_PLATEAU = 1.9
NCCL_TREE_STEP_S = {"nvlink": 28e-6, "net": 50e-6}
NCCL_TREE_MAX_BUSBW_GB_S = {"two_nodes": 110.0, "more": 80.0}


def nccl_collective(cl: ClusterSpec, nbytes: Any, op: str, bw_gb_s: Any, alpha_s: Any, n: Any,
                    per_node: Any) -> np.ndarray:
    """Seconds of one `op` ("all_reduce", "all_gather", "reduce_scatter") of `nbytes` per rank (nccl-tests sizes)
    over n ranks, `per_node` of them in each node, at bus bandwidth `bw_gb_s`: NCCL's latency model (above) where
    the cluster runs NCCL, else the flat `alpha_s`; zero for a group of one."""
    n = np.asarray(n)
    factor = (2.0 if op == "all_reduce" else 1.0) * (n - 1) / np.maximum(n, 1)
    if not cl.nccl_tuning:
        return collective(nbytes, factor, bw_gb_s, alpha_s, n)
    per_node = np.clip(per_node, 1, np.maximum(n, 1))
    nodes = np.ceil(n / per_node)
    k = 2.0 if op == "all_reduce" else 1.0
    steps, inter = k * (n - 1), k * (nodes - 1)
    ring_lat = NCCL_RING_BASE_S + (steps - inter) * NCCL_RING_STEP_S["nvlink"] + inter * NCCL_RING_STEP_S["net"]
    ring = ring_lat + nbytes * factor / (bw_gb_s * GB)
    if op == "all_reduce":
        ring = ring + np.where(nodes > 1, (NCCL_RING_PLATEAU - 1.0) * ring_lat, 0.0)
        tree_bw = np.minimum(0.9 * bw_gb_s, np.where(nodes > 2, NCCL_TREE_MAX_BUSBW_GB_S["more"],
                                                     NCCL_TREE_MAX_BUSBW_GB_S["two_nodes"]))
        tree = (2.0 * ((per_node - 1) * NCCL_TREE_STEP_S["nvlink"] + np.log2(nodes) * NCCL_TREE_STEP_S["net"])
                + nbytes * 2.0 / (tree_bw * GB))
        ring = np.where(nodes > 1, np.minimum(ring, tree), ring)
    return np.where(n > 1, ring, 0.0)


def link(cluster: ClusterSpec, gpus: int, intra: Any, rails: Any = 1) -> tuple[np.ndarray, np.ndarray]:
    """(busbw GB/s, latency s) of a group; `rails` = the group's ranks per node.

    Across nodes NCCL runs one ring per NIC, so a group with r ranks in each node drives r NICs
    at once: its bus bandwidth is r x the per-GPU NIC rate, at most the intra-node rate (a DP
    group at tp=1 uses all 8 NICs of a DGX node; at tp=8 it has one rank, one NIC, per node).
    """
    inter_bw, inter_lat = cluster.inter_link(gpus)
    inter_bw = np.minimum(inter_bw * np.maximum(rails, 1), np.maximum(cluster.intra_bw_gb_s, inter_bw))
    return (np.where(intra, cluster.intra_bw_gb_s, inter_bw),
            np.where(intra, cluster.intra_latency_s, inter_lat))


def all_to_all_time(cl: ClusterSpec, gpus: int, nbytes: np.ndarray, n: np.ndarray, stride: np.ndarray,
                    hierarchical: Any = False) -> np.ndarray:
    """One all_to_all of `nbytes` per rank in a group of n ranks `stride` apart, seconds.

    Flat: (n-1) alpha + bytes (n-1)/n / busbw (nccl-tests factor; one message per peer), on the
    intra-node link when the group's n x stride ranks fit in a node, else on each rank's NIC.
    Hierarchical (DeepSpeed-MoE, SE-MoE): an all_to_all among the r ranks of the group inside a
    node, then one among the n/r nodes: (r-1) alpha_intra + bytes (r-1)/r / intra + (N-1)
    alpha_inter + bytes (N-1)/N / NIC. A group of one costs nothing.
    """
    n = np.asarray(n)
    inter_bw, inter_lat = cl.inter_link(gpus)
    inside = n * stride <= cl.gpus_per_node
    frac = (n - 1) / np.maximum(n, 1)
    flat = np.where(inside, (n - 1) * cl.intra_latency_s + nbytes * frac / (cl.intra_bw_gb_s * GB),
                    (n - 1) * inter_lat + nbytes * frac / (inter_bw * GB))
    if not np.any(hierarchical):
        return np.where(n > 1, flat, 0.0)
    r = np.clip(cl.gpus_per_node // np.maximum(stride, 1), 1, n)  # group ranks per node
    nodes = np.maximum(n // r, 1)
    hier = ((r - 1) * cl.intra_latency_s + nbytes * (r - 1) / r / (cl.intra_bw_gb_s * GB)
            + (nodes - 1) * inter_lat + nbytes * (nodes - 1) / nodes / (inter_bw * GB))
    return np.where(n > 1, np.where(np.asarray(hierarchical) & ~inside, hier, flat), 0.0)
