"""tuning/diagnose.py (issue 52 item 10): runs with a known bottleneck, planted as recorded telemetry in a
real run store (profilers/store.py, the records the engine writes), each diagnosed: the first finding
names the planted bottleneck (and the rank, where one rank is the cause), with a suggestion priced
below the measured step and one command away."""
from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from profilers.records import Record
from profilers.store import RunStore
from tuning.diagnose import diagnose

REPO = Path(__file__).resolve().parent.parent
GPT = {"layers": 2, "d_model": 64, "heads": 4, "seq_len": 64, "vocab": 256}
BALANCED = {"data": 0.002, "forward": 0.030, "backward": 0.060, "optimizer": 0.008, "comm_exposed": 0.010,
            "bubble": 0.0, "other": 0.002}


def plant(store: RunStore, run_id: str, phases: dict[int, dict[str, float]], *, config: dict,
          busbw: dict[int, float] | None = None, steps: int = 20) -> None:
    """A finished run whose ranks recorded `phases` (seconds per step, +-3% noise), as the engine records
    them: breakdown, step and per-rank dp all-reduce records."""
    rng = random.Random(run_id)
    world = len(phases)
    store.create_run(run_id, name=run_id, config=config, world_size=world,
                     layout={"dp": config["parallel"].get("dp", 1), "tp": 1, "pp": config["parallel"].get("pp", 1)})
    records = []
    for step in range(steps):
        for rank, mine in phases.items():
            noisy = {p: v * (1 + rng.uniform(-0.03, 0.03)) for p, v in mine.items()}
            total = sum(noisy.values())
            records += [Record(run_id, rank, step, "breakdown", f"{p}(s)", v, float(step)) for p, v in noisy.items()]
            records += [Record(run_id, rank, step, "step", "step_time(s)", total, float(step)),
                        Record(run_id, rank, step, "step", "loss", 5.0 - 0.01 * step, float(step))]
            if config["parallel"].get("dp", 1) > 1:
                bw = (busbw or {}).get(rank, 0.5)
                records += [Record(run_id, rank, step, "comm", f"dp:all_reduce/{k}", v, float(step)) for k, v in
                            (("bytes", 4e5), ("count", 4.0), ("time(s)", 4e5 / (bw * 1e9)), ("busbw(GB/s)", bw))]
    store.write(records)
    store.finish_run(run_id, "completed")


def dp2(**parallel) -> dict:
    return {"name": "planted", "model": GPT, "data": {"source": "text"}, "parallel": {"dp": 2, **parallel},
            "batch": {"global": 16, "micro": 4}, "train": {"steps": 20}}


PLANTED = {  # run id: (config, phases per rank, the finding's kind, the rank it names)
    "exposed-comm": (dp2(), {r: {**BALANCED, "comm_exposed": 0.09} for r in (0, 1)}, "exposed_comm", None),
    "slow-rank": (dp2(), {0: {**BALANCED, "comm_exposed": 0.075},
                          1: {**BALANCED, "forward": 0.055, "backward": 0.110, "comm_exposed": 0.0}}, "slow_rank", 1),
    "optimizer": (dp2(), {r: {**BALANCED, "optimizer": 0.07} for r in (0, 1)}, "optimizer", None),
    "data-loading": (dp2(), {r: {**BALANCED, "data": 0.05} for r in (0, 1)}, "data_loading", None),
    "bubble": ({"name": "planted", "model": {**GPT, "layers": 4}, "data": {"source": "text"},
                "parallel": {"pp": 2, "schedule": "1f1b"}, "batch": {"global": 8, "micro": 4}, "train": {"steps": 20}},
               {r: {**BALANCED, "comm_exposed": 0.001, "bubble": 0.05} for r in (0, 1)}, "pipeline_bubble", None),
}


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("planted")
    with RunStore.open_home(home) as store:
        for run_id, (config, phases, _, _) in PLANTED.items():
            plant(store, run_id, phases, config=config)
    return home


@pytest.mark.parametrize("run_id", list(PLANTED))
def test_the_diagnosis_names_the_planted_bottleneck_with_a_priced_suggestion(run_id, home):
    _, phases, kind, rank = PLANTED[run_id]
    with RunStore.open_home(home) as store:
        found = diagnose(store, run_id, home=home)
    assert found is not None and found.findings, found
    first = found.findings[0]
    assert first.kind == kind, [(f.kind, f.headline) for f in found.findings]
    if rank is not None:
        assert first.rank == rank and f"rank {rank}" in first.headline, first.headline
    measured = max(sum(p.values()) for p in phases.values())
    assert found.step_s == pytest.approx(measured, rel=0.03)
    best = first.suggestions[0]
    assert best.predicted_step_s is not None and best.predicted_tokens_per_s > found.tokens_per_step / found.step_s, best
    assert best.command.startswith("workbench ")
    if best.basis == "simulator":  # the change is a valid config for `workbench run` (its command's --set items)
        assert best.overrides and all(f"--set {o}" in best.command for o in best.overrides)
        assert str(home / "runs" / run_id / "config.json") in best.command


def test_a_slow_rank_is_the_cause_not_the_others_wait(home):
    """The others' exposed all-reduce is the slow rank's symptom: no second finding blames their link."""
    with RunStore.open_home(home) as store:
        found = diagnose(store, "slow-rank", home=home)
    assert [f.kind for f in found.findings if f.kind in ("slow_rank", "unbalanced_comm")] == ["slow_rank"]
    assert "the others wait for it in exposed dp all_reduce" in found.findings[0].headline


def test_balanced_runs_have_no_finding_and_a_simulator_price_reproduces_the_measured_step(home):
    from tuning.diagnose import _Pricer, _read

    with RunStore.open_home(home) as store:
        plant(store, "balanced", {0: BALANCED, 1: BALANCED}, config=dp2())
        assert diagnose(store, "balanced", home=home).findings == ()
        run = _read(store, "balanced", home)
    pricer = _Pricer(run, home)
    same = pricer.price("nothing", [])  # the recorded config prices back to the measured mean step
    assert same.predicted_step_s == pytest.approx(float(run.phases.sum(axis=1).mean()), rel=1e-6)


def test_show_opens_with_the_diagnosis(home):
    import json
    import os

    env = {**os.environ, "WORKBENCH_HOME": str(home), "COLUMNS": "200"}
    show = [sys.executable, "-m", "workbench.cli", "show", "slow-rank"]
    out = subprocess.run(show, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("What bounds this run"))
    assert first <= 3 and lines[first + 1].lstrip().startswith("1. rank 1 computes"), lines[:8]
    assert f"$ workbench run {home / 'runs' / 'slow-rank' / 'config.json'}" in out.stdout
    data = json.loads(subprocess.run([*show, "--json"], capture_output=True, text=True, env=env, timeout=120).stdout)
    assert data["diagnosis"]["findings"][0]["kind"] == "slow_rank"


def test_the_run_page_opens_with_the_diagnosis_and_a_button_per_priced_change(home, monkeypatch):
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("WORKBENCH_HOME", str(home))
    st.cache_data.clear()
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=120)
    at.switch_page("workbench/app_pages/run.py")
    at.run()
    at.selectbox(key="run_pick").set_value("exposed-comm").run()
    assert not at.exception, [e.value for e in at.exception]
    text = [m.value for m in at.markdown]
    title = next(i for i, t in enumerate(text) if t.startswith("**What bounds this run"))
    assert text[title + 1].startswith("1. every rank spends") and "exposed dp all_reduce" in text[title + 1]
    assert any(c.value.startswith("try ") and "[simulator]" in c.value for c in at.caption)
    assert any(c.value.startswith(f"workbench run {home / 'runs' / 'exposed-comm' / 'config.json'} --set ")
               for c in at.code)
    assert [b.label for b in at.button if b.key and b.key.startswith("try-exposed-comm-0-")] == ["Run it", "Run it"]
