"""Every dashboard figure: `fig_*` functions take plain data (DataFrames, dicts) and draw it.

Nothing here reads the run store or computes a measurement (STYLE habit 7): the pages build the
data, these functions only render it. Every figure has a title and axis titles with units.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

PHASE_COLORS = {
    "data": "#8c8c8c", "forward": "#1f77b4", "backward": "#2ca02c", "optimizer": "#9467bd",
    "comm_exposed": "#d62728", "bubble": "#ff7f0e", "other": "#bcbd22",
}
MAX_POINTS = 2000
"""Points drawn per trace; longer series are thinned evenly (the last point always kept)."""


def _layout(fig: go.Figure, title: str, x: str, y: str, *, height: int = 320) -> go.Figure:
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, height=height,
                      margin={"l": 50, "r": 20, "t": 50, "b": 45}, legend_title_text="")
    return fig


def thin(df: pd.DataFrame, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """Every k-th row so at most about ``max_points`` remain (keeps the first and last rows)."""
    if len(df) <= max_points:
        return df
    stride = -(-len(df) // max_points)
    picked = df.iloc[::stride]
    return picked if picked.index[-1] == df.index[-1] else pd.concat([picked, df.iloc[[-1]]])


def empty_figure(title: str, message: str) -> go.Figure:
    """A figure holding only a message (for a chart whose data has not arrived yet)."""
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, title, "", "", height=220)


def fig_loss(steps: pd.DataFrame, evals: pd.DataFrame | None = None) -> go.Figure:
    """Training loss per step (mean over ranks), with validation loss points when present."""
    fig = go.Figure()
    if "loss" in steps:
        data = thin(steps.dropna(subset=["loss"]))
        fig.add_scatter(x=data["step"], y=data["loss"], mode="lines+markers", name="train loss",
                        marker={"size": 4})
    if evals is not None and len(evals):
        fig.add_scatter(x=evals["step"], y=evals["value"], mode="markers", name="val loss",
                        marker={"size": 9, "symbol": "diamond"})
    return _layout(fig, "Loss", "step", "loss (nats/token)")


def fig_throughput(steps: pd.DataFrame) -> go.Figure:
    """Tokens/s (left axis) and MFU (right axis, %) per step."""
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    data = thin(steps)
    if "tokens_per_s" in data:
        fig.add_scatter(x=data["step"], y=data["tokens_per_s"], name="tokens/s", mode="lines")
    if "mfu" in data and data["mfu"].notna().any():
        fig.add_scatter(x=data["step"], y=100 * data["mfu"], name="MFU", mode="lines",
                        line={"dash": "dot"}, secondary_y=True)
    fig.update_yaxes(title_text="MFU (%)", secondary_y=True)
    return _layout(fig, "Throughput and MFU", "step", "throughput (tokens/s)")


def _phases(table: pd.DataFrame) -> list[str]:
    return [c for c in table.columns if c not in ("step", "rank", "total", "run")]


def fig_breakdown_ranks(table: pd.DataFrame, step: int) -> go.Figure:
    """Stacked step-time phases per rank for one step (`RunStore.breakdown_table` rows)."""
    rows = table[table["step"] == step].sort_values("rank")
    fig = go.Figure()
    for phase in _phases(rows):
        fig.add_bar(x=[f"rank {r}" for r in rows["rank"]], y=rows[phase], name=phase,
                    marker_color=PHASE_COLORS.get(phase))
    fig.update_layout(barmode="stack")
    return _layout(fig, f"Step-time breakdown per rank, step {step}", "rank", "time (s)")


def fig_breakdown_steps(table: pd.DataFrame) -> go.Figure:
    """Stacked phases per step, averaged over ranks: where each step's time went over the run."""
    mean = table.drop(columns=["rank"]).groupby("step", as_index=False).mean()
    mean = thin(mean, 500)
    fig = go.Figure()
    for phase in _phases(mean):
        fig.add_bar(x=mean["step"], y=mean[phase], name=phase, marker_color=PHASE_COLORS.get(phase))
    fig.update_layout(barmode="stack", bargap=0.05)
    return _layout(fig, "Step-time breakdown over the run (mean of ranks)", "step", "time (s)")


def fig_busbw(comm: pd.DataFrame) -> go.Figure:
    """Bus bandwidth against mean message size, one series per collective op.

    ``comm`` has columns op, size(B) (bytes per call) and busbw(GB/s), one row per rank-step.
    """
    fig = go.Figure()
    for op, rows in comm.groupby("op"):
        rows = thin(rows.sort_values("size(B)"))
        fig.add_scatter(x=rows["size(B)"], y=rows["busbw(GB/s)"], mode="markers", name=str(op),
                        marker={"size": 6, "opacity": 0.7})
    fig.update_xaxes(type="log")
    return _layout(fig, "Collective bus bandwidth by message size", "message size (bytes, log)",
                   "bus bandwidth (GB/s)")


def fig_timeline(samples: pd.DataFrame, title: str, unit_label: str) -> go.Figure:
    """Sampled values (columns time, name, value, rank) against wall-clock time, one line each."""
    fig = go.Figure()
    for (name, rank), rows in samples.groupby(["name", "rank"]):
        rows = thin(rows.sort_values("time"))
        fig.add_scatter(x=pd.to_datetime(rows["time"], unit="s"), y=rows["value"], mode="lines",
                        name=f"{name} r{rank}")
    return _layout(fig, title, "time (UTC)", unit_label)


def fig_memory(memory: pd.DataFrame) -> go.Figure:
    """Peak memory per rank (columns rank, name, value in GiB), grouped by what it measures."""
    fig = go.Figure()
    for name, rows in memory.groupby("name"):
        fig.add_bar(x=[f"rank {r}" for r in rows["rank"]], y=rows["value"], name=str(name))
    fig.update_layout(barmode="group")
    return _layout(fig, "Memory per rank (peak)", "rank", "memory (GiB)")


def fig_compare_curves(curves: pd.DataFrame, metric: str, unit_label: str) -> go.Figure:
    """One line per run (columns run, step, ``metric``)."""
    fig = go.Figure()
    for run, rows in curves.groupby("run"):
        rows = thin(rows.dropna(subset=[metric]))
        fig.add_scatter(x=rows["step"], y=rows[metric], mode="lines", name=str(run))
    return _layout(fig, f"{metric} by run", "step", unit_label)


def fig_compare_breakdown(means: pd.DataFrame) -> go.Figure:
    """Mean step-time phases per run, stacked (index = run, columns = phases in s)."""
    fig = go.Figure()
    for phase in means.columns:
        fig.add_bar(x=[str(i) for i in means.index], y=means[phase], name=phase,
                    marker_color=PHASE_COLORS.get(phase))
    fig.update_layout(barmode="stack")
    return _layout(fig, "Mean step-time breakdown by run", "run", "time per step (s)")


def fig_sim_breakdown(breakdown: Mapping[str, float]) -> go.Figure:
    """The simulator's predicted iteration time split into its parts (s)."""
    fig = go.Figure()
    for part, seconds in breakdown.items():
        fig.add_bar(x=["iteration"], y=[seconds], name=part)
    fig.update_layout(barmode="stack")
    return _layout(fig, "Predicted iteration time", "", "time (s)")


def fig_sim_memory(memory: Mapping[str, float], capacity_gb: float) -> go.Figure:
    """Predicted memory per GPU by part (GB), with the device capacity as a line."""
    fig = go.Figure()
    for part, gb in memory.items():
        fig.add_bar(x=["per GPU"], y=[gb], name=part)
    fig.add_hline(y=capacity_gb, line_dash="dash", annotation_text=f"capacity {capacity_gb:g} GB")
    fig.update_layout(barmode="stack")
    return _layout(fig, "Predicted memory per GPU", "", "memory (GB, 1e9 B)")


def fig_search_scatter(configs: pd.DataFrame) -> go.Figure:
    """Every searched configuration: iteration time against memory, coloured by fit."""
    data = thin(configs, 5000)
    fig = go.Figure()
    for fits, rows in data.groupby("fits"):
        fig.add_scattergl(x=rows["memory_per_gpu_gb"], y=rows["iteration_time_s"], mode="markers",
                          name="fits" if fits else "does not fit", marker={"size": 4},
                          text=[f"tp{t} pp{p} dp{d} mb{m} z{z}" for t, p, d, m, z in
                                zip(rows["tp"], rows["pp"], rows["dp"], rows["micro"], rows["zero"])])
    fig.update_yaxes(type="log")
    return _layout(fig, "Searched configurations", "memory per GPU (GB)", "iteration time (s, log)")


def fig_segments(steps: pd.DataFrame, segments: Sequence[Mapping[str, Any]],
                 metric: str = "tokens_per_s") -> go.Figure:
    """A live in-job study: one metric over the run's steps with each trial's segment shaded."""
    fig = go.Figure()
    if metric in steps:
        data = thin(steps.dropna(subset=[metric]))
        fig.add_scatter(x=data["step"], y=data[metric], mode="lines", name=metric)
    for i, seg in enumerate(segments):
        end = seg.get("end_step")
        end = end if end is not None else (steps["step"].max() if len(steps) else seg["start_step"])
        fig.add_vrect(x0=seg["start_step"] - 0.5, x1=end + 0.5, opacity=0.12, line_width=0,
                      fillcolor="#1f77b4" if i % 2 == 0 else "#ff7f0e",
                      annotation_text=f"trial {seg.get('trial_number')}", annotation_position="top left")
    return _layout(fig, "Live tuning: segments over the run", "step", f"{metric} (tokens/s)"
                   if metric == "tokens_per_s" else metric)


def label_optuna(fig: go.Figure, title: str, objective_label: str) -> go.Figure:
    """Give an optuna.visualization figure our title and the objective's name with its unit."""
    fig.update_layout(title=title, height=360, margin={"l": 50, "r": 20, "t": 50, "b": 45})
    if fig.layout.yaxis and fig.layout.yaxis.title and fig.layout.yaxis.title.text == "Objective Value":
        fig.update_yaxes(title_text=objective_label)
    return fig
