"""Mixture-of-Experts layer for the GPT: softmax router, top-k, capacity with token dropping,
the load-balancing auxiliary loss, and analytic parameter / FLOP counts.

Routing follows GShard (Lepikhin et al. 2020) and Switch (Fedus et al. 2021): router logits ->
softmax (fp32) -> top-k experts per token; top-1 gates are the router probability (Switch),
top-k>1 gates are renormalised over the k chosen (GShard). Capacity per expert is
ceil(capacity_factor * tokens * k / experts) of the tokens this rank routes (GShard's local
group); assignments beyond it are dropped, first choices before second choices (GShard's
priority), tokens in order. A dropped assignment contributes nothing (the residual carries the
token). capacity_factor=0 drops nothing.

Auxiliary loss (Switch eq. 4): experts * sum_e f_e * P_e, f_e = share of the top-k assignments
routed to e (before dropping), P_e = mean router probability of e; for k=1 this is Switch's
form, for k>1 the HF-Transformers / Mixtral generalisation.

The layer hands its sorted tokens to `self.exchange(tokens, counts)`; without expert
parallelism that runs the local experts, with it (engine/parallel/expert.py) an all_to_all
sends each expert's tokens to the rank that holds it and brings the outputs back.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config.schema import ModelConfig
from engine.model.mlp import MLP
from engine.model.shapes import moe_layer_indices

Exchange = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Every `moe_every`-th block (`engine.model.shapes.moe_layer_indices`)."""
    return layer in moe_layer_indices(cfg.layers, experts=cfg.experts, moe_every=cfg.moe_every)


def moe_layer_count(cfg: ModelConfig) -> int:
    return len(moe_layer_indices(cfg.layers, experts=cfg.experts, moe_every=cfg.moe_every))


def capacity(tokens: int, *, experts: int, top_k: int, factor: float) -> int:
    """Assignments one expert accepts from `tokens` local tokens; 0 factor = unlimited."""
    if factor <= 0:
        return tokens * top_k
    return max(1, math.ceil(factor * tokens * top_k / experts))


@dataclass(slots=True)
class Routing:
    """Kept (token, expert, gate) assignments of one forward, sorted by expert."""

    token: torch.Tensor  # (A,) token index of each kept assignment
    expert: torch.Tensor  # (A,) expert index, non-decreasing
    gate: torch.Tensor  # (A,) combine weight
    counts: torch.Tensor  # (experts,) kept assignments per expert
    routed: torch.Tensor  # (experts,) assignments per expert before dropping
    aux_loss: torch.Tensor  # scalar load-balancing loss (unscaled)


def route(logits: torch.Tensor, *, top_k: int, capacity_factor: float) -> Routing:
    """Top-k softmax routing with capacity of `logits` (tokens, experts)."""
    n, experts = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)
    top_p, top_e = torch.topk(probs, top_k, dim=-1)  # (n, k)
    gates = top_p if top_k == 1 else top_p / top_p.sum(dim=-1, keepdim=True)
    # priority order: all first choices, then all second choices (GShard), tokens in order
    expert = top_e.t().reshape(-1)
    token = torch.arange(n, device=logits.device).repeat(top_k)
    gate = gates.t().reshape(-1)
    one_hot = F.one_hot(expert, experts)
    routed = one_hot.sum(0)
    f = routed.float() / (n * top_k)
    aux = experts * torch.sum(f * probs.mean(0))
    if capacity_factor > 0:  # dropless keeps every assignment: no mask, whose size depends on values (dry runs)
        position = (one_hot.cumsum(0) * one_hot).sum(1) - 1  # rank of each assignment within its expert
        keep = position < capacity(n, experts=experts, top_k=top_k, factor=capacity_factor)
        expert, token, gate = expert[keep], token[keep], gate[keep]
    order = torch.argsort(expert, stable=True)
    return Routing(token=token[order], expert=expert[order], gate=gate[order],
                   counts=torch.bincount(expert, minlength=experts), routed=routed, aux_loss=aux)


class MoE(nn.Module):
    """`experts` expert MLPs behind a top-k router; replaces a block's MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.experts, cfg.top_k
        self.capacity_factor, self.aux_loss_coef = cfg.capacity_factor, cfg.aux_loss_coef
        self.router = nn.Linear(cfg.d_model, cfg.experts, bias=False)
        # keyed by the GLOBAL expert id: under expert parallelism a rank keeps a subset under the
        # same names (`experts.2.w1.weight` is expert 2 on every layout), so checkpoints never collide
        self.experts = nn.ModuleDict({str(e): MLP(cfg.d_model, cfg.mlp_ratio * cfg.d_model, cfg.dropout)
                                      for e in range(cfg.experts)})
        self.exchange: Exchange = self.run_experts  # replaced by expert parallelism
        self.compressor = None  # LSH-MoE token compression (engine/comm/lsh.py), set by expert parallelism
        self.aux_loss: torch.Tensor | None = None
        self.stats = MoEStats(cfg.experts)

    def run_experts(self, tokens: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        """Tokens sorted by local expert, `counts` per local expert (a tensor, or the Python ints
        expert parallelism already read) -> outputs in the same order."""
        # variable chunk sizes are Python ints: one host read per layer (as every dropless MoE)
        chunks = tokens.split(counts if isinstance(counts, list) else counts.tolist())
        outs = [expert(chunk) for expert, chunk in zip(self.experts.values(), chunks)]
        return torch.cat(outs) if outs else tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        r = route(self.router(flat), top_k=self.top_k, capacity_factor=self.capacity_factor)
        tokens = flat[r.token]
        if self.compressor is not None:
            sent, counts, restore = self.compressor.compress(tokens, r.expert, r.counts)
            y = restore(self.exchange(sent, counts))
        else:
            y = self.exchange(tokens, r.counts)
        # under bf16 autocast the experts return bf16 while the residual stream is fp32: sum in fp32
        out = torch.zeros_like(flat).index_add(0, r.token, (y * r.gate.to(y.dtype).unsqueeze(1)).to(flat.dtype))
        if self.training:
            self.aux_loss = self.aux_loss_coef * r.aux_loss
            self.stats.add(r.routed, r.counts)
        return out.view_as(x)


class MoEStats:
    """Assignments this rank routed to each expert, and how many were kept (not dropped), since
    the last read. Summed on the device of the routing (allocated at the first forward); read
    once per step record (`step_stats`), never per layer or micro-batch."""

    def __init__(self, experts: int) -> None:
        self.experts = experts
        self.routed: torch.Tensor | None = None
        self.kept: torch.Tensor | None = None

    def add(self, routed: torch.Tensor, kept: torch.Tensor) -> None:
        if self.routed is None or self.routed.device != routed.device:
            self.routed = torch.zeros(self.experts, dtype=torch.long, device=routed.device)
            self.kept = torch.zeros(self.experts, dtype=torch.long, device=routed.device)
        self.routed += routed.detach()
        self.kept += kept.detach()

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(routed, kept) per expert since the last take, on their device (zeros before any add)."""
        if self.routed is None:
            zeros = torch.zeros(self.experts, dtype=torch.long)
            return zeros, zeros.clone()
        out = (self.routed.clone(), self.kept.clone())
        self.routed.zero_()
        self.kept.zero_()
        return out


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def take_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the scaled aux losses of the last forward (then cleared): the GPT's MoE layers, and a
    Hugging Face model's router loss (engine/model/hf.py, `has_aux_loss`); None when there is none."""
    total = None
    for layer in [m for m in model.modules() if isinstance(m, MoE) or getattr(m, "has_aux_loss", False)]:
        if layer.aux_loss is not None:
            total = layer.aux_loss if total is None else total + layer.aux_loss
            layer.aux_loss = None
    return total


def step_stats(modules: list[nn.Module]) -> dict[str, float]:
    """Per-step MoE metrics of this rank: tokens routed to each expert (summed over MoE layers,
    before dropping) and the drop rate; resets the counters. One host read for all of them."""
    routed, kept = None, None
    for module in modules:
        for layer in moe_layers(module):
            r, k = layer.stats.take()
            routed = r if routed is None else routed + r.to(routed.device)
            kept = k if kept is None else kept + k.to(kept.device)
    if routed is None:
        return {}
    values = torch.cat([routed, kept.sum().reshape(1)]).tolist()  # the step record's one read
    per_expert, total_kept = values[:-1], values[-1]
    out = {f"tokens/e{i}": float(v) for i, v in enumerate(per_expert)}
    total = float(sum(per_expert))
    out["drop_rate"] = (total - total_kept) / total if total else 0.0
    out["imbalance"] = max(per_expert) / (total / len(per_expert)) if total else 0.0  # max / mean load
    return out
