"""Run: edit a config (form or YAML), launch it in the background, watch it live, stop it."""
from __future__ import annotations

import time
from typing import Any

import streamlit as st
import yaml

from engine.mesh import world_size
from engine.config.validate import COMPRESSORS
from workbench import fmt, live_charts, report, ui_state
from workbench.app_pages import common

FORM_KEY = "new_run_open"
FOLDED_FOR = "new_run_folded_for"  # the live run the form last folded away for
FOLLOW_S = 60.0  # the picker gives up following a launched run not listed after this long
LIVE_KEY = "run_live"
# a polled panel's elements are marked stale while the fragment reruns, and Streamlit fades stale elements
# (a live run's charts dimmed on every poll): the live panel keeps full opacity, its data arrive in place
NO_DIM = (f"<style>.st-key-{LIVE_KEY} [data-stale='true'] {{opacity: 1 !important; transition: none !important;}}"
          "</style>")


def form_config() -> dict[str, Any]:
    """The key fields of a run config as widgets; returns the nested config dict."""
    c = st.columns(4)
    name = c[0].text_input("Name", "tiny")
    layers = c[1].number_input("Layers", 1, 96, 2)
    d_model = c[2].number_input("d_model", 8, 8192, 32, step=8)
    heads = c[3].number_input("Heads", 1, 128, 2)
    c = st.columns(4)
    seq_len = c[0].number_input("Sequence length", 8, 8192, 32, step=8)
    dp = c[1].number_input("dp", 1, 64, 2)
    tp = c[2].number_input("tp", 1, 64, 1)
    pp = c[3].number_input("pp", 1, 64, 1)
    c = st.columns(4)
    global_batch = c[0].number_input("Global batch", 1, 65536, 8)
    micro = c[1].number_input("Micro batch", 1, 4096, 4)
    steps = c[2].number_input("Steps", 1, 1_000_000, 15)
    lr = c[3].number_input("Learning rate", 1e-6, 1.0, 3e-3, format="%.4g")
    c = st.columns(4)
    compressor = c[0].selectbox("Compressor", list(COMPRESSORS))
    gbps = c[1].number_input("Emulated link (Gbit/s, 0 = real)", 0.0, 10_000.0, 0.0)
    latency = c[2].number_input("Emulated latency (µs)", 0.0, 100_000.0, 0.0)
    zero = c[3].selectbox("ZeRO stage", [0, 1, 2, 3])
    return {"name": name, "model": {"layers": layers, "d_model": d_model, "heads": heads,
                                    "seq_len": seq_len, "vocab": 256},
            "data": {"source": "text"},
            "parallel": {"dp": dp, "tp": tp, "pp": pp, "zero": zero},
            "batch": {"global": global_batch, "micro": micro},
            "train": {"steps": steps, "lr": float(lr)},
            "comm": {"compressor": compressor},
            "link": {"gbps": float(gbps), "latency_us": float(latency)}}


def editor() -> str:
    """The config as YAML: from the form, or edited / uploaded by hand."""
    mode = st.radio("Edit with", ["Form", "YAML"], horizontal=True, key="edit_mode")
    if mode == "Form":
        text = yaml.safe_dump(form_config(), sort_keys=False)
        with st.expander("YAML of this form"):
            st.code(text, language="yaml")
        return text
    upload = st.file_uploader("Upload a YAML config", type=["yaml", "yml"])
    if upload is not None:
        st.session_state["yaml_text"] = upload.getvalue().decode()
    if "yaml_text" not in st.session_state:
        st.session_state["yaml_text"] = (ui_state.REPO_ROOT / "examples" / "tiny.yaml").read_text()
    return st.text_area("Run config (YAML)", key="yaml_text", height=260)


def launch(config: dict[str, Any]) -> None:
    """Launch button callback: start the run, fold the form away, make the picker follow it."""
    job = ui_state.launch_run(config, home=common.home())
    st.session_state["run_job"] = job.job_id
    st.session_state[FORM_KEY] = False  # fold the form: the live charts come into view
    st.toast(f"Launched {job.name} (pid {job.pid})", icon=":material/rocket_launch:")


def launch_panel() -> None:
    """Editor, inline validation errors and the Launch button."""
    text = editor()
    config, errors = ui_state.parse_config(text)
    for err in errors:
        st.error(f"**{err.field}** = `{err.value!r}`: {err.rule}")
    if config is not None:
        par = config["parallel"]
        world = world_size(dp=par["dp"], tp=par["tp"], pp=par["pp"], cp=par.get("cp", 1))
        st.caption(f"valid · {world} rank(s) · {config['train']['steps']} steps")
    st.button("Launch run", type="primary", disabled=config is None, icon=":material/rocket_launch:",
              on_click=launch, args=(config,))


def launched_job() -> ui_state.Job | None:
    """This session's latest launch, while the picker has not moved to its run yet."""
    job_id = st.session_state.get("run_job")
    return next((j for j in ui_state.load_jobs(common.home()) if j.job_id == job_id), None) if job_id else None


def follow_launched(run_ids: list[str]) -> None:
    """Point the Run picker at the run just launched once it is listed (then leave the picker alone)."""
    job = launched_job()
    if job is None:
        return
    run_id = ui_state.resolve_run_id(job, common.store(), common.home())
    if run_id in run_ids:
        st.session_state["run_pick"] = run_id
    if run_id in run_ids or (run_id is not None and time.time() - job.started > FOLLOW_S):
        st.session_state.pop("run_job", None)


def pending_panel() -> None:
    """Polls until the launched run registers, then reruns the page to show it."""
    job = launched_job()
    if job is None:
        return
    if ui_state.resolve_run_id(job, common.store(), common.home()) is not None:
        common.runs_table.clear()
        st.rerun(scope="app")  # the page picks the new run (follow_launched)
    if ui_state.is_alive(job.pid):
        st.info(f"Starting `{job.name}` (pid {job.pid})…", icon=":material/hourglass_top:")
    else:
        st.session_state.pop("run_job", None)
        log = open(job.log_path, errors="replace").read()[-3000:]
        st.error(f"The launcher exited before registering a run:\n\n```\n{log}\n```")


def stop_button(run: dict[str, Any]) -> None:
    if run["status"] != "running":
        return
    job = ui_state.job_for_run(run["run_id"], common.store(), common.home())
    if job is None:
        st.caption("Started outside this dashboard: stop it where it runs (Ctrl-C).")
        return
    if st.button("Stop run", type="secondary", key=f"stop-{run['run_id']}", icon=":material/stop_circle:"):
        with st.spinner("Stopping every rank…"):
            ui_state.stop_job(job, store=common.store())
        common.run_data.clear()
        common.runs_table.clear()
        st.rerun()


def live_panel(run_id: str, shown_status: str) -> None:
    """Header, headline figures and every chart of the run; polled while it runs. Once the run
    has ended, the whole page reruns (until the picker, ``shown_status``, agrees) to stop polling."""
    home = str(common.home())
    data = common.run_data(home, run_id)
    run = data["run"]
    if run is None:
        st.warning(f"Run `{run_id}` disappeared from the store.")
        return
    live = run["status"] == "running"
    # containers keep the element count fixed when optional parts come and go between polls
    with st.container():
        common.run_header(run)
    with st.container():
        stop_button(run)
    common.headline(data)
    if not live:  # a finished run opens with what bounds it; a live one with its charts
        with st.container():  # what bounds the run and what to try (tuning/diagnose.py)
            diagnosis_panel(run, data)
    common.run_charts(data, key=f"run-{run_id}")
    if live:
        with st.container():
            diagnosis_panel(run, data)
    with st.container():  # TP/SP, DP/FSDP and pipeline traffic per collective type
        collectives = common.collectives_table(home, run_id, common.run_version(data))
        if len(collectives):
            st.caption("Collectives per mesh axis and type (per rank, whole run)")
            st.dataframe(common.collectives_shown(collectives), hide_index=True)
    with st.container():  # Mixture-of-Experts: expert load and dropped tokens (empty for dense runs)
        moe = report.moe_report(common.store(), run_id)
        if moe:
            left, right = st.columns(2)
            for col, chart in zip((left, right), (live_charts.moe_load(moe["per_step"]),
                                                  live_charts.moe_drops(moe["per_step"]))):
                col.vega_lite_chart(chart.data, chart.spec, width="stretch")
    with st.container():  # adaptive sequence parallelism: the plan of each step
        flexsp_panel(run_id)
    if shown_status == "running" and run["status"] != "running":  # the picker still says running
        common.runs_table.clear()
        st.rerun(scope="app")  # the run ended: leave polling mode


def diagnosis_panel(run: dict[str, Any], data: dict[str, Any]) -> None:
    """The run's diagnosis: each finding, its best priced suggestions with their command, and a button
    that launches the run again with the change."""
    from engine.config.schema import apply_overrides

    home = str(common.home())
    diag = common.run_diagnosis(home, run["run_id"], common.diagnosis_version(data), common.run_version(data))
    if diag is None:
        return
    with st.container(border=True):
        st.markdown(f"**{report.diagnosis_title(diag)}**")
        if not diag["findings"]:
            st.caption(report.diagnosis_lines(diag)[1].strip())
        for i, finding in enumerate(diag["findings"][:report.DIAGNOSIS_FINDINGS]):
            st.markdown(f"{i + 1}. {finding['headline']}")
            for j, sug in enumerate(finding["suggestions"][:report.DIAGNOSIS_SUGGESTIONS]):
                left, right = st.columns([6, 1], vertical_alignment="center")
                left.caption(report.suggestion_line(sug, diag["step_s"]))
                left.code(sug["command"], language="bash")
                if sug["overrides"]:
                    changed = apply_overrides(run.get("config") or {}, list(sug["overrides"]))
                    changed["name"] = f"{changed.get('name', 'run')}-try"
                    right.button("Run it", key=f"try-{run['run_id']}-{i}-{j}", icon=":material/rocket_launch:",
                                 on_click=launch, args=(changed,), help="launch this run's config with the change")


def schedule_panel(run_id: str, status: str) -> None:
    """A pipeline run's executed schedule as a rank x time grid (Plotly). Outside the polled panel:
    a Plotly chart is redrawn from blank whenever its figure changes, so a live run's grid stays at
    the step it showed when the page loaded, and the page redraws it when the run ends."""
    from workbench.schedule_view import schedule_figure, schedule_report

    sched = schedule_report(common.store(), run_id)
    if sched is None:
        return
    live = f" (the run is live: step {sched['step']} as of this page load)" if status == "running" else ""
    st.caption(f"Executed pipeline schedule (last recorded step){live}: gaps are the bubble")
    st.plotly_chart(schedule_figure(sched), key=f"schedule-{run_id}")


def flexsp_panel(run_id: str) -> None:
    """Adaptive SP (FlexSP): each step's groups (sizes, tokens) and predicted vs measured time."""
    from workbench.flexsp_view import flexsp_frames, flexsp_notes

    import pandas as pd

    # only the two plan kinds: the whole run's records took 0.5 s a render at 100k records
    store = common.store()
    plans = [store.metrics(run_id, kind=kind, as_frame=True) for kind in ("flexsp", "flexsp_group")]
    steps, groups = flexsp_frames(pd.concat(plans, ignore_index=True))
    if steps.empty:
        return
    st.caption("Adaptive sequence parallelism: groups per step (ranks, tokens) and the slowest "
               "group's predicted vs measured time")
    if not groups.empty:
        chart = live_charts.flexsp_groups(groups)
        st.vega_lite_chart(chart.data, chart.spec, width="stretch")
    seconds_columns = {c: fmt.seconds for c in steps.columns if c.endswith("(s)")}
    counts = {c: fmt.count for c in ("step", "groups", "max_tokens_per_rank", "token_cap") if c in steps}
    ratio = {"measured/predicted": fmt.ratio} if "measured/predicted" in steps else {}
    if ratio:
        st.caption(f"Measured over predicted, median of the steps: {fmt.ratio(steps['measured/predicted'].median())} "
                   "(the cost model is fitted once, when the run starts)")
    for note in flexsp_notes(steps):
        st.info(note, icon=":material/info:")
    st.dataframe(fmt.frame(steps, {**seconds_columns, **counts, **ratio}), hide_index=True)


def fold_form_while_live(runs: Any) -> None:
    """Fold the New-run form away once for each live run the picker shows, so its charts are the first
    screen; a user who opens the form again keeps it open."""
    if runs.empty:
        return
    picked = st.session_state.get("run_pick")
    row = runs[runs["run_id"] == picked] if picked in set(runs["run_id"]) else runs.head(1)
    run_id, status = row["run_id"].iloc[0], row["status"].iloc[0]
    if status == "running" and st.session_state.get(FOLDED_FOR) != run_id:
        st.session_state[FORM_KEY] = False
        st.session_state[FOLDED_FOR] = run_id


st.title("Run")
st.html(NO_DIM)
runs = common.runs_table(str(common.home()))
follow_launched(list(runs["run_id"]))  # before the poller: once it is picked, polling stops
# the form stays open until a launch or a live run folds it (the user can reopen it); state in FORM_KEY
st.session_state.setdefault(FORM_KEY, True)
fold_form_while_live(runs)
with st.expander("New run", key=FORM_KEY, on_change="rerun", icon=":material/edit_note:"):
    launch_panel()
pending_slot = st.container()
with pending_slot:
    st.fragment(run_every=1.0 if launched_job() else None)(pending_panel)()
if launched_job() is not None:  # "Starting…" alone: not the previous run's charts under it
    st.stop()
if runs.empty:
    common.empty_runs_message()
    st.stop()
labels = {row["run_id"]: common.run_label(row) for _, row in runs.iterrows()}
RUN_ID = st.selectbox("Run", list(labels), format_func=labels.__getitem__, key="run_pick")
STATUS = runs.loc[runs["run_id"] == RUN_ID, "status"].iloc[0]
with st.container(key=LIVE_KEY):
    st.fragment(run_every=common.REFRESH_S if STATUS == "running" else None)(live_panel)(RUN_ID, STATUS)
schedule_panel(RUN_ID, STATUS)
