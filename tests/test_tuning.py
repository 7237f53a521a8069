"""Optuna studies over real runs: end to end, invalid combinations, crashes, a killed tuner,
parallel workers (SQLite and PostgreSQL), export reproducibility and live in-job tuning."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from engine.config.schema import from_dict, load_config
from engine.launch.local import launch
from profilers.store import RunStore
from tuning.export.trial import export_trial
from tuning.objective import SKIPPED_ATTR, Objective, median_ci
from tuning.space import SearchSpace, layouts
from tuning.study import load_study, run_trials

pytestmark = pytest.mark.xdist_group("studies")  # tuner runs: apart from "launch", the suite's long pole

BASE = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=32", "train.steps=4",
        "batch.global=8", "batch.micro=4", "parallel.dp=2", "train.warmup_steps=0",
        "profile.host_interval_s=0", "profile.nvml_interval_s=0", "train.timeout_s=30"]
SPACE = {"params": {"batch.micro": {"choices": [2, 4]}, "ddp.bucket_cap_mb": {"choices": [1, 25]}}}
PG_URL = "postgresql://postgres@127.0.0.1:5432/test"


def _base():
    return load_config(None, BASE)


def _study(tmp_path, name=None, **kw):
    return load_study(name or f"s-{uuid.uuid4().hex[:6]}", f"sqlite:///{tmp_path}/studies.db", seed=0, **kw)


def test_space_parsing_and_errors():
    assert layouts(4) == ["dp1-tp1-pp4", "dp1-tp2-pp2", "dp1-tp4-pp1", "dp2-tp1-pp2", "dp2-tp2-pp1", "dp4-tp1-pp1"]
    sp = SearchSpace.from_yaml("examples/space.yaml")
    grid = sp.grid()
    assert all(("comm.rank" in g) == (g["comm.compressor"] == "powersgd") for g in grid)
    assert len(grid) == 3 * 3 * 2 * (1 + 1 + 2)  # layouts x micro x bucket x (none, fp16, powersgd x 2 ranks)
    with pytest.raises(Exception, match=r"params.batch.micro.low.*must be a number"):
        SearchSpace.from_dict({"params": {"batch.micro": {"low": "a", "high": 2}}})
    with pytest.raises(Exception, match=r"unknown key"):
        SearchSpace.from_dict({"params": {"batch.mikro": {"choices": [1]}}})
    with pytest.raises(Exception, match=r"layouts needs space.world_size"):
        SearchSpace.from_dict({"params": {"parallel.layout": {"layouts": ["dp"]}}})


def test_median_ci_brackets_the_median():
    med, lo, hi = median_ci([float(x) for x in range(1, 22)])
    assert med == 11 and lo < med < hi and lo >= 1 and hi <= 21


def test_four_trial_study_end_to_end(tmp_path):
    study = _study(tmp_path)
    obj = Objective(_base(), SearchSpace.from_dict(SPACE), home=tmp_path, warmup_steps=1)
    run_trials(study, obj, 4)
    trials = [t for t in study.get_trials() if not t.user_attrs.get("skipped")]  # repeats drawn are skipped
    assert len(trials) == 4 and len({t.user_attrs["config_key"] for t in trials}) == 4  # the 4 configs, once each
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(done) >= 2  # the median pruner may stop late trials, never the first two
    store = RunStore.open_home(tmp_path)
    for t in done:
        run = store.run(t.user_attrs["run_id"])
        assert run["status"] == "completed" and run["parent"].startswith(f"study:{study.study_name}#")
        assert t.values[0] > 0 and t.user_attrs["tokens_per_s_ci_low"] <= t.values[0] <= t.user_attrs["tokens_per_s_ci_high"]
        assert t.user_attrs["step_time_s"] > 0 and "comm_exposed_s" in t.user_attrs


def test_invalid_combination_never_launches(tmp_path):
    space = SearchSpace.from_dict({"params": {"batch.micro": {"choices": [3]}}})  # 8 % (2*3) != 0
    study = _study(tmp_path)
    run_trials(study, Objective(_base(), space, home=tmp_path), 2)
    for t in study.get_trials():
        assert t.state == TrialState.PRUNED
        assert "batch.global=8: is not divisible by dp*micro = 2*3" in t.user_attrs["reason"]
        assert "run_id" not in t.user_attrs
    assert RunStore.open_home(tmp_path).runs() == []
    assert not (tmp_path / "runs").exists()


def test_of_two_trials_drawing_one_config_at_once_only_the_first_screened_runs(tmp_path):
    """Two workers ask() at once and draw one config; the later-numbered trial may screen first. It ran,
    and so did the earlier one: comparing with earlier trials only, it saw no key (busy CI: trials 7 and
    8 of the four-worker study both ran config b421c15c)."""
    space = SearchSpace.from_dict({"params": {"batch.micro": {"choices": [4]}}})
    study = _study(tmp_path, sampler="random")
    objective = Objective(_base(), space, home=tmp_path)
    first, second = study.ask(), study.ask()
    assert objective.screen(second)[1] is None  # screened first: it runs
    cfg, why = objective.screen(first)
    assert cfg is None and why == f"repeat: the config of trial {second.number}"


def test_workers_screen_their_draws_under_the_studys_lock(tmp_path):
    """The screen and the skip happen under the study database's lock, so screens never interleave."""
    import fcntl

    from tuning.objective import TrialOutcome

    held = []

    class Probe(Objective):
        def screen(self, trial):
            with open(tmp_path / "studies.db.lock", "a") as other:  # another worker's try
                try:
                    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held.append(False)
                    fcntl.flock(other, fcntl.LOCK_UN)
                except BlockingIOError:
                    held.append(True)
            return super().screen(trial)

        def evaluate(self, trial, cfg=None):
            return TrialOutcome(TrialState.COMPLETE, [1.0])

    study = _study(tmp_path, sampler="random")
    run_trials(study, Probe(_base(), SearchSpace.from_dict(SPACE), home=tmp_path), 2)
    assert held and all(held), held


def test_on_postgresql_screens_hold_the_advisory_lock_on_the_storages_own_pool(tmp_path, monkeypatch):
    """On PostgreSQL the screen runs under the advisory lock, taken on a connection of the study storage's
    pool: no new engine (and new server connection) per draw, as there was one before."""
    if reason := _pg_available():
        pytest.skip(reason)
    import sqlalchemy

    from tuning.objective import TrialOutcome
    from profilers.locks import STUDY_LOCK_KEY
    from tuning.study import with_driver

    other = sqlalchemy.create_engine(with_driver(PG_URL)).connect()  # another worker's session
    held, engines = [], []

    class Probe(Objective):
        def screen(self, trial):
            got = other.execute(sqlalchemy.text("SELECT pg_try_advisory_lock(:k)"), {"k": STUDY_LOCK_KEY}).scalar()
            if got:
                other.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": STUDY_LOCK_KEY})
            held.append(not got)
            return super().screen(trial)

        def evaluate(self, trial, cfg=None):
            return TrialOutcome(TrialState.COMPLETE, [1.0])

    name = f"pg-lock-{uuid.uuid4().hex[:8]}"
    study = load_study(name, PG_URL, seed=0, sampler="random")
    create_engine = sqlalchemy.create_engine
    monkeypatch.setattr(sqlalchemy, "create_engine", lambda *a, **k: engines.append(a) or create_engine(*a, **k))
    try:
        run_trials(study, Probe(_base(), SearchSpace.from_dict(SPACE), home=tmp_path), 3)
    finally:
        monkeypatch.undo()
        other.close()
        optuna.delete_study(study_name=name, storage=PG_URL)
    assert len(held) >= 3 and all(held), held
    assert engines == [], engines


def test_invalid_draws_and_repeats_are_skipped_not_run_and_counted(tmp_path):
    """--trials N means N trials that ran: an invalid draw (micro 3) or the config of an earlier trial
    is told PRUNED at once, marked skipped and counted; when no valid, unrun config is left, the loop
    stops (here after 2 trials: micro 4 x two bucket sizes)."""
    from engine.errors import ConfigError
    from tuning.objective import TrialOutcome

    class NoLaunch(Objective):
        def evaluate(self, trial, cfg=None):  # as Objective.evaluate, without starting processes
            try:
                self.config_for(trial)
            except ConfigError as exc:
                return TrialOutcome(TrialState.PRUNED, None, f"invalid: {exc}")
            return TrialOutcome(TrialState.COMPLETE, [float(trial.number)])

    space = SearchSpace.from_dict({"params": {"batch.micro": {"choices": [3, 4]},
                                              "ddp.bucket_cap_mb": {"choices": [1, 25]}}})
    study = _study(tmp_path, sampler="random")
    draws = run_trials(study, NoLaunch(_base(), space, home=tmp_path), 3)
    trials = study.get_trials()
    ran = [t for t in trials if not t.user_attrs.get("skipped")]
    assert [t.state for t in ran] == [TrialState.COMPLETE] * 2, [(t.state, t.params) for t in ran]
    from tuning.study import MAX_SKIPS_IN_A_ROW

    assert draws.ran == 2
    assert {t.params["ddp.bucket_cap_mb"] for t in ran} == {1, 25} and {t.params["batch.micro"] for t in ran} == {4}
    skipped = [t for t in trials if t.user_attrs.get("skipped")]
    assert draws.gave_up and draws.invalid + draws.repeats == len(skipped) >= MAX_SKIPS_IN_A_ROW
    assert draws.invalid > 0 and draws.repeats > 0
    assert all(t.state == TrialState.PRUNED and t.user_attrs["reason"].startswith(("invalid: ", "repeat: "))
               for t in skipped)


def test_a_trial_this_machine_cannot_hold_is_pruned_before_launch(tmp_path):
    space = SearchSpace.from_dict({"params": {"model.d_model": {"choices": [1_000_000_000]}}})
    study = _study(tmp_path)
    run_trials(study, Objective(_base(), space, home=tmp_path), 1)
    (t,) = study.get_trials()
    assert t.state == TrialState.PRUNED
    assert t.user_attrs["reason"].startswith("does not fit: model.d_model=1000000000: the run needs an estimated")
    assert "run_id" not in t.user_attrs and not (tmp_path / "runs").exists()


def test_crashing_trial_fails_with_reason_and_study_goes_on(tmp_path):
    space = SearchSpace.from_dict({"params": {"data.path": {"choices": ["/nonexistent/corpus"]}}})
    study = _study(tmp_path, sampler="random")
    study.enqueue_trial({"data.path": "/nonexistent/corpus"})
    base = load_config(None, BASE + ["data.source=files", "data.path=/nonexistent/corpus"])
    obj = Objective(base, space, home=tmp_path)
    run_trials(study, obj, 1)
    good = Objective(_base(), SearchSpace.from_dict({"params": {"batch.micro": {"choices": [4]}}}), home=tmp_path)
    run_trials(study, good, 1)
    first, second = study.get_trials()
    assert first.state == TrialState.FAIL
    assert first.user_attrs["reason"].startswith("crash (rank ") and "no readable text" in first.user_attrs["reason"]
    assert second.state == TrialState.COMPLETE


def _tune_cmd(tmp_path, space_path, base_path, study, trials, storage):
    return [sys.executable, "-m", "workbench.cli", "tune", str(space_path), "--base", str(base_path),
            "--trials", str(trials), "--study", study, "--storage", storage, "--json", "--pruner", "none"]


def _files(tmp_path):
    space_path, base_path = tmp_path / "space.yaml", tmp_path / "base.yaml"
    space_path.write_text(yaml.safe_dump(SPACE))
    base_path.write_text(yaml.safe_dump(_base().to_dict()))
    return space_path, base_path


def _env(tmp_path):
    # no worker dies here: a grace far above the beat interval, so a loaded machine's stalls fail no live trial
    return {**os.environ, "WORKBENCH_HOME": str(tmp_path), "WORKBENCH_HEARTBEAT_S": "1", "WORKBENCH_GRACE_S": "30"}


def _pg_available() -> str | None:
    """Skip only when no server listens: a missing driver must fail the test, not skip it."""
    import socket

    try:
        socket.create_connection(("127.0.0.1", 5432), timeout=2).close()
        return None
    except OSError as exc:
        return f"no PostgreSQL server listens at 127.0.0.1:5432: {exc}"


@pytest.mark.parametrize("backend", ["postgresql"])  # SQLite: four workers in test_reliability_tuner.py
def test_two_workers_share_one_study(tmp_path, backend):
    if backend == "postgresql" and (reason := _pg_available()):
        pytest.skip(reason)
    space_path, base_path = _files(tmp_path)
    study = f"two-{uuid.uuid4().hex[:8]}"
    storage = f"sqlite:///{tmp_path}/studies.db" if backend == "sqlite" else PG_URL
    procs = [subprocess.Popen(_tune_cmd(tmp_path, space_path, base_path, study, 1, storage), env=_env(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-1500:] for o in outs]
    every = optuna.load_study(study_name=study, storage=storage).get_trials()
    assert sorted(t.number for t in every) == list(range(len(every)))  # no duplicate number, none lost
    # a worker that draws the config the other one already runs skips it unrun (a repeat) and draws again
    skipped = [t for t in every if t.user_attrs.get(SKIPPED_ATTR)]
    assert all(t.user_attrs["reason"].startswith("repeat") for t in skipped), [t.user_attrs for t in skipped]
    trials = [t for t in every if not t.user_attrs.get(SKIPPED_ATTR)]
    assert len(trials) == 2 and all(t.state == TrialState.COMPLETE for t in trials)  # one trial each
    run_ids = [t.user_attrs["run_id"] for t in trials]
    assert len(set(run_ids)) == 2
    summary = json.loads(outs[0][0])
    assert summary["study"] == study and "COMPLETE" in summary["counts"]
    if backend == "postgresql":
        optuna.delete_study(study_name=study, storage=storage)


FIRST_BEAT = """
import json
import sys

import optuna

from engine.config.schema import load_config
from tuning import study as s
from tuning.objective import Objective
from tuning.space import SearchSpace

enter = s._Heartbeat.__enter__
at_first_beat = []


def first_beat(self):
    if not at_first_beat:
        at_first_beat.append({"torch": "torch" in sys.modules, "launcher": "engine.launch.local" in sys.modules})
    return enter(self)


s._Heartbeat.__enter__ = first_beat
home, base, space = sys.argv[1:]
study = optuna.create_study(storage=s.make_storage(f"sqlite:///{home}/studies.db"), study_name="beat")
s.run_trials(study, Objective(load_config(base, []), SearchSpace.from_yaml(space), home=home), 1)
print(json.dumps({"first_beat": at_first_beat[0], "torch_after": "torch" in sys.modules,
                  "trial": study.trials[0].state.name}))
"""


def test_the_engine_is_loaded_before_the_first_trial_beats(tmp_path):
    """Loading torch holds the GIL for seconds on a loaded machine: a worker that loaded it under its
    first trial's heartbeat stalled the beats past the grace period, and the other worker failed the
    live trial as stale (busy CI: 'worker died: no heartbeat since ... (5 s, grace 3 s)'). What the trial's
    launch imports is loaded before the first beat; torch, which a CPU trial's launcher no longer imports
    (engine/device.py `gpu_driver_present`), is then never loaded under a beat either."""
    space_path, base_path = _files(tmp_path)
    out = subprocess.run([sys.executable, "-c", FIRST_BEAT, str(tmp_path), str(base_path), str(space_path)],
                         env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["first_beat"]["launcher"] and seen["trial"] == "COMPLETE", seen  # the launcher before the beat; it ran
    assert not seen["torch_after"] or seen["first_beat"]["torch"], seen  # torch: never, or before the first beat


def test_exported_yaml_reproduces_the_trial_loss(tmp_path):
    study = _study(tmp_path)
    run_trials(study, Objective(_base(), SearchSpace.from_dict({"params": {"batch.micro": {"choices": [2, 4]}}}),
                                home=tmp_path), 1)
    text = export_trial(study, fmt="yaml")
    cfg = from_dict(yaml.safe_load(text))
    again = launch(cfg, home=tmp_path)
    best = study.best_trial
    store = RunStore.open_home(tmp_path)
    original = {r.step: r.value for r in store.metrics(best.user_attrs["run_id"], kind="step", name="loss", rank=0)}
    rerun = {s["step"]: s["loss"] for s in again.steps}
    assert rerun[3] == original[3]  # exactly: same config, same seed, same data
    for fmt in ("torchrun", "json", "megatron", "deepspeed"):
        assert export_trial(study, fmt=fmt).strip()
    assert "--micro-batch-size" in export_trial(study, fmt="megatron")
    assert json.loads(export_trial(study, fmt="deepspeed"))["train_batch_size"] == 8


def test_live_in_job_study_records_segments(tmp_path):
    from tuning.live import LiveTuner

    study = _study(tmp_path, sampler="random", objective="throughput+val_loss")
    space = SearchSpace.from_dict({"params": {"train.lr": {"low": 0.0005, "high": 0.005, "log": True},
                                              "batch.micro": {"choices": [2, 4]}}})
    base = load_config(None, BASE + ["train.schedule=constant"])
    # train.lr changes the loss, not the speed: live tuning scores it with (tokens/s, val_loss)
    tuner = LiveTuner(study, space, base, segments=4, segment_steps=3, home=tmp_path,
                      objective="throughput+val_loss")
    result = tuner.run()
    assert result.status == "completed" and len(result.steps) == 12
    trials = study.get_trials()
    assert len(trials) == 4 and all(t.state == TrialState.COMPLETE for t in trials)
    segs = RunStore.open_home(tmp_path).segments(tuner.run_id)
    assert [(s["start_step"], s["end_step"]) for s in segs] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert [s["trial_number"] for s in segs] == [t.number for t in trials]
    assert all(s["value"] == t.values[0] for s, t in zip(segs, trials))
    vals = {r.step: r.value for r in RunStore.open_home(tmp_path).metrics(tuner.run_id, kind="eval", name="val_loss", rank=0)}
    assert [t.values[1] for t in trials] == [vals[s["end_step"] - 1] for s in segs]  # each segment's own eval
    # the knobs really changed on the ranks: the recorded lr follows each segment's trial
    lrs = {r.step: r.value for r in RunStore.open_home(tmp_path).metrics(tuner.run_id, kind="step", name="lr", rank=0)}
    for s, t in zip(segs, trials):
        assert lrs[s["start_step"]] == pytest.approx(t.params["train.lr"], rel=1e-6)



def test_the_median_pruner_ignores_one_noisy_step_and_prunes_a_slow_trial():
    """Two finished trials ran at ~100 tokens/s. One slow step (60 after 100) is noise: kept. A trial
    slower at every step (50-52) is pruned. Optuna's MedianPruner cut the noisy one at its step 2."""
    from tuning.study import make_pruner

    study = optuna.create_study(direction="maximize", pruner=make_pruner("median", warmup_steps=0))
    for values in ([100.0, 101.0, 99.0, 100.0], [99.0, 100.0, 101.0, 100.0]):
        t = study.ask()
        for step, v in enumerate(values, start=1):
            t.report(v, step)
        study.tell(t, 100.0)

    def pruned_at(values):
        t = study.ask()
        for step, v in enumerate(values, start=1):
            t.report(v, step)
            if t.should_prune():
                study.tell(t, state=TrialState.PRUNED)
                return step
        study.tell(t, values[-1])
        return None

    assert pruned_at([100.0, 60.0, 100.0, 99.0]) is None
    assert pruned_at([50.0, 52.0, 51.0, 50.0]) == 2


def test_example_space_says_how_many_ranks_it_needs():
    import re

    text = open("examples/space.yaml").read()
    said = re.search(r"^# .*Needs (\d+) ranks", text, re.M)
    assert said is not None, text.splitlines()[:3]
    assert int(said.group(1)) == yaml.safe_load(text)["world_size"]


def test_a_run_store_opens_while_a_study_holds_its_lock(tmp_path):
    """The study's lock (held while Optuna creates its tables and while a worker screens a draw) and the
    run store's schema lock are two purposes with two keys: a launcher opening its PostgreSQL run store
    does not wait for a tuner's screen."""
    import threading

    from profilers.store import RunStore
    from tests.pg_schema import pg_schema
    from tuning.study import _schema_lock, with_driver

    with pg_schema() as url:
        opened = threading.Event()

        def open_store() -> None:
            store = RunStore(url)
            store.create_run("r", name="n", config={}, world_size=1)  # the first statement opens the connection
            store.close()
            opened.set()

        with _schema_lock(with_driver(PG_URL)):
            worker = threading.Thread(target=open_store, daemon=True)
            worker.start()
            waited = not opened.wait(timeout=20)
        worker.join(timeout=60)
        assert not waited, "the run store waited for the study's lock: the two share one advisory-lock key"
