"""The dashboard under Streamlit's AppTest: every page with an empty home, with finished runs and
studies, and with a run in progress; plus the plotting module and the UI job registry."""
from __future__ import annotations

import dataclasses
import json
import re
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
    """The title of every chart on the page: Plotly figures and Vega-Lite specs (the Run page's)."""
    out = []
    for chart in at.get("plotly_chart"):
        layout = json.loads(chart.proto.spec)["layout"]
        out.append(layout["title"]["text"])
    for chart in at.get("arrow_vega_lite_chart") + at.get("vega_lite_chart"):
        spec = json.loads(chart.proto.spec)
        if "title" in spec:  # st.bar_chart's (the Hardware page's cores) has none
            out.append(spec["title"]["text"])
    return out


def chart_messages(at) -> list[str]:
    """The messages of the charts drawn in place of a chart whose data have not come (Vega-Lite text marks)."""
    import pyarrow as pa

    out = []
    for chart in at.get("vega_lite_chart"):
        frame = pa.ipc.open_stream(chart.proto.data.data).read_all().to_pandas() if chart.proto.data.data else None
        if frame is not None and "message" in frame:
            out += list(frame["message"])
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
        assert {"Step-time breakdown per rank (latest step)", "Step-time breakdown over the run (mean of ranks)"} <= set(titles)
        assert {"Host utilisation (%)", "Host transfer rate (bytes/s)", "Host memory (GiB)"} <= set(titles)
    if page == "tune":
        assert titles[:3] == ["Optimisation history", "Parallel coordinates (tokens/s)",
                              "Parameter importances for tokens/s"]
        assert "Loss" in titles  # the drill-down into trial 0's run
        trials = at.dataframe[0].value
        assert len(trials) == 12 and {"state", "reason", "run_id"} <= set(trials.columns)
        assert set(trials["state"]) == {"COMPLETE", "PRUNED", "FAIL"}
    if page == "compare":
        assert {"Mean step-time breakdown by run", "Loss by run", "Throughput by run"} <= set(titles)
        side = at.dataframe[0].value
        assert all(len(v) <= 12 for v in side.loc["mean_tokens_per_s"])  # 40,983 not 40982.71359...
    if page == "export":
        buttons = at.get("download_button")
        labels = [b.proto.label for b in buttons]
        assert "DeepSpeed JSON" in labels and "YAML config" in labels
        assert {b.proto.icon for b in buttons} == {":material/download:"}
        assert any(i.value.startswith("this trial ran a stand-in (") for i in at.info)  # 2 CPU ranks
        # issue 52 item 7: every format `workbench export --format` takes, one button each, none failing
        # (old code: no torchtitan or accelerate button)
        from tuning.export.trial import FORMATS

        keys = {b.key for b in buttons}
        from workbench.app_pages.export import formats

        refused = {f for f, (label, _, _) in formats().items() if any(w.value.startswith(f"{label}: ") for w in at.warning)}
        assert {f"dl-{f}" for f in set(FORMATS) - refused} <= keys, sorted(keys)
        assert refused <= {"torchtitan"}, refused  # the tiny GPT is no registered torchtitan flavor: said in one line
        assert {"torchtitan", "accelerate"} <= set(FORMATS) and not at.error, [e.value for e in at.error]
    if page == "home":
        assert len(at.dataframe[0].value) == 2
        best = at.dataframe[1].value["best tokens/s"].iloc[0]  # old code: a float drawn as 4123 (no separator)
        assert re.fullmatch(r"\d{1,3}(,\d{3})+", best), best


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
    from workbench import live_charts, plots

    steps = pd.DataFrame({"step": [0, 1, 2], "loss": [3.0, 2.5, 2.0], "tokens_per_s": [10.0, 12.0, 11.0],
                          "mfu": [0.01, 0.02, 0.02]})
    table = pd.DataFrame({"step": [0, 0], "rank": [0, 1], "forward": [0.1, 0.1], "backward": [0.2, 0.3],
                          "total": [0.3, 0.4]})
    samples = pd.DataFrame({"time": [1.0, 2.0], "name": ["cpu(%)"] * 2, "value": [5.0, 6.0], "rank": [0, 0]})
    figs = [plots.fig_compare_curves(steps.assign(run="a"), "loss", "loss (nats/token)"),
            plots.fig_sim_memory({"params": 1.0}, 80.0)]
    for fig in figs:
        assert fig.layout.title.text
        assert fig.layout.yaxis.title.text and "(" in fig.layout.yaxis.title.text
    charts = [live_charts.loss(steps), live_charts.throughput(steps), live_charts.breakdown_ranks(table),
              live_charts.breakdown_steps(table),
              live_charts.busbw(pd.DataFrame({"op": ["all_reduce"], "size(B)": [1024.0], "busbw(GB/s)": [1.0]})),
              live_charts.timeline(samples, "Host CPU", "percent (%)"),
              live_charts.memory(pd.DataFrame({"rank": [0], "name": ["rss(GiB)"], "value": [1.0]}))]
    for chart in charts:
        layers = chart.spec.get("layer", [chart.spec])
        ys = [layer["encoding"]["y"]["title"] for layer in layers]
        assert chart.spec["title"]["text"] == chart.title and all("(" in y for y in ys), (chart.title, ys)
    stacked = live_charts.breakdown_ranks(table)
    assert list(stacked.data["phase"].unique()) == ["forward", "backward"]
    assert list(stacked.data[stacked.data["phase"] == "backward"]["seconds"]) == [0.2, 0.3]


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
    cfg, errors = parse_config("model: {d_model: 1000000000}\n")  # refused before Launch, like `workbench run`
    assert cfg is None and errors[0].field == "model.d_model" and "GiB" in errors[0].rule


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


# -- issue 15: what a new user trips over ---------------------------------------------------
EMOJI = re.compile("[\U0001F000-\U0001FAFF\u2600-\u27BF\u2B00-\u2BFF\uFE0F]")


def test_icons_are_material_symbols_not_emoji():
    """Emoji need an emoji font (boxes without one); Streamlit serves its Material Symbols font."""
    sources = [REPO / "app.py", *sorted((REPO / "workbench" / "app_pages").glob("*.py"))]
    found = {p.name: EMOJI.findall(p.read_text()) for p in sources}
    assert {k: v for k, v in found.items() if v} == {}
    assert ':material/' in (REPO / "app.py").read_text()


def test_launch_folds_the_form_and_the_picker_follows_the_new_run(tmp_path, monkeypatch):
    from workbench import ui_state

    store = RunStore.open_home(tmp_path)
    write_run(store, "old-0001", steps=3, ranks=2, status="completed")
    sleeper = subprocess.Popen(["sleep", "60"])

    def fake_launch(config, *, home=None):  # registers at once, as a fast launcher would
        time.sleep(0.05)
        run_id = f"{config['name']}-0002"
        write_run(store, run_id, steps=2, ranks=2, status="running")
        time.sleep(0.05)
        write_run(store, "shell-0003", steps=2, ranks=2, status="running")  # started from a shell meanwhile
        job = ui_state.Job(job_id="j-new", pid=sleeper.pid, name=config["name"], started=time.time() - 0.5,
                           config_path="", log_path=str(tmp_path / "log"), run_id=run_id)
        ui_state.save_jobs([job], home)
        return job

    monkeypatch.setattr(ui_state, "launch_run", fake_launch)
    try:
        at = render(tmp_path, "run", monkeypatch)
        assert at.expander[0].proto.expanded and at.selectbox(key="run_pick").value == "old-0001"
        [b for b in at.button if b.label == "Launch run"][0].click().run()
        assert not at.exception
        # the picker follows the run this session launched, not merely the newest run
        assert at.selectbox(key="run_pick").value == "tiny-0002"
        assert "new_run_open" in at.session_state and at.session_state["new_run_open"] is False  # folded
        assert "running" in {m.label: m.value for m in at.metric}["status"]
    finally:
        sleeper.kill()
        sleeper.wait()
        store.close()


def _figure(at, title_start: str) -> dict:
    for chart in at.get("plotly_chart"):
        spec = json.loads(chart.proto.spec)
        if spec["layout"]["title"]["text"].startswith(title_start):
            return spec
    raise AssertionError(f"no figure titled {title_start!r}: {chart_titles(at)}")


def test_few_complete_trials_say_so_instead_of_drawing_noise(tmp_path, monkeypatch):
    write_study(tmp_path, "few", trials=3)  # trials 0-2 complete
    at = render(tmp_path, "tune", monkeypatch)
    imp = _figure(at, "Parameter importances")
    assert imp.get("data", []) == [] and "needs at least 5 complete trials" in imp["layout"]["annotations"][0]["text"]
    history = _figure(at, "Optimisation history")["layout"]
    assert "only 3 complete trials" in history["annotations"][0]["text"]


def test_a_study_without_complete_trials_has_no_empty_axes(tmp_path, monkeypatch):
    import optuna

    from tuning.study import default_storage

    study = optuna.create_study(study_name="none-done", storage=default_storage(tmp_path), direction="maximize")
    dist = {"train.lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)}
    study.add_trials([optuna.trial.create_trial(params={"train.lr": 1e-3}, distributions=dist,
                                                state=optuna.trial.TrialState.FAIL) for _ in range(2)])
    at = render(tmp_path, "tune", monkeypatch)
    history = _figure(at, "Optimisation history")
    assert history.get("data", []) == [] and history["layout"]["xaxis"]["visible"] is False
    assert "no complete trial yet" in history["layout"]["annotations"][0]["text"]


def test_finished_tuning_workers_are_reaped(tmp_path):
    """A worker that ended is waited for: no <defunct> child, and it is not listed as running."""
    import psutil

    from tuning import control

    pids = control.start_workers("s", "params: {}\n", "name: x\n", n_trials=1, home=tmp_path,
                                 extra_args=["--no-such-option"])  # the CLI refuses it and exits
    proc = psutil.Process(pids[0])
    deadline = time.time() + 60
    while time.time() < deadline and proc.status() not in (psutil.STATUS_ZOMBIE,):
        time.sleep(0.2)
    assert control.running_workers("s", home=tmp_path) == []
    assert not psutil.pid_exists(pids[0]), "the finished worker stayed <defunct>"


def test_study_reader_follows_a_study_through_optunas_api(tmp_path):
    """Incremental refreshes (new, finished, enqueued trials) match Optuna's own full read."""
    import optuna

    from tuning.study import default_storage
    from workbench.app_pages.studies import StudyReader

    url = default_storage(tmp_path)
    study = write_study(tmp_path, "inc", trials=20)
    reader = StudyReader(url)

    def same() -> None:
        _, mine = reader.trials("inc")
        theirs = optuna.load_study(study_name="inc", storage=url).get_trials(deepcopy=False)
        assert [(t.number, t.state, t.values, t.params, t.user_attrs) for t in mine] == \
               [(t.number, t.state, t.values, t.params, t.user_attrs) for t in theirs]

    same()
    running = study.ask()
    running.suggest_float("train.lr", 1e-4, 1e-2, log=True)
    study.enqueue_trial({"train.lr": 1e-3})
    same()
    study.tell(running, 123.0)
    for _ in range(3):
        study.tell(study.ask(), 5.0)
    same()
    write_study(tmp_path, "other", trials=3)
    study.add_trials(optuna.load_study(study_name="other", storage=url).get_trials() * 30)  # a bulk add
    same()
    assert {s["study"] for s in reader.summaries()} == {"inc", "other"}
    source = (REPO / "workbench" / "app_pages" / "studies.py").read_text()
    assert "sqlite3" not in source and "trial_values" not in source  # no SQL on Optuna's schema


def test_store_chart_readers_match_the_full_reads(tmp_path):
    store = RunStore.open_home(tmp_path)
    write_run(store, "r-1", steps=120, ranks=2)
    steps = pd.DataFrame(store.latest_steps("r-1", n=10_000))
    frame = store.step_frame("r-1")
    pd.testing.assert_frame_equal(frame[sorted(frame.columns)], steps[sorted(steps.columns)], check_dtype=False)
    table = store.breakdown_table("r-1")
    mean = table.drop(columns=["rank"]).groupby("step", as_index=False).mean()
    pd.testing.assert_frame_equal(store.breakdown_steps("r-1", max_steps=None), mean, check_dtype=False)
    thinned = store.breakdown_steps("r-1", max_steps=50)
    assert len(thinned) <= 51 and thinned["step"].iloc[-1] == 119
    last = store.breakdown_ranks("r-1")
    assert list(last["rank"]) == [0, 1] and set(last["step"]) == {119}
    comm = store.comm_points("r-1", max_steps=None)
    assert len(comm) == 240 and (comm["size(B)"] > 0).all()
    host = store.series("r-1", "host", max_points=None)
    few = store.series("r-1", "host", max_points=30)
    for name, rows in few.groupby("name"):
        assert len(rows) <= 31 and rows["time"].max() == host[host["name"] == name]["time"].max()
    peaks = store.memory_peaks("r-1")
    assert set(peaks["name"]) == {"rss(GiB)", "params(GiB)"} and len(peaks) == 4
    store.close()


def test_simulator_report_compares_like_with_like_and_answers_first(tmp_path):
    from tuning.sim.hardware import load_cluster
    from tuning.search import best_configs, enumerate_configs, sensitivities
    from tuning.sim.simulator import ModelSpec
    from workbench import sim_report

    model = ModelSpec(layers=40, hidden=6144, heads=48, seq=2048, vocab=51200)
    df = enumerate_configs(model, load_cluster("frontier"), 64, 512)
    best, sens = best_configs(df, 10), sensitivities(df)
    figs = {f.layout.title.text: f for f in sim_report.sensitivity_figures(df, sens)}
    for name, table in sens.items():
        bars = next(f for t, f in figs.items() if t.startswith(f"Sensitivity: {name.replace('_', ' ')}"))
        # one bar per value of the knob, each the best config's time there: never a sum of configs
        assert list(bars.data[0].y) == list(table["iteration_time_s"])
        assert max(bars.data[0].y) < 5 * best["iteration_time_s"].iloc[0]
        assert bars.layout.uniformtext.mode == "hide"  # labels wider than their bar never overlap (was None)
    scatter = figs["Configurations that fit: TFLOP/s per GPU against memory per GPU"]
    assert not any(getattr(tr.marker, "showscale", False) for tr in scatter.data)  # legend, no colour bar
    text = sim_report.write_report(tmp_path / "r.html", df, best, sens, title="t").read_text()
    assert text.index("Fastest configuration that fits") < text.index("<table")
    main = text[:text.index("<h2>Details</h2>")]
    tables = [t.split("</table>")[0] for t in main.split('class="dataframe"')[1:]]
    assert len(tables) == 1 and tables[0].count("</th>") <= 12  # the key columns only


def test_history_ticks_fall_on_whole_trial_numbers():
    import pandas as pd

    from workbench.plots import fig_history

    two = fig_history(pd.DataFrame({"number": [0, 1], "state": ["COMPLETE"] * 2, "tokens/s": [1.0, 2.0]}),
                      "tokens/s", "throughput")
    assert two.layout.xaxis.dtick == 1  # plotly's auto ticks put a "0.5" between two trials
    many = fig_history(pd.DataFrame({"number": range(60), "state": ["COMPLETE"] * 60, "tokens/s": [1.0] * 60}),
                       "tokens/s", "throughput")
    assert many.layout.xaxis.tickformat == "d"


def test_collective_totals_are_read_once_per_run_version(tmp_path, monkeypatch):
    """The Run page's collectives table (a scan of the whole run) is cached like its other reads,
    but a live run that records more, or ends, is read again."""
    from workbench.app_pages import common

    store = RunStore.open_home(tmp_path)
    write_run(store, "live-0001", steps=3, ranks=2, status="running")
    reads: list[str] = []
    real = RunStore.comm_totals
    monkeypatch.setattr(RunStore, "comm_totals", lambda self, run_id: reads.append(run_id) or real(self, run_id))
    home = str(tmp_path)

    def table() -> pd.DataFrame:
        common.run_data.clear()  # the 1 s ttl cache of the other reads: as after a poll interval
        return common.collectives_table(home, "live-0001", common.run_version(common.run_data(home, "live-0001")))

    assert len(table()) and len(table()) and reads == ["live-0001"]
    store.finish_run("live-0001", "completed")
    table()
    assert reads == ["live-0001"] * 2


def test_tune_page_shows_predicted_vs_measured_order(tmp_path, monkeypatch):
    """Issue 38 item 5: a study whose trials recorded the simulator's prediction shows the order table."""
    import optuna

    from tuning.study import default_storage

    study = optuna.create_study(study_name="ordered", storage=default_storage(tmp_path), direction="maximize")
    dist = {"batch.micro": optuna.distributions.CategoricalDistribution([1, 2, 4, 8])}
    for micro in (1, 2, 4, 8):
        cfg = {"parallel": {"dp": 2}, "batch": {"global": 16, "micro": micro}}
        study.add_trial(optuna.trial.create_trial(
            params={"batch.micro": micro}, distributions=dist, value=80.0 * micro ** -0.3,
            user_attrs={"config": cfg, "predicted_tokens_per_s": 100.0 * micro ** 0.3,
                        "tokens_per_s": 80.0 * micro ** -0.3}))
    at = render(tmp_path, "tune", monkeypatch)
    assert any(s.value == "Predicted vs measured order" for s in at.subheader)
    assert any("pairs of finished trials ordered as measured: raw 0%" in c.value for c in at.caption)


def test_run_page_names_a_hugging_face_model(tmp_path, monkeypatch):
    """The Run page's header names the run's model.hf family and shape (issue 37)."""
    store = RunStore.open_home(tmp_path)
    hf = {"model_type": "mixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "num_local_experts": 4}
    store.create_run("mx-0001", name="mx", world_size=2, config={"name": "mx", "model": {"hf": hf, "seq_len": 16}},
                     layout={"dp": 2, "tp": 1, "pp": 1})
    store.finish_run("mx-0001", "completed")
    store.close()
    at = render(tmp_path, "run", monkeypatch)
    at.selectbox(key="run_pick").set_value("mx-0001").run()
    assert not at.exception
    assert any("mixtral (Hugging Face, inline config): 2 layers, hidden 32, 4/2 kv heads" in c.value
               for c in at.caption), [c.value for c in at.caption]


@pytest.mark.parametrize("opener", ["reader", "handle"])
def test_the_dashboard_opens_a_study_database_under_the_tuners_schema_lock(tmp_path, opener):
    """A dashboard reading a new studies.db while a worker created its tables crashed that worker
    ("UNIQUE constraint failed: alembic_version.version_num", busy CI): it waits for the workers' lock."""
    import threading

    import optuna

    from tuning.study import _schema_lock
    from workbench.app_pages import common
    from workbench.app_pages.studies import StudyReader

    url = f"sqlite:///{tmp_path}/studies.db"
    open_storage = StudyReader if opener == "reader" else common._optuna_storage.__wrapped__
    optuna.storages.RDBStorage(url)  # the tables exist: opening takes well under a second, lock aside
    opened = threading.Event()
    with _schema_lock(url):  # what a worker holds while Optuna creates the tables
        threading.Thread(target=lambda: (open_storage(url), opened.set()), daemon=True).start()
        assert not opened.wait(5), "the dashboard opened the database while a worker held the schema lock"
    assert opened.wait(60)


def test_live_run_chart_specs_do_not_change_with_their_data(tmp_path):
    """Issue 52 item 6: Streamlit swaps new data into a drawn Vega-Lite view only while its spec is the
    same; a spec that named the step (the old "Step-time breakdown per rank, step 29") redrew from blank."""
    import streamlit as st

    from workbench.app_pages.common import run_chart_list, run_data

    store = RunStore.open_home(tmp_path)
    write_run(store, "grow-1", steps=5, ranks=2, status="running")
    st.cache_data.clear()
    early = run_chart_list(run_data(str(tmp_path), "grow-1"))
    write_run(store, "grow-2", steps=40, ranks=2, status="running", seed=1)  # as grow-1 later: more steps
    later = run_chart_list(run_data(str(tmp_path), "grow-2"))
    assert [c.title for c in early] == [c.title for c in later] and len(early) >= 9
    assert [c.spec for c in early] == [c.spec for c in later]
    assert any(len(a.data) != len(b.data) for a, b in zip(early, later))
    for chart in later:  # every chart: a title, and each quantitative axis its unit
        assert chart.spec["title"]["text"] == chart.title
        axes = [enc for layer in chart.spec.get("layer", [chart.spec]) for enc in layer.get("encoding", {}).values()
                if isinstance(enc, dict) and enc.get("type") == "quantitative" and "title" in enc]
        assert all("(" in a["title"] or a["title"] == "step" for a in axes), (chart.title, axes)
    store.close()


def test_adaptive_sp_run_page_says_why_the_milp_was_skipped_and_why_measured_is_off(tmp_path, monkeypatch):
    """Issue 52 item 8: the plan table read "MILP skipped" and measured/predicted ~2x with no reason."""
    from profilers.records import Record

    store = RunStore.open_home(tmp_path)
    write_run(store, "asp-1", steps=3, ranks=2)
    recs = []
    for step in range(3):
        for name, value in (("predicted(s)", 0.5), ("measured(s)", 1.0 + 0.05 * step), ("groups", 2),
                            ("solver", 1), ("milp_vars", 0 if step else 24), ("token_cap", 512)):
            recs.append(Record("asp-1", 0, step, "flexsp", name, value, 0.0))
        recs += [Record("asp-1", 0, step, "flexsp_group", f"g0_{k}", v, 0.0)
                 for k, v in (("size", 2), ("first_rank", 0), ("sequences", 3), ("tokens", 900),
                              ("predicted(s)", 0.5), ("measured(s)", 1.0))]
    store.write(recs)
    store.close()
    at = render(tmp_path, "run", monkeypatch)
    notes = " ".join(i.value for i in at.info)
    # old code: no note at all (only "Measured over predicted, median of the steps: 2.1x")
    assert "MILP skipped at 2 of 3 steps" in notes and "within 5%" in notes and "lower bound" in notes
    assert "2.10x the prediction" in notes and "fitted once" in notes
    assert "Adaptive SP groups per step" in chart_titles(at)


def test_the_dashboard_does_not_watch_the_workbench_home():
    """Issue 52 item 7: Streamlit watched app.py's folder recursively, ./.workbench included ("Inotify
    queue overflowed", 8,267 lines): `streamlit run app.py` here and `workbench app` anywhere watch nothing."""
    code = ("from streamlit import config; config.get_config_options(force_reparse=True); "
            "print(config.get_option('server.fileWatcherType'))")
    shown = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert shown.stdout.split()[-1] == "none", shown.stdout + shown.stderr  # old code: auto
    from workbench.cli import app_command

    cmd = app_command("127.0.0.1", 8501)
    assert cmd[cmd.index("--server.fileWatcherType") + 1] == "none"


def test_hardware_page_lists_the_export_tools_and_draws_its_facts_without_torch(tmp_path, monkeypatch):
    """Issue 52 item 7: the Hardware page spun ~6 s (importing torch.distributed before drawing anything)
    and its versions omitted transformers, accelerate and torchtitan."""
    at = render(tmp_path, "hardware", monkeypatch)
    versions = next(d.value for d in at.dataframe if "version" in d.value.columns)
    # old code: only the runs' KEY_PACKAGES (torch, numpy, ..., pyyaml)
    assert {"transformers", "accelerate", "torchtitan", "deepspeed", "megatron-core"} <= set(versions.index)
    assert "Distributed backends: gloo: yes" in " ".join(c.value for c in at.caption)
    code = ("import sys; from workbench.app_pages.common import machine_facts; f = machine_facts(); "
            "print('torch' in sys.modules, f['host']['versions']['transformers'] is not None)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr  # every fact but the backends: no torch


def _study_with_a_skipped_draw(home: Path) -> None:
    """write_study's 12 trials (complete, pruned, failed) plus a draw the tuner skipped (told PRUNED)."""
    import optuna

    from tuning.objective import SKIPPED_ATTR

    study = write_study(home, "sk", trials=12)
    skipped = optuna.trial.create_trial(state=optuna.trial.TrialState.PRUNED, params={}, distributions={},
                                        user_attrs={SKIPPED_ATTR: True, "reason": "repeat of trial 3's config "
                                                    + "(batch.micro=4, comm.compressor=none) " * 4})
    study.add_trial(skipped)


def test_skipped_draws_are_not_counted_as_pruned_and_reasons_read_whole(tmp_path, monkeypatch):
    """Issue 52 item 7: the Overview counted skipped draws as pruned; the Tune table cut reasons off."""
    _study_with_a_skipped_draw(tmp_path)
    at = render(tmp_path, "home", monkeypatch)
    row = at.dataframe[-1].value.iloc[0]
    assert row["pruned"] == 2, row.to_dict()  # old code: 3, the skipped draw among them
    assert (row["skipped"], row["trials"]) == (1, 12), row.to_dict()
    at = render(tmp_path, "tune", monkeypatch)
    metrics = {m.label: m.value for m in at.metric}
    assert (metrics["pruned"], metrics["skipped"]) == ("2", "1"), metrics
    whole = at.table[0].value
    assert any(r.endswith("comm.compressor=none) ") for r in whole["reason"]) and "SKIPPED" in set(whole["state"])


def test_a_pruned_trials_run_says_pruned_not_failed(tmp_path, monkeypatch):
    """Issue 52 item 7: a pruned trial's run read "Run failed"."""
    store = RunStore.open_home(tmp_path)
    write_run(store, "trial-0007", steps=5, ranks=1, status="running")
    store.finish_run("trial-0007", "pruned", error="pruned by the tuner at step 4")
    store.close()
    at = render(tmp_path, "run", monkeypatch)
    assert not [e.value for e in at.error if "failed" in e.value]  # old code: "Run failed: pruned by ..."
    assert any(w.value == "Pruned by the tuner: pruned by the tuner at step 4" for w in at.warning)


def test_the_tune_page_says_what_its_workers_do():
    """Issue 52 item 7: "workers running: none · active" read as if something were running."""
    from workbench.ui_state import workers_line

    assert workers_line([], False).startswith("No worker is running for this study")
    assert workers_line([11, 12], False).startswith("2 workers (pid 11, 12) running")
    assert workers_line([11], True).startswith("Paused: 1 worker (pid 11) finish")
    assert workers_line([], True).startswith("Paused, and no worker is running")


def test_identical_compare_curves_are_told_apart():
    """Issue 52 item 7: two identical loss curves (a seeded repeat) drew as one line in Compare."""
    from workbench import plots

    steps = pd.DataFrame({"step": [0, 1, 2], "loss": [3.0, 2.5, 2.0]})
    curves = pd.concat([steps.assign(run="a"), steps.assign(run="b"),
                        steps.assign(run="c", loss=[3.0, 2.4, 2.1])], ignore_index=True)
    fig = plots.fig_compare_curves(curves, "loss", "loss (nats/token)")
    names = [t.name for t in fig.data]
    assert names == ["a", "b (identical to a)", "c"], names  # old code: ["a", "b", "c"], b hidden under a
    assert fig.data[1].line.dash == "dash" and fig.data[0].line.dash is None


SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
           "num_hidden_layers": 30, "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192,
           "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "hidden_act": "silu"}


def test_whatif_prices_a_config_json_on_this_homes_calibrated_profile(tmp_path, monkeypatch):
    """Issue 52 item 7: What-if priced only GPT presets on preset clusters; it takes a Hugging Face
    config.json (upload or path) and lists the home's calibrated profiles (<home>/hardware/, first)."""
    from tuning.sim.hardware import cpu_profile, save_cluster
    from tuning.sim.simulator import ModelSpec, ParallelSpec, simulate

    profile = cpu_profile(name="cpu-local-2", gemm_points=[(1e6, 2e10), (1e9, 5e10)], intra=(2e-5, 1.0),
                          gpus_per_node=2, memory_gb=24.0)
    save_cluster(profile, tmp_path / "hardware" / "cpu-local-2.yaml")
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    at = render(tmp_path, "whatif", monkeypatch)
    assert at.selectbox[0].value.startswith("cpu-local-2 (profile:")  # old code: only the presets
    at.radio(key="whatif_kind").set_value("Hugging Face config.json").run()
    at.text_input(key="whatif_hf_path").set_value(str(tmp_path / "config.json")).run()
    assert at.number_input[0].value == 2 and at.number_input[0].max == 2  # the profile's 2 measured ranks
    assert not at.exception and not at.error, [e.value for e in at.error]
    model = ModelSpec.from_hf(SMOLLM2, seq=2048)
    caption = " ".join(c.value for c in at.caption)
    assert f"llama (config.json) ({model.params / 1e6:.0f}M parameters) on 2 GPUs of cpu-local-2" in caption
    metrics = {m.label: m.value for m in at.metric}  # the sliders' defaults: tp 1 (2 divides no 9 heads), pp 1
    par = ParallelSpec(dp=2, tp=1, pp=1, micro=1, global_batch=512, zero=1, recompute="selective",
                       framework="megatron-core", flash_attention=True)
    assert metrics["iteration (s)"] == f"{simulate(model, profile, par).iteration_time_s:.3f}"
    next(b for b in at.button if b.label == "Search").click().run()  # every configuration of it, on that profile
    assert not at.exception and any("valid configurations" in m.value for m in at.markdown), [m.value for m in at.markdown]


def test_a_live_runs_per_rank_breakdown_draws_the_last_step_every_rank_reported(tmp_path):
    """Seen in the live-charts screenshot: the newest step had only rank 1's report, so the chart drew one bar."""
    import streamlit as st

    from profilers.records import Record
    from workbench.app_pages.common import run_data

    store = RunStore.open_home(tmp_path)
    write_run(store, "part-1", steps=3, ranks=2, status="running")
    store.write([Record("part-1", 1, 3, "breakdown", "forward(s)", 0.03, 0.0)])  # step 3: rank 1 only, so far
    store.close()
    st.cache_data.clear()
    last = run_data(str(tmp_path), "part-1")["breakdown_ranks"]
    assert list(last["rank"]) == [0, 1] and set(last["step"]) == {2}


def test_run_charts_name_every_legend_and_axis_with_a_unit_and_draw_mfu_only_with_a_peak(tmp_path):
    """Issue 64 item 3: legends read raw keys (estimate_activations(GiB), cpu(%) r0, comm_exposed), bandwidth
    raw GB/s, and a CPU run (no peak FLOP/s, no MFU recorded) drew an empty MFU axis."""
    import streamlit as st

    from profilers.records import Record
    from workbench.app_pages.common import run_chart_list, run_data

    store = RunStore.open_home(tmp_path)
    write_run(store, "cpu-1", steps=12, ranks=2)
    store.write([Record("cpu-1", r, 0, "memory", "estimate_activations(GiB)", 0.1, 0.0) for r in (0, 1)])
    store.close()
    import sqlite3

    with sqlite3.connect(tmp_path / "runs.db") as db:  # a CPU run records no MFU (engine.device.peak_flops is None)
        db.execute("DELETE FROM metrics WHERE name = 'mfu'")
    st.cache_data.clear()
    charts = {c.title: c for c in run_chart_list(run_data(str(tmp_path), "cpu-1"))}
    raw = re.compile(r"[a-z]_[a-z]|[A-Za-z]\((GiB|B/s|GB/s|%|s)\)")
    for chart in charts.values():
        layers = chart.spec.get("layer", [chart.spec])
        axes = [enc for layer in layers for enc in layer.get("encoding", {}).values() if isinstance(enc, dict)]
        titles = [a["title"] for a in axes if a.get("title")]
        legends = [str(v) for col in ("series", "name", "phase", "op") if col in chart.data
                   for v in chart.data[col].unique()]
        assert not [t for t in titles + legends if raw.search(t)], (chart.title, titles, legends)
        assert not any("MFU" in t for t in titles + legends + [chart.title]), chart.title
    assert "Throughput" in charts and "Throughput and MFU" not in charts
    memory = set(charts["Memory per rank (peak)"].data["name"])
    assert "activations, estimated (GiB)" in memory and "resident memory (GiB)" in memory
    rate = charts["Host transfer rate (bytes/s)"].spec["encoding"]["y"]
    assert rate["title"] == "transfer rate (bytes/s)" and "MB/s" in rate["axis"]["labelExpr"]
    bus = charts["Collective bus bandwidth by message size"]
    bus_y = bus.spec["encoding"]["y"]
    assert bus_y["title"] == "bus bandwidth (bytes/s)" and "GB/s" in bus_y["axis"]["labelExpr"]
    assert set(bus.data["op"]) == {"all-reduce"} and bus.data["busbw"].max() > 1e8  # bytes/s, not GB/s
    with_peak = run_chart_list(run_data(str(tmp_path), "cpu-1") | {"steps": pd.DataFrame(
        {"step": [0, 1], "ranks": [2, 2], "tokens_per_s": [10.0, 11.0], "mfu": [0.3, 0.31]})})
    assert with_peak[1].title == "Throughput and MFU"


def test_whatif_opens_on_a_named_preset_inside_the_validated_domain_with_a_fused_attention_control(tmp_path,
                                                                                                  monkeypatch):
    """Issue 65 item 4: What-if opened on Frontier with an 18B GPT, extrapolated (a 16x-wide interval, model
    sizes as 11-13 digit counts), and had no fused-attention control; its labels were bare keys (tp, pp, ZeRO)."""
    from tuning.sim.hardware import load_cluster
    from tuning.sim.simulator import ModelSpec, ParallelSpec, simulate

    at = render(tmp_path, "whatif", monkeypatch)
    assert at.selectbox[0].value == "dgx-h100"  # old code: frontier, GPT 18B
    assert at.selectbox(key="whatif_model").value == "Llama-3.1-8B (8.0B parameters)"
    shown = " ".join([c.value for c in at.caption] + [w.value for w in at.warning])
    assert "Inside the validated domain" in shown and not re.search(r"\d{1,3}(,\d{3}){3,}", shown), shown
    lo, hi = (float(x) for x in re.search(r"likely ([\d.]+)-([\d.]+) s", shown).groups())
    assert hi / lo < 1.5, (lo, hi)  # old code: 4.89-80.9 s
    llama = ModelSpec.from_hf(json.loads((REPO / "examples/llama3_8b/config.json").read_text()), seq=2048)
    par = ParallelSpec(dp=32, tp=2, pp=1, micro=1, global_batch=512, zero=1, recompute="selective",
                       framework="megatron-core", flash_attention=True)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["iteration (s)"] == f"{simulate(llama, load_cluster('dgx-h100'), par).iteration_time_s:.3f}"
    at.checkbox(key="whatif_flash").uncheck().run()  # the fused-attention control reaches the simulator
    unfused = simulate(llama, load_cluster("dgx-h100"), dataclasses.replace(par, flash_attention=False))
    assert {m.label: m.value for m in at.metric}["iteration (s)"] == f"{unfused.iteration_time_s:.3f}"
    labels = [w.label for w in [*at.get("select_slider"), *at.selectbox, *at.number_input]]
    names = ("framework", "cp implementation", "activation recompute")  # choices, not quantities
    assert all("(" in label or label in names for label in labels), labels


def test_hardware_page_names_every_fact_with_its_unit(tmp_path, monkeypatch):
    """Issue 65 item 4: the Hardware page showed recorded keys (memory_total(GiB), cpu_count) as labels."""
    at = render(tmp_path, "hardware", monkeypatch)
    facts = next(d.value for d in at.dataframe if "value" in d.value.columns)
    assert "memory total (GiB)" in facts.index and "CPU cores (logical)" in facts.index, list(facts.index)
    raw = re.compile(r"[a-z]_[a-z]|[A-Za-z]\((GiB|MiB|B/s|%|W|C|MHz)\)")
    labels = [str(x) for d in at.dataframe if "version" not in d.value.columns
              for x in [*d.value.index, *d.value.columns] if not isinstance(x, int)] + [m.label for m in at.metric]
    assert not [x for x in labels if raw.search(x)], labels


def test_the_tune_page_shows_the_last_trials_finished_once_its_workers_end(tmp_path, monkeypatch):
    """The Tune page polls while its workers run; when they end it redraws once and stops polling. That
    last drawing read the trial table cached (2 s) while the last trial still ran, so the page stayed at
    'running 1' for good (the browser test's 3-trial study, on a loaded host: CI of d9e20bc, here beside
    six busy loops)."""
    import optuna

    from tuning import control
    from tuning.study import default_storage

    study = optuna.create_study(study_name="ending", storage=default_storage(tmp_path), direction="maximize")
    trial = study.ask({"train.lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)})
    workers = [4242]
    monkeypatch.setattr(control, "running_workers", lambda name, home=None: list(workers))
    at = render(tmp_path, "tune", monkeypatch)
    running = {m.label: m.value for m in at.metric}
    assert (running["complete"], running["running"]) == ("0", "1"), running
    study.tell(trial, 100.0)  # the worker finishes its last trial and exits
    workers.clear()
    at.run()  # what the polling fragment's rerun draws once it finds no worker
    assert not at.exception, [e.value for e in at.exception]
    done = {m.label: m.value for m in at.metric}
    assert (done["complete"], done["running"]) == ("1", "0"), done
