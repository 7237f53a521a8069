"""Tuner faults and concurrent workers lose nothing.

- A tuner running two workers (`--jobs 2`) is killed with SIGKILL twice in the middle of trials and
  restarted: the trials that were running become FAIL (and their runs `interrupted`), every completed
  trial is kept as it was, trial numbers stay unique and gap-free, and no rank outlives its tuner.
- A trial whose rank is SIGKILLed fails with the rank and the reason; an out-of-memory error inside a
  trial prunes it with reason "oom"; the study goes on to a completed trial after both.
- Four `workbench tune` processes share one SQLite study and one run store for 12 trials: every
  trial has its own run, complete with all its steps; numbers 0..11; the counts add up.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from engine.config.schema import load_config
from profilers.store import RunStore
from tests.processes import processes_naming
from tuning.objective import Objective
from tuning.space import SearchSpace
from tuning.study import load_study, make_storage, run_trials

# its own worker group: these are the suite's three longest tests, and in "launch" they made it the long pole
pytestmark = pytest.mark.xdist_group("tuner")

ROOT = Path(__file__).resolve().parent.parent
BASE = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=32", "train.steps=3",
        "batch.global=8", "batch.micro=4", "parallel.dp=1", "train.warmup_steps=0", "train.timeout_s=30",
        "profile.host_interval_s=0", "profile.nvml_interval_s=0"]
# 24 distinct configs: more than any test here runs (the tuner never re-runs an earlier trial's config)
SPACE = {"params": {"batch.micro": {"choices": [1, 2, 4, 8]}, "ddp.bucket_cap_mb": {"choices": [1, 25, 50]},
                    "train.seed": {"choices": [0, 1]}}}
STEP_NAMES = {"loss", "step_time(s)", "tokens_per_s", "lr", "grad_norm"}
WORKERS, TRIALS_EACH = 4, 3


def _files(tmp_path: Path, steps: int = 3) -> tuple[Path, Path]:
    space_path, base_path = tmp_path / "space.yaml", tmp_path / "base.yaml"
    space_path.write_text(yaml.safe_dump(SPACE))
    base_path.write_text(yaml.safe_dump(load_config(None, BASE + [f"train.steps={steps}"]).to_dict()))
    return space_path, base_path


def _env(tmp_path: Path, grace_s: int = 6) -> dict[str, str]:
    return {**os.environ, "WORKBENCH_HOME": str(tmp_path), "WORKBENCH_HEARTBEAT_S": "1",
            "WORKBENCH_GRACE_S": str(grace_s),
            "OMP_NUM_THREADS": "1", "_TYPER_STANDARD_TRACEBACK": "1"}


def _tune(space: Path, base: Path, study: str, storage: str, trials: int, jobs: int = 1) -> list[str]:
    return [sys.executable, "-m", "workbench.cli", "tune", str(space), "--base", str(base), "--trials", str(trials),
            "--jobs", str(jobs), "--study", study, "--storage", storage, "--json", "--pruner", "none",
            "--sampler", "random"]


def _trials(study: str, storage: str) -> list[optuna.trial.FrozenTrial]:
    # make_storage takes the schema lock: a bare URL raced the tuner creating the tables once in CI
    # (UNIQUE constraint failed: alembic_version.version_num)
    try:
        return optuna.load_study(study_name=study, storage=make_storage(storage)).get_trials()
    except KeyError:
        return []


def _errors(stderr: str) -> str:
    """A worker's stderr without Optuna's experimental-feature warnings."""
    return "\n".join(line for line in stderr.splitlines() if "warn" not in line.lower())[-4000:]


def _kill_mid_trial(cmd: list[str], env: dict[str, str], study: str, storage: str, *, completed_before: int,
                    home: Path) -> None:
    """Start a tuner, wait until a new trial completed and another is running, SIGKILL its process group."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 180
    while time.time() < deadline:
        time.sleep(0.5)
        states = [t.state for t in _trials(study, storage)]
        if states.count(TrialState.COMPLETE) > completed_before and TrialState.RUNNING in states:
            break
    assert time.time() < deadline, "the tuner never reached a running trial"
    os.killpg(proc.pid, signal.SIGKILL)  # the tuner and its --jobs child; ranks follow by PDEATHSIG
    proc.wait()
    deadline = time.time() + 15
    while time.time() < deadline and processes_naming(str(home)):
        time.sleep(0.3)
    assert processes_naming(str(home)) == []  # no orphaned launcher or rank keeps running


def test_tuner_killed_twice_with_two_jobs_resumes_losing_nothing(tmp_path):
    space, base = _files(tmp_path)
    storage, study, env = f"sqlite:///{tmp_path}/studies.db", "killed-twice", _env(tmp_path)
    cmd = _tune(space, base, study, storage, trials=8, jobs=2)
    kept: dict[int, list[float]] = {}
    for _ in range(2):
        _kill_mid_trial(cmd, env, study, storage, completed_before=len(kept), home=tmp_path)
        done = {t.number: t.values for t in _trials(study, storage) if t.state == TrialState.COMPLETE}
        assert all(done[n] == v for n, v in kept.items())  # completed trials survive each kill unchanged
        kept = done
        time.sleep(7)  # past the 6 s grace: the killed trials' heartbeats are stale
    out = subprocess.run(_tune(space, base, study, storage, trials=2), env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    trials = _trials(study, storage)
    assert sorted(t.number for t in trials) == list(range(len(trials)))  # unique, no gaps
    assert all(t.state != TrialState.RUNNING for t in trials)
    done = {t.number: t.values for t in trials if t.state == TrialState.COMPLETE}
    assert all(done[n] == v for n, v in kept.items()) and len(done) == len(kept) + 2
    stale = [t for t in trials if t.state == TrialState.FAIL]
    assert 2 <= len(stale) <= 4  # each kill left one or two (two jobs) running trials behind
    store = RunStore.open_home(tmp_path)
    for t in trials:
        run = store.run(t.user_attrs["run_id"]) if "run_id" in t.user_attrs else None
        if t.state == TrialState.COMPLETE:
            assert run is not None and run["status"] == "completed"
        elif run is not None and run["status"] != "completed":  # completed: killed between run end and tell
            # a stale trial's run is closed, never left "running" forever
            assert run["status"] == "interrupted" and "stopped sending heartbeats" in run["error"], run
    assert [r for r in store.runs(limit=1000) if r["status"] == "running"] == []
    print(f"\nkilled twice: {len(trials)} trials, {len(done)} complete, {len(stale)} stale -> FAIL")


def test_crashed_and_oom_trials_do_not_stop_the_study(tmp_path):
    study = load_study("faults", f"sqlite:///{tmp_path}/studies.db", sampler="random", seed=0, pruner="none")
    base = load_config(None, BASE)
    for seed, fault in enumerate(("rank=0,step=1,kind=kill", "rank=0,step=1,kind=oom", None)):
        # another seed each: the tuner runs no config an earlier (not failed) trial ran
        space = SearchSpace.from_dict({"params": {"batch.micro": {"choices": [4]}}, "fixed": {"train.seed": seed}})
        run_trials(study, Objective(base, space, home=tmp_path, extra_env={"WORKBENCH_FAULT": fault} if fault
                                    else None), 1)
    killed, oom, good = study.get_trials()
    assert killed.state == TrialState.FAIL
    assert killed.user_attrs["reason"].startswith("crash (rank 0): rank 0 failed: killed by signal 9 (SIGKILL)")
    assert oom.state == TrialState.PRUNED and oom.user_attrs["reason"] == "oom"
    assert good.state == TrialState.COMPLETE and good.values[0] > 0
    store = RunStore.open_home(tmp_path)
    assert [store.run(t.user_attrs["run_id"])["status"] for t in (killed, oom, good)] == ["failed", "failed",
                                                                                         "completed"]
    assert "OutOfMemoryError" in store.run(oom.user_attrs["run_id"])["error"]
    for t in (killed, oom):  # step 0 finished before each fault: its records are kept
        assert {r.name for r in store.metrics(t.user_attrs["run_id"], kind="step", rank=0) if r.step == 0} >= STEP_NAMES


@pytest.mark.timeout(900)  # 12 real runs: ~1.4 min on 2 shared cores
def test_four_workers_share_one_study_and_one_store(tmp_path):
    space, base = _files(tmp_path, steps=2)
    # no worker dies here: a grace of 30 s, not 6. Beside three other suites (load 16-30 on 2 cores) four
    # writers on one SQLite file held a live trial's heartbeats back past 6 s and it was failed as stale
    storage, study, env = f"sqlite:///{tmp_path}/studies.db", "four", _env(tmp_path, grace_s=30)
    started = time.time()
    procs = [subprocess.Popen(_tune(space, base, study, storage, trials=TRIALS_EACH), env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(WORKERS)]
    outs = [p.communicate(timeout=540) for p in procs]
    wall = time.time() - started
    assert all(p.returncode == 0 for p in procs), [_errors(err) for _, err in outs]
    total = WORKERS * TRIALS_EACH
    every = _trials(study, storage)
    assert sorted(t.number for t in every) == list(range(len(every)))  # unique, no gaps
    trials = [t for t in every if not t.user_attrs.get("skipped")]  # repeats drawn meanwhile are skipped
    assert len(trials) == total
    assert all(t.state == TrialState.COMPLETE for t in trials), [(t.number, t.state, t.user_attrs) for t in trials]
    assert len({t.user_attrs["config_key"] for t in trials}) == total  # no config ran twice
    run_ids = [t.user_attrs["run_id"] for t in trials]
    assert len(set(run_ids)) == total
    store = RunStore.open_home(tmp_path)
    runs = {r["run_id"]: r for r in store.runs(limit=10 * total)}
    assert set(runs) == set(run_ids)  # no run without a trial, no trial without a run
    for t in trials:
        run = runs[t.user_attrs["run_id"]]
        assert run["status"] == "completed" and run["parent"] == f"study:{study}#{t.number}"
        seen: dict[int, set[str]] = {}
        for rec in store.metrics(run["run_id"], kind="step"):
            seen.setdefault(rec.step, set()).add(rec.name)
        assert sorted(seen) == [0, 1] and all(names >= STEP_NAMES for names in seen.values())
        assert run["config"]["batch"]["micro"] == t.params["batch.micro"]  # the run is the trial's config
    for out, _ in outs:  # every worker's own summary agrees with the study
        summary = json.loads(out)
        assert summary["study"] == study and sum(summary["counts"].values()) <= total
    assert processes_naming(str(tmp_path)) == []
    print(f"\nfour workers: {total} trials, {len(runs)} runs, wall {wall:.1f} s")


def test_a_worker_whose_trial_another_worker_failed_goes_on(tmp_path):
    """A worker stalled past the heartbeat grace finds its trial failed as stale by another worker:
    it tells nothing more about that trial and runs the next one instead of crashing."""
    from tuning.objective import TrialOutcome

    class FailedMeanwhile:
        def evaluate(self, trial):
            if trial.number == 0:  # what another worker's fail_stale_trials does while this one works
                trial.study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
            return TrialOutcome(TrialState.COMPLETE, [1.0])

    study = optuna.create_study(direction="maximize", storage=f"sqlite:///{tmp_path}/s.db")
    run_trials(study, FailedMeanwhile(), 2)
    assert [t.state for t in study.get_trials()] == [TrialState.FAIL, TrialState.COMPLETE]


def test_a_trial_whose_worker_died_before_its_first_heartbeat_is_failed_by_the_next_worker(tmp_path):
    """Optuna's fail_stale_trials passes over a RUNNING trial with no heartbeat at all: a worker killed
    between ask() and its first heartbeat (CI under load) left it RUNNING for good. The next worker fails
    it once it is older than the grace period, and names why."""
    from tuning.objective import TrialOutcome

    class Quick:
        def evaluate(self, trial):
            return TrialOutcome(TrialState.COMPLETE, [1.0])

    storage = make_storage(f"sqlite:///{tmp_path}/s.db", tmp_path, heartbeat_s=1, grace_s=1)
    study = optuna.create_study(study_name="never-beat", direction="maximize", storage=storage)
    orphan = study.ask()  # its worker dies here: no heartbeat was ever recorded
    young = study.ask()
    young.set_user_attr("live", True)  # a live in-job trial beats through its run: left alone
    time.sleep(2.5)
    run_trials(study, Quick(), 1)
    states = {t.number: t.state for t in study.get_trials()}
    assert states[orphan.number] == TrialState.FAIL and states[young.number] == TrialState.RUNNING, states
    assert study.get_trials()[orphan.number].user_attrs["reason"].startswith("worker died before its first heartbeat")
    assert list(states.values()).count(TrialState.COMPLETE) == 1
