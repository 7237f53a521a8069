"""The code a matrix cell runs, and its hash: a recorded result stays current while that code is unchanged.

Read from real imports: every `import` of engine/, profilers/ and the runner's two files, those inside
functions included (importing a module also runs its packages' __init__).

- Every run executes the **core**: the closure of `ROOTS` (the trainer, the checkpoint, the runner and
  its rank harness), stopped at the gated modules (tests/test_matrix.py checks that a featureless run
  loads nothing outside the core, and that no core module imports a gated one at its top).
- A **gated** module (`GATES`), with its own closure, only where a config of the cell's plan sets its
  knobs (the cell's run, its reference, the dropout chain, the other layout): the engine imports it
  only there (engine/parallel/parallelize.py, engine/train/comm_setup.py, engine/model/build.py,
  engine/data/batches.py decide).

A cell's hash is of the content of those files, uncommitted changes included: a change stales the cells
that can run it and no other. Torch-free.
"""
from __future__ import annotations

import ast
import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.matrix.compat import Cell, Plan, _default, plan, world_of

PACKAGES = ("engine", "profilers")  # the hashed code, besides the runner's files
RUNNER_FILES = {"matrix_runner": "tests/matrix_runner.py", "parallel_harness": "tests/parallel_harness.py"}
ROOTS = ("engine.train.trainer", "engine.train.checkpoint", *RUNNER_FILES)


def _get(flat: Mapping[str, Any], key: str) -> Any:
    return flat.get(key, _default(key))


def _changed(flat: Mapping[str, Any], key: str) -> bool:
    return _get(flat, key) != _default(key)


def _compressed(flat: Mapping[str, Any]) -> bool:
    return _changed(flat, "comm.compressor")


@dataclass(frozen=True, slots=True)
class Gate:
    """Modules the engine imports only where `on(config)` holds (`when` says it in words)."""

    modules: tuple[str, ...]
    when: str
    on: Callable[[Mapping[str, Any]], bool]


GATES: tuple[Gate, ...] = (
    Gate(("engine.comm", "engine.comm.compress", "engine.comm.adaptive", "engine.comm.co2", "engine.comm.link"),
         "several ranks, a link emulation, a compressor or CO2",
         lambda f: world_of(f) > 1 or _get(f, "link.gbps") > 0 or _compressed(f) or _changed(f, "co2.enabled")),
    Gate(("engine.comm.bucket_order",), "a gradient compressor", _compressed),
    Gate(("engine.comm.fsdp_compress",), "ZeRO-2/3 with a compressor",
         lambda f: _get(f, "parallel.zero") >= 2 and _compressed(f)),
    Gate(("engine.comm.bidirectional",), "comm.bidirectional", lambda f: _changed(f, "comm.bidirectional")),
    Gate(("engine.comm.link_patch",), "link.groups", lambda f: _changed(f, "link.groups")),
    Gate(("engine.comm.lsh",), "comm.moe_compression", lambda f: _changed(f, "comm.moe_compression")),
    Gate(("engine.parallel.tensor",), "parallel.tp > 1", lambda f: _get(f, "parallel.tp") > 1),
    Gate(("engine.parallel.expert", "engine.parallel.expert_fused"), "parallel.ep > 1",
         lambda f: _get(f, "parallel.ep") > 1),
    Gate(("engine.model.hf", "engine.model.hf_weights"), "model.hf", lambda f: _changed(f, "model.hf")),
    Gate(("engine.parallel.adaptive_sp", "engine.parallel.flexsp"), "parallel.adaptive_sp",
         lambda f: _changed(f, "parallel.adaptive_sp")),
    Gate(("engine.parallel.layer_split",), "parallel.pp > 1", lambda f: _get(f, "parallel.pp") > 1),
    Gate(("engine.parallel.skippipe",), "parallel.schedule=skip", lambda f: _get(f, "parallel.schedule") == "skip"),
    Gate(("engine.data.sources",), "a data.source other than the default", lambda f: _changed(f, "data.source")),
    Gate(("engine.data.lengths",), "a data.source, data.pack, data.lengths or adaptive SP",
         lambda f: any(_changed(f, k) for k in ("data.source", "data.pack", "data.lengths", "parallel.adaptive_sp"))),
)
_GATED = frozenset(m for gate in GATES for m in gate.modules)


def _is_gated(module: str) -> bool:
    """Named by a gate. A new module under a gated package is not: imported from the core it is core, and
    its package's __init__ then runs in every process (tests/test_matrix.py names such a leak)."""
    return module in _GATED


@dataclass(frozen=True, slots=True)
class CodeIndex:
    """The hashed files of a checkout: module -> (path, content digest), its imports (all, and top-level)."""

    root: Path
    paths: dict[str, str]
    digests: dict[str, str]
    imports: dict[str, frozenset[str]]
    top: dict[str, frozenset[str]]
    hashes: dict[tuple[Gate, ...], str] = field(default_factory=dict, compare=False)  # cell_code's, per gate set

    def closure(self, starts: Iterable[str], stop: Callable[[str], bool] = lambda m: False) -> set[str]:
        """`starts` and every module they import (in functions too) and their packages, short of `stop`."""
        seen: set[str] = set()
        todo = [m for m in starts if m in self.paths]
        while todo:
            module = todo.pop()
            if module in seen or stop(module):
                continue
            seen.add(module)
            todo.extend(self.imports[module])
        return seen

    def core(self) -> set[str]:
        """What every run executes: the closure of ROOTS short of the gated modules."""
        return self.closure(ROOTS, stop=_is_gated)

    def digest(self, modules: Iterable[str]) -> str:
        h = hashlib.sha256()
        for module in sorted(modules):
            h.update(f"{self.paths[module]}\0{self.digests[module]}\0".encode())
        return h.hexdigest()[:16]


def _module_paths(root: Path) -> dict[str, str]:
    paths = dict(RUNNER_FILES)
    for package in PACKAGES:
        for file in sorted((root / package).rglob("*.py")):
            parts = file.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            paths[name] = str(file.relative_to(root))
    return {m: p for m, p in paths.items() if (root / p).is_file()}


def _imported(module: str, path: str, tree: ast.Module, known: Mapping[str, str]) -> tuple[set[str], set[str]]:
    """(all, top-level) modules of `known` that `tree` imports, with the packages above each."""
    everything, top = set(), set()
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f) if n is not f}
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module or ""
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            found = {".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in known}
            everything |= found
            if id(node) not in in_function:
                top |= found
    return everything - {module}, top - {module}


def build_index(root: Path) -> CodeIndex:
    """Read the checkout at `root`: every hashed file's content and imports."""
    paths = _module_paths(root)
    digests, imports, top = {}, {}, {}
    for module, path in paths.items():
        data = (root / path).read_bytes()
        digests[module] = hashlib.sha256(data).hexdigest()
        everything, first = _imported(module, path, ast.parse(data), paths)
        parents = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)} & set(paths)
        imports[module], top[module] = frozenset(everything | parents), frozenset(first | parents)
    return CodeIndex(root, paths, digests, imports, top)


def plan_configs(p: Plan) -> list[dict[str, Any]]:
    """Every config a cell's plan runs: the cell, its reference, the dropout chain, the other layout."""
    return [c for c in (p.config, p.reference, p.dropout_config, p.other) if c is not None]


def gates_of(cell: Cell) -> tuple[Gate, ...]:
    """The gates some config of the cell's plan opens."""
    configs = plan_configs(plan(cell))
    return tuple(g for g in GATES if any(g.on(c) for c in configs))


def cell_modules(cell: Cell, index: CodeIndex) -> set[str]:
    """The modules a cell's runs can execute: the core and its open gates' closures."""
    return _modules(index, gates_of(cell))


def cell_code(cell: Cell, index: CodeIndex) -> str:
    """The hash of the code the cell runs (its results are current while it holds)."""
    gates = gates_of(cell)
    if gates not in index.hashes:  # many cells open the same gates
        index.hashes[gates] = index.digest(_modules(index, gates))
    return index.hashes[gates]


def _modules(index: CodeIndex, gates: Iterable[Gate]) -> set[str]:
    return index.core() | index.closure([m for g in gates for m in g.modules])
