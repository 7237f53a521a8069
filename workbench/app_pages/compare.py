"""Compare: pick runs (or the runs of study trials) and overlay their curves and breakdowns."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from profilers.records import PHASES
from workbench import plots
from workbench.app_pages import common

st.title("Compare")
HOME = str(common.home())
runs = common.runs_table(HOME)
if runs.empty:
    common.empty_runs_message()
    st.stop()
labels = {row["run_id"]: common.run_label(row) for _, row in runs.iterrows()}
default = [r for r in list(labels)[:2]]
picked = st.multiselect("Runs (a study trial's run is named after its study and trial)", list(labels),
                        default=default, format_func=labels.__getitem__)
if len(picked) < 1:
    st.info("Pick one or more runs to overlay.")
    st.stop()
curves, means = [], {}
for run_id in picked:
    data = common.run_data(HOME, run_id)
    steps = data["steps"].assign(run=run_id)
    curves.append(steps)
    table = common.store().breakdown_steps(run_id, max_steps=None)  # every step: an exact mean
    if len(table):
        means[run_id] = table[[p for p in PHASES if p in table]].mean()
curves_df = pd.concat(curves, ignore_index=True)
left, right = st.columns(2)
if "loss" in curves_df:
    left.plotly_chart(plots.fig_compare_curves(curves_df, "loss", "loss (nats/token)"), width="stretch")
if "tokens_per_s" in curves_df:
    right.plotly_chart(plots.fig_compare_curves(curves_df, "tokens_per_s", "throughput (tokens/s)"),
                       width="stretch")
if means:
    st.plotly_chart(plots.fig_compare_breakdown(pd.DataFrame(means).T), width="stretch")
st.subheader("Side by side")
table = common.store().compare(picked)
st.dataframe(common.side_by_side(table), width="stretch")
