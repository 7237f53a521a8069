"""The simulator's modules import each other without a circle (issue 38 item 6): each technique is priced
in its own module and one core composes them. Walks every import statement (top level and inside
functions) with `ast`, so a lazy import that hides a circle is caught too."""
from __future__ import annotations

import functools

from tests.test_architecture import ROOT, circles, import_graph

TUNING = ROOT / "tuning"
# the simulator's and calibration's packages, and the search beside them: "sim.core", "calibrate.runs", "search"
SIMULATOR_MODULES = sorted([f"{p.parent.name}.{p.stem}" for package in ("sim", "calibrate")
                            for p in (TUNING / package).glob("*.py") if p.stem != "__init__"] + ["search"])


@functools.cache
def _graph() -> dict[str, set[str]]:
    return import_graph(ROOT)[0]  # every import, inside functions too (tests/test_architecture.py)


def _imports(module: str) -> set[str]:
    """The simulator modules `module` imports anywhere in its body."""
    return {m.removeprefix("tuning.") for m in _graph()[f"tuning.{module}"]} & set(SIMULATOR_MODULES) - {module}


def test_cycle_finder_finds_a_planted_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circle_among_the_simulator_modules() -> None:
    graph = {m: _imports(m) for m in SIMULATOR_MODULES}
    assert circles(graph) == [], f"import circles: {circles(graph)}"


def test_one_core_composes_one_module_per_technique() -> None:
    core = _imports("sim.core")
    assert {"sim.compute", "sim.tensor", "sim.pipeline", "sim.zero", "sim.memory", "sim.context", "sim.moe"} <= core
    for technique in ("sim.compute", "sim.tensor", "sim.pipeline", "sim.zero", "sim.context", "sim.moe"):
        assert "sim.core" not in _imports(technique) and "sim.simulator" not in _imports(technique), technique


def test_modules_stay_small() -> None:
    for module in SIMULATOR_MODULES:
        lines = len((TUNING / f"{module.replace('.', '/')}.py").read_text().splitlines())
        assert lines <= 650, f"tuning/{module.replace('.', '/')}.py has {lines} lines"
