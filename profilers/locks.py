"""The locks the workbench's databases take across processes, and their keys: one helper that the run
store (profilers/store.py, profilers/store_sql.py) and the tuner's study database (tuning/study.py)
both import.

- A lock file (`<target>.lock`, fcntl.flock): SQLite files, opened or created by several processes.
- A PostgreSQL advisory lock, one key per purpose, so unrelated purposes never wait on each other:
  `RUN_STORE_LOCK_KEY` while a run store creates or migrates its schema (transaction-scoped),
  `STUDY_LOCK_KEY` while Optuna creates a study database's tables and while a worker screens a
  draw (session-scoped, through SQLAlchemy, as Optuna's storage).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RUN_STORE_LOCK_KEY = 0x776F726B62656E63  # "workbenc": a run store's schema creation and migration
STUDY_LOCK_KEY = 0x776F726B73747564  # "workstud": opening a study database, screening a draw


@contextlib.contextmanager
def file_lock(target: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on `<target>.lock` (created if missing); none where the folder is read-only
    (whatever opens `target` there names the problem itself)."""
    import fcntl

    try:
        handle = open(f"{target}.lock", "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def take_transaction_lock(conn: Any, key: int) -> None:
    """Take PostgreSQL's advisory lock `key` until the current transaction of `conn` (psycopg) ends."""
    conn.execute("SELECT pg_advisory_xact_lock(%s)", (key,))


def engine(url: str, **connect_args: Any) -> Any:
    """A one-connection SQLAlchemy engine for `url` (NullPool: nothing stays open after `dispose()`)."""
    import sqlalchemy
    from sqlalchemy.pool import NullPool

    return sqlalchemy.create_engine(url, poolclass=NullPool, connect_args=connect_args)


@contextlib.contextmanager
def advisory_lock(url: str, *, key: int, on: Any = None) -> Iterator[None]:
    """Hold PostgreSQL's session advisory lock `key` on a connection of the SQLAlchemy engine `on`, or,
    without one (before a storage exists), of a one-connection engine made for `url`."""
    import sqlalchemy

    own = on is None
    if own:
        on = engine(url, connect_timeout=10)
    try:
        with on.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), {"key": key})
            try:
                yield
            finally:
                conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:key)"), {"key": key})
    finally:
        if own:
            on.dispose()


def database_lock(url: str, *, key: int) -> contextlib.AbstractContextManager[None]:
    """The cross-process lock of the database at SQLAlchemy `url`: PostgreSQL's advisory lock `key`, a
    lock file beside a SQLite file, none for anything else (in memory: one process)."""
    if url.startswith("postgresql"):
        return advisory_lock(url, key=key)
    if url.startswith("sqlite:///"):
        return file_lock(url.removeprefix("sqlite:///"))
    return contextlib.nullcontext()
