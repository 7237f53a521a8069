"""The run store: SQLite in WAL mode, one file (`runs.db`) under the workbench home, or a shared
PostgreSQL database (`--runs postgresql://...` / ``$WORKBENCH_RUNS``) that launchers on several nodes
write at once; one query path for both (profilers/store_sql.py).

Writers (the telemetry server, the launcher) and readers (dashboard, CLI, tuner) may open the
same file from several processes and threads at once: WAL lets readers run while one writer
commits, ``busy_timeout`` makes a second writer wait instead of failing, and every batch of
records is one transaction, so a reader sees whole batches or nothing. Each thread (and each
process after a fork) gets its own connection, opened lazily on first use: constructing a
`RunStore` does no I/O.

Schema history (``PRAGMA user_version``): 1 = runs + metrics; 2 adds ``runs.parent`` and the
``segments`` table of live-tuning segments; 3 allows run status ``pruned`` (SQLite cannot alter a
CHECK: the runs table is rebuilt). An older file is migrated on open; a newer one is
refused with a `StoreError`, never written.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from profilers.locks import file_lock
from profilers.records import Record
from profilers.store_queries import RunQueries
from profilers.store_sql import PostgresBackend, SqliteBackend, is_url

if TYPE_CHECKING:
    import pandas as pd

STORE_FILENAME = "runs.db"
RUNS_ENV = "WORKBENCH_RUNS"  # a postgresql:// URL: the run store every launcher and dashboard shares
STATUSES = ("running", "completed", "failed", "interrupted", "pruned")
FINAL_STATUSES = ("completed", "failed", "interrupted", "pruned")  # pruned: a tuner stopped the trial's run
BUSY_TIMEOUT_MS = 30_000
_JSON_FIELDS = ("config", "layout", "host", "versions", "summary")
_RUN_FIELDS = (
    "name", "status", "config", "world_size", "layout", "host", "versions", "emulated", "parent",
    "created", "started", "ended", "error", "error_rank", "summary",
)

_V1 = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, name TEXT, status TEXT NOT NULL
        CHECK (status IN ('running', 'completed', 'failed', 'interrupted')),
    config TEXT, world_size INTEGER, layout TEXT, host TEXT, versions TEXT,
    emulated INTEGER NOT NULL DEFAULT 0, created REAL, started REAL, ended REAL,
    error TEXT, error_rank INTEGER, summary TEXT);
CREATE INDEX IF NOT EXISTS runs_created ON runs (created);
CREATE INDEX IF NOT EXISTS runs_status ON runs (status, created);
CREATE TABLE IF NOT EXISTS metrics (
    run_id TEXT NOT NULL, rank INTEGER NOT NULL, step INTEGER NOT NULL, kind TEXT NOT NULL,
    name TEXT NOT NULL, value REAL, time REAL);
CREATE INDEX IF NOT EXISTS metrics_kind_step ON metrics (run_id, kind, step, name);
CREATE INDEX IF NOT EXISTS metrics_name ON metrics (run_id, name, step);
"""
_V2 = """
ALTER TABLE runs ADD COLUMN parent TEXT;
CREATE INDEX IF NOT EXISTS runs_parent ON runs (parent);
CREATE TABLE IF NOT EXISTS segments (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, start_step INTEGER NOT NULL,
    end_step INTEGER, trial_number INTEGER, params TEXT, value REAL, time REAL);
CREATE INDEX IF NOT EXISTS segments_run ON segments (run_id, start_step);
"""
_RUNS_V3 = ("run_id, name, status, config, world_size, layout, host, versions, emulated, created, started, ended, "
            "error, error_rank, summary, parent")
_V3 = f"""
CREATE TABLE runs_v3 (
    run_id TEXT PRIMARY KEY, name TEXT, status TEXT NOT NULL
        CHECK (status IN ('running', 'completed', 'failed', 'interrupted', 'pruned')),
    config TEXT, world_size INTEGER, layout TEXT, host TEXT, versions TEXT,
    emulated INTEGER NOT NULL DEFAULT 0, created REAL, started REAL, ended REAL,
    error TEXT, error_rank INTEGER, summary TEXT, parent TEXT);
INSERT INTO runs_v3 ({_RUNS_V3}) SELECT {_RUNS_V3} FROM runs;
DROP TABLE runs;
ALTER TABLE runs_v3 RENAME TO runs;
CREATE INDEX IF NOT EXISTS runs_created ON runs (created);
CREATE INDEX IF NOT EXISTS runs_status ON runs (status, created);
CREATE INDEX IF NOT EXISTS runs_parent ON runs (parent);
"""
MIGRATIONS: tuple[str, ...] = (_V1, _V2, _V3)
"""``MIGRATIONS[i]`` takes a store from schema version i to i + 1."""
SCHEMA_VERSION = len(MIGRATIONS)


class StoreError(RuntimeError):
    """A run store that cannot be opened, read or written; names the file, the cause and a fix."""

    def __init__(self, path: Path | str, cause: str, hint: str = "") -> None:
        self.path = path if isinstance(path, str) and is_url(path) else Path(path)
        self.cause = cause
        # a URL naming no reachable server: the user's input (exit 2), not a failing store
        self.unreachable = isinstance(self.path, str) and "connection" in cause.lower() and "failed" in cause.lower()
        self.hint = hint
        super().__init__(f"run store {self.path}: {cause}" + (f"; {hint}" if hint else ""))


def default_home() -> Path:
    """The workbench home: ``$WORKBENCH_HOME`` if set, else ``./.workbench`` (absolute)."""
    home = os.environ.get("WORKBENCH_HOME") or ".workbench"
    return Path(home).expanduser().absolute()


def _hint(message: str) -> str:
    text = message.lower()
    if "full" in text:
        return "the disk (or its quota) is full: free space or choose another --home"
    if "readonly" in text or "read-only" in text or "unable to open" in text:
        return "check that the folder exists and is writable, or choose another --home / WORKBENCH_HOME"
    if "locked" in text or "busy" in text:
        return f"another process held the write lock for over {BUSY_TIMEOUT_MS // 1000} s"
    if "not a database" in text or "malformed" in text:
        return "the file is not a workbench run store (or is damaged): move it aside"
    return ""


def _opening(path: Path) -> contextlib.AbstractContextManager[None]:
    """Hold `<store>.lock` while a connection opens: SQLite answers "database is locked" at once,
    without its busy handler, when processes switch a new file to WAL together (4 processes opening
    a new store at once: 14 of 40 tries failed so); the lock makes them take turns."""
    return file_lock(path)


def _dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value, default=str, sort_keys=True)


class _Tx:
    """A write transaction's connection: each statement in the backend's SQL."""

    def __init__(self, conn: Any, backend: SqliteBackend | PostgresBackend) -> None:
        self.conn, self.backend = conn, backend

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self.conn.execute(self.backend.sql(sql), tuple(params))

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> Any:
        cursor = self.conn.cursor()
        cursor.executemany(self.backend.sql(sql), rows)
        return cursor


def _decode_run(row: Any) -> dict[str, Any]:
    out = dict(row)
    for field in _JSON_FIELDS:
        if out.get(field) is not None:
            out[field] = json.loads(out[field])
    out["emulated"] = bool(out.get("emulated"))
    return out


class RunStore(RunQueries):
    """Runs, metrics and tuning segments in one SQLite file (WAL) or one PostgreSQL database;
    safe across processes (and, on PostgreSQL, across machines)."""

    def __init__(self, path: str | Path) -> None:
        self.location = str(path) if is_url(path) else str(Path(path).expanduser().absolute())
        self.backend: SqliteBackend | PostgresBackend = (
            PostgresBackend(self.location) if is_url(path) else SqliteBackend(Path(self.location)))
        self.path: Path | str = self.location if is_url(path) else Path(self.location)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[tuple[threading.Thread, Any]] = []
        self._pid = os.getpid()

    @classmethod
    def open_home(cls, home: str | Path | None = None) -> RunStore:
        """The shared store ``$WORKBENCH_RUNS`` if set, else ``runs.db`` under ``home`` (default:
        `default_home()`); run folders (configs, error files) stay under the home either way."""
        if os.environ.get(RUNS_ENV):
            return cls(os.environ[RUNS_ENV])
        folder = Path(home).expanduser() if home is not None else default_home()
        return cls(folder / STORE_FILENAME)

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (RunStore, (self.location,))

    def __repr__(self) -> str:
        return f"RunStore({self.backend.label!r})"

    # -- connections -------------------------------------------------------------------------
    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except self.backend.errors as exc:
            raise StoreError(self.backend.label, f"{type(exc).__name__}: {exc}", _hint(str(exc))) from exc

    def _conn(self) -> sqlite3.Connection:
        if os.getpid() != self._pid:  # after fork: never share the parent's connections
            self._local = threading.local()
            self._all, self._pid = [], os.getpid()
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._open()
            self._local.conn = conn
            with self._lock:
                self._prune()
                self._all.append((threading.current_thread(), conn))
        return conn

    def _prune(self) -> None:
        """Close the connections of threads that have ended (Streamlit reruns, sampler threads)."""
        alive = []
        for thread, conn in self._all:
            if thread.is_alive():
                alive.append((thread, conn))
            else:
                conn.close()
        self._all = alive

    def _open(self) -> Any:
        if isinstance(self.backend, PostgresBackend):
            with self._errors():
                conn = self.backend.connect(SCHEMA_VERSION)
                if self.backend.version(conn) > SCHEMA_VERSION:
                    conn.close()
                    raise StoreError(self.backend.label, f"schema version {self.backend.version(conn)} is newer "
                                     f"than this workbench supports ({SCHEMA_VERSION})", "upgrade the workbench")
            return conn
        assert isinstance(self.path, Path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(self.path, f"cannot create folder {self.path.parent}: {exc.strerror}",
                             _hint("unable to open")) from exc
        with self._errors(), _opening(self.path):
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000,
                                   isolation_level=None, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            try:
                conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
                self._refuse_newer(conn)  # before WAL: switching the journal mode rewrites the header
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise StoreError(self.path, f"journal_mode is {mode}, WAL is required",
                                     "the file system must support shared memory (not NFS)")
                conn.execute("PRAGMA synchronous = NORMAL")
                self._migrate(conn)
            except BaseException:
                conn.close()
                raise
        return conn

    def _refuse_newer(self, conn: sqlite3.Connection) -> int:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(self.path, f"schema version {version} is newer than this workbench "
                             f"supports ({SCHEMA_VERSION})",
                             "upgrade the workbench, or choose another --home")
        return version

    def _migrate(self, conn: sqlite3.Connection) -> None:
        version = self._refuse_newer(conn)
        if version == SCHEMA_VERSION:
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            # re-read under the write lock: another process may have migrated meanwhile
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            for step in range(version, SCHEMA_VERSION):
                for statement in MIGRATIONS[step].split(";"):
                    if statement.strip():
                        conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {max(version, SCHEMA_VERSION)}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    @contextmanager
    def _write(self) -> Iterator[_Tx]:
        """One write transaction (SQLite: BEGIN IMMEDIATE takes the lock up front, honouring busy_timeout)."""
        conn = self._conn()
        with self._errors():
            self.backend.begin(conn)
            try:
                yield _Tx(conn, self.backend)
                conn.execute("COMMIT")
            except BaseException:
                if self.backend.in_transaction(conn):
                    conn.execute("ROLLBACK")
                raise

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        conn = self._conn()
        with self._errors():
            return conn.execute(self.backend.sql(sql), tuple(params)).fetchall()

    def schema_version(self) -> int:
        """The store's schema version (after any migration on open)."""
        conn = self._conn()
        with self._errors():
            return self.backend.version(conn)

    def journal_mode(self) -> str:
        """The file's journal mode (``wal`` for every SQLite store this class opened; ``postgresql``)."""
        if isinstance(self.backend, PostgresBackend):
            return "postgresql"
        return str(self._query("PRAGMA journal_mode")[0][0]).lower()

    def close(self) -> None:
        """Close every connection this object opened (any thread); it reopens lazily if used."""
        with self._lock:
            conns, self._all = [c for _, c in self._all], []
        for conn in conns:
            try:
                conn.close()
            except self.backend.errors:
                pass
        self._local = threading.local()

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writer API --------------------------------------------------------------------------
    def create_run(self, run_id: str, *, name: str, config: dict[str, Any], world_size: int,
                   layout: dict[str, Any] | None = None, host: dict[str, Any] | None = None,
                   versions: dict[str, Any] | None = None, emulated: bool = False,
                   parent: str | None = None, join: bool = False) -> None:
        """Insert a run with status ``running`` (``created`` and ``started`` = now). ``join=True``: the
        launchers of a multi-node run all register the same id; the first one's row stays."""
        now = time.time()
        with self._write() as conn:
            conn.execute(
                "INSERT INTO runs (run_id, name, status, config, world_size, layout, host, "
                "versions, emulated, parent, created, started) "
                "VALUES (?, ?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                + (" ON CONFLICT (run_id) DO NOTHING" if join else ""),
                (run_id, name, _dumps(config), int(world_size), _dumps(layout), _dumps(host),
                 _dumps(versions), int(bool(emulated)), parent, now, now))

    def update_run(self, run_id: str, **fields: Any) -> None:
        """Set columns of a run, e.g. ``update_run(rid, layout={...}, started=t)``.

        Dict/list columns (config, layout, host, versions, summary) are stored as JSON.
        Raises ValueError for an unknown column or status and KeyError for an unknown run.
        """
        unknown = sorted(set(fields) - set(_RUN_FIELDS))
        if unknown:
            raise ValueError(f"unknown run field(s) {unknown}; allowed: {', '.join(_RUN_FIELDS)}")
        if "status" in fields and fields["status"] not in STATUSES:
            raise ValueError(f"status={fields['status']!r} must be one of {', '.join(STATUSES)}")
        if not fields:
            return
        values = [_dumps(v) if k in _JSON_FIELDS else (int(v) if k == "emulated" else v)
                  for k, v in fields.items()]
        assignments = ", ".join(f"{k} = ?" for k in fields)
        with self._write() as conn:
            cursor = conn.execute(f"UPDATE runs SET {assignments} WHERE run_id = ?",
                                  (*values, run_id))
            if cursor.rowcount == 0:
                raise KeyError(f"no run {run_id!r} in {self.backend.label}")

    def finish_run(self, run_id: str, status: str, *, error: str | None = None,
                   error_rank: int | None = None, summary: dict[str, Any] | None = None,
                   first: bool = False) -> None:
        """Mark a run completed, failed, interrupted or pruned (``ended`` = now), with the reason. ``first=True``
        (each node of a multi-node run): only while still running, so the first node's outcome stays,
        except that a failure replaces another node's completion."""
        if status not in FINAL_STATUSES:
            raise ValueError(f"status={status!r} must be one of {', '.join(FINAL_STATUSES)}")
        fields: dict[str, Any] = {"status": status, "ended": time.time(), "error": error,
                                  "error_rank": error_rank}
        if summary is not None:
            fields["summary"] = summary
        if not first:
            self.update_run(run_id, **fields)
            return
        values = [_dumps(v) if k in _JSON_FIELDS else v for k, v in fields.items()]
        replaceable = "('running', 'completed')" if status == "failed" else "('running')"
        with self._write() as conn:
            conn.execute(f"UPDATE runs SET {', '.join(f'{k} = ?' for k in fields)} "
                         f"WHERE run_id = ? AND status IN {replaceable}", (*values, run_id))

    def write(self, records: Sequence[Record]) -> int:
        """Append a batch of records in one transaction; returns how many were written."""
        if not records:
            return 0
        rows = [r.to_row() if isinstance(r, Record) else Record.from_row(r).to_row()
                for r in records]
        with self._write() as conn:
            conn.executemany("INSERT INTO metrics (run_id, rank, step, kind, name, value, time) "
                             "VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
        return len(rows)

    def add_segment(self, run_id: str, *, start_step: int, end_step: int | None = None,
                    trial_number: int | None = None, params: dict[str, Any] | None = None,
                    value: float | None = None) -> int:
        """Record a live-tuning segment (steps start..end run with ``params``); returns its id."""
        with self._write() as conn:
            cursor = conn.execute(
                "INSERT INTO segments (run_id, start_step, end_step, trial_number, params, value, "
                "time) VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id",
                (run_id, int(start_step), end_step, trial_number, _dumps(params), value,
                 time.time()))
            return int(cursor.fetchone()[0])

    def end_segment(self, segment_id: int, *, end_step: int, value: float | None = None) -> None:
        """Close an open segment with its last step and its measured objective value."""
        with self._write() as conn:
            conn.execute("UPDATE segments SET end_step = ?, value = ? WHERE id = ?",
                         (int(end_step), value, int(segment_id)))

    # -- reader API --------------------------------------------------------------------------
    def runs(self, limit: int = 100, status: str | None = None,
             parent: str | None = None) -> list[dict[str, Any]]:
        """The newest runs first, optionally only one status or the children of ``parent``."""
        where, params = [], []
        if status is not None:
            where.append("status = ?")
            params.append(status)
        if parent is not None:
            where.append("parent = ?")
            params.append(parent)
        sql = "SELECT * FROM runs" + (" WHERE " + " AND ".join(where) if where else "")
        rows = self._query(sql + " ORDER BY created DESC LIMIT ?", (*params, int(limit)))
        return [_decode_run(r) for r in rows]

    def run(self, run_id: str) -> dict[str, Any] | None:
        """One run's row (JSON columns decoded), or None."""
        rows = self._query("SELECT * FROM runs WHERE run_id = ?", (run_id,))
        return _decode_run(rows[0]) if rows else None

    def latest_steps(self, run_id: str, n: int = 50) -> list[dict[str, Any]]:
        """The last ``n`` steps of ``kind='step'`` records, oldest first.

        Each dict holds ``step``, ``time`` (latest record time), ``ranks`` (how many ranks
        reported) and every step metric by its stored name (``loss``, ``step_time(s)``, ...),
        averaged over the ranks that reported it.
        """
        rows = self._query(
            "SELECT step, name, AVG(value) AS value, MAX(time) AS time, COUNT(DISTINCT rank) AS "
            "ranks FROM metrics WHERE run_id = ? AND kind = 'step' AND step IN (SELECT DISTINCT "
            "step FROM metrics WHERE run_id = ? AND kind = 'step' ORDER BY step DESC LIMIT ?) "
            "GROUP BY step, name ORDER BY step", (run_id, run_id, int(n)))
        steps: dict[int, dict[str, Any]] = {}
        for row in rows:
            entry = steps.setdefault(row["step"], {"step": row["step"], "time": 0.0, "ranks": 0})
            entry[row["name"]] = row["value"]
            entry["time"] = max(entry["time"], row["time"] or 0.0)
            entry["ranks"] = max(entry["ranks"], row["ranks"])
        return list(steps.values())

    def metrics(self, run_id: str, kind: str | None = None, name: str | None = None,
                rank: int | None = None, since_step: int | None = None,
                as_frame: bool = False) -> list[Record] | pd.DataFrame:
        """Records of a run filtered by kind/name/rank/step (> since_step), in step order."""
        where, params = ["run_id = ?"], [run_id]
        for column, value in (("kind", kind), ("name", name), ("rank", rank)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if since_step is not None:
            where.append("step > ?")
            params.append(int(since_step))
        rows = self._query("SELECT run_id, rank, step, kind, name, value, time FROM metrics "
                           f"WHERE {' AND '.join(where)} ORDER BY step, rank, time, rowid", params)
        records = [Record.from_row(tuple(r)) for r in rows]
        if not as_frame:
            return records
        import pandas as pd

        columns = ["run_id", "rank", "step", "kind", "name", "value", "time"]
        return pd.DataFrame([r.to_row() for r in records], columns=columns)

    def segments(self, run_id: str) -> list[dict[str, Any]]:
        """The live-tuning segments of a run, in step order (params decoded)."""
        rows = self._query("SELECT * FROM segments WHERE run_id = ? ORDER BY start_step, id",
                           (run_id,))
        out = [dict(r) for r in rows]
        for seg in out:
            seg["params"] = json.loads(seg["params"]) if seg["params"] else {}
        return out
