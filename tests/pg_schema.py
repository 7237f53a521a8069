"""A fresh PostgreSQL schema per test on the local server (127.0.0.1:5432, trust, database `test`):
`with pg_schema() as url:` yields a run store URL whose search_path is a new schema, dropped after."""
from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"


def server_listens(host: str = "127.0.0.1", port: int = 5432) -> bool:
    """Only the server's absence may skip: a missing driver or a refused login must fail the test."""
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


@contextmanager
def pg_schema() -> Iterator[str]:
    """A run store URL on a schema of its own (skips the test when no server listens)."""
    if not server_listens():
        pytest.skip("no PostgreSQL server listens on 127.0.0.1:5432")
    import psycopg

    schema = f"wb_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")
