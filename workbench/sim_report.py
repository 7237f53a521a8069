"""An HTML report of a Frontier-style simulator search: best configs and sensitivity figures."""
from __future__ import annotations

import html
from pathlib import Path

import pandas as pd


def sensitivity_figures(df: pd.DataFrame, sens: dict[str, pd.DataFrame]) -> list:
    """Plotly figures (units in every title and axis) from the search's DataFrame and tables."""
    import plotly.express as px

    figs = []
    fits = df[df["fits"]]
    if not fits.empty:
        figs.append(px.scatter(fits, x="memory_per_gpu_gb", y="tflops_per_gpu", color="tp", symbol="zero",
                               hover_data=["tp", "pp", "dp", "micro", "virtual", "recompute"],
                               title="Configs that fit: TFLOP/s per GPU vs memory per GPU",
                               labels={"memory_per_gpu_gb": "memory per GPU (GB)",
                                       "tflops_per_gpu": "TFLOP/s per GPU"}))
    for name, table in sens.items():
        numeric = [c for c in table.columns if c.startswith(("tflops", "tokens", "iteration", "mfu"))]
        if table.empty or not numeric:
            continue
        x = table.columns[0]
        figs.append(px.bar(table, x=table[x].astype(str), y=numeric[0], title=f"Sensitivity: {name}",
                           labels={"x": x, numeric[0]: numeric[0].replace("_", " ")}))
    return figs


def write_report(path: Path, df: pd.DataFrame, best: pd.DataFrame, sens: dict[str, pd.DataFrame], *,
                 title: str) -> Path:
    figs = sensitivity_figures(df, sens)
    parts = [f"<h1>{html.escape(title)}</h1>",
             f"<p>{len(df):,} valid configurations, {int(df['fits'].sum()):,} fit in memory.</p>",
             "<h2>Best configurations</h2>", best.round(3).to_html(index=False)]
    for name, table in sens.items():
        parts += [f"<h2>{html.escape(name)}</h2>", table.round(3).to_html(index=False)]
    for i, fig in enumerate(figs):
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
    path.write_text("<html><head><meta charset='utf-8'><title>" + html.escape(title) + "</title></head><body>"
                    + "\n".join(parts) + "</body></html>")
    return path
