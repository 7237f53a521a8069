"""Gradient compression under FSDP2 (ZeRO-2/3) through torch's hook for it:
`FSDPModule.set_custom_reduce_scatter(comm)` (torch 2.13), which replaces the reduce-scatter of
each `fully_shard` group's flat gradient buffer.

The custom comm runs the reduce leg of engine/comm/bidirectional.py: each rank compresses its
gradient's n shards (Rand-k with shared-seed indices, or Top-k with a worker error memory) and
the owner of each shard receives the compressed pieces and writes their mean (or sum) into its
dense gradient shard. The other leg of FSDP2 is the all-gather of *parameters* (the optimizer
runs on the owner's shard), which is not a gradient and stays dense.

Only randk and topk have this form: the buffer FSDP2 hands over is a flat concatenation of many
parameters' shards without their shapes, so PowerSGD (needs each gradient matrix) cannot run
there; fp16/bf16 is FSDP2's own `MixedPrecisionPolicy(reduce_dtype=...)`, not a comm hook; int8
would need its own all-to-all of int8 rows and scales (not written).
"""
from typing import Sequence

import torch
import torch.distributed as dist

from engine.comm.bidirectional import BidirectionalState, compressed_reduce_scatter
from engine.torch_compat import ReduceScatter
from engine.config.validate import FSDP_COMPRESSORS


class CompressedReduceScatter(ReduceScatter):
    """FSDP2 reduce-scatter whose traffic is Rand-k or Top-k compressed; one per fully_shard group."""

    def __init__(self, state: BidirectionalState, index: int) -> None:
        self.state, self.index = state, index

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise ValueError(f"compressed FSDP2 reduce-scatter supports AVG and SUM, not {op}")
        mean = compressed_reduce_scatter(self.state, input_tensor.float(), self.index)
        scale = 1.0 if op == dist.ReduceOp.AVG else float(dist.get_world_size(group))
        output_tensor.copy_(mean.mul_(scale).to(output_tensor.dtype))
        return None


def apply_fsdp_compression(modules: list, compressor: str, *, process_group: dist.ProcessGroup | None,
                           density: float = 0.01, seed: int = 0, on_bytes=None) -> BidirectionalState:
    """Give every FSDP2 module in `modules` (each `fully_shard` group) a compressed reduce-scatter
    sharing one state (residuals keyed by the module's position). Returns the state."""
    if compressor not in FSDP_COMPRESSORS:
        raise ValueError(f"comm.compressor={compressor!r} has no FSDP2 form; use one of {', '.join(FSDP_COMPRESSORS)}")
    state = BidirectionalState(compressor=compressor, process_group=process_group, seed=seed, on_bytes=on_bytes)
    state.set_level(density=density)
    for index, module in enumerate(modules):
        module.set_custom_reduce_scatter(CompressedReduceScatter(state, index))
    return state
