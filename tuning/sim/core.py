"""The simulator's core: one iteration priced by composing each technique's terms (vectorised).

`evaluate_arrays(model, cluster, gpus, cols)` takes equal-length arrays of `ParallelSpec` fields
(categorical fields as codes, see `tuning.sim.spec.columns`) and returns arrays of times, rates and
memory. Each term comes from the module that prices one technique, mirroring engine/parallel/:

| term | module |
|---|---|
| block compute, activations, FLOPs | `tuning.sim.compute` |
| tensor parallelism | `tuning.sim.tensor` |
| pipeline sends, syncs, bubble, in-flight | `tuning.sim.pipeline` (walks `tuning.sim.schedule`) |
| data parallelism, ZeRO, model states | `tuning.sim.zero` |
| memory on the most loaded stage | `tuning.sim.memory` |
| context parallelism, long-tail batches | `tuning.sim.context` |
| experts (MoE) | `tuning.sim.moe` |
| framework flavour and its fixed costs | `tuning.sim.framework` |

Iteration = compute + tp_comm + pp_comm + bubble + dp_comm_exposed + optimizer + straggler (+ all_to_all
for MoE, + cp_comm at cp > 1); straggler is the compute and bubble stretched to the slowest GPU's pace
(`tuning.sim.stragglers`). No validation here: pass valid rows (`tuning.sim.simulator.validate_parallel`).

Speed (a search prices 100k+ rows, bench/simulator.py): the rows are priced once per cp degree
(`sim_context.by_degree`); kernel times once per distinct micro-batch, tp and kernel
(`sim_compute.per_unique`); what ZeRO does not change once per group of rows that differ only in
`zero` (ZERO_FREE_GROUP, which `tuning.search` adds), then gathered onto every row (`tuning.sim.groups`).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from engine.mesh import world_size
from tuning.sim import context as sim_context, moe as sim_moe
from tuning.sim.hardware import GB, ClusterSpec
from tuning.sim.compute import activation_bytes, compute_times, flops, stage_params
from tuning.sim.groups import row_groups, spread, take_rows
from tuning.sim.kernels import memory_bandwidth
from tuning.sim.memory import CATEGORIES, TERMS, memory
from tuning.sim.pipeline import bubble, pp_comm_time
from tuning.sim.spec import ModelSpec, engine_rows
from tuning.sim.stragglers import slowest_gpu_factor
from tuning.sim.tensor import tp_comm_time
from tuning.sim.zero import dp_comm

# Adam step traffic per parameter: fp32 master, momentum, variance read + written (24 B),
# the gradient read and the 16-bit weight written (4 B). The step is memory-bound.
OPTIMIZER_BYTES_PER_PARAM = 28.0
MEMORY_KEYS = CATEGORIES + tuple(name for names in TERMS.values() for name in names)
# a column `tuning.search` adds: rows with one value agree on every field but `zero`, so what ZeRO does not
# change (`_layout_terms`) is priced once per group
ZERO_FREE_GROUP = "_zero_free_group"
LAYOUT_TERMS = ("act", "times", "windows", "a2a", "cp", "tp", "pp", "bubble")  # `_layout_terms`' keys


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
    act = dict(act)
    extra = act["attn"] * (sim_context.score_memory_scale(c, cp) - 1.0)
    act["attn"], act["full"] = act["attn"] + extra, act["full"] + extra
    act["stored"] = act["stored"] + np.where(c["recompute"] == 0, extra, 0.0)
    if model.experts:  # per layer on average: a stage's MoE blocks / its layers
        moe = sim_moe.activation_delta(local, c) * sim_moe.moe_layer_count(
            model.layers, model.experts, model.moe_every) / model.layers
        act["full"] = act["full"] + moe
        act["moe"] = moe
        act["stored"] = act["stored"] + np.where(c["recompute"] == 2, 0.0, moe)
    return act


def _extend_times(model: ModelSpec, local: ModelSpec, cluster: ClusterSpec, gpus: int, c: dict[str, np.ndarray],
                  times: dict[str, np.ndarray], cp: int, frameworks: Any = None) -> tuple[dict[str, np.ndarray], ...]:
    """Issues 18/19, per micro-batch: (times with attention over cp and expert GEMMs, the compute
    windows other traffic may hide under, all_to_all s, cp comm s)."""
    times = sim_context.add_attention(times, model, local, cluster, c, cp, frameworks)
    cp_comm, ring_hidden = sim_context.cp_comm_time(model, local, cluster, gpus, c, cp, frameworks)
    a2a = np.zeros(np.shape(c["tp"]))
    if model.experts:
        blocks = sim_moe.moe_layer_count(model.layers, model.experts, model.moe_every) / c["pp"]
        delta = blocks * sim_moe.expert_compute_delta(local, cluster, c)
        times = {**times, "fwd": times["fwd"] + delta, "bwd": times["bwd"] + delta * (2.0 + (c["recompute"] == 2))}
        a2a = sim_moe.a2a_time(local, cluster, gpus, c, cp)
    windows = {**times, "fwd": times["fwd"] - ring_hidden["fwd"], "bwd": times["bwd"] - ring_hidden["bwd"]}
    return times, windows, a2a, cp_comm


def _states(model: ModelSpec, local: ModelSpec, cluster: ClusterSpec, gpus: int, c: dict[str, np.ndarray],
            act: dict[str, np.ndarray], windows: dict[str, np.ndarray], cp: int,
            frameworks: Any) -> tuple[dict, dict, np.ndarray, np.ndarray]:
    """(dp traffic, memory, parameters per GPU, parameters the optimizer steps) of the rows."""
    psi = stage_params(model, c)
    cg = c if cp == 1 else {**c, "dp": c["dp"] * cp}  # gradients are reduced over dp x cp ranks
    if model.experts:
        dp, mem, psi_opt = sim_moe.dp_and_memory(model, local, cluster, gpus, cg, psi, act, windows, frameworks)
    else:
        dp = dp_comm(model, cluster, gpus, cg, psi, windows, frameworks)
        mem = memory(local, cluster, cg, psi, act, frameworks)
        psi_opt = psi / np.where(c["zero"] >= 1, cg["dp"], 1)
    return dp, mem, psi, psi_opt


def _layout_terms(model: ModelSpec, local: ModelSpec, cluster: ClusterSpec, gpus: int, c: dict[str, np.ndarray],
                  cp: int, extended: bool, frameworks: Any) -> dict[str, Any]:
    """What ZeRO does not change, per micro-batch: activations, compute (and the windows other traffic
    hides under), all-to-all, cp, tp and pp traffic, and the bubble (keys: LAYOUT_TERMS)."""
    act = activation_bytes(local, c)
    a2a_mb = cp_mb = np.zeros(())
    if extended:
        act = _extend_activations(model, local, c, act, cp)
    times = windows = compute_times(local, cluster, c, act, frameworks)
    if extended:
        times, windows, a2a_mb, cp_mb = _extend_times(model, local, cluster, gpus, c, times, cp, frameworks)
    return {"act": act, "times": times, "windows": windows, "a2a": a2a_mb, "cp": cp_mb,
            "tp": tp_comm_time(local, cluster, gpus, c, times.get("gemm")), "pp": pp_comm_time(local, cluster, gpus, c),
            "bubble": bubble(model, c)}


def _zero_free_rows(c: dict[str, np.ndarray], cluster: ClusterSpec) -> tuple[np.ndarray, np.ndarray] | None:
    """(a row of each ZERO_FREE_GROUP, each row's group) where the rows carry the column and it saves
    work; None otherwise. What ZeRO changes in `_layout_terms` is whether it is >= 2: a measured host's
    FSDP hook cost (`overhead_fsdp_layer_s`) and the engine's FSDP2 mixed precision (bf16 hidden states,
    `tuning.sim.spec.fsdp_bf16_rows`); where either applies, a group splits there."""
    group = c.get(ZERO_FREE_GROUP)
    if group is None or np.ndim(group) == 0:
        return None
    if cluster.overhead_fsdp_layer_s or np.any(engine_rows(c)):
        group = 2 * group + (c["zero"] >= 2)
    first, inverse = row_groups(group)
    return (first, inverse) if first.size <= 0.75 * group.size else None


def evaluate_arrays(model: ModelSpec, cluster: ClusterSpec, gpus: int, cols: dict[str, Any], *,
                    frameworks: Any = None) -> dict[str, np.ndarray]:
    """Price many configurations at once; `cols` holds equal-length arrays of ParallelSpec fields.

    Codes: recompute 0 none / 1 selective / 2 full (RECOMPUTE); schedule: index in SCHEDULES;
    framework: index in sim_framework.FRAMEWORK_NAMES. `frameworks` replaces the flavour presets
    (a fit's trial values). No validation: pass valid rows (see `tuning.search`).
    """
    c = {k: np.asarray(v) for k, v in cols.items()}
    cp = _cp_degree(c)
    if cp is None:  # several cp degrees: one pass each (tuning/sim/context.py)
        return sim_context.by_degree(evaluate_arrays, model, cluster, gpus, c, frameworks=frameworks)
    c["num_mb"] = c["global_batch"] // (c["dp"] * c["micro"])
    nmb = c["num_mb"]
    # issues 18/19: MoE blocks, context parallelism (a rank holds s/cp tokens), long-tail attention
    extended = model.experts > 0 or cp > 1 or bool(np.any(c.get("attn_density", 1.0) != 1.0))
    local = sim_context.local_model(model, cp) if extended else model
    groups = _zero_free_rows(c, cluster)
    rows = c if groups is None else take_rows(c, groups[0], c[ZERO_FREE_GROUP].size)
    per_layout = _layout_terms(model, local, cluster, gpus, rows, cp, extended, frameworks)
    if groups is not None:  # back onto every row: a gather per result, not a pricing per row
        per_layout = spread(per_layout, groups[1])
    act, times, windows, a2a_mb, cp_mb, tp, pp, bub = (per_layout[key] for key in LAYOUT_TERMS)
    dp, mem, psi, psi_opt = _states(model, local, cluster, gpus, c, act, windows, cp, frameworks)
    per_mb = times["fwd"] + times["bwd"] + tp + pp["pp"] + a2a_mb + cp_mb
    out = {
        "compute_s": nmb * (times["fwd"] + times["bwd"]),
        "tp_comm_s": nmb * tp,
        "pp_comm_s": nmb * pp["pp"] + pp["step_sync"],  # sends per micro-batch, syncs per step
        "bubble_s": bub * nmb * per_mb,  # bubble / ideal time from walking the schedule's action list
        "dp_comm_exposed_s": dp["exposed"],
        "optimizer_s": psi_opt * OPTIMIZER_BYTES_PER_PARAM
        / (cluster.optimizer_gb_s * GB or memory_bandwidth(cluster)) + cluster.overhead_step_s,
        "all_to_all_s": nmb * a2a_mb,  # MoE dispatch/combine (tuning/sim/moe.py)
        "cp_comm_s": nmb * cp_mb,  # context-parallel exposed communication (tuning/sim/context.py)
    }
    # the step waits for its slowest GPU: its compute (and the bubble, a share of it) at that GPU's pace
    out["straggler_s"] = slowest_gpu_factor(gpus, cluster.gpu_speed_sd) * (out["compute_s"] + out["bubble_s"])
    iteration = sum(out.values())
    executed, model_flops = flops(model, c)
    if extended:
        for delta in (sim_moe.flops_delta(model, c), sim_context.flops_delta(model, c)):
            executed, model_flops = executed + delta[0], model_flops + delta[1]
    total_gpus = world_size(dp=c["dp"], tp=c["tp"], pp=c["pp"], cp=cp)
    out.update({
        "iteration_time_s": iteration,
        "tokens_per_s": c["global_batch"] * model.seq / iteration,
        "tflops_per_gpu": executed / (iteration * total_gpus) / 1e12,
        "mfu": model_flops / (iteration * total_gpus * cluster.peak_flops),
        "memory_per_gpu_gb": mem["total"] / GB, "fits": mem["fits"],
        # the categories; the terms for one configuration (simulate's breakdown; a search skips them for speed)
        **{f"mem_{k}_gb": mem[k] / GB for k in (MEMORY_KEYS if np.size(mem["total"]) == 1 else CATEGORIES)},
        "memory_stage": mem["stage"],
        "num_microbatches": nmb,
        "bubble_fraction": bub,
        "dp_comm_total_s": dp["total"], "flops_per_iteration": executed,
        "model_flops_per_iteration": model_flops, "params_per_gpu": psi,
        "expert_params_per_gpu": dp.get("expert_params", np.zeros(())),
    })
    return out
