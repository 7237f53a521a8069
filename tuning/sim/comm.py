"""Collective costs of the simulator: the alpha-beta model with nccl-tests bus factors (formulas.md).

Every technique module prices its traffic with these: a collective of `bytes` per rank over a
group of n ranks costs alpha + bytes x factor / busbw; `link` picks the group's bus bandwidth and
latency from where its ranks sit (inside a node, or across nodes on as many NICs as the group has
ranks per node); `all_to_all_time` prices the MoE and Ulysses all-to-alls. On clusters that run NCCL
(`ClusterSpec.nccl_tuning`) an all-reduce, all-gather or reduce-scatter takes NCCL's own cost model instead of
one flat alpha (`nccl_collective`): a ring's latency grows with its steps, and NCCL's tuner picks the fastest of its
rings and trees over its three protocols.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from tuning.sim.hardware import GB, ClusterSpec


def collective(nbytes: Any, factor: Any, bw_gb_s: Any, alpha_s: Any, n: Any) -> np.ndarray:
    """alpha + bytes * factor / busbw (formulas.md); zero for a group of one."""
    return np.where(np.asarray(n) > 1, alpha_s + nbytes * factor / (bw_gb_s * GB), 0.0)


# NCCL's cost model of its collectives, NVIDIA/nccl@01afd20a77b5804e0ecf1042509dd9d20ebf9e93 src/graph/tuning.cc
# (ncclTopoTuneModel and ncclTopoGetAlgoTime of NCCL 2.7.5, June 2020, the NCCL the first A100 clusters ran; the ring's
# constants stay the same through 2.15), which NCCL's tuner evaluates for every algorithm and protocol to pick the
# fastest: a ring of n ranks on N nodes takes nsteps = 2(n-1) steps for an all-reduce, n-1 for an all-gather or
# reduce-scatter, of which 2(N-1) (N-1) cross the network; the tree (all-reduce) 2 ((n/N - 1) intra + log2(N) inter).
# Per protocol (LL, LL128, Simple), microseconds:
NCCL_PROTOCOLS = ("LL", "LL128", "Simple")
NCCL_BASE_US = {"ring": (3.6, 10.0, 8.4), "tree": (4.4, 4.4, 0.0)}  # baseLat
NCCL_STEP_US = {"ring": {"nvlink": (0.47, 1.9, 3.4), "net": (2.7, 4.0, 9.6)},  # hwLat
                "tree": {"nvlink": (0.52, 1.2, 28.0), "net": (5.0, 8.5, 50.0)}}
NCCL_SM80_MAX_BUSBW_GB_S = 235.0  # "if (compCap80) busBw = std::min(busBw, 235.0f)"
NCCL_LL128_MAX_BW_PER_CHANNEL = {"all_gather": 18.3, "reduce_scatter": 15.2, "all_reduce": 16.7}  # ll128MaxBwPerCh
# maxTreeBw on sm80, (Simple / LL, LL128) GB/s: above two nodes, at most two
NCCL_TREE_MAX_BUSBW_GB_S = {"more": (80.0, 105.0), "two": (110.0, 130.0)}
# treeCorrectionFactor: the tree's bandwidth at log2(bytes / 64) = 0..21 ("not perfectly sticking to the model for
# medium sizes")
NCCL_TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .5, .6, .6, .7, .7, .8, .9, .9, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7, .8, .9))
NCCL_RING_PLATEAU = 1.9  # a multi-node ring all-reduce on Simple: "Plateau effect of ring"


def _ring_time(cl: ClusterSpec, nbytes: Any, op: str, bus: Any, n: Any, per_node: Any, nodes: Any,
               p: int) -> np.ndarray:
    """NCCL 2.7.5's time of `op` on its ring at protocol p (index in NCCL_PROTOCOLS)."""
    k = 2.0 if op == "all_reduce" else 1.0
    steps, inter = k * (n - 1), k * (nodes - 1)
    if p == 0:  # LL: 8-byte lines, half of them flags; a quarter of the bandwidth across nodes or for an all-reduce
        bus = bus * np.where((nodes > 1) | (op == "all_reduce"), 1 / 4, 1 / 3)
    elif p == 1:  # LL128: 120 of 128 bytes data, less where a GPU sends and receives through one NIC
        bus = np.minimum(bus * np.where(per_node < 2, 0.7, 0.92),
                         NCCL_LL128_MAX_BW_PER_CHANNEL[op] * max(cl.nccl_channels, 1))
    intra = NCCL_STEP_US["ring"]["nvlink"][p] * np.where((nodes > 1) & (p == 0), 1.8, 1.0)
    lat = (NCCL_BASE_US["ring"][p] + (steps - inter) * intra + inter * NCCL_STEP_US["ring"]["net"][p]) * 1e-6
    if p == 2 and op == "all_reduce":
        lat = lat * np.where((nodes > 1) & (nbytes >= n / 16.0 * 65536), NCCL_RING_PLATEAU, 1.0)
    return lat + nbytes * steps / np.maximum(n, 1) / (bus * GB)


def _tree_time(cl: ClusterSpec, nbytes: Any, bus: Any, per_node: Any, nodes: Any, p: int) -> np.ndarray:
    """NCCL 2.7.5's time of an all-reduce on its tree at protocol p; its algorithm bandwidth is half the bus's."""
    cap = np.where(nodes > 2, NCCL_TREE_MAX_BUSBW_GB_S["more"][p == 1], NCCL_TREE_MAX_BUSBW_GB_S["two"][p == 1])
    bus = np.minimum(bus * 0.9, cap)
    if p == 0:
        bus = bus / 3.8
    elif p == 1:
        bus = np.minimum(bus * np.where(nodes == 1, 7 / 9, 0.915),
                         NCCL_LL128_MAX_BW_PER_CHANNEL["all_reduce"] * max(cl.nccl_channels, 1) * 7 / 9)
    log_size = np.floor(np.log2(np.maximum(nbytes, 64.0) / 64.0)).astype(int)
    bus = bus * np.where(log_size < 22, np.asarray(NCCL_TREE_CORRECTION[p])[np.clip(log_size, 0, 21)], 1.0)
    intra = NCCL_STEP_US["tree"]["nvlink"][p] * np.where((nodes > 1) & (p == 0), 1.8, 1.0)
    depth = np.floor(np.log2(np.maximum(nodes, 1)))
    lat = (NCCL_BASE_US["tree"][p] + 2 * ((per_node - 1) * intra + depth * NCCL_STEP_US["tree"]["net"][p])) * 1e-6
    return lat + nbytes / (0.5 * bus * GB)


def nccl_collective(cl: ClusterSpec, nbytes: Any, op: str, bw_gb_s: Any, alpha_s: Any, n: Any,
                    per_node: Any) -> np.ndarray:
    """Seconds of one `op` ("all_reduce", "all_gather", "reduce_scatter") of `nbytes` per rank (nccl-tests sizes)
    over n ranks, `per_node` of them in each node, at bus bandwidth `bw_gb_s`: where the cluster runs NCCL, the
    fastest of NCCL's rings (and trees, for an all-reduce) over its protocols, as its tuner picks (above); else the
    flat `alpha_s`. Zero for a group of one."""
    n = np.asarray(n)
    if not cl.nccl_tuning:
        return collective(nbytes, (2.0 if op == "all_reduce" else 1.0) * (n - 1) / np.maximum(n, 1), bw_gb_s,
                          alpha_s, n)
    per_node = np.clip(per_node, 1, np.maximum(n, 1))
    nodes = np.ceil(n / per_node)
    bus = np.minimum(bw_gb_s, NCCL_SM80_MAX_BUSBW_GB_S)
    times = [_ring_time(cl, nbytes, op, bus, n, per_node, nodes, p) for p in range(3)]
    if op == "all_reduce":
        times += [_tree_time(cl, nbytes, bus, per_node, nodes, p) for p in range(3)]
    return np.where(n > 1, np.minimum.reduce(times), 0.0)


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
