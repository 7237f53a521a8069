"""RunStore: round trip, WAL, schema versions, reader queries, errors, concurrency."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sqlite3
import tempfile
import threading
from pathlib import Path

import pytest

from profilers.records import Record
from profilers.store import (MIGRATIONS, SCHEMA_VERSION, STORE_FILENAME, RunStore, StoreError,
                             default_home)


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> RunStore:
    """The same tests over both backends (a fresh PostgreSQL schema each; skipped without a server)."""
    if request.param == "sqlite":
        s = RunStore(tmp_path / "runs.db")
        yield s
        s.close()
        return
    from tests.pg_schema import pg_schema

    with pg_schema() as url:
        s = RunStore(url)
        yield s
        s.close()


def _rec(run: str, rank: int, step: int, kind: str, name: str, value: float) -> Record:
    return Record(run, rank, step, kind, name, value, 1000.0 + step)


def test_round_trip(store: RunStore) -> None:
    store.create_run("r1", name="first", config={"model": {"layers": 4}, "lr": 0.1},
                     world_size=2, layout={"dp": 2}, host={"hostname": "h"},
                     versions={"torch": "2.13"}, emulated=True, parent="study-1")
    records = [_rec("r1", rank, step, "step", "loss", 3.0 - step * 0.1 + rank)
               for step in range(3) for rank in range(2)]
    assert store.write(records) == len(records)
    got = store.metrics("r1")
    assert sorted(got, key=lambda r: (r.step, r.rank)) == records
    run = store.run("r1")
    assert run is not None
    assert run["config"] == {"model": {"layers": 4}, "lr": 0.1}
    assert run["layout"] == {"dp": 2} and run["host"] == {"hostname": "h"}
    assert run["emulated"] is True and run["parent"] == "study-1"
    assert run["status"] == "running" and run["ended"] is None
    store.finish_run("r1", "failed", error="boom", error_rank=1, summary={"steps": 3})
    run = store.run("r1")
    assert run["status"] == "failed" and run["error"] == "boom" and run["error_rank"] == 1
    assert run["summary"] == {"steps": 3} and run["ended"] >= run["started"]
    assert store.run("missing") is None
    frame = store.metrics("r1", kind="step", rank=1, since_step=0, as_frame=True)
    assert list(frame["step"]) == [1, 2] and set(frame["rank"]) == {1}


def test_wal_mode_and_schema_version(store: RunStore, tmp_path: Path) -> None:
    store.create_run("r", name="n", config={}, world_size=1)
    if store.journal_mode() == "postgresql":
        assert store.schema_version() == SCHEMA_VERSION
        return
    assert store.journal_mode() == "wal"
    assert store.schema_version() == SCHEMA_VERSION
    with sqlite3.connect(tmp_path / "runs.db") as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_migrates_older_store(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    raw = sqlite3.connect(path)
    raw.executescript(MIGRATIONS[0])
    raw.execute("INSERT INTO runs (run_id, name, status, config, world_size, created) "
                "VALUES ('old', 'legacy', 'completed', '{}', 2, 1.0)")
    raw.execute("PRAGMA user_version = 1")
    raw.commit()
    raw.close()
    store = RunStore(path)
    assert store.schema_version() == SCHEMA_VERSION
    old = store.run("old")
    assert old is not None and old["name"] == "legacy" and old["parent"] is None
    seg = store.add_segment("old", start_step=0, end_step=9, trial_number=3, params={"x": 1},
                            value=0.5)
    assert store.segments("old") == [{"id": seg, "run_id": "old", "start_step": 0,
                                      "end_step": 9, "trial_number": 3, "params": {"x": 1},
                                      "value": 0.5, "time": store.segments("old")[0]["time"]}]
    store.close()


def test_refuses_newer_store(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    raw = sqlite3.connect(path)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 3}")
    raw.commit()
    raw.close()
    with pytest.raises(StoreError, match=rf"schema version {SCHEMA_VERSION + 3} is newer"):
        RunStore(path).runs()
    with sqlite3.connect(path) as raw:  # refused means untouched
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 3
        assert raw.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0


def _filled(store: RunStore) -> None:
    store.create_run("a", name="a", config={"lr": 0.1, "dp": 2}, world_size=2)
    recs = []
    for step in range(5):
        for rank in range(2):
            recs += [_rec("a", rank, step, "step", "loss", 10 - step + rank),
                     _rec("a", rank, step, "step", "step_time(s)", 0.5 + 0.1 * rank)]
            recs += [_rec("a", rank, step, "breakdown", f"{p}(s)", v) for p, v in
                     (("forward", 0.1), ("backward", 0.2 + rank), ("other", 0.05))]
    # two ranks, two steps of all_reduce: bytes, time and busbw (2 ranks: factor 1)
    for rank, step, nbytes, seconds in ((0, 0, 4e9, 2.0), (0, 1, 4e9, 1.0),
                                        (1, 0, 4e9, 2.0), (1, 1, 4e9, 1.0)):
        recs += [_rec("a", rank, step, "comm", "all_reduce/bytes", nbytes),
                 _rec("a", rank, step, "comm", "all_reduce/time(s)", seconds),
                 _rec("a", rank, step, "comm", "all_reduce/busbw(GB/s)", nbytes / seconds / 1e9)]
    recs += [_rec("a", 0, 0, "memory", "rss(GiB)", 1.0), _rec("a", 0, 1, "memory", "rss(GiB)", 2.0),
             _rec("a", 1, 0, "memory", "peak_allocated(GiB)", 5.0),
             _rec("a", 1, 0, "memory", "rss(GiB)", 9.0)]
    store.write(recs)


def test_reader_queries(store: RunStore) -> None:
    _filled(store)
    latest = store.latest_steps("a", n=2)
    assert [s["step"] for s in latest] == [3, 4]
    assert latest[-1]["loss"] == pytest.approx((6 + 7) / 2)  # mean over ranks
    assert latest[-1]["step_time(s)"] == pytest.approx(0.55) and latest[-1]["ranks"] == 2
    assert store.step_breakdown("a", 2) == {0: {"forward": 0.1, "backward": 0.2, "other": 0.05},
                                            1: {"forward": 0.1, "backward": 1.2, "other": 0.05}}
    table = store.breakdown_table("a")
    assert len(table) == 10 and set(table.columns) >= {"step", "rank", "forward", "total"}
    row = table[(table.step == 3) & (table["rank"] == 1)].iloc[0]
    assert row["total"] == pytest.approx(0.1 + 1.2 + 0.05) and row["data"] == 0.0
    comm = store.comm_totals("a")["all_reduce"]
    assert comm["bytes"] == pytest.approx(8e9) and comm["time(s)"] == pytest.approx(3.0)
    # bus bytes over total time: (4e9 + 4e9) / 3 s, not the mean of 2 and 4 GB/s
    assert comm["busbw(GB/s)"] == pytest.approx(8 / 3) and comm["ranks"] == 2
    assert store.peak_memory("a") == {0: 2.0, 1: 5.0}  # CUDA peak preferred over RSS


def test_compare_runs_and_filters(store: RunStore) -> None:
    _filled(store)
    store.create_run("b", name="b", config={"lr": 0.2, "dp": 2}, world_size=2)
    store.write([_rec("b", 0, 0, "step", "loss", 4.0)])
    store.finish_run("b", "completed")
    frame = store.compare(["a", "b"])
    assert list(frame.columns) == ["a", "b"]
    assert frame.loc["config.lr", "a"] == 0.1 and frame.loc["config.lr", "b"] == 0.2
    assert frame.loc["final_loss", "a"] == pytest.approx(6.5)
    assert frame.loc["status", "b"] == "completed" and frame.loc["steps", "a"] == 5
    assert [r["run_id"] for r in store.runs()] == ["b", "a"]
    assert [r["run_id"] for r in store.runs(status="running")] == ["a"]
    assert len(store.runs(limit=1)) == 1


def test_update_run_rules(store: RunStore) -> None:
    store.create_run("r", name="n", config={}, world_size=1)
    store.update_run("r", layout={"tp": 2}, started=5.0)
    assert store.run("r")["layout"] == {"tp": 2} and store.run("r")["started"] == 5.0
    with pytest.raises(ValueError, match="unknown run field"):
        store.update_run("r", colour="red")
    with pytest.raises(ValueError, match="status='done' must be one of"):
        store.update_run("r", status="done")
    with pytest.raises(KeyError, match="no run 'nope'"):
        store.update_run("nope", name="x")
    with pytest.raises(ValueError, match="must be one of completed"):
        store.finish_run("r", "running")


def test_default_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path / "home"))
    assert default_home() == tmp_path / "home"
    store = RunStore.open_home()
    assert store.path == tmp_path / "home" / STORE_FILENAME
    store.runs()
    assert (tmp_path / "home" / STORE_FILENAME).exists()
    monkeypatch.delenv("WORKBENCH_HOME")
    monkeypatch.chdir(tmp_path)
    assert default_home() == tmp_path / ".workbench"


def _open_in_child(path: Path, as_uid: int | None) -> str:
    """Open the store in a forked child (optionally as another user); returns its message."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        os.close(read)
        message = "NO ERROR"
        try:
            if as_uid is not None:
                os.setgid(as_uid)
                os.setuid(as_uid)
            RunStore(path).runs()
        except StoreError as exc:
            message = f"STORE_ERROR {exc}"
        except BaseException as exc:
            message = f"OTHER {type(exc).__name__}: {exc}"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(pid, 0)
    return message


def test_read_only_folder_gives_store_error() -> None:
    folder = Path(tempfile.mkdtemp(prefix="wb-ro-", dir="/tmp"))
    try:
        folder.chmod(0o555)
        # root ignores permission bits: open the store as the unprivileged 'nobody' when root
        message = _open_in_child(folder / "runs.db", 65534 if os.geteuid() == 0 else None)
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder)
    assert message.startswith("STORE_ERROR"), message
    assert str(folder / "runs.db") in message and "writable" in message


def test_full_disk_gives_store_error(store: RunStore) -> None:
    if store.journal_mode() == "postgresql":
        pytest.skip("SQLite's page limit stands in for a full disk; PostgreSQL has no such knob per session")
    store.create_run("r", name="n", config={}, world_size=1)
    # a page limit makes SQLite fail exactly as on a full disk (SQLITE_FULL)
    store._conn().execute("PRAGMA max_page_count = 20")
    big = [_rec("r", 0, i, "step", "x" * 200, float(i)) for i in range(5000)]
    with pytest.raises(StoreError, match="full") as info:
        store.write(big)
    assert str(store.path) in str(info.value)
    assert store.metrics("r") == []  # the failed batch is rolled back whole


def test_threads_write_concurrently(store: RunStore) -> None:
    store.create_run("t", name="n", config={}, world_size=4)

    def writer(rank: int) -> None:
        for step in range(30):
            store.write([_rec("t", rank, step, "step", "loss", 1.0)] * 5)

    threads = [threading.Thread(target=writer, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store.metrics("t")) == 4 * 30 * 5


def _process_writer(path: str, rank: int) -> None:
    store = RunStore(path)
    for step in range(40):
        store.write([Record("p", rank, step, "step", "loss", 1.0, 0.0)] * 3)
    store.close()


def test_processes_write_concurrently(tmp_path: Path) -> None:
    path = str(tmp_path / "runs.db")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_process_writer, args=(path, r)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(RunStore(path).metrics("p")) == 2 * 40 * 3


_READERS = [("latest_steps", ("a",), {"n": 3}), ("step_breakdown", ("a", 2), {}), ("breakdown_table", ("a",), {}),
            ("comm_totals", ("a",), {}), ("wire_totals", ("a",), {}), ("peak_memory", ("a",), {}),
            ("segments", ("a",), {}), ("run_summary", ("a",), {}), ("compare", (["a"],), {}),
            ("step_frame", ("a",), {}), ("breakdown_steps", ("a",), {"max_steps": 2}),
            ("breakdown_ranks", ("a",), {}), ("comm_points", ("a",), {"max_steps": 1}),
            ("series", ("a", "memory"), {"max_points": 1}), ("series", ("a", "step"), {}),
            ("memory_peaks", ("a",), {}), ("metrics", ("a",), {"kind": "comm", "as_frame": True})]


def _same(a, b) -> bool:
    import pandas as pd

    if isinstance(a, pd.DataFrame):
        pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True), check_dtype=False)
        return True
    if isinstance(a, list) and a and isinstance(a[0], dict):  # segments: each store stamps its own time
        return [{k: v for k, v in d.items() if k != "time"} for d in a] == \
            [{k: v for k, v in d.items() if k != "time"} for d in b]
    return a == b


@pytest.mark.parametrize("reader, args, kwargs", _READERS, ids=[f"{r[0]}-{i}" for i, r in enumerate(_READERS)])
def test_every_reader_answers_the_same_on_sqlite_and_postgresql(tmp_path: Path, reader, args, kwargs) -> None:
    from tests.pg_schema import pg_schema

    with pg_schema() as url:
        answers = []
        for s in (RunStore(tmp_path / "runs.db"), RunStore(url)):
            _filled(s)
            seg = s.add_segment("a", start_step=0, trial_number=1, params={"lr": 0.1})
            s.end_segment(seg, end_step=4, value=2.5)
            answers.append(getattr(s, reader)(*args, **kwargs))
            s.close()
        assert _same(*answers), answers


def _pg_writer(url: str, rank: int) -> None:
    store = RunStore(url)  # each process opens a fresh schema: creation must happen once, under the lock
    store.create_run(f"run{rank}", name="n", config={}, world_size=1)
    for step in range(40):
        store.write([Record(f"run{rank}", 0, step, "step", "loss", 1.0 / (step + 1), 0.0)] * 3)
    store.finish_run(f"run{rank}", "completed")
    store.close()


def test_launchers_on_several_nodes_share_one_postgresql_store(tmp_path: Path) -> None:
    from tests.pg_schema import pg_schema

    with pg_schema() as url:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_pg_writer, args=(url, r)) for r in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        store = RunStore(url)
        assert sorted(r["run_id"] for r in store.runs()) == ["run0", "run1", "run2", "run3"]
        assert all(r["status"] == "completed" for r in store.runs())
        assert [len(store.metrics(f"run{r}")) for r in range(4)] == [120] * 4
        assert store.schema_version() == SCHEMA_VERSION
        import psycopg

        with psycopg.connect(url) as raw:
            assert raw.execute("SELECT COUNT(*) FROM workbench_schema").fetchone()[0] == 1
        store.close()


def test_workbench_runs_points_every_open_home_at_the_shared_store(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.pg_schema import pg_schema

    with pg_schema() as url:
        monkeypatch.setenv("WORKBENCH_RUNS", url)
        store = RunStore.open_home(tmp_path)
        assert store.journal_mode() == "postgresql" and "runs.db" not in repr(store)
        store.create_run("x", name="n", config={}, world_size=1)
        assert RunStore.open_home(tmp_path / "elsewhere").run("x")["name"] == "n"
        assert not (tmp_path / "runs.db").exists()
        store.close()


def test_a_postgresql_store_of_schema_2_is_migrated_to_take_pruned_runs(tmp_path: Path) -> None:
    from tests.pg_schema import pg_schema

    with pg_schema() as url:
        first = RunStore(url)
        assert first.runs() == []  # opens it: the schema is created
        first.close()
        import psycopg

        with psycopg.connect(url, autocommit=True) as raw:  # the store as schema 2 made it
            raw.execute("ALTER TABLE runs DROP CONSTRAINT runs_status_check")
            raw.execute("ALTER TABLE runs ADD CONSTRAINT runs_status_check CHECK "
                        "(status IN ('running', 'completed', 'failed', 'interrupted'))")
            raw.execute("UPDATE workbench_schema SET version = 2")
        store = RunStore(url)
        assert store.schema_version() == SCHEMA_VERSION
        store.create_run("r", name="r", config={}, world_size=1)
        store.finish_run("r", "pruned", error="pruned by the tuner at step 2")
        assert store.run("r")["status"] == "pruned"
        store.close()
