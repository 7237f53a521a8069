"""Pipeline parallelism in the simulator (engine/parallel/pipeline.py): sends, step syncs, the bubble
and the micro-batches in flight.

- Point-to-point: 2 v messages per micro-batch per stage (activation out, gradient back, per chunk).
  Megatron-LM's scatter/gather (Narayanan et al. 2021, sec. 4.1) sends b s h dtype / t from each
  tp rank; DeepSpeed's PipelineEngine partitions them the same way (`pipe_partitioned`).
- Once per step: the first and last stage all-reduce the tied embedding gradients (V schedules
  hold both ends on one rank) and the stages all-reduce the gradient norm's squares (one alpha).
- The engine (torch.distributed.pipelining) sends each stage's whole hidden state in its dtype
  (`tuning.sim.spec.weight_bytes`: fp32 under autocast over fp32 parameters, bf16 where FSDP2's mixed
  precision gathers bf16 weights; every tp rank sends its own copy, no scatter/gather); the first stage sends
  activations only, the last gradients only, a middle stage both; it all-reduces embedding gradients only
  for a tied head. `pp_messages` holds these sizes (tuning/sim/dryrun.py sets them beside a dry run).
- Bubble: walked from the schedule's action list (tuning/sim/schedule.py).
- In flight on the first stage: 1F1B min(p, m), GPipe m, interleaved min(p, m)(1 + (p-1)/(p v))
  (Korthikanti et al. 2022, sec. 4.2.3).
"""
from __future__ import annotations

import numpy as np

from engine.config.validate import V_SCHEDULES
from tuning.sim.hardware import GB, ClusterSpec
from tuning.sim.comm import collective, link
from tuning.sim.schedule import schedule_bubble
from tuning.sim.spec import SCHEDULES, ModelSpec, engine_rows, weight_bytes


def pp_comm_time(m: ModelSpec, cl: ClusterSpec, gpus: int, c: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{"pp": sends per micro-batch, "step_sync": once per step} seconds on one stage."""
    t = c["tp"]
    msg = pp_messages(m, c)
    pbw, plat = cl.measured_link("p2p", link(cl, gpus, np.full(np.shape(t), gpus <= cl.gpus_per_node)))
    p2p = np.where(c["pp"] > 1, plat + msg["send"] / (pbw * GB), 0.0)
    embedding = np.where(msg["embedding"] > 0, collective(msg["embedding"], 1.0, pbw, plat, 2), 0.0)
    return {"pp": 2.0 * c["virtual"] * p2p, "step_sync": np.where(c["pp"] > 1, embedding + plat, 0.0)}


def pp_messages(m: ModelSpec, c: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Pipeline message sizes on one rank: `send` the bytes of one send (an activation out or a gradient
    back), `directions` how many a stage sends per micro-batch and chunk (2; the engine's end stages 1) at
    `stage` (default the first), `embedding` the once-a-step embedding all-reduce (0: none)."""
    t = c["tp"]
    act = c["micro"] * m.seq * m.hidden * c["dtype_bytes"]
    v_shaped = np.isin(c["schedule"], [SCHEDULES.index(name) for name in V_SCHEDULES])
    embedding = np.where(v_shaped, 0.0, m.vocab * m.hidden / t * c["dtype_bytes"])
    engine = engine_rows(c)
    if not np.any(engine):
        return {"send": act / t, "directions": np.full(np.shape(act), 2.0), "embedding": embedding}
    p, stage = c["pp"], np.asarray(c.get("stage", 0))
    ends = (stage == 0) | (stage == p - 1)
    return {"send": np.where(engine, c["micro"] * m.seq * m.hidden * weight_bytes(c, engine), act / t),
            "directions": np.where(engine & ends, 1.0, 2.0),
            "embedding": np.where(engine, m.vocab * m.hidden * 4.0 * m.tied_embeddings, embedding)}


def bubble(model: ModelSpec, c: dict[str, np.ndarray]) -> np.ndarray:
    """Bubble / ideal pipeline time of each row's schedule (walked, tuning/sim/schedule.py)."""
    return schedule_bubble(c["schedule"], c["pp"], c["num_mb"], c["virtual"], model.layers, c.get("skip_ratio", 0.0))


def in_flight(c: dict[str, np.ndarray]) -> np.ndarray:
    """Micro-batches whose activations the first stage holds at once."""
    p, v, nmb = c["pp"], c["virtual"], c["num_mb"]
    held = np.where(p == 1, 1, np.where(c["schedule"] == SCHEDULES.index("gpipe"), nmb, np.minimum(nmb, p)))
    return held * np.where(v > 1, 1 + (p - 1) / (p * v), 1.0)
