"""The study's database: its URL (SQLite by default, PostgreSQL or MySQL for workers on several
hosts), the Optuna RDB storage with heartbeats, the lock that serializes opening it and screening a
draw (profilers/locks.py, shared with the run store), and the callback that marks a stale trial's
run interrupted in the run store. tuning/study.py holds the search itself (samplers, pruners, the
ask/tell loop) and re-exports these names.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna

from profilers.locks import STUDY_LOCK_KEY, advisory_lock, database_lock
from profilers.store import default_home

HEARTBEAT_S = 5
GRACE_S = 15


def default_storage(home: str | Path | None = None) -> str:
    path = Path(home) if home else default_home()
    path.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path.resolve() / 'studies.db'}"


class StorageError(ValueError):
    """A storage URL that cannot be used: unknown dialect, missing driver, server not answering."""


def with_driver(url: str) -> str:
    """A bare ``postgresql://`` URL with the driver that is installed: SQLAlchemy 2.1 picks psycopg 3
    for it and older versions psycopg2, whichever is missing here."""
    if not url.startswith(("postgresql://", "postgres://")):
        return url
    import importlib.util

    rest = url.split("://", 1)[1]
    for module, dialect in (("psycopg", "postgresql+psycopg"), ("psycopg2", "postgresql+psycopg2")):
        if importlib.util.find_spec(module) is not None:
            return f"{dialect}://{rest}"
    return url


def _shown(url: str) -> str:
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - an unparsable URL is shown as given
        return url


def _storage_error(url: str, exc: BaseException) -> StorageError:
    """One line naming the URL, what is wrong with it and what to do."""
    import sqlalchemy.exc as sa

    shown = f"storage={_shown(url)!r}"
    if isinstance(exc, sa.NoSuchModuleError):
        return StorageError(f"{shown}: unknown database dialect {url.split(':', 1)[0]!r}; use "
                            "sqlite:///PATH, postgresql://USER@HOST:PORT/DB or mysql+pymysql://USER@HOST/DB")
    if isinstance(exc, sa.ArgumentError):
        return StorageError(f"{shown}: not a database URL ({exc}); e.g. sqlite:///studies.db")
    if isinstance(exc, ImportError):  # optuna re-raises a missing driver as a plain ImportError
        missing = exc if isinstance(exc, ModuleNotFoundError) else exc.__cause__ or exc.__context__
        name = getattr(missing, "name", None) or "?"
        hint = " (pip install 'psycopg[binary]')" if url.startswith("postgres") else \
            " (pip install pymysql and use mysql+pymysql://)" if url.startswith("mysql") else ""
        return StorageError(f"{shown}: its Python driver {name!r} is not installed{hint}")
    if isinstance(exc, sa.OperationalError):
        first = str(getattr(exc, "orig", exc) or exc).strip().splitlines()
        return StorageError(f"{shown}: cannot connect: {first[0] if first else type(exc).__name__}")
    return StorageError(f"{shown}: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")


def make_storage(url: str | None, home: str | Path | None = None, *, heartbeat_s: int | None = None,
                 grace_s: int | None = None) -> optuna.storages.RDBStorage:
    """An RDB storage with heartbeats (WORKBENCH_HEARTBEAT_S / WORKBENCH_GRACE_S override the defaults).
    Raises StorageError (one line) when the URL cannot be used."""
    given = url or default_storage(home)
    url = with_driver(given)
    heartbeat_s = heartbeat_s or int(os.environ.get("WORKBENCH_HEARTBEAT_S", HEARTBEAT_S))
    grace_s = grace_s or int(os.environ.get("WORKBENCH_GRACE_S", GRACE_S))
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("sqlite"):
        kwargs["connect_args"] = {"timeout": 60}  # several workers share one file: wait for the lock
    elif url.startswith("postgresql"):
        kwargs["connect_args"] = {"connect_timeout": 10}  # a host that drops packets fails in 10 s, not minutes
    import inspect

    # optuna 4.9 renamed failed_trial_callback; pyproject allows older versions too
    params = inspect.signature(optuna.storages.RDBStorage).parameters
    callback = "heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback" in params else "failed_trial_callback"
    import sqlalchemy.exc

    try:
        with _schema_lock(url), warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeats: stable enough for us
            return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, heartbeat_interval=heartbeat_s,
                                              grace_period=grace_s, **{callback: _interrupt_run(home)})
    except (sqlalchemy.exc.SQLAlchemyError, ImportError) as exc:
        raise _storage_error(given, exc) from exc


def reader_storage(url: str) -> optuna.storages.RDBStorage:
    """A storage without heartbeats, for readers (the dashboard): opened under the same schema lock as the
    tuner's workers, or a reader opening a new studies.db while a worker creates its tables crashes that
    worker (busy CI: "UNIQUE constraint failed: alembic_version.version_num", the study never started)."""
    with _schema_lock(with_driver(url)):
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})


def _schema_lock(url: str) -> contextlib.AbstractContextManager[None]:
    """Serialize opening one study database (and screening a draw: `_study_lock`) across processes: Optuna
    creates its tables and version row without a lock, and workers started together fail, on SQLite with
    "table ... already exists", on PostgreSQL with UniqueViolation "pg_type_typname_nsp_index" (its CREATE
    TABLE IF NOT EXISTS is not atomic). SQLite: a lock file; PostgreSQL: the study's advisory lock
    (profilers/locks.py, a key of its own: run stores opening meanwhile do not wait)."""
    return database_lock(url, key=STUDY_LOCK_KEY)


def _backend(study: optuna.Study) -> Any:
    """The study's own storage: Optuna wraps an RDBStorage in a cache."""
    return getattr(study._storage, "_backend", study._storage)


def _study_lock(study: optuna.Study) -> contextlib.AbstractContextManager[None]:
    """The lock of the study's database (the schema lock: held for moments), across processes and threads;
    none for a storage without a URL (in memory: one process). On PostgreSQL it is taken on a connection
    of the storage's own pool, not a new engine and connection per draw."""
    backend = _backend(study)
    url = getattr(backend, "url", None)
    if not isinstance(url, str):
        return contextlib.nullcontext()
    if url.startswith("postgresql"):
        return advisory_lock(url, key=STUDY_LOCK_KEY, on=backend.engine)
    return _schema_lock(url)


def _interrupt_run(home: str | Path | None) -> Callable[[optuna.Study, optuna.trial.FrozenTrial], None]:
    """When a stale trial is failed, mark its run interrupted too: its launcher died with the worker,
    so nobody else will ever finish that row (it would say "running" forever)."""

    def callback(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        from profilers.store import RunStore, StoreError

        run_id = trial.user_attrs.get("run_id")
        if not run_id:
            return
        store = RunStore.open_home(home)
        try:
            run = store.run(run_id)
            if run is not None and run["status"] == "running":
                store.finish_run(run_id, "interrupted", error=f"the tuner running trial {trial.number} of study "
                                 f"{study.study_name} stopped sending heartbeats (killed?)")
        except StoreError:
            pass  # a store we cannot write must not stop the study
        finally:
            store.close()

    return callback
