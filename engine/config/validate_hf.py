"""The rules of `model.hf` and `model.hf_weights` (engine/model/hf.py): what a Hugging Face model combines
with, and the shape rules its config implies. Pure: they take what engine/config/validate_files.py read
(`files.hf_model`: the config.json, transformers' refusals, the weights' check) and open nothing.
`RunConfig` and `Files` are named in annotations only (config imports validation: no import circle)."""
from __future__ import annotations

from collections.abc import Iterator

from engine.errors import ConfigError
from engine.mesh import divisor_hint as _try


HF_TRAINABLE = ("llama", "mistral", "qwen2", "qwen3", "mixtral")  # engine/model/hf.py builds and trains these


def hf_rules(cfg: RunConfig, files: Files) -> Iterator[ConfigError]:
    """model.hf (engine/model/hf.py): what a Hugging Face model combines with; the shape rules read its config
    (`files.hf_model`: the config.json read, transformers' refusals, the weights' check)."""
    from engine.config.hf_fields import field_errors
    from engine.model.shapes import from_hf_config

    m, p, found = cfg.model, cfg.parallel, files.hf_model
    if m.hf is None:
        if m.hf_weights is not None:
            yield ConfigError("model.hf_weights", m.hf_weights, "needs model.hf (the config the weights belong to)")
        return
    if found.error is not None:
        yield found.error
        return
    shape = from_hf_config(found.config)
    yield from found.config_problems
    yield from field_errors(found.config, cfg)  # engine/config/hf_fields.py: what the ranks would not follow
    if shape.family not in HF_TRAINABLE:
        yield ConfigError("model.hf", shape.family, f"model_type {shape.family} is priced by the simulator but not "
                          f"trained by the engine; trainable: {', '.join(HF_TRAINABLE)}")
    if m.hf_weights is not None and not found.weights_is_dir:
        yield ConfigError("model.hf_weights", m.hf_weights, "must be a local folder of safetensors (and config.json)")
    yield from found.weight_problems
    for on, name, why in ((m.entry is not None, "model.entry", "a model is either model.hf or model.entry"),
                          (m.experts > 0, "model.experts", "applies to the built-in GPT; a Hugging Face MoE "
                           "brings its own experts"),
                          (m.dropout > 0, "model.dropout", "applies to the built-in GPT; set attention_dropout "
                           "in model.hf"),
                          (p.adaptive_sp, "parallel.adaptive_sp", "runs the built-in GPT only"),
                          (p.schedule == "skip" and p.pp > 1, "parallel.schedule", "skip runs the built-in GPT only"),
                          (p.layer_split == "auto", "parallel.layer_split", "auto probes a GPT block; give a list")):
        if on:
            yield ConfigError(name, getattr(m, name.split(".")[1], None) if name.startswith("model.")
                              else getattr(p, name.split(".")[1]), f"with model.hf: {why}")
    if shape.kv_heads % p.tp:
        yield ConfigError("parallel.tp", p.tp, f"must divide the key/value heads of model.hf "
                          f"(num_key_value_heads={shape.kv_heads}){_try(shape.kv_heads)}")
    if p.ep > 1:
        if shape.experts == 0:
            yield ConfigError("parallel.ep", p.ep, f"needs a mixture-of-experts model; model.hf is {shape.family} (dense)")
        elif shape.experts % p.ep:
            yield ConfigError("parallel.ep", p.ep, f"must divide the experts of model.hf "
                              f"(num_local_experts={shape.experts}){_try(shape.experts)}")
        for on, name in ((p.tp > 1, "parallel.tp"), (p.pp > 1, "parallel.pp"), (p.cp > 1, "parallel.cp"),
                         (cfg.train.activation_checkpointing, "train.activation_checkpointing")):
            if on:
                yield ConfigError("parallel.ep", p.ep, f"with model.hf does not combine with {name} here (not wired)")
    # the fused experts' exchange (engine/parallel/expert_fused.py) is flat and uncompressed
    for on, name, value in ((cfg.comm.moe_hierarchical, "comm.moe_hierarchical", True),
                            (cfg.comm.moe_compression != "none", "comm.moe_compression", cfg.comm.moe_compression)):
        if on:
            yield ConfigError(name, value, "applies to the built-in GPT's experts, not model.hf's")
