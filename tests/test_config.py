"""Config loading, overrides and every validation rule's message (field, value, rule)."""
from __future__ import annotations

import pytest

from engine.config.schema import RunConfig, apply_overrides, from_dict, load_config, replace
from engine.errors import ConfigError, ConfigErrors
from engine.config.validate import check

# (overrides, the field the error names, a regex the message must match)
RULES = [
    (["batch.global=30", "parallel.dp=4", "batch.micro=4"], "batch.global",
     r"batch.global=30: is not divisible by dp\*micro = 4\*4"),
    (["batch.global=0"], "batch.global", r"must be > 0"),
    (["batch.micro=-1"], "batch.micro", r"must be > 0"),
    (["model.layers=0"], "model.layers", r"must be > 0"),
    (["model.d_model=-8"], "model.d_model", r"must be > 0"),
    (["model.heads=0"], "model.heads", r"must be > 0"),
    (["model.seq_len=0"], "model.seq_len", r"must be > 0"),
    (["model.mlp_ratio=0"], "model.mlp_ratio", r"must be > 0"),
    (["model.vocab=1"], "model.vocab", r"must be >= 2"),
    (["model.vocab=100"], "model.vocab", r"must be >= 256 for byte-level"),
    (["model.dropout=1.5"], "model.dropout", r"must be in \[0, 1\)"),
    (["model.d_model=66", "model.heads=4"], "model.d_model", r"divisible by model.heads=4"),
    (["model.entry=not a module"], "model.entry", r"package.module:function"),
    (["data.source=web"], "data.source", r"one of text, synthetic, files"),
    (["data.split=test"], "data.split", r"one of train, val"),
    (["data.source=files"], "data.path", r"must name a file or folder"),
    (["data.val_fraction=0.9"], "data.val_fraction", r"\(0, 0.5\]"),
    (["parallel.dp=0"], "parallel.dp", r"must be > 0"),
    (["parallel.tp=0"], "parallel.tp", r"must be > 0"),
    (["parallel.pp=-2"], "parallel.pp", r"must be > 0"),
    (["parallel.virtual=0"], "parallel.virtual", r"must be > 0"),
    (["parallel.dp=300", "parallel.tp=300", "batch.global=300", "batch.micro=1"], "parallel",
     r"world size must be <= 65536"),
    (["parallel.zero=4"], "parallel.zero", r"ZeRO stage must be 0, 1, 2 or 3"),
    (["parallel.tp=3", "batch.global=12"], "parallel.tp", r"must divide model.heads=4; try 1, 2, 4"),
    (["model.heads=8", "model.d_model=64", "parallel.tp=16"], "parallel.tp", r"must divide model.heads=8"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel", r"needs parallel.tp > 1"),
    (["parallel.sequence_parallel=true", "parallel.tp=2", "model.seq_len=63"], "model.seq_len",
     r"divisible by parallel.tp=2 with sequence_parallel"),
    (["parallel.schedule=zigzag"], "parallel.schedule", r"one of gpipe, 1f1b, interleaved"),
    (["parallel.virtual=2"], "parallel.virtual", r"needs parallel.schedule in interleaved, looped_bfs"),
    (["parallel.schedule=interleaved", "parallel.pp=2", "model.layers=4", "batch.global=16"], "parallel.virtual",
     r"must be >= 2 for the interleaved schedule"),
    (["parallel.pp=2", "parallel.layer_split=[1]"], "parallel.layer_split", r"needs pp\*virtual = 2\*1 = 2 entries"),
    (["parallel.pp=2", "parallel.layer_split=[1, 2]"], "parallel.layer_split", r"sum to model.layers=2"),
    (["parallel.pp=2", "model.layers=3"], "model.layers", r"divisible by pp\*virtual = 2\*1 = 2"),
    (["parallel.pp=4", "model.layers=4", "batch.global=8", "batch.micro=4"], "batch.global",
     r"gives 2 micro-batches per pipeline, fewer than parallel.pp=4"),
    (["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual=2", "model.layers=4",
      "batch.global=12", "batch.micro=4"], "batch.global", r"not a multiple of parallel.pp=2 \(interleaved\)"),
    (["train.steps=0"], "train.steps", r"must be > 0"),
    (["train.lr=0"], "train.lr", r"must be > 0"),
    (["train.timeout_s=0"], "train.timeout_s", r"must be > 0"),
    (["train.seed=-1"], "train.seed", r"must be >= 0"),
    (["train.warmup_steps=-1"], "train.warmup_steps", r"must be >= 0"),
    (["train.weight_decay=-0.1"], "train.weight_decay", r"must be >= 0"),
    (["train.grad_clip=-1"], "train.grad_clip", r"must be >= 0"),
    (["train.eval_interval=-1"], "train.eval_interval", r"must be >= 0"),
    (["train.checkpoint_interval=-1"], "train.checkpoint_interval", r"must be >= 0"),
    (["train.eval_batches=0"], "train.eval_batches", r"must be > 0"),
    (["train.schedule=step"], "train.schedule", r"one of cosine, constant, linear"),
    (["train.min_lr_ratio=2"], "train.min_lr_ratio", r"must be in \[0, 1\]"),
    (["train.beta1=1.0"], "train.beta1", r"must be in \[0, 1\)"),
    (["train.beta2=-0.5"], "train.beta2", r"must be in \[0, 1\)"),
    (["comm.compressor=zip"], "comm.compressor", r"one of none, fp16, bf16, int8, topk, randk, powersgd"),
    (["comm.density=0"], "comm.density", r"must be in \(0, 1\]"),
    (["comm.rank=0"], "comm.rank", r"must be > 0"),
    (["comm.error_budget=0"], "comm.error_budget", r"must be > 0"),
    (["comm.adaptive_interval=0"], "comm.adaptive_interval", r"must be > 0"),
    (["comm.adaptive=true", "comm.compressor=fp16"], "comm.adaptive", r"needs comm.compressor=topk \(L-GreCo"),
    (["comm.compressor=powersgd", "parallel.zero=2"], "comm.compressor", r"needs parallel.zero=0 or 1"),
    (["comm.compressor=fp16", "parallel.tp=2"], "comm.compressor", r"needs parallel.tp=1 and parallel.pp=1"),
    (["parallel.zero=1", "parallel.pp=2", "batch.global=16"], "parallel.zero", r"use ZeRO stage 2 or 3"),
    (["co2.tau=0"], "co2.tau", r"must be > 0"),
    (["co2.outer_lr=0"], "co2.outer_lr", r"must be > 0"),
    (["co2.clip=-1"], "co2.clip", r"must be >= 0"),
    (["co2.outer_momentum=1.0"], "co2.outer_momentum", r"must be in \[0, 1\)"),
    (["co2.enabled=true", "parallel.zero=1"], "co2.enabled", r"needs parallel.zero=0 and comm.compressor=none"),
    (["co2.enabled=true", "parallel.pp=2", "batch.global=16"], "co2.enabled", r"needs parallel.pp=1"),
    (["link.gbps=-1"], "link.gbps", r"must be >= 0"),
    (["link.latency_us=-5"], "link.latency_us", r"must be >= 0"),
    (["ddp.bucket_cap_mb=0"], "ddp.bucket_cap_mb", r"must be > 0"),
    (["ddp.static_graph=true"], "ddp.static_graph", r"cannot be combined with gradient accumulation"),
    (["precision=fp8"], "precision", r"one of fp32, bf16"),
    (["backend=mpi"], "backend", r"one of auto, gloo, nccl"),
    (["name=has space"], "name", r"letters, digits"),
    (["live.every=-1"], "live.every", r"must be >= 0"),
    (["live.wait_s=0"], "live.wait_s", r"must be > 0"),
    (["model.entry=mymod:build", "parallel.tp=2"], "model.entry", r"data parallel and ZeRO only"),
    (["model.entry=mymod:build", "train.activation_checkpointing=true"], "train.activation_checkpointing",
     r"built-in GPT only"),
    (["profile.nvml_interval_s=-1"], "profile.nvml_interval_s", r"must be >= 0"),
    (["profile.host_interval_s=-1"], "profile.host_interval_s", r"must be >= 0"),
    (["profile.warmup_steps=-1"], "profile.warmup_steps", r"must be >= 0"),
    (["profile.trace_steps=[3, 1]"], "profile.trace_steps", r"\[a, b\] with 0 <= a <= b"),
    (["parallel.dp=2", "cluster.nodes=3"], "cluster.nodes", r"must divide the world size dp\*tp\*pp = 2"),
    (["cluster.gpus_per_node=8"], "cluster.gpus_per_node", r"nodes\*gpus_per_node = 1\*8 = 8 must equal"),
    (["cluster.time=1h"], "cluster.time", r"Slurm time limit"),
    (["cluster.sbatch=[exclusive]"], "cluster.sbatch[0]", r"one sbatch option like --qos=high"),
    (['cluster.setup=["a\\nb"]'], "cluster.setup[0]", r"one shell line"),
    (["model.experts=-1"], "model.experts", r"must be >= 0"),
    (["model.experts=4", "parallel.dp=2", "parallel.ep=4"], "parallel.ep", r"must divide parallel.dp=2"),
    (["model.experts=4", "parallel.dp=2", "parallel.ep=2", "parallel.zero=1"], "parallel.ep", r"needs parallel.zero=0"),
    (["model.experts=4", "comm.moe_compression=lsh"], "comm.moe_compression", r"needs parallel.ep > 1"),
    (["model.hf={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
      "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256}", "parallel.tp=4"], "parallel.tp",
     r"must divide the key/value heads of model.hf \(num_key_value_heads=2\)"),
    (["data.lengths=zipf"], "data.lengths", r"must be one of fixed, lognormal, pareto or a file"),
    (["parallel.cp=3"], "parallel.cp", r"tp\*cp = 1\*3 must divide model.heads=4"),
]


@pytest.mark.parametrize("overrides,field,pattern", RULES, ids=[r[1] + ":" + r[0][-1] for r in RULES])
def test_each_rule_names_field_value_and_rule(overrides, field, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        load_config(None, overrides)
    fields = [e.field for e in getattr(info.value, "errors", [info.value])]
    assert field in fields
    assert f"{field}=" in str(info.value)


def test_every_rule_function_is_exercised():
    """Each rule family in engine.config.validate has at least one failing case above."""
    from engine.config import validate as v
    from engine.config.validate_files import read_files

    hit = set()
    for overrides, _, _ in RULES:
        cfg = from_dict(apply_overrides({}, overrides))
        for rule in v.RULES:
            if list(rule(cfg, read_files(cfg))):
                hit.add(rule.__name__)
    assert hit == {r.__name__ for r in v.RULES}


def test_defaults_and_example_are_valid(tmp_path):
    assert check(RunConfig()) == []
    cfg = load_config("examples/tiny.yaml")
    assert cfg.world_size == 2 and cfg.grad_accum == 2


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ConfigError, match=r"batch.mciro=.*unknown key; did you mean 'micro'\?"):
        load_config(None, ["batch.mciro=4"])
    with pytest.raises(ConfigError, match=r"unknown key; did you mean 'parallel'\?"):
        from_dict({"paralel": {"dp": 2}})


def test_wrong_types_are_named():
    with pytest.raises(ConfigError, match=r"train.steps='ten': must be an integer"):
        load_config(None, ["train.steps=ten"])
    with pytest.raises(ConfigError, match=r"parallel.dp=True: must be an integer"):
        load_config(None, ["parallel.dp=true"])
    with pytest.raises(ConfigError, match=r"model=3: must be a mapping"):
        from_dict({"model": 3})
    with pytest.raises(ConfigError, match=r"parallel.layer_split\[1\]='x': must be an integer"):
        load_config(None, ["parallel.layer_split=[1, x]"])


def test_several_errors_reported_at_once():
    with pytest.raises(ConfigErrors) as info:
        load_config(None, ["train.steps=0", "train.lr=-1"])
    assert {e.field for e in info.value.errors} == {"train.steps", "train.lr"}


def test_yaml_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {layers: 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(lst)
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.yaml")


def test_overrides_parse_yaml_values_and_round_trip(tmp_path):
    cfg = load_config("examples/tiny.yaml", ["batch.micro=2", "train.lr=0.01", "parallel.layer_split=null"])
    assert cfg.batch.micro == 2 and cfg.train.lr == 0.01 and cfg.grad_accum == 4
    again = from_dict(cfg.to_dict())
    assert again == cfg
    assert cfg.to_dict()["batch"]["global"] == 16  # the YAML key, not the Python name
    with pytest.raises(ConfigError, match="must look like key.sub=value"):
        apply_overrides({}, ["batch.micro"])


def test_replace_validates():
    cfg = load_config("examples/tiny.yaml")
    assert replace(cfg, {"batch.micro": 8}).grad_accum == 1
    with pytest.raises(ConfigError, match="batch.global"):
        replace(cfg, {"batch.micro": 3})


def test_parallel_dims_error_prints_every_factor():
    from engine.mesh import ParallelDims

    with pytest.raises(ConfigError, match=r"dp\(2\) \* tp\(3\) \* pp\(1\) = 6.*world_size\(4\)"):
        ParallelDims(2, 3, 1, 4)
    assert ParallelDims(2, 2, 1, 4).coords(3) == {"pp": 0, "dp": 1, "tp": 1}


@pytest.mark.parametrize("text", ["", "# only a comment\n", "\n\n"])
def test_empty_yaml_file_is_refused(tmp_path, text):
    """An empty file used to train the defaults without a word."""
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"^config='.*empty.yaml': is empty; give at least one key"):
        load_config(path)


GIB = 2**30


def test_memory_estimate_refuses_a_model_the_machine_cannot_hold():
    """`--set model.d_model=1000000000` passed validation and died on rank 0 allocating memory."""
    from engine.train.memory import estimate_memory, memory_error

    huge = load_config(None, ["model.d_model=1000000000"])
    error = memory_error(huge, limit_bytes=64 * GIB, ranks_sharing=1, limit_name="of RAM available")
    assert error is not None and error.field == "model.d_model" and error.value == 1_000_000_000
    assert "GiB per rank" in error.rule and "more than the 64 GiB of RAM available" in error.rule
    assert memory_error(RunConfig(), limit_bytes=64 * GIB, ranks_sharing=1, limit_name="x") is None
    # the ranks of one node share its RAM: per rank x ranks is what must fit
    cfg = load_config(None, ["parallel.dp=4", "batch.global=16"])
    per_rank = sum(estimate_memory(cfg).values())
    assert memory_error(cfg, limit_bytes=2 * per_rank, ranks_sharing=1, limit_name="x") is None
    shared = memory_error(cfg, limit_bytes=2 * per_rank, ranks_sharing=4, limit_name="x")
    assert shared is not None and "per rank x 4 ranks" in shared.rule
    # activations dominate: the knob named is batch.micro
    long = load_config(None, ["model.seq_len=65536", "batch.micro=64", "batch.global=64"])
    act = memory_error(long, limit_bytes=GIB, ranks_sharing=1, limit_name="x")
    assert act is not None and act.field == "batch.micro"


def test_check_fits_uses_the_machines_available_memory(monkeypatch):
    import psutil

    from engine.train.memory import check_fits

    class Mem:
        available = 1 * GIB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Mem)
    check_fits(load_config(None, ["backend=gloo"]))  # a few MB; gloo: host RAM even where CUDA exists
    with pytest.raises(ConfigError, match=r"^model.d_model=1000000000: .* more than the 1 GiB of RAM available"):
        check_fits(load_config(None, ["model.d_model=1000000000", "backend=gloo"]))
    check_fits(load_config(None, ["model.d_model=1000000000", "model.entry=pkg.mod:build"]))  # size unknown
