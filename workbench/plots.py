"""Every Plotly figure of the dashboard: `fig_*` functions take plain data (DataFrames, dicts) and draw it
(the Run page's charts, redrawn in place while a run is live, are Vega-Lite: workbench/live_charts.py).

Nothing here reads the run store or computes a measurement (STYLE habit 7): the pages build the
data, these functions only render it. Every figure has a title and axis titles with units.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
import plotly.graph_objects as go

PHASE_COLORS = {
    "data": "#8c8c8c", "forward": "#1f77b4", "backward": "#2ca02c", "optimizer": "#9467bd",
    "comm_exposed": "#d62728", "bubble": "#ff7f0e", "other": "#bcbd22",
}
MAX_POINTS = 2000
"""Points drawn per trace; longer series are thinned evenly (the last point always kept)."""


def _layout(title: str, x: str, y: str, *, height: int = 320, **extra: Any) -> dict[str, Any]:
    """Our layout as nested dicts (plotly's ``xaxis_title=`` shorthand costs ~5 ms a figure)."""
    layout: dict[str, Any] = {"title": {"text": title}, "xaxis": {"title": {"text": x}},
                              "yaxis": {"title": {"text": y}}, "height": height,
                              "margin": {"l": 50, "r": 20, "t": 50, "b": 45}, "legend": {"title": {"text": ""}}}
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(layout.get(key), dict):
            layout[key] = {**layout[key], **value}
        else:
            layout[key] = value
    return layout


def _figure(traces: Sequence[Any], title: str, x: str, y: str, **layout: Any) -> go.Figure:
    return go.Figure(data=list(traces), layout=_layout(title, x, y, **layout))


def thin(df: pd.DataFrame, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """Every k-th row so at most about ``max_points`` remain (keeps the first and last rows)."""
    if len(df) <= max_points:
        return df
    stride = -(-len(df) // max_points)
    picked = df.iloc[::stride]
    return picked if picked.index[-1] == df.index[-1] else pd.concat([picked, df.iloc[[-1]]])


def empty_figure(title: str, message: str) -> go.Figure:
    """A figure holding only a message (for a chart whose data has not arrived yet): no axes."""
    return _figure([], title, "", "", height=220, xaxis={"visible": False}, yaxis={"visible": False},
                   annotations=[{"text": message, "showarrow": False, "x": 0.5, "y": 0.5,
                                 "xref": "paper", "yref": "paper", "font": {"size": 14}}])


DASHES = ("dash", "dot", "dashdot", "longdash")


def fig_compare_curves(curves: pd.DataFrame, metric: str, unit_label: str) -> go.Figure:
    """One line per run (columns run, step, ``metric``). A curve identical to an earlier run's (same
    steps, same values: a seeded repeat) is dashed, marked and named "identical to ..." in the legend,
    where it would hide exactly under the first."""
    traces, seen = [], {}
    for run, rows in curves.groupby("run", sort=False):
        rows = thin(rows.dropna(subset=[metric]))
        curve = (tuple(rows["step"]), tuple(rows[metric]))
        first = seen.setdefault(curve, str(run))
        if first == str(run):
            traces.append(go.Scatter(x=rows["step"], y=rows[metric], mode="lines", name=str(run)))
            continue
        twins = sum(1 for t in traces if t.name.endswith(f"(identical to {first})"))
        traces.append(go.Scatter(x=rows["step"], y=rows[metric], mode="lines+markers",
                                 name=f"{run} (identical to {first})", line={"dash": DASHES[twins % len(DASHES)]},
                                 marker={"symbol": "circle-open", "size": 7}))
    what = unit_label.split(" (")[0]
    return _figure(traces, f"{what[:1].upper()}{what[1:]} by run", "step", unit_label)


def fig_compare_breakdown(means: pd.DataFrame) -> go.Figure:
    """Mean step-time phases per run, stacked (index = run, columns = phases in s)."""
    traces = [go.Bar(x=[str(i) for i in means.index], y=means[phase], name=phase,
                     marker_color=PHASE_COLORS.get(phase)) for phase in means.columns]
    return _figure(traces, "Mean step-time breakdown by run", "run", "time per step (s)", barmode="stack")


def fig_sim_breakdown(breakdown: Mapping[str, float]) -> go.Figure:
    """The simulator's predicted iteration time split into its parts (s)."""
    traces = [go.Bar(x=["iteration"], y=[seconds], name=part) for part, seconds in breakdown.items()]
    return _figure(traces, "Predicted iteration time", "", "time (s)", barmode="stack")


def fig_sim_memory(memory: Mapping[str, float], capacity_gb: float) -> go.Figure:
    """Predicted memory per GPU by part (GB), with the device capacity as a line."""
    traces = [go.Bar(x=["per GPU"], y=[gb], name=part) for part, gb in memory.items()]
    return _figure(traces, "Predicted memory per GPU", "", "memory (GB, 1e9 B)", barmode="stack",
                   shapes=[{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": capacity_gb,
                            "y1": capacity_gb, "line": {"dash": "dash"}}],
                   annotations=[{"xref": "paper", "x": 1, "y": capacity_gb, "xanchor": "right",
                                 "yanchor": "bottom", "showarrow": False,
                                 "text": f"capacity {capacity_gb:g} GB"}])


def fig_search_scatter(configs: pd.DataFrame) -> go.Figure:
    """Every searched configuration: iteration time against memory, coloured by fit."""
    data = thin(configs, 5000)
    traces = []
    for fits, rows in data.groupby("fits"):
        traces.append(go.Scattergl(
            x=rows["memory_per_gpu_gb"], y=rows["iteration_time_s"], mode="markers",
            name="fits" if fits else "does not fit", marker={"size": 4},
            text=[f"tp{t} pp{p} dp{d} mb{m} z{z}" for t, p, d, m, z in
                  zip(rows["tp"], rows["pp"], rows["dp"], rows["micro"], rows["zero"])]))
    return _figure(traces, "Searched configurations", "memory per GPU (GB)", "iteration time (s, log)",
                   yaxis={"type": "log"})


MIN_TREND_TRIALS = 5
"""Complete trials below which a study's history or parameter importance shows no trend."""


def fig_history(trials: pd.DataFrame, objective: str, objective_label: str, *, maximize: bool = True,
                shown_of: int | None = None) -> go.Figure:
    """Optimisation history: each complete trial's objective and the best so far, by trial number.

    ``trials`` has columns number, state and ``objective``. With no complete trial the figure is
    a message (no empty axes); with fewer than MIN_TREND_TRIALS the title says so.
    """
    done = trials[(trials["state"] == "COMPLETE") & trials[objective].notna()].sort_values("number")
    title = "Optimisation history" + (f" (newest {len(trials)} of {shown_of} trials)" if shown_of else "")
    if done.empty:
        return empty_figure(title, "no complete trial yet: the history starts with the first one")
    best = done[objective].cummax() if maximize else done[objective].cummin()
    traces = [go.Scatter(x=done["number"], y=done[objective], mode="markers", name="trial",
                         marker={"size": 6}),
              go.Scatter(x=done["number"], y=best, mode="lines", name="best so far", line={"shape": "hv"})]
    notes = []
    if len(done) < MIN_TREND_TRIALS:  # said on the chart, under the title (the toolbar covers long titles)
        notes.append({"text": f"only {len(done)} complete trial{'s' if len(done) != 1 else ''}: no trend yet",
                      "xref": "paper", "yref": "paper", "x": 0, "y": 1.02, "xanchor": "left",
                      "yanchor": "bottom", "showarrow": False, "font": {"size": 13, "color": "#b35c00"}})
    return _figure(traces, title, "trial number", objective_label, height=360, annotations=notes,
                   margin={"t": 70}, xaxis=_whole_ticks(done["number"]))


def fig_prediction_trend(trend: pd.DataFrame) -> go.Figure:
    """Simulator vs real per trial of a warm-started study: measured, predicted and corrected step time
    (left axis, s) and the corrected prediction's running median |error| (right axis, %).

    ``trend`` has the columns of ``tuning.warmstart.prediction_trend``.
    """
    title = "Simulator vs measured step time per trial"
    data = trend.dropna(subset=["measured_step_s"]) if "measured_step_s" in trend else trend.iloc[0:0]
    if data.empty:
        return empty_figure(title, "no trial with a simulator prediction yet (tune with a calibrated profile)")
    x = data["trial"]
    traces = [go.Scatter(x=x, y=data["measured_step_s"], mode="markers", name="measured",
                         marker={"size": 9, "color": "#2ca02c"}),
              go.Scatter(x=x, y=data["predicted_step_s"], mode="markers", name="simulator (raw)",
                         marker={"size": 8, "symbol": "x", "color": "#7f7f7f"}),
              go.Scatter(x=x, y=data["corrected_step_s"], mode="lines+markers", name="simulator (corrected)",
                         marker={"size": 7, "color": "#1f77b4"}),
              go.Scatter(x=x, y=data["trend_abs_error_pct"], mode="lines", name="median |error| so far (%)",
                         yaxis="y2", line={"dash": "dot", "color": "#d62728"})]
    return _figure(traces, title, "trial number", "step time (s)", height=360, xaxis=_whole_ticks(x),
                   yaxis2={"title": {"text": "median |corrected error| (%)"}, "overlaying": "y", "side": "right",
                           "rangemode": "tozero"}, margin={"r": 60})


def _whole_ticks(numbers: pd.Series) -> dict[str, Any]:
    """Axis ticks on whole trial numbers only (plotly's auto ticks put 0.5 between two trials)."""
    return {"dtick": 1} if numbers.max() - numbers.min() <= 20 else {"tickformat": "d"}


def too_few_trials(title: str, done: int, need: int = MIN_TREND_TRIALS) -> go.Figure:
    """The figure shown instead of a study chart that needs more complete trials to mean anything."""
    return empty_figure(title, f"needs at least {need} complete trials to mean anything (have {done})")


def fig_importances(importances: Mapping[str, float], title: str) -> go.Figure:
    """Parameter importances (optuna.importance, fractions summing to 1) as horizontal bars."""
    items = sorted(importances.items(), key=lambda kv: kv[1])
    trace = go.Bar(x=[v for _, v in items], y=[k for k, _ in items], orientation="h",
                   text=[f"{v:.2f}" for _, v in items], textposition="outside", cliponaxis=False,
                   marker_color="#1f77b4", showlegend=False)
    return _figure([trace], title, "importance (fraction of the objective's variance)", "parameter",
                   height=360, xaxis={"range": [0, 1.15 * max([v for _, v in items] or [1.0])]},
                   margin={"l": 140})


def _axis(values: pd.Series, label: str) -> dict[str, Any]:
    """One parallel-coordinates dimension: numbers as they are (log10 when they span decades),
    anything else as categories."""
    numeric = pd.to_numeric(values, errors="coerce")
    if numeric.notna().all() and not values.map(lambda v: isinstance(v, bool)).any():
        lo, hi = float(numeric.min()), float(numeric.max())
        if lo > 0 and hi / lo >= 100:
            ticks = [10.0 ** e for e in range(int(math.floor(math.log10(lo))), int(math.ceil(math.log10(hi))) + 1)]
            return {"label": f"{label} (log)", "values": numeric.map(math.log10),
                    "tickvals": [math.log10(t) for t in ticks], "ticktext": [f"{t:g}" for t in ticks]}
        return {"label": label, "values": numeric}
    cats = sorted(values.astype(str).unique())
    codes = values.astype(str).map({c: i for i, c in enumerate(cats)})
    return {"label": label, "values": codes, "tickvals": list(range(len(cats))), "ticktext": cats}


def fig_parallel(frame: pd.DataFrame, params: Sequence[str], objective: str, title: str) -> go.Figure:
    """Parallel coordinates of complete trials: one axis per parameter and the objective last,
    lines coloured by the objective (its colour bar has no legend beside it)."""
    dims = [_axis(frame[p], p.removeprefix("param:")) for p in params]
    dims.append({"label": objective, "values": frame[objective]})
    trace = go.Parcoords(dimensions=dims, line={"color": frame[objective], "colorscale": "Viridis",
                                                "showscale": True, "colorbar": {"title": {"text": objective}}})
    return go.Figure(data=[trace], layout={"title": {"text": title}, "height": 360,
                                           "margin": {"l": 60, "r": 40, "t": 80, "b": 30}})


def label_optuna(fig: go.Figure, title: str, objective_label: str) -> go.Figure:
    """Give an optuna.visualization figure our title and the objective's name with its unit."""
    fig.update_layout(title={"text": title}, height=360, margin={"l": 50, "r": 20, "t": 50, "b": 45})
    if fig.layout.yaxis and fig.layout.yaxis.title and fig.layout.yaxis.title.text == "Objective Value":
        fig.update_yaxes(title={"text": objective_label})
    return fig
