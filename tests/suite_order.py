"""The suite's order under xdist (`make test`: -n 3 --dist loadgroup): the slowest work first, so no worker is
left alone with a long test at the end. A unit is an xdist_group (xdist hands it to one worker at once) or a
module (its tests kept together in their order; xdist hands them out one at a time). Units run by their
recorded seconds, most first (tests/durations.json, which `make test` rewrites: --record-durations);
a test with no record counts as UNRECORDED_S. Runs without xdist keep pytest's own order. Under xdist the
progress figure is the share of recorded seconds run (SecondsProgress), not of tests.

A pytest plugin: tests/conftest.py imports its hooks; `-p tests.suite_order` loads it elsewhere."""
from __future__ import annotations

import json
import resource
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
UNRECORDED_S = {"slow": 30.0, "other": 1.0}  # a test marked slow runs "more than a few seconds" (pyproject)
_SECONDS: dict[str, float] = defaultdict(float)  # this run's seconds per test, for --record-durations


def plain_nodeid(nodeid: str) -> str:
    """The nodeid without the @group suffix xdist's loadgroup adds on its workers."""
    return nodeid.split("@")[0] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid


def unit_of(item: pytest.Item) -> str:
    """The work unit xdist's loadgroup hands a worker: the test's group names joined as xdist joins them, else
    its module."""
    names = sorted(_group_names(item))
    return "@" + "_".join(names) if names else item.nodeid.split("::")[0]


def expected_s(item: pytest.Item, durations: dict[str, float]) -> float:
    recorded = durations.get(plain_nodeid(item.nodeid))
    if recorded is not None:
        return recorded
    return UNRECORDED_S["slow" if item.get_closest_marker("slow") else "other"]


def slowest_units_first(items: list[pytest.Item], durations: dict[str, float]) -> list[pytest.Item]:
    """`items` regrouped by work unit, units by their seconds (most first, ties in collection order), each unit's
    tests in collection order."""
    units: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        units[unit_of(item)].append(item)
    seconds = {name: sum(expected_s(i, durations) for i in members) for name, members in units.items()}
    order = sorted(units, key=lambda name: -seconds[name])  # stable: dict order is first appearance
    return [item for name in order for item in units[name]]


def read_durations(path: Path) -> dict[str, float]:
    return json.loads(path.read_text()) if path.exists() else {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-durations", action="store_true",
                     help="Write each test's seconds (setup + call + teardown) into tests/durations.json at the end, "
                          "beside the recorded tests this run did not run")
    parser.addoption("--durations-file", default=str(DURATIONS), help="The durations file (default: %(default)s)")
    parser.addoption("--timeline", default=None, metavar="PATH",
                     help="Write each test phase's worker, start and stop (epoch seconds) as JSON to PATH at the end: "
                          "where a run's wall time goes beside its CPU time (idle workers, the last one's tail)")


# A group split into lanes, whole modules each (their module fixtures stay on one worker), balanced by recorded
# seconds: "launch" keeps the multi-rank runs off each other, and was one worker's 36% of the suite alone (1,637 of
# 4,542 recorded seconds): with it whole, no number of workers made `make test` shorter than that one worker's queue
LANES = {"launch": 2}


def lanes(module_seconds: dict[str, float], n: int) -> dict[str, int]:
    """Each module's lane (0..n-1): the slowest first onto the least-loaded lane (ties: the lower lane)."""
    load = [0.0] * n
    out: dict[str, int] = {}
    for module in sorted(module_seconds, key=lambda m: (-module_seconds[m], m)):
        lane = load.index(min(load))
        out[module] = lane
        load[lane] += module_seconds[module]
    return out


class GroupLanes:
    """Renames each split group's mark to its lane's ("launch" -> "launch-0", "launch-1") on every node that
    carries it, before xdist reads the marks into the nodeid (its own collection hook)."""

    def __init__(self, durations: dict[str, float]) -> None:
        self.durations = durations

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for group, n in LANES.items():
            members = [i for i in items if group in _group_names(i)]
            seconds: dict[str, float] = defaultdict(float)
            for item in members:
                seconds[item.nodeid.split("::")[0]] += expected_s(item, self.durations)
            lane_of = lanes(seconds, n)
            for item in members:
                lane = pytest.mark.xdist_group(f"{group}-{lane_of[item.nodeid.split('::')[0]]}").mark
                for node in item.listchain():
                    node.own_markers[:] = [lane if _is_group(m, group) else m for m in node.own_markers]


def _group_names(item: pytest.Item) -> set[str]:
    return {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}


def _is_group(mark: Any, group: str) -> bool:
    return mark.name == "xdist_group" and (mark.args[0] if mark.args else mark.kwargs.get("name")) == group


class SecondsProgress:
    """The controller's `[ NN%]`: the share of the collected tests' recorded seconds that has run, not of their
    count. With the slowest units first, pytest's count-based figure crawled (21% after 18 of a quiet run's 33
    minutes) and then raced; a figure in recorded seconds moves with the clock. A test without a record counts
    UNRECORDED_S["other"] (the controller has no items to read a `slow` mark from)."""

    def __init__(self, config: pytest.Config, durations: dict[str, float]) -> None:
        self.config, self.durations = config, durations
        self.expected: dict[str, float] = {}
        self.total = 0.0

    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        if self.expected:  # every worker collects the same ids
            return
        self.expected = {i: self.durations.get(plain_nodeid(i), UNRECORDED_S["other"]) for i in ids}
        self.total = sum(self.expected.values())
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None and getattr(reporter, "_show_progress_info", None) == "progress":
            # pytest has no hook for the progress figure: its reporter's one method that makes it is replaced
            reporter._get_progress_information_message = lambda: self.message(reporter._progress_nodeids_reported)

    def message(self, reported: set[str]) -> str:
        done = sum(self.expected.get(nodeid, 0.0) for nodeid in reported)
        return f" [{int(done * 100 / self.total + 1e-6) if self.total else 100:3d}%]"  # 1e-6: the sums' rounding


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of the children it has waited for (torchrun's ranks, once
    torchrun is waited for; a server a fixture stops counts in the phase that stops it)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class CpuMeter:
    """With --timeline, where the tests run (each xdist worker, or the one process): the CPU seconds each test phase
    took (`cpu_seconds`), sent with its report as the user property `cpu_s`."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Any:
        outcome = yield
        start = item.stash.get(_PHASE_CPU, None)
        item.stash[_PHASE_CPU] = now = cpu_seconds()  # the next phase starts where this one's report is made
        if start is not None:
            outcome.get_result().user_properties.append(("cpu_s", round(now - start, 3)))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        item.stash[_PHASE_CPU] = cpu_seconds()


_PHASE_CPU = pytest.StashKey[float]()


class Timeline:
    """--timeline PATH, on the controller: each test phase's worker, start and stop (epoch seconds) and CPU seconds
    (`CpuMeter`), written at the end: where a run's wall time goes beside its CPU time."""

    def __init__(self, path: Path) -> None:
        self.path, self.phases = path, []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        node = getattr(report, "node", None)  # xdist's controller sets the worker a report came from
        self.phases.append({"test": plain_nodeid(report.nodeid), "when": report.when, "start": report.start,
                            "stop": report.stop, "worker": node.gateway.id if node is not None else "main",
                            "cpu_s": dict(report.user_properties).get("cpu_s")})

    def pytest_sessionfinish(self) -> None:
        self.path.write_text(json.dumps(self.phases) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # xdist's own order (most tests per unit first) would undo ours
        config.option.loadscopereorder = False
    durations = read_durations(Path(config.getoption("durations_file")))
    runs_tests_here = hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)
    if config.getoption("timeline") and runs_tests_here:
        config.pluginmanager.register(CpuMeter())
    if hasattr(config, "workerinput"):  # an xdist worker: every worker computes the same lanes from the same file
        config.pluginmanager.register(GroupLanes(durations))
        return
    if durations and hasattr(config.hook, "pytest_xdist_node_collection_finished"):  # xdist's controller (if -n)
        config.pluginmanager.register(SecondsProgress(config, durations))
    if config.getoption("timeline"):
        config.pluginmanager.register(Timeline(Path(config.getoption("timeline"))))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: every worker computes the same order from the same file
        items[:] = slowest_units_first(items, read_durations(Path(config.getoption("durations_file"))))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SECONDS[plain_nodeid(report.nodeid)] += report.duration  # on xdist's controller: every worker's reports


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if hasattr(config, "workerinput") or not config.getoption("record_durations"):
        return
    path = Path(config.getoption("durations_file"))
    merged = read_durations(path) | {k: round(v, 2) for k, v in _SECONDS.items()}
    path.write_text(json.dumps(dict(sorted(merged.items())), indent=0) + "\n")
