"""One tensor-parallel run through the CLI (`run --json`, `show --json`) and what users read from
it: TP collectives with bytes and bus bandwidth, their time as exposed communication (also in the
tuner's compute/comm split), and per-rank traces with ProfilerStep spans that Holistic Trace
Analysis loads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.xdist_group("launch"), pytest.mark.slow]

# gloo: two ranks on a machine with one GPU (the device machine) would otherwise get NCCL and be refused
TP_RUN = ["backend=gloo", "parallel.dp=1", "parallel.tp=2", "model.layers=2", "model.d_model=32", "model.heads=4",
          "model.seq_len=32", "batch.global=4", "batch.micro=2", "train.steps=4", "train.warmup_steps=0",
          "profile.trace_steps=[1, 2]", "profile.nvml_interval_s=0", "profile.host_interval_s=0",
          "profile.warmup_steps=1", "train.timeout_s=60"]


def _cli(home: Path, *args: str) -> dict:
    env = {**os.environ, "WORKBENCH_HOME": str(home), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "workbench.cli", *args], capture_output=True, text=True,
                         env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory) -> dict:
    home = tmp_path_factory.mktemp("tp-home")
    ran = _cli(home, "run", *[a for kv in TP_RUN for a in ("--set", kv)], "--json")
    shown = _cli(home, "show", ran["run_id"], "--json")
    return {"home": home, "run": ran, "show": shown}


def test_tp_run_shows_tp_collectives_with_bytes_busbw_and_exposed_time(tp_run):
    run, show = tp_run["run"], tp_run["show"]
    assert run["status"] == "completed" and run["wire_bytes"] > 0
    tp = show["collectives"]["tp:all_reduce"]
    assert tp["count"] > 0 and tp["bytes"] > 0 and tp["time(s)"] > 0 and tp["busbw(GB/s)"] > 0
    # forward: batch 2 x seq 32 x d_model 32 fp32 per row-parallel output, 2 per block, 2 blocks
    assert tp["bytes"] >= 4 * (2 * 32 * 32 * 4) * 2 * 4
    assert {(row["step"], row["rank"]) for row in show["breakdown"]} == {(s, r) for s in range(4) for r in (0, 1)}
    for row in show["breakdown"]:
        assert row["comm_exposed"] > 0, row  # TP time on the critical path, out of forward/backward
        assert row["forward"] > 0 and row["backward"] > 0, row
    assert set(show["breakdown_unexplained"]) == {"0", "1"}  # JSON keys: the ranks


def test_tp_breakdown_records_the_independent_wall_time(tp_run):
    """Each step's own wall time is stored beside its breakdown; whether the phases explain it
    within 2% is a timing claim (bench/timing_claims.py breakdown --tp 2)."""
    from profilers.store import RunStore

    store = RunStore.open_home(tp_run["home"])
    run_id = tp_run["run"]["run_id"]
    walls = store.metrics(run_id, kind="step", name="wall_time(s)")
    table = store.breakdown_table(run_id)
    assert sorted((w.step, w.rank) for w in walls) == sorted(zip(table["step"], table["rank"]))
    assert len(walls) == 8 and all(w.value > 0 for w in walls)


def test_tuner_split_of_a_tp_trial_counts_tp_communication(tp_run):
    import optuna

    from engine.config.schema import load_config
    from tuning.objective import Objective
    from tuning.space import SearchSpace

    objective = Objective(load_config(None, TP_RUN), SearchSpace([]), home=tp_run["home"], warmup_steps=1)
    trial = optuna.trial.FixedTrial({})
    objective._attach_breakdown(trial, tp_run["run"]["run_id"])
    attrs = trial.user_attrs
    assert attrs["comm_exposed_s"] > 0 and attrs["compute_s"] > 0
    assert attrs["comm_by_axis"]["tp"]["bytes"] > 0 and attrs["comm_by_axis"]["tp"]["time_s"] > 0
    assert attrs["tp_comm_s"] == attrs["comm_by_axis"]["tp"]["time_s"]


def test_traces_have_profiler_steps_and_distributed_info_per_rank(tp_run):
    run, show = tp_run["run"], tp_run["show"]
    assert run["trace_dir"] and run["trace_dir"] == show["trace_dir"]
    files = sorted(Path(run["trace_dir"]).glob("*.json"))
    assert [f.name for f in files] == ["trace_rank0_steps1-2.json", "trace_rank1_steps1-2.json"]
    for rank, path in enumerate(files):
        trace = json.loads(path.read_text())
        assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["world_size"] == 2
        steps = sorted(e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#"))
        assert steps == ["ProfilerStep#1", "ProfilerStep#2"]


def test_hta_trace_analysis_loads_our_traces(tp_run):
    hta = pytest.importorskip("hta.trace_analysis", reason="HolisticTraceAnalysis not installed (make install)")
    analysis = hta.TraceAnalysis(trace_dir=tp_run["run"]["trace_dir"])
    assert sorted(analysis.t.get_ranks()) == [0, 1]
    assert len(analysis.get_profiler_steps()) >= 1  # "ProfilerStep not found" on traces without steps
    overlap = analysis.get_comm_comp_overlap(visualize=False)
    assert sorted(overlap["rank"]) == [0, 1]


def test_hta_gpu_kernel_analyses(tmp_path):
    """HTA's kernel analyses on a trace with GPU kernels: one rank on the GPU (NCCL), traced steps 1-2."""
    import torch

    hta = pytest.importorskip("hta.trace_analysis", reason="HolisticTraceAnalysis not installed (make install)")
    if not torch.cuda.is_available():
        pytest.skip("HTA's temporal breakdown needs GPU kernels: this machine has no CUDA GPU")
    one_gpu = [kv for kv in TP_RUN if not kv.startswith(("backend=", "parallel.tp="))]
    ran = _cli(tmp_path, "run", *[a for kv in one_gpu for a in ("--set", kv)], "--json")
    analysis = hta.TraceAnalysis(trace_dir=ran["trace_dir"])
    assert not analysis.get_temporal_breakdown(visualize=False).empty


def test_dashboard_run_page_lists_tp_traffic(tp_run, monkeypatch):
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("WORKBENCH_HOME", str(tp_run["home"]))
    st.cache_data.clear()
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=60)
    at.switch_page("workbench/app_pages/run.py")
    at.run()
    assert not at.exception
    frames = [df.value for df in at.dataframe if "axis" in df.value.columns]
    assert len(frames) == 1
    tp = frames[0][frames[0]["axis"] == "tp"]
    assert list(tp["traffic"]) == ["TP/SP"] and list(tp["op"]) == ["all_reduce"]
    # the page shows sizes for people ("768.2 KiB"); the number in front is what must be non-zero
    amount, unit = tp["bytes"].iloc[0].split()
    rate, rate_unit = tp["busbw"].iloc[0].split()  # a bandwidth for people too ("22.7 MB/s")
    assert float(amount.replace(",", "")) > 0 and unit in ("B", "KiB", "MiB", "GiB")
    assert float(rate.replace(",", "")) > 0 and rate_unit in ("B/s", "kB/s", "MB/s", "GB/s", "TB/s")
