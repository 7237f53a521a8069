"""Memory per GPU in the simulator, on the most loaded pipeline stage: model states (tuning/sim_zero.py)
plus the activations of the micro-batches in flight (tuning/sim_pipeline.py), the fp32 logits of
the loss and, under full recomputation, one layer's full set while it is replayed."""
from __future__ import annotations

from typing import Any

import numpy as np

from tuning.hardware import GB, ClusterSpec
from tuning.sim_pipeline import in_flight
from tuning.sim_spec import ModelSpec
from tuning.sim_zero import state_bytes


def memory(m: ModelSpec, cl: ClusterSpec, c: dict[str, np.ndarray], psi: np.ndarray,
           act: dict[str, np.ndarray], frameworks: Any = None) -> dict[str, np.ndarray]:
    """Bytes per GPU: params, grads, optimizer, activations, total, and whether it fits."""
    states = state_bytes(m, c, psi, frameworks)
    logits = 4.0 * c["micro"] * m.seq * m.vocab / c["tp"]  # fp32 logits for the loss
    per_stage = m.layers / c["pp"]
    first = per_stage * in_flight(c) * act["stored"] + np.where(c["pp"] == 1, logits, 0.0)
    last = per_stage * act["stored"] + logits
    working = np.where(c["recompute"] == 2, act["full"], 0.0)  # one layer replayed in backward
    activations = np.maximum(first, last) + working
    total = states["params"] + states["grads"] + states["optimizer"] + activations
    return {**states, "activations": activations, "total": total,
            "fits": total <= cl.memory_gb * cl.usable_memory_fraction * GB}
