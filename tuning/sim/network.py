"""The simulator on a heterogeneous network: each collective and each pipeline edge priced on the
links it really crosses, and a search over placements (Holmes: pp across NIC groups).

`ClusterSpec.inter_link` prices every inter-node ring at the slowest NIC of the job; here the
ranks are placed on the mesh (`engine.config.placement`, the engine's own order), every dp group, tp
group and pp edge is mapped to the hops it crosses (`engine.comm.link.LinkTopology`, the rule the
engine's link emulator applies), and the slowest of each kind gates the step (all dp groups
synchronise at the optimizer step; a pipeline runs at its slowest edge).

Pricing on a host where the links are emulated (the engine's `link.groups`): an emulated
collective lasts max(real, emulated), so its link is the slower of the host's own link and the
emulated hop; an emulated send waits for the hop, then sends for real, so the two add.
The engine's pipeline all-reduces dp gradients after the schedule: with pp > 1 that traffic is
priced as exposed (overlap_dp False).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from tuning.sim.hardware import ClusterSpec
from tuning.sim.simulator import ModelSpec, ParallelSpec, _arrays, evaluate_arrays, validate_parallel

Link = tuple[float, float]  # (bus bandwidth GB/s, latency s)


def hop_link(topology: Any, ranks: Sequence[int]) -> Link:
    """(GB/s, s) of a ring over `ranks` on `topology` (engine.comm.link.LinkTopology)."""
    link = topology.link_for(list(ranks))
    return link.gbps / 8.0, link.latency_us * 1e-6


def _slowest(links: list[Link], nbytes: float) -> Link:
    """The link that takes longest for `nbytes` (bandwidth and latency together)."""
    return max(links, key=lambda bl: bl[1] + nbytes / (bl[0] * 1e9)) if links else (float("inf"), 0.0)


def placement_links(topology: Any, *, pp: int, dp: int, tp: int, placement: str,
                    grad_bytes: float = 1e6, act_bytes: float = 1e5) -> dict[str, Link]:
    """The slowest dp ring, tp ring and pp edge of `placement` on `topology` (emulated links only).

    `grad_bytes` / `act_bytes` pick the slowest link when bandwidth and latency disagree.
    """
    from engine.mesh import world_size
    from engine.config.placement import mesh_groups, rank_order

    order = rank_order(world_size(dp=dp, tp=tp, pp=pp), placement=placement, groups=[g.ranks for g in topology.groups], pp=pp, tp=tp)
    sets = mesh_groups(order, pp=pp, dp=dp, tp=tp)
    edges = [(chain[i], chain[i + 1]) for chain in sets["pp"] for i in range(len(chain) - 1)]
    return {
        "dp": _slowest([hop_link(topology, r) for r in sets["dp"] if len(r) > 1], grad_bytes),
        "tp": _slowest([hop_link(topology, r) for r in sets["tp"] if len(r) > 1], act_bytes),
        "pp": _slowest([hop_link(topology, e) for e in edges], act_bytes),
    }


def _on_host(cluster: ClusterSpec, link: Link) -> Link:
    """An emulated collective link on this host: the slower of the two (max of the two times)."""
    return min(cluster.intra_bw_gb_s, link[0]), max(cluster.intra_latency_s, link[1])


def _p2p_on_host(cluster: ClusterSpec, link: Link) -> Link:
    """An emulated send: the hop's wait, then the real send (their times add)."""
    real_bw = cluster.p2p_bw_gb_s or cluster.intra_bw_gb_s
    real_lat = cluster.p2p_latency_s or cluster.intra_latency_s
    bw = 1.0 / (1.0 / link[0] + 1.0 / real_bw) if np.isfinite(link[0]) else real_bw
    return bw, link[1] + real_lat


def simulate_placement(model: ModelSpec, cluster: ClusterSpec, par: ParallelSpec, *, topology: Any,
                       placement: str) -> dict[str, float]:
    """Iteration time, tokens/s and breakdown (s) of `par` placed by `placement` on `topology`.

    One node of `par.gpus` ranks whose collectives run over the emulated links (see the module
    docstring); `cluster` gives compute and the host's own link.
    """
    reasons = validate_parallel(model, cluster, par, gpus=par.gpus)
    if reasons:
        raise ValueError("invalid parallel config: " + "; ".join(reasons))
    psi_bytes = model.params / par.pp / par.tp * par.dtype_bytes
    act = par.micro * model.seq * model.hidden * par.dtype_bytes
    links = placement_links(topology, pp=par.pp, dp=par.dp, tp=par.tp, placement=placement,
                            grad_bytes=psi_bytes, act_bytes=act)
    p2p = _p2p_on_host(cluster, links["pp"])
    base = dataclasses.replace(cluster, gpus_per_node=par.gpus, num_nodes=1, node_groups=(),
                               p2p_bw_gb_s=p2p[0], p2p_latency_s=max(p2p[1], 1e-12))
    dp_bw, dp_lat = _on_host(cluster, links["dp"])
    tp_bw, tp_lat = _on_host(cluster, links["tp"])
    spec = dataclasses.replace(par, overlap_dp=par.overlap_dp and par.pp == 1)
    cols = _arrays(spec)
    by_dp = _scalars(evaluate_arrays(model, dataclasses.replace(base, intra_bw_gb_s=dp_bw, intra_latency_s=dp_lat),
                                     par.gpus, cols))
    by_tp = _scalars(evaluate_arrays(model, dataclasses.replace(base, intra_bw_gb_s=tp_bw, intra_latency_s=tp_lat),
                                     par.gpus, cols))
    # dp traffic from the dp-link pricing, tp traffic (and the bubble it stretches) from the tp-link one
    out = dict(by_dp)
    out["tp_comm_s"], out["bubble_s"] = by_tp["tp_comm_s"], by_tp["bubble_s"]
    out["iteration_time_s"] = by_dp["iteration_time_s"] + (by_tp["tp_comm_s"] - by_dp["tp_comm_s"]) \
        + (by_tp["bubble_s"] - by_dp["bubble_s"])
    out["tokens_per_s"] = par.global_batch * model.seq / out["iteration_time_s"]
    out.update({f"{k}_link_gb_s": v[0] for k, v in links.items()})
    return out


def _scalars(result: dict[str, np.ndarray]) -> dict[str, float]:
    return {k: float(np.asarray(v)) for k, v in result.items()}


def search_placements(model: ModelSpec, cluster: ClusterSpec, par: ParallelSpec, *, topology: Any,
                      layouts: Sequence[tuple[int, int, int]] | None = None) -> pd.DataFrame:
    """Every valid (pp, dp, tp) layout of `par.gpus` ranks x every placement, fastest first.

    `layouts` defaults to all factorisations; a placement the engine would refuse (holmes with a
    group whose size is not a multiple of tp) is skipped.
    """
    from engine.config.placement import PLACEMENTS

    gpus = par.gpus
    if layouts is None:
        layouts = [(pp, dp, gpus // (pp * dp)) for pp in range(1, gpus + 1) for dp in range(1, gpus + 1)
                   if gpus % (pp * dp) == 0]
    rows = []
    for pp, dp, tp in layouts:
        for placement in PLACEMENTS:
            if placement == "holmes" and any(len(g.ranks) % tp for g in topology.groups):
                continue
            spec = dataclasses.replace(par, pp=pp, dp=dp, tp=tp)
            if validate_parallel(model, cluster, spec, gpus=gpus):
                continue
            r = simulate_placement(model, cluster, spec, topology=topology, placement=placement)
            rows.append({"pp": pp, "dp": dp, "tp": tp, "placement": placement, **r})
    df = pd.DataFrame(rows)
    return df.sort_values("iteration_time_s", kind="stable").reset_index(drop=True) if len(df) else df
