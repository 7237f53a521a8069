"""Issue 65 item 3: under `make test`'s -n 4 --dist loadgroup the slowest work units start first (tests/suite_order.py),
an xdist_group still runs on one worker, and --record-durations writes what each test took."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STARTED = "import os, pathlib\ndef started(name):\n    with open(pathlib.Path(__file__).with_name('started.log'), 'a') as f:\n" \
          "        f.write(os.environ['PYTEST_XDIST_WORKER'] + ' ' + name + '\\n')\n"


def _suite(folder: Path) -> None:
    """Three units: a group of two tests (test_a), a module of one (test_b), a module of two (test_c)."""
    (folder / "test_a.py").write_text("import pytest\nfrom helper import started\n"
                                      'pytestmark = pytest.mark.xdist_group("g")\n'
                                      + "".join(f"def test_a{i}():\n    started('a{i}')\n" for i in range(2)))
    (folder / "test_b.py").write_text("from helper import started\ndef test_b0():\n    started('b0')\n")
    (folder / "test_c.py").write_text("from helper import started\n"
                                      + "".join(f"def test_c{i}():\n    started('c{i}')\n" for i in range(2)))
    (folder / "helper.py").write_text(STARTED)


def inner_env(**extra: str) -> dict[str, str]:
    """The environment of a pytest run inside a test: without the outer run's PYTEST_ADDOPTS (`--timeline PATH` there
    would make PATH a test path of the inner run)."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}, **extra}


def _pytest(folder: Path, *args: str, workers: int = 2, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.suite_order",
                           "-n", str(workers), "--dist", "loadgroup", "--durations-file", "durations.json", *args],
                          cwd=folder, env=inner_env(PYTHONPATH=f"{ROOT}:{folder}", **env), capture_output=True,
                          text=True, timeout=300)


def test_the_slowest_units_start_first_and_a_group_stays_on_one_worker(tmp_path):
    """Recorded: test_b's one test 50 s, test_c's 10 + 10 s, the group's 1 + 1 s. xdist's own order (most tests per
    unit first) would start the group and test_c; ours starts test_b and test_c, the group last on one worker."""
    _suite(tmp_path)
    (tmp_path / "durations.json").write_text(json.dumps({"test_a.py::test_a0": 1, "test_a.py::test_a1": 1,
                                                         "test_b.py::test_b0": 50, "test_c.py::test_c0": 10,
                                                         "test_c.py::test_c1": 10}))
    out = _pytest(tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    started = [line.split() for line in (tmp_path / "started.log").read_text().splitlines()]
    first = {}
    for worker, name in started:
        first.setdefault(worker, name)
    assert sorted(first.values()) == ["b0", "c0"], started
    assert len({worker for worker, name in started if name.startswith("a")}) == 1, started


def test_record_durations_writes_each_tests_seconds_without_the_group_suffix(tmp_path):
    _suite(tmp_path)
    (tmp_path / "durations.json").write_text(json.dumps({"test_gone.py::test_x": 3.0}))
    out = _pytest(tmp_path, "--record-durations")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    recorded = json.loads((tmp_path / "durations.json").read_text())
    assert set(recorded) == {"test_gone.py::test_x", "test_a.py::test_a0", "test_a.py::test_a1", "test_b.py::test_b0",
                             "test_c.py::test_c0", "test_c.py::test_c1"}, recorded
    assert all(isinstance(s, float) and 0 <= s < 60 for s in recorded.values()), recorded


def test_make_test_runs_the_suite_in_this_order():
    """The Makefile's test target runs xdist's loadgroup (the order above applies); `make durations` records."""
    text = (ROOT / "Makefile").read_text()
    test = re.search(r"^test:.*\n\t(.*)\n", text, re.M).group(1)
    assert "-n $(WORKERS) --dist loadgroup" in test and "--record-durations" not in test, test
    durations = re.search(r"^durations:.*\n\t(.*)\n", text, re.M).group(1)
    assert "-n $(WORKERS) --dist loadgroup" in durations and "--record-durations" in durations, durations
    assert re.search(r"^WORKERS \?= 4$", text, re.M), "make test runs four workers"
    assert (ROOT / "tests" / "conftest.py").read_text().count("tests.suite_order") == 1


def test_the_launch_group_runs_in_two_lanes_of_whole_modules(tmp_path):
    """`launch` was one unit of 1,637 of the suite's 4,542 recorded seconds, all on one worker: now two lanes, each
    module whole in one (its fixtures on one worker), the lanes balanced by recorded seconds. Old plugin: all four
    tests on one worker."""
    from tests.suite_order import lanes

    assert lanes({"a": 5, "b": 4, "c": 3, "d": 1}, 2) == {"a": 0, "b": 1, "c": 1, "d": 0}
    for name in ("x", "y"):
        (tmp_path / f"test_{name}.py").write_text(
            "import pytest\nfrom helper import started\npytestmark = pytest.mark.xdist_group('launch')\n"
            + "".join(f"def test_{name}{i}():\n    started('{name}{i}')\n" for i in range(2)))
    (tmp_path / "helper.py").write_text(STARTED)
    (tmp_path / "durations.json").write_text(json.dumps({f"test_{n}.py::test_{n}{i}": 5 for n in "xy" for i in range(2)}))
    out = _pytest(tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    started = [line.split() for line in (tmp_path / "started.log").read_text().splitlines()]
    worker_of = {name[0]: {w for w, n in started if n[0] == name[0]} for _, name in started}
    assert all(len(workers) == 1 for workers in worker_of.values()), started  # a module stays on one worker
    assert worker_of["x"] != worker_of["y"], started  # the two lanes run side by side


def test_the_progress_figure_is_the_share_of_recorded_seconds_run(tmp_path):
    """Issue 65 item 3: `[ NN%]` tells how much of the suite's time has run. test_b's 10 tests are recorded at 10 s each
    and run first; test_a's 100 at 0.5 s. After the first line's 72 tests (test_b's 10 and 62 of test_a's) 131 of the
    150 recorded seconds have run: 87%, where pytest's count says 65% (72 of 110), as it did before."""
    (tmp_path / "test_a.py").write_text("".join(f"def test_a{i}():\n    pass\n" for i in range(100)))
    (tmp_path / "test_b.py").write_text("".join(f"def test_b{i}():\n    pass\n" for i in range(10)))
    (tmp_path / "durations.json").write_text(json.dumps({**{f"test_a.py::test_a{i}": 0.5 for i in range(100)},
                                                         **{f"test_b.py::test_b{i}": 10 for i in range(10)}}))
    out = _pytest(tmp_path, workers=1, COLUMNS="80")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    figures = re.findall(r"^[.]+ +\[ *(\d+)%\]$", out.stdout, re.M)
    assert figures == ["87", "100"], out.stdout


def test_timeline_writes_each_tests_worker_start_and_stop(tmp_path):
    """--timeline PATH: where a run's wall time goes (each phase's worker, start and stop on the controller) and its
    CPU time (each phase's CPU seconds, measured on the worker that ran it)."""
    _suite(tmp_path)
    (tmp_path / "test_b.py").write_text("import time\nfrom helper import started\ndef test_b0():\n    started('b0')\n"
                                        "    t = time.process_time()\n    while time.process_time() - t < 0.3:\n"
                                        "        pass\n")
    (tmp_path / "durations.json").write_text("{}")
    out = _pytest(tmp_path, "--timeline", "timeline.json")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    phases = json.loads((tmp_path / "timeline.json").read_text())
    calls = {p["test"]: p for p in phases if p["when"] == "call"}
    assert sorted(calls) == ["test_a.py::test_a0", "test_a.py::test_a1", "test_b.py::test_b0", "test_c.py::test_c0",
                             "test_c.py::test_c1"], phases
    assert all(p["worker"] in ("gw0", "gw1") and 0 <= p["stop"] - p["start"] < 60 for p in phases), phases
    assert all(0 <= p["cpu_s"] < 60 for p in phases), phases  # each phase's CPU seconds (CpuMeter, on the workers)
    assert calls["test_b.py::test_b0"]["cpu_s"] >= 0.2, calls  # its loop burns 0.3 s of CPU
    started = {line.split()[1]: line.split()[0] for line in (tmp_path / "started.log").read_text().splitlines()}
    assert all(calls[f"test_{name[0]}.py::test_{name}"]["worker"] == w for name, w in started.items()), (started, calls)


ONCE = """import sys, time, pathlib
sys.path.insert(0, {root!r})
from tests.run_once import computed_once
def compute():
    with open({log!r}, 'a') as f:
        f.write('computed\\n')
    time.sleep(0.5)
    if {fail}:
        raise RuntimeError('the first one failed')
    return ['a+b', 'c+d']
try:
    print(computed_once('probe', compute))
except RuntimeError as e:
    print(e)
"""


def test_a_collection_value_is_computed_by_one_worker_and_read_by_the_others(tmp_path):
    """tests/run_once.py: three processes of one xdist run ask at once; one computes, the others read its value
    (test_matrix's slice was drawn by every worker at collection, 4-10 s of CPU each); a run's first failure makes
    the others compute for themselves, and another run does not read this run's value."""
    def ask(run: str, fail: bool) -> tuple[list[str], list[str]]:
        log = tmp_path / f"{run}.log"
        code = ONCE.format(root=str(ROOT), log=str(log), fail=fail)
        procs = [subprocess.Popen([sys.executable, "-c", code], text=True, stdout=subprocess.PIPE,
                                  env={**os.environ, "PYTEST_XDIST_TESTRUNUID": run, "TMPDIR": str(tmp_path)})
                 for _ in range(3)]
        return [p.communicate(timeout=60)[0].strip() for p in procs], log.read_text().split()

    folder = tmp_path / "workbench-run-once"
    folder.mkdir()
    (folder / "probe-old.json").write_text("{}")
    os.utime(folder / "probe-old.json", (time.time() - 2 * 24 * 3600,) * 2)
    (folder / "probe-recent.json").write_text("{}")
    uid = os.urandom(8).hex()
    printed, computed = ask(f"ok-{uid}", False)
    assert printed == ["['a+b', 'c+d']"] * 3 and computed == ["computed"], (printed, computed)
    printed, computed = ask(f"failed-{uid}", True)
    assert printed == ["the first one failed"] * 3 and computed == ["computed"] * 3, (printed, computed)
    left = sorted(p.name for p in folder.iterdir())  # a run's worker removes the files of runs a day gone
    assert left == sorted(["probe-recent.json"] + [f"probe-{r}-{uid}.{s}" for r in ("ok", "failed")
                                                   for s in ("json", "lock")]), left
