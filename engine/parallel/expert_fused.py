"""Expert parallelism for transformers' fused experts (Mixtral in transformers 5: one
`gate_up_proj` (E, 2F, H) and one `down_proj` (E, H, F) tensor per layer, not a module per expert).

`FusedExperts` holds the same weights as one (2F, H) and one (H, F) parameter per expert, keyed by
the expert's global id (`experts.gate_up.5`): a checkpoint then names expert e the same in every
layout, and DCP never mistakes two ranks' different slices of one fused tensor for replicas.
engine/model/hf.py splits every MoE layer so at build time (ep=1 included, so ep=1 and ep=2 checkpoints
resume in each other). Each ep rank keeps experts [j*E/ep, (j+1)*E/ep) and routes token copies to their expert's rank with engine/parallel/expert.py's `ExpertExchange`
(all_to_all of counts, tokens and outputs; gradients travel back the same way). The groups and
the expert-gradient reduction are expert.py's: ep groups cut out of the mesh's dp groups, expert
gradients summed over their replicas and divided by dp.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.parallel.expert import ExpertExchange, ExpertParallel, _new_groups, _Wire, expert_group_ranks


class FusedExperts(nn.Module):
    """A drop-in for transformers' fused experts module holding experts [first, first + local)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.num_experts = inner.num_experts  # global count: routing indices are global ids
        self.first, self.local = 0, inner.num_experts
        self.gate_up = nn.ParameterDict({str(e): nn.Parameter(inner.gate_up_proj.data[e].clone())
                                         for e in range(self.num_experts)})
        self.down = nn.ParameterDict({str(e): nn.Parameter(inner.down_proj.data[e].clone())
                                      for e in range(self.num_experts)})
        self.act_fn = inner.act_fn
        self.exchange = self.run_experts  # replaced by an ExpertExchange under ep > 1

    def keep(self, first: int, local: int) -> list[nn.Parameter]:
        """Drop every expert but [first, first + local); returns the kept parameters."""
        for e in range(self.num_experts):
            if not first <= e < first + local:
                del self.gate_up[str(e)], self.down[str(e)]
        self.first, self.local = first, local
        return [*self.gate_up.values(), *self.down.values()]

    def run_experts(self, rows: torch.Tensor, per_expert: list[int] | torch.Tensor) -> torch.Tensor:
        """Rows grouped by local expert (`per_expert[e]` rows each) through their experts."""
        sizes = per_expert.tolist() if isinstance(per_expert, torch.Tensor) else list(per_expert)
        outs = []
        for e, part in enumerate(rows.split(sizes)):
            key = str(self.first + e)
            gate, up = nn.functional.linear(part, self.gate_up[key]).chunk(2, dim=-1)
            outs.append(nn.functional.linear(self.act_fn(gate) * up, self.down[key]))
        return torch.cat(outs) if outs else rows

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' experts contract: (n, H) tokens, (n, k) expert ids and weights -> (n, H)."""
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # token copies grouped by global expert id
        token = order // k
        counts = torch.bincount(flat, minlength=self.num_experts)
        y = self.exchange(hidden_states[token], counts)
        y = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)
        return torch.zeros_like(hidden_states).index_add_(0, token, y.to(hidden_states.dtype))


def split_fused_experts(model: nn.Module) -> int:
    """Replace every transformers fused experts module (a 3-D `gate_up_proj`) by a `FusedExperts`
    holding the same weights per expert; returns how many were replaced."""
    found = [m for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module)
             and getattr(m.experts, "gate_up_proj", None) is not None and m.experts.gate_up_proj.dim() == 3]
    for parent in found:
        parent.experts = FusedExperts(parent.experts)
    return len(found)


def apply_fused_expert_parallel(model: nn.Module, mesh, *, ep: int, timeout=None) -> ExpertParallel:
    """Keep this rank's experts of every `FusedExperts` module and exchange tokens over its ep group.

    ep groups are cut out of the mesh's dp groups (expert.py's `expert_group_ranks`, placement
    included). Every rank must hold the full, identically initialised model. Call on every rank.
    """
    from engine.mesh import mesh_axis_groups

    rank = dist.get_rank()
    dp = mesh["dp"].size()
    ep_lists, replica_lists = expert_group_ranks(mesh_axis_groups(mesh, "dp"), ep)
    ep_group = _new_groups(ep_lists, rank, timeout)
    replica_group = _new_groups(replica_lists, rank, timeout)
    ep_rank = next(g for g in ep_lists if rank in g).index(rank)
    params: list[nn.Parameter] = []
    for experts in [m for m in model.modules() if isinstance(m, FusedExperts)]:
        local = experts.num_experts // ep
        params += experts.keep(ep_rank * local, local)
        experts.exchange = ExpertExchange(experts, ep_group=ep_group, ep_rank=ep_rank, ep=ep,
                                          node_of=[0] * ep, nodes=None, wire=_Wire(None))
    return ExpertParallel(expert_params=params, replica_group=replica_group, dp=dp, ep_group=ep_group)
