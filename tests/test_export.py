"""Exports run or load in the tool they name: torchrun runs the printed line, an outside torchrun's run is
recorded and finalised in the store, DeepSpeed's own config and scheduler classes accept the JSON (with
the run's lr curve), Megatron-LM's own parser accepts the launch, and one config round-trips through all."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import create_trial

from engine.config.schema import RunConfig, load_config
from engine.train.trainer import lr_at
from tuning.export.trial import export_trial, to_deepspeed

pytestmark = pytest.mark.xdist_group("launch")

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TINY = ["train.steps=3", "train.eval_interval=0", "profile.host_interval_s=0", "profile.nvml_interval_s=0",
        "train.timeout_s=60"]


def _study(tmp_path: Path, overrides: list[str], base: str | None = "examples/tiny.yaml") -> tuple[str, optuna.Study]:
    """A study whose best (only) trial holds this config, as `workbench tune` leaves it."""
    cfg = load_config(REPO / base if base else None, overrides)
    storage = f"sqlite:///{tmp_path}/studies.db"
    study = optuna.create_study(study_name="s", storage=storage, direction="maximize")
    study.add_trial(create_trial(value=1000.0, user_attrs={"config": cfg.to_dict()}))
    return storage, study


def _env(home: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}", "WORKBENCH_HOME": str(home),
            "OMP_NUM_THREADS": "1", **extra}


def _workbench(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "workbench"), *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def _only_run(env: dict[str, str], cwd: Path) -> dict:
    runs = json.loads(_workbench("runs", "--json", env=env, cwd=cwd).stdout)
    assert len(runs) == 1, runs
    out = _workbench("show", runs[0]["run_id"], "--json", env=env, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# ------------------------------------------------------------------ torchrun, and runs it starts
@pytest.mark.slow
def test_torchrun_bundle_runs_as_printed_and_the_run_is_finalised(tmp_path):
    storage, _ = _study(tmp_path, TINY)
    work, home = tmp_path / "elsewhere", tmp_path / "home"
    work.mkdir()
    env = _env(home)
    out = _workbench("export", "s", "--storage", storage, "--format", "torchrun", "-o", "bundle", env=env, cwd=work)
    assert out.returncode == 0, out.stderr
    command = out.stdout.strip().splitlines()[-1]
    assert command.startswith("torchrun --nproc-per-node=2 --standalone -m engine.launch.worker --config bundle/config.yaml")
    assert sorted(p.name for p in (work / "bundle").iterdir()) == ["README.md", "config.yaml", "launch.sh"]
    ran = subprocess.run(command, shell=True, env=env, cwd=work, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    report = _only_run(env, work)
    assert report["status"] == "completed" and report["error"] is None
    assert report["layout"] == {"dp": 2, "tp": 1, "pp": 1, "world_size": 2}
    assert report["summary"]["steps"] == 3 and report["summary"]["tokens_per_s"] > 0
    assert not (work / ".workbench").exists()  # WORKBENCH_HOME is honoured by every rank


@pytest.mark.slow
def test_a_failing_outside_torchrun_run_is_recorded_failed_with_the_rank_error(tmp_path):
    storage, _ = _study(tmp_path, TINY)
    work, home = tmp_path / "elsewhere", tmp_path / "home"
    work.mkdir()
    script = _workbench("export", "s", "--storage", storage, "--format", "torchrun", env=_env(home), cwd=work)
    assert script.returncode == 0, script.stderr
    env = _env(home, WORKBENCH_FAULT="rank=1,step=1,kind=raise")
    ran = subprocess.run(["bash", "-c", script.stdout], env=env, cwd=work, capture_output=True, text=True,
                         timeout=300)  # the printed script, as printed: writes best.yaml, then torchrun
    assert ran.returncode != 0
    assert (work / "best.yaml").exists()
    report = _only_run(env, work)
    assert report["status"] == "failed" and report["error_rank"] == 1
    assert "InjectedFault: injected fault at step 1" in report["error"]
    assert report["layout"]["dp"] == 2 and report["summary"]["steps"] >= 1
    assert not (work / ".workbench").exists()


# torchrun SIGTERMs the surviving ranks when one fails; here it lands while rank 0 closes its telemetry
SIGTERM_DURING_CLOSE = """
import os, runpy, signal
from profilers.telemetry import TelemetryClient
close = TelemetryClient.close
def close_under_sigterm(self, *a, **k):
    os.kill(os.getpid(), signal.SIGTERM)
    return close(self, *a, **k)
TelemetryClient.close = close_under_sigterm
runpy.run_module("engine.launch.worker", run_name="__main__")
"""


def test_a_launcher_sigterm_while_a_failed_rank_winds_down_still_records_the_failure(tmp_path):
    cfg = load_config(REPO / "examples/tiny.yaml", [*TINY, "parallel.dp=1", "batch.global=8"])
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    env = {k: v for k, v in _env(tmp_path / "home", WORLD_SIZE="1", RANK="0", WORKBENCH_RUN_ID="",
                                 WORKBENCH_FAULT="rank=0,step=1,kind=raise").items()
           if k != "WORKBENCH_TELEMETRY"}
    ran = subprocess.run([sys.executable, "-c", SIGTERM_DURING_CLOSE, "--config", "run.yaml"], cwd=tmp_path,
                         env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 1, ran.stderr[-3000:]
    assert "Terminated" not in ran.stderr, ran.stderr[-3000:]
    report = _only_run(env, tmp_path)
    assert report["status"] == "failed" and report["error_rank"] == 0, ran.stderr[-3000:]
    assert "InjectedFault: injected fault at step 1" in report["error"]


def test_a_refused_outside_run_is_recorded_failed_with_the_config_error(tmp_path):
    cfg = load_config(REPO / "examples/tiny.yaml", TINY)  # dp=2, started as one process
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    env = {k: v for k, v in _env(tmp_path / "home", WORLD_SIZE="1", RANK="0",
                                 WORKBENCH_RUN_ID="").items() if k != "WORKBENCH_TELEMETRY"}
    ran = subprocess.run([sys.executable, "-m", "engine.launch.worker", "--config", "run.yaml"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 1
    report = _only_run(env, tmp_path)
    assert report["status"] == "failed" and report["error_rank"] == 0
    assert "dp*tp*pp=2" in report["error"] and "WORLD_SIZE=1" in report["error"]
    assert report["layout"]["dp"] == 2 and not (tmp_path / ".workbench").exists()


# ------------------------------------------------------------------ DeepSpeed
def _deepspeed():
    return pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: `make install` installs it "
                                                   "(DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed)")


def _ds_config(ds: dict, dp: int, monkeypatch):
    """DeepSpeed's own config class on this CPU machine: rank 0 of `dp` data-parallel ranks."""
    deepspeed = _deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 0)
    mpu = types.SimpleNamespace(get_data_parallel_world_size=lambda: dp, get_data_parallel_rank=lambda: 0,
                                get_model_parallel_world_size=lambda: 1, get_model_parallel_rank=lambda: 0)
    return DeepSpeedConfig(json.loads(json.dumps(ds)), mpu=mpu)


def _ds_lr_per_step(config, peak_lr: float, steps: int) -> list[float]:
    """The lr of each optimizer step under DeepSpeed's engine: the scheduler built by the engine's own
    `_scheduler_from_config`, stepped after each optimizer step as `DeepSpeedEngine._take_model_step` does."""
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=peak_lr)
    engine = types.SimpleNamespace(scheduler_name=lambda: config.scheduler_name,
                                   scheduler_params=lambda: config.scheduler_params)
    scheduler = DeepSpeedEngine._scheduler_from_config(engine, opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return out


# the steps whose lr differs from the run's: DeepSpeed's own schedulers set their start value when built
# and step after each optimizer step (steps 0 and 1 share an lr), and WarmupDecayLR warms up from its floor
DIFFERENT_STEPS = {("constant", 0): [], ("linear", 0): [], ("cosine", 0): [],
                   ("constant", 2): [0], ("constant", 3): [0], ("constant", 4): [0],
                   ("linear", 3): [0, 1, 2], ("linear", 4): [0, 1, 2, 3],
                   ("cosine", 2): [0, 1, 2], ("cosine", 4): [0, 1, 2, 3, 4]}


@pytest.mark.parametrize("schedule,warmup", sorted(DIFFERENT_STEPS))
def test_deepspeed_accepts_every_schedule_with_the_runs_lr_curve(schedule, warmup, monkeypatch):
    cfg = load_config(None, [f"train.schedule={schedule}", f"train.warmup_steps={warmup}", "train.steps=30",
                             "train.lr=0.003", "train.min_lr_ratio=0.1", "parallel.dp=2", "batch.global=16",
                             "batch.micro=4"])
    ds, notes = to_deepspeed(cfg)
    config = _ds_config(ds, dp=2, monkeypatch=monkeypatch)
    if "scheduler" in ds:
        assert config.scheduler_params.get("warmup_num_steps", 1) > 0
    got = _ds_lr_per_step(config, cfg.train.lr, cfg.train.steps)
    want = [lr_at(k, cfg) for k in range(cfg.train.steps)]
    differ = [k for k in range(cfg.train.steps) if abs(got[k] - want[k]) > 1e-9 * cfg.train.lr]
    assert differ == DIFFERENT_STEPS[(schedule, warmup)], list(zip(got, want))
    if differ:  # said beside the JSON, with the step from which it matches
        assert any(f"step {differ[-1] + 1}" in n or "every later step" in n for n in notes), notes
    assert all(not k.startswith("_") for k in ds)  # nothing but DeepSpeed keys inside the JSON


def test_deepspeed_buckets_in_elements_and_checkpointing_switched_on(monkeypatch):
    cfg = load_config(None, ["parallel.dp=2", "parallel.pp=2", "model.layers=4", "batch.global=8",
                             "batch.micro=2", "ddp.bucket_cap_mb=25", "train.activation_checkpointing=true",
                             "precision=bf16"])
    ds, notes = to_deepspeed(cfg)
    config = _ds_config(ds, dp=2, monkeypatch=monkeypatch)
    assert config.zero_config.reduce_bucket_size == 25 * 2**20 // 2  # bf16 gradients: 2 bytes per element
    assert config.activation_checkpointing_config.partition_activations is False  # no model parallel ranks
    assert config.activation_checkpointing_config.number_checkpoints == 4
    assert config.pipeline["activation_checkpoint_interval"] == 1  # a PipelineModule recomputes each layer
    assert any("deepspeed.checkpointing.checkpoint" in n for n in notes)
    assert notes[-1].startswith("the workbench GPT, data.source=text, train.steps=10: a DeepSpeed config holds none")


def test_deepspeed_export_prints_json_only_and_lists_unmapped_knobs_beside_it(tmp_path):
    storage, _ = _study(tmp_path, ["comm.compressor=powersgd", "train.warmup_steps=4"])
    out = _workbench("export", "s", "--storage", storage, "--format", "deepspeed", env=_env(tmp_path / "h"),
                     cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    ds = json.loads(out.stdout)  # stdout is the JSON and nothing else
    assert "_not_mapped" not in ds and ds["scheduler"]["params"]["warmup_type"] == "linear"
    assert "not mapped: comm.compressor=powersgd" in out.stderr


# ------------------------------------------------------------------ Megatron-LM
MEGATRON_REASON = ("Megatron-LM's megatron.training is not importable: PyPI's megatron-core (wheel and sdist, "
                   "0.16.1 checked) ships only megatron/core; set MEGATRON_PATH to a Megatron-LM checkout "
                   "(core_v0.16.1 on Python 3.11) with six, regex and triton installed")

# parse and validate our launch with Megatron's own code; the GPU generation is the one thing it asks a GPU
_MEGATRON_PARSE = textwrap.dedent("""
    import json, os, sys
    import torch
    import megatron.training.arguments as ma
    from megatron.training.arguments import parse_args, validate_args
    ma.get_device_arch_version = lambda: 9  # an H100: the only question validate_args asks the GPU
    torch.cuda.get_device_capability = lambda *a: (9, 0)  # (asked again, for --moe-grouped-gemm)
    args = parse_args()
    validate_args(args)
    keys = ["world_size", "data_parallel_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "micro_batch_size", "global_batch_size", "bf16", "recompute_granularity", "lr", "min_lr", "train_iters"]
    print("ARGS=" + json.dumps({k: getattr(args, k) for k in keys}))
""")


def _megatron_env() -> dict[str, str] | None:
    path = os.environ.get("MEGATRON_PATH", "")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH", "")) if p)}
    probe = subprocess.run([sys.executable, "-c", "import megatron.training.arguments"], env=env,
                           capture_output=True, text=True, timeout=300)
    return env if probe.returncode == 0 else None


def _printed_tokens(text: str) -> list[str]:
    return shlex.split(text.replace("\\\n", " "), comments=True)


def _megatron_parse(text: str) -> dict:
    """Run the printed launch's pretrain_gpt.py arguments through Megatron-LM's parser and validator with the
    environment torchrun would give rank 0."""
    env = _megatron_env()
    if env is None:
        pytest.skip(MEGATRON_REASON)
    cmd = _printed_tokens(text)
    assignments = [c for c in cmd[:cmd.index("torchrun")]]
    nproc = int(next(c for c in cmd if c.startswith("--nproc-per-node=")).split("=")[1])
    nnodes = int(next(c for c in cmd if c.startswith("--nnodes=")).split("=")[1])
    env.update(dict(a.split("=", 1) for a in assignments), WORLD_SIZE=str(nproc * nnodes), RANK="0")
    argv = cmd[cmd.index("pretrain_gpt.py"):]
    out = subprocess.run([sys.executable, "-c", f"import sys; sys.argv = {argv!r}\n{_MEGATRON_PARSE}"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(out.stdout.split("ARGS=")[-1])


def test_megatron_launch_sets_world_size_and_prints_clean_numbers(tmp_path):
    storage, study = _study(tmp_path, ["parallel.dp=1", "parallel.tp=2", "train.lr=0.003",
                                       "train.min_lr_ratio=0.1"])
    text = export_trial(study, fmt="megatron")
    launch = [line for line in text.splitlines() if not line.startswith("#")]
    assert launch[0].startswith("CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node=2 --nnodes=1")
    assert "--min-lr 0.0003 " in text.replace("\\\n", " ") + " "  # 0.003 * 0.1 without float noise
    numbers = re.findall(r"--[a-z0-9-]+ (-?[0-9][0-9.e+-]*)", text)
    assert numbers and all(len(n.replace("-", "").replace(".", "").split("e")[0]) <= 12 for n in numbers)
    args = _megatron_parse(text)
    assert args["world_size"] == 2 and args["tensor_model_parallel_size"] == 2
    assert args["min_lr"] == 0.0003 and args["lr"] == 0.003


# ------------------------------------------------------------------ one config through every tool
ROUND_TRIP = ["model.layers=4", "model.heads=4", "parallel.dp=2", "parallel.tp=2", "parallel.pp=2",
              "batch.global=16", "batch.micro=2", "precision=bf16", "train.activation_checkpointing=true"]


def _seen_by(tool: str, study: optuna.Study, monkeypatch) -> dict:
    """(layout, batch, precision, recompute) as the named tool reads the export."""
    text = export_trial(study, fmt="torchrun" if tool == "torchrun" else "yaml")
    if tool in ("yaml", "torchrun"):
        body = text.split("<<'WORKBENCH_EOF'\n", 1)[-1].split("WORKBENCH_EOF", 1)[0]
        cfg = load_config_text(body)
        if tool == "torchrun":
            nproc = int(re.search(r"--nproc-per-node=(\d+)", text).group(1))
            assert nproc == cfg.world_size
        p = cfg.parallel
        return {"dp": p.dp, "tp": p.tp, "pp": p.pp, "micro": cfg.batch.micro, "global": cfg.batch.global_,
                "bf16": cfg.precision == "bf16", "recompute": cfg.train.activation_checkpointing}
    if tool == "megatron":
        a = _megatron_parse(export_trial(study, fmt="megatron"))
        return {"dp": a["data_parallel_size"], "tp": a["tensor_model_parallel_size"],
                "pp": a["pipeline_model_parallel_size"], "micro": a["micro_batch_size"],
                "global": a["global_batch_size"], "bf16": a["bf16"], "recompute": a["recompute_granularity"] == "full"}
    ds = json.loads(export_trial(study, fmt="deepspeed"))
    c = _ds_config(ds, dp=2, monkeypatch=monkeypatch)  # DeepSpeed checks global = micro * accum * dp
    return {"dp": c.train_batch_size // (c.train_micro_batch_size_per_gpu * c.gradient_accumulation_steps),
            "tp": 1, "pp": c.pipeline["stages"], "micro": c.train_micro_batch_size_per_gpu,
            "global": c.train_batch_size, "bf16": c.bfloat16_config.enabled,
            "recompute": c.pipeline["activation_checkpoint_interval"] == 1
            and c.activation_checkpointing_config.number_checkpoints == 4}


def load_config_text(text: str) -> RunConfig:
    from engine.config.schema import from_dict, validate

    return validate(from_dict(yaml.safe_load(text)))


@pytest.mark.parametrize("tool", ["yaml", "torchrun", "megatron", "deepspeed"])
def test_best_config_round_trips_through_each_tool(tool, tmp_path, monkeypatch):
    """Each tool reads the layout it was given; DeepSpeed, which has no tensor parallelism of its own, refuses tp=2 in
    one line and reads the same job at tp=1."""
    _, study = _study(tmp_path, ROUND_TRIP, base=None)
    want = {"dp": 2, "tp": 2, "pp": 2, "micro": 2, "global": 16, "bf16": True, "recompute": True}
    if tool == "deepspeed":
        with pytest.raises(ValueError, match=r"^deepspeed: tp=2 cp=1: DeepSpeed has no tensor or context parallel"):
            export_trial(study, fmt="deepspeed")
        (tmp_path / "tp1").mkdir()
        _, study = _study(tmp_path / "tp1", ROUND_TRIP + ["parallel.tp=1"], base=None)
        want["tp"] = 1
    assert _seen_by(tool, study, monkeypatch) == want
