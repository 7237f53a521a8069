"""torchtitan and accelerate exports, read back by the tools' own parsers: torchtitan's ConfigManager
(its JobConfig) and accelerate's config loader plus its launcher's checks and environment, from which
accelerate's ParallelismConfig and FSDP plugin build themselves."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.config import RunConfig, load_config
from tuning.export_frameworks import accelerate_yaml, to_accelerate, to_torchtitan, torchtitan_toml

BASE = ["model.layers=4", "model.d_model=32", "model.heads=4", "model.seq_len=32", "batch.global=16"]
LAYOUTS = {
    "dp4-zero3-bf16": ["parallel.dp=4", "parallel.zero=3", "batch.micro=2", "precision=bf16"],
    "dp2-tp2-sp": ["parallel.dp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "batch.micro=4",
                   "parallel.zero=2"],
    "pp2-interleaved": ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual=2", "batch.micro=2",
                        "parallel.dp=2"],
    "cp2-ring": ["parallel.cp=2", "parallel.cp_impl=ring", "parallel.dp=2", "batch.micro=4"],
    "dp2-ddp": ["parallel.dp=2", "batch.micro=4", "comm.compressor=powersgd"],
}


def _cfg(name: str) -> RunConfig:
    return load_config(None, BASE + LAYOUTS[name])


def _titan(cfg: RunConfig, tmp_path: Path):
    from torchtitan.config import ConfigManager

    path = tmp_path / "job.toml"
    path.write_text(torchtitan_toml(cfg))
    return ConfigManager().parse_args(["--job.config_file", str(path)])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_torchtitan_config_manager_reads_the_layout_batch_and_precision(tmp_path, name):
    cfg = _cfg(name)
    job = _titan(cfg, tmp_path)
    p, par = cfg.parallel, job.parallelism
    shard = par.data_parallel_shard_degree
    assert (par.data_parallel_replicate_degree * shard, par.tensor_parallel_degree, par.pipeline_parallel_degree,
            par.context_parallel_degree) == (p.dp, p.tp, p.pp, p.cp)
    assert shard == (p.dp if p.zero >= 2 else 1)
    assert job.training.global_batch_size == cfg.batch.global_
    assert job.training.seq_len == cfg.model.seq_len and job.training.steps == cfg.train.steps
    if p.pp > 1:  # a pipeline step takes the dp rank's batch in micro-batches of batch.micro
        assert job.training.local_batch_size == cfg.batch.global_ // p.dp
        assert par.pipeline_parallel_microbatch_size == cfg.batch.micro
        assert par.pipeline_parallel_schedule == "Interleaved1F1B"
        assert par.pipeline_parallel_layers_per_stage * p.pp * p.virtual == cfg.model.layers
    else:  # torchtitan accumulates global / (local * dp) local batches: the engine's grad_accum
        assert job.training.global_batch_size // (job.training.local_batch_size * p.dp) == cfg.grad_accum
    assert job.training.mixed_precision_param == ("bfloat16" if cfg.precision == "bf16" else "float32")
    assert job.optimizer.lr == cfg.train.lr and job.debug.seed == cfg.train.seed


def test_torchtitan_names_what_it_cannot_map(tmp_path):
    notes = to_torchtitan(_cfg("dp2-ddp"))[1]
    assert any(n.startswith("comm.compressor=powersgd") for n in notes)
    assert any(n.startswith("model shape (layers=4, hidden=32, heads=4, kv_heads=4") for n in notes)
    cp_notes = to_torchtitan(load_config(None, BASE + ["parallel.cp=2", "batch.micro=4"]))[1]
    assert any("cp_impl=ulysses" in n for n in cp_notes)
    assert torchtitan_toml(_cfg("dp2-ddp")).startswith("# not mapped: model shape")
    from engine.config import from_dict

    hf = from_dict({"data": {"source": "hf", "path": "c.jsonl", "tokenizer": "tok"}})
    sections, notes = to_torchtitan(hf)
    assert sections["training"]["dataset_path"] == "c.jsonl"
    assert any(n.startswith("data.source=hf (c.jsonl): torchtitan loads the datasets it registers") for n in notes)


def _accelerate_env(cfg: RunConfig, tmp_path: Path) -> dict[str, str]:
    """The environment `accelerate launch --config_file` gives the script, built by accelerate's code."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = tmp_path / "accelerate.yaml"
    path.write_text(accelerate_yaml(cfg))
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    assert defaults.num_processes == cfg.world_size
    return prepare_multi_gpu_env(args)


@pytest.mark.parametrize("name", ["dp4-zero3-bf16", "dp2-tp2-sp", "cp2-ring"])
def test_accelerate_builds_its_parallelism_config_and_fsdp_plugin_from_the_export(tmp_path, monkeypatch, name):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    cfg = _cfg(name)
    (tmp_path / "a.yaml").write_text(accelerate_yaml(cfg))
    loaded = load_config_from_file(str(tmp_path / "a.yaml"))
    assert loaded.distributed_type == "FSDP" and loaded.num_processes == cfg.world_size
    assert loaded.mixed_precision == ("bf16" if cfg.precision == "bf16" else "no")
    env = _accelerate_env(cfg, tmp_path)
    for key in [k for k in os.environ if k.startswith(("FSDP_", "PARALLELISM_CONFIG_", "ACCELERATE_"))]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith(("FSDP_", "PARALLELISM_CONFIG_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    pc = ParallelismConfig()
    p = cfg.parallel
    assert (pc.dp_replicate_size * pc.dp_shard_size, pc.tp_size, pc.cp_size) == (p.dp, p.tp, p.cp)
    assert pc.total_size == cfg.world_size
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward == (p.zero == 3)
    assert env["ACCELERATE_MIXED_PRECISION"] == ("bf16" if cfg.precision == "bf16" else "no")


def test_accelerate_plain_data_parallel_is_multi_gpu_and_batch_sizes_are_named(tmp_path):
    cfg = _cfg("dp2-ddp")
    config, notes = to_accelerate(cfg)
    assert config["distributed_type"] == "MULTI_GPU" and "fsdp_config" not in config
    env = _accelerate_env(cfg, tmp_path)
    assert env["ACCELERATE_MIXED_PRECISION"] == "no"
    assert notes[0].startswith("batch.micro=4, batch.global=16") and f"gradient_accumulation_steps={cfg.grad_accum}" \
        in notes[0]
    pp_notes = to_accelerate(_cfg("pp2-interleaved"))[1]
    assert any(n.startswith("parallel.pp=2") for n in pp_notes)
    # accelerate refuses tp/cp over replicated dp ("cannot be used with pure data parallelism"): sharded, said so
    assert to_accelerate(_cfg("cp2-ring"))[0]["parallelism_config"]["parallelism_config_dp_shard_size"] == 2
    assert any(n.startswith("parallel.zero=0 with tp/cp") for n in to_accelerate(_cfg("cp2-ring"))[1])


def test_megatron_export_reads_a_megatron_dataset_by_its_prefix(tmp_path):
    from tuning.export import megatron_args

    for suffix in (".bin", ".idx"):
        (tmp_path / f"corpus{suffix}").write_bytes(b"")
    cfg = load_config(None, BASE + ["data.source=megatron", f"data.path={tmp_path / 'corpus.bin'}"])
    args, notes = megatron_args(cfg)
    assert "--mock-data" not in args
    at = args.index("--data-path")
    assert args[at + 1:at + 4] == [str(tmp_path / "corpus"), "--split", "95,5,0"]
    assert any(n.startswith("data order: Megatron-LM shuffles") for n in notes)
    tokens = load_config(None, BASE + ["data.source=tokens", f"data.path={tmp_path / 'corpus.bin'}"])
    assert "--mock-data" in megatron_args(tokens)[0]


def test_torchtitan_names_its_own_flavor_for_a_llama_3_8b_config(tmp_path):
    """A Llama-3-8B config.json (the published shape) exports as torchtitan's llama3 flavor 8B."""
    import dataclasses
    import json

    from engine.config import ModelConfig
    from engine.shapes import from_hf_config
    from tuning.export_frameworks import _titan_flavor

    llama8b = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256, "rope_theta": 500000.0,
               "max_position_embeddings": 8192}
    assert _titan_flavor("llama3", from_hf_config(llama8b), block_causal=False) == "8B"
    assert _titan_flavor("llama3", from_hf_config(llama8b), block_causal=True) == "8B_flex"
    if "hf" not in {f.name for f in dataclasses.fields(ModelConfig)}:
        pytest.skip("model.hf is not in this tree yet")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(llama8b))
    cfg = load_config(None, [f"model.hf={path}", "model.seq_len=32", "batch.global=8", "batch.micro=8"])
    sections, notes = to_torchtitan(cfg)
    assert sections["model"] == {"name": "llama3", "flavor": "8B", "hf_assets_path": str(tmp_path)}
    assert not any(n.startswith("model shape") for n in notes)


def test_accelerate_wraps_the_decoder_layer_transformers_names_for_the_family():
    qwen3_moe = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
                 "num_experts_per_tok": 2, "vocab_size": 256, "head_dim": 8}
    from engine.config import from_dict

    # priced by the simulator, not trained by the engine: built without validate() to export
    cfg = from_dict({"model": {"hf": qwen3_moe, "seq_len": 32}, "parallel": {"dp": 2, "zero": 3}})
    assert to_accelerate(cfg)[0]["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "Qwen3MoeDecoderLayer"
