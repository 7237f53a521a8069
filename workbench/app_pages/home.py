"""Overview: what is in this home (runs, studies, background work) and where to go next."""
import streamlit as st

from workbench import fmt, ui_state
from workbench.app_pages import common

st.title("Workbench overview")
st.caption(f"Home: `{common.home()}` (set WORKBENCH_HOME to use another)")

runs = common.runs_table(str(common.home()))
studies = common.studies_table(str(common.home()))
jobs = ui_state.running_jobs(common.home())
cols = st.columns(4)
cols[0].metric("runs", len(runs))
cols[1].metric("running now", int((runs["status"] == "running").sum()) if len(runs) else 0)
cols[2].metric("studies", len(studies))
cols[3].metric("background launches", len(jobs))

st.subheader("Recent runs")
if runs.empty:
    common.empty_runs_message()
else:
    st.dataframe(runs.head(20), hide_index=True, width="stretch")
st.subheader("Studies")
if studies.empty:
    st.info("No studies yet: start one on the **Tune** page, or `workbench tune SPACE.yaml`.")
else:
    # the first objective is tokens/s: 29,395 (it read 29395)
    shown = studies.assign(best=[fmt.num(round(v)) if v == v and v is not None else "" for v in studies["best"]])
    st.dataframe(shown.rename(columns={"best": "best tokens/s"}), hide_index=True, width="stretch")
