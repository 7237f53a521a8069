"""An HTML report of a Frontier-style simulator search: the answer first, then the best configs,
sensitivity figures and, folded away, every column.

Readable on a laptop screen: the page is at most ``PAGE_WIDTH_PX`` wide, the main table shows
only the key columns (the rest sit in a scrollable ``<details>`` table), and each sensitivity
bar is the best fitting configuration at one value of a knob (never a sum of several configs).
"""
from __future__ import annotations

import html
from pathlib import Path

import pandas as pd

PAGE_WIDTH_PX = 1100
KEY_COLUMNS = {  # column of enumerate_configs: header in the main table (short: the table must fit)
    "layout": "layout", "micro": "micro", "zero": "ZeRO", "recompute": "recompute",
    "sequence_parallel": "seq. par.", "schedule": "schedule",
    "iteration_time_s": "iter. (s)", "vs_best": "vs best", "tflops_per_gpu": "TFLOP/s/GPU",
    "mfu_pct": "MFU (%)", "memory_per_gpu_gb": "GB/GPU", "extrapolated": "extrapolated",
}
STYLE = f"""
body {{ font-family: system-ui, sans-serif; max-width: {PAGE_WIDTH_PX}px; margin: 1.5em auto;
       padding: 0 1em; color: #222; }}
.answer {{ font-size: 1.2em; background: #eef5ff; border-left: 4px solid #1f77b4; padding: .6em 1em; }}
.scroll {{ overflow-x: auto; max-width: 100%; }}
table {{ border-collapse: collapse; font-size: .85em; }}
th, td {{ padding: .2em .5em; border-bottom: 1px solid #ddd; text-align: right; white-space: nowrap; }}
th {{ background: #f4f4f4; }}
details {{ margin: .8em 0; }}
"""


def _layout(row: pd.Series) -> str:
    return f"tp{int(row['tp'])} pp{int(row['pp'])} dp{int(row['dp'])}" + (
        f" v{int(row['virtual'])}" if int(row.get("virtual", 1)) > 1 else "") + (
        f" cp{int(row['cp'])} {row.get('cp_impl', '')}" if int(row.get("cp", 1)) > 1 else "") + (
        f" ep{int(row['ep'])}" if int(row.get("ep", 1)) > 1 else "")


def headline(df: pd.DataFrame, best: pd.DataFrame) -> str:
    """One sentence: the fastest configuration that fits and its figures (or why there is none)."""
    if best.empty:
        if df.empty:
            return "No valid configuration: no tp x pp x dp layout divides this model and GPU count."
        least = df.nsmallest(1, "memory_per_gpu_gb").iloc[0]
        return (f"No configuration fits in memory: the leanest ({_layout(least)}, ZeRO {int(least['zero'])}, "
                f"recompute {least['recompute']}) needs {least['memory_per_gpu_gb']:.1f} GB per GPU.")
    top = best.iloc[0]
    return (f"Fastest configuration that fits: <b>{_layout(top)}</b>, micro batch {int(top['micro'])}, "
            f"ZeRO {int(top['zero'])}, recompute {top['recompute']}, schedule {top['schedule']}: "
            f"<b>{top['iteration_time_s']:.3g} s per iteration</b>, {top['tokens_per_s']:,.0f} tokens/s, "
            f"{top['tflops_per_gpu']:.1f} TFLOP/s per GPU (MFU {100 * top['mfu']:.1f} %), "
            f"{top['memory_per_gpu_gb']:.1f} GB per GPU.")


def key_table(best: pd.DataFrame) -> pd.DataFrame:
    """The best configurations with only the columns a reader compares (short headers)."""
    if best.empty:
        return pd.DataFrame(columns=list(KEY_COLUMNS.values()))
    out = best.assign(layout=best.apply(_layout, axis=1),
                      vs_best=[f"+{100 * (t / best['iteration_time_s'].iloc[0] - 1):.1f} %"
                               for t in best["iteration_time_s"]],
                      mfu_pct=100 * best["mfu"])
    out = out[[c for c in KEY_COLUMNS if c in out]].rename(columns=KEY_COLUMNS)
    return out.round(2)


def sensitivity_keys(table: pd.DataFrame) -> list[str]:
    """The knob columns of a `tuning.search.sensitivities` table (those before the results)."""
    keys = []
    for col in table.columns:
        if col == "iteration_time_s":
            break
        keys.append(col)
    return keys or [table.columns[0]]


def _value_label(row: pd.Series, keys: list[str]) -> str:
    parts = []
    for k in keys:
        v = row[k]
        if k == "tp_spans_nodes":
            parts.append("across nodes" if bool(v) else "within a node")
        else:
            parts.append(f"{k} {v}")
    return ", ".join(parts)


def _config_text(row: pd.Series) -> str:
    return ", ".join(f"{k} {row[k]}" for k in ("tp", "pp", "dp", "virtual", "micro", "zero", "recompute")
                     if k in row)


def sensitivity_figure(name: str, table: pd.DataFrame, overall_best_s: float | None):
    """One bar per value of the knob: the best fitting config's iteration time at that value."""
    import plotly.graph_objects as go

    keys = sensitivity_keys(table)
    labels = [_value_label(row, keys) for _, row in table.iterrows()]
    times = table["iteration_time_s"].astype(float)
    text = [f"{t:.3g} s" + (f" (+{100 * (t / overall_best_s - 1):.0f} %)" if overall_best_s else "")
            for t in times]
    fig = go.Figure(go.Bar(x=labels, y=times, text=text, textposition="outside", cliponaxis=False,
                           marker_color="#1f77b4", showlegend=False,
                           hovertext=[_config_text(r) for _, r in table.iterrows()]))
    note = ""
    if overall_best_s:  # the line is named in the title: a label on it would sit on the bars' labels
        fig.add_hline(y=overall_best_s, line_dash="dash", line_color="#d62728")
        note = f"; dashed: overall best {overall_best_s:.3g} s"
    fig.update_layout(title=f"Sensitivity: {name.replace('_', ' ')} (best fitting config at each value{note})",
                      xaxis_title=" / ".join(k.replace("_", " ") for k in keys),
                      yaxis_title="iteration time (s)", height=340, showlegend=False,
                      margin={"l": 60, "r": 20, "t": 60, "b": 60},
                      yaxis_range=[0, 1.18 * float(times.max())] if len(times) else None,
                      # many values: a label wider than its bar is hidden (hover keeps it), never overlapping
                      uniformtext={"minsize": 9, "mode": "hide"})
    return fig


def scatter_figure(df: pd.DataFrame):
    """Configs that fit: TFLOP/s per GPU against memory per GPU, coloured by tp (legend below)."""
    import plotly.express as px

    fits = df[df["fits"]].copy()
    fits["tp"] = "tp " + fits["tp"].astype(str)
    fits["ZeRO"] = "ZeRO " + fits["zero"].astype(str)
    order = sorted(fits["tp"].unique(), key=lambda s: int(s.split()[1]))
    fig = px.scatter(fits, x="memory_per_gpu_gb", y="tflops_per_gpu", color="tp", symbol="ZeRO",
                     category_orders={"tp": order},
                     hover_data=["pp", "dp", "micro", "virtual", "recompute", "iteration_time_s"],
                     title="Configurations that fit: TFLOP/s per GPU against memory per GPU",
                     labels={"memory_per_gpu_gb": "memory per GPU (GB)", "tflops_per_gpu": "TFLOP/s per GPU"})
    fig.update_layout(height=420, legend={"orientation": "h", "y": -0.2, "x": 0, "title_text": ""},
                      margin={"l": 60, "r": 20, "t": 60, "b": 40})
    return fig


def sensitivity_figures(df: pd.DataFrame, sens: dict[str, pd.DataFrame]) -> list:
    """Plotly figures (units in every title and axis) from the search's DataFrame and tables."""
    fits = df[df["fits"]]
    best_s = float(fits["iteration_time_s"].min()) if not fits.empty else None
    figs = [scatter_figure(df)] if not fits.empty else []
    for name, table in sens.items():
        if not table.empty and "iteration_time_s" in table:
            figs.append(sensitivity_figure(name, table, best_s))
    return figs


def _table_html(table: pd.DataFrame) -> str:
    return "<div class='scroll'>" + table.round(3).to_html(index=False, border=0) + "</div>"


def domain_note(domain: dict | None, interval_s: list[float] | None = None) -> str:
    """One paragraph on the top choice's domain of validity (tuning/sim/domain.py `prediction`)."""
    if not domain:
        return ""
    near = "; ".join(f"{n['id']} ({n['error_pct']:+.1f}%)" for n in domain.get("nearest", []))
    span = f" Measured time likely in {interval_s[0]:.3g} .. {interval_s[1]:.3g} s." if interval_s else ""
    if domain.get("inside"):
        return f"<p>Inside the validated domain ({html.escape(domain['cell'])}).{span} Nearest validated rows: {html.escape(near)}.</p>"
    why = "; ".join(domain.get("reasons", []))
    return (f"<p class='answer'><b>Extrapolated</b>: {html.escape(why)} (distance {domain['distance']:g}, "
            f"interval widened).{span} Nearest validated rows: {html.escape(near)}.</p>")


def write_report(path: Path, df: pd.DataFrame, best: pd.DataFrame, sens: dict[str, pd.DataFrame], *,
                 title: str, domain: dict | None = None, interval_s: list[float] | None = None) -> Path:
    """Write the report: headline answer (and the top choice's domain of validity), key table, figures,
    then every column folded away."""
    figs = sensitivity_figures(df, sens)
    outside = int(df["extrapolated"].sum()) if "extrapolated" in df else 0
    parts = [f"<h1>{html.escape(title)}</h1>",
             f"<p class='answer'>{headline(df, best)}</p>", domain_note(domain, interval_s),
             f"<p>{len(df):,} valid configurations searched, {int(df['fits'].sum()):,} fit in memory, "
             f"{outside:,} extrapolated (outside the published rows the simulator was checked on).</p>",
             "<h2>Best configurations</h2>", _table_html(key_table(best))]
    for i, fig in enumerate(figs):
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0), default_width="100%",
                                 config={"responsive": True}))
    parts += ["<h2>Details</h2>",
              "<details><summary>Best configurations, every column</summary>" + _table_html(best) + "</details>"]
    for name, table in sens.items():
        parts.append(f"<details><summary>Sensitivity table: {html.escape(name.replace('_', ' '))}</summary>"
                     + _table_html(table) + "</details>")
    path.write_text("<!DOCTYPE html><html><head><meta charset='utf-8'><title>" + html.escape(title)
                    + f"</title><style>{STYLE}</style></head><body>" + "\n".join(parts) + "</body></html>")
    return path
