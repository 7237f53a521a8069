"""Shared pieces of the pages: the store handle, cached run data as DataFrames, run charts.

Data comes from the run store as DataFrames (`run_data`), and `workbench.plots` draws it. The
store handle is a `st.cache_resource` (one per home); data that changes is `st.cache_data` with a
short ttl, so a live panel polling every second or two reads SQLite at most once per tick.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

from profilers.store import RunStore, default_home
from workbench import fmt, live_charts, plots, report

LIVE_TTL_S = 1.0
BREAKDOWN_STEPS = 500  # steps drawn in the breakdown-over-the-run chart (evenly spaced, last kept)
COMM_STEPS = 500  # steps whose collectives the bandwidth scatter draws (a point per rank and op each)
REFRESH_S = 1.5


def home() -> Path:
    """The workbench home of this session ($WORKBENCH_HOME, else ./.workbench)."""
    return default_home()


@st.cache_resource
def _store(path: str) -> RunStore:
    return RunStore.open_home(path)


def store() -> RunStore:
    """The run store of the current home (one shared handle per home)."""
    return _store(str(home()))


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def runs_table(home_path: str, limit: int = 200) -> pd.DataFrame:
    """The newest runs, one row each: id, name, status, ranks, layout, emulated, created, error."""
    rows = _store(home_path).runs(limit=limit)
    out = []
    for r in rows:
        lay = r.get("layout") or {}
        out.append({"run_id": r["run_id"], "name": r["name"], "status": r["status"],
                    "ranks": r["world_size"],
                    "layout": fmt.layout(lay, r.get("config")),
                    "emulated": bool(r.get("emulated")),
                    "created": pd.to_datetime(r.get("created") or 0, unit="s"),
                    "error": r.get("error") or ""})
    return pd.DataFrame(out, columns=["run_id", "name", "status", "ranks", "layout", "emulated",
                                      "created", "error"])


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def run_data(home_path: str, run_id: str) -> dict[str, Any]:
    """Everything the run charts draw, as plain frames, aggregated and thinned by the store
    (bounded size whatever the run's length): steps, evals, breakdown, comm, host, ..."""
    s = _store(home_path)
    evals = s.series(run_id, "eval", max_points=plots.MAX_POINTS)
    run = s.run(run_id)
    return {
        "run": run,
        "steps": s.step_frame(run_id),
        "evals": evals[(evals["name"] == "val_loss") & (evals["rank"] == 0)],
        "breakdown": s.breakdown_steps(run_id, max_steps=BREAKDOWN_STEPS),  # mean over ranks
        "breakdown_ranks": _whole_last_step(s, run_id, (run or {}).get("world_size") or 1),
        "comm": s.comm_points(run_id, max_steps=COMM_STEPS),
        "gpu": s.series(run_id, "gpu", max_points=plots.MAX_POINTS),
        "host": s.series(run_id, "host", max_points=plots.MAX_POINTS),
        "memory": s.memory_peaks(run_id),
        "segments": s.segments(run_id),
        "read_at": time.time(),
    }


def _whole_last_step(s: RunStore, run_id: str, world: int) -> pd.DataFrame:
    """The per-rank breakdown of the last step, or of the one before while the last has only some
    ranks' reports (a live run: the chart would show one bar, then two)."""
    last = s.breakdown_ranks(run_id)
    if len(last) and last["rank"].nunique() < world and int(last["step"].max()) > 0:
        before = s.breakdown_ranks(run_id, int(last["step"].max()) - 1)
        if before["rank"].nunique() > last["rank"].nunique():
            return before
    return last


def run_version(data: dict[str, Any]) -> tuple[Any, ...]:
    """What changes whenever a run records more: its status, steps and per-rank step reports."""
    steps = data["steps"]
    return data["run"]["status"], len(steps), int(steps["ranks"].sum()) if len(steps) else 0


@st.cache_data(max_entries=64, show_spinner=False)
def comm_totals(home_path: str, run_id: str, version: tuple[Any, ...]) -> dict[str, dict[str, float]]:
    """The run's `RunStore.comm_totals` (a scan of its whole run), read again only when `version`
    (`run_version`) changes, so a live run still updates; the collectives table and the diagnosis share it."""
    return _store(home_path).comm_totals(run_id)


@st.cache_data(max_entries=64, show_spinner=False)
def collectives_table(home_path: str, run_id: str, version: tuple[Any, ...]) -> pd.DataFrame:
    """`report.collectives_frame` of the run's `comm_totals`, read again only when `version` changes."""
    return report.collectives_frame(comm_totals(home_path, run_id, version))


def empty_runs_message() -> None:
    """What to do when the store holds no run."""
    st.info("No runs yet: launch one on the **Run** page, or from a shell "
            "`workbench run examples/tiny.yaml` (same WORKBENCH_HOME).")


def run_label(row: pd.Series) -> str:
    """``run_id · layout · started`` for pickers: facts that never change, because a keyed select
    box keeps showing an option's old text when only its label changes (a status would go stale;
    the run header shows it)."""
    badge = " · emulated link" if row["emulated"] else ""
    return f"{row['run_id']} · {row['layout']} · {row['created']:%Y-%m-%d %H:%M}{badge}"


def run_header(run: dict[str, Any]) -> None:
    """Status, layout, emulated-link badge and the failure reason of one run."""
    lay = run.get("layout") or {}
    cols = st.columns([1, 1, 3, 1])  # the layout names five axes
    cols[0].metric("status", run["status"])
    cols[1].metric("ranks", run["world_size"])
    cols[2].metric("layout", fmt.layout(lay, run.get("config")))
    cols[3].metric("link", "emulated" if run.get("emulated") else "real")
    from workbench.report import model_line

    model = model_line(run.get("config"))
    if model:
        st.caption(f"Model: {model}")
    if run.get("emulated"):
        st.warning("Emulated link: communication was slowed to the configured bandwidth and latency "
                   "(link.*); timings are not this machine's real network.", icon=":material/network_check:")
    if run.get("error"):
        rank = run.get("error_rank")
        where = f" on rank {rank}" if rank is not None else ""
        if run["status"] == "pruned":  # the tuner stopped a trial that was behind: not a failure
            st.warning(f"Pruned by the tuner: {run['error'][-1000:]}", icon=":material/content_cut:")
        elif run["status"] == "interrupted":
            st.warning(f"Stopped before the end: {run['error'][-1000:]}", icon=":material/stop_circle:")
        else:
            st.error(f"Run failed{where}:\n\n```\n{run['error'][-3000:]}\n```")


def headline(data: dict[str, Any]) -> None:
    """The latest step's figures as metrics."""
    steps = data["steps"]
    cols = st.columns(4)
    if steps.empty:
        cols[0].metric("step", "–")
        return
    last = steps.iloc[-1]

    def value(key: str) -> float | None:
        v = last.get(key)
        return None if v is None or pd.isna(v) else float(v)

    cols[0].metric("step", fmt.count(last["step"]))
    cols[1].metric("loss (nats/token)", fmt.num(value("loss")))
    cols[2].metric("throughput (tokens/s)", fmt.num(value("tokens_per_s")))
    cols[3].metric("MFU", fmt.pct(value("mfu")) if live_charts.has_mfu(steps) else "n/a",
                   help=None if live_charts.has_mfu(steps) else "no peak FLOP/s known for this device (a CPU run): "
                   "set WORKBENCH_PEAK_FLOPS to the rate `workbench calibrate` measured")


TIMELINE_TOPICS = {"%": ("utilisation", "percent (%)"), "GiB": ("memory", "memory (GiB)"),
                   "B/s": ("transfer rate", "transfer rate (bytes/s)"), "W": ("power", "power (W)"),
                   "C": ("temperature", "temperature (°C)"), "MHz": ("clocks", "clock (MHz)")}
"""A timeline's unit -> (what its chart title calls it, its y axis title)."""


def timeline_charts(samples: pd.DataFrame, what: str) -> list[live_charts.Chart]:
    """One timeline per unit (names carry their unit, e.g. ``cpu(%)``): never mixed axes."""
    if samples.empty:
        return []
    unit_of = {name: fmt.split_unit(name)[1] for name in samples["name"].unique()}  # a few names, many rows
    units = samples["name"].map(unit_of)
    charts = []
    for unit in sorted(set(unit_of.values())):
        topic, axis = TIMELINE_TOPICS.get(unit, (f"values ({unit})" if unit else "values",
                                                 f"value ({unit or 'no unit'})"))
        title = f"{what} {topic} ({fmt.UNIT_NAMES.get(unit, unit)})" if unit in TIMELINE_TOPICS else f"{what} {topic}"
        charts.append(live_charts.timeline(samples[units == unit], title, axis))
    return charts


def _no_breakdown_reason(data: dict[str, Any]) -> str:
    """Why a run has no breakdown yet: no step so far, or profiling is off in its config."""
    profile = ((data["run"] or {}).get("config") or {}).get("profile") or {}
    if profile.get("enabled", True) is False:
        return "no breakdown: profile.enabled is false in this run's config"
    return "waiting for the first step" if data["steps"].empty else "no breakdown records yet"


def run_chart_list(data: dict[str, Any]) -> list[live_charts.Chart]:
    """Every chart of one run (`run_data`), a message in place of each whose data have not come:
    the fixed ones first, so a chart that arrives later moves no chart drawn before it."""
    steps, table, last = data["steps"], data["breakdown"], data["breakdown_ranks"]
    waiting = "waiting for the first step"
    no_breakdown = _no_breakdown_reason(data)
    charts = [live_charts.loss(steps, data["evals"]) if len(steps) else live_charts.message("Loss", waiting),
              live_charts.throughput(steps) if len(steps) else live_charts.message("Throughput", waiting),
              live_charts.breakdown_ranks(last) if len(last) else
              live_charts.message("Step-time breakdown per rank (latest step)", no_breakdown),
              live_charts.breakdown_steps(table) if len(table) else
              live_charts.message("Step-time breakdown over the run (mean of ranks)", no_breakdown),
              live_charts.busbw(data["comm"]) if len(data["comm"]) else
              live_charts.message("Collective bus bandwidth by message size", "no collective records"),
              live_charts.memory(data["memory"]) if len(data["memory"]) else
              live_charts.message("Memory per rank (peak)", "no memory records yet")]
    charts += timeline_charts(data["host"], "Host") or [
        live_charts.message("Host utilisation", "no host samples (profile.host_interval_s)")]
    charts += timeline_charts(data["gpu"], "GPU")
    if data["segments"]:
        charts.append(live_charts.segments(steps, data["segments"]))
    return charts


def run_charts(data: dict[str, Any], key: str) -> None:
    """Every chart of one run, two per row. Vega-Lite, not Plotly: a live run's charts update in
    place, where a Plotly chart is remounted (blank until redrawn) whenever its figure changes."""
    charts = run_chart_list(data)
    for i in range(0, len(charts), 2):
        cols = st.columns(2)
        for col, chart in zip(cols, charts[i:i + 2]):
            col.vega_lite_chart(chart.data, chart.spec, width="stretch")


# -- hardware --------------------------------------------------------------------------------
EXPORT_PACKAGES = ("transformers", "accelerate", "torchtitan", "deepspeed", "megatron-core", "scipy")
"""Versions the Hardware page lists beyond the runs' own (profilers.host.KEY_PACKAGES): the tools
the exports and model loading meet (`workbench export`, model.hf)."""


def machine_facts() -> dict[str, Any]:
    """Host, package versions (read from the installed metadata: no import) and the GPU inventory."""
    from profilers import nvml
    from profilers.host import KEY_PACKAGES, host_info, software_versions

    host = host_info()
    host["versions"] = software_versions(KEY_PACKAGES + EXPORT_PACKAGES)
    return {"host": host, "gpus": nvml.gpu_inventory(), "nvml": nvml.nvml_available(),
            "nvml_reason": nvml.unavailable_reason()}


def distributed_backends() -> dict[str, Any]:
    """gloo / nccl / mpi available in this torch (imports torch.distributed: seconds the first time)."""
    try:
        import torch.distributed as dist
    except ImportError as exc:
        return {"torch": f"not importable: {exc}"}
    return {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(), "mpi": dist.is_mpi_available()}


# -- studies ---------------------------------------------------------------------------------
def storage_url(home_path: str) -> str:
    """The Optuna storage of a home (tuning.study.default_storage: SQLite ``studies.db``)."""
    from tuning.study import default_storage

    return default_storage(home_path)


def _has_studies(home_path: str) -> bool:
    return (Path(home_path) / "studies.db").exists()


@st.cache_resource
def _optuna_storage(url: str) -> Any:
    from tuning.study import reader_storage

    return reader_storage(url)


@st.cache_resource
def _study_reader(url: str) -> Any:
    from workbench.app_pages.studies import StudyReader

    return StudyReader(url)


def study_reader(home_path: str) -> Any:
    """The `studies.StudyReader` of a home's storage (one per server: it caches finished trials)."""
    return _study_reader(storage_url(home_path))


@st.cache_data(ttl=2.0, show_spinner=False)
def studies_table(home_path: str) -> pd.DataFrame:
    """One row per study: name, directions, trials (run ones), counts by state, draws skipped unrun, best."""
    columns = ["study", "directions", "trials", "complete", "running", "pruned", "failed", "skipped", "best"]
    if not _has_studies(home_path):
        return pd.DataFrame(columns=columns)
    rows = []
    for s in study_reader(home_path).summaries():
        c = s["counts"]
        rows.append({"study": s["study"], "directions": " / ".join(s["directions"]),
                     "trials": sum(v for k, v in c.items() if k != "SKIPPED"), "complete": c.get("COMPLETE", 0),
                     "running": c.get("RUNNING", 0), "pruned": c.get("PRUNED", 0),
                     "failed": c.get("FAIL", 0), "skipped": c.get("SKIPPED", 0), "best": s["best"]})
    return pd.DataFrame(rows, columns=columns)


def load_study(home_path: str, name: str) -> Any:
    """The named study on this home's storage (a live handle, for writes and export)."""
    import optuna

    return optuna.load_study(study_name=name, storage=_optuna_storage(storage_url(home_path)))


def study_trials(home_path: str, name: str) -> tuple[list[str], list[Any]]:
    """(directions, FrozenTrials) of a study, through the home's `StudyReader` (a cache already:
    st.cache_data would pickle thousands of trials on every hit)."""
    return study_reader(home_path).trials(name)


@st.cache_data(ttl=2.0, show_spinner=False)
def trials_frame(home_path: str, name: str) -> pd.DataFrame:
    """One row per trial: number, state, value(s), params, reason, run id, duration (s)."""
    from workbench.app_pages.studies import display_state

    directions, trials = study_trials(home_path, name)
    rows = []
    for t in trials:
        values = t.values or []
        row: dict[str, Any] = {"number": t.number, "state": display_state(t),
                               "tokens/s": values[0] if values else None}
        if len(directions) > 1:
            row["val_loss"] = values[1] if len(values) > 1 else None
        row.update({f"param:{k}": v for k, v in t.params.items()})
        row["reason"] = t.user_attrs.get("reason", "")
        row["run_id"] = t.user_attrs.get("run_id")
        row["duration(s)"] = t.duration.total_seconds() if t.duration else None
        rows.append(row)
    return pd.DataFrame(rows)


def collectives_shown(frame: pd.DataFrame) -> pd.DataFrame:
    """`report.collectives_frame` for people: whole counts, bytes in KiB/MiB/GiB, durations in their unit."""
    return fmt.frame(frame, {"count": fmt.count, "bytes": fmt.size, "time(s)": fmt.seconds,
                             "busbw(GB/s)": fmt.bandwidth}).rename(columns={"time(s)": "time", "busbw(GB/s)": "busbw"})


DIAGNOSIS_EVERY = 20  # a live run's diagnosis is read again every this many steps (it scans the whole run)


@st.cache_data(max_entries=32, show_spinner=False)
def run_diagnosis(home_path: str, run_id: str, version: tuple[Any, ...],
                  _comm_version: tuple[Any, ...] | None = None) -> dict[str, Any] | None:
    """`tuning.diagnose.diagnose` of the run as plain data, read again only when `version` moves; with
    ``_comm_version`` (`run_version`; not part of the cache key), its collectives are the cached
    `comm_totals` the Run page read."""
    from dataclasses import asdict

    from tuning.diagnose import diagnose

    totals = comm_totals(home_path, run_id, _comm_version) if _comm_version is not None else None
    found = diagnose(_store(home_path), run_id, home=home_path, collectives=totals)
    return asdict(found) if found is not None else None


def diagnosis_version(data: dict[str, Any]) -> tuple[Any, ...]:
    """The run's status and its step count in blocks of DIAGNOSIS_EVERY."""
    return data["run"]["status"], len(data["steps"]) // DIAGNOSIS_EVERY


def shown_by_unit(name: str, value: Any) -> str:
    """One value of a row named with its unit (`RunStore.run_summary`'s keys) as people read it:
    ``dp:all_reduce/busbw(GB/s)`` 1.49e-07 -> '149 B/s', ``.../bytes`` -> KiB/MiB, ``(s)`` -> ms/s."""
    if value is None or (isinstance(value, float) and value != value):
        return ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if name.endswith("(GB/s)"):
        return fmt.bandwidth(value)
    if name.endswith("/bytes") or name.endswith("_bytes"):
        return fmt.size(value)
    if name.endswith("(GiB)"):
        return fmt.size(value * 2**30)
    if name.endswith("(s)"):
        return fmt.seconds(value)
    return fmt.num(value)


def side_by_side(table: pd.DataFrame) -> pd.DataFrame:
    """`RunStore.compare` for people: each row's values formatted by the unit in its name."""
    return pd.DataFrame({col: [shown_by_unit(str(name), v) for name, v in table[col].items()] for col in table.columns},
                        index=table.index)
