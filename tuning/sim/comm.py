"""Collective costs of the simulator: the alpha-beta model with nccl-tests bus factors (formulas.md).

Every technique module prices its traffic with these: a collective of `bytes` per rank over a
group of n ranks costs alpha + bytes x factor / busbw; `link` picks the group's bus bandwidth and
latency from where its ranks sit (inside a node, or across nodes on as many NICs as the group has
ranks per node); `all_to_all_time` prices the MoE and Ulysses all-to-alls.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from tuning.sim.hardware import GB, ClusterSpec


def collective(nbytes: Any, factor: Any, bw_gb_s: Any, alpha_s: Any, n: Any) -> np.ndarray:
    """alpha + bytes * factor / busbw (formulas.md); zero for a group of one."""
    return np.where(np.asarray(n) > 1, alpha_s + nbytes * factor / (bw_gb_s * GB), 0.0)


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
