"""The CLI as a user runs it: help, commbench's table, simulate's JSON and search."""
from __future__ import annotations

import json
import os
import re
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
    for command in ("run", "runs", "show", "commbench", "tune", "studies", "export", "simulate", "calibrate", "app",
                    "tokenize", "plan", "dryrun"):
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


def test_commbench_refuses_a_sweep_larger_than_memory_in_one_line(tmp_path):
    """Before: `commbench --max-mb 10240` had no bound and ran 240 s until killed (issue 40)."""
    out = cli("commbench", "--max-mb", "1048576", home=tmp_path, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert re.search(r"--max-mb=1048576: .* GiB on this machine .* GiB is available; lower --max-mb", out.stderr)


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


# ---------------------------------------------------------------- issue 15: readable at 80 columns


def test_numbers_are_formatted_for_people():
    from workbench.fmt import gib, num, nums, pct, ratio

    assert num(45815.01329358271) == "45,815" and num(48.61357569694519) == "48.61"
    assert num(0.000123) == "0.000123" and num(3) == "3" and num(2.0) == "2" and num(1e20) == "1e+20"
    assert num(None) == "n/a" and num(float("nan")) == "n/a" and num(True) == "True"
    assert nums([45815.01329358271]) == "45,815" and nums(None) == "-"
    assert pct(0.4213) == "42.1%" and ratio(1.0) == "1x" and ratio(0.0625) == "0.0625x" and gib(2**31) == "2"


def _report() -> dict:
    phases = ["data", "forward", "backward", "optimizer", "comm_exposed", "bubble", "other", "total"]
    mem = ["estimate_activations(GiB)", "estimate_grads(GiB)", "estimate_optimizer(GiB)", "estimate_params(GiB)",
           "grads(GiB)", "optimizer(GiB)", "params(GiB)", "peak_rss(GiB)", "rss(GiB)"]
    return {"run_id": "tiny-0123abcd", "status": "completed", "world_size": 4, "emulated": False, "error": None,
            "layout": {"dp": 4, "tp": 1, "pp": 1},
            "summary": {"ratio": 1.0, "tokens_per_s": 45815.01329358271, "final_loss": 5.0931234, "mfu": None,
                        "wire_bytes": 2866176.0, "dense_bytes": 2866176.0},
            "breakdown": [{"step": s, "rank": r, **{p: 0.0123456 * (i + 1) for i, p in enumerate(phases)}}
                          for s in range(3) for r in range(4)],
            "collectives": {"all_reduce": {"count": 7, "bytes": 1433120.0, "time(s)": 0.30712, "busbw(GB/s)": 0.0046}},
            "memory": {r: {n: 0.000444912 * (i + 1) for i, n in enumerate(mem)} for r in range(4)}}


def test_show_fits_80_columns_with_whole_headers():
    """`show`'s memory table cut its headers to "esti..." and the summary printed as a Python dict."""
    import io

    from rich.console import Console

    from workbench.report import print_report

    buf = io.StringIO()
    print_report(_report(), Console(file=buf, width=80, color_system=None))
    text = buf.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "…" not in text and "..." not in text, text
    for name in ("estimate_activations", "comm_exposed", "wire / dense bytes (ratio)", "busbw"):
        assert name in text, name
    assert re.search(r"\d B/s|[kMG]B/s", text), text  # a bus bandwidth in its unit (issue 52 item 7), not 1.49e-07
    assert "466.5 KiB" in text  # memory in the unit that reads best (0.000444912 GiB)
    assert "{'" not in text and "45,815" in text and "1x" in text


def test_simulate_search_fits_80_columns():
    env = {**os.environ, "COLUMNS": "80"}
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "simulate", "--gpus", "64", "--model", "22b",
                          "--search", "--top", "3", "--global-batch", "256"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, out.stdout
    assert "…" not in out.stdout
    assert "tokens/s" in out.stdout and "iter (s)" in out.stdout and "use --wide or --json" in out.stdout
    wide = subprocess.run([sys.executable, "-m", "workbench.cli", "simulate", "--gpus", "64", "--model", "22b",
                           "--search", "--top", "3", "--global-batch", "256", "--wide"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert "mem_activations_gb" in wide.stdout and "use --wide" not in wide.stdout


def test_studies_prints_best_as_a_number(tmp_path):
    import optuna

    storage = f"sqlite:///{tmp_path}/studies.db"
    study = optuna.create_study(study_name="fmt", storage=storage, direction="maximize")
    study.add_trial(optuna.trial.create_trial(params={}, distributions={}, value=45815.01329358271))
    out = cli("studies", "--storage", storage, home=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "45,815" in out.stdout and "[45815" not in out.stdout


# ---------------------------------------------------------------- issue 15: tuning from the shell


def _tiny(tmp_path):
    space, base = tmp_path / "space.yaml", tmp_path / "base.yaml"
    space.write_text("params:\n  batch.micro: {choices: [2, 4]}\nfixed: {train.steps: 2}\n")
    base.write_text("model: {layers: 1, d_model: 32, heads: 4, seq_len: 32}\nbatch: {global: 4, micro: 2}\n"
                    "data: {source: synthetic}\n")
    return ["tune", str(space), "--base", str(base), "--storage", f"sqlite:///{tmp_path}/studies.db",
            "--study", "quiet", "--pruner", "none"]


@pytest.mark.slow
@pytest.mark.xdist_group("launch")
def test_tune_is_quiet_and_total_trials_says_what_applies(tmp_path):
    """No Optuna ExperimentalWarning/UserWarning on stderr; --total-trials counts existing trials."""
    env = {**os.environ, "WORKBENCH_HOME": str(tmp_path), "OMP_NUM_THREADS": "1", "COLUMNS": "80"}
    run = lambda *extra: subprocess.run([sys.executable, "-m", "workbench.cli", *_tiny(tmp_path), *extra],  # noqa: E731
                                        capture_output=True, text=True, env=env, timeout=300)
    first = run("--trials", "1")
    assert first.returncode == 0, first.stderr[-2000:]
    assert "Warning" not in first.stderr and "A new study created" not in first.stderr, first.stderr
    assert max(len(line) for line in first.stdout.splitlines()) <= 80, first.stdout
    again = run("--total-trials", "1")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "study quiet has 1 trials; --total-trials 1: running 0 more" in again.stderr
    assert "Warning" not in again.stderr


def test_tune_with_no_completed_trial_exits_nonzero(tmp_path):
    """Every trial pruned (here: over the memory limit, so no process starts) used to exit 0 with no best."""
    out = cli(*_tiny(tmp_path), "--trials", "2", "--memory-limit-gb", "1e-9", home=tmp_path)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "study='quiet': no trial completed (2 pruned)" in " ".join(out.stderr.split())
    assert not (tmp_path / "runs").exists()


def test_trials_to_run_counts_existing_trials(capsys):
    import optuna

    from workbench.cli_tune import _trials_to_run

    study = optuna.create_study(study_name="s")
    for _ in range(3):
        study.add_trial(optuna.trial.create_trial(params={}, distributions={}, value=1.0))
    assert _trials_to_run(study, None, 5, quiet=False) == 2
    assert _trials_to_run(study, None, 2, quiet=False) == 0
    assert _trials_to_run(study, 4, None, quiet=False) == 4
    assert _trials_to_run(study, None, None, quiet=False) == 10
    err = capsys.readouterr().err
    assert "study s has 3 trials; --total-trials 5: running 2 more" in err
    assert "--trials 4 adds 4 more (7 in total; --total-trials N stops at N in total)" in err


def test_a_dead_workers_trial_says_why(tmp_path):
    """After a killed tuner is restarted, its running trial was FAIL with an empty reason."""
    import time

    import optuna
    from optuna.trial import TrialState

    from tuning.objective import TrialOutcome
    from tuning.study import _Heartbeat, make_storage, run_trials

    storage = make_storage(f"sqlite:///{tmp_path}/s.db", tmp_path, heartbeat_s=1, grace_s=1)
    study = optuna.create_study(study_name="dead", storage=storage, direction="maximize")
    orphan = study.ask()
    beat = _Heartbeat(study, orphan, 1.0).__enter__()
    beat.__exit__()  # the worker dies: no more heartbeats, no tell
    time.sleep(2.5)  # past the 1 s grace

    class Done:
        def evaluate(self, trial):
            return TrialOutcome(TrialState.COMPLETE, [1.0])

    run_trials(study, Done(), 1)  # the next worker fails the stale trial first
    dead = study.get_trials()[0]
    assert dead.state == TrialState.FAIL
    assert dead.user_attrs["reason"].startswith("worker died: no heartbeat since "), dead.user_attrs
    assert study.get_trials()[1].state == TrialState.COMPLETE


# ---------------------------------------------------------------- issue 40.2: hints that work
def test_hints_name_the_storage_the_presets_and_a_folder(tmp_path):
    """After a PostgreSQL study the export hint carries --storage (without it: "no such study");
    an unknown --model name lists the presets; a folder given as a config or space says so."""
    import typer

    from engine.config.schema import load_config
    from engine.errors import ConfigError
    from tuning.space import SearchSpace
    from workbench.cli_sim import _model
    from workbench.cli_tune import export_command

    assert export_command("s1", "postgresql://u:secret@db:5432/t") == \
        "workbench export s1 --storage 'postgresql://u:***@db:5432/t'"
    assert export_command("s1", None) == "workbench export s1"
    with pytest.raises(typer.BadParameter, match=r"^--model: '7b' is not a preset; presets: 22b, 175b, 1t; or "):
        _model("7b")
    with pytest.raises(ConfigError, match=r"is a folder; give a run config YAML file in it"):
        load_config(tmp_path, [])
    with pytest.raises(ConfigError, match=r"is a folder; give a search space YAML file in it"):
        SearchSpace.from_yaml(tmp_path)
    out = cli("tune", str(tmp_path), "--trials", "1", home=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "is a folder" in out.stderr, out.stderr[-400:]
