"""FP8 memory: what Transformer Engine keeps beside the 16-bit weights where a row trains its linear layers in FP8
(`ParallelSpec.fp8`); the FP8 GEMM rates and cast traffic are tuning/sim/compute.py's and tuning/sim/kernels.py's."""
from __future__ import annotations

from typing import Any

import numpy as np

from tuning.sim.compute import FP8_AMAX_BYTES_PER_GEMM
from tuning.sim.framework import FRAMEWORK_NAMES
from tuning.sim.spec import ModelSpec


def fp8_weight_copies(m: ModelSpec, c: dict[str, np.ndarray], layers: Any, held: Any) -> Any:
    """Bytes of Transformer Engine's FP8 weight copies on a pipeline rank holding `layers` blocks where a row runs FP8
    (`fp8`). TE's Linear
    casts each weight to FP8 with its transpose (tex.fp8_cast_transpose_fused); Megatron-core passes
    is_first_microbatch, so TE keeps both as workspaces for the whole step (`_fp8_workspaces` / weight1_fp8 and
    weight1_t_fp8: 2 bytes a linear weight of the stage); a caller that passes None (Composer's amp_fp8) recasts
    each call and keeps only what its backward reads, the FP8 transpose saved for dgrad (ctx.save_for_backward:
    1 byte a linear weight per layer and micro-batch in flight, `held`; one layer under full recomputation). Each
    of a layer's GEMMs keeps its amax history (FP8_AMAX_BYTES_PER_GEMM). MoE experts are not counted (their
    GEMMs are priced 16-bit)."""
    on = np.asarray(c.get("fp8", False), dtype=bool)
    fw = np.asarray(c.get("framework", 0))
    cached = (fw == FRAMEWORK_NAMES.index("megatron-core")) | (fw == FRAMEWORK_NAMES.index("megatron"))
    per_layer = m.layer_matmul_params / c["tp"]
    saved = per_layer * np.where(c["recompute"] == 2, 1.0, held)
    gemms = layers * (3 + m.mlp_mats - 1 + 1)  # q/k/v (fused), out, the MLP's matrices
    return np.where(on, np.where(cached, 2.0 * per_layer * layers, saved) + gemms * FP8_AMAX_BYTES_PER_GEMM, 0.0)
