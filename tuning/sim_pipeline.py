"""Pipeline parallelism in the simulator (engine/parallel/pipeline.py): sends, step syncs, the bubble
and the micro-batches in flight.

- Point-to-point: 2 v messages per micro-batch per stage (activation out, gradient back, per chunk).
  Megatron-LM's scatter/gather (Narayanan et al. 2021, sec. 4.1) sends b s h dtype / t from each
  tp rank; DeepSpeed's PipelineEngine partitions them the same way (`pipe_partitioned`).
- Once per step: the first and last stage all-reduce the tied embedding gradients (V schedules
  hold both ends on one rank) and the stages all-reduce the gradient norm's squares (one alpha).
- Bubble: walked from the schedule's action list (tuning/sim_schedule.py).
- In flight on the first stage: 1F1B min(p, m), GPipe m, interleaved min(p, m)(1 + (p-1)/(p v))
  (Korthikanti et al. 2022, sec. 4.2.3).
"""
from __future__ import annotations

import numpy as np

from engine.validate import V_SCHEDULES
from tuning.hardware import GB, ClusterSpec
from tuning.sim_comm import collective, link
from tuning.sim_schedule import schedule_bubble
from tuning.sim_spec import SCHEDULES, ModelSpec


def pp_comm_time(m: ModelSpec, cl: ClusterSpec, gpus: int, c: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{"pp": sends per micro-batch, "step_sync": once per step} seconds on one stage."""
    t = c["tp"]
    act = c["micro"] * m.seq * m.hidden * c["dtype_bytes"]
    pbw, plat = cl.measured_link("p2p", link(cl, gpus, np.full(np.shape(t), gpus <= cl.gpus_per_node)))
    p2p = np.where(c["pp"] > 1, plat + act / t / (pbw * GB), 0.0)
    v_shaped = np.isin(c["schedule"], [SCHEDULES.index(name) for name in V_SCHEDULES])
    embedding = np.where(v_shaped, 0.0, collective(m.vocab * m.hidden / t * c["dtype_bytes"], 1.0, pbw, plat, 2))
    return {"pp": 2.0 * c["virtual"] * p2p, "step_sync": np.where(c["pp"] > 1, embedding + plat, 0.0)}


def bubble(model: ModelSpec, c: dict[str, np.ndarray]) -> np.ndarray:
    """Bubble / ideal pipeline time of each row's schedule (walked, tuning/sim_schedule.py)."""
    return schedule_bubble(c["schedule"], c["pp"], c["num_mb"], c["virtual"], model.layers, c.get("skip_ratio", 0.0))


def in_flight(c: dict[str, np.ndarray]) -> np.ndarray:
    """Micro-batches whose activations the first stage holds at once."""
    p, v, nmb = c["pp"], c["virtual"], c["num_mb"]
    held = np.where(p == 1, 1, np.where(c["schedule"] == SCHEDULES.index("gpipe"), nmb, np.minimum(nmb, p)))
    return held * np.where(v > 1, 1 + (p - 1) / (p * v), 1.0)
