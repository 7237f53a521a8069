"""Every field of the Hugging Face config classes of engine/model/shapes.py's families, classified: what
the engine does with it when it trains `model.hf` (engine/model/hf.py).

- implemented: the run follows transformers. Most fields are read by transformers' own modules,
  which the engine runs unmodified (the decoder layers, the rotary embedding, the init); the rest
  by engine/model/hf.py where it replaces transformers' model-level forward (the sliding-window mask,
  the router's auxiliary loss) and by the attention cores (engine/parallel/context.py).
- irrelevant: no effect on a training step (generation, output formats, classification heads,
  metadata; dtype: the engine's `precision` decides).
- refused: values the engine cannot follow; `field_errors` names the field, the value and the
  rule (ConfigError) before any rank starts. Some implemented fields are refused in one layout
  only (a sliding window with ring attention); their rule says which.

tests/test_hf_fields.py walks transformers' config classes of every family: a field that is not
in `FIELDS` fails it, so a new transformers field is classified before it can change a model
silently. Torch-free (validate() imports it); `RunConfig` is named in annotations only (config
imports validation, so validation does not import config: no import circle).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from engine.errors import ConfigError
from engine.model.shapes import MOE_FAMILIES

IMPLEMENTED, IRRELEVANT, REFUSED = "implemented", "irrelevant", "refused"
LAYERS = "transformers' decoder layers (run unmodified)"

FIELDS: dict[str, tuple[str, str]] = {
    # the shape (engine/model/shapes.py reads it for counts and prices)
    "vocab_size": (IMPLEMENTED, "embedding and head (transformers' modules)"),
    "hidden_size": (IMPLEMENTED, LAYERS),
    "intermediate_size": (IMPLEMENTED, LAYERS),
    "num_hidden_layers": (IMPLEMENTED, LAYERS),
    "num_attention_heads": (IMPLEMENTED, LAYERS),
    "num_key_value_heads": (IMPLEMENTED, "GQA: k/v keep their heads into the attention core, repeated there"),
    "head_dim": (IMPLEMENTED, LAYERS),
    "hidden_act": (IMPLEMENTED, LAYERS),
    "rms_norm_eps": (IMPLEMENTED, LAYERS),
    "attention_bias": (IMPLEMENTED, LAYERS),
    "mlp_bias": (IMPLEMENTED, LAYERS),
    "qkv_bias": (IMPLEMENTED, LAYERS),
    "tie_word_embeddings": (IMPLEMENTED, "transformers ties the head; engine/model/hf.py keeps it (HFCausalLM.tied)"),
    "pad_token_id": (IMPLEMENTED, "the embedding's padding_idx (transformers' module)"),
    "initializer_range": (IMPLEMENTED, "transformers' own initialisation at build"),
    "rope_parameters": (IMPLEMENTED, "transformers' rotary module; dynamic / longrope refused with parallel.cp > 1"),
    "max_position_embeddings": (IMPLEMENTED, "read by the rotary module's scaled rope types"),
    # attention (engine/model/hf.py `_attention`, engine/parallel/context.py)
    "attention_dropout": (IMPLEMENTED, "the attention core's dropout; refused with cp_impl=ring"),
    "sliding_window": (IMPLEMENTED, "masked as transformers masks it (local_attention); refused with cp_impl=ring"),
    "use_sliding_window": (IMPLEMENTED, "with sliding_window (the layer's window, `sliding_windows`)"),
    "max_window_layers": (IMPLEMENTED, "with sliding_window (the layer's window, `sliding_windows`)"),
    "layer_types": (IMPLEMENTED, "with sliding_window (the layer's window, `sliding_windows`)"),
    # mixture of experts
    "num_local_experts": (IMPLEMENTED, "engine/parallel/expert_fused.py holds them, sharded over ep"),
    "num_experts": (IMPLEMENTED, "engine/parallel/expert_fused.py holds them, sharded over ep"),
    "num_experts_per_tok": (IMPLEMENTED, "transformers' router"),
    "moe_intermediate_size": (IMPLEMENTED, LAYERS),
    "shared_expert_intermediate_size": (IMPLEMENTED, LAYERS),
    "decoder_sparse_step": (IMPLEMENTED, LAYERS),
    "mlp_only_layers": (IMPLEMENTED, LAYERS),
    "norm_topk_prob": (IMPLEMENTED, "transformers' router"),
    "router_jitter_noise": (IMPLEMENTED, "transformers' MoE block (training only)"),
    "output_router_logits": (IMPLEMENTED, "switches the router aux loss into the training loss (engine/model/hf.py); "
                             "refused with parallel.pp > 1"),
    "router_aux_loss_coef": (IMPLEMENTED, "the aux loss's weight (engine/model/hf.py router_aux_coef)"),
    # no effect on training
    "use_cache": (IRRELEVANT, "generation's key/value cache"),
    "bos_token_id": (IRRELEVANT, "generation; documents end with data.eos_id"),
    "eos_token_id": (IRRELEVANT, "generation; documents end with data.eos_id"),
    "pretraining_tp": (IRRELEVANT, "no module reads it in transformers 5"),
    "chunk_size_feed_forward": (IRRELEVANT, "no module of these families reads it"),
    "dtype": (IRRELEVANT, "the engine builds fp32 weights; `precision` sets the compute dtype"),
    "output_hidden_states": (IRRELEVANT, "an output format"),
    "return_dict": (IRRELEVANT, "an output format"),
    "id2label": (IRRELEVANT, "classification heads"),
    "label2id": (IRRELEVANT, "classification heads"),
    "problem_type": (IRRELEVANT, "classification heads"),
    "architectures": (IRRELEVANT, "metadata"),
    "transformers_version": (IRRELEVANT, "metadata"),
    # refused outright when set
    "is_encoder_decoder": (REFUSED, "must be false: the engine trains decoder-only causal LMs"),
}
# spellings transformers accepts beside its fields (hub config.json files carry them)
ALIASES: dict[str, str] = {"rope_theta": "rope_parameters", "rope_scaling": "rope_parameters",
                           "torch_dtype": "dtype"}
POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")  # rescale by the largest position id a forward sees
# transformers' config defaults the window rules read (tests/test_hf_fields.py compares them)
MISTRAL_WINDOW, QWEN_WINDOW, QWEN_MAX_WINDOW_LAYERS = 4096, 4096, 28
PER_LAYER_WINDOW = ("qwen2", "qwen3", "qwen2_moe")  # layer_types / max_window_layers pick the layers


def sliding_windows(data: Mapping[str, Any]) -> list[int | None]:
    """The sliding window transformers gives each layer's attention (None: full causal), from the
    raw config as its config classes and attention modules derive it."""
    family, n = data["model_type"], int(data.get("num_hidden_layers", 0) or 0)
    if family == "llama":
        return [None] * n
    if family in ("mistral", "mixtral"):
        return [data.get("sliding_window", MISTRAL_WINDOW if family == "mistral" else None)] * n
    window = data.get("sliding_window", QWEN_WINDOW) if data.get("use_sliding_window", False) else None
    if family not in PER_LAYER_WINDOW:
        return [window] * n
    types = data.get("layer_types") or [
        "sliding_attention" if window is not None and i >= data.get("max_window_layers", QWEN_MAX_WINDOW_LAYERS)
        else "full_attention" for i in range(n)]
    return [window if kind == "sliding_attention" else None for kind in types]


def _rope_types(data: Mapping[str, Any]) -> set[str]:
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    nested = [v for v in rope.values() if isinstance(v, Mapping)] if isinstance(rope, Mapping) else []
    return {str(r.get("rope_type", r.get("type", "default"))) for r in (nested or [rope]) if isinstance(r, Mapping)}


def field_errors(data: Mapping[str, Any], cfg: RunConfig) -> Iterator[ConfigError]:
    """Every value of `data` (a model.hf config) the engine would not follow in `cfg`'s layout."""
    p, seq = cfg.parallel, cfg.model.seq_len
    if data.get("is_encoder_decoder"):
        yield ConfigError("model.hf.is_encoder_decoder", data["is_encoder_decoder"], FIELDS["is_encoder_decoder"][1])
    ring = p.cp > 1 and p.cp_impl == "ring"
    dropout = data.get("attention_dropout", 0.0) or 0.0
    if ring and dropout > 0:
        yield ConfigError("model.hf.attention_dropout", dropout, "ring attention here has no attention dropout; "
                          "use parallel.cp_impl=ulysses (or attention_dropout 0)")
    windows = [w for w in sliding_windows(data) if w is not None and w < seq]
    if ring and windows:
        yield ConfigError("model.hf.sliding_window", min(windows), f"is shorter than model.seq_len={seq}: ring "
                          "attention here masks causally only; use parallel.cp_impl=ulysses")
    moving = sorted(_rope_types(data) & set(POSITION_DEPENDENT_ROPE))
    if p.cp > 1 and moving:
        yield ConfigError("model.hf.rope_parameters", f"rope_type={moving[0]}", "rescales by the largest position "
                          "a forward sees, which differs between cp chunks: needs parallel.cp=1")
    if data.get("output_router_logits") and data["model_type"] in MOE_FAMILIES and p.pp > 1:
        yield ConfigError("model.hf.output_router_logits", True, "adds the router aux loss of every layer, which "
                          "the pipeline schedule's loss does not carry: needs parallel.pp=1 (or "
                          "output_router_logits false)")
