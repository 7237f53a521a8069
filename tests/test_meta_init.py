"""Meta-device construction (engine/model/meta_init.py): a rank materialises only its own shards and stages,
bit-identical to the full seeded build done the e19d228 way (`device="cpu"`, built here in process),
with the generator left where that build leaves it; and a Llama-3.2-1B-shaped model laid out over 2
CPU ranks grows each rank's RSS by about its own share of the model, not the whole model."""
from __future__ import annotations

import json

import pytest
import torch

from engine.config.schema import load_config
from parallel_harness import run_ranks

LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
HF = {"llama": LLAMA,
      "llama-tied-pad": {**LLAMA, "tie_word_embeddings": True, "pad_token_id": 3,
                         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
      "mixtral": {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
      "qwen3": {**LLAMA, "model_type": "qwen3", "head_dim": 16}}
GPT = ["model.layers=4", "model.d_model=32", "model.heads=4", "model.seq_len=16", "model.vocab=260"]
MODELS = {"gpt": GPT, "gpt-dropout": [*GPT, "model.dropout=0.1"],
          "gpt-moe-dropout": [*GPT, "model.experts=4", "model.top_k=2", "model.moe_every=2", "model.dropout=0.1"],
          **{name: [f"model.hf={json.dumps(hf)}", "model.seq_len=16"] for name, hf in HF.items()}}
TRAIN = ["train.steps=3", "train.lr=0.003", "train.warmup_steps=0", "batch.global=8", "batch.micro=2",
         "train.grad_clip=0.5", "profile.host_interval_s=0", "profile.nvml_interval_s=0", "train.eval_interval=0",
         "train.weight_decay=0.1", "train.seed=5"]


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from engine.model.meta_init import _canonical

    out = dict(module.named_parameters(remove_duplicate=False))
    out.update(module.named_buffers(remove_duplicate=False))
    return {_canonical(k): v for k, v in out.items()}


@pytest.mark.parametrize("name", list(MODELS))
def test_a_meta_build_materialises_exactly_the_seeded_build(name):
    """Every parameter and buffer bit-equal to the full CPU build, ties kept, the generator where
    that build leaves it (dropout draws after it continue the same stream)."""
    from engine.model.build import build_model
    from engine.model.meta_init import materialize

    cfg = load_config(None, MODELS[name]).model
    reference = build_model(cfg, seed=5, device="cpu")
    after_reference = torch.get_rng_state()
    torch.manual_seed(123)  # whatever ran before
    model = build_model(cfg, seed=5, device="meta")
    assert all(t.is_meta for t in _tensors(model).values())
    materialize([model])
    ref, got = _tensors(reference), _tensors(model)
    assert ref.keys() == got.keys()
    assert [k for k in ref if not torch.equal(ref[k], got[k])] == []
    assert (reference.head.weight is reference.tok_emb.weight) == (model.head.weight is model.tok_emb.weight)
    assert torch.equal(torch.get_rng_state(), after_reference)


def test_a_draw_nothing_needs_advances_the_generator_in_pieces_as_in_one_call(monkeypatch):
    """The pieces `_advance` draws (instead of a full-size tensor) leave the generator where one
    normal_/uniform_ call over the whole tensor does, at every size (tails included)."""
    import engine.model.meta_init as mi
    from engine.config.schema import ModelConfig
    from engine.model.gpt import build_model

    monkeypatch.setattr(mi, "_CHUNK", 48)
    aten = torch.ops.aten
    for func, args in ((aten.normal_.default, (0.0, 0.02)), (aten.uniform_.default, (-0.1, 0.1))):
        for n in (65, 97, 100, 1000, 4097, 65541):
            torch.manual_seed(1)
            func(torch.empty(n), *args)
            whole = torch.get_rng_state()
            torch.manual_seed(1)
            ref = mi._Ref(0, torch.float32, (n,), (1,), 0)
            op = mi._Op(func, (ref, *args), {}, (), frozenset(), frozenset({0}), frozenset({0}), True)
            assert mi._advance(op)
            assert torch.equal(torch.get_rng_state(), whole), (func, n)
    # and through a whole build: 250 x 36 embedding elements are not a multiple of 16
    cfg = ModelConfig(layers=2, d_model=36, heads=4, seq_len=16, vocab=250, dropout=0.0)
    reference = build_model(cfg, seed=3)
    model = build_model(cfg, seed=3, device="meta")
    mi.materialize([model])
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), model.state_dict().values()))


def test_hf_weights_are_read_slice_by_slice_as_from_pretrained_loads_them(tmp_path):
    """model.hf_weights on meta: the same tensors (and generator state) as transformers'
    from_pretrained, for Mixtral's per-expert save format and a tied Llama (lm_head not saved)."""
    from engine.model.build import build_model
    from engine.model.hf import reference_model
    from engine.model.meta_init import materialize

    for name in ("mixtral", "llama-tied-pad"):
        folder = tmp_path / name
        reference_model(load_config(None, MODELS[name]).model, seed=7).save_pretrained(folder)
        cfg = load_config(None, [f"model.hf={folder}", f"model.hf_weights={folder}", "model.seq_len=16"]).model
        loaded = build_model(cfg, seed=0, device="cpu")
        after = torch.get_rng_state()
        model = build_model(cfg, seed=0, device="meta")
        materialize([model])
        ref, got = _tensors(loaded), _tensors(model)
        assert [k for k in ref if not torch.equal(ref[k], got[k])] == [], name
        assert torch.equal(torch.get_rng_state(), after)


def test_a_checkpoint_missing_a_parameter_is_refused_in_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    from engine.model.build import build_model
    from engine.errors import ConfigError
    from engine.model.hf import reference_model
    from engine.model.meta_init import materialize

    reference_model(load_config(None, MODELS["llama"]).model, seed=7).save_pretrained(tmp_path)
    cfg = load_config(None, [f"model.hf={tmp_path}", f"model.hf_weights={tmp_path}", "model.seq_len=16"]).model
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    # validate() refuses it before any rank starts; one that loses the tensor after validation (replaced on disk
    # before the ranks read it) is refused by materialize itself
    with pytest.raises(ConfigError, match=r"model\.hf_weights=.*1 tensor\(s\) missing .*layers\.1\.mlp\.up_proj"):
        load_config(None, [f"model.hf={tmp_path}", f"model.hf_weights={tmp_path}", "model.seq_len=16"])
    with pytest.raises(ConfigError, match=r"model\.hf_weights=.*no tensor for parameter layers\.1\.mlp\.up_proj"):
        materialize([build_model(cfg, seed=0, device="meta")])


# ---------------------------------------------------------------- every rank's own part

def _rank_parts(rank: int, world: int, overrides: list[str]) -> dict:
    """This rank's parts after parallelize() of a meta build, against the full CPU build's slices."""
    from engine.model.build import build_model
    from engine.mesh import ParallelDims
    from engine.model.meta_init import _owned
    from engine.parallel.parallelize import parallelize

    torch.set_num_threads(1)
    cfg = load_config(None, overrides)
    p = cfg.parallel
    dims = ParallelDims(p.dp, p.tp, p.pp, world, cp=p.cp)
    mesh = dims.build_mesh("cpu")
    full = _tensors(build_model(cfg.model, seed=cfg.train.seed, device="cpu"))
    after = torch.get_rng_state()
    par = parallelize(build_model(cfg.model, seed=cfg.train.seed, device="meta"), cfg, dims, mesh,
                      device=torch.device("cpu"))
    names, wrong, held = set(), [], 0
    for module in par.modules:
        for name, t in _tensors(module).items():
            local, box = _owned(t)
            names.add(name)
            held += local.numel()
            if not torch.equal(local, full[name][box]):
                wrong.append(name)
    return {"names": sorted(names), "wrong": wrong, "rng": torch.equal(torch.get_rng_state(), after),
            "held": held, "full": sum(t.numel() for t in {id(t): t for t in full.values()}.values())}


LAYOUTS = {  # name: (model, parallel overrides, world size)
    "zero3-dp2": ("gpt", ["parallel.dp=2", "parallel.zero=3"], 2),
    "tp2-sp": ("gpt", ["parallel.tp=2", "parallel.sequence_parallel=true"], 2),
    "pp2-1f1b": ("gpt", ["parallel.pp=2"], 2),
    "pp2-interleaved": ("gpt", ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual=2"], 2),
    "pp2-zbv": ("gpt", ["parallel.pp=2", "parallel.schedule=zbv"], 2),
    "moe-ep2": ("gpt-moe-dropout", ["parallel.dp=2", "parallel.ep=2"], 2),
    "moe-zero3-dp2": ("gpt-moe-dropout", ["parallel.dp=2", "parallel.zero=3"], 2),
    "zero3-dp2-tp2": ("gpt", ["parallel.dp=2", "parallel.tp=2", "parallel.zero=3"], 4),
    "zero3-dp2-pp2": ("gpt", ["parallel.dp=2", "parallel.pp=2", "parallel.zero=3"], 4),
    "zero1-dp2": ("gpt-moe-dropout", ["parallel.dp=2", "parallel.zero=1"], 2),
    "llama-zero3-dp2": ("llama-tied-pad", ["parallel.dp=2", "parallel.zero=3"], 2),
    "llama-pp2": ("llama-tied-pad", ["parallel.pp=2"], 2),
    "llama-tp2": ("llama", ["parallel.tp=2"], 2),
    "qwen3-tp2": ("qwen3", ["parallel.tp=2"], 2),
    "mixtral-ep2": ("mixtral", ["parallel.dp=2", "parallel.ep=2"], 2),
    "mixtral-pp2": ("mixtral", ["parallel.pp=2"], 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_rank_materialises_its_own_part_of_the_seeded_build(name):
    """After parallelize() of a meta build, every tensor a rank holds (FSDP2 / TP shard, pipeline
    stage, kept expert) equals its box of the full CPU build bit for bit, the generator is where
    that build leaves it, and a sharded layout holds less than the model per rank."""
    model, extra, world = LAYOUTS[name]
    results = run_ranks(world, _rank_parts, [*MODELS[model], *TRAIN, *extra], timeout=240)
    for rank, r in enumerate(results):
        assert r["wrong"] == [] and r["rng"], (rank, r["wrong"])
    if any(k in name for k in ("zero3", "pp2", "tp2", "ep2")):
        assert all(r["held"] < r["full"] for r in results), [(r["held"], r["full"]) for r in results]
    if "pp2" in name:  # stage 0 holds the embedding, the last stage the head; no rank holds every block
        assert not set(results[0]["names"]) >= set(results[-1]["names"])


@pytest.mark.slow
@pytest.mark.parametrize("model, extra", [("mixtral", ["parallel.dp=2", "parallel.zero=3"]),
                                          ("llama-tied-pad", ["parallel.pp=2"])], ids=["mixtral-zero3", "tied-pp2"])
def test_each_rank_reads_its_own_part_of_hf_weights(tmp_path, model, extra):
    """model.hf_weights under ZeRO-3 (each rank reads half of each tensor, Mixtral's experts from
    its per-expert files) and pp2 (the last stage reads the tied head from the embedding's tensor):
    the tensors from_pretrained loads whole."""
    from engine.model.hf import reference_model

    reference_model(load_config(None, MODELS[model]).model, seed=7).save_pretrained(tmp_path)
    overrides = [f"model.hf={tmp_path}", f"model.hf_weights={tmp_path}", "model.seq_len=16", *TRAIN, *extra]
    for rank, r in enumerate(run_ranks(2, _rank_parts, overrides, timeout=240)):
        assert r["wrong"] == [] and r["rng"], (rank, r["wrong"])


def _losses(rank: int, world: int, overrides: list[str], legacy: bool) -> list[float]:
    """The Trainer's losses, the model built on meta (now) or whole on CPU (`legacy`: e19d228's way)."""
    import engine.train.compose as compose
    from engine.model.build import build_model
    from engine.train.trainer import Trainer

    torch.set_num_threads(1)
    if legacy:
        compose.build_model = lambda cfg, *, seed, device: build_model(cfg, seed=seed, device="cpu")
    trainer = Trainer(load_config(None, overrides), device=torch.device("cpu"))
    return [m.loss for m in trainer.run()]


@pytest.mark.slow
@pytest.mark.parametrize("model, extra", [
    ("gpt-moe-dropout", ["parallel.dp=2", "parallel.zero=3"]),
    ("gpt-dropout", ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual=2"]),
    ("mixtral", ["parallel.dp=2", "parallel.ep=2"]),
    ("llama-tied-pad", ["parallel.pp=2"]),
], ids=["moe-dropout-zero3", "dropout-pp2-interleaved", "mixtral-ep2", "llama-tied-pp2"])
def test_training_losses_are_bit_identical_to_the_whole_cpu_build(model, extra):
    """Three steps of the real train loop (dropout included) give the very same losses whether the
    model is built whole on CPU first (e19d228) or on meta and materialised per rank."""
    overrides = [*MODELS[model], *TRAIN, *extra]
    new = run_ranks(2, _losses, overrides, False, timeout=240)
    old = run_ranks(2, _losses, overrides, True, timeout=240)
    assert new == old
    assert any(losses for losses in new)


# ---------------------------------------------------------------- memory of a real-sized model

LLAMA_3_2_1B = {  # meta-llama/Llama-3.2-1B's config.json (1,235,814,400 parameters, tied embeddings)
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256}


def _memory_after_layout(rank: int, world: int, overrides: list[str], legacy: bool = False) -> dict:
    """RSS growth of this rank from before the build to after compose() (built, laid out,
    materialised; no step), its peak (VmHWM, reset first), and the bytes of the tensors it holds;
    `legacy`: the model built whole on CPU first, as e19d228 did (bench/meta_init_memory.py)."""
    import gc
    import time
    from pathlib import Path

    import psutil

    import engine.train.compose
    from engine.train.compose import compose
    from engine.mesh import ParallelDims
    from profilers.collectives import CollectiveProfiler

    torch.set_num_threads(1)
    if legacy:
        from engine.model.build import build_model

        engine.train.compose.build_model = lambda cfg, *, seed, device: build_model(cfg, seed=seed, device="cpu")
    cfg = load_config(None, overrides)
    p = cfg.parallel
    dims = ParallelDims(p.dp, p.tp, p.pp, world, cp=p.cp)
    mesh = dims.build_mesh("cpu")
    if cfg.model.hf is not None:  # code, not model: imported before the baseline
        import transformers.models.llama.modeling_llama  # noqa: F401

        import engine.model.hf  # noqa: F401
    gc.collect()
    before = psutil.Process().memory_info().rss
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak RSS) to the current RSS
    start = time.perf_counter()
    parts = compose(cfg, dims=dims, mesh=mesh, device=torch.device("cpu"), mark=time.perf_counter,
                    collectives=CollectiveProfiler(enabled=False))
    seconds = time.perf_counter() - start
    gc.collect()
    after = psutil.Process().memory_info().rss
    status = Path("/proc/self/status").read_text()
    peak = int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1]) * 1024
    local = [t.to_local() if hasattr(t, "to_local") else t for t in parts.par.parameters()]
    return {"grew": after - before, "peak": peak - before, "seconds": seconds,
            "held": sum(t.numel() * t.element_size() for t in local)}


@pytest.mark.slow
@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
@pytest.mark.parametrize("layout", [["parallel.dp=2", "parallel.zero=3"], ["parallel.pp=2"]], ids=["zero3-dp2", "pp2"])
def test_a_llama_3_2_1b_shaped_model_costs_each_rank_its_own_share(tmp_path, layout):
    """Llama-3.2-1B (real config.json) on 2 CPU ranks, built and laid out, no step: under ZeRO-3 each
    rank's RSS grows by at most 0.6x the fp32 model's bytes, its peak too; under pp2 by its stage's
    bytes (the embedding on stage 0, its tied copy on stage 1: 0.606x each, so 0.6x cannot hold for
    pp2) plus the same allowance, never the whole model."""
    from engine.model.gpt import count_parameters

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_2_1B))
    overrides = [f"model.hf={tmp_path}", "model.seq_len=128", "batch.global=2", "batch.micro=1",
                 "train.steps=1", "profile.host_interval_s=0", "profile.nvml_interval_s=0", *layout]
    model_bytes = 4 * count_parameters(load_config(None, overrides).model)["total"]
    assert model_bytes == 4 * 1_235_814_400
    results = run_ranks(2, _memory_after_layout, overrides, timeout=900)
    allowance = 0.1 * model_bytes  # the meta model's Python objects, allocator slack, one tensor in flight
    for rank, r in enumerate(results):
        print(f"rank {rank}: RSS +{r['grew'] / model_bytes:.3f}x, peak +{r['peak'] / model_bytes:.3f}x, holds "
              f"{r['held'] / model_bytes:.3f}x of {model_bytes / 2**30:.2f} GiB, {r['seconds']:.0f} s")
        assert r["grew"] <= r["held"] + allowance and r["peak"] <= r["held"] + allowance, r
        if "parallel.zero=3" in layout:
            assert r["held"] <= 0.5 * model_bytes + 2**20
            assert r["grew"] <= 0.6 * model_bytes and r["peak"] <= 0.6 * model_bytes, r
