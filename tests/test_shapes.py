"""engine/model/shapes.py: the one model shape every consumer prices, checked against published parameter
counts and against the parameters of the real transformers modules of each family."""
from __future__ import annotations

import json

import pytest

from engine.errors import ConfigError
from engine.model.shapes import HF_FAMILIES, from_gpt, from_hf_config

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
    from engine.config.schema import ModelConfig
    from engine.model.gpt import build_model, flops_per_token

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


# Real published config.json values (the shape fields and the flags that decide which parameters
# transformers builds), written inline: nothing is downloaded.
REAL_CONFIGS = {
    "Llama-3.1-8B": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         attention_bias=False, mlp_bias=False, tie_word_embeddings=False, rms_norm_eps=1e-5,
                         rope_theta=500000.0),
    "Mistral-7B-v0.1": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                            max_position_embeddings=32768, sliding_window=4096, tie_word_embeddings=False,
                            rms_norm_eps=1e-5, rope_theta=10000.0),
    "Qwen2-0.5B": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=131072,
                       max_window_layers=24, sliding_window=131072, use_sliding_window=False, tie_word_embeddings=True,
                       rms_norm_eps=1e-6, rope_theta=1000000.0),
    "Qwen2-7B": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=131072,
                     max_window_layers=28, sliding_window=131072, use_sliding_window=False, tie_word_embeddings=False,
                     rms_norm_eps=1e-6, rope_theta=1000000.0),
    "Qwen3-8B": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, attention_bias=False, tie_word_embeddings=False, rms_norm_eps=1e-6,
                     rope_theta=1000000.0),
    "Mixtral-8x7B-v0.1": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                              vocab_size=32000, max_position_embeddings=32768, tie_word_embeddings=False,
                              rms_norm_eps=1e-5, rope_theta=1000000.0),
    "Qwen1.5-MoE-A2.7B": dict(model_type="qwen2_moe", hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                              shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
                              decoder_sparse_step=1, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                              vocab_size=151936, max_position_embeddings=8192, tie_word_embeddings=False,
                              rms_norm_eps=1e-6, rope_theta=1000000.0),
    "Qwen3-30B-A3B": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          vocab_size=151936, max_position_embeddings=40960, attention_bias=False,
                          tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1000000.0),
}


def _meta_params(config: dict) -> int:
    """sum(p.numel()) of transformers' own model for `config`, built on the meta device (no memory)."""
    transformers = pytest.importorskip("transformers")
    import torch

    config = dict(config)
    cfg = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())  # parameters(): a tied head once


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_real_config_counts_equal_transformers_on_the_meta_device(name):
    """Every parameter transformers builds (Qwen2's q/k/v biases, Qwen3's q/k norms, qwen2_moe's shared
    expert and its gate, the routers, a tied or untied head) is counted by the engine's shape and by
    the simulator's model, and the simulator's stage at tp = pp = 1 holds all of them."""
    import numpy as np

    from tuning.sim.compute import stage_params
    from tuning.sim.spec import ModelSpec

    config = REAL_CONFIGS[name]
    expected = _meta_params(config)
    spec = ModelSpec.from_hf(config, seq=4096)
    one = {k: np.asarray(v) for k, v in dict(tp=1, pp=1).items()}
    assert (from_hf_config(config).params, spec.params) == (expected, expected)
    if not spec.experts:  # MoE stages add their experts in tuning/sim/moe.py
        assert int(stage_params(spec, one)) == expected


@pytest.mark.parametrize("family", HF_FAMILIES)
@pytest.mark.parametrize("flags", [{"attention_bias": True}, {"mlp_bias": True}, {"qkv_bias": False},
                                   {"tie_word_embeddings": True}, {"head_dim": 32}])
def test_bias_and_head_flags_count_as_each_family_builds_them(family, flags):
    """attention_bias / mlp_bias / qkv_bias are honoured by some families and ignored by others
    (mistral and mixtral build no attention bias, only llama an MLP bias, qwen2 always q/k/v biases)."""
    base = dict(model_type=family, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, vocab_size=300, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=48, shared_expert_intermediate_size=80)
    config = dict(base, **flags)
    expected = _meta_params(config)
    assert from_hf_config(config).params == expected


def test_gpt_flops_per_token_is_narayanans_formula_and_the_simulators():
    """The one FLOP count (engine/model/shapes.py) is Narayanan et al. 2021's 72 l h^2 (1 + s/(6h) + V/(12 l h))
    per token for their GPT (mlp_ratio 4), the engine's MFU uses it, and the simulator's model FLOPs
    per iteration are it times the tokens (dense and with Qwen2's biases / Qwen3's q/k norms, which do
    no matmul)."""
    import numpy as np

    from engine.config.schema import ModelConfig
    from engine.model.gpt import flops_per_token
    from tuning.sim.compute import flops
    from tuning.sim.spec import ModelSpec

    l, h, s, v = 24, 2048, 2048, 51200
    shape = from_gpt(layers=l, d_model=h, heads=16, seq_len=s, vocab=v)
    assert shape.flops_per_token(s) == pytest.approx(72 * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)), rel=1e-12)
    assert flops_per_token(ModelConfig(layers=l, d_model=h, heads=16, seq_len=s, vocab=v)) == shape.flops_per_token(s)
    cols = {"global_batch": np.asarray(8), "recompute": np.asarray(0)}
    for spec in (ModelSpec.from_shape(shape, seq=s), ModelSpec.from_hf(REAL_CONFIGS["Qwen2-0.5B"], seq=1024),
                 ModelSpec.from_hf(REAL_CONFIGS["Qwen3-8B"], seq=4096)):
        assert float(flops(spec, cols)[1]) == pytest.approx(8 * spec.seq * spec.shape.flops_per_token(spec.seq), rel=1e-12)
