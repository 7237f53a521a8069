"""A plan's exports, each checked by its target's own code at the plan's world size (issue 62 item 4): DeepSpeed's
DeepSpeedConfig (its batch check counts the ranks DeepSpeed sees), torchtitan's ConfigManager and tokenizer,
megatron-core's GPTModel built from the Megatron flags, accelerate's launcher and ParallelismConfig, the engine's
validate() for the YAML; a target that cannot take a layout refuses it in one line. Llama-3.1-8B, Mixtral-8x7B and
Mistral-7B (sliding window 4096 at seq 8192) on 64 H100s; `--export all` exits 0 with one line per refusal, and each
export names the workbench defaults it carries (issue 65)."""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from engine.config.schema import RunConfig
from tests.test_export_megatron import LLAMA31_8B, MIXTRAL_8X7B, build_gpt_model, model_parallel, transformers_params  # noqa: F401
from tuning.plan import TARGETS, export_plan, make_plan, plan_config

REPO = Path(__file__).resolve().parent.parent
BIN = REPO / ".venv" / "bin"
MISTRAL_7B_V01 = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "rope_theta": 10000.0,
                  "rms_norm_eps": 1e-5, "max_position_embeddings": 32768, "tie_word_embeddings": False,
                  "sliding_window": 4096}
JOB = {"gpus": 64, "global_batch": 1024, "seq": 8192}


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Path]:
    """The models' config.json files, and a tokenizer folder (a real tokenizer.json torchtitan loads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("models")
    out = {"llama-3.1-8b": LLAMA31_8B}
    for name, data in (("mixtral-8x7b", MIXTRAL_8X7B), ("mistral-7b", MISTRAL_7B_V01)):
        out[name] = folder / f"{name}.json"
        out[name].write_text(json.dumps(data))
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (folder / "tok").mkdir()
    tok.save(str(folder / "tok" / "tokenizer.json"))
    out["tokenizer"] = folder / "tok"
    return out


@pytest.fixture(scope="module")
def plans(configs):
    """(model, target) -> the plan of that job for that target (the top 2 layouts), the tokenizer named."""
    from tuning.sim.hardware import load_cluster
    from workbench.cli_sim import _model

    cluster = load_cluster("dgx-h100")
    out = {}
    for name in ("llama-3.1-8b", "mixtral-8x7b"):
        model = _model(str(configs[name]), JOB["seq"])
        for target in TARGETS:
            out[name, target] = make_plan(model, cluster, gpus=JOB["gpus"], global_batch=JOB["global_batch"],
                                          target=target, model_source=str(configs[name]), top=2,
                                          base={"data": {"tokenizer": str(configs["tokenizer"])}})
    return out


def _exports(plans, name: str, fmt: str, picks: tuple[int, ...] = (1, 2)):
    """(plan, cfg, export or the refusal's ValueError) of format `fmt` for each target's top layouts."""
    for target in TARGETS:
        plan = plans[name, target]
        for pick in picks:
            try:
                yield plan, plan_config(plan, pick), export_plan(plan, pick, fmt)
            except ValueError as exc:
                assert str(exc).startswith(f"{fmt}: ") and "\n" not in str(exc), exc
                yield plan, plan_config(plan, pick), exc


# ------------------------------------------------------------------ DeepSpeed

def deepspeed_config(ds: dict, world: int, monkeypatch):
    """DeepSpeed's DeepSpeedConfig of `ds` as rank 0 of a `world`-rank launch sees it: without an mpu its batch
    check counts every rank; with a pipeline, deepspeed.initialize passes the PipelineModule's grid (pp stages x
    world / pp data-parallel ranks), as built here by DeepSpeed's own PipelineParallelGrid."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(deepspeed.comm, "get_world_size", lambda *a, **k: world)
    monkeypatch.setattr(deepspeed.comm, "new_group", lambda ranks, **k: tuple(ranks))  # no process group here
    mpu = None
    if "pipeline" in ds:
        stages = ds["pipeline"]["stages"]
        mpu = PipelineParallelGrid(topology=PipeDataParallelTopology(num_pp=stages, num_dp=world // stages))
    return DeepSpeedConfig(json.loads(json.dumps(ds)), mpu=mpu)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "mixtral-8x7b"])
def test_every_plans_deepspeed_export_passes_deepspeeds_check_at_the_plans_world_size(plans, name, monkeypatch):
    checked = 0
    for plan, cfg, out in _exports(plans, name, "deepspeed"):
        p = cfg.parallel
        if isinstance(out, ValueError):  # tp / cp (or pipeline with ZeRO-2/3): named in the line
            assert p.tp > 1 or p.cp > 1 or (p.pp > 1 and p.zero >= 2), out
            assert f"tp={p.tp} cp={p.cp}" in str(out) or f"pp={p.pp}" in str(out)
            assert plan.target != "deepspeed", out  # the deepspeed target's own layouts are never refused
            continue
        ds = deepspeed_config(json.loads(out[0]), cfg.world_size, monkeypatch)
        assert ds.train_batch_size == plan.global_batch and ds.train_micro_batch_size_per_gpu == cfg.batch.micro
        checked += 1
    assert checked >= 2


def test_a_deepspeed_pipeline_is_checked_against_its_data_parallel_ranks(monkeypatch):
    from engine.config.schema import apply_overrides, from_dict
    from tuning.export.trial import to_deepspeed

    cfg = from_dict(apply_overrides({}, [f"model.hf={LLAMA31_8B}", "model.seq_len=8192", "parallel.dp=16",
                                         "parallel.pp=4", "batch.global=1024", "batch.micro=2", "parallel.zero=1"]))
    ds = deepspeed_config(to_deepspeed(cfg)[0], 64, monkeypatch)
    assert ds.world_size == 16 and ds.gradient_accumulation_steps == 32
    with pytest.raises(ValueError, match=r"^deepspeed: pp=4 with parallel.zero=2: DeepSpeed's pipeline engine"):
        to_deepspeed(from_dict(apply_overrides(cfg.to_dict(), ["parallel.zero=2"])))


# ------------------------------------------------------------------ torchtitan

def _titan_job(text: str, tmp_path: Path):
    from torchtitan.config import ConfigManager

    path = tmp_path / "job.toml"
    path.write_text(text)
    return ConfigManager().parse_args(["--job.config_file", str(path)])


def test_every_plans_torchtitan_export_parses_shards_and_loads_the_tokenizer(plans, configs, tmp_path):
    """Llama-3.1-8B: torchtitan's ConfigManager reads the exact flavor and a parallelism torchtitan runs at the
    plan's world size: FSDP over dp (never fp32 DDP replicas beside cp / tp / pp), and torchtitan's tokenizer loads
    from hf_assets_path. Mixtral: refused in one line (torchtitan has no mixtral model)."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    for plan, cfg, out in _exports(plans, "llama-3.1-8b", "torchtitan", picks=(1,)):  # a flavor check builds 8B
        assert not isinstance(out, ValueError), out
        job = _titan_job(out[0], tmp_path)
        p, par = cfg.parallel, job.parallelism
        assert (job.model.name, job.model.flavor) == ("llama3", "8B")
        assert (par.data_parallel_replicate_degree, par.data_parallel_shard_degree) == (1, p.dp), plan.target
        world = (par.data_parallel_replicate_degree * par.data_parallel_shard_degree * par.tensor_parallel_degree
                 * par.pipeline_parallel_degree * par.context_parallel_degree)
        assert world == cfg.world_size == 64
        assert job.model.hf_assets_path == str(configs["tokenizer"])
        assert HuggingFaceTokenizer(job.model.hf_assets_path).encode("hello")
    for _, _, out in _exports(plans, "mixtral-8x7b", "torchtitan", picks=(1,)):
        assert isinstance(out, ValueError) and str(out).startswith("torchtitan: model_type=mixtral has no torchtitan")


def test_torchtitan_says_in_one_line_that_a_tokenizer_is_needed(plans):
    plan = plans["llama-3.1-8b", "torchtitan"]
    untokenized = dataclasses.replace(plan, base={})
    text, notes = export_plan(untokenized, 1, "torchtitan")
    need = [n for n in notes if n.startswith("tokenizer: needed, and none given")]
    assert len(need) == 1 and str(LLAMA31_8B.parent) in need[0] and "which holds none" in need[0]
    assert not (LLAMA31_8B.parent / "tokenizer.json").exists()


# ------------------------------------------------------------------ Megatron-LM

# the layout's degrees: the whole model's parameters do not depend on them (one rank builds every layer without them)
LAYOUT_ONLY = ("--pipeline-model-parallel-size", "--context-parallel-size", "--expert-model-parallel-size",
               "--num-layers-per-virtual-pipeline-stage",
               # Transformer Engine's FP8 (megatron-core asks TE's version of an FP8 MoE config): no parameters
               "--fp8-format")
# switches whose modules need GPU packages (Transformer Engine's norms, grouped_gemm's or TE's grouped experts) and
# hold the parameters the local modules hold: parsed, then built without
GPU_KERNELS = ("--sequence-parallel", "--moe-grouped-gemm", "--tp-comm-overlap")


def _megatron_model(text: str, sequence_parallel: bool = False):
    """megatron-core's GPTModel of the launch's flags (the whole model: LAYOUT_ONLY and GPU_KERNELS left out of the
    build) and the flags as parsed."""
    from tests.test_export_megatron import megatron_parser

    tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    args = tokens[tokens.index("pretrain_gpt.py") + 1:]
    assert ("--sequence-parallel" in args) == sequence_parallel
    ns, _ = megatron_parser().parse_known_args(args)
    for flag in LAYOUT_ONLY:
        if flag in args:
            at = args.index(flag)
            args = args[:at] + args[at + 2:]
    return build_gpt_model([a for a in args if a not in GPU_KERNELS])[0], ns


@pytest.mark.parametrize("name", ["llama-3.1-8b", "mixtral-8x7b"])
def test_every_plans_megatron_export_builds_the_models_parameters(plans, configs, model_parallel, name, monkeypatch):
    """megatron-core builds transformers' parameter count from each plan's flags at the plan's layout; MoE runs
    megatron-core's grouped GEMM experts with all-to-all dispatch, as its Mixtral recipes do."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    # the all-to-all dispatcher opens a CUDA stream when built (no parameters): a placeholder on this CPU machine
    monkeypatch.setattr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", object())
    want = transformers_params(configs[name])
    built = 0
    for plan, cfg, out in _exports(plans, name, "megatron"):
        assert not isinstance(out, ValueError), out
        model, ns = _megatron_model(out[0], cfg.parallel.sequence_parallel)
        assert sum(p.numel() for p in model.parameters()) == want
        p = cfg.parallel
        assert (ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size, ns.context_parallel_size,
                ns.expert_model_parallel_size) == (p.tp, p.pp, p.cp, p.ep)
        if name == "mixtral-8x7b":
            assert ns.moe_grouped_gemm and ns.moe_token_dispatcher_type == "alltoall"
        built += 1
        if built == 3:  # a GPTModel of 8B on the meta device takes seconds: three layouts, the megatron plan's first
            break


def test_mistrals_sliding_window_reaches_megatron_core(configs, model_parallel):
    """Mistral-7B-v0.1 slides a 4096-token window; at seq 8192 the plan's launch sets megatron-core's window_size
    (4095 tokens before each token and itself, as transformers masks) and builds transformers' parameter count."""
    from tuning.sim.hardware import load_cluster
    from workbench.cli_sim import _model

    plan = make_plan(_model(str(configs["mistral-7b"]), 8192), load_cluster("dgx-h100"), gpus=64, global_batch=1024,
                     target="megatron", model_source=str(configs["mistral-7b"]), top=1)
    model, ns = _megatron_model(export_plan(plan, 1, "megatron")[0], plan_config(plan, 1).parallel.sequence_parallel)
    assert ns.window_size == (4095, 0) and ns.window_attn_skip_freq is None
    assert model.config.window_size == (4095, 0)
    assert sum(p.numel() for p in model.parameters()) == transformers_params(configs["mistral-7b"])
    short = make_plan(_model(str(configs["mistral-7b"]), 4096), load_cluster("dgx-h100"), gpus=64, global_batch=1024,
                      target="megatron", model_source=str(configs["mistral-7b"]), top=1)
    assert "--window-size" not in export_plan(short, 1, "megatron")[0]  # a window as long as the sequence masks nothing


# ------------------------------------------------------------------ accelerate and the workbench's YAML

@pytest.mark.parametrize("name", ["llama-3.1-8b", "mixtral-8x7b"])
def test_every_plans_accelerate_export_launches_at_the_plans_world_size(plans, name, tmp_path, monkeypatch):
    from accelerate.parallelism_config import ParallelismConfig

    from tests.test_export_frameworks import _accelerate_env

    launched = 0
    for plan, cfg, out in _exports(plans, name, "accelerate"):
        if isinstance(out, ValueError):
            assert cfg.parallel.pp > 1 and str(out).startswith(f"accelerate: pp={cfg.parallel.pp}:"), out
            assert plan.target != "accelerate"
            continue
        env = _accelerate_env(cfg, tmp_path)  # accelerate's launcher: num_processes == world
        for key in [k for k in os.environ if k.startswith(("FSDP_", "PARALLELISM_CONFIG_", "ACCELERATE_"))]:
            monkeypatch.delenv(key)
        for key, value in env.items():
            if key.startswith(("FSDP_", "PARALLELISM_CONFIG_", "ACCELERATE_")):
                monkeypatch.setenv(key, value)
        if "PARALLELISM_CONFIG_DP_SHARD_SIZE" in env:
            assert ParallelismConfig().total_size == cfg.world_size == 64
        launched += 1
    assert launched >= 2


def test_every_plans_yaml_export_is_one_the_engine_runs_or_refused_in_one_line(plans):
    from engine.config.validate import validate
    from tuning.export.trial import engine_refusal

    for plan, cfg, _ in _exports(plans, "llama-3.1-8b", "yaml"):
        refusal = engine_refusal(cfg)
        if plan.target == "yaml":
            assert refusal is None and validate(cfg).world_size == 64
        elif refusal is not None:
            assert refusal.startswith("yaml: the workbench's engine does not run this layout: ") and "\n" not in refusal


# ------------------------------------------------------------------ the CLI

def _plan_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WORKBENCH_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run([str(BIN / "workbench"), "plan", "--cluster", "dgx-h100", "--gpus", "64", "--seq", "8192",
                           "--global-batch", "1024", "--target", "megatron", *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)


def test_export_all_exits_0_with_one_line_per_refusal_and_names_the_defaults(configs, tmp_path):
    out = _plan_cli(tmp_path, "--model", str(configs["mixtral-8x7b"]), "--export", "all", "-o", str(tmp_path / "o"),
                    "--set", "train.lr=0.0003")
    assert out.returncode == 0, out.stderr[-3000:]
    refusals = [line for line in out.stderr.splitlines() if line.startswith("torchtitan: ")]
    assert refusals == ["torchtitan: model_type=mixtral has no torchtitan model (llama and qwen3 configs map to its "
                        "llama3 and qwen3); export to another format"]
    script = (tmp_path / "o" / "megatron.sh").read_text()
    assert "--lr 0.0003" in script.replace("\\\n", " ")
    named = [line for line in out.stderr.splitlines() if line.startswith("megatron: train.")]
    assert "megatron: train.steps=10: the workbench's default, not yours (set it: --set train.steps=VALUE or " \
           "--base FILE)" in named
    assert not any(line.startswith("megatron: train.lr=") for line in named)  # the user's own value
    assert "# train.steps=10: the workbench's default" in script
    assert not (tmp_path / "o" / "torchtitan.toml").exists()
    single = _plan_cli(tmp_path, "--model", str(configs["mixtral-8x7b"]), "--export", "torchtitan")
    assert single.returncode == 2 and single.stderr.strip().splitlines()[-1].startswith("torchtitan: model_type=mixtral")


@pytest.mark.parametrize("name", ["llama-3.1-8b", "mixtral-8x7b"])
def test_megatron_lms_own_parse_args_and_validate_args_take_every_plans_launch(plans, name):
    """With MEGATRON_PATH (a Megatron-LM core_v0.16.1 checkout; PyPI's megatron-core has no megatron.training):
    Megatron-LM's parse_args + validate_args read each plan's launch at world size 64 with the plan's dp."""
    from tests.test_export import _megatron_parse

    for _, cfg, out in _exports(plans, name, "megatron", picks=(1,)):
        args = _megatron_parse(out[0])
        assert (args["world_size"], args["data_parallel_size"]) == (64, cfg.parallel.dp)
        assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]) == (cfg.parallel.tp,
                                                                                              cfg.parallel.pp)
