"""Study storage URLs: `postgresql://` works with the installed driver (a real server at 127.0.0.1:5432,
trust auth, database `test`), and a URL that cannot be used is one line and exit 2, never a traceback."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import optuna
import pytest

from tuning.study import StorageError, make_storage, with_driver

pytestmark = pytest.mark.xdist_group("launch")

REPO = Path(__file__).resolve().parent.parent
PG_URL = "postgresql://postgres@127.0.0.1:5432/test"


def _server_listens(host: str = "127.0.0.1", port: int = 5432) -> bool:
    """Only the server's absence may skip: a missing driver or a refused login must fail the test."""
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _workbench(*args: str, home: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    # a wide terminal: the error is one line, which Rich would wrap at 80 columns
    env = {**os.environ, "WORKBENCH_HOME": str(home), "OMP_NUM_THREADS": "1", "COLUMNS": "400"}
    return subprocess.run([sys.executable, "-m", "workbench.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_bare_postgresql_url_gets_the_installed_driver():
    url = with_driver(PG_URL)
    assert url.startswith(("postgresql+psycopg://", "postgresql+psycopg2://")), url
    assert with_driver("sqlite:///x.db") == "sqlite:///x.db"


@pytest.mark.slow
def test_tune_on_postgresql_as_documented(tmp_path):
    if not _server_listens():
        pytest.skip("no PostgreSQL server listens on 127.0.0.1:5432")
    study = f"pg-{uuid.uuid4().hex[:10]}"
    try:
        out = _workbench("tune", "examples/space.yaml", "--base", "examples/tiny.yaml", "--trials", "2",
                         "--storage", PG_URL, "--study", study, "--seed", "0", "--json", home=tmp_path)
        # invalid draws of examples/space.yaml are skipped (told PRUNED, marked skipped), not run
        assert out.returncode == 0, out.stderr[-3000:]
        trials = optuna.load_study(study_name=study, storage=make_storage(PG_URL)).get_trials()
        ran = [t for t in trials if not t.user_attrs.get("skipped")]
        assert len(ran) == 2 and all(t.state.is_finished() for t in trials)
    finally:
        try:
            optuna.delete_study(study_name=study, storage=make_storage(PG_URL))
        except KeyError:
            pass


@pytest.mark.parametrize("url,said", [
    ("mongodb://127.0.0.1/x", "unknown database dialect 'mongodb'"),
    ("postgresql://postgres@127.0.0.1:1/test", "cannot connect"),
    ("not-a-url", "not a database URL"),
])
def test_storage_url_errors_are_one_line_and_exit_2(tmp_path, url, said):
    for command in (["studies"], ["export", "any"],
                    ["tune", "examples/space.yaml", "--base", "examples/tiny.yaml", "--trials", "1"]):
        out = _workbench(*command, "--storage", url, home=tmp_path, timeout=120)
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert out.returncode == 2, (command, out.stderr[-2000:])
        assert len(lines) == 1 and said in lines[0] and "Traceback" not in out.stderr, (command, out.stderr)
    assert not (tmp_path / "runs").exists()  # refused before any process started
    with pytest.raises(StorageError, match=said):
        make_storage(url)


def _open_storage(url: str, go, out) -> None:
    go.wait()
    try:
        make_storage(url)
        out.put("ok")
    except Exception as exc:  # noqa: BLE001 - the parent asserts on what each worker saw
        out.put(f"{type(exc).__name__}: {exc}")


def test_workers_opening_a_fresh_postgresql_database_at_once_all_succeed():
    """Optuna creates its tables with CREATE TABLE IF NOT EXISTS, which PostgreSQL does not serialize:
    two `workbench tune` workers started together on an empty database failed in CI with
    UniqueViolation "pg_type_typname_nsp_index". Four processes open one fresh database at once."""
    if not _server_listens():
        pytest.skip("no PostgreSQL server listens on 127.0.0.1:5432")
    import multiprocessing as mp

    import sqlalchemy

    name = f"wb_race_{uuid.uuid4().hex[:10]}"
    admin = sqlalchemy.create_engine(with_driver(PG_URL), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sqlalchemy.text(f"CREATE DATABASE {name}"))
    try:
        ctx = mp.get_context("spawn")
        go, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_open_storage, args=(PG_URL.rsplit("/", 1)[0] + f"/{name}", go, out))
                 for _ in range(4)]
        for p in procs:
            p.start()
        go.set()
        seen = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        assert seen == ["ok"] * 4, seen
    finally:
        with admin.connect() as conn:
            conn.execute(sqlalchemy.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()
