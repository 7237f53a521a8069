"""Studies running in background worker processes, steered from the dashboard.

Workers are `workbench tune` processes in their own sessions (closing the browser stops nothing);
their pids live in `<home>/workers.json`. Pause and resume are a study user attribute that every
worker checks between trials; the space file is re-read between trials, so editing it steers the
study live.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna

from profilers.store import default_home
from tuning.study import check_study_name, default_storage, make_storage


def _home(home: str | Path | None) -> Path:
    return Path(home) if home else default_home()


def _registry(home: str | Path | None) -> Path:
    return _home(home) / "workers.json"


def _read(home: str | Path | None) -> dict[str, list[dict[str, Any]]]:
    try:
        return json.loads(_registry(home).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _write(home: str | Path | None, data: dict[str, list[dict[str, Any]]]) -> None:
    path = _registry(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def study_dir(study_name: str, home: str | Path | None = None) -> Path:
    path = _home(home) / "studies" / check_study_name(study_name)  # a ConfigError before any file is written
    path.mkdir(parents=True, exist_ok=True)
    return path


_CHILDREN: dict[int, subprocess.Popen] = {}
"""Workers this process started: polled so that a finished one is reaped, not left <defunct>."""


def _alive(pid: int) -> bool:
    child = _CHILDREN.get(pid)
    if child is not None:
        if child.poll() is None:
            return True
        _CHILDREN.pop(pid, None)  # poll() waited for it: the zombie is gone
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a finished child that nobody waited for is a zombie: not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def reap() -> int:
    """Wait for every finished worker this process started (no <defunct> left); returns how many."""
    return sum(not _alive(pid) for pid in list(_CHILDREN))


def start_workers(study_name: str, space_yaml: str, base_config_yaml: str, *, storage: str | None = None,
                  n_trials: int, jobs: int = 1, home: str | Path | None = None,
                  extra_args: list[str] | None = None) -> list[int]:
    """Start `jobs` background workers sharing `n_trials`; returns their pids."""
    folder = study_dir(study_name, home)
    (folder / "space.yaml").write_text(space_yaml)
    (folder / "base.yaml").write_text(base_config_yaml)
    storage = storage or default_storage(home)
    env = {**os.environ, "WORKBENCH_HOME": str(_home(home))}
    pids = []
    shares = [n_trials // jobs + (1 if i < n_trials % jobs else 0) for i in range(jobs)]
    for i, share in enumerate(s for s in shares if s > 0):
        cmd = [sys.executable, "-m", "workbench.cli", "tune", str(folder / "space.yaml"), "--base",
               str(folder / "base.yaml"), "--trials", str(share), "--study", study_name, "--storage", storage,
               "--json", *(extra_args or [])]
        with open(folder / f"worker-{int(time.time())}-{i}.log", "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _CHILDREN[proc.pid] = proc
        pids.append(proc.pid)
    data = _read(home)
    data.setdefault(study_name, []).extend({"pid": p, "started": time.time()} for p in pids)
    _write(home, data)
    return pids


def running_workers(study_name: str, home: str | Path | None = None) -> list[int]:
    return [w["pid"] for w in _read(home).get(study_name, []) if _alive(w["pid"])]


def stop_workers(study_name: str, home: str | Path | None = None, grace_s: float = 5.0) -> int:
    """SIGTERM each worker's session (its running trial's ranks included); returns how many."""
    pids = running_workers(study_name, home)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0)):
        for pid in pids:
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.time() + wait
        while time.time() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
    data = _read(home)
    data[study_name] = [w for w in data.get(study_name, []) if _alive(w["pid"])]
    _write(home, data)
    return len(pids)


def _study(study_name: str, storage: str | None) -> optuna.Study:
    return optuna.load_study(study_name=study_name, storage=make_storage(storage))


def pause(study_name: str, storage: str | None = None) -> None:
    _study(study_name, storage).set_user_attr("paused", True)


def resume(study_name: str, storage: str | None = None) -> None:
    _study(study_name, storage).set_user_attr("paused", False)


def is_paused(study_name: str, storage: str | None = None) -> bool:
    return bool(_study(study_name, storage).user_attrs.get("paused", False))


def enqueue(study_name: str, storage: str | None, params: dict[str, Any]) -> None:
    """Queue a config by hand: the next free worker runs exactly these params."""
    _study(study_name, storage).enqueue_trial(params)
