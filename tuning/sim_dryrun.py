"""The simulator's figures beside a dry run of the same config (engine/dryrun.py): per-rank memory by
category and per-step collective bytes per mesh axis, row by row (`workbench dryrun` prints them).

Memory is the simulator's own answer (`simulate(...).memory_breakdown_gb`, the most loaded pipeline
stage). Collective bytes are the message sizes the simulator prices (nccl-tests sizes: an
all-gather's output, a reduce-scatter's input, an all-reduce's buffer), one rank, one step:

- tp (tuning/sim_tensor.py): per layer and micro-batch 4 all-reduces of b s h (6 with full
  recomputation); sequence parallelism makes each a reduce-scatter + all-gather of the same size.
- pp (tuning/sim_pipeline.py): 2 v messages of b s h / t per micro-batch (activation out, gradient
  back), plus the once-a-step embedding all-reduce of V h / t (not under V-shaped schedules).
- dp (tuning/sim_zero.py): ZeRO-0 one all-reduce of the gradients; ZeRO-1 (the engine's
  ZeroRedundancyOptimizer) that plus a broadcast of the parameters; ZeRO-2 (FSDP2, gathered once)
  one all-gather plus a reduce-scatter per micro-batch; ZeRO-3 per micro-batch two all-gathers and
  a reduce-scatter (one all-gather with reshard_after_forward off).
Those modules fold these sizes into seconds; they are restated here as bytes (issue 49 item 3
checks the simulator against the dry run).
"""
from __future__ import annotations

from typing import Any

from engine.dryrun import GROUPS, DryRun, RoleResult
from engine.validate import V_SCHEDULES
from tuning.hardware import ClusterSpec
from tuning.sim_compute import stage_params
from tuning.sim_spec import ModelSpec, ParallelSpec, columns
from tuning.simulator import from_run_config, simulate

MEMORY_ROWS = ("params", "grads", "optimizer", "activations", "comm buffers", "other")
AXES = ("dp", "tp", "pp", "cp")


def simulator_traffic(model: ModelSpec, par: ParallelSpec) -> dict[str, float]:
    """Bytes one rank of the most loaded stage sends or reduces per step, per mesh axis (see the module
    docstring); cp is not priced as bytes here (tuning/sim_context.py prices it as time)."""
    db, t, p, v = par.dtype_bytes, par.tp, par.pp, par.virtual
    nmb = par.global_batch // (par.dp * par.micro)
    act = par.micro * model.seq * model.hidden * db
    out = dict.fromkeys(("dp", "tp", "pp"), 0.0)
    if t > 1:
        out["tp"] = model.layers / p * (4 + 2 * (par.recompute == "full")) * act * nmb \
            * (2 if par.sequence_parallel else 1)
    if p > 1:
        embedding = 0.0 if par.schedule in V_SCHEDULES else model.vocab * model.hidden / t * db
        out["pp"] = 2 * v * nmb * act / t + embedding
    if par.dp > 1:
        psi = float(stage_params(model, {**columns(par), "num_mb": nmb}))
        out["dp"] = _dp_bytes(psi * db / par.compression_ratio, psi * db, par, nmb)
    return out


def _dp_bytes(grads: float, params: float, par: ParallelSpec, nmb: int) -> float:
    if par.zero == 3:
        return nmb * ((2 if par.reshard_after_forward else 1) * params + grads)
    if par.zero == 2:
        return params + nmb * grads
    return grads + (params if par.zero == 1 else 0.0)


def simulator_figures(cfg: dict[str, Any], cluster: ClusterSpec) -> dict[str, Any]:
    """The simulator's per-rank memory (bytes, most loaded stage, its four categories) and per-step
    collective bytes per axis for the run config `cfg` (a plain dict, engine/config.py keys)."""
    model, par = from_run_config(cfg)
    result = simulate(model, cluster, par)
    memory = {k: v * 1e9 for k, v in result.memory_breakdown_gb.items()}
    return {"memory": memory, "traffic": simulator_traffic(model, par), "cluster": cluster.name,
            "fits": result.fits, "usable_bytes": cluster.memory_gb * cluster.usable_memory_fraction * 1e9}


def side_by_side(dry: DryRun, cfg: dict[str, Any], cluster: ClusterSpec) -> dict[str, Any]:
    """Per role: memory rows (category, its tracker parts, dry-run bytes, simulator bytes) and collective
    rows per axis (ops with calls and bytes, the axis total beside the simulator's)."""
    sim = simulator_figures(cfg, cluster)
    return {"world": dry.world, "layout": dry.layout, "simulator": sim,
            "roles": [_role_rows(role, sim) for role in dry.roles]}


def _role_rows(role: RoleResult, sim: dict[str, Any]) -> dict[str, Any]:
    grouped = role.grouped()
    memory = []
    for group in MEMORY_ROWS:
        parts = {k: v for k, v in role.memory.items() if GROUPS.get(k, "other") == group and v}
        if parts or group in sim["memory"]:
            memory.append({"category": group, "dry_run": grouped.get(group, 0.0), "simulator": sim["memory"].get(group),
                           "parts": parts})
    sent = role.axis_bytes()
    comm = []
    for axis in [a for a in AXES if a in sent or sim["traffic"].get(a)] + sorted(set(sent) - set(AXES)):
        ops = {key.rpartition(":")[2]: agg for key, agg in role.collectives.items() if key.rpartition(":")[0] == axis}
        comm.append({"axis": axis or "(other groups)", "dry_run": sent.get(axis, 0.0),
                     "simulator": sim["traffic"].get(axis), "ops": ops})
    return {"rank": role.rank, "coords": role.coords, "peak": role.peak, "tracker": role.tracker,
            "seconds": role.seconds, "memory": memory, "comm": comm,
            "simulator_total": sum(sim["memory"].values())}
