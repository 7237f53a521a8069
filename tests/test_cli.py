"""The CLI as a user runs it: help, commbench's table, simulate's JSON and search."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def cli(*args: str, home=None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "WORKBENCH_HOME": str(home)} if home else dict(os.environ)
    return subprocess.run([sys.executable, "-m", "workbench.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_help_lists_every_command():
    out = cli("--help")
    assert out.returncode == 0
    for command in ("run", "runs", "show", "commbench", "tune", "studies", "export", "simulate", "calibrate", "app"):
        assert f" {command} " in out.stdout, command


@pytest.mark.xdist_group("launch")
def test_commbench_prints_a_busbw_table(tmp_path):
    out = cli("commbench", "--world", "2", "--max-mb", "0.0625", "--iters", "2", "--ops", "all_reduce,sendrecv",
              home=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "# all_reduce" in out.stdout and "# sendrecv" in out.stdout and "busbw" in out.stdout
    rows = [line.split() for line in out.stdout.splitlines() if line.strip() and line.strip()[0].isdigit()]
    assert [int(r[0]) for r in rows[:3]] == [1024, 4096, 16384]
    assert len(rows) == 2 * 4  # 1, 4, 16, 64 KB for each op
    assert float(rows[3][-1]) > 0 and float(rows[7][-1]) > 0  # the 64 KB rows print a nonzero busbw
    bad = cli("commbench", "--ops", "allreduce", home=tmp_path)
    assert bad.returncode == 2 and "unknown allreduce" in bad.stderr and "Traceback" not in bad.stderr


def test_simulate_one_config_json():
    out = cli("simulate", "--cluster", "dgx-a100-80gb", "--gpus", "1024", "--model", "175b", "--config",
              "tp=8,pp=8,dp=16,micro=1,global_batch=1536,recompute=full", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    for key in ("iteration_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "memory_per_gpu_gb", "fits", "breakdown"):
        assert key in data
    assert data["fits"] is True and 0 < data["mfu"] < 1
    assert abs(sum(data["breakdown"].values()) - data["iteration_time_s"]) <= 0.5 * data["iteration_time_s"]


def test_simulate_search_and_errors(tmp_path):
    report = tmp_path / "r.html"
    out = cli("simulate", "--cluster", "frontier", "--gpus", "256", "--model",
              "layers=24,hidden=2048,heads=16,seq=2048,vocab=51200", "--search", "--global-batch", "512",
              "--top", "3", "--report", str(report), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["configs"] > 100 and len(data["best"]) == 3
    assert data["best"][0]["tokens_per_s"] >= data["best"][1]["tokens_per_s"]
    assert "plotly" in report.read_text()
    bad = cli("simulate", "--gpus", "8", "--model", "layers=2", "--config", "tp=1")
    assert bad.returncode == 2 and "missing hidden" in bad.stderr
    invalid = cli("simulate", "--gpus", "8", "--model", "22b", "--config", "tp=3,pp=1,dp=1,micro=1,global_batch=8")
    assert invalid.returncode == 2 and "Traceback" not in invalid.stderr
