"""torchtitan and accelerate exports, read back by the tools' own parsers: torchtitan's ConfigManager
(its JobConfig) and accelerate's config loader plus its launcher's checks and environment, from which
accelerate's ParallelismConfig and FSDP plugin build themselves."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine.config.schema import RunConfig, load_config
from tuning.export.frameworks import accelerate_yaml, to_accelerate, to_torchtitan, torchtitan_toml

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


# torchtitan's llama3 flavor "debugmodel" as a Hugging Face config.json: the layouts export to that flavor
TITAN_DEBUG = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 16,
               "num_key_value_heads": 16, "intermediate_size": 768, "vocab_size": 2048, "rope_theta": 500000.0,
               "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 131072,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}}
LLAMA31_8B = Path(__file__).resolve().parent.parent / "examples" / "llama3_8b" / "config.json"


def _cfg(name: str, *extra: str) -> RunConfig:
    return load_config(None, BASE + LAYOUTS[name] + list(extra))


def _gpu_cfg(name: str) -> RunConfig:
    """The layout on GPUs (one node of world_size GPUs): accelerate's GPU form."""
    cfg = _cfg(name)
    cfg.cluster.gpus_per_node = cfg.world_size
    return cfg


def _titan_cfg(name: str, tmp_path: Path) -> RunConfig:
    """The layout `name` of torchtitan's debugmodel (pp2-interleaved holds 3 of its 6 layers per virtual stage)."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(TITAN_DEBUG))
    extra = ["parallel.virtual=3"] if name == "pp2-interleaved" else []
    shape_free = [b for b in BASE if not b.startswith(("model.layers", "model.d_model", "model.heads"))]
    return load_config(None, shape_free + LAYOUTS[name] + [f"model.hf={tmp_path / 'config.json'}", *extra])


def _titan(cfg: RunConfig, tmp_path: Path):
    from torchtitan.config import ConfigManager

    path = tmp_path / "job.toml"
    path.write_text(torchtitan_toml(cfg))
    return ConfigManager().parse_args(["--job.config_file", str(path)])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_torchtitan_config_manager_reads_the_layout_batch_and_precision(tmp_path, name):
    cfg = _titan_cfg(name, tmp_path)
    job = _titan(cfg, tmp_path)
    p, par = cfg.parallel, job.parallelism
    shard = par.data_parallel_shard_degree
    assert (par.data_parallel_replicate_degree * shard, par.tensor_parallel_degree, par.pipeline_parallel_degree,
            par.context_parallel_degree) == (p.dp, p.tp, p.pp, p.cp)
    # FSDP but for plain fp32 data parallel (torchtitan's DDP keeps fp32 replicas and runs without tp / cp / pp)
    assert shard == (1 if p.zero == 0 and cfg.precision != "bf16" and p.tp * p.cp * p.pp == 1 else p.dp)
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
    assert (job.model.name, job.model.flavor) == ("llama3", "debugmodel")


def test_torchtitan_names_what_it_cannot_map(tmp_path):
    notes = to_torchtitan(_titan_cfg("dp2-ddp", tmp_path))[1]
    assert any(n.startswith("comm.compressor=powersgd") for n in notes)
    shape_free = [b for b in BASE if not b.startswith(("model.layers", "model.d_model", "model.heads"))]
    cp = load_config(None, shape_free + [f"model.hf={tmp_path / 'config.json'}", "parallel.cp=2", "batch.micro=4"])
    assert any("cp_impl=ulysses" in n for n in to_torchtitan(cp)[1])
    assert "# not mapped: comm.compressor=powersgd (no gradient compression hook in torchtitan)" in \
        torchtitan_toml(_titan_cfg("dp2-ddp", tmp_path)).splitlines()
    from engine.config.schema import from_dict

    (tmp_path / "data").mkdir()
    hf = from_dict({"model": {"hf": TITAN_DEBUG}, "data": {"source": "hf", "path": str(tmp_path / "data" / "c.jsonl"),
                                                           "tokenizer": "tok"}})
    sections, notes = to_torchtitan(hf)
    assert sections["training"]["dataset"] == "c4_test"  # load_dataset(folder, split="train"), field 'text'
    assert sections["training"]["dataset_path"] == str(tmp_path / "data")
    assert any(n.startswith(f"data.source=hf ({tmp_path / 'data' / 'c.jsonl'}): read by torchtitan's c4_test")
               for n in notes)


def test_torchtitan_refuses_a_shape_no_flavor_has_in_one_line():
    """Qwen2-0.5B (qwen2: no torchtitan model), a llama of no registered shape, and the workbench GPT are
    refused in one line naming what differs, never exported as debugmodel."""
    from engine.config.schema import from_dict

    qwen2 = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
             "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768}
    with pytest.raises(ValueError, match=r"^torchtitan: model_type=qwen2 has no torchtitan model") as exc:
        to_torchtitan(from_dict({"model": {"hf": qwen2}}))
    assert "\n" not in str(exc.value)
    llama3_0 = {k: v for k, v in json.loads(LLAMA31_8B.read_text()).items() if k != "rope_scaling"}  # Llama-3-8B
    with pytest.raises(ValueError, match=r"^torchtitan: no llama3 flavor has this model's shape; the nearest, 8B, "
                                         r"differs in rope_scaling None \(flavor: \(8\.0, 1\.0, 4\.0, 8192\.0\)\)"):
        to_torchtitan(from_dict({"model": {"hf": llama3_0}}))
    with pytest.raises(ValueError, match=r"^torchtitan: the workbench GPT .* has no torchtitan model"):
        to_torchtitan(_cfg("dp2-ddp"))


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

    cfg = _gpu_cfg(name)
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
    cfg = _gpu_cfg("dp2-ddp")
    config, notes = to_accelerate(cfg)
    assert config["distributed_type"] == "MULTI_GPU" and "fsdp_config" not in config
    env = _accelerate_env(cfg, tmp_path)
    assert env["ACCELERATE_MIXED_PRECISION"] == "no"
    assert notes[0].startswith("batch.micro=4, batch.global=16") and f"gradient_accumulation_steps={cfg.grad_accum}" \
        in notes[0]
    with pytest.raises(ValueError, match=r"^accelerate: pp=2: accelerate has no pipeline parallelism of its own"):
        to_accelerate(_gpu_cfg("pp2-interleaved"))  # its ParallelismConfig would hold 2 of the 4 ranks
    # accelerate refuses tp/cp over replicated dp ("cannot be used with pure data parallelism"): sharded, said so
    assert to_accelerate(_gpu_cfg("cp2-ring"))[0]["parallelism_config"]["parallelism_config_dp_shard_size"] == 2
    assert any(n.startswith("parallel.zero=0 with tp/cp") for n in to_accelerate(_gpu_cfg("cp2-ring"))[1])


def test_accelerate_on_cpu_ranks_is_ddp_and_says_why():
    """accelerate's AcceleratorState turns FSDP on for accelerator devices only (MULTI_CPU stays DDP, and a
    ParallelismConfig there is refused): on CPU ranks ZeRO-3 is exported as DDP, in one line."""
    config, notes = to_accelerate(_cfg("dp4-zero3-bf16"))
    assert config["distributed_type"] == "MULTI_GPU" and "fsdp_config" not in config
    assert config["num_processes"] == 4 and config["use_cpu"] is False  # torchrun's launch; the script asks for CPU
    assert any(n.startswith("parallel.zero=3, tp=1, cp=1 on CPU ranks: accelerate shards (FSDP)") for n in notes)


def test_megatron_export_reads_a_megatron_dataset_by_its_prefix(tmp_path):
    from tuning.export.trial import megatron_args

    for suffix in (".bin", ".idx"):
        (tmp_path / f"corpus{suffix}").write_bytes(b"")
    cfg = load_config(None, BASE + ["data.source=megatron", f"data.path={tmp_path / 'corpus.bin'}"])
    args, notes = megatron_args(cfg)
    assert "--mock-data" not in args
    at = args.index("--data-path")
    assert args[at + 1:at + 4] == [str(tmp_path / "corpus"), "--split", "95,5,0"]
    assert any(n.startswith("data order: Megatron-LM shuffles") for n in notes)
    import numpy as np

    (np.arange(4096) % 256).astype(np.uint16).tofile(tmp_path / "corpus.bin")  # a token file validate() can read
    tokens = load_config(None, BASE + ["data.source=tokens", f"data.path={tmp_path / 'corpus.bin'}"])
    assert "--mock-data" in megatron_args(tokens)[0]


def test_torchtitan_names_its_own_flavor_for_the_llama_3_1_8b_config(tmp_path):
    """The real Llama-3.1-8B config.json exports as torchtitan's llama3 flavor 8B (8B_flex with document
    masks): ConfigManager reads the TOML, and the flavor's model args from torchtitan's registry build a model
    of the config's shape and of transformers' parameter count, 8,030,261,248."""
    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    from engine.config.schema import from_dict

    cfg = from_dict({"model": {"hf": str(LLAMA31_8B), "seq_len": 8192}, "batch": {"global": 512, "micro": 1},
                     "parallel": {"dp": 8, "tp": 8, "zero": 3}, "precision": "bf16"})
    path = tmp_path / "job.toml"
    path.write_text(torchtitan_toml(cfg))
    job = ConfigManager().parse_args(["--job.config_file", str(path)])
    assert (job.model.name, job.model.flavor, job.model.hf_assets_path) == ("llama3", "8B", str(LLAMA31_8B.parent))
    spec = get_train_spec(job.model.name)
    args = spec.model_args[job.model.flavor]
    with torch.device("meta"):
        model = spec.model_cls(args)
    hf = json.loads(LLAMA31_8B.read_text())
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.vocab_size, args.rope_theta) == \
        (hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"],
         hf["vocab_size"], hf["rope_theta"])
    assert model.layers["0"].feed_forward.w1.weight.shape[0] == hf["intermediate_size"]
    assert args.rope_scaling_args.scaling_factor == hf["rope_scaling"]["factor"]
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    packed = from_dict({"model": {"hf": str(LLAMA31_8B)}, "data": {"pack": True}})
    assert to_torchtitan(packed)[0]["model"]["flavor"] == "8B_flex"


def test_accelerate_wraps_the_decoder_layer_transformers_names_for_the_family():
    qwen3_moe = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
                 "num_experts_per_tok": 2, "vocab_size": 256, "head_dim": 8}
    from engine.config.schema import from_dict

    # priced by the simulator, not trained by the engine: built without validate() to export
    cfg = from_dict({"model": {"hf": qwen3_moe, "seq_len": 32}, "parallel": {"dp": 2, "zero": 3},
                     "cluster": {"gpus_per_node": 2}})
    assert to_accelerate(cfg)[0]["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "Qwen3MoeDecoderLayer"
