"""engine/shapes.py: the one model shape every consumer prices, checked against published parameter
counts and against the parameters of the real transformers modules of each family."""
from __future__ import annotations

import json

import pytest

from engine.errors import ConfigError
from engine.shapes import HF_FAMILIES, from_gpt, from_hf_config

# the published configs' shape fields (meta-llama/Meta-Llama-3-8B and -70B config.json)
LLAMA3_8B = dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, intermediate_size=28672)
MIXTRAL_8X7B = dict(model_type="mixtral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, intermediate_size=14336, vocab_size=32000, num_local_experts=8,
                    num_experts_per_tok=2)


@pytest.mark.parametrize("config, published", [(LLAMA3_8B, 8.03e9), (LLAMA3_70B, 70.6e9), (MIXTRAL_8X7B, 46.7e9)])
def test_published_parameter_counts_within_one_percent(config, published):
    assert abs(from_hf_config(config).params / published - 1) < 0.01


def test_mixtral_active_parameters():
    assert abs(from_hf_config(MIXTRAL_8X7B).active_params / 12.9e9 - 1) < 0.01  # "12.9B active" (Mistral AI)


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_counts_equal_the_transformers_module(family):
    transformers = pytest.importorskip("transformers")
    config_cls = transformers.AutoConfig.for_model(family).__class__
    config = config_cls(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=96, vocab_size=300, num_experts=4, num_local_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=80)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert from_hf_config(config.to_dict()).params == sum(p.numel() for p in model.parameters())


def test_gpt_shape_matches_the_engine_model():
    from engine.config import ModelConfig
    from engine.model import build_model, flops_per_token

    cfg = ModelConfig(layers=4, d_model=32, heads=4, seq_len=16, vocab=256, experts=8, top_k=2, moe_every=2)
    shape = from_gpt(layers=4, d_model=32, heads=4, seq_len=16, vocab=256, experts=8, top_k=2, moe_every=2)
    assert shape.params == sum(p.numel() for p in build_model(cfg, seed=0).parameters())
    assert shape.flops_per_token(16) == flops_per_token(cfg)
    assert shape.flops_per_token(16, causal=True) < shape.flops_per_token(16)


def test_bad_configs_name_the_field(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="model.hf.*not valid JSON"):
        from_hf_config(bad)
    with pytest.raises(ConfigError, match="model_type must be one of"):
        from_hf_config({"model_type": "bert"})
    bad.write_text(json.dumps(dict(LLAMA3_8B, num_attention_heads=0)))
    with pytest.raises(ConfigError, match="num_attention_heads"):
        from_hf_config(bad)
