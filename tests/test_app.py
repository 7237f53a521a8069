"""The dashboard under Streamlit's AppTest: every page with an empty home, with finished runs and
studies, and with a run in progress; plus the plotting module and the UI job registry."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.dashboard import write_run, write_study  # noqa: E402
from profilers.store import RunStore  # noqa: E402

pytestmark = pytest.mark.xdist_group("dashboard")
PAGES = ["home", "hardware", "run", "tune", "whatif", "compare", "export"]
TITLES = {"home": "Workbench overview", "hardware": "Hardware", "run": "Run", "tune": "Tune",
          "whatif": "What-if", "compare": "Compare", "export": "Export"}


def render(home: Path, page: str, monkeypatch: pytest.MonkeyPatch, setup=None):
    """Run one page of app.py with WORKBENCH_HOME=home; returns the AppTest after the run."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("WORKBENCH_HOME", str(home))
    st.cache_data.clear()
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=60)
    at.switch_page(f"workbench/app_pages/{page}.py")
    if setup is not None:
        setup(at)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert [t.value for t in at.title] == [TITLES[page]]
    return at


def chart_titles(at) -> list[str]:
    out = []
    for chart in at.get("plotly_chart"):
        layout = json.loads(chart.proto.spec)["layout"]
        out.append(layout["title"]["text"])
    return out


@pytest.fixture(scope="module")
def finished_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("finished")
    store = RunStore.open_home(home)
    write_run(store, "done-0001", steps=30, ranks=2)
    write_run(store, "broken-0002", steps=5, ranks=2, status="failed", emulated=True)
    write_study(home, "s1", trials=12, run_ids=["done-0001"])
    write_study(home, "mo", trials=8, multi=True)
    store.close()
    return home


@pytest.fixture(scope="module")
def running_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("running")
    store = RunStore.open_home(home)
    write_run(store, "live-0001", steps=7, ranks=2, status="running")
    store.add_segment("live-0001", start_step=0, end_step=3, trial_number=0, params={"comm.density": 0.1})
    store.add_segment("live-0001", start_step=4, trial_number=1, params={"comm.density": 0.01})
    store.close()
    return home


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_with_an_empty_home(page, tmp_path, monkeypatch):
    at = render(tmp_path, page, monkeypatch)
    if page in ("run", "compare"):
        assert any("No runs yet" in i.value for i in at.info)
    if page == "tune":
        assert any("No studies yet" in i.value for i in at.info)


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_with_finished_runs_and_studies(page, finished_home, monkeypatch):
    at = render(finished_home, page, monkeypatch)
    if page == "run":
        at.selectbox(key="run_pick").set_value("done-0001").run()
        assert not at.exception
    titles = chart_titles(at)
    assert all(titles), "every figure has a title"
    if page == "run":
        assert {"Loss", "Throughput and MFU", "Collective bus bandwidth by message size",
                "Memory per rank (peak)"} <= set(titles)
        assert any(t.startswith("Step-time breakdown per rank, step 29") for t in titles)
        assert any(t.startswith("Host timeline (%)") for t in titles)
    if page == "tune":
        assert titles[:3] == ["Optimisation history", "Parallel coordinates (tokens/s)",
                              "Parameter importances for tokens/s"]
        assert "Loss" in titles  # the drill-down into trial 0's run
        trials = at.dataframe[0].value
        assert len(trials) == 12 and {"state", "reason", "run_id"} <= set(trials.columns)
        assert set(trials["state"]) == {"COMPLETE", "PRUNED", "FAIL"}
    if page == "compare":
        assert "Mean step-time breakdown by run" in titles and "loss by run" in titles
    if page == "export":
        buttons = at.get("download_button")
        labels = [b.proto.label for b in buttons]
        assert len(labels) == 7 and "DeepSpeed JSON" in labels and "YAML config" in labels
        assert {b.proto.icon for b in buttons} == {":material/download:"}
    if page == "home":
        assert len(at.dataframe[0].value) == 2


def test_failed_emulated_run_shows_its_error_and_badge(finished_home, monkeypatch):
    at = render(finished_home, "run", monkeypatch)
    at.selectbox(key="run_pick").set_value("broken-0002").run()
    assert not at.exception
    assert any("rank 1" in e.value and "synthetic error" in e.value for e in at.error)
    assert any("Emulated link" in w.value for w in at.warning)


def test_multi_objective_study_draws_a_pareto_front(finished_home, monkeypatch):
    at = render(finished_home, "tune", monkeypatch)
    at.selectbox[0].set_value("mo").run()
    assert not at.exception
    assert "Pareto front" in chart_titles(at)
    assert "val_loss" in at.dataframe[0].value.columns


def test_run_in_progress_renders_partial_steps_and_segments(running_home, monkeypatch):
    at = render(running_home, "run", monkeypatch)
    metrics = {m.label: m.value for m in at.metric}
    assert "running" in metrics["status"] and metrics["step"] == "6"
    titles = chart_titles(at)
    assert "Live tuning: segments over the run" in titles and "Loss" in titles
    assert any(b.label == "Stop run" for b in at.button) or any(
        "Started outside this dashboard" in c.value for c in at.caption)


def test_invalid_yaml_config_shows_inline_errors_and_disables_launch(tmp_path, monkeypatch):
    at = render(tmp_path, "run", monkeypatch)
    at.radio(key="edit_mode").set_value("YAML").run()
    at.text_area(key="yaml_text").set_value(
        "model: {layers: 2, d_model: 32, heads: 3}\nparallel: {dp: 2}\nbatch: {global: 8, micro: 4}\n").run()
    assert not at.exception
    assert any("heads" in e.value for e in at.error)
    launch = [b for b in at.button if b.label == "Launch run"][0]
    assert launch.disabled
    at.text_area(key="yaml_text").set_value("model: {layers: 2, d_model: 32, heads: 2}\n").run()
    assert not at.error and not [b for b in at.button if b.label == "Launch run"][0].disabled


def test_every_figure_has_a_title_and_axis_units():
    from workbench import plots

    steps = pd.DataFrame({"step": [0, 1, 2], "loss": [3.0, 2.5, 2.0], "tokens_per_s": [10.0, 12.0, 11.0],
                          "mfu": [0.01, 0.02, 0.02]})
    table = pd.DataFrame({"step": [0, 0], "rank": [0, 1], "forward": [0.1, 0.1], "backward": [0.2, 0.3],
                          "total": [0.3, 0.4]})
    samples = pd.DataFrame({"time": [1.0, 2.0], "name": ["cpu(%)"] * 2, "value": [5.0, 6.0], "rank": [0, 0]})
    figs = [plots.fig_loss(steps), plots.fig_throughput(steps), plots.fig_breakdown_ranks(table, 0),
            plots.fig_breakdown_steps(table),
            plots.fig_busbw(pd.DataFrame({"op": ["all_reduce"], "size(B)": [1024.0], "busbw(GB/s)": [1.0]})),
            plots.fig_timeline(samples, "Host CPU", "percent (%)"),
            plots.fig_memory(pd.DataFrame({"rank": [0], "name": ["rss(GiB)"], "value": [1.0]})),
            plots.fig_compare_curves(steps.assign(run="a"), "loss", "loss (nats/token)"),
            plots.fig_sim_memory({"params": 1.0}, 80.0)]
    for fig in figs:
        assert fig.layout.title.text
        assert fig.layout.yaxis.title.text and "(" in fig.layout.yaxis.title.text
    stacked = plots.fig_breakdown_ranks(table, 0)
    assert [tr.name for tr in stacked.data] == ["forward", "backward"]
    assert list(stacked.data[1].y) == [0.2, 0.3]


def test_thin_keeps_first_and_last_rows():
    from workbench.plots import thin

    df = pd.DataFrame({"x": range(10_001)})
    out = thin(df, 1000)
    assert len(out) <= 1001 and out["x"].iloc[0] == 0 and out["x"].iloc[-1] == 10_000


def test_parse_config_lists_every_error_with_its_field():
    from workbench.ui_state import parse_config

    cfg, errors = parse_config("model: {layers: 2}\ntrain: {steps: 3}\n")
    assert errors == [] and cfg["train"]["steps"] == 3
    cfg, errors = parse_config("model: {layerz: 2}\n")
    assert cfg is None and "layers" in errors[0].rule
    cfg, errors = parse_config("model: [1\n")
    assert cfg is None and "YAML" in errors[0].rule


def test_stop_job_ends_the_launcher_and_its_process_tree(tmp_path):
    from workbench import ui_state

    script = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    ui_state._CHILDREN[proc.pid] = proc
    job = ui_state.Job(job_id="j1", pid=proc.pid, name="x", started=time.time(), config_path="", log_path="")
    ui_state.save_jobs([job], tmp_path)
    time.sleep(0.5)
    import psutil

    children = psutil.Process(proc.pid).children(recursive=True)
    assert ui_state.running_jobs(tmp_path) == [job]
    assert ui_state.stop_job(job, grace_s=2.0)
    assert proc.poll() is not None and ui_state.running_jobs(tmp_path) == []
    for child in children:
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
