"""The data-parallel engine, end to end through torchrun: parity with one process, gradient
accumulation, checkpoint/resume, a crashing rank, and no processes left behind."""
from __future__ import annotations

import os

import psutil
import pytest
import torch

from engine.config.schema import load_config
from engine.errors import RankFailure
from engine.launch.local import launch
from engine.train.trainer import Trainer
from tests.processes import descendants

TINY = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=32", "model.vocab=256",
        "train.steps=5", "train.lr=0.003", "train.warmup_steps=0", "batch.global=8",
        "profile.host_interval_s=0", "profile.nvml_interval_s=0"]

pytestmark = pytest.mark.xdist_group("launch")


def single_process_losses(overrides: list[str]) -> list[float]:
    """The reference: the same config in this process, dp=1, no process group."""
    torch.set_num_threads(1)
    cfg = load_config(None, TINY + overrides)
    return [m.loss for m in Trainer(cfg, device=torch.device("cpu")).run()]


def run_losses(tmp_path, overrides: list[str], **kw) -> list[float]:
    cfg = load_config(None, TINY + overrides)
    result = launch(cfg, home=tmp_path, **kw)
    assert result.status == "completed"
    return [s["loss"] for s in result.steps]


@pytest.mark.parametrize("world,micro", [(2, 4), (4, 2)])
def test_dp_follows_single_process_trajectory(tmp_path, world, micro):
    ref = single_process_losses(["batch.micro=4"])
    got = run_losses(tmp_path, [f"parallel.dp={world}", f"batch.micro={micro}"])
    assert len(got) == len(ref) == 5
    diff = max(abs(a - b) for a, b in zip(got, ref))
    assert diff <= 1e-4, (got, ref)
    assert ref[-1] < ref[0]  # it really trains


def test_accumulation_equals_full_batch_step():
    accumulated = single_process_losses(["batch.micro=2"])  # 2 x accumulation 4
    full = single_process_losses(["batch.micro=8"])
    assert max(abs(a - b) for a, b in zip(accumulated, full)) <= 1e-5


def test_checkpoint_resume_matches_uninterrupted(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    common = ["parallel.dp=2", "batch.micro=4", "train.steps=6"]
    full = run_losses(tmp_path, common + ["train.checkpoint_interval=3", f"train.checkpoint_dir={ckpt_dir}"])
    saved = ckpt_dir / "step000003"
    assert (saved / ".metadata").is_file()
    resumed = run_losses(tmp_path, common + [f"train.resume_from={saved}"])
    # the resumed run starts at step 3: its steps 3, 4, 5 equal the uninterrupted run's
    assert len(resumed) == 3
    assert max(abs(a - b) for a, b in zip(resumed, full[3:])) <= 1e-6


def test_crashing_rank_reaches_caller_with_rank_and_no_process_survives(tmp_path):
    before = descendants()
    cfg = load_config(None, TINY + ["parallel.dp=2", "batch.micro=4", "train.timeout_s=20"])
    with pytest.raises(RankFailure) as info:
        launch(cfg, home=tmp_path, extra_env={"WORKBENCH_FAULT": "rank=1,step=2,kind=raise"})
    assert info.value.rank == 1
    assert "InjectedFault" in str(info.value) and "injected fault at step 2" in info.value.traceback
    assert "Traceback" in info.value.traceback
    leftover = [p for p in descendants() - before if psutil.pid_exists(p)]
    assert leftover == []
    from profilers.store import RunStore

    run = RunStore.open_home(tmp_path).runs()[0]
    assert run["status"] == "failed" and run["error_rank"] == 1
    # the steps completed before the fault stay readable
    assert [s["step"] for s in RunStore.open_home(tmp_path).latest_steps(run["run_id"])] == [0, 1]


def test_killed_rank_is_reported_with_its_signal(tmp_path):
    cfg = load_config(None, TINY + ["parallel.dp=2", "batch.micro=4", "train.timeout_s=20"])
    with pytest.raises(RankFailure, match=r"rank 0 failed: killed by signal 9 \(SIGKILL\)"):
        launch(cfg, home=tmp_path, extra_env={"WORKBENCH_FAULT": "rank=0,step=1,kind=kill"})


def test_world_size_must_match_external_torchrun(tmp_path):
    """Under an external torchrun the config's dp*tp*pp must equal WORLD_SIZE."""
    import json
    import subprocess
    import sys

    cfg = load_config(None, TINY + ["parallel.dp=2", "batch.micro=4"])
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg.to_dict()))
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "WORKBENCH_HOME": str(tmp_path)}
    env.pop("WORKBENCH_TELEMETRY", None)
    proc = subprocess.run([sys.executable, "-m", "engine.launch.worker", "--config", str(path), "--run-dir",
                           str(tmp_path / "r")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "dp*tp*pp=2" in proc.stderr and "WORLD_SIZE=1" in proc.stderr
