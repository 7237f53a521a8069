"""What the dashboard started: background runs, kept in a small JSON registry in the home.

The registry (``$WORKBENCH_HOME/ui/jobs.json``) lets a reopened browser, or another Streamlit
session, find the runs still going and stop them. Launching writes the config as YAML under
``$WORKBENCH_HOME/ui/configs/`` and starts ``python -m workbench.cli run CFG --json`` in its own
process session, so closing the browser never stops the work.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from engine.errors import ConfigError, ConfigErrors
from profilers.store import RunStore, default_home

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(kw_only=True, slots=True)
class Job:
    """A background run started from the dashboard."""

    job_id: str  # unique id of this launch
    pid: int  # the `workbench run` launcher (leader of its own process group)
    name: str  # the run config's name (the run id starts with it)
    started: float  # Unix seconds
    config_path: str  # the YAML that was launched
    log_path: str  # the launcher's stdout and stderr
    run_id: str | None = None  # filled in once the launcher has registered the run


def ui_folder(home: Path | None = None) -> Path:
    """``$WORKBENCH_HOME/ui``, created on demand."""
    folder = (home or default_home()) / "ui"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def load_jobs(home: Path | None = None) -> list[Job]:
    """Every job in the registry, newest first (an unreadable file counts as empty)."""
    path = ui_folder(home) / "jobs.json"
    try:
        rows = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return []
    return sorted((Job(**row) for row in rows), key=lambda j: j.started, reverse=True)


def save_jobs(jobs: list[Job], home: Path | None = None) -> None:
    """Write the registry atomically (rename), so a concurrent reader sees old or new, never half."""
    path = ui_folder(home) / "jobs.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps([asdict(j) for j in jobs], indent=1))
    tmp.replace(path)


def parse_config(text: str) -> tuple[dict[str, Any] | None, list[ConfigError]]:
    """Parse and validate run-config YAML: (the config as a dict, []) or (None, every error)."""
    from engine.config.schema import from_dict, validate

    try:
        data = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as exc:
        return None, [ConfigError("config", "(YAML)", f"is not valid YAML: {exc}".replace("\n", " "))]
    if not isinstance(data, dict):
        return None, [ConfigError("config", data, "must hold a mapping at the top level")]
    try:
        cfg = from_dict(data)
        validate(cfg)
        from engine.train.memory import check_fits

        check_fits(cfg)  # the same refusal `workbench run` gives, shown before Launch
    except ConfigErrors as exc:
        return None, list(exc.errors)
    except ConfigError as exc:
        return None, [exc]
    return cfg.to_dict(), []


def launch_run(config: dict[str, Any], *, home: Path | None = None) -> Job:
    """Start a validated config as a background `workbench run`; returns its registry entry."""
    home = home or default_home()
    folder = ui_folder(home)
    job_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    cfg_path = folder / "configs" / f"{config.get('name', 'run')}-{job_id}.yaml"
    log_path = folder / "logs" / f"{job_id}.log"
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {**os.environ, "WORKBENCH_HOME": str(home), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    started = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "run", str(cfg_path), "--json"],
                                cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    _CHILDREN[proc.pid] = proc
    job = Job(job_id=job_id, pid=proc.pid, name=str(config.get("name", "run")), started=started,
              config_path=str(cfg_path), log_path=str(log_path))
    save_jobs([job, *load_jobs(home)], home)
    return job


_CHILDREN: dict[int, subprocess.Popen] = {}
"""Launchers this server process started: polled so that finished ones are reaped (no zombies)."""


def is_alive(pid: int) -> bool:
    """Whether the process runs (a zombie counts as finished)."""
    child = _CHILDREN.get(pid)
    if child is not None:
        return child.poll() is None  # poll() reaps a finished child
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def reap_children() -> int:
    """Wait for every finished launcher and tuning worker this server started, so none stays
    <defunct>; returns how many were reaped."""
    from tuning import control

    done = [pid for pid, child in list(_CHILDREN.items()) if child.poll() is not None]  # sessions are threads
    for pid in done:
        _CHILDREN.pop(pid, None)
    return len(done) + control.reap()


def resolve_run_id(job: Job, store: RunStore, home: Path | None = None) -> str | None:
    """The run id the launcher registered for ``job`` (same name, created after the launch)."""
    if job.run_id:
        return job.run_id
    for run in store.runs(limit=50):
        if run["name"] == job.name and (run.get("created") or 0) >= job.started - 1.0:
            jobs = load_jobs(home)
            claimed = {j.run_id for j in jobs if j.run_id}
            if run["run_id"] in claimed:
                continue
            job.run_id = run["run_id"]
            save_jobs([job if j.job_id == job.job_id else j for j in jobs], home)
            return job.run_id
    return None


def job_for_run(run_id: str, store: RunStore, home: Path | None = None) -> Job | None:
    """The registry entry that launched ``run_id``, if the dashboard started it."""
    for job in load_jobs(home):
        if resolve_run_id(job, store, home) == run_id:
            return job
    return None


def stop_job(job: Job, *, store: RunStore | None = None, grace_s: float = 8.0) -> bool:
    """Stop a launched run: SIGINT (the launcher stops its ranks and marks the run interrupted),
    then SIGTERM and SIGKILL for anything left. Returns whether the process had been running."""
    if not is_alive(job.pid):
        return False
    try:
        # the ranks run in the launcher's child session: collect them before the launcher exits
        tree = psutil.Process(job.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGTERM, 2.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(job.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        deadline = time.time() + wait
        while time.time() < deadline and is_alive(job.pid):
            time.sleep(0.1)
        if not is_alive(job.pid):
            break
    for proc in tree:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(tree, timeout=5.0)  # a kill is asynchronous: return once the tree is gone
    if store is not None and job.run_id:
        run = store.run(job.run_id)
        if run is not None and run["status"] == "running":
            store.finish_run(job.run_id, "interrupted", error="stopped from the dashboard")
    return True


def running_jobs(home: Path | None = None) -> list[Job]:
    """Registry entries whose launcher is still alive."""
    return [j for j in load_jobs(home) if is_alive(j.pid)]


def workers_line(pids: list[int], paused: bool) -> str:
    """What the study's workers are doing, in words (it read "workers running: none · active")."""
    listed = f"{len(pids)} worker{'s' if len(pids) != 1 else ''} (pid {', '.join(map(str, pids))})" if pids else ""
    if pids and not paused:
        return f"{listed} running: each runs a trial, then asks the study for the next"
    if pids:
        return f"Paused: {listed} finish their current trial, then wait for Resume"
    if paused:
        return "Paused, and no worker is running: Resume, then start workers to continue the study"
    return "No worker is running for this study: start or continue it above (Search space, base config and start)"
