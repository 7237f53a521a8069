"""The house's floors (issue 51 item 2): app -> workbench -> tuning -> engine -> profilers, each floor
importing only floors below it; tools/ (dev harnesses such as the compatibility-matrix runner) may import
every floor and nothing but the tests imports it. Walks every import statement with `ast` (top level,
inside functions and under TYPE_CHECKING, relative ones resolved), so a lazy import that hides a circle
is caught too. Fails on an import circle (a strongly connected component of more than one module), an
upward import, or a file over 600 lines; a planted circle and a planted upward import in a tmp tree
prove the checker sees them."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"profilers": 0, "engine": 1, "tuning": 2, "workbench": 3, "app": 4, "tools": 5}
MAX_LINES = 600


def modules_under(root: Path) -> dict[str, Path]:
    """Every module of the floors found under `root`, by dotted name (a package by its own name)."""
    found: dict[str, Path] = {}
    for top in FLOORS:
        paths = [root / f"{top}.py"] if (root / f"{top}.py").is_file() else sorted((root / top).rglob("*.py"))
        for path in paths:
            found[".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module `name` lands on: itself or its longest prefix among `modules` (an attribute's module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that `module` imports anywhere in its body."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {_resolve(a.name, modules) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{parent}.{base}".strip(".")
            found |= {_resolve(f"{base}.{a.name}", modules) for a in node.names}
    return found - {None, module}


def import_graph(root: Path) -> tuple[dict[str, set[str]], dict[str, Path]]:
    modules = modules_under(root)
    return {m: imports_of(m, p, modules) for m, p in modules.items()}, modules


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            component.append(node)
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _floor(module: str) -> int:
    return FLOORS[module.split(".")[0]]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for each import of a floor above the importer's own (tools/ counts as the top floor)."""
    return [f"{a} -> {b}" for a in sorted(graph) for b in sorted(graph[a]) if _floor(b) > _floor(a)]


def long_files(modules: dict[str, Path], root: Path) -> list[str]:
    sizes = {p: len(p.read_text().splitlines()) for p in modules.values()}
    return [f"{p.relative_to(root)}: {n} lines" for p, n in sorted(sizes.items()) if n > MAX_LINES]


def findings(root: Path) -> list[str]:
    """Every finding under `root`, one readable line each."""
    graph, modules = import_graph(root)
    return ([f"import circle: {' <-> '.join(c)} ({_circle_edges(c, graph)})" for c in circles(graph)]
            + [f"upward import: {u}" for u in upward_imports(graph)]
            + [f"over {MAX_LINES} lines: {f}" for f in long_files(modules, root)])


def _circle_edges(component: list[str], graph: dict[str, set[str]]) -> str:
    return ", ".join(f"{a} -> {b}" for a in component for b in sorted(graph[a]) if b in component)


def test_no_circle_no_upward_import_no_long_file() -> None:
    found = findings(ROOT)
    assert not found, "\n" + "\n".join(found)


def test_the_walk_sees_the_floors_and_imports_inside_functions() -> None:
    graph, modules = import_graph(ROOT)
    assert {"app", "workbench.cli", "tuning.study", "engine.train.trainer", "profilers.store"} <= set(modules)
    assert {"engine.train.dryrun", "engine.launch.slurm"} <= graph["engine.launch.local"]  # both imported inside launch()
    assert graph["app"], "app.py imports the workbench"


def _plant(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_checker_reports_a_planted_circle_an_upward_import_and_a_long_file(tmp_path: Path) -> None:
    _plant(tmp_path, {
        "engine/__init__.py": "",
        "engine/a.py": "def f():\n    from engine import b\n",  # inside a function: still counted
        "engine/b.py": "from .a import f\n",
        "engine/pkg/__init__.py": "from engine.pkg import leaf\n",  # a package importing its own submodule
        "engine/pkg/leaf.py": "import os\n",
        "profilers/__init__.py": "",
        "profilers/store.py": "import engine.a\n",  # a floor importing the one above it
        "tuning/__init__.py": "",
        "tuning/long.py": "x = 1\n" * (MAX_LINES + 1),
        "tuning/ok.py": "from engine.pkg.leaf import os\nimport profilers.store\n",
        "tools/__init__.py": "import tuning.ok\n",
        "workbench/__init__.py": "import tools\n",  # nothing in the product imports tools/
    })
    assert findings(tmp_path) == [
        "import circle: engine.a <-> engine.b (engine.a -> engine.b, engine.b -> engine.a)",
        "upward import: profilers.store -> engine.a",
        "upward import: workbench -> tools",
        f"over {MAX_LINES} lines: tuning/long.py: {MAX_LINES + 1} lines",
    ]
