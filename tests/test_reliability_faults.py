"""Rank faults end a run cleanly and lose no telemetry: a rank killed with SIGKILL, a rank that hangs
so its peer blocks in a collective until train.timeout_s, an exception in one rank, and the
launcher's own timeout. Each run ends within a bound, leaves no process behind, is marked failed
in the store with the rank and the reason, and keeps every record of every step completed before
the fault (on every rank), readable.

"Records lost" is measured, not assumed: every rank emits a fixed set of step records per step
(loss, step time, tokens/s, lr, grad norm), so the steps completed before a fault at step k on a
world of w ranks must read back as exactly w * k * 5 such records.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import psutil
import pytest

from engine.config.schema import load_config
from engine.launch.local import launch
from profilers.store import RunStore
from tests.processes import descendants, processes_naming

pytestmark = pytest.mark.xdist_group("launch")

TINY = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=32", "model.vocab=256",
        "train.steps=4", "train.warmup_steps=0", "batch.global=8", "batch.micro=4", "parallel.dp=2",
        "profile.host_interval_s=0", "profile.nvml_interval_s=0"]
STEP_NAMES = {"loss", "step_time(s)", "tokens_per_s", "lr", "grad_norm"}
FAULT_STEP = 2
COLLECTIVE_TIMEOUT_S = 5
# startup of torchrun + 2 ranks on a loaded 2-core machine takes up to ~30 s; the fault adds at
# most the collective timeout and the launcher's 3 s SIGTERM grace
BOUND_S = 90


def _faulty_run(home: Path, fault: str, overrides: list[str], *, launch_timeout: float | None = None):
    cfg = load_config(None, TINY + overrides)
    before = descendants()
    started = time.time()
    result = launch(cfg, home=home, raise_on_failure=False, timeout_s=launch_timeout,
                    extra_env={"WORKBENCH_FAULT": fault})
    wall = time.time() - started
    config_path = str(result.run_dir / "config.json")
    deadline = time.time() + 5  # a process reaped by init a moment late is not a leak
    while time.time() < deadline and ([p for p in descendants() - before if psutil.pid_exists(p)]
                                      or processes_naming(config_path)):
        time.sleep(0.2)
    assert [p for p in descendants() - before if psutil.pid_exists(p)] == []
    assert processes_naming(config_path) == []
    return cfg, result, wall


def _kept_steps(store: RunStore, run_id: str, world: int, upto: int) -> int:
    """Assert every step < upto has all its step records on every rank, finite; return the count."""
    records = store.metrics(run_id, kind="step")
    seen: dict[tuple[int, int], set[str]] = {}
    for rec in records:
        assert math.isfinite(rec.value), rec
        seen.setdefault((rec.rank, rec.step), set()).add(rec.name)
    missing = [(rank, step) for rank in range(world) for step in range(upto)
               if not STEP_NAMES <= seen.get((rank, step), set())]
    assert missing == [], f"lost the records of (rank, step) {missing}"
    return sum(len(names & STEP_NAMES) for (rank, step), names in seen.items() if step < upto)


def _assert_failed(home: Path, result, rank: int | None, reason: str) -> dict:
    run = RunStore.open_home(home).run(result.run_id)
    assert run is not None and run["status"] == "failed"
    assert run["error_rank"] == rank and result.error_rank == rank
    assert reason in run["error"], run["error"]
    assert run["ended"] is not None and run["ended"] >= run["started"]
    return run


def test_rank_killed_with_sigkill(tmp_path):
    cfg, result, wall = _faulty_run(tmp_path, f"rank=1,step={FAULT_STEP},kind=kill",
                                    [f"train.timeout_s={COLLECTIVE_TIMEOUT_S}"])
    assert wall < BOUND_S
    _assert_failed(tmp_path, result, 1, "rank 1 failed: killed by signal 9 (SIGKILL)")
    kept = _kept_steps(RunStore.open_home(tmp_path), result.run_id, cfg.world_size, FAULT_STEP)
    assert kept == cfg.world_size * FAULT_STEP * len(STEP_NAMES)
    print(f"\nSIGKILL: wall {wall:.1f} s, step records kept {kept}")


def test_rank_hanging_in_a_collective_is_named_after_the_timeout(tmp_path):
    cfg, result, wall = _faulty_run(tmp_path, f"rank=1,step={FAULT_STEP},kind=hang",
                                    [f"train.timeout_s={COLLECTIVE_TIMEOUT_S}"])
    assert COLLECTIVE_TIMEOUT_S <= wall < BOUND_S
    # rank 0 timed out waiting; the root cause is the rank that never arrived
    run = _assert_failed(tmp_path, result, 1, "rank 1 failed: hung: rank 0 timed out waiting for it")
    assert "Timed out" in run["error"] or "timed out" in run["error"]
    kept = _kept_steps(RunStore.open_home(tmp_path), result.run_id, cfg.world_size, FAULT_STEP)
    assert kept == cfg.world_size * FAULT_STEP * len(STEP_NAMES)
    print(f"\nhang: wall {wall:.1f} s, step records kept {kept}")


def test_exception_in_one_rank(tmp_path):
    cfg, result, wall = _faulty_run(tmp_path, f"rank=1,step={FAULT_STEP},kind=raise", ["train.timeout_s=30"])
    assert wall < BOUND_S
    _assert_failed(tmp_path, result, 1, f"rank 1 failed: InjectedFault: injected fault at step {FAULT_STEP}")
    assert "Traceback" in result.error  # the user's own error comes back with its traceback
    kept = _kept_steps(RunStore.open_home(tmp_path), result.run_id, cfg.world_size, FAULT_STEP)
    assert kept == cfg.world_size * FAULT_STEP * len(STEP_NAMES)
    print(f"\nraise: wall {wall:.1f} s, step records kept {kept}")


def test_launcher_timeout_stops_a_hung_run(tmp_path):
    """One rank hangs with no collective to time out: only launch(timeout_s=...) can end it."""
    limit = 25.0
    cfg, result, wall = _faulty_run(tmp_path, "rank=0,step=1,kind=hang",
                                    ["parallel.dp=1", "train.timeout_s=600"], launch_timeout=limit)
    assert limit <= wall < limit + BOUND_S  # a hang guard (SIGTERM, 3 s grace, SIGKILL, telemetry drained)
    _assert_failed(tmp_path, result, None, f"the run failed: timed out after {limit:.0f} s; every rank was stopped")
    store = RunStore.open_home(tmp_path)
    reached = sorted({rec.step for rec in store.metrics(result.run_id, kind="step")})
    assert reached == list(range(len(reached))) and len(reached) <= 1  # a prefix, never past the hang
    if reached:  # step 0 finished before the hang: it is kept whole
        _kept_steps(store, result.run_id, 1, 1)
    print(f"\nlauncher timeout: wall {wall:.1f} s, steps kept {reached}")


def test_a_sigterm_is_not_swallowed_by_code_that_must_not_raise_into_training():
    """The rank's SIGTERM handler raises where the rank happens to be; in the telemetry client's
    `except Exception` it was caught there and the rank trained on (an orphaned node's ranks, 2 nodes)."""
    import os
    import signal

    from engine.launch.worker import Terminated, _on_sigterm

    before = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with pytest.raises(Terminated):
            try:  # as profilers.telemetry.TelemetryClient.emit
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler runs here
            except Exception:  # noqa: BLE001
                pass
    finally:
        signal.signal(signal.SIGTERM, before)


PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "from engine.launch.parent_death import die_with_parent; import time; "
                          "die_with_parent(); print('ready', flush=True); time.sleep(120)"],
                         stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_process_that_asked_to_die_with_its_parent_does_when_the_parent_is_killed():
    """Every rank asks for it: a SIGKILLed torchrun cannot stop its ranks (they run in their own sessions)."""
    import os
    import signal
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, cwd=repo,
                              env={**os.environ, "PYTHONPATH": str(repo)})
    child = psutil.Process(int(parent.stdout.readline()))
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    try:
        child.wait(timeout=60)  # not our child: no exit status, psutil.TimeoutExpired while it lives on
    finally:
        if child.is_running():
            child.kill()
