"""The simulator's figures beside a dry run of the same config (engine/train/dryrun.py): per-rank memory by
category and per-step collective bytes per mesh axis, row by row (`workbench dryrun` prints them;
tests/test_sim_vs_dryrun.py compares them).

Memory is the simulator's own answer (`simulate(...)`, the most loaded pipeline stage, which `stage`
names), in its categories (params, grads, optimizer, activations, temp; the runtime is not a tensor and no
tracker sees it); the dry run's tracker categories are summed into the same ones (`SIM_CATEGORY`: FSDP2's
all-gather and reduce-scatter buffers are temporaries). Collective bytes are the message sizes the
simulator prices, taken from the modules that price them (nccl-tests sizes: an all-gather's output, a
reduce-scatter's input, an all-reduce's buffer), one rank, one step: tp `tuning.sim.tensor.tp_messages`, pp
`tuning.sim.pipeline.pp_messages`, dp `tuning.sim.zero.dp_messages`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from engine.train.dryrun import DryRun, RoleResult
from tuning.sim.hardware import ClusterSpec
from tuning.sim.compute import stage_params
from tuning.sim.pipeline import pp_messages
from tuning.sim.spec import ModelSpec, ParallelSpec, columns
from tuning.sim.tensor import tp_messages
from tuning.sim.zero import dp_messages
from tuning.sim.simulator import from_run_config, simulate

MEMORY_ROWS = ("params", "grads", "optimizer", "activations", "temp", "other")
# torch's tracker categories (MemTracker, FSDPMemTracker) in the simulator's
SIM_CATEGORY = {"Sharded Param": "params", "Unsharded Param": "params", "Parameter": "params",
                "Sharded Grad": "grads", "Unsharded Grad": "grads", "Gradient": "grads",
                "OptState": "optimizer", "Optstate": "optimizer", "Activation": "activations", "Inputs": "activations",
                "Temp": "temp", "All Gather": "temp", "Reduce Scatter": "temp", "Buffer": "other", "Other": "other"}
AXES = ("dp", "tp", "pp", "cp")


def simulator_traffic(model: ModelSpec, par: ParallelSpec, stage: int = 0) -> dict[str, float]:
    """Bytes one rank of pipeline stage `stage` sends or reduces per step, per mesh axis (the module
    docstring); cp is not priced as bytes here (tuning/sim/context.py prices it as time)."""
    nmb = par.global_batch // (par.dp * par.micro)
    c = {**columns(par), "num_mb": np.asarray(nmb), "stage": np.asarray(stage)}
    out = dict.fromkeys(("dp", "tp", "pp"), 0.0)
    if par.tp > 1:
        per_layer = sum(float(np.asarray(n * size)) for n, size in tp_messages(model, c))
        out["tp"] = model.layers / par.pp * nmb * per_layer * (2 if par.sequence_parallel else 1)
    if par.pp > 1:
        msg = pp_messages(model, c)
        out["pp"] = float(msg["directions"] * par.virtual * nmb * msg["send"] + msg["embedding"])
    if par.dp * par.cp > 1:
        cg = {**c, "dp": np.asarray(par.dp * par.cp)}
        # stage_params prices the most loaded stage; the final norm sits on the last one only
        last = stage == par.pp - 1
        psi = float(stage_params(model, cg)) - (0 if last else model.norm_params * model.hidden)
        out["dp"] = float(sum(np.asarray(v) for v in dp_messages(cg, psi).values()))
    return out


def simulator_figures(cfg: dict[str, Any], cluster: ClusterSpec) -> dict[str, Any]:
    """The simulator's per-rank memory (bytes by category on its most loaded stage, `stage`) and per-step
    collective bytes per axis for each pipeline stage (`traffic[stage]`) for the run config `cfg` (a plain
    dict, engine/config/schema.py keys)."""
    model, par = from_run_config(cfg)
    result = simulate(model, cluster, par)
    memory = {k: v * 1e9 for k, v in result.memory_breakdown_gb.items() if k != "runtime"}
    return {"memory": memory, "stage": int(result.extra["memory_stage"]),
            "traffic": {s: simulator_traffic(model, par, s) for s in range(par.pp)}, "cluster": cluster.name,
            "fits": result.fits, "usable_bytes": cluster.memory_gb * cluster.usable_memory_fraction * 1e9}


def dry_run_memory(role: RoleResult) -> dict[str, float]:
    """A dry-run role's tracker categories summed into the simulator's (`SIM_CATEGORY`)."""
    out: dict[str, float] = {}
    for category, value in role.memory.items():
        key = SIM_CATEGORY.get(category, "other")
        out[key] = out.get(key, 0.0) + value
    return out


def side_by_side(dry: DryRun, cfg: dict[str, Any], cluster: ClusterSpec) -> dict[str, Any]:
    """Per role: memory rows (category, its tracker parts, dry-run bytes, simulator bytes: the simulator's
    most loaded stage) and collective rows per axis (ops with calls and bytes, the axis total beside the
    simulator's for the role's stage)."""
    sim = simulator_figures(cfg, cluster)
    return {"world": dry.world, "layout": dry.layout, "simulator": sim,
            "roles": [_role_rows(role, sim) for role in dry.roles]}


def _role_rows(role: RoleResult, sim: dict[str, Any]) -> dict[str, Any]:
    grouped = dry_run_memory(role)
    memory = []
    for group in MEMORY_ROWS:
        parts = {k: v for k, v in role.memory.items() if SIM_CATEGORY.get(k, "other") == group and v}
        if parts or group in sim["memory"]:
            memory.append({"category": group, "dry_run": grouped.get(group, 0.0), "simulator": sim["memory"].get(group),
                           "parts": parts})
    sent = role.axis_bytes()
    traffic = sim["traffic"].get(role.coords.get("pp", 0), {})
    comm = []
    for axis in [a for a in AXES if a in sent or traffic.get(a)] + sorted(set(sent) - set(AXES)):
        ops = {key.rpartition(":")[2]: agg for key, agg in role.collectives.items() if key.rpartition(":")[0] == axis}
        comm.append({"axis": axis or "(other groups)", "dry_run": sent.get(axis, 0.0),
                     "simulator": traffic.get(axis), "ops": ops})
    return {"rank": role.rank, "coords": role.coords, "peak": role.peak, "tracker": role.tracker,
            "seconds": role.seconds, "memory": memory, "comm": comm, "simulator_stage": sim["stage"],
            "simulator_total": sum(sim["memory"].values())}


def runtime_bytes(degrees: Mapping[str, Any], cluster: ClusterSpec) -> float:
    """What a rank with these parallel degrees holds beyond its tensors, which a dry run does not see: the CUDA
    context and NCCL's buffers as the simulator prices them (tuning.sim.memory.runtime, which reads tp, dp, cp, ep
    and pp from `degrees`, 1 where absent; 0 on a cluster that does not model them)."""
    from tuning.sim.memory import runtime

    return float(sum(np.sum(v) for v in runtime(degrees, cluster).values()))


def tensor_budget(limit: float, name: str, runtime: float) -> tuple[float, str]:
    """(bytes a rank's tensors may take, what they are): the device memory less the runtime beside them."""
    if not runtime:
        return limit, name
    return max(limit - runtime, 0.0), (f"left of the {limit / 2**30:.4g} GiB {name} beside the {runtime / 2**30:.2g} "
                                       "GiB of CUDA context and NCCL buffers a rank holds (priced)")
