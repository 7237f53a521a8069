"""Each fact of issue 51 is defined in one product file, and its callers import it from there.

The facts: the GPT parameter and FLOP-per-token formulas (engine/model/shapes.py), which blocks are MoE
(engine/model/shapes.py), the PostgreSQL advisory-lock keys and the lock-file helper (profilers/locks.py),
the peak FLOP/s table (engine/peaks.py) and the world-size product dp*tp*pp*cp (engine/mesh.py).
Each check greps (or walks with `ast`) the product source for the fact's definition shape and fails
when it appears in more than one file.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("app.py", "workbench", "tuning", "engine", "profilers", "tools")
# the compatibility-matrix runner is a test harness outside the product (tools/matrix/); its folder lock
# (tools/matrix/compat_results.py) is not the storage lock-file helper
MATRIX_RUNNER = ("compat.py", "compat_doc.py", "compat_results.py")


def _product_files() -> list[Path]:
    files: list[Path] = []
    for name in PRODUCT:
        path = ROOT / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(sorted(path.rglob("*.py")))
    return files


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _files_matching(pattern: str, *, skip_matrix_runner: bool = False) -> list[str]:
    regex = re.compile(pattern, re.IGNORECASE)
    return [_rel(p) for p in _product_files() if regex.search(p.read_text())
            and not (skip_matrix_runner and p.name in MATRIX_RUNNER)]


# fact -> (definition pattern, the one file allowed to hold it)
PATTERNS = {
    "FLOPs per token: 6 x parameters": (r"\b6(\.0)?\s*\*\s*[\w.]*param", "engine/model/shapes.py"),
    "FLOPs per token: 12 l h s attention": (r"\b12(\.0)?\s*\*\s*[\w.]*layers", "engine/model/shapes.py"),
    "GPT MLP parameters: mlp_ratio x h x h": (r"mlp_ratio\s*\*\s*\w+\s*\*\s*\w+", None),
    "dense block parameters: attention + MLP": (r"attention_params\s*\+\s*[\w.]*mlp_params", "engine/model/shapes.py"),
    "which blocks are MoE: (i + 1) % moe_every": (r"\(\w+\s*\+\s*1\)\s*%\s*max\(", "engine/model/shapes.py"),
    "advisory-lock key": (r"0x776F726B", "profilers/locks.py"),
    "advisory-lock SQL": (r"pg_advisory", "profilers/locks.py"),
    "lock-file name": (r"\.lock\"", "profilers/locks.py"),
    "peak FLOP/s: H100 989 TFLOP/s": (r"\b989e12\b", "engine/peaks.py"),
    "peak FLOP/s: A100 312 TFLOP/s": (r"\b312e12\b", "engine/peaks.py"),
    "peak FLOP/s: MI250X 191.5 TFLOP/s": (r"\b191\.5e12\b", "engine/peaks.py"),
}


@pytest.mark.parametrize("fact", sorted(PATTERNS))
def test_each_fact_is_defined_in_one_file(fact: str) -> None:
    pattern, home = PATTERNS[fact]
    found = _files_matching(pattern)
    assert len(found) <= 1, f"{fact} ({pattern}) is defined in {len(found)} files: {found}"
    if home is not None:
        assert found == [home], f"{fact} should live in {home}, found in {found}"


def test_the_file_lock_is_taken_in_one_place() -> None:
    found = _files_matching(r"fcntl\.flock\(", skip_matrix_runner=True)
    assert found == ["profilers/locks.py"], f"fcntl.flock in {found}"


def _factor_names(node: ast.AST) -> list[str]:
    """The names multiplied in a chain of `*`: `p.dp`, `dp`, `c["dp"]`, `knobs.get("parallel.dp", 1)`."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _factor_names(node.left) + _factor_names(node.right)
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return [str(node.slice.value)]
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        return [str(node.args[0].value).rsplit(".", 1)[-1]]
    return []


def _world_products(path: Path) -> list[int]:
    tree = ast.parse(path.read_text())
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            if {"dp", "tp", "pp"} <= set(_factor_names(node)):
                lines.append(node.lineno)
    return lines


def test_the_world_size_product_is_written_once() -> None:
    found = {_rel(p): lines for p in _product_files() if (lines := _world_products(p))}
    assert list(found) == ["engine/mesh.py"], f"dp * tp * pp products in {found}"


# caller -> the module its fact must be imported from
CALLERS = {
    "engine/model/gpt.py": "engine.model.shapes",
    "engine/model/moe.py": "engine.model.shapes",
    "tuning/sim/spec.py": "engine.model.shapes",
    "engine/device.py": "engine.peaks",
    "tuning/sim/hardware.py": "engine.peaks",
    "tuning/storage.py": "profilers.locks",
    "profilers/store_sql.py": "profilers.locks",
    "engine/config/schema.py": "engine.mesh",
    "tuning/sim/spec.py ": "engine.mesh",
    "tuning/sim/published.py": "engine.mesh",
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("caller", sorted(CALLERS))
def test_callers_import_the_fact(caller: str) -> None:
    path = ROOT / caller.strip()
    assert CALLERS[caller] in _imports(path), f"{caller.strip()} does not import {CALLERS[caller]}"


def test_the_run_store_imports_the_lock_helper() -> None:
    """The run store (however its files are cut) takes its file and advisory locks from profilers/locks.py."""
    stores = [p for p in (ROOT / "profilers").rglob("*.py") if "store" in _rel(p)]
    assert any("profilers.locks" in _imports(p) for p in stores), [_rel(p) for p in stores]


# issue 51: functions nothing called (tests included); removed, and kept out
UNUSED = ("engine/train/memory.py:_stage_params", "tools/matrix/compat.py:as_set_args", "engine/parallel/adaptive_sp.py:plan_step",
          "engine/parallel/schedules.py:format_actions", "profilers/store.py:delete_run", "tuning/export/trial.py:export_pareto",
          "tuning/space.py:live_only")


def test_the_unused_functions_are_gone() -> None:
    names = {spec.rsplit(":", 1)[1] for spec in UNUSED}
    found = [f"{_rel(p)}:{node.name}" for p in _product_files() for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.FunctionDef) and node.name in names]
    assert found == [], f"unused functions still defined: {found}"
