"""Studies on an Optuna storage: create or resume, run trials with ask/tell, survive dead workers.

SQLite in the workbench home by default; a PostgreSQL/MySQL URL lets `workbench tune` run on
several nodes against one study (the storage, its lock and the run-store callback: tuning/storage.py). Every running trial sends heartbeats, so a killed worker's trial
is marked FAIL by the next worker (`fail_stale_trials`) and nothing else is lost.
"""
from __future__ import annotations

import statistics
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from engine.config.schema import RunConfig
from engine.config.validate import name_error
from tuning.objective import PARETO, THROUGHPUT, Objective, TrialOutcome
from tuning.space import SearchSpace
# the study's database lives in tuning/storage.py; its names stay importable from here
from tuning.storage import (GRACE_S, HEARTBEAT_S, StorageError, _backend, _schema_lock, _shown, _study_lock,  # noqa: F401
                            default_storage, make_storage, reader_storage, with_driver)

SAMPLERS = ("tpe", "cmaes", "random", "grid")
PRUNERS = ("median", "hyperband", "none")
HEARTBEAT_ATTR = "workbench:heartbeat_at"  # trial system attribute: time.time() of the last heartbeat

Event = Callable[[str, dict[str, Any]], None]

# Our ask/tell loop records heartbeats itself (_Heartbeat). Optuna's notices that heartbeats and
# fail_stale_trials are experimental, and its hint to use them with optimize(), give a user
# nothing to act on and bury the real messages on stderr.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")


def make_sampler(name: str, seed: int | None) -> optuna.samplers.BaseSampler:
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True)
    if name == "cmaes":
        # CMA-ES handles the numeric knobs; categorical ones fall back to independent sampling
        return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    if name in ("random", "grid"):  # grid = every combination enqueued, then taken in order
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"sampler={name!r} must be one of {', '.join(SAMPLERS)}")


def make_pruner(name: str, warmup_steps: int) -> optuna.pruners.BasePruner:
    if name == "median":  # Optuna's rule, but only on differences beyond the trial's own step noise
        from tuning.pruner import NoiseAwareMedianPruner

        return NoiseAwareMedianPruner(n_startup_trials=2, n_warmup_steps=warmup_steps + 1)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=warmup_steps + 1)
    return optuna.pruners.NopPruner()


def check_study_name(name: object, field: str = "study") -> str:
    """`name` if it may name a study, else a ConfigError: the run-name rule (engine/config/validate.py), since a
    study's name becomes part of its trials' run ids and its own folder (<home>/studies/<name>)."""
    error = name_error(field, name)
    if error is not None:
        raise error
    return str(name)


def load_study(name: str, storage: str | None = None, *, sampler: str = "tpe", seed: int | None = None,
               objective: str = THROUGHPUT, pruner: str = "median", warmup_steps: int = 1,
               create: bool = True, home: str | Path | None = None) -> optuna.Study:
    """Create the study or resume it; directions follow the objective. A bad name is a ConfigError first."""
    check_study_name(name)
    directions = ["maximize", "minimize"] if objective == PARETO else ["maximize"]
    store = make_storage(storage, home)
    if not create:
        return optuna.load_study(study_name=name, storage=store, sampler=make_sampler(sampler, seed),
                                 pruner=make_pruner(pruner, warmup_steps))
    return optuna.create_study(study_name=name, storage=store, directions=directions, load_if_exists=True,
                               sampler=make_sampler(sampler, seed), pruner=make_pruner(pruner, warmup_steps))


def list_studies(storage: str | None = None, home: str | Path | None = None) -> list[dict[str, Any]]:
    out = []
    for s in optuna.get_all_study_summaries(make_storage(storage, home), include_best_trial=True):
        study = optuna.load_study(study_name=s.study_name, storage=make_storage(storage, home))
        counts = {st.name: 0 for st in TrialState}
        for t in study.get_trials(deepcopy=False):
            counts[t.state.name] += 1
        best = s.best_trial.values if s.best_trial is not None else None
        out.append({"name": s.study_name, "n_trials": s.n_trials, "states": counts, "best_values": best,
                    "directions": [d.name.lower() for d in s.directions], "created": s.datetime_start,
                    "paused": bool(study.user_attrs.get("paused", False))})
    return out


class _Heartbeat:
    """Record heartbeats of a running trial (ask/tell does not, unlike study.optimize)."""

    def __init__(self, study: optuna.Study, trial: optuna.trial.Trial, interval: float) -> None:
        self.storage, self.trial_id, self.interval = study._storage, trial._trial_id, interval
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="trial-heartbeat")

    def _beat(self) -> None:
        self.storage.record_heartbeat(self.trial_id)
        # our own copy of the time, read by _name_stale_trials (Optuna keeps its own privately)
        self.storage.set_trial_system_attr(self.trial_id, HEARTBEAT_ATTR, time.time())

    def _loop(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                self._beat()
            except Exception:  # a storage hiccup must not kill the trial
                pass

    def __enter__(self) -> _Heartbeat:
        self._beat()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=2)


@dataclass(slots=True)
class StudySummary:
    study_name: str
    storage: str
    counts: dict[str, int] = field(default_factory=dict)
    best_value: Any = None
    best_params: dict[str, Any] | None = None
    best_trial: int | None = None
    confirmed_best: int | None = None
    skipped: int = 0  # draws not run: invalid points and repeats of an earlier trial's config

    def to_dict(self) -> dict[str, Any]:
        return {"study": self.study_name, "storage": self.storage, "counts": self.counts,
                "best_value": self.best_value, "best_params": self.best_params, "best_trial": self.best_trial,
                "confirmed_best": self.confirmed_best, "skipped": self.skipped}


def enqueue_grid(study: optuna.Study, space: SearchSpace) -> int:
    """For the grid sampler: enqueue every combination once (only into a study with no trials)."""
    if study.get_trials(deepcopy=False):
        return 0
    combos = space.grid()
    for params in combos:
        study.enqueue_trial(params, skip_if_exists=True)
    return len(combos)


@dataclass(slots=True)
class Draws:
    """What a worker's loop did: trials run, and draws skipped unrun (invalid points, repeated configs)."""

    ran: int = 0
    invalid: int = 0
    repeats: int = 0
    gave_up: bool = False  # MAX_SKIPS_IN_A_ROW draws in a row were skipped

    @property
    def skipped(self) -> int:
        return self.invalid + self.repeats


MAX_SKIPS_IN_A_ROW = 50  # a space with fewer valid, unrun configs than --trials ends here


def _skip(study: optuna.Study, trial: optuna.trial.Trial, why: str, draws: Draws, emit: Event) -> None:
    """Tell a draw that is not run: PRUNED, with why; the sampler learns to avoid its region."""
    from tuning.objective import SKIPPED_ATTR

    try:
        trial.set_user_attr("reason", why)
        trial.set_user_attr(SKIPPED_ATTR, True)
    except optuna.exceptions.UpdateFinishedTrialError:  # failed as stale by another worker meanwhile
        pass
    study.tell(trial, state=TrialState.PRUNED, skip_if_finished=True)
    if why.startswith("repeat"):
        draws.repeats += 1
    else:
        draws.invalid += 1
    emit("trial_skipped", {"number": trial.number, "reason": why})


def run_trials(study: optuna.Study, objective: Objective, n_trials: int, *, timeout_s: float | None = None,
               on_event: Event | None = None, stop_when: Callable[[], bool] | None = None,
               before_trial: Callable[[], None] | None = None) -> Draws:
    """This worker's share of the study: n_trials run, one after another. A draw that `objective.screen`
    skips (an invalid point, or the config another trial ran or runs) is told at once and not counted."""
    import time

    if hasattr(objective, "prepare"):  # before any heartbeat: see Objective.prepare
        objective.prepare()
    started = time.time()
    emit = on_event or (lambda *_: None)
    screen = getattr(objective, "screen", None)
    draws, in_a_row = Draws(), 0
    while draws.ran < n_trials:
        if timeout_s is not None and time.time() - started > timeout_s:
            break
        if stop_when is not None and stop_when():
            break
        if in_a_row >= MAX_SKIPS_IN_A_ROW:
            draws.gave_up = True
            break
        if before_trial is not None:
            before_trial()
        _name_stale_trials(study)
        optuna.storages.fail_stale_trials(study)
        _fail_trials_that_never_beat(study)
        trial = study.ask()
        # heartbeats from the ask on: a worker killed while screening leaves a trial others can fail as stale
        with _Heartbeat(study, trial, study._storage.get_heartbeat_interval() or HEARTBEAT_S):
            with _study_lock(study):  # one screen at a time: of two workers drawing one config, one runs it
                cfg, why = screen(trial) if screen is not None else (None, None)
                if why is not None:
                    _skip(study, trial, why, draws, emit)
                    in_a_row += 1
                    continue
            in_a_row = 0
            draws.ran += 1
            emit("trial_start", {"number": trial.number, "params": trial.params})
            try:
                outcome = objective.evaluate(trial, cfg) if cfg is not None else objective.evaluate(trial)
            except KeyboardInterrupt:  # Ctrl-C, or SIGTERM of a cancelled worker job: the trial ends with why
                trial.set_user_attr("reason", "interrupted: its tuner worker was stopped (Ctrl-C, SIGTERM or scancel)")
                study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
                raise
            except optuna.exceptions.UpdateFinishedTrialError:  # failed as stale meanwhile (see below)
                outcome = TrialOutcome(TrialState.FAIL, None, "failed as stale by another worker while it ran")
        # skip_if_finished: a worker stalled past the heartbeat grace (a loaded machine) may find its
        # trial already failed as stale by another worker; it goes on to the next trial, not crash
        if outcome.state == TrialState.COMPLETE:
            study.tell(trial, outcome.values, skip_if_finished=True)
        else:
            study.tell(trial, state=outcome.state, skip_if_finished=True)
        emit("trial_end", {"number": trial.number, "state": outcome.state.name, "values": outcome.values,
                           "reason": outcome.reason})
    return draws


def _heartbeat_grace(study: optuna.Study, default_interval: float | None = None) -> float | None:
    """Seconds without a heartbeat after which a running trial's worker counts as dead: the storage's
    grace period, else twice its heartbeat interval (Optuna's own default); None when the storage
    sends no heartbeats and no `default_interval` stands in."""
    backend = _backend(study)
    interval = getattr(backend, "heartbeat_interval", None) or default_interval
    if interval is None:
        return None
    return getattr(backend, "grace_period", None) or 2 * interval


def _name_stale_trials(study: optuna.Study, now: float | None = None) -> list[int]:
    """Write why on each running trial whose worker stopped sending heartbeats, just before Optuna
    fails it (a finished trial takes no more attributes); returns their numbers."""
    import datetime

    grace = _heartbeat_grace(study, default_interval=HEARTBEAT_S)
    now = time.time() if now is None else now
    named = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        beat = t.system_attrs.get(HEARTBEAT_ATTR)
        if beat is None or now - beat <= grace:
            continue
        when = datetime.datetime.fromtimestamp(beat).strftime("%Y-%m-%d %H:%M:%S")
        reason = f"worker died: no heartbeat since {when} ({now - beat:.0f} s, grace {grace} s)"
        try:
            study._storage.set_trial_user_attr(t._trial_id, "reason", reason)
            named.append(t.number)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # another worker failed it first
    return named


def _fail_trials_that_never_beat(study: optuna.Study, now: float | None = None) -> list[int]:
    """Fail, with why, each running trial that never sent a heartbeat and started longer than the grace
    period ago: its worker died between `ask()` and the first heartbeat, and Optuna's fail_stale_trials
    passes over trials without one, so such a trial stayed RUNNING for good (a CI run under load).
    Live in-job trials (user attr "live") beat through their run instead; they are left alone."""
    import datetime

    grace = _heartbeat_grace(study)
    if grace is None:  # no heartbeats in this storage: nothing tells a dead worker from a slow one
        return []
    now_dt = datetime.datetime.fromtimestamp(time.time() if now is None else now)
    failed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if HEARTBEAT_ATTR in t.system_attrs or t.user_attrs.get("live") or t.datetime_start is None:
            continue
        if (now_dt - t.datetime_start).total_seconds() <= grace:
            continue
        try:
            study._storage.set_trial_user_attr(t._trial_id, "reason", "worker died before its first heartbeat "
                                               f"(started {t.datetime_start:%Y-%m-%d %H:%M:%S}, grace {grace} s)")
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            failed.append(t.number)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # its worker, or another one, finished it meanwhile
    return failed


def remeasure_best(study: optuna.Study, objective: Objective, top: int, repeats: int = 1) -> int | None:
    """Re-run the best `top` configs and pick the best by median of all measurements, so noise
    does not choose the winner; recorded as study user attributes."""
    from engine.config.schema import from_dict
    from engine.launch.local import launch
    from tuning.objective import median_ci

    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if len(t.values) == 1]
    if not done:
        return None
    ranked = sorted(done, key=lambda t: t.values[0], reverse=True)[:top]
    table: dict[str, list[float]] = {}
    for t in ranked:
        cfg: RunConfig = from_dict(t.user_attrs["config"])
        values = [t.values[0]]
        for _ in range(repeats):
            result = launch(cfg, home=objective.home, raise_on_failure=False, parent=f"study:{study.study_name}#{t.number}:remeasure",
                            launcher=getattr(objective, "launcher", "local"))
            steady = [s["tokens_per_s"] for s in result.steps[objective.warmup:] if "tokens_per_s" in s]
            if steady:
                values.append(median_ci(steady)[0])
        table[str(t.number)] = values
    best = max(table, key=lambda k: statistics.median(table[k]))
    study.set_user_attr("remeasured", table)
    study.set_user_attr("confirmed_best", int(best))
    return int(best)


def summarize(study: optuna.Study, storage: str) -> StudySummary:
    """Counts per state of the trials that ran (skipped draws counted apart) and the best."""
    from tuning.objective import SKIPPED_ATTR

    counts: dict[str, int] = {}
    skipped = 0
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get(SKIPPED_ATTR):
            skipped += 1
            continue
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
    summary = StudySummary(study.study_name, storage, counts, confirmed_best=study.user_attrs.get("confirmed_best"),
                           skipped=skipped)
    if counts.get("COMPLETE"):
        if len(study.directions) == 1:
            best = study.best_trial
            summary.best_value, summary.best_params, summary.best_trial = best.value, best.params, best.number
        else:
            front = study.best_trials
            summary.best_value = [t.values for t in front]
            summary.best_params = {str(t.number): t.params for t in front}
    return summary


LAUNCHER_ATTR = "launcher"  # study user attribute: how its trials start, set by its first worker


def study_launcher(study: optuna.Study, asked: str | None) -> str:
    """The launcher every worker of the study uses: the study's own (set by its first worker), else the
    one asked for, else local. A worker asking for another one is refused with both names."""
    have = study.user_attrs.get(LAUNCHER_ATTR)
    if have is None:
        chosen = asked or "local"
        study.set_user_attr(LAUNCHER_ATTR, chosen)
        return chosen
    if asked is not None and asked != have:
        raise ValueError(f"--launcher={asked}: study {study.study_name!r} runs its trials with --launcher {have} "
                         f"(set by its first worker); use --launcher {have}, or another --study")
    return have


def job_table(trials: list[optuna.trial.FrozenTrial]) -> list[dict[str, Any]]:
    """One row per trial that ran as a Slurm job: its job id, phase (queued | running | done), Slurm's
    state, the trial's state and the seconds it queued and ran (what the dashboard shows)."""
    rows = []
    for t in trials:
        a = t.user_attrs
        if "slurm_job_id" not in a:
            continue
        rows.append({"trial": t.number, "job": a["slurm_job_id"], "phase": a.get("slurm_phase", "queued"),
                     "slurm state": a.get("slurm_state", "PENDING"), "trial state": t.state.name,
                     "queued (s)": a.get("queued_s"), "ran (s)": a.get("run_s"), "reason": a.get("reason", "")})
    return rows
