"""The simulator's modules import each other without a circle (issue 38 item 6): each technique is priced
in its own module and one core composes them. Walks every import statement (top level and inside
functions) with `ast`, so a lazy import that hides a circle is caught too."""
from __future__ import annotations

import ast
from pathlib import Path

TUNING = Path(__file__).resolve().parents[1] / "tuning"
SIMULATOR_MODULES = sorted(p.stem for p in TUNING.glob("*.py")
                           if p.stem.startswith(("sim", "calib")) or p.stem in ("published", "validation", "search", "hardware"))


def _imports(module: str) -> set[str]:
    """The simulator modules `module` imports anywhere in its body (`from tuning import x` included)."""
    tree = ast.parse((TUNING / f"{module}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "tuning":
                found |= {a.name for a in node.names}
            elif node.module.startswith("tuning."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("tuning.")}
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
    core = _imports("sim_core")
    assert {"sim_compute", "sim_tensor", "sim_pipeline", "sim_zero", "sim_memory", "sim_context", "sim_moe"} <= core
    for technique in ("sim_compute", "sim_tensor", "sim_pipeline", "sim_zero", "sim_context", "sim_moe"):
        assert "sim_core" not in _imports(technique) and "simulator" not in _imports(technique), technique


def test_modules_stay_small() -> None:
    for module in SIMULATOR_MODULES:
        lines = len((TUNING / f"{module}.py").read_text().splitlines())
        assert lines <= 650, f"tuning/{module}.py has {lines} lines"
