"""The shape of a decoder-only language model, read from the engine's GPT config or a Hugging Face
`config.json`, and the counts every consumer derives from it (parameters, active parameters,
training FLOPs per token). Pure and torch-free: the engine (MFU, memory estimate), the simulator
(`tuning/`) and the export all read the same `ModelShape`, so what runs and what is priced agree.

Hugging Face families read here: llama, mistral, qwen2, qwen3 (dense) and mixtral, qwen2_moe,
qwen3_moe (mixture of experts). Their attribute names are transformers' own (`hidden_size`,
`num_key_value_heads`, `intermediate_size`, `num_local_experts`, ...).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# transformers' config-class defaults (transformers 5) for keys a config.json may omit, where they differ
# from the rule used otherwise (head_dim = hidden / heads, key/value heads = heads)
FAMILY_DEFAULTS: dict[str, dict[str, int]] = {
    "qwen3": {"head_dim": 128}, "mistral": {"num_key_value_heads": 8}, "mixtral": {"num_key_value_heads": 8},
    "qwen3_moe": {"num_key_value_heads": 4},
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
HF_FAMILIES = DENSE_FAMILIES + MOE_FAMILIES


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """Everything about a model's architecture that its cost depends on (no weights)."""

    family: str  # "gpt" (engine/model/gpt.py) or a Hugging Face model_type
    layers: int
    hidden: int
    heads: int  # query heads
    kv_heads: int  # key/value heads (grouped-query attention when < heads)
    head_dim: int
    ffn_hidden: int  # MLP hidden size of a dense layer
    gated_mlp: bool  # SwiGLU (gate, up, down: 3 matrices) or GELU (2 matrices)
    vocab: int
    tied_embeddings: bool  # lm head shares the embedding matrix
    learned_positions: int = 0  # rows of a learned position table (GPT); 0 for RoPE (no parameters)
    norm_params: int = 1  # parameters per hidden unit of a norm: 1 RMSNorm, 2 LayerNorm (weight + bias)
    qkv_bias: bool = False  # biases on q, k, v (qwen2)
    o_bias: bool = False  # bias on the output projection
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k (qwen3)
    experts: int = 0  # routed experts per MoE layer; 0 = dense
    top_k: int = 0  # routed experts per token
    moe_ffn_hidden: int = 0  # hidden size of one routed expert
    shared_ffn_hidden: int = 0  # hidden size of the shared expert (qwen2_moe); 0 = none
    moe_layers: tuple[int, ...] = field(default_factory=tuple)  # indices of the MoE layers

    # ------------------------------------------------------------ parameters
    @property
    def layer_matmul_params(self) -> int:
        """Weights a token multiplies by in one dense block: q, k, v, o and the MLP's matrices (no norms,
        no biases: they do no matmul)."""
        attention = (2 * self.heads + 2 * self.kv_heads) * self.head_dim * self.hidden
        return attention + (3 if self.gated_mlp else 2) * self.hidden * self.ffn_hidden

    @property
    def attention_params(self) -> int:
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        bias += self.hidden if self.o_bias else 0
        return q + kv + o + bias + (2 * self.head_dim * self.norm_params if self.qk_norm else 0)

    def mlp_params(self, ffn: int) -> int:
        """One MLP of hidden size `ffn`."""
        mats = 3 if self.gated_mlp else 2
        bias = ((mats - 1) * ffn + self.hidden) if self.mlp_bias else 0
        return mats * self.hidden * ffn + bias

    @property
    def router_params(self) -> int:
        return self.hidden * self.experts

    @property
    def shared_expert_params(self) -> int:
        # qwen2_moe: a shared expert MLP and its sigmoid gate (a hidden -> 1 linear)
        return self.mlp_params(self.shared_ffn_hidden) + self.hidden if self.shared_ffn_hidden else 0

    @property
    def block_norm_params(self) -> int:
        """The two norms of one block (before attention, before the MLP)."""
        return 2 * self.hidden * self.norm_params

    @property
    def dense_layer_params(self) -> int:
        """Parameters of one dense block: attention, the MLP, norms and biases."""
        return self.attention_params + self.mlp_params(self.ffn_hidden) + self.block_norm_params

    @property
    def expert_params(self) -> int:
        """Every routed expert of every MoE block (no routers, no shared experts)."""
        return len(self.moe_layers) * self.experts * self.mlp_params(self.moe_ffn_hidden)

    def layer_params(self, layer: int, *, active: bool = False) -> int:
        """Parameters of block `layer` (with `active`, only the top_k experts a token uses)."""
        if layer not in self.moe_layers:
            return self.dense_layer_params
        routed = (self.top_k if active else self.experts) * self.mlp_params(self.moe_ffn_hidden)
        return self.attention_params + self.router_params + routed + self.shared_expert_params + self.block_norm_params

    @property
    def embedding_params(self) -> int:
        """Token embedding, learned positions, and the head when it is not tied."""
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.vocab * self.hidden + self.learned_positions * self.hidden + head

    @property
    def final_norm_params(self) -> int:
        return self.hidden * self.norm_params

    @property
    def params(self) -> int:
        """Every parameter (each expert counted once, a tied head once)."""
        return sum(self.layer_params(i) for i in range(self.layers)) + self.embedding_params + self.final_norm_params

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (top_k experts per MoE layer)."""
        return (sum(self.layer_params(i, active=True) for i in range(self.layers)) + self.embedding_params
                + self.final_norm_params)

    # ------------------------------------------------------------ FLOPs
    @property
    def matmul_params_per_token(self) -> int:
        """Weights each token multiplies by: the blocks' matrices (active experts, router, shared
        expert and its gate) and the vocabulary projection; no norms or biases (no matmul), no
        embedding lookup."""
        mlp = (3 if self.gated_mlp else 2) * self.hidden
        attention = self.layer_matmul_params - mlp * self.ffn_hidden
        per_moe = self.router_params + mlp * (self.top_k * self.moe_ffn_hidden + self.shared_ffn_hidden)
        per_moe += self.hidden if self.shared_ffn_hidden else 0
        moe = len(self.moe_layers)
        blocks = (self.layers - moe) * self.layer_matmul_params + moe * (attention + per_moe)
        return blocks + self.vocab * self.hidden

    def flops_per_token(self, seq: int, *, causal: bool = False) -> float:
        """Training FLOPs per token (forward + backward, no recomputation).

        6 * matmul parameters + 12 * layers * (heads * head_dim) * seq for attention scores and
        values (Chowdhery et al. 2022, PaLM appendix B, the MFU convention). `causal=True` counts
        only the unmasked half of the score matrix ((seq + 1) / 2 keys per query on average),
        what a causal kernel really computes; MFU figures use the convention (causal=False).
        """
        keys = (seq + 1) / 2 if causal else seq
        return 6.0 * self.matmul_params_per_token + 12.0 * self.layers * self.heads * self.head_dim * keys


# ---------------------------------------------------------------- readers

def read_hf_config(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A Hugging Face config as a dict: a `config.json` path (or a folder holding one), or a mapping
    with `model_type`. Errors name `model.hf`, the value and the rule."""
    if isinstance(source, Mapping):
        data = dict(source)
    else:
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError("model.hf", str(source), "must be a config.json file, a folder holding one, "
                              "or a mapping with model_type")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError("model.hf", str(source), f"is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError("model.hf", str(source), "must hold a JSON object")
    family = data.get("model_type")
    if family not in HF_FAMILIES:
        raise ConfigError("model.hf", family if family is not None else "(no model_type)",
                          f"model_type must be one of {', '.join(HF_FAMILIES)}")
    return data


def _positive_int(data: Mapping[str, Any], key: str, default: Any = None) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"model.hf.{key}", value, "must be a positive integer")
    return value


def _bias_flags(family: str, data: Mapping[str, Any]) -> dict[str, bool]:
    """Which linear layers carry a bias, as each transformers family builds them (transformers 5):
    Qwen2 always on q/k/v (never on o), qwen2_moe on q/k/v unless `qkv_bias` is false, `attention_bias`
    on q/k/v/o of llama, qwen3 and qwen3_moe (mistral and mixtral ignore it), `mlp_bias` on llama only."""
    attention = family in ("llama", "qwen3", "qwen3_moe") and bool(data.get("attention_bias", False))
    qkv = family == "qwen2" or (family == "qwen2_moe" and bool(data.get("qkv_bias", True)))
    return {"qkv_bias": qkv or attention, "o_bias": attention,
            "mlp_bias": family == "llama" and bool(data.get("mlp_bias", False))}


def from_hf_config(source: str | Path | Mapping[str, Any]) -> ModelShape:
    """The shape of a Hugging Face causal LM config (see `read_hf_config` for `source`)."""
    data = read_hf_config(source)
    family = data["model_type"]
    data = {**FAMILY_DEFAULTS.get(family, {}), **{k: v for k, v in data.items() if v is not None}}
    hidden = _positive_int(data, "hidden_size")
    heads = _positive_int(data, "num_attention_heads")
    layers = _positive_int(data, "num_hidden_layers")
    kv_heads = _positive_int(data, "num_key_value_heads", heads)
    head_dim = data.get("head_dim") or hidden // heads
    common: dict[str, Any] = dict(
        family=family, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=int(head_dim),
        ffn_hidden=_positive_int(data, "intermediate_size"), gated_mlp=True,
        vocab=_positive_int(data, "vocab_size"), tied_embeddings=bool(data.get("tie_word_embeddings", False)),
        **_bias_flags(family, data), qk_norm=family in ("qwen3", "qwen3_moe"))
    if family == "mixtral":
        experts = _positive_int(data, "num_local_experts", 8)
        return ModelShape(**common, experts=experts, top_k=_positive_int(data, "num_experts_per_tok", 2),
                          moe_ffn_hidden=common["ffn_hidden"], moe_layers=tuple(range(layers)))
    if family in ("qwen2_moe", "qwen3_moe"):
        step = int(data.get("decoder_sparse_step", 1) or 1)
        dense_only = set(data.get("mlp_only_layers") or [])
        moe = tuple(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
        shared = int(data.get("shared_expert_intermediate_size", 0) or 0) if family == "qwen2_moe" else 0
        # hub configs say num_experts; transformers 5 serialises qwen3_moe's as num_local_experts
        experts_key = "num_experts" if data.get("num_experts") is not None else "num_local_experts"
        return ModelShape(**common, experts=_positive_int(data, experts_key),
                          top_k=_positive_int(data, "num_experts_per_tok"),
                          moe_ffn_hidden=_positive_int(data, "moe_intermediate_size"),
                          shared_ffn_hidden=shared, moe_layers=moe)
    return ModelShape(**common)


def moe_layer_indices(layers: int, *, experts: int, moe_every: int) -> tuple[int, ...]:
    """The MoE blocks of the built-in GPT: every `moe_every`-th block, 1-based (moe_every=2 makes blocks
    1, 3, ... MoE, as GShard); none without experts."""
    return tuple(i for i in range(layers) if experts > 0 and (i + 1) % max(moe_every, 1) == 0)


def from_gpt(*, layers: int, d_model: int, heads: int, seq_len: int, vocab: int, mlp_ratio: int = 4,
             experts: int = 0, top_k: int = 2, moe_every: int = 1) -> ModelShape:
    """The shape of the engine's built-in GPT (engine/model/gpt.py): LayerNorm, GELU MLP, learned
    positions, tied head, no biases on the linear layers."""
    moe = moe_layer_indices(layers, experts=experts, moe_every=moe_every)
    return ModelShape(family="gpt", layers=layers, hidden=d_model, heads=heads, kv_heads=heads,
                      head_dim=d_model // heads, ffn_hidden=mlp_ratio * d_model, gated_mlp=False, vocab=vocab,
                      tied_embeddings=True, learned_positions=seq_len, norm_params=2, experts=experts,
                      top_k=min(top_k, experts) if experts else 0, moe_ffn_hidden=mlp_ratio * d_model,
                      moe_layers=moe)
