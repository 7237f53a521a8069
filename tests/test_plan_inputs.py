"""Issue 65 item 1: what a new user types into `plan`, `dryrun` and `run --launcher slurm` is refused in one
line naming the field, its value and the rule (exit 2), or done as asked: GPU counts that fill no whole node or
leave no data-parallel size that divides the global batch, --seq 0, a global batch below the GPU count, --wide,
a read-only -o folder, a plan-N.yaml dry-run at another --world, and --run-id on the Slurm launcher."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_reliability_store import _read_only_folder

ROOT = Path(__file__).resolve().parent.parent
LLAMA = "examples/llama3_8b/config.json"


def _start(*args: str, home: Path) -> subprocess.Popen:
    env = {**os.environ, "WORKBENCH_HOME": str(home), "OMP_NUM_THREADS": "1", "COLUMNS": "100"}
    return subprocess.Popen([sys.executable, "-m", "workbench.cli", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(procs: dict[str, subprocess.Popen]) -> dict[str, tuple[int, str, str]]:
    """Each command's (exit code, stdout, stderr), the processes run side by side."""
    outs = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        outs[name] = (proc.returncode, out, err)
    return outs


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


REFUSED = {  # plan's arguments -> the start of its one line
    "gpus 100": (["--model", "22b", "--gpus", "100"],
                 "error: --gpus=100: must fit in one node or fill whole nodes of dgx-h100 (a multiple of its 8 GPUs"),
    "gpus 7": (["--model", "22b", "--gpus", "7"],
               "error: --global-batch=512: must be a multiple of a data-parallel size this model can have on 7 GPUs (7;"),
    "seq 0, config.json": (["--model", LLAMA, "--gpus", "8", "--seq", "0"], "error: --seq=0: must be >= 1"),
    "seq 0, preset": (["--model", "22b", "--gpus", "8", "--seq", "0"], "error: --seq=0: must be >= 1"),
}


def test_plans_bad_inputs_are_one_line_each_and_the_odd_ones_are_said(tmp_path):
    """Old code: `zero-size array to reduction operation maximum which has no identity` for --gpus 100 and 7,
    a 186-line ZeroDivisionError for --seq 0 on a config.json, nothing said of a global batch of 3 on 64 GPUs
    (every layout dp 1), "No such option: --wide" after the table itself said to use it, and a read-only -o
    folder told to "choose another --home / WORKBENCH_HOME" with exit 1 once the plan was made."""
    read_only = _read_only_folder()
    try:
        procs = {name: _start("plan", *args, home=tmp_path) for name, (args, _) in REFUSED.items()}
        procs["batch 3"] = _start("plan", "--model", "22b", "--gpus", "64", "--global-batch", "3", home=tmp_path)
        procs["wide"] = _start("plan", "--model", "22b", "--gpus", "64", "--wide", home=tmp_path)
        procs["-o"] = _start("plan", "--model", "22b", "--gpus", "64", "-o", str(read_only / "plans"), home=tmp_path)
        outs = _finish(procs)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(read_only)], check=False)
        read_only.chmod(0o755)
        read_only.rmdir()
    for name, (_, start) in REFUSED.items():
        code, _, err = outs[name]
        assert code == 2 and _one_line(err).startswith(start), (name, code, err[-2000:])
    code, out, err = outs["batch 3"]
    assert code == 0 and "more columns" in out, err[-2000:]  # the narrow table, which names --wide
    assert _one_line(err) == ("note: --global-batch=3 on 64 GPUs: the data-parallel size divides it, so every "
                              "layout has dp <= 1 and splits the model over the other GPUs")
    code, out, err = outs["wide"]
    assert code == 0, err[-2000:]
    assert "more columns" not in out and "dp" in out, out  # every column, however narrow the terminal
    code, _, err = outs["-o"]
    line = _one_line(err)
    assert code == 2 and line.startswith(f"error: -o='{read_only / 'plans'}': "), line
    assert line.endswith("must be a folder you can write: choose another -o") and "--home" not in line, line


def _plan_yaml(folder: Path) -> Path:
    """A plan-N.yaml's shape: a layout for a world of 8, its Slurm job 4 nodes x 2 GPUs (a tiny model)."""
    path = folder / "plan-1.yaml"
    path.write_text("name: plan-1\nmodel: {layers: 2, d_model: 64, heads: 4, seq_len: 64, vocab: 256}\n"
                    "data: {source: synthetic}\nparallel: {dp: 8, zero: 3}\nbatch: {global: 8, micro: 1}\n"
                    "precision: fp32\ncluster: {nodes: 4, gpus_per_node: 2}\n")
    return path


def test_dryrun_at_another_world_rescales_the_plans_slurm_job(tmp_path):
    """Old code: `cluster.gpus_per_node=2: nodes*gpus_per_node = 4*2 = 8 must equal the world size ... = 2`."""
    config = _plan_yaml(tmp_path)
    procs = {"world 2": _start("dryrun", str(config), "--world", "2", "--json", home=tmp_path),
             "world 3": _start("dryrun", str(config), "--world", "3", home=tmp_path)}
    outs = _finish(procs)
    code, out, err = outs["world 2"]
    assert code == 0, err[-2000:]
    assert _one_line(err) == "--world 2: the Slurm job (cluster:) rescaled from 4 x 2 to 1 x 2 GPUs"
    report = json.loads(out)
    assert report["world"] == 2 and report["layout"]["dp"] == 2
    code, _, err = outs["world 3"]
    assert code == 2 and _one_line(err) == (
        "error: --world=3: must fit in one node or fill whole nodes of the config's Slurm job (a multiple of "
        "cluster.gpus_per_node=2); or --set cluster.gpus_per_node=N"), err


def test_run_on_slurm_shows_and_submits_the_run_id_it_was_given(tmp_path, monkeypatch):
    """Old code: the Slurm job was named and stored as `tiny-<random>` whatever --run-id said (the local
    launcher honoured it). Slurm itself is not needed: the dry run prints the batch script sbatch would get,
    and the submitting path is followed to `launch`, the call that registers the run under its id."""
    import typer
    from typer.testing import CliRunner

    import engine.launch.local as local
    import engine.launch.slurm as slurm
    from workbench import cli

    shown = _start("run", "examples/tiny.yaml", "--launcher", "slurm", "--dry-run", "--run-id", "my-run.1",
                   home=tmp_path)
    app = typer.Typer()
    app.command()(cli.run)  # one command: its options are the app's
    asked: list[str | None] = []

    def launch(cfg, **kwargs):
        asked.append(kwargs.get("run_id"))
        raise slurm.SlurmError("stopped by the test")

    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)  # run() takes SIGTERM: not the test's
    monkeypatch.setattr(slurm, "require_sbatch", lambda: None)
    monkeypatch.setattr(local, "launch", launch)
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path))
    for extra in ([], ["--json"]):
        result = CliRunner().invoke(app, ["examples/tiny.yaml", "--launcher", "slurm", "--run-id", "my-run.1",
                                          "--set", "train.steps=1", *extra])
        assert result.exit_code == 1 and "stopped by the test" in result.output, result.output
    assert asked == ["my-run.1", "my-run.1"]
    (code, out, err), = _finish({"shown": shown}).values()
    assert code == 0, err[-2000:]
    assert "#SBATCH --job-name=my-run.1\n" in out and "export WORKBENCH_RUN_ID=my-run.1\n" in out, out
    assert f"{tmp_path}/runs/my-run.1/slurm-%j.out" in out and "tiny-" not in out
