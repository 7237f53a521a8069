"""ZeRO (Rajbhandari et al. 2020) sharded data parallelism over the dp mesh axis (dp x cp flattened,
"dp_cp", under context parallelism: cp ranks hold the same weights, as torchtitan's dp_shard_cp).

What each stage does per optimizer step of `accum` micro-batches (G FSDP2 groups: one per block
in `model.layers`, then the root with the embeddings, the tied head and the final norm):

stage 1: optimizer states sharded. DDP (or, with tensor parallelism, FSDP2 `replicate`) with
         no-sync accumulation: one gradient all-reduce per step, after the last micro-batch;
         `ZeroRedundancyOptimizer(AdamW)` (`DTensorZeroOptimizer` for DTensor parameters,
         below) steps each rank's share and broadcasts it.
stage 2: + gradients sharded. FSDP2 `fully_shard(reshard_after_forward=False)` per group.
         Every micro-batch's backward reduce-scatters each group's gradients as soon as that
         group's backward ends (and frees the unsharded copy), as DeepSpeed's ZeRO-2 reduces
         gradients every micro-batch; the sharded gradients accumulate. Parameters are
         all-gathered once per step, before the first micro-batch's forward, and stay
         unsharded through every micro-batch (`keep_gathered`: reshard-after-backward off on
         all but the last) until the last backward: G all-gathers per step at any `accum`.
         Ours, unlike DeepSpeed's ZeRO-2: parameters are sharded at rest (between steps), so
         the step's one all-gather replaces DeepSpeed's parameter all-gather after the step;
         the bytes per step are the same (one reduce-scatter per micro-batch, one all-gather).
stage 3: + parameters sharded. The same groups with `reshard_after_forward=True`: each group is
         all-gathered before its forward and again before its backward, in every micro-batch
         (2 x G x accum all-gathers per step, plus the reduce-scatters). `reshard_after_forward=
         False` keeps them gathered from forward to backward within a micro-batch (G x accum).

Composes with tensor parallelism: FSDP2 shards the dp sub-mesh of a model already
parallelized over the tp sub-mesh of the same (pp, dp, tp) mesh (2-D FSDP+TP). Under a
pipeline, torch's schedule runs the micro-batches and does its own no-sync accumulation.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim import AdamW, Optimizer

from engine.parallel.data import apply_data_parallel
from engine.torch_compat import _flatten_dense_tensors, _unflatten_dense_tensors, fused_kernel_devices

logger = logging.getLogger(__name__)


def apply_zero(model: nn.Module, dp_mesh: DeviceMesh, *, stage: int, reshard_after_forward: bool = True,
               mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Apply ZeRO `stage` (1-3) over the 1-D `dp_mesh`; pair it with `build_optimizer(stage=...)`.

    Stage 1 returns a DDP wrapper (or, with TP, `model` under FSDP2 `replicate`); stages 2 and
    3 shard `model` in place, one FSDP2 group per block (`model.layers`) then the root, and
    return it. Stage 3 honours `reshard_after_forward` (False makes it stage 2); stage 2
    always keeps parameters after forward. The root `fully_shard` holds the tied
    embedding/head weight, so the tie survives (sharding the embedding alone would split it
    from the head). `mp_policy` is FSDP2's `MixedPrecisionPolicy` (stages 2-3).
    """
    if stage == 1:
        if mp_policy is not None:
            logger.warning("apply_zero: mp_policy applies to stages 2-3 (FSDP2); stage 1 ignores it")
        return apply_data_parallel(model, process_group=dp_mesh.get_group(), dp_mesh=dp_mesh)
    if stage not in (2, 3):
        raise ValueError(f"parallel.zero={stage}: apply_zero takes stage 1, 2 or 3; "
                         "stage 0 is plain data parallel (apply_data_parallel)")
    reshard = reshard_after_forward if stage == 3 else False
    kwargs: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": reshard}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    # per block: a block's gradients are reduce-scattered and freed when its backward ends
    for block in getattr(model, "layers", {}).values():
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


@contextlib.contextmanager
def keep_gathered(model: nn.Module) -> Iterator[None]:
    """ZeRO-2's context for a micro-batch other than the step's last: its backward still
    reduce-scatters the gradients, but the parameters stay unsharded afterwards, so the next
    micro-batch's forward all-gathers nothing (FSDP2's `set_reshard_after_backward`, restored on
    exit: the last micro-batch reshards, and parameters are sharded at rest)."""
    model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        model.set_reshard_after_backward(True)


def param_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """The one weight-decay rule of every layout: decay matrices (linear weights and the tied
    embedding/head), not norms or biases (1-D), as nanoGPT's `configure_optimizers` and
    Megatron-LM's `get_param_groups` do. DTensor parameters (TP, FSDP2) keep their global
    `dim()`, so the rule is the same sharded or not."""
    unique = list({id(p): p for p in params if p.requires_grad}.values())
    decayed = {"params": [p for p in unique if p.dim() >= 2], "weight_decay": weight_decay}
    plain = {"params": [p for p in unique if p.dim() < 2], "weight_decay": 0.0}
    return [part for group in (decayed, plain) for part in _split_dtensors(group)]


def _split_dtensors(group: dict[str, Any]) -> list[dict[str, Any]]:
    """`group` as one group of DTensor and one of plain parameters where it holds both (TP leaves
    norms plain): AdamW's foreach kernels, its default on CUDA, refuse a list mixing the two."""
    dtensors = [p for p in group["params"] if isinstance(p, DTensor)]
    if not dtensors or len(dtensors) == len(group["params"]):
        return [group]
    tensors = [p for p in group["params"] if not isinstance(p, DTensor)]
    return [{**group, "params": dtensors}, {**group, "params": tensors}]


def build_optimizer(params: nn.Module | Iterable[nn.Parameter], *, stage: int, lr: float,
                    betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.0,
                    process_group: dist.ProcessGroup | None = None) -> Optimizer:
    """AdamW over `params` (a module or its parameters) under ZeRO `stage` (0-3): the one
    optimizer builder of every layout; `process_group` is the dp group (stage 1).

    Stages 0, 2 and 3: plain AdamW, which under FSDP2 steps on the local shards of the DTensor
    parameters, so its states are sharded too. Stage 1: AdamW states sharded over
    `process_group`, by `ZeroRedundancyOptimizer` or, for DTensor parameters,
    `DTensorZeroOptimizer`. Weight decay follows `param_groups` in every stage.
    """
    groups = param_groups(params.parameters() if isinstance(params, nn.Module) else params, weight_decay)
    flat = [p for g in groups for p in g["params"]]
    fused = fused_supported(flat)
    if stage != 1:
        return AdamW(groups, lr=lr, betas=betas, fused=fused)
    if any(isinstance(p, DTensor) for p in flat):
        return DTensorZeroOptimizer(groups, optimizer_class=AdamW, process_group=process_group,
                                    lr=lr, betas=betas, fused=fused)
    # imported here: torch.distributed.optim scripts its functional optimizers on import (~1.4 s)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    # bucket view: after the step each rank broadcasts one flat bucket, not one message per parameter
    return ZeroRedundancyOptimizer(groups, optimizer_class=AdamW, process_group=process_group,
                                   lr=lr, betas=betas, fused=fused, parameters_as_bucket_view=True)


def fused_supported(params: list[torch.Tensor]) -> bool:
    """Whether AdamW's fused kernel takes `params`: floating point, on a device type torch has it
    for (CPU and CUDA). One kernel per step instead of a chain of foreach ops: on this 2-core host
    a 6.3M-parameter step took 6.5 ms fused against 40.3 ms with foreach (`bench/optimizer.py`)."""
    devices = set(fused_kernel_devices())
    return bool(params) and all(p.is_floating_point() and p.device.type in devices for p in params)


def _partition(params: list[torch.Tensor], num_ranks: int) -> list[int]:
    """Owner index per parameter: largest first onto the least-loaded rank (as ZeroRedundancyOptimizer)."""
    load = [0] * num_ranks
    owner = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: -_local(params[i]).numel()):
        r = load.index(min(load))
        owner[i] = r
        load[r] += _local(params[i]).numel()
    return owner


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


class DTensorZeroOptimizer(Optimizer):
    """ZeRO-1 for DTensor parameters: each dp rank steps the parameters it owns, then broadcasts them.

    Written because `ZeroRedundancyOptimizer` broadcasts `param.data`, and `c10d.broadcast_`
    has no DTensor sharding rule in torch 2.13. Gradients must already be averaged over the
    dp group (FSDP2 `replicate`). The inner optimizer (`self.optim`, as in
    ZeroRedundancyOptimizer) holds the states of the owned parameters only; one broadcast per
    owner rank carries the updated local shards. `state_dict()` is this rank's shard.
    """

    def __init__(self, params: Iterable[Any], *, optimizer_class: Callable[..., Optimizer],
                 process_group: dist.ProcessGroup | None, **defaults: Any) -> None:
        super().__init__(params, defaults)
        self.process_group = process_group
        ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        self._ranks = ranks
        all_params = [p for g in self.param_groups for p in g["params"]]
        owner = dict(zip(map(id, all_params), _partition(all_params, len(ranks))))
        me = ranks.index(dist.get_rank())
        self._owned_by = [[p for p in all_params if owner[id(p)] == r] for r in range(len(ranks))]
        local_groups = [{**{k: v for k, v in g.items() if k != "params"},
                         "params": [p for p in g["params"] if owner[id(p)] == me]} for g in self.param_groups]
        self.optim = optimizer_class(local_groups, **defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step the owned parameters with the current hyperparameters, then share them."""
        for group, local in zip(self.param_groups, self.optim.param_groups):
            local.update({k: v for k, v in group.items() if k != "params"})
        loss = self.optim.step(closure)
        for r, owned in enumerate(self._owned_by):
            if not owned:
                continue
            shards = [_local(p) for p in owned]
            flat = _flatten_dense_tensors(shards)
            dist.broadcast(flat, src=self._ranks[r], group=self.process_group)
            for shard, new in zip(shards, _unflatten_dense_tensors(flat, shards)):
                shard.copy_(new)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state of this rank's shard."""
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a shard saved by `state_dict()` on the same rank and layout."""
        self.optim.load_state_dict(state_dict)
