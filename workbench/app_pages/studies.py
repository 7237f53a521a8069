"""Fast read-only access to Optuna studies in the home's SQLite file (``studies.db``).

Optuna's RDB storage builds every trial through the SQLAlchemy ORM: about 3 s for 5,000 trials
here, too slow for a page that refreshes every 2 s. These readers run a few plain SQL queries
over Optuna's documented RDB schema (studies, study_directions, trials, trial_params,
trial_values, trial_user_attributes) and rebuild `FrozenTrial`s; any schema surprise falls back
to `optuna.load_study`. Writes (start, pause, enqueue) always go through Optuna.
"""
from __future__ import annotations

import datetime as dt
import json
import sqlite3
from collections import defaultdict
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import json_to_distribution
from optuna.trial import FrozenTrial, TrialState

_VALUE_TYPES = {"FINITE": None, "INF_POS": float("inf"), "INF_NEG": float("-inf")}


def _connect(db: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    conn.row_factory = sqlite3.Row
    return conn


def summaries(db: Path) -> list[dict[str, Any]]:
    """Per study: name, directions and trial counts by state (one query each)."""
    with _connect(db) as conn:
        studies = conn.execute("SELECT study_id, study_name FROM studies ORDER BY study_id").fetchall()
        dirs: dict[int, list[str]] = defaultdict(list)
        for r in conn.execute("SELECT study_id, direction FROM study_directions ORDER BY objective"):
            dirs[r["study_id"]].append(str(r["direction"]).lower())
        counts: dict[int, dict[str, int]] = defaultdict(dict)
        for r in conn.execute("SELECT study_id, state, COUNT(*) AS n FROM trials GROUP BY study_id, state"):
            counts[r["study_id"]][str(r["state"])] = r["n"]
        best: dict[int, float] = {}
        for r in conn.execute(
                "SELECT t.study_id, MAX(v.value) AS hi, MIN(v.value) AS lo FROM trials t JOIN trial_values v "
                "ON v.trial_id = t.trial_id WHERE t.state = 'COMPLETE' AND v.objective = 0 GROUP BY t.study_id"):
            best[r["study_id"]] = r["hi"] if dirs[r["study_id"]][:1] == ["maximize"] else r["lo"]
    return [{"study": s["study_name"], "directions": dirs[s["study_id"]],
             "counts": counts[s["study_id"]], "best": best.get(s["study_id"])} for s in studies]


def _time(text: Any) -> dt.datetime | None:
    return dt.datetime.fromisoformat(str(text)) if text else None


def read_trials(db: Path, name: str) -> tuple[list[str], list[FrozenTrial]]:
    """(directions, trials) of one study, rebuilt from the tables in four queries."""
    with _connect(db) as conn:
        row = conn.execute("SELECT study_id FROM studies WHERE study_name = ?", (name,)).fetchone()
        if row is None:
            raise KeyError(f"no study {name!r} in {db}")
        sid = row["study_id"]
        directions = [str(r["direction"]).lower() for r in conn.execute(
            "SELECT direction FROM study_directions WHERE study_id = ? ORDER BY objective", (sid,))]
        trials = conn.execute("SELECT trial_id, number, state, datetime_start, datetime_complete FROM trials "
                              "WHERE study_id = ? ORDER BY number", (sid,)).fetchall()
        sub = "SELECT trial_id FROM trials WHERE study_id = ?"
        params: dict[int, dict[str, Any]] = defaultdict(dict)
        dists: dict[int, dict[str, Any]] = defaultdict(dict)
        cache: dict[str, Any] = {}
        for r in conn.execute("SELECT trial_id, param_name, param_value, distribution_json FROM trial_params "
                              f"WHERE trial_id IN ({sub})", (sid,)):
            dist = cache.get(r["distribution_json"]) or cache.setdefault(
                r["distribution_json"], json_to_distribution(r["distribution_json"]))
            params[r["trial_id"]][r["param_name"]] = dist.to_external_repr(r["param_value"])
            dists[r["trial_id"]][r["param_name"]] = dist
        values: dict[int, dict[int, float]] = defaultdict(dict)
        for r in conn.execute(f"SELECT trial_id, objective, value, value_type FROM trial_values WHERE trial_id IN ({sub})",
                              (sid,)):
            special = _VALUE_TYPES.get(str(r["value_type"]))
            values[r["trial_id"]][r["objective"]] = special if special is not None else r["value"]
        attrs: dict[int, dict[str, Any]] = defaultdict(dict)
        for r in conn.execute("SELECT trial_id, key, value_json FROM trial_user_attributes "
                              f"WHERE trial_id IN ({sub})", (sid,)):
            attrs[r["trial_id"]][r["key"]] = json.loads(r["value_json"])
    out = []
    for t in trials:
        tid, state = t["trial_id"], TrialState[str(t["state"])]
        vals = values.get(tid)
        out.append(FrozenTrial(
            number=t["number"], state=state, value=None,
            values=[vals[k] for k in sorted(vals)] if vals and state == TrialState.COMPLETE else None,
            datetime_start=_time(t["datetime_start"]), datetime_complete=_time(t["datetime_complete"]),
            params=params.get(tid, {}), distributions=dists.get(tid, {}), user_attrs=attrs.get(tid, {}),
            system_attrs={}, intermediate_values={}, trial_id=tid))
    return directions, out


def in_memory(directions: list[str], trials: list[FrozenTrial], name: str) -> optuna.Study:
    """An in-memory study holding ``trials`` (for optuna.visualization)."""
    study = optuna.create_study(directions=directions, study_name=name)
    study.add_trials(trials)
    return study


def is_paused(db: Path, name: str) -> bool:
    """The ``paused`` study user attribute that tuning.control.pause/resume set (read in one query)."""
    with _connect(db) as conn:
        row = conn.execute("SELECT a.value_json FROM study_user_attributes a JOIN studies s ON "
                           "s.study_id = a.study_id WHERE s.study_name = ? AND a.key = 'paused'",
                           (name,)).fetchone()
    return bool(json.loads(row["value_json"])) if row else False
