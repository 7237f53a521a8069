"""The workbench dashboard: `streamlit run app.py` (or `workbench app`, bound to 127.0.0.1).

Thin by design (STYLE habit 12): page config and navigation only; each page lives in
`workbench/app_pages/` and the logic in plain modules.
"""
import streamlit as st

from workbench import ui_state

st.set_page_config(page_title="Workbench", page_icon=":material/tune:", layout="wide")

PAGES = [
    st.Page("workbench/app_pages/home.py", title="Overview", icon=":material/home:", default=True),
    st.Page("workbench/app_pages/plan.py", title="Plan", icon=":material/format_list_numbered:"),
    st.Page("workbench/app_pages/hardware.py", title="Hardware", icon=":material/memory:"),
    st.Page("workbench/app_pages/run.py", title="Run", icon=":material/play_circle:"),
    st.Page("workbench/app_pages/tune.py", title="Tune", icon=":material/tune:"),
    st.Page("workbench/app_pages/whatif.py", title="What-if", icon=":material/science:"),
    st.Page("workbench/app_pages/compare.py", title="Compare", icon=":material/compare_arrows:"),
    st.Page("workbench/app_pages/export.py", title="Export", icon=":material/download:"),
]
ui_state.reap_children()  # background launchers and tuning workers that ended: no <defunct> left
st.navigation(PAGES).run()
