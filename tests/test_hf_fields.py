"""engine/config/hf_fields.py: every field of transformers' config classes of the supported families is
implemented, irrelevant to training or refused by validate(); what it says about the sliding
window matches what transformers' own attention modules receive; refused values are one line."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine.config.schema import load_config
from engine.errors import ConfigError, ConfigErrors
from engine.config.hf_fields import (FIELDS, IMPLEMENTED, IRRELEVANT, MISTRAL_WINDOW, QWEN_MAX_WINDOW_LAYERS, QWEN_WINDOW,
                              REFUSED, sliding_windows)
from engine.model.shapes import HF_FAMILIES

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256}
MOE = {"num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def _config_class(family: str):
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[family]


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_every_config_field_of_every_family_is_classified(family):
    """A field transformers adds to one of these config classes fails here until it is classified."""
    fields = [f.name for f in dataclasses.fields(_config_class(family))]
    assert fields, family
    missing = [name for name in fields if name not in FIELDS]
    assert not missing, f"{family}: classify {missing} in engine/config/hf_fields.py FIELDS"
    assert {kind for kind, _ in FIELDS.values()} == {IMPLEMENTED, IRRELEVANT, REFUSED}
    assert all(why for _, why in FIELDS.values())


def test_the_window_defaults_are_transformers_own():
    defaults = {f.name: f.default for f in dataclasses.fields(_config_class("mistral"))}
    assert defaults["sliding_window"] == MISTRAL_WINDOW
    for family in ("qwen2", "qwen3"):
        defaults = {f.name: f.default for f in dataclasses.fields(_config_class(family))}
        assert (defaults["sliding_window"], defaults["max_window_layers"]) == (QWEN_WINDOW, QWEN_MAX_WINDOW_LAYERS)


def _windows_transformers_passes(data: dict) -> list:
    """The `sliding_window` each layer's attention hands to the attention function, recorded by
    registering one that records it (the real model, one forward)."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from engine.model.hf import hf_config

    seen: list = []

    def recorder(module, *args, **kwargs):
        seen.append(kwargs.get("sliding_window"))
        return sdpa_attention_forward(module, *args, **kwargs)

    AttentionInterface.register("hf_fields_probe", recorder)
    model = AutoModelForCausalLM.from_config(hf_config(data), attn_implementation="hf_fields_probe")
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    return seen


@pytest.mark.parametrize("data", [
    {"model_type": "llama"},
    {"model_type": "mistral"},
    {"model_type": "mistral", "sliding_window": 4},
    {"model_type": "mistral", "sliding_window": None},
    {"model_type": "mixtral", **MOE},
    {"model_type": "mixtral", **MOE, "sliding_window": 4},
    {"model_type": "qwen2", "sliding_window": 4},
    {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    {"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 2},
    {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4,
     "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]},
    {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 3},
    {"model_type": "qwen3", "head_dim": 16},
], ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items() if k not in MOE)[:60])
def test_sliding_windows_are_what_transformers_attention_receives(data):
    data = {**TINY, **data}
    assert sliding_windows(data) == _windows_transformers_passes(data)


def _refused(overrides: list[str]) -> str:
    with pytest.raises((ConfigError, ConfigErrors)) as info:
        load_config(None, overrides)
    return str(info.value)


def _hf(**fields) -> str:
    return "model.hf=" + json.dumps({"model_type": "llama", **TINY, **fields})


MIXTRAL_AUX = {"model_type": "mixtral", **MOE, "output_router_logits": True}


@pytest.mark.parametrize("overrides, match", [
    ([_hf(is_encoder_decoder=True)], r"^model\.hf\.is_encoder_decoder=True: must be false"),
    ([_hf(attention_dropout=0.1), "parallel.cp=2", "parallel.cp_impl=ring"],
     r"^model\.hf\.attention_dropout=0\.1: ring attention here has no attention dropout"),
    ([_hf(model_type="mistral", sliding_window=4), "model.seq_len=16", "parallel.cp=2", "parallel.cp_impl=ring"],
     r"^model\.hf\.sliding_window=4: is shorter than model\.seq_len=16: ring attention here masks causally only"),
    ([_hf(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=3), "model.seq_len=16",
      "parallel.cp=2", "parallel.cp_impl=ring"], r"^model\.hf\.sliding_window=8: is shorter"),
    ([_hf(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), "parallel.cp=2"],
     r"^model\.hf\.rope_parameters='rope_type=dynamic': rescales by the largest position"),
    ([_hf(rope_scaling={"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}),
      "parallel.cp=2", "parallel.cp_impl=ring"], r"^model\.hf\.rope_parameters='rope_type=longrope'"),
    (["model.hf=" + json.dumps({**TINY, **MIXTRAL_AUX}), "parallel.pp=2"],
     r"^model\.hf\.output_router_logits=True: adds the router aux loss of every layer"),
    (["model.hf=" + json.dumps({**TINY, **MIXTRAL_AUX}), "parallel.dp=2", "parallel.ep=2",
      "comm.moe_hierarchical=true"], r"^comm\.moe_hierarchical=True: applies to the built-in GPT's experts"),
    (["model.hf=" + json.dumps({**TINY, **MIXTRAL_AUX}), "parallel.dp=2", "parallel.ep=2",
      "comm.moe_compression=lsh"], r"^comm\.moe_compression='lsh': applies to the built-in GPT's experts"),
], ids=["encoder-decoder", "attention-dropout-ring", "mistral-window-ring", "qwen2-window-ring", "dynamic-rope-cp",
        "longrope-cp", "aux-loss-pp", "moe-hierarchical", "moe-lsh"])
def test_what_the_ranks_would_not_follow_is_refused_in_one_line(overrides, match):
    """Each was accepted by validate() on e19d228; the ranks then raised (ring attention with
    dropout), trained another model than transformers would (a window or a dynamic rope under cp,
    the aux loss the pipeline drops, the GPT-only expert exchanges ignored) or took the flag."""
    import re

    line = _refused(overrides)
    assert "\n" not in line and re.search(match, line), line


@pytest.mark.parametrize("overrides", [
    [_hf(model_type="mistral", sliding_window=4), "model.seq_len=16", "parallel.cp=2", "parallel.cp_impl=ulysses"],
    [_hf(model_type="mistral"), "model.seq_len=16", "parallel.cp=2", "parallel.cp_impl=ring"],  # 4096 >= 16
    [_hf(model_type="qwen2", sliding_window=4), "model.seq_len=16", "parallel.cp=2", "parallel.cp_impl=ring"],
    [_hf(attention_dropout=0.1), "parallel.cp=2", "parallel.cp_impl=ulysses"],
    [_hf(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})],
    ["model.hf=" + json.dumps({**TINY, **MIXTRAL_AUX}), "parallel.dp=2", "parallel.ep=2", "parallel.cp=1"],
    ["model.hf=" + json.dumps({**TINY, **MIXTRAL_AUX}), "parallel.cp=2", "parallel.cp_impl=ring"],
])
def test_what_the_engine_follows_is_accepted(overrides):
    load_config(None, overrides)


# an alternative value of each irrelevant field the engine might otherwise pick up
IRRELEVANT_VALUES = {"use_cache": False, "bos_token_id": 7, "eos_token_id": 9, "pretraining_tp": 2,
                     "chunk_size_feed_forward": 4, "output_hidden_states": True, "return_dict": False,
                     "id2label": {"0": "a", "1": "b", "2": "c"}, "problem_type": "regression",
                     "architectures": ["Other"], "transformers_version": "0.0.1", "dtype": "bfloat16"}


def test_irrelevant_fields_leave_the_training_loss_unchanged():
    """The first step's loss of the engine is the same with each irrelevant field at another value."""
    from engine.train.trainer import Trainer

    torch.set_num_threads(1)
    assert set(IRRELEVANT_VALUES) | {"label2id"} == {k for k, (kind, _) in FIELDS.items() if kind == IRRELEVANT}
    tiny = ["model.seq_len=16", "train.steps=2", "batch.global=4", "batch.micro=2", "train.warmup_steps=0",
            "train.eval_interval=0", "profile.host_interval_s=0", "profile.nvml_interval_s=0"]

    def losses(**fields) -> list[float]:
        cfg = load_config(None, [_hf(**fields), *tiny])
        return [m.loss for m in Trainer(cfg, device=torch.device("cpu")).run()]

    base = losses()
    assert losses(**IRRELEVANT_VALUES) == base
    assert losses(rms_norm_eps=1e-2) != base  # an implemented field does move it
