"""Profiling through the real engine: breakdown per step per rank, DDP collectives covering every
gradient byte, a reader seeing rows grow during a run, a killed run keeping its steps, memory
accounting next to the estimate, and the torch.profiler trace window."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from engine.config.schema import load_config
from engine.errors import RankFailure
from engine.launch.local import launch
from engine.model.gpt import build_model
from profilers.steps import StepTimer, check_breakdown
from profilers.store import RunStore

pytestmark = pytest.mark.xdist_group("launch")

TINY = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=32", "batch.global=8",
        "batch.micro=2", "parallel.dp=2", "train.warmup_steps=0", "profile.nvml_interval_s=0",
        "profile.host_interval_s=0.2", "train.timeout_s=30"]


def test_two_rank_run_records_breakdown_collectives_memory_and_trace(tmp_path):
    cfg = load_config(None, TINY + ["train.steps=4", "profile.trace_steps=[1, 2]", "ddp.bucket_cap_mb=0.05"])
    result = launch(cfg, home=tmp_path)
    store = RunStore.open_home(tmp_path)
    table = store.breakdown_table(result.run_id)
    assert sorted(zip(table["step"], table["rank"])) == [(s, r) for s in range(4) for r in range(2)]
    # each step's wall time (the trainer's own clock) is recorded beside its breakdown; whether the
    # phases explain it within 2% is a timing claim: bench/timing_claims.py breakdown
    walls = store.metrics(result.run_id, kind="step", name="wall_time(s)")
    assert sorted((w.step, w.rank) for w in walls) == [(s, r) for s in range(4) for r in range(2)]
    assert all(w.value > 0 for w in walls)
    grad_bytes = 4 * sum(p.numel() for p in build_model(cfg.model, seed=0).parameters())
    per_step: dict[tuple[int, int], dict[str, float]] = {}
    for rec in store.metrics(result.run_id, kind="comm"):
        per_step.setdefault((rec.step, rec.rank), {})[rec.name] = rec.value
    for key, values in per_step.items():
        # every gradient byte went through a DDP bucket, and the buckets through all_reduce
        assert values["dp:ddp_bucket/bytes"] == grad_bytes, key
        if key[0] >= 1:  # DDP rebuilds its buckets to bucket_cap_mb after the first step
            assert values["dp:ddp_bucket/count"] > 1, key
        assert values["dp:all_reduce/bytes"] >= grad_bytes
        assert values["dp:all_reduce/busbw(GB/s)"] > 0
    totals = store.comm_totals(result.run_id)
    assert totals["dp:ddp_bucket"]["bytes"] == 4 * grad_bytes
    memory = {(r.rank, r.name): r.value for r in store.metrics(result.run_id, kind="memory")}
    for rank in range(2):
        for part in ("params", "grads", "optimizer"):
            measured, estimate = memory[(rank, f"{part}(GiB)")], memory[(rank, f"estimate_{part}(GiB)")]
            assert abs(measured - estimate) <= 0.05 * estimate, (part, measured, estimate)
        assert memory[(rank, "estimate_activations(GiB)")] > 0
    host = store.metrics(result.run_id, kind="host")
    assert {r.name for r in host} >= {"cpu(%)", "rss(GiB)"}
    traces = result.summary["traces"]
    assert len(traces) == 2  # one per rank
    events = json.loads(open(traces[0]).read())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::mm") or n.startswith("aten::addmm") for n in names)  # the model's GEMMs
    assert any("all_reduce" in n for n in names)  # and DDP's gloo all-reduce
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == ["ProfilerStep#1", "ProfilerStep#2"]


def assert_breakdowns_explain_wall_time(table, walls, tolerance: float = 0.02) -> None:
    """Per rank, the median step's timed phases explain its wall time by the product's own rule,
    `check_breakdown`: within `tolerance` plus 1 ms of clock reads and glue between phases (about
    0.35 ms a step here, 2.3% of a 15 ms step on a fast host). Median: a stall of this shared
    machine between two phases must not fail the test."""
    by_rank: dict[int, list[tuple[float, str | None]]] = {}
    for rec in walls:
        row = table[(table["step"] == rec.step) & (table["rank"] == rec.rank)].iloc[0]
        phases = {k: v for k, v in row.items() if k not in ("step", "rank", "total")}
        named = sum(v for k, v in phases.items() if k != "other")
        excess = abs(rec.value - named) - (tolerance * rec.value + 1e-3)
        by_rank.setdefault(rec.rank, []).append((excess, check_breakdown(phases, rec.value, tolerance=tolerance)))
    for rank, checks in by_rank.items():
        excess, line = sorted(checks)[len(checks) // 2]  # the median step (upper middle)
        assert excess <= 0, (rank, line, [round(e, 5) for e, _ in checks])


def test_the_breakdown_check_allows_a_fast_steps_glue_but_not_a_dropped_phase():
    """On a fast host a tiny step takes 12 ms of which 0.35 ms is glue between phases (timer,
    scopes, loop): 2.9%, which a bare 2% rule failed (CI, stop 26); a dropped 3 ms phase must
    still fail."""
    import pandas as pd
    from types import SimpleNamespace

    def run(gap_s: float):
        rows, walls = [], []
        for step in range(4):
            rows.append({"step": step, "rank": 0, "data": 0.0003, "forward": 0.004, "backward": 0.005 - gap_s,
                         "optimizer": 0.0022, "comm_exposed": 0.0005, "bubble": 0.0,
                         "other": gap_s, "total": 0.012})
            walls.append(SimpleNamespace(step=step, rank=0, value=0.012))
        return pd.DataFrame(rows), walls

    assert_breakdowns_explain_wall_time(*run(0.00035))
    with pytest.raises(AssertionError):
        assert_breakdowns_explain_wall_time(*run(0.003))


def test_reader_sees_rows_grow_while_the_run_goes_on(tmp_path):
    cfg = load_config(None, TINY + ["train.steps=40", "model.layers=4", "model.d_model=64"])
    store = RunStore.open_home(tmp_path)
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(r=launch(cfg, home=tmp_path, run_id="live-run")))
    thread.start()
    seen = []
    while thread.is_alive():
        run = store.run("live-run")
        if run is not None and run["status"] == "running":
            steps = store.latest_steps("live-run", n=1)
            if steps:
                seen.append(steps[-1]["step"])
        time.sleep(0.2)
    thread.join()
    assert box["r"].status == "completed"
    growth = sorted(set(seen))
    assert len(growth) >= 3  # several distinct steps seen while the run was still running


def test_killed_run_keeps_completed_steps_and_is_marked_failed(tmp_path):
    cfg = load_config(None, TINY + ["train.steps=8"])
    with pytest.raises(RankFailure):
        launch(cfg, home=tmp_path, run_id="killed", extra_env={"WORKBENCH_FAULT": "rank=1,step=5,kind=kill"})
    store = RunStore.open_home(tmp_path)
    run = store.run("killed")
    assert run["status"] == "failed" and run["error_rank"] == 1 and "SIGKILL" in run["error"]
    table = store.breakdown_table("killed")
    for rank in range(2):
        assert sorted(table[table["rank"] == rank]["step"]) == [0, 1, 2, 3, 4]


def test_show_and_runs_json(tmp_path):
    cfg = load_config(None, TINY + ["train.steps=3"])
    result = launch(cfg, home=tmp_path)
    env = {"WORKBENCH_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "show", result.run_id, "--json"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["status"] == "completed" and report["config"]["parallel"]["dp"] == 2
    assert {row["rank"] for row in report["breakdown"]} == {0, 1}
    assert report["collectives"]["dp:all_reduce"]["busbw(GB/s)"] > 0
    assert set(report["peak_memory_gib"]) == {"0", "1"} or set(report["peak_memory_gib"]) == {0, 1}
    runs = subprocess.run([sys.executable, "-m", "workbench.cli", "runs", "--json"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert [r["run_id"] for r in json.loads(runs.stdout)] == [result.run_id]
    missing = subprocess.run([sys.executable, "-m", "workbench.cli", "show", "nope"], capture_output=True,
                             text=True, env=env, timeout=120)
    assert missing.returncode == 2 and "no such run" in missing.stderr and "Traceback" not in missing.stderr


def test_breakdown_check_fails_when_a_phase_is_dropped(monkeypatch):
    """The check compares the timed phases with the trainer's own wall clock, so a phase that
    is never timed shows up as unexplained time (``other`` would absorb it and still add up)."""
    import contextlib

    import torch

    from engine.train.trainer import Trainer

    cfg = load_config(None, TINY + ["parallel.dp=1", "model.d_model=64", "model.seq_len=64", "train.steps=8"])
    trainer = Trainer(cfg, device=torch.device("cpu"))
    steps = [trainer.train_step(s) for s in range(5)]
    assert all(m.breakdown["backward"] > 0 for m in steps)  # the median step passing the rule: bench

    timed_phase = StepTimer.phase

    def phase(self, name):  # backward is no longer timed: a dropped phase
        return contextlib.nullcontext() if name == "backward" else timed_phase(self, name)

    monkeypatch.setattr(StepTimer, "phase", phase)
    dropped = [trainer.train_step(s) for s in range(5, 8)]
    for m in dropped:
        assert m.breakdown["backward"] == 0.0
        assert abs(sum(m.breakdown.values()) - m.step_time_s) < 1e-9  # the old check: still adds up
    # the product's rule on a step whose backward (a third of it) was never timed
    wall = 0.015
    untimed = {"data": 0.0003, "forward": 0.004, "backward": 0.0, "optimizer": 0.0022, "comm_exposed": 0.0005,
               "bubble": 0.0, "other": 0.008}
    assert "unexplained" in (check_breakdown(untimed, wall) or "")
    assert check_breakdown({**untimed, "backward": 0.0078, "other": 0.0002}, wall) is None
