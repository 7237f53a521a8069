"""Tensor parallelism in the simulator (engine/parallel/tensor.py): the per-layer collectives.

Each layer does 4 all-reduces of b s h x dtype bytes (2 forward, 2 backward; Shoeybi et al.
2019), 2 more when full recomputation replays the forward; with sequence parallelism each becomes
a reduce-scatter + all-gather of the same bytes and twice the latency (Korthikanti et al. 2022).
The group is on NVLink while t <= gpus_per_node, otherwise across nodes.
"""
from __future__ import annotations

import numpy as np

from tuning.hardware import ClusterSpec
from tuning.sim_comm import collective, link
from tuning.sim_spec import ModelSpec


def tp_comm_time(m: ModelSpec, cl: ClusterSpec, gpus: int, c: dict[str, np.ndarray]) -> np.ndarray:
    """Tensor-parallel collective seconds per micro-batch on one stage."""
    t, b = c["tp"], c["micro"]
    act = b * m.seq * m.hidden * c["dtype_bytes"]
    bw, lat = link(cl, gpus, t <= cl.gpus_per_node, np.minimum(t, cl.gpus_per_node))
    n_ar = 4 + 2 * (c["recompute"] == 2)
    per_ar = np.where(c["sequence_parallel"],
                      2 * collective(act, (t - 1) / t, bw, lat, t),
                      collective(act, 2 * (t - 1) / t, bw, lat, t))
    return m.layers / c["pp"] * n_ar * per_ar
