"""The simulator's modules import each other without a circle (issue 38 item 6): each technique is priced
in its own module and one core composes them. Walks every import statement (top level and inside
functions) with `ast`, so a lazy import that hides a circle is caught too."""
from __future__ import annotations

import ast
from pathlib import Path

TUNING = Path(__file__).resolve().parents[1] / "tuning"
# the simulator's and calibration's packages, and the search beside them: "sim.core", "calibrate.runs", "search"
SIMULATOR_MODULES = sorted([f"{p.parent.name}.{p.stem}" for package in ("sim", "calibrate")
                            for p in (TUNING / package).glob("*.py") if p.stem != "__init__"] + ["search"])


def _imports(module: str) -> set[str]:
    """The simulator modules `module` imports anywhere in its body (`from tuning.sim import x` included)."""
    tree = ast.parse((TUNING / f"{module.replace('.', '/')}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tuning"):
            inner = node.module.removeprefix("tuning").removeprefix(".")
            found |= {f"{inner}.{a.name}".lstrip(".") for a in node.names}  # `from tuning.sim import core`
            found.add(inner)  # `from tuning.sim.core import x`
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("tuning.") for a in node.names if a.name.startswith("tuning.")}
    return found & set(SIMULATOR_MODULES) - {module}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_cycle_finder_finds_a_planted_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_among_the_simulator_modules() -> None:
    graph = {m: _imports(m) for m in SIMULATOR_MODULES}
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"


def test_one_core_composes_one_module_per_technique() -> None:
    core = _imports("sim.core")
    assert {"sim.compute", "sim.tensor", "sim.pipeline", "sim.zero", "sim.memory", "sim.context", "sim.moe"} <= core
    for technique in ("sim.compute", "sim.tensor", "sim.pipeline", "sim.zero", "sim.context", "sim.moe"):
        assert "sim.core" not in _imports(technique) and "sim.simulator" not in _imports(technique), technique


def test_modules_stay_small() -> None:
    for module in SIMULATOR_MODULES:
        lines = len((TUNING / f"{module.replace('.', '/')}.py").read_text().splitlines())
        assert lines <= 650, f"tuning/{module.replace('.', '/')}.py has {lines} lines"
