"""The workbench dashboard: `streamlit run app.py` (or `workbench app`, bound to 127.0.0.1).

Thin by design (STYLE habit 12): page config and navigation only; each page lives in
`workbench/app_pages/` and the logic in plain modules.
"""
import streamlit as st

st.set_page_config(page_title="Workbench", page_icon="⚙️", layout="wide")

PAGES = [
    st.Page("workbench/app_pages/home.py", title="Overview", icon="🏠", default=True),
    st.Page("workbench/app_pages/hardware.py", title="Hardware", icon="🖥️"),
    st.Page("workbench/app_pages/run.py", title="Run", icon="▶️"),
    st.Page("workbench/app_pages/tune.py", title="Tune", icon="🎛️"),
    st.Page("workbench/app_pages/whatif.py", title="What-if", icon="🔮"),
    st.Page("workbench/app_pages/compare.py", title="Compare", icon="📊"),
    st.Page("workbench/app_pages/export.py", title="Export", icon="📦"),
]
st.navigation(PAGES).run()
