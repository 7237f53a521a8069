"""A GPT-style decoder-only transformer sized by ModelConfig, with analytic parameter and FLOP counts.

Laid out for the parallelisms (as torchtitan does): separate q/k/v/o projections so a
column-parallel split keeps whole heads; blocks in a ModuleDict keyed by layer index so a
pipeline stage can delete the others and keep the names; `tok_emb`, `pos_emb`, `ln_f` and
`head` may be None on stages that do not own them.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from engine.config.schema import ModelConfig
from engine.model.mlp import MLP


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0,
                     doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over (b, heads, t, head_dim); with `doc_ids` (b, t), each run of equal ids
    (a packed document) attends only within itself, as flash-attention's varlen kernels do."""
    if doc_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    rows = []
    for i in range(q.shape[0]):
        _, counts = torch.unique_consecutive(doc_ids[i], return_counts=True)
        bounds = [0, *torch.cumsum(counts, 0).tolist()]
        rows.append(torch.cat([F.scaled_dot_product_attention(
            q[i:i + 1, :, a:e], k[i:i + 1, :, a:e], v[i:i + 1, :, a:e], is_causal=True, dropout_p=dropout_p)
            for a, e in zip(bounds[:-1], bounds[1:])], dim=2))
    return torch.cat(rows, dim=0)


class Attention(nn.Module):
    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.head_dim = d_model // heads
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)
        self.dropout = dropout
        self.core = causal_attention  # context parallelism swaps in its own (engine/parallel/context.py)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        # heads = width / head_dim, so a tensor-parallel shard sees only its local heads
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = self.core(q, k, v, dropout_p=self.dropout if self.training else 0.0, doc_ids=doc_ids)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Pre-LayerNorm block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig, *, moe: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg.d_model, cfg.heads, cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        if moe:  # Mixture-of-Experts block (engine/model/moe.py)
            from engine.model.moe import MoE

            self.mlp: nn.Module = MoE(cfg)
        else:
            self.mlp = MLP(cfg.d_model, cfg.mlp_ratio * cfg.d_model, cfg.dropout)
        self.checkpointed = False

    def _forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        # doc_ids only as a keyword and only when given: TP's PrepareModuleInput sees one input
        x = x + (self.attn(self.ln1(x)) if doc_ids is None else self.attn(self.ln1(x), doc_ids=doc_ids))
        return x + self.mlp(self.ln2(x))

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.checkpointed and torch.is_grad_enabled():
            return checkpoint(self._forward, x, doc_ids, use_reentrant=False)
        return self._forward(x, doc_ids)


class GPT(nn.Module):
    """Token + learned position embeddings, blocks, final LayerNorm, head tied to the embedding."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb: nn.Embedding | None = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        from engine.model.moe import is_moe_layer

        self.layers = nn.ModuleDict({str(i): Block(cfg, moe=is_moe_layer(cfg, i)) for i in range(cfg.layers)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(cfg.d_model)
        self.head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # tied embeddings
        self._init_weights()

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                # GPT-2 scaled init for the residual projections (Radford et al. 2019)
                std = 0.02 / math.sqrt(2 * self.cfg.layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens (b, t) -> logits (b, t, vocab); on a middle pipeline stage, hidden -> hidden.

        `positions` ((t,) or (b, t)): position ids, 0..t-1 when None (a context-parallel shard
        passes its slice; packed documents restart at 0). `doc_ids` (b, T): the packed document of
        each token of the whole row (T = t, or the full sequence under context parallelism).
        """
        if self.tok_emb is not None:
            pos = torch.arange(x.shape[1], device=x.device) if positions is None else positions
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.layers.values():
            x = block(x) if doc_ids is None else block(x, doc_ids)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.head is not None:
            x = self.head(x)
        return x

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each block's activations in backward (non-reentrant; works under DDP/FSDP2)."""
        for block in self.layers.values():
            block.checkpointed = enabled


def build_model(cfg: ModelConfig, *, seed: int, device: torch.device | str = "cpu") -> GPT:
    """The same initial weights on every rank for the same seed. On `device="meta"` nothing is
    allocated or drawn: engine/model/meta_init.py's `materialize` later fills each rank's own part with
    exactly these weights."""
    if torch.device(device).type == "meta":
        from engine.model.meta_init import record

        return record(lambda: GPT(cfg), seed=seed)
    torch.manual_seed(seed)
    return GPT(cfg).to(device)


def count_parameters(cfg: ModelConfig) -> dict[str, int]:
    """Analytic parameter counts (tied head counted once), from the model's shape (`engine.model.shapes`).

    `per_layer` is a dense block; `layers` and `total` hold every expert; with experts, `active`
    counts the top_k experts a token passes through (plus the routers) and `experts` every routed
    expert."""
    shape = model_shape(cfg)
    out = {"per_layer": shape.dense_layer_params, "layers": sum(shape.layer_params(i) for i in range(shape.layers)),
           "embedding": shape.embedding_params, "total": shape.params}
    if shape.experts:
        out["active"] = shape.active_params
        out["experts"] = shape.expert_params
    return out


def model_shape(cfg: ModelConfig):
    """The engine/model/shapes.py ModelShape of `cfg`: model.hf's config, else the built-in GPT."""
    from engine.model.shapes import from_gpt, from_hf_config

    if cfg.hf is not None:
        return from_hf_config(cfg.hf)
    return from_gpt(layers=cfg.layers, d_model=cfg.d_model, heads=cfg.heads, seq_len=cfg.seq_len, vocab=cfg.vocab,
                    mlp_ratio=cfg.mlp_ratio, experts=cfg.experts, top_k=cfg.top_k, moe_every=cfg.moe_every)


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token (forward + backward, no recomputation): the model's shape's count
    (`engine.model.shapes.ModelShape.flops_per_token`, the one definition: 6 x matmul parameters + 12 l h s,
    Chowdhery et al. 2022 appendix B; Narayanan et al. 2021's 72 l h^2 (1 + s/(6h) + V/(12 l h)) per
    token at mlp_ratio=4; MoE blocks count the router and the top_k experts a token passes through)."""
    return model_shape(cfg).flops_per_token(cfg.seq_len)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
