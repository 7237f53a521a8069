"""Hardware: GPUs (NVML) with live utilisation, memory, power and clocks; CPU, memory, network. Every
label is a quantity named for people with its unit (`fmt.quantity`: 'memory total (GiB)', not the
recorded key 'memory_total(GiB)')."""
from __future__ import annotations

import time
from typing import Any

import pandas as pd
import psutil
import streamlit as st

from profilers import nvml
from workbench import fmt
from workbench.app_pages import common

GIB = float(1 << 30)


@st.cache_resource(show_spinner=False)
def _static_facts() -> dict[str, Any]:
    """Facts that do not change while the server runs: host, versions, GPU inventory (no torch import)."""
    return common.machine_facts()


@st.cache_resource(show_spinner="Reading torch's distributed backends (imports torch once)…")
def _backends() -> dict[str, Any]:
    return common.distributed_backends()


@st.cache_resource
def _gpu_sampler() -> Any:
    return nvml.NvmlSampler(interval=1.0)


def _net_rates() -> dict[str, float]:
    """Bytes/s received and sent since the previous refresh of this session."""
    counters = psutil.net_io_counters()
    now = time.monotonic()
    last = st.session_state.get("hw_net")
    st.session_state["hw_net"] = (now, counters.bytes_recv, counters.bytes_sent)
    if not last or now <= last[0]:
        return {"rx": 0.0, "tx": 0.0}
    return {"rx": (counters.bytes_recv - last[1]) / (now - last[0]),
            "tx": (counters.bytes_sent - last[2]) / (now - last[0])}


@st.fragment(run_every=2.0)
def live() -> None:
    """GPU samples and host CPU / memory / network, refreshed every 2 s."""
    facts = _static_facts()
    if facts["nvml"]:
        sample = _gpu_sampler().sample()
        rows: dict[str, dict[str, float]] = {}
        for key, value in sample.items():
            gpu, _, field = key.partition("/")
            rows.setdefault(gpu, {})[field] = value
        gpus = pd.DataFrame.from_dict(rows, orient="index")
        st.dataframe(gpus.rename(columns=fmt.quantity, index=lambda g: g.upper().replace("GPU", "GPU ")),
                     width="stretch")
    mem = psutil.virtual_memory()
    net = _net_rates()
    cols = st.columns(4)
    cols[0].metric("CPU busy (%)", f"{psutil.cpu_percent(None):.0f}")
    cols[1].metric("memory used (GiB)", f"{(mem.total - mem.available) / GIB:.1f} / {mem.total / GIB:.1f}")
    cols[2].metric("network received (MB/s)", f"{net['rx'] / 1e6:.2f}")
    cols[3].metric("network sent (MB/s)", f"{net['tx'] / 1e6:.2f}")
    per_core = psutil.cpu_percent(None, percpu=True)
    st.bar_chart(pd.DataFrame({"busy (%)": per_core}, index=[f"cpu{i}" for i in range(len(per_core))]),
                 x_label="core", y_label="busy (%)", height=200)


st.title("Hardware")
FACTS = _static_facts()
st.subheader("GPUs")
if FACTS["gpus"]:
    st.dataframe(pd.DataFrame(FACTS["gpus"]).rename(columns=fmt.quantity), hide_index=True, width="stretch")
else:
    st.info(f"No NVIDIA GPU visible ({FACTS['nvml_reason'] or 'NVML unavailable'}): runs use CPU "
            "ranks over gloo; GPU timelines stay empty.")
st.subheader("Live")
live()
st.subheader("Machine and software")
host = dict(FACTS["host"])
versions = host.pop("versions", {}) or {}
left, right = st.columns(2)
left.dataframe(pd.DataFrame({"value": {fmt.quantity(k): str(v) for k, v in host.items()}}), width="stretch")
right.dataframe(pd.DataFrame({"version": {k: v or "not installed" for k, v in versions.items()}}), width="stretch")
# last: the one fact that needs torch imported (~3 s the first time on a busy host); the rest is drawn
st.caption("Distributed backends: " + ", ".join(f"{k}: {'yes' if v is True else ('no' if v is False else v)}"
                                                 for k, v in _backends().items()))
