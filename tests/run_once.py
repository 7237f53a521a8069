"""A value that every xdist worker needs at collection, computed by one of them and read by the rest.

Four workers collecting at once each paid for tests/test_matrix.py's slice (every cell's verdict and code hash:
4-10 s of CPU apiece on 2 cores, the most costly module to collect); `computed_once` lets the first worker to ask
compute it and the others, who must collect the same tests, wait for its file. The file is this run's own
(`PYTEST_XDIST_TESTRUNUID`, which xdist gives each worker of one run); without xdist the value is just computed.
The worker that computes removes the files of runs over a day old.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from tools.matrix.compat import replace_atomically

WAIT_S = 300  # a loaded 2-core machine: the first worker computes beside three others
KEEP_S = 24 * 3600  # a run's files outlive it by a day at most


def computed_once(name: str, compute: Callable[[], Any]) -> Any:
    """`compute()` (a JSON value), computed once per xdist run and shared with the run's other workers; a worker
    that finds the first one failed, or waits past WAIT_S, computes it itself."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        return compute()
    folder = Path(tempfile.gettempdir()) / "workbench-run-once"
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}-{run}.json"
    try:
        os.close(os.open(path.with_suffix(".lock"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return _waited_for(path, compute)
    _remove_old_runs(folder)
    try:
        value = compute()
    except BaseException:
        _write(path, {"failed": True})
        raise
    _write(path, {"value": value})
    return value


def _waited_for(path: Path, compute: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if path.exists():
            found = json.loads(path.read_text())
            return found["value"] if "value" in found else compute()
        time.sleep(0.05)
    return compute()


def _write(path: Path, record: dict) -> None:
    replace_atomically(path, json.dumps(record).encode())  # whole or absent for the readers


def _remove_old_runs(folder: Path) -> None:
    for old in folder.iterdir():
        with contextlib.suppress(OSError):  # another run's worker may remove it first
            if time.time() - old.stat().st_mtime > KEEP_S:
                old.unlink()
