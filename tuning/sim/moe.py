"""Mixture-of-Experts terms of the performance simulator (issue 18); pure numpy arithmetic.

`tuning.sim.core.evaluate_arrays` calls these when `model.experts > 0`. Every
`moe_every`-th block (1-based, blocks moe_every, 2 moe_every, ...: GShard's every other layer
at 2) replaces its MLP by `experts` expert MLPs of width `moe_ffn_hidden` (the dense width by
default; GELU or SwiGLU as the dense MLP), a softmax router (h x E) and, for Qwen-MoE, an
always-active shared expert of width `shared_ffn_hidden`. Parameter counts come from the model's
shape (`engine.model.shapes`, through `ModelSpec.params`).

Sources (docs/simulator.md gives the equations):
- Routing, capacity C = capacity_factor x k x tokens / E, buffers padded to C: Lepikhin et al.
  2020 (GShard), Fedus et al. 2021 (Switch Transformer).
- Two all-to-alls per MoE layer forward (dispatch, combine), two in backward; their latency
  grows with the number of peers, and the hierarchical all-to-all (inside the node first, then
  across nodes) cuts the peers from p to G + p/G: Rajbhandari et al. 2022 (DeepSpeed-MoE),
  sec. 5; SE-MoE (Shen et al. 2022).
- Expert weights and optimizer states sharded over ep, expert gradients reduced over the
  dp/ep ranks that hold the same experts: DeepSpeed-MoE sec. 5 (expert + data parallelism).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from engine.model.shapes import moe_layer_indices
from tuning.sim.hardware import GB, ClusterSpec
from tuning.sim.comm import all_to_all_time
from tuning.sim.memory import finish, memory, reserve_share
from tuning.sim.zero import dp_comm

A2A_PER_LAYER = 4  # dispatch + combine in forward, their gradients in backward (GShard, DeepSpeed-MoE)
# Assumed wire-byte ratio of comm.moe_compression=lsh (LSH-MoE centroids instead of tokens): the
# issue's goal (>= 2x), not a measurement; set ParallelSpec.moe_a2a_ratio to bench/moe.py's figure.
LSH_A2A_RATIO = 2.0


def moe_layer_count(layers: int, experts: int, moe_every: int) -> int:
    """Blocks with experts: every moe_every-th of `layers` (0 for a dense model)."""
    return len(moe_layer_indices(layers, experts=experts, moe_every=moe_every))


def mlp_params(m: Any, width: int) -> float:
    """One MLP of `width` as the model builds it (GELU: 2 matrices, SwiGLU: 3; biases if the model has them)."""
    return float(m.shape.mlp_params(width)) if width else 0.0


def _mlp_flops_per_token(m: Any, width: int) -> float:
    """Forward FLOPs of one MLP of `width` per token: 2 x its matrices x h x width."""
    return 2.0 * m.mlp_mats * m.hidden * width


def load_factor(capacity_factor: float, imbalance: Any, padded: Any) -> np.ndarray:
    """Tokens the busiest expert rank processes, over the mean k x tokens / E share.

    Padded buffers (GShard, Switch, DeepSpeed) always carry capacity_factor x the mean; variable
    splits (the engine) carry the imbalance, cut at the capacity (tokens beyond it are dropped).
    capacity_factor 0 means no capacity (nothing dropped, no padding).
    """
    imb = np.asarray(imbalance, dtype=float)
    if capacity_factor <= 0:
        return imb
    return np.where(padded, capacity_factor, np.minimum(imb, capacity_factor))


def _rows(m: Any, c: dict[str, np.ndarray]) -> dict[str, Any]:
    """Per-row quantities: ep, the load factor, local tokens per micro-batch."""
    return {"ep": np.asarray(c.get("ep", 1)), "load": load_factor(m.capacity_factor, c.get("moe_imbalance", 1.0),
                                                                   c.get("moe_padded", True)),
            "tokens": c["micro"] * m.seq, "k": min(m.top_k, m.experts)}


def a2a_bytes(m: Any, c: dict[str, np.ndarray]) -> np.ndarray:
    """Bytes one rank sends in one all_to_all: load x k x b s h x dtype / t (tokens sharded
    over tp as Megatron-core's sequence-parallel MoE block), over the compression ratio.
    `m.seq` is the rank's sequence (s / cp under context parallelism)."""
    r = _rows(m, c)
    return (r["load"] * r["k"] * r["tokens"] * m.hidden * c["dtype_bytes"] / c["tp"]
            / np.asarray(c.get("moe_a2a_ratio", 1.0)))


def a2a_time(m: Any, cl: ClusterSpec, gpus: int, c: dict[str, np.ndarray], cp: int) -> np.ndarray:
    """All_to_all seconds per micro-batch on one pipeline stage: 4 per MoE block (2 more when
    full recomputation replays the forward); the ep group's ranks are tp x cp apart."""
    n_moe = moe_layer_count(m.layers, m.experts, m.moe_every)
    per = A2A_PER_LAYER + 2 * (c["recompute"] == 2)
    one = all_to_all_time(cl, gpus, a2a_bytes(m, c), np.asarray(c.get("ep", 1)), c["tp"] * cp,
                          c.get("moe_hierarchical", False))
    return n_moe / c["pp"] * per * one


def _gemm_time(cl: ClusterSpec, flops: np.ndarray) -> np.ndarray:
    return flops / cl.gemm_rate(flops)


def _mlp_time(m: Any, cl: ClusterSpec, tokens: np.ndarray, width: float, t: np.ndarray) -> np.ndarray:
    """Forward seconds of one MLP of `width` over `tokens` on a tp rank: its matrices' GEMMs, each by
    its shape on GPU presets (tuning.sim.kernels), by its FLOPs on CPU profiles."""
    if not width:
        return np.zeros(np.shape(tokens))
    if cl.kernels:
        from tuning.sim.kernels import gemm_seconds, gpu_facts

        facts = gpu_facts(cl.kernels)
        tok = np.maximum(tokens, 1.0)
        up = gemm_seconds(facts, cl.peak_flops, tok, width / t, m.hidden)
        return (m.mlp_mats - 1) * up + gemm_seconds(facts, cl.peak_flops, tok, m.hidden, width / t)
    one = 2.0 * tokens * m.hidden * width / t
    return m.mlp_mats * _gemm_time(cl, one)


def expert_compute_delta(m: Any, cl: ClusterSpec, c: dict[str, np.ndarray]) -> np.ndarray:
    """Forward seconds one MoE block adds over the dense block, per micro-batch on one rank.

    Removes the dense MLP's GEMMs; adds the router (2 b s h E / t), the shared expert over every
    token and, for each of the E/ep local experts, its GEMMs over its load x ep x k x b s / E tokens
    (the expert GEMMs are smaller than the dense one, so they run at a lower rate; ep makes them larger).
    """
    r = _rows(m, c)
    h, t, e = m.hidden, c["tp"], m.experts
    per_expert = r["load"] * r["ep"] * r["k"] * r["tokens"] / e
    router = 2.0 * r["tokens"] * h * e / t
    return ((e / r["ep"]) * _mlp_time(m, cl, per_expert, m.expert_ffn, t) + _gemm_time(cl, router)
            + _mlp_time(m, cl, r["tokens"], m.shared_ffn_hidden, t) - _mlp_time(m, cl, r["tokens"], m.ffn, t))


def activation_delta(m: Any, c: dict[str, np.ndarray]) -> np.ndarray:
    """Bytes per MoE block and micro-batch over the dense block (16-bit basis x dtype / 2):
    the expert intermediates are load x k x an expert MLP's 4 f / h sbh / t (8 f / h gated; the
    dense GELU MLP's 16 sbh / t at f = 4h), the shared expert's over every token, less the dense
    MLP's, plus the dispatched and combined token buffers, 2 x 2 load k sbh / t (Korthikanti et
    al. 2022's MLP terms)."""
    r = _rows(m, c)
    sbh = r["tokens"] * m.hidden * c["dtype_bytes"] / 2.0
    lk = r["load"] * r["k"]
    per_width = (8.0 if m.gated_mlp else 4.0) / m.hidden
    inside = per_width * (lk * m.expert_ffn + m.shared_ffn_hidden - m.ffn)
    return sbh * (inside + 4.0 * lk) / c["tp"]


def stage_params(m: Any, c: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(dense change, expert parameters) per GPU of a stage: the MoE blocks drop their dense MLP
    (/t) and add a router (h x E, replicated) and the shared expert (/t); each rank holds E/ep
    experts of them (/t)."""
    n = moe_layer_count(m.layers, m.experts, m.moe_every) / c["pp"]
    shared = mlp_params(m, m.shared_ffn_hidden) + (m.hidden if m.shared_ffn_hidden else 0)
    dense = n * (m.hidden * m.experts + (shared - mlp_params(m, m.ffn)) / c["tp"])
    return dense, n * (m.experts / np.asarray(c.get("ep", 1))) * mlp_params(m, m.expert_ffn) / c["tp"]


def expert_states(psi_e: np.ndarray, c: dict[str, np.ndarray], group: np.ndarray) -> dict[str, np.ndarray]:
    """Bytes of the expert weights, gradients and optimizer states per GPU, kept as the framework keeps
    dense ones (`tuning.sim.memory.state_terms`); ZeRO shards them over the `group` ranks that hold the
    same experts (dp x cp / ep), as Rajbhandari et al. 2020."""
    from tuning.sim.memory import keeps, state_terms

    return state_terms(psi_e, c, keeps(c), group)


def flops_delta(m: Any, c: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(executed, model) FLOPs per iteration the MoE blocks add over the dense model.

    Per token and MoE block, forward: router 2 h E, k experts (2 x matrices x h x expert width each;
    16 h^2 for a GELU MLP of 4h) and the shared expert instead of one dense MLP; executed FLOPs count
    the padding to capacity (padded buffers: capacity_factor x k experts), model FLOPs (MFU) the k
    experts only. Backward 2x; full recomputation one more forward.
    """
    n = moe_layer_count(m.layers, m.experts, m.moe_every)
    k, h = min(m.top_k, m.experts), m.hidden
    padded = np.asarray(c.get("moe_padded", True)) & (m.capacity_factor > 0)
    exec_k = np.where(padded, m.capacity_factor * k, k)
    tokens = c["global_batch"] * m.seq
    expert, dense = _mlp_flops_per_token(m, m.expert_ffn), _mlp_flops_per_token(m, m.ffn)
    fixed = 2.0 * h * m.experts + _mlp_flops_per_token(m, m.shared_ffn_hidden) - dense
    fwd_exec = n * tokens * (fixed + exec_k * expert)
    fwd_model = n * tokens * (fixed + k * expert)
    return fwd_exec * (3.0 + (c["recompute"] == 2)), 3.0 * fwd_model


def validate(m: Any, par: Any) -> list[str]:
    """Every reason the MoE fields of `m` and `par` cannot run (empty when valid)."""
    reasons = []
    if m.experts < 0:
        reasons.append(f"model.experts={m.experts} must be >= 0 (0 = dense)")
    if m.experts > 0:
        if not 1 <= m.top_k <= m.experts:
            reasons.append(f"model.top_k={m.top_k} must be in 1..model.experts={m.experts}")
        if not 1 <= m.moe_every <= m.layers:
            reasons.append(f"model.moe_every={m.moe_every} must be in 1..model.layers={m.layers}")
        if m.capacity_factor < 0:
            reasons.append(f"model.capacity_factor={m.capacity_factor} must be >= 0 (0 = no capacity limit)")
    if par.ep < 1:
        return reasons + [f"parallel.ep={par.ep} must be >= 1"]
    if par.ep > 1:
        if m.experts == 0:
            reasons.append(f"parallel.ep={par.ep} needs model.experts > 0")
        elif m.experts % par.ep:
            reasons.append(f"parallel.ep={par.ep} must divide model.experts={m.experts}")
        if par.dp % par.ep:
            reasons.append(f"parallel.ep={par.ep} must divide parallel.dp={par.dp} (ep ranks are carved from dp)")
    if par.moe_imbalance < 1.0:
        reasons.append(f"moe_imbalance={par.moe_imbalance} must be >= 1 (busiest rank / mean)")
    if not par.moe_a2a_ratio > 0:
        reasons.append(f"moe_a2a_ratio={par.moe_a2a_ratio} must be > 0")
    return reasons


def dp_and_memory(model: Any, local: Any, cl: ClusterSpec, gpus: int, cg: dict[str, np.ndarray], psi: np.ndarray,
                  act: dict[str, np.ndarray], times: dict[str, np.ndarray],
                  frameworks: Any = None) -> tuple[dict, dict, np.ndarray]:
    """Data-parallel traffic, memory and optimizer parameters of an MoE stage.

    Dense parameters (with the routers) are reduced and ZeRO-sharded over the dp x cp ranks of
    `cg`; expert parameters over the dp x cp / ep ranks holding the same experts (tp x ep apart).
    The two gradient streams share the backward window in proportion to their bytes.
    Returns (dp {total, exposed}, memory as `sim_memory.memory`, parameters the optimizer steps).
    """
    dense_delta, psi_e = stage_params(model, cg)
    psi_d = psi + dense_delta
    ep = np.asarray(cg.get("ep", 1))
    ce = {**cg, "dp": cg["dp"] // ep, "tp": cg["tp"] * ep}
    share = psi_d / (psi_d + psi_e)
    dense = dp_comm(model, cl, gpus, cg, psi_d, {k: w * share for k, w in times.items()}, frameworks)
    expert = dp_comm(model, cl, gpus, ce, psi_e, {k: w * (1.0 - share) for k, w in times.items()}, frameworks)
    mem = dict(memory(local, cl, cg, psi_d, act, frameworks))
    for key, value in expert_states(psi_e, cg, ce["dp"]).items():
        mem[key] = mem[key] + value
    mem = finish(mem, cl, reserve_share(cg, frameworks))
    zero = cg["zero"] >= 1
    psi_opt = psi_d / np.where(zero, cg["dp"], 1) + psi_e / np.where(zero, ce["dp"], 1)
    dp = {"total": dense["total"] + expert["total"], "exposed": dense["exposed"] + expert["exposed"],
          "expert_params": psi_e}
    return dp, mem, psi_opt
