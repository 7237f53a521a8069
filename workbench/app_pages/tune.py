"""Tune: define a search space, start/pause/resume/stop background workers, watch the study."""
from __future__ import annotations

import time
import warnings
from typing import Any

import pandas as pd
import streamlit as st
import yaml

from engine.errors import ConfigError
from engine.config.validate import name_error
from workbench import live_charts, plots, ui_state
from workbench.app_pages import common

DEFAULT_SPACE = """\
# Every trial runs the base config with these keys changed (dotted config keys).
world_size: 2
params:
  batch.micro: {choices: [2, 4]}
  comm.compressor: {choices: [none, fp16]}
  train.lr: {low: 0.001, high: 0.01, log: true}
fixed: {train.steps: 6}
"""
DEFAULT_BASE = """\
name: tune
model: {layers: 2, d_model: 32, heads: 2, seq_len: 32, vocab: 256}
data: {source: text}
parallel: {dp: 2}
batch: {global: 8, micro: 4}
train: {steps: 6, lr: 3.0e-3}
"""
MAX_TABLE_ROWS = 1000


def _control() -> tuple[Any, str]:
    try:
        from tuning import control
    except ImportError as exc:
        return None, f"tuning.control is not importable ({exc}); studies can be browsed, not started"
    return control, ""


def _space_errors(text: str) -> list[str]:
    from tuning.space import SearchSpace

    try:
        SearchSpace.from_yaml(text)
    except ConfigError as exc:
        return [str(e) for e in getattr(exc, "errors", [exc])]
    except (ValueError, TypeError) as exc:
        return [f"space: {exc}"]
    return []


def start_form(home: str, name: str, control: Any) -> None:
    """Space and base config editors with inline errors, and the start/continue button."""
    left, right = st.columns(2)
    space_text = left.text_area("Search space (YAML)", DEFAULT_SPACE, height=230, key="space_yaml")
    base_text = right.text_area("Base run config (YAML)", DEFAULT_BASE, height=230, key="base_yaml")
    errors = _space_errors(space_text)
    _, cfg_errors = ui_state.parse_config(base_text)
    for e in errors:
        left.error(e)
    for e in cfg_errors:
        right.error(f"{e.field}: {e.rule} (got {e.value!r})")
    c1, c2, c3 = st.columns([1, 1, 2])
    n_trials = c1.number_input("Trials", 1, 10_000, 3, key="n_trials")
    jobs = c2.number_input("Worker processes", 1, 8, 1, key="n_jobs")
    c3.caption("Starting again on an existing study continues it with the space above: edit the "
               "space between trials to tune live.")
    bad_name = name_error("study", name.strip())  # it becomes a folder and part of every trial's run id
    if bad_name is not None:
        st.error(str(bad_name))
    ok = not errors and not cfg_errors and control is not None and bad_name is None
    if st.button("Start / continue study", type="primary", disabled=not ok, icon=":material/play_arrow:"):
        pids = control.start_workers(name.strip(), space_text, base_text,
                                     storage=common.storage_url(home), n_trials=int(n_trials),
                                     jobs=int(jobs), home=home)
        st.session_state["tune_study"] = name.strip()
        common.studies_table.clear()
        st.success(f"Started {len(pids)} worker(s) for study `{name.strip()}`: pids {pids}")


def controls(home: str, name: str, control: Any) -> list[int]:
    """Pause / resume / stop buttons and the workers' state; returns the running worker pids."""
    if control is None:
        return []
    storage = common.storage_url(home)
    pids = control.running_workers(name, home=home)
    paused = common.study_reader(home).is_paused(name)
    st.caption(ui_state.workers_line(pids, paused))
    c1, c2, c3 = st.columns(3)
    if c1.button("Pause", disabled=paused or not pids, icon=":material/pause:"):  # nothing to pause once it ended
        control.pause(name, storage)
        st.rerun()
    if c2.button("Resume", disabled=not paused, icon=":material/play_arrow:"):
        control.resume(name, storage)
        st.rerun()
    if c3.button("Stop workers", disabled=not pids, icon=":material/stop:"):
        control.stop_workers(name, home=home)
        st.rerun()
    return pids


def read_afresh_once_workers_end(name: str, workers: list[int]) -> None:
    """While workers run the page polls, reading the trial table through a 2 s cache; the drawing after they
    end is the last (polling stops), so it reads the table anew, not one cached while the last trial ran.

    The caches cleared when the workers end, together: `live()` clears `studies_table` as it asks for that last
    drawing, and this clears `trials_frame` and `study_figures` as the drawing begins."""
    had_workers = st.session_state.setdefault("tune_had_workers", {})
    if had_workers.get(name) and not workers:
        common.trials_frame.clear()
        study_figures.clear()
    had_workers[name] = bool(workers)


# Parallel coordinates and importances use the newest FIGURE_TRIALS complete trials, the
# history the newest HISTORY_TRIALS trials (a browser draws thousands of lines slowly).
FIGURE_TRIALS = 500
HISTORY_TRIALS = 1000
OBJECTIVE = "tokens/s"
OBJECTIVE_LABEL = "throughput (tokens/s)"


def importances(directions: list[str], trials: list[Any], name: str) -> dict[str, float]:
    """optuna.importance of each parameter for the first objective (PED-ANOVA past 100 trials:
    fANOVA, the default, takes seconds on hundreds of trials). PED-ANOVA rates what makes the
    target low, so a maximised objective is negated (fANOVA does not mind the sign)."""
    import optuna

    from tuning.warmstart import prediction_trend
    from workbench.app_pages.studies import in_memory

    study = in_memory(directions, trials, name)
    evaluator = optuna.importance.PedAnovaImportanceEvaluator() if len(trials) > 100 else None
    sign = -1.0 if directions[0] == "maximize" else 1.0
    with warnings.catch_warnings():  # PED-ANOVA warns that it rates low targets: the sign above handles it
        warnings.filterwarnings("ignore", message="PedAnovaImportanceEvaluator computes the importances")
        return optuna.importance.get_param_importances(study, evaluator=evaluator,
                                                       target=lambda t: sign * t.values[0])


@st.cache_data(ttl=5.0, show_spinner=False)
def study_figures(home: str, name: str, n_done: int) -> list[Any]:
    """The study's figures (recomputed when its finished-trial count moves): history (or Pareto
    front), parallel coordinates and parameter importances; a chart that needs more complete
    trials than there are says so instead of drawing noise."""
    import optuna.visualization as vis
    from optuna.trial import TrialState

    from tuning.warmstart import prediction_trend
    from workbench.app_pages.studies import in_memory

    directions, trials = common.study_trials(home, name)
    frame = common.trials_frame(home, name).sort_values("number")
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    recent = done[-FIGURE_TRIALS:]
    suffix = f" (newest {FIGURE_TRIALS} of {len(done)})" if len(done) > FIGURE_TRIALS else ""
    figs: list[Any] = []
    if len(directions) == 1:
        figs.append(plots.fig_history(frame.tail(HISTORY_TRIALS), OBJECTIVE, OBJECTIVE_LABEL,
                                      maximize=directions[0] == "maximize",
                                      shown_of=len(trials) if len(trials) > HISTORY_TRIALS else None))
    elif done:
        figs.append(plots.label_optuna(vis.plot_pareto_front(in_memory(directions, recent, name), target_names=[
            OBJECTIVE_LABEL, "val loss (nats/token)"]), "Pareto front" + suffix, "val loss (nats/token)"))
    else:
        figs.append(plots.empty_figure("Pareto front", "no complete trial yet"))
    if any("predicted_tokens_per_s" in t.user_attrs for t in done):  # a study with a calibrated profile
        figs.append(plots.fig_prediction_trend(prediction_trend(in_memory(directions, done, name))))
    if len(done) < plots.MIN_TREND_TRIALS:
        figs.append(plots.too_few_trials("Parameter importances for tokens/s", len(done)))
        return figs
    complete = frame[frame["state"] == "COMPLETE"].tail(FIGURE_TRIALS)
    params = [c for c in complete.columns if c.startswith("param:") and complete[c].notna().all()]
    if params:
        figs.append(plots.fig_parallel(complete, params, OBJECTIVE, "Parallel coordinates (tokens/s)" + suffix))
    if len(params) > 1:
        figs.append(plots.fig_importances(importances(directions, recent, name),
                                          "Parameter importances for tokens/s" + suffix))
    return figs


def study_panel(home: str, name: str) -> None:
    """Counts, figures and the trial table of one study."""
    trials = common.trials_frame(home, name)
    if trials.empty:
        st.info("No trials yet: workers are starting, or start them above.")
        return
    counts = trials["state"].value_counts()
    cols = st.columns(6)
    for col, state in zip(cols, ("COMPLETE", "RUNNING", "PRUNED", "FAIL", "WAITING", "SKIPPED")):
        col.metric(state.lower(), int(counts.get(state, 0)),
                   help="draws not run: an invalid point or a repeat of another trial's config" if state == "SKIPPED" else None)
    figs = study_figures(home, name, int(counts.get("COMPLETE", 0)) + int(counts.get("PRUNED", 0)))
    for i in range(0, len(figs), 2):
        for col, fig in zip(st.columns(2), figs[i:i + 2]):
            col.plotly_chart(fig, width="stretch", key=f"study-{name}-{i}-{fig.layout.title.text}")
    order_panel(home, name)
    st.subheader("Trials")
    shown = trials.sort_values("number", ascending=False).head(MAX_TABLE_ROWS)
    if OBJECTIVE in shown:
        shown = shown.assign(**{OBJECTIVE: pd.to_numeric(shown[OBJECTIVE], errors="coerce").round()})
    if len(trials) > MAX_TABLE_ROWS:
        st.caption(f"newest {MAX_TABLE_ROWS} of {len(trials)} trials")
    st.dataframe(shown, hide_index=True, width="stretch", column_config={
        OBJECTIVE: st.column_config.NumberColumn(format="localized"),  # 45,815: thousands separated
        "run_id": st.column_config.TextColumn(width="large"),  # never cut to "tune-ui-"
        "val_loss": st.column_config.NumberColumn(format="%.4f"),
        "duration(s)": st.column_config.NumberColumn(format="%.1f"),
        "reason": st.column_config.TextColumn(width="large")})
    reasons_table(shown)
    jobs_panel(home, name)


REASON_ROWS = 50


def reasons_table(trials: pd.DataFrame) -> None:
    """The newest pruned, failed and skipped trials with their whole reason (a table wraps its text;
    the trial table's reason column cuts it at the column's width)."""
    if "reason" not in trials:
        return
    why = trials[trials["reason"].fillna("").astype(str).str.len() > 0][["number", "state", "reason"]]
    if why.empty:
        return
    st.caption(f"Why trials stopped or were not run (newest {min(len(why), REASON_ROWS)} of {len(why)})")
    st.table(why.head(REASON_ROWS).set_index("number"))


def order_panel(home: str, name: str) -> None:
    """Predicted vs measured order of the finished trials (tuning.warmstart.prediction_order): whether the
    simulator, raw and corrected with the other trials, ranks them as they ran."""
    from optuna.trial import TrialState

    from tuning.warmstart import prediction_order
    from workbench.app_pages.studies import in_memory

    directions, trials = common.study_trials(home, name)
    done = [t for t in trials if t.state == TrialState.COMPLETE and "predicted_tokens_per_s" in t.user_attrs]
    if len(done) < 2 or len(directions) != 1:
        return
    order = prediction_order(in_memory(directions, done, name))
    st.subheader("Predicted vs measured order")
    st.caption(f"pairs of finished trials ordered as measured: raw {100 * order.attrs['raw_agreement']:.0f}%, "
               f"corrected {100 * order.attrs['corrected_agreement']:.0f}% (each trial corrected without its own run)")
    st.dataframe(order.sort_values("measured_rank")[["trial", "strategy_class", "compressor", "measured_rank",
                                                      "predicted_rank", "corrected_rank", "measured"]],
                 hide_index=True, width="stretch", column_config={"measured": st.column_config.NumberColumn(
                     "measured tokens/s", format="%.0f")})


def jobs_panel(home: str, name: str) -> None:
    """Trials that ran as Slurm jobs (--launcher slurm): queued / running / done per job id."""
    from tuning.study import job_table

    rows = job_table(common.study_trials(home, name)[1])
    if not rows:
        return
    st.subheader("Slurm jobs")
    phases = pd.Series([r["phase"] for r in rows]).value_counts()
    for col, phase in zip(st.columns(3), ("queued", "running", "done")):
        col.metric(f"jobs {phase}", int(phases.get(phase, 0)))
    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch", column_config={
        "queued (s)": st.column_config.NumberColumn(format="%.0f"),
        "ran (s)": st.column_config.NumberColumn(format="%.0f"),
        "reason": st.column_config.TextColumn(width="large")})


def drill_down(home: str, name: str) -> None:
    """Pick a trial and see its run's charts (the trial's run_id links to the run store)."""
    trials = common.trials_frame(home, name)
    linked = trials.dropna(subset=["run_id"]) if "run_id" in trials else trials.iloc[0:0]
    if linked.empty:
        st.caption("No trial has a run yet.")
        return
    options = [f"trial {n} · {s} · {r}" for n, s, r in zip(linked["number"], linked["state"], linked["run_id"])]
    pick = st.selectbox("Trial", options, key="drill_trial")
    run_id = pick.rsplit(" · ", 1)[-1]
    if common.store().run(run_id) is None:
        st.warning(f"Run `{run_id}` is not in this home's run store.")
        return
    data = common.run_data(home, run_id)
    common.run_header(data["run"])
    common.run_charts(data, key=f"drill-{run_id}")


def segments_panel(home: str, name: str) -> None:
    """A live in-job study: the trials share one run; draw it with each trial's segment marked."""
    trials = common.trials_frame(home, name)
    if "run_id" not in trials:
        return
    shared = trials["run_id"].value_counts()
    shared = [r for r in shared[shared >= 2].index if common.store().segments(r)]
    if not shared:
        st.caption("No live in-job study here: its trials would share one run, split into segments.")
        return
    run_id = st.selectbox("In-job run", shared, key="segments_run")
    data = common.run_data(home, run_id)
    chart = live_charts.segments(data["steps"], data["segments"])
    st.vega_lite_chart(chart.data, chart.spec, width="stretch")
    st.dataframe(pd.DataFrame(data["segments"]), hide_index=True, width="stretch")


def enqueue_form(home: str, name: str, control: Any) -> None:
    """Queue a hand-picked config (params as YAML) as the study's next trial."""
    text = st.text_area("Params to try next (YAML mapping of the space's keys)",
                        "batch.micro: 4\ncomm.compressor: none\ntrain.lr: 0.003\n", key="enqueue_yaml")
    if st.button("Enqueue trial", disabled=control is None, icon=":material/playlist_add:"):
        try:
            params = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            st.error(f"not valid YAML: {exc}")
            return
        if not isinstance(params, dict):
            st.error("params must be a mapping, e.g. `batch.micro: 4`")
            return
        control.enqueue(name, common.storage_url(home), params)
        common.trials_frame.clear()
        st.success(f"Enqueued {params}")


st.title("Tune")
HOME = str(common.home())
CONTROL, WHY = _control()
if WHY:
    st.warning(WHY)
studies = common.studies_table(HOME)
names = list(studies["study"])
default = st.session_state.get("tune_study")
choice = st.selectbox("Study", ["(new study)", *names],
                      index=(names.index(default) + 1) if default in names else (1 if names else 0))
st.session_state.setdefault("new_study_name", f"study-{time.strftime('%Y%m%d-%H%M%S')}")
name = st.text_input("New study name", key="new_study_name") if choice == "(new study)" else choice
with st.expander("Search space, base config and start", expanded=not names):
    start_form(HOME, name, CONTROL)


def await_new_study() -> None:
    """Workers create the study a moment after they start: rerun the page once it exists."""
    if st.session_state.get("tune_study") in common.studies_table(HOME)["study"].values:
        st.rerun(scope="app")
    st.info(f"Waiting for study `{st.session_state['tune_study']}` to be created by its workers…")


if choice == "(new study)":
    default = st.session_state.get("tune_study")  # the start button may have just set it
    if default and default not in names:
        st.fragment(run_every=1.0)(await_new_study)()
    elif not names:
        st.info("No studies yet: edit the space above and press **Start / continue study**, "
                "or run `workbench tune SPACE.yaml` from a shell (same WORKBENCH_HOME).")
    st.stop()

workers = controls(HOME, name, CONTROL)
read_afresh_once_workers_end(name, workers)


@st.fragment(run_every=2.0 if workers else None)
def live() -> None:
    study_panel(HOME, name)
    if workers and CONTROL is not None and not CONTROL.running_workers(name, home=HOME):
        common.studies_table.clear()  # the other caches: read_afresh_once_workers_end, as the rerun begins
        st.rerun(scope="app")  # the workers ended (and were reaped): redraw the controls, stop polling


live()
with st.expander("Drill down: a trial's run"):
    drill_down(HOME, name)
with st.expander("Live in-job segments"):
    segments_panel(HOME, name)
with st.expander("Enqueue a config by hand"):
    enqueue_form(HOME, name, CONTROL)
