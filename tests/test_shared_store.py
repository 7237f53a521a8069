"""A run store in PostgreSQL: launchers on two "nodes" (separate homes, no shared files) write runs into
one database at once, `workbench runs` lists both, and the dashboard draws them from it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from profilers.store import RunStore
from tests.pg_schema import pg_schema

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.xdist_group("launch")


def _workbench(*args: str, home: Path, runs: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "400"}
    return subprocess.Popen([sys.executable, "-m", "workbench.cli", "--home", str(home), "--runs", runs, *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_runs_value_that_is_not_a_postgresql_url_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "--runs", "runs.db", "runs"], cwd=REPO,
                         capture_output=True, text=True, env={**os.environ, "COLUMNS": "400"})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: --runs='runs.db': must be a postgresql:// URL "
                                               "(e.g. postgresql://USER@HOST:5432/DB); the SQLite run store is "
                                               "runs.db under --home"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_launchers_share_one_postgresql_run_store_and_the_dashboard_reads_it(tmp_path, monkeypatch):
    with pg_schema() as url:
        procs = [_workbench("run", "examples/tiny.yaml", "--json", "--set", "train.steps=3", "--set",
                            "train.eval_interval=0", "--set", f"name=node{i}", home=tmp_path / f"node{i}", runs=url)
                 for i in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
        store = RunStore(url)
        runs = {r["name"]: r for r in store.runs()}
        assert set(runs) == {"node0", "node1"} and {r["status"] for r in runs.values()} == {"completed"}
        for r in runs.values():
            steps = {(m.rank, m.step) for m in store.metrics(r["run_id"], kind="step", name="loss")}
            assert steps == {(rank, step) for rank in (0, 1) for step in range(3)}
        assert not any((tmp_path / f"node{i}" / "runs.db").exists() for i in range(2))
        listed = _workbench("runs", home=tmp_path / "elsewhere", runs=url).communicate(timeout=120)[0]
        assert all(r["run_id"] in listed for r in runs.values())

        from tests.test_app import chart_titles, render

        monkeypatch.setenv("WORKBENCH_RUNS", url)
        at = render(tmp_path / "dashboard-home", "run", monkeypatch)  # a home with no runs.db at all
        at.selectbox(key="run_pick").set_value(runs["node1"]["run_id"]).run()
        assert not at.exception
        assert "Loss" in chart_titles(at)
        store.close()
