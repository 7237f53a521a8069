"""The accelerate export runs as exported: `accelerate launch --config_file EXPORT.yaml EXPORT_train.py` on 2 CPU
processes trains the run's Hugging Face model on the run's token file, batch, accumulation and lr schedule, and
its loss at each of 3 steps equals `workbench run` of the same config within 1e-4."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import optuna
import pytest
import yaml
from optuna.trial import create_trial

from engine.config.schema import load_config

pytestmark = pytest.mark.xdist_group("launch")

BIN = Path(sys.executable).parent
TINY_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "rope_theta": 10000.0,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}", "WORKBENCH_HOME": str(home),
            "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_accelerate_launch_runs_the_export_and_its_loss_is_the_engines(tmp_path):
    tokens = tmp_path / "train.bin"
    np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16).tofile(tokens)
    run = {"name": "acc", "model": {"hf": TINY_LLAMA, "seq_len": 32},
           "data": {"source": "tokens", "path": str(tokens)},
           "parallel": {"dp": 2}, "batch": {"global": 8, "micro": 2},  # 2 micro-batches per step and rank
           "train": {"steps": 3, "lr": 3e-3, "warmup_steps": 1, "weight_decay": 0.1, "grad_clip": 0.5,
                     "eval_interval": 0, "timeout_s": 60},
           "profile": {"host_interval_s": 0, "nvml_interval_s": 0}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    cfg = load_config(tmp_path / "run.yaml")
    storage = f"sqlite:///{tmp_path}/studies.db"
    study = optuna.create_study(study_name="s", storage=storage, direction="maximize")
    study.add_trial(create_trial(value=1.0, user_attrs={"config": cfg.to_dict()}))
    env = _env(tmp_path / "home")
    (tmp_path / "out").mkdir()
    out = subprocess.run([str(BIN / "workbench"), "export", "s", "--storage", storage, "--format", "accelerate",
                          "-o", str(tmp_path / "out" / "acc.yaml")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    launch = out.stdout.strip().splitlines()[-1]
    assert launch == "accelerate launch --config_file acc.yaml acc_train.py"
    assert "not mapped: batch.micro=2, batch.global=8" in out.stderr
    # the export as written and the engine's run, side by side (two ranks each)
    accelerate = subprocess.Popen(launch, shell=True, cwd=tmp_path / "out", env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
    engine = subprocess.run([str(BIN / "workbench"), "run", str(tmp_path / "run.yaml"), "--json"], env=env,
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    stdout, stderr = accelerate.communicate(timeout=300)
    assert accelerate.returncode == 0, stderr[-3000:]
    assert engine.returncode == 0, engine.stderr[-3000:]
    theirs = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"step"')]
    ours = json.loads(engine.stdout[engine.stdout.index("{"):])["steps"]
    assert [s["step"] for s in theirs] == [s["step"] for s in ours] == [0, 1, 2]
    for a, b in zip(theirs, ours):
        assert abs(a["loss"] - b["loss"]) <= 1e-4, (theirs, ours)
    assert theirs[0]["loss"] != theirs[2]["loss"]  # it trained
