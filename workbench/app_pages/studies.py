"""Optuna studies read through Optuna's public storage API, with a cache of finished trials.

Reading every trial through the storage (`get_all_trials`) costs about 2 s of CPU for 5,000
trials here: too slow for a page that refreshes every 2 s. A finished trial never changes in
Optuna, so a `StudyReader` keeps the finished ones and a refresh asks the storage only for the
trials still running or waiting and for trial numbers it has not seen yet (a few small queries).
Only public `BaseStorage` methods are used, never Optuna's tables, so an Optuna upgrade that
changes its schema cannot break the pages. Writes (start, pause, enqueue) go through Optuna too.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

OPEN_STATES = (TrialState.RUNNING, TrialState.WAITING)
RELOAD_GAP = 64
"""New trials since the last refresh beyond which one bulk read beats reading them one by one."""


@dataclass(slots=True)
class _Cached:
    study_id: int
    directions: list[str]
    finished: dict[int, FrozenTrial] = field(default_factory=dict)  # by trial number; never change
    open: dict[int, FrozenTrial] = field(default_factory=dict)  # running / waiting, re-read each refresh
    next_number: int = 0  # the first trial number not seen yet

    def absorb(self, trial: FrozenTrial) -> None:
        if trial.state.is_finished():
            self.finished[trial.number] = trial
            self.open.pop(trial.number, None)
        else:
            self.open[trial.number] = trial
        self.next_number = max(self.next_number, trial.number + 1)

    def trials(self) -> list[FrozenTrial]:
        return sorted([*self.finished.values(), *self.open.values()], key=lambda t: t.number)


class StudyReader:
    """Read-only view of the studies in one Optuna storage, refreshed incrementally."""

    def __init__(self, url: str) -> None:
        from tuning.study import reader_storage

        self.storage = reader_storage(url)
        self._cache: dict[str, _Cached] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        """Every study's name, oldest first."""
        return [s.study_name for s in self.storage.get_all_studies()]

    def trials(self, name: str) -> tuple[list[str], list[FrozenTrial]]:
        """(directions as 'maximize'/'minimize', every trial by number) of one study, up to date."""
        study_id = self.storage.get_study_id_from_name(name)  # KeyError when there is no such study
        with self._lock:
            cached = self._cache.get(name)
            if cached is None or cached.study_id != study_id:  # new, or deleted and created again
                cached = self._load(study_id)
            else:
                self._refresh(cached)
            self._cache[name] = cached
            return list(cached.directions), cached.trials()

    def _load(self, study_id: int) -> _Cached:
        directions = [d.name.lower() for d in self.storage.get_study_directions(study_id)]
        cached = _Cached(study_id, directions)
        for trial in self.storage.get_all_trials(study_id, deepcopy=False):
            cached.absorb(trial)
        return cached

    def _trial(self, study_id: int, number: int) -> FrozenTrial:
        return self.storage.get_trial(self.storage.get_trial_id_from_study_id_trial_number(study_id, number))

    def _refresh(self, cached: _Cached) -> None:
        sid = cached.study_id
        try:  # many new trials (a bulk add): one full read is cheaper than one by one
            self.storage.get_trial_id_from_study_id_trial_number(sid, cached.next_number + RELOAD_GAP)
        except KeyError:
            pass
        else:
            for trial in self.storage.get_all_trials(sid, deepcopy=False):
                cached.absorb(trial)
            return
        open_now = {t.number: t for t in self.storage.get_all_trials(sid, deepcopy=False, states=OPEN_STATES)}
        for number in [n for n in cached.open if n not in open_now]:  # finished since the last look
            cached.absorb(self._trial(sid, number))
        while True:  # trials created since the last look
            number = cached.next_number
            try:
                trial = open_now.get(number) or self._trial(sid, number)
            except KeyError:
                break
            cached.absorb(trial)
        for trial in open_now.values():
            cached.absorb(trial)

    def summaries(self) -> list[dict[str, Any]]:
        """Per study: name, directions, trial counts by `display_state` and the best first objective."""
        out = []
        for name in self.names():
            try:
                directions, trials = self.trials(name)
            except KeyError:  # deleted meanwhile
                continue
            counts: dict[str, int] = {}
            for t in trials:
                state = display_state(t)
                counts[state] = counts.get(state, 0) + 1
            firsts = [t.values[0] for t in trials if t.state == TrialState.COMPLETE and t.values]
            best = (max(firsts) if directions[:1] == ["maximize"] else min(firsts)) if firsts else None
            out.append({"study": name, "directions": directions, "counts": counts, "best": best})
        return out

    def is_paused(self, name: str) -> bool:
        """The ``paused`` study user attribute that tuning.control.pause/resume set."""
        attrs = self.storage.get_study_user_attrs(self.storage.get_study_id_from_name(name))
        return bool(attrs.get("paused", False))


def display_state(trial: FrozenTrial) -> str:
    """A trial's state as the pages count it: a draw the tuner did not run (an invalid point, a repeat of
    another trial's config) is told to Optuna as PRUNED so its sampler avoids it, and reads SKIPPED here."""
    from tuning.objective import SKIPPED_ATTR

    return "SKIPPED" if trial.user_attrs.get(SKIPPED_ATTR) else trial.state.name


def in_memory(directions: list[str], trials: list[FrozenTrial], name: str) -> optuna.Study:
    """An in-memory study holding ``trials`` (for optuna.visualization)."""
    study = optuna.create_study(directions=directions, study_name=name)
    study.add_trials(trials)
    return study
