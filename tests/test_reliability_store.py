"""The run store survives its faults: a writer SIGKILLed in the middle of a batch leaves only whole
batches and loses none it had committed; stores of older schema versions are migrated (even by two
processes at once), newer or foreign files are refused with a clear message and left untouched; a
full disk during a real run fails the run with the reason instead of losing its telemetry silently;
a read-only home gives a clear error in the CLI, never a traceback.
"""
from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from profilers.records import Record
from profilers.store import MIGRATIONS, SCHEMA_VERSION, RunStore, StoreError

ROOT = Path(__file__).resolve().parent.parent
BATCH = 2000  # records per transaction: big enough that a kill often lands inside one
KILLS = 8

_WRITER = """
import sys, time
from profilers.records import Record
from profilers.store import RunStore
path, batch, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
store = RunStore(path)
store.create_run("w", name="w", config={}, world_size=1) if store.run("w") is None else None
start = len(store.metrics("w")) // batch
for b in range(start, start + 100000):
    rows = [Record("w", 0, b, "step", f"r{i}", float(i), time.time()) for i in range(batch)]
    if mode == "stall" and b == start + 2:
        with store._write() as conn:  # one batch half inserted, its transaction still open
            conn.executemany("INSERT INTO metrics (run_id, rank, step, kind, name, value, time) "
                             "VALUES (?, ?, ?, ?, ?, ?, ?)", [r.to_row() for r in rows[:batch // 2]])
            print(f"STALLED {b}", flush=True)
            time.sleep(3600)
    store.write(rows)
    print(f"COMMITTED {b}", flush=True)
"""


def _start_writer(path: Path, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(BATCH), mode], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _read_until(proc: subprocess.Popen, prefix: str, count: int) -> list[int]:
    seen: list[int] = []
    while len(seen) < count:
        line = proc.stdout.readline()
        assert line, "the writer died early"
        if line.startswith(prefix):
            seen.append(int(line.split()[1]))
    return seen


def _batches_read_back(path: Path) -> dict[int, int]:
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    counts: dict[int, int] = {}
    for rec in RunStore(path).metrics("w"):
        counts[rec.step] = counts.get(rec.step, 0) + 1
    return counts


def test_writer_killed_mid_transaction_leaves_whole_batches(tmp_path):
    path = tmp_path / "runs.db"
    proc = _start_writer(path, "stall")
    committed = _read_until(proc, "COMMITTED", 2)
    _read_until(proc, "STALLED", 1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    batches = _batches_read_back(path)
    assert batches == {b: BATCH for b in committed}  # the open half batch is gone, nothing else is


def test_writer_killed_at_random_moments_loses_no_committed_batch(tmp_path):
    """Kill the writer again and again at varying points; after each kill the store reads back every
    batch the writer saw committed, each whole, and at most the one batch in flight besides."""
    path = tmp_path / "runs.db"
    lost, written, in_flight_kept = 0, 0, 0
    for kill in range(KILLS):
        proc = _start_writer(path, "plain")
        committed = _read_until(proc, "COMMITTED", 1)
        time.sleep(0.013 * kill)  # a different moment of the next batch each time
        os.kill(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate()
        committed += [int(line.split()[1]) for line in rest.splitlines() if line.startswith("COMMITTED")]
        written = max(written, max(committed) + 1)
        batches = _batches_read_back(path)
        assert set(batches.values()) == {BATCH}, "a torn batch"
        lost += len([b for b in range(written) if b not in batches])
        extra = sorted(set(batches) - set(range(written)))
        assert len(extra) <= 1  # committed just before the kill, its line never printed
        in_flight_kept += len(extra)
        written += len(extra)
    assert lost == 0
    print(f"\nstore writer killed {KILLS} times: {written} batches ({written * BATCH} records) committed, "
          f"{in_flight_kept} in-flight batches found whole, 0 lost, 0 torn")


def _v1_store(path: Path, runs: int = 3, records: int = 500) -> None:
    raw = sqlite3.connect(path)
    raw.executescript(MIGRATIONS[0])
    for i in range(runs):
        raw.execute("INSERT INTO runs (run_id, name, status, config, world_size, created) VALUES "
                    "(?, 'legacy', 'completed', '{}', 2, ?)", (f"old{i}", float(i)))
        raw.executemany("INSERT INTO metrics VALUES (?, 0, ?, 'step', 'loss', ?, 0.0)",
                        [(f"old{i}", s, float(s)) for s in range(records)])
    raw.execute("PRAGMA user_version = 1")
    raw.commit()
    raw.close()


_MIGRATE = """
import sys
from profilers.store import RunStore
store = RunStore(sys.argv[1])
print(store.schema_version(), len(store.runs()), flush=True)
"""


def test_older_store_is_migrated_by_two_processes_at_once(tmp_path):
    path = tmp_path / "runs.db"
    _v1_store(path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _MIGRATE, str(path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    assert [o.split() for o, _ in outs] == [[str(SCHEMA_VERSION), "3"]] * 2
    store = RunStore(path)
    assert store.schema_version() == SCHEMA_VERSION
    assert [len(store.metrics(f"old{i}")) for i in range(3)] == [500] * 3  # no record lost in the migration
    store.create_run("new", name="new", config={}, world_size=1, parent="study:x#0")  # the v2 column works
    assert store.run("new")["parent"] == "study:x#0" and store.run("old0")["parent"] is None
    store.finish_run("new", "pruned", error="pruned by the tuner at step 3")  # v3: a pruned trial's run
    assert store.run("new")["status"] == "pruned" and store.run("old1")["status"] == "completed"


def test_a_run_the_tuner_pruned_reads_pruned_not_interrupted():
    import optuna

    from engine.launch.run_record import stop_status

    assert stop_status(optuna.TrialPruned(3)) == ("pruned", "pruned by the tuner at step 3")
    assert stop_status(KeyboardInterrupt())[0] == "interrupted"


@pytest.mark.parametrize("content,pattern", [
    ("newer", rf"schema version {SCHEMA_VERSION + 1} is newer than this workbench supports \({SCHEMA_VERSION}\); "
              "upgrade the workbench"),
    ("garbage", r"file is not a database; the file is not a workbench run store \(or is damaged\): move it aside"),
])
def test_newer_or_foreign_store_is_refused_untouched(tmp_path, content, pattern):
    path = tmp_path / "runs.db"
    if content == "newer":
        with sqlite3.connect(path) as raw:
            raw.execute("CREATE TABLE future (x)")
            raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    else:
        path.write_bytes(b"this is not sqlite" * 100)
    before = path.read_bytes()
    with pytest.raises(StoreError, match=pattern) as info:
        RunStore(path).runs()
    assert str(path) in str(info.value)
    assert path.read_bytes() == before  # refused means not written
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "--home", str(tmp_path), "runs"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "400"})
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "error: run store" in out.stderr and str(path) in " ".join(out.stderr.split())
    assert path.read_bytes() == before


def _read_only_folder() -> Path:
    """A folder this process cannot write: mode 555, plus the immutable flag when root (root ignores
    permission bits, not `chattr +i`)."""
    folder = Path(tempfile.mkdtemp(prefix="wb-ro-", dir="/tmp"))
    folder.chmod(0o555)
    if os.geteuid() == 0:
        out = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
        if out.returncode != 0:
            folder.chmod(0o755)
            folder.rmdir()
            pytest.skip(f"running as root and chattr +i is not available here: {out.stderr.strip()}")
    return folder


def test_read_only_home_gives_a_clear_cli_error():
    folder = _read_only_folder()
    env = {**os.environ, "COLUMNS": "400", "OMP_NUM_THREADS": "1"}
    try:
        with pytest.raises(OSError):
            (folder / "probe").write_text("x")  # really read-only for us
        procs = {cmd: subprocess.Popen([sys.executable, "-m", "workbench.cli", "--home", str(folder), *cmd.split()],
                                       cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for cmd in ("runs", "run --set train.steps=1")}
        outs = {cmd: (p.communicate(timeout=120)[1], p.returncode)[::-1] for cmd, p in procs.items()}
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(folder)], check=False)
        folder.chmod(0o755)
        shutil.rmtree(folder)
    for cmd, (code, err) in outs.items():
        assert code == 1, (cmd, code, err[-2000:])
        assert "Traceback" not in err, (cmd, err[-2000:])
        text = " ".join(err.split())
        assert str(folder) in text and "writable" in text, (cmd, text)


def test_full_disk_during_a_real_run_fails_it_with_the_reason(tmp_path, monkeypatch):
    """The telemetry writer's connection can grow the file by no page (SQLITE_FULL, as on a full disk):
    the launcher stops the run at once and marks it failed with the store's message; nothing is
    reported as stored that is not."""
    from engine.config.schema import load_config
    from engine.launch.local import launch

    opened = RunStore._open

    def open_full(self: RunStore) -> sqlite3.Connection:
        conn = opened(self)
        if "telemetry" in __import__("threading").current_thread().name:
            pages = conn.execute("PRAGMA page_count").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count = {pages}")
        return conn

    monkeypatch.setattr(RunStore, "_open", open_full)
    cfg = load_config(None, ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=32",
                             "train.steps=200", "batch.global=4", "batch.micro=4", "train.timeout_s=30",
                             "profile.host_interval_s=0", "profile.nvml_interval_s=0"])
    started = time.time()
    result = launch(cfg, home=tmp_path, raise_on_failure=False)
    wall = time.time() - started
    run = RunStore.open_home(tmp_path).run(result.run_id)
    assert run["status"] == "failed" and result.status == "failed"
    assert run["error"].startswith("the run failed: the run store could not take this run's telemetry (")
    assert "database or disk is full" in run["error"] and run["error_rank"] is None, run["error"]
    assert "records not stored" in run["error"]
    steps = RunStore.open_home(tmp_path).metrics(result.run_id, kind="step")
    assert len({r.step for r in steps}) < cfg.train.steps  # stopped early, not after 200 silent steps
    assert wall < 90
    print(f"\nfull disk: run failed after {wall:.1f} s with: {run['error'][:160]}")


def test_processes_opening_a_new_store_at_once_all_open_it(tmp_path):
    """Two nodes' launchers (or tuner workers) open a new runs.db at the same moment: SQLite answered
    "database is locked" at once to some of them (switching a new file to WAL does not wait on the
    busy timeout): 14 of 40 tries of 4 processes failed before `<store>.lock` serialized the open."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    failed = []
    # one pool for the six tries (a spawned process costs ~2 s of CPU to start here), all four started before the
    # first try's opens are handed out
    with ctx.Pool(4, initializer=_wait_for_all, initargs=(ctx.Barrier(4),)) as pool:
        for trial in range(6):
            path = tmp_path / f"t{trial}" / "runs.db"
            start = time.time() + 1.0
            failed += [r for r in pool.starmap(_open_at, [(str(path), start)] * 4, chunksize=1) if r != "ok"]
    assert failed == []


def _wait_for_all(barrier) -> None:
    barrier.wait(timeout=120)


def _open_at(path: str, start: float) -> str:
    # asleep until 20 ms before the start, then spinning: the four opens still land within about a millisecond of
    # one another, and the wait no longer burns a core per process for up to a second (the suite is CPU-bound)
    time.sleep(max(0.0, start - time.time() - 0.02))
    while time.time() < start:
        pass
    try:
        RunStore(path).schema_version()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - the test reports what each process saw
        return f"{type(exc).__name__}: {exc}"
