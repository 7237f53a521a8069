"""Hugging Face causal LMs (model.hf, engine/model/hf.py): the unmodified transformers model's loss, every
layout through the real launcher against one process, resume, bad input, shapes and reports."""
from __future__ import annotations

import json

import pytest
import torch

from engine.config.schema import load_config
from engine.errors import ConfigError

LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
MIXTRAL = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
QWEN3 = {**LLAMA, "model_type": "qwen3", "head_dim": 16}
MISTRAL_SW = {**LLAMA, "model_type": "mistral", "sliding_window": 4}  # at seq 16: every layer windowed
QWEN2_SW = {**LLAMA, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}
MIXTRAL_AUX = {**MIXTRAL, "output_router_logits": True, "router_aux_loss_coef": 0.1}
FAMILIES = {"llama": LLAMA, "mixtral": MIXTRAL, "qwen3": QWEN3, "mistral-sw": MISTRAL_SW, "qwen2-sw": QWEN2_SW,
            "mixtral-aux": MIXTRAL_AUX}
TINY = ["model.seq_len=16", "train.steps=5", "train.lr=0.003", "train.warmup_steps=0", "batch.global=8",
        "batch.micro=2", "train.grad_clip=0.5", "profile.host_interval_s=0", "profile.nvml_interval_s=0",
        "train.eval_interval=5", "train.weight_decay=0.1"]


def _over(family: str, *extra: str) -> list[str]:
    return [f"model.hf={json.dumps(FAMILIES[family])}", *TINY, *extra]


@pytest.mark.parametrize("family", ["llama", "mixtral", "qwen3"])
def test_single_process_loss_is_the_transformers_models(family):
    """The engine's first step on one process sees the loss the unmodified transformers model (sdpa
    attention, its own shifted-label loss) gives on the same batch and weights."""
    from engine.model.hf import reference_model
    from engine.train.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config(None, _over(family, "train.steps=1"))
    trainer = Trainer(cfg, device=torch.device("cpu"))
    x, y = trainer._local_batch(0)
    tokens = torch.cat([x, y[:, -1:]], dim=1)
    with torch.no_grad():
        expected = reference_model(cfg.model, seed=cfg.train.seed)(input_ids=tokens, labels=tokens).loss.item()
    got = next(iter(trainer.run())).loss
    assert abs(got - expected) <= 1e-5, (got, expected)


def _engine_and_transformers(family: str, *extra: str) -> tuple[float, float]:
    """The engine's first-step loss and the unmodified transformers model's `loss` on the same batch
    and weights: per micro-batch (input x, the engine's targets y as transformers' shift_labels),
    averaged as the engine (and transformers' Trainer under gradient accumulation) does."""
    from engine.model.hf import reference_model
    from engine.train.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config(None, _over(family, "train.steps=1", *extra))
    trainer = Trainer(cfg, device=torch.device("cpu"))
    x, y = trainer._local_batch(0)
    model, micro = reference_model(cfg.model, seed=cfg.train.seed), cfg.batch.micro
    with torch.no_grad():
        parts = [model(input_ids=x[i:i + micro], labels=y[i:i + micro], shift_labels=y[i:i + micro].contiguous()).loss
                 for i in range(0, x.shape[0], micro)]
    return next(iter(trainer.run())).loss, torch.stack(parts).mean().item()


@pytest.mark.parametrize("family", ["mistral-sw", "qwen2-sw"])
def test_sliding_window_follows_transformers(family):
    """Mistral's window of 4 at seq 16 (every layer), Qwen2's on layers >= max_window_layers: the
    engine masks as transformers does (e19d228 trained without the window: 4.2e-3 off at step 1)."""
    got, expected = _engine_and_transformers(family)
    assert abs(got - expected) <= 1e-5, (got, expected)


@pytest.mark.parametrize("micro", ["batch.micro=8", "batch.micro=2"])
def test_mixtral_loss_includes_its_router_aux_loss_as_transformers(micro):
    """With output_router_logits the engine's reported loss is transformers' `loss`: cross-entropy +
    router_aux_loss_coef x the load-balancing loss of the micro-batch (e19d228 left it out: 0.2 off)."""
    got, expected = _engine_and_transformers("mixtral-aux", micro)
    assert abs(got - expected) <= 1e-5, (got, expected)
    ce_only, _ = _engine_and_transformers("mixtral", micro)
    assert expected - ce_only > 0.1  # the aux loss (about 2 x 0.1) is really in it


def test_router_aux_loss_is_transformers_load_balancing_loss():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from engine.model.hf import router_aux_loss

    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(24, 4, generator=g) for _ in range(3))
    expected = load_balancing_loss_func(logits, 4, 2)
    assert torch.allclose(router_aux_loss(list(logits), experts=4, top_k=2), expected, atol=1e-6, rtol=0)


def test_the_aux_loss_is_off_without_output_router_logits():
    """transformers adds the aux loss only with output_router_logits (Mixtral's default: false)."""
    got, expected = _engine_and_transformers("mixtral")
    assert abs(got - expected) <= 1e-5, (got, expected)


LAYOUTS = {
    "llama-dp2": ("llama", ["parallel.dp=2"]),
    "llama-zero3-dp2": ("llama", ["parallel.dp=2", "parallel.zero=3", "train.activation_checkpointing=true"]),
    "llama-tp2-sp": ("llama", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "llama-dp2-tp2": ("llama", ["parallel.dp=2", "parallel.tp=2"]),
    "llama-pp2-1f1b": ("llama", ["parallel.pp=2", "parallel.schedule=1f1b"]),
    "llama-pp2-interleaved": ("llama", ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual=2",
                                        "model.hf.num_hidden_layers=4"]),
    "llama-cp2-ulysses": ("llama", ["parallel.cp=2", "parallel.cp_impl=ulysses"]),
    "llama-cp2-ring": ("llama", ["parallel.cp=2", "parallel.cp_impl=ring"]),
    "mixtral-dp2": ("mixtral", ["parallel.dp=2"]),
    "mixtral-zero3-dp2": ("mixtral", ["parallel.dp=2", "parallel.zero=3"]),
    "mixtral-ep2": ("mixtral", ["parallel.dp=2", "parallel.ep=2"]),
    "mixtral-tp2-sp": ("mixtral", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "mixtral-dp2-tp2": ("mixtral", ["parallel.dp=2", "parallel.tp=2"]),
    "mixtral-pp2-1f1b": ("mixtral", ["parallel.pp=2"]),
    "mixtral-pp2-gpipe": ("mixtral", ["parallel.pp=2", "parallel.schedule=gpipe"]),
    "mixtral-cp2-ulysses": ("mixtral", ["parallel.cp=2", "parallel.cp_impl=ulysses"]),
    "mixtral-cp2-ring": ("mixtral", ["parallel.cp=2", "parallel.cp_impl=ring"]),
    "qwen3-tp2": ("qwen3", ["parallel.tp=2"]),
    # the sliding window under tp and Ulysses; the router aux loss under ep, sp and both cp cores
    "mistral-sw-tp2": ("mistral-sw", ["parallel.tp=2"]),
    "mistral-sw-cp2-ulysses": ("mistral-sw", ["parallel.cp=2", "parallel.cp_impl=ulysses"]),
    "qwen2-sw-pp2": ("qwen2-sw", ["parallel.pp=2"]),
    "mixtral-aux-ep2": ("mixtral-aux", ["parallel.dp=2", "parallel.ep=2"]),
    "mixtral-aux-tp2-sp": ("mixtral-aux", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "mixtral-aux-cp2-ulysses": ("mixtral-aux", ["parallel.cp=2", "parallel.cp_impl=ulysses"]),
    "mixtral-aux-cp2-ring": ("mixtral-aux", ["parallel.cp=2", "parallel.cp_impl=ring"]),
}
_REFERENCES: dict[tuple[str, ...], tuple[list[float], float | None]] = {}


@pytest.mark.slow
@pytest.mark.xdist_group("launch")
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_follows_single_process(tmp_path, name):
    """Through the real launcher (torchrun, engine.launch.worker), 5 steps within 1e-4 of one process."""
    from engine.launch.local import launch
    from parallel_harness import assert_launch_follows, trainer_reference

    family, extra = LAYOUTS[name]
    ref_over = tuple(_over(family, *[e for e in extra if e.startswith("model.")]))
    if ref_over not in _REFERENCES:
        _REFERENCES[ref_over] = trainer_reference(list(ref_over))
    result = launch(load_config(None, _over(family, *extra)), home=tmp_path)
    assert_launch_follows(result, *_REFERENCES[ref_over], steps=5)


@pytest.mark.slow
@pytest.mark.xdist_group("launch")
@pytest.mark.parametrize("family, first, then", [
    ("llama", ["parallel.dp=2", "parallel.zero=3"], ["parallel.dp=2", "parallel.zero=3"]),
    ("llama", ["parallel.dp=2", "parallel.zero=3"], ["parallel.tp=2"]),
    ("llama", ["parallel.pp=2"], ["parallel.dp=2"]),
    ("mixtral", ["parallel.dp=2", "parallel.ep=2"], ["parallel.dp=2", "parallel.ep=2"]),
    ("mixtral", ["parallel.dp=2", "parallel.ep=2"], ["parallel.dp=2"]),
], ids=["zero3-same", "zero3-to-tp2", "pp2-to-dp2", "ep2-same", "ep2-to-dp2"])
def test_checkpoint_resumes(tmp_path, tmp_path_factory, family, first, then):
    """Saved at step 3 in one layout, resumed in `then`: steps 3-5 follow the uninterrupted run (one saved run per
    saved layout, tests/saved_runs.py)."""
    from engine.launch.local import launch
    from saved_runs import saved_run

    common = _over(family, "train.steps=6", "train.eval_interval=0")
    full, ckpt = saved_run(common + first, tmp_path_factory)
    resumed = launch(load_config(None, common + then + [f"train.resume_from={ckpt / 'step000003'}"]), home=tmp_path)
    assert [s["step"] for s in resumed.steps] == [3, 4, 5]
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(resumed.steps, full.steps[3:]))
    assert diff <= 1e-6, (resumed.steps, full.steps[3:])


@pytest.mark.parametrize("overrides, match", [
    (["model.hf={model_type: gpt9, hidden_size: 32}"], r"model\.hf='gpt9': model_type must be one of llama"),
    ([f"model.hf={json.dumps(LLAMA)}", "parallel.tp=4"], r"parallel\.tp=4: must divide the key/value heads"),
    ([f"model.hf={json.dumps(LLAMA)}", "parallel.dp=2", "parallel.ep=2"], r"parallel\.ep=2: needs a mixture-of-experts"),
    ([f"model.hf={json.dumps(MIXTRAL)}", "parallel.dp=3", "parallel.ep=3"], r"parallel\.ep=3: must divide the experts"),
    ([f"model.hf={json.dumps(LLAMA)}", "model.hf_weights=/no/such/folder"], r"model\.hf_weights=.*local folder"),
    (["model.hf={model_type: qwen3_moe, hidden_size: 32, num_attention_heads: 4, num_hidden_layers: 2, "
      "intermediate_size: 64, vocab_size: 256, num_experts: 4, num_experts_per_tok: 2, moe_intermediate_size: 32}"],
     r"qwen3_moe is priced by the simulator but not trained"),
    ([f"model.hf={json.dumps(LLAMA)}", "model.entry=a.b:c"], r"model\.entry=.*either model\.hf or model\.entry"),
    ([f"model.hf={json.dumps(LLAMA)}", "model.dropout=0.1"], r"model\.dropout=0\.1: with model\.hf"),
])
def test_bad_input_is_refused_in_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_config_json_that_is_not_json_is_refused(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"model\.hf=.*is not valid JSON"):
        load_config(None, [f"model.hf={bad}"])


def test_shape_keys_and_flops_come_from_the_hf_config(tmp_path):
    """layers/d_model/heads/vocab are the config's; FLOPs and parameters follow its GQA, SwiGLU and
    untied head (hand count for the tiny Llama below), not the GPT formula."""
    from engine.model.gpt import count_parameters, flops_per_token

    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    cfg = load_config(None, [f"model.hf={path}", "model.seq_len=16"]).model
    assert (cfg.layers, cfg.d_model, cfg.heads, cfg.vocab) == (2, 32, 4, 256)
    h, kv, ffn, v = 32, 2 * 8, 64, 256  # kv: 2 heads of head_dim 8
    attention = h * h + 2 * h * kv + h * h
    layer = attention + 3 * h * ffn + 2 * h
    assert count_parameters(cfg)["total"] == 2 * layer + 2 * v * h + h
    matmul = 2 * (attention + 3 * h * ffn) + v * h
    assert flops_per_token(cfg) == 6 * matmul + 12 * 2 * 4 * 8 * 16


def test_the_model_built_matches_the_counted_parameters():
    from engine.model.hf import build_hf_model
    from engine.model.gpt import count_parameters

    for family in ("llama", "mixtral"):
        cfg = load_config(None, _over(family)).model
        model = build_hf_model(cfg, seed=0)
        assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg)["total"], family


def test_report_names_the_hf_model():
    from workbench.report import model_line

    line = model_line({"model": {"hf": MIXTRAL, "seq_len": 16}})
    assert line.startswith("mixtral (Hugging Face, inline config): 2 layers, hidden 32, 4/2 kv heads")
    assert "4 experts top-2" in line
    assert model_line({"model": {"layers": 2, "d_model": 32, "heads": 4}}).startswith("gpt (built-in)")


@pytest.mark.parametrize("example", ["examples/llama.yaml", "examples/mixtral.yaml"])
def test_examples_validate(example):
    cfg = load_config(example)
    assert cfg.model.hf["model_type"] in ("llama", "mixtral")


def test_memory_estimate_reads_the_hf_shape():
    """Llama-3-8B's config (GQA 32/8, SwiGLU 14336, untied 128256 vocab): 8.03B parameters, 16 bytes each
    of model state on one rank, and tp=8 splits the blocks but not the embeddings."""
    from engine.train.memory import estimate_memory
    from engine.model.gpt import count_parameters

    l8 = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
          "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}
    cfg = load_config(None, [f"model.hf={json.dumps(l8)}", "model.seq_len=8192", "batch.global=8", "batch.micro=1"])
    total = count_parameters(cfg.model)["total"]
    assert abs(total / 8.03e9 - 1) < 0.01
    est = estimate_memory(cfg)
    assert (est["params"], est["grads"], est["optimizer"]) == (4 * total, 4 * total, 8 * total)
    tp8 = estimate_memory(load_config(None, [f"model.hf={json.dumps(l8)}", "model.seq_len=8192", "batch.global=8",
                                             "batch.micro=1", "parallel.tp=8"]))
    embeddings = 2 * 128256 * 4096
    assert tp8["params"] == pytest.approx(4 * (embeddings + (total - embeddings - 4096) / 8 + 4096), rel=1e-3)


def test_a_local_safetensors_checkpoint_is_loaded(tmp_path):
    """model.hf_weights: the weights of a saved transformers model (safetensors), not a fresh init."""
    from engine.model.hf import build_hf_model, reference_model

    cfg = load_config(None, _over("mixtral")).model
    saved = reference_model(cfg, seed=7)
    saved.save_pretrained(tmp_path, safe_serialization=True)
    assert list(tmp_path.glob("*.safetensors"))
    cfg = load_config(None, [f"model.hf={tmp_path}", f"model.hf_weights={tmp_path}", *TINY]).model
    model = build_hf_model(cfg, seed=0)  # another seed: only the loaded weights can match
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(model(x), saved(input_ids=x).logits, atol=1e-5)
