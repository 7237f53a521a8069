"""The Run page while a launch starts: "Starting…" alone, honest placeholders before the first step,
a study's Pause off once it ended, no Deploy button."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.dashboard import write_run  # noqa: E402
from profilers.store import RunStore  # noqa: E402
from tests.test_app import chart_messages, chart_titles, render  # noqa: E402

pytestmark = pytest.mark.xdist_group("dashboard")


def test_starting_shows_no_chart_of_the_previous_run(tmp_path, monkeypatch):
    # old code: the previous run's charts stayed under "Starting…" ('Loss', 'Throughput and MFU', ...)
    from workbench import ui_state

    store = RunStore.open_home(tmp_path)
    write_run(store, "old-0001", steps=3, ranks=2, status="completed")
    sleeper = subprocess.Popen(["sleep", "60"])
    job = ui_state.Job(job_id="j-new", pid=sleeper.pid, name="tiny", started=time.time(), config_path="",
                       log_path=str(tmp_path / "log"), run_id=None)
    ui_state.save_jobs([job], tmp_path)
    try:
        at = render(tmp_path, "run", monkeypatch, setup=lambda a: a.session_state.__setitem__("run_job", "j-new"))
        assert any("Starting" in i.value for i in at.info)
        assert chart_titles(at) == [] and not at.metric
    finally:
        sleeper.kill()
        sleeper.wait()
        store.close()


def test_before_the_first_step_the_breakdown_waits_instead_of_blaming_the_config(tmp_path, monkeypatch):
    # old code: "no breakdown records yet (profile.enabled must be true)" on a run with profiling on
    store = RunStore.open_home(tmp_path)
    store.create_run("new-0001", name="new", config={"profile": {"enabled": True}}, world_size=2,
                     layout={"dp": 2, "tp": 1, "pp": 1, "world_size": 2})
    store.close()
    at = render(tmp_path, "run", monkeypatch)
    texts = json.dumps(chart_messages(at))
    assert "profile.enabled must be true" not in texts and "waiting for the first step" in texts


def test_pause_is_off_once_no_worker_runs(tmp_path, monkeypatch):
    from bench.dashboard import write_study

    write_study(tmp_path, "s1", trials=6)
    at = render(tmp_path, "tune", monkeypatch)
    pause = [b for b in at.button if b.label == "Pause"]
    assert pause and pause[0].disabled  # old code: enabled after the study ended


def test_the_dashboard_hides_streamlits_deploy_button():
    config = tomllib.loads((REPO / ".streamlit" / "config.toml").read_text())
    assert config["client"]["toolbarMode"] == "minimal"
    from workbench.cli import app_command

    cmd = app_command("127.0.0.1", 8501)
    assert cmd[cmd.index("--client.toolbarMode") + 1] == "minimal"


def test_the_run_page_never_reads_a_whole_run(tmp_path, monkeypatch):
    # old code: the adaptive-SP panel read every record of the run on each render (0.5 s of the
    # page's 1.1 s CPU at 100k records, bench/dashboard.py); reads are by kind now
    store = RunStore.open_home(tmp_path)
    write_run(store, "done-0001", steps=5, ranks=2)
    store.close()
    calls: list[str | None] = []
    real = RunStore.metrics

    def spy(self, run_id, kind=None, *args, **kwargs):
        calls.append(kind)
        return real(self, run_id, kind, *args, **kwargs)

    monkeypatch.setattr(RunStore, "metrics", spy)
    render(tmp_path, "run", monkeypatch)
    assert calls and None not in calls, calls
