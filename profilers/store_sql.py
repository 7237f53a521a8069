"""The run store's two databases behind one query path: SQLite (one file, the embedded default) and
PostgreSQL (a `postgresql://` URL that launchers on several nodes write at once).

`RunStore` writes every query once, in SQLite's spelling; `PostgresBackend.sql` translates it
(placeholders, `rowid`, `instr`, the SQLite-only index hint). Each backend opens a connection,
creates or migrates the schema exactly once under a lock (SQLite: BEGIN IMMEDIATE; PostgreSQL: a
transaction-scoped advisory lock, since concurrent CREATE TABLE IF NOT EXISTS races on pg_type),
and begins write transactions.
"""
from __future__ import annotations

import re
import sqlite3
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from profilers.locks import RUN_STORE_LOCK_KEY, take_transaction_lock

URL_SCHEMES = ("postgresql://", "postgres://")

# the newest schema (SQLite's MIGRATIONS end state) in PostgreSQL's types: REAL is float4 there, so
# DOUBLE PRECISION; metrics get an explicit id for the insertion order SQLite keeps as rowid
PG_SCHEMA = """
CREATE TABLE runs (
    run_id TEXT PRIMARY KEY, name TEXT, status TEXT NOT NULL
        CHECK (status IN ('running', 'completed', 'failed', 'interrupted', 'pruned')),
    config TEXT, world_size INTEGER, layout TEXT, host TEXT, versions TEXT,
    emulated INTEGER NOT NULL DEFAULT 0, created DOUBLE PRECISION, started DOUBLE PRECISION,
    ended DOUBLE PRECISION, error TEXT, error_rank INTEGER, summary TEXT, parent TEXT);
CREATE INDEX runs_created ON runs (created);
CREATE INDEX runs_status ON runs (status, created);
CREATE INDEX runs_parent ON runs (parent);
CREATE TABLE metrics (
    id BIGSERIAL PRIMARY KEY, run_id TEXT NOT NULL, rank INTEGER NOT NULL, step INTEGER NOT NULL,
    kind TEXT NOT NULL, name TEXT NOT NULL, value DOUBLE PRECISION, time DOUBLE PRECISION);
CREATE INDEX metrics_kind_step ON metrics (run_id, kind, step, name);
CREATE INDEX metrics_name ON metrics (run_id, name, step);
CREATE TABLE segments (
    id BIGSERIAL PRIMARY KEY, run_id TEXT NOT NULL, start_step INTEGER NOT NULL,
    end_step INTEGER, trial_number INTEGER, params TEXT, value DOUBLE PRECISION, time DOUBLE PRECISION);
CREATE INDEX segments_run ON segments (run_id, start_step);
CREATE TABLE workbench_schema (version INTEGER NOT NULL);
"""
# PG_MIGRATIONS[v] takes a PostgreSQL store from version v to v + 1 (the first one was created at 2)
PG_MIGRATIONS: dict[int, str] = {
    2: "ALTER TABLE runs DROP CONSTRAINT IF EXISTS runs_status_check; ALTER TABLE runs ADD CONSTRAINT "
       "runs_status_check CHECK (status IN ('running', 'completed', 'failed', 'interrupted', 'pruned'))",
}


def is_url(location: str | Path) -> bool:
    """Whether a run store location is a PostgreSQL URL (else a SQLite file path)."""
    return str(location).startswith(URL_SCHEMES)


def redact(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class Row(tuple):
    """A result row read by position or by column name, like `sqlite3.Row` (and `dict(row)` works)."""

    def __new__(cls, values: Any, index: dict[str, int]) -> Row:
        row = super().__new__(cls, values)
        row._index = index
        return row

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return tuple.__getitem__(self, self._index[key])
        return tuple.__getitem__(self, key)

    def keys(self) -> list[str]:
        return list(self._index)


def _row_factory(cursor: Any) -> Any:
    index = {c.name: i for i, c in enumerate(cursor.description or [])}
    return lambda values: Row(values, index)


@lru_cache(maxsize=512)
def to_postgres(sql: str) -> str:
    """One SQLite-spelled query in PostgreSQL's: %s placeholders (a literal % doubled), the metrics id
    for rowid, strpos for instr, no INDEXED BY hint."""
    sql = sql.replace("%", "%%").replace("?", "%s")
    sql = re.sub(r"\browid\b", "id", sql)
    sql = re.sub(r"INDEXED BY \w+ ", "", sql)
    return re.sub(r"\binstr\(", "strpos(", sql)


class PostgresBackend:
    """Connections to one PostgreSQL database (its search_path picks the schema: `?options=-csearch_path%3DS`)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.label = redact(url)
        import psycopg

        self.errors: tuple[type[BaseException], ...] = (psycopg.Error,)

    def connect(self, schema_version: int) -> Any:
        """A new autocommit connection; the schema is created once, under the advisory lock."""
        import psycopg

        conn = psycopg.connect(self.url, autocommit=True, row_factory=_row_factory)
        try:
            with conn.transaction():
                take_transaction_lock(conn, RUN_STORE_LOCK_KEY)
                if conn.execute("SELECT to_regclass('workbench_schema')").fetchone()[0] is None:
                    conn.execute(PG_SCHEMA)
                    conn.execute("INSERT INTO workbench_schema (version) VALUES (%s)", (schema_version,))
                version = self.version(conn)
                for step in range(version, schema_version):
                    conn.execute(PG_MIGRATIONS[step])
                if version < schema_version:
                    conn.execute("UPDATE workbench_schema SET version = %s", (schema_version,))
        except BaseException:
            conn.close()
            raise
        return conn

    def version(self, conn: Any) -> int:
        return int(conn.execute("SELECT MAX(version) FROM workbench_schema").fetchone()[0])

    def sql(self, text: str) -> str:
        return to_postgres(text)

    def begin(self, conn: Any) -> None:
        conn.execute("BEGIN")

    def in_transaction(self, conn: Any) -> bool:
        from psycopg.pq import TransactionStatus

        return conn.info.transaction_status != TransactionStatus.IDLE


class SqliteBackend:
    """The embedded store: `runs.db` opened in WAL mode (see profilers/store.py)."""

    errors: tuple[type[BaseException], ...] = (sqlite3.Error,)

    def __init__(self, path: Path) -> None:
        self.path = path
        self.label = str(path)

    def sql(self, text: str) -> str:
        return text

    def begin(self, conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")  # takes the write lock up front, honouring busy_timeout

    def in_transaction(self, conn: sqlite3.Connection) -> bool:
        return conn.in_transaction

    def version(self, conn: sqlite3.Connection) -> int:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])
