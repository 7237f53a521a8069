"""Composition in one place (issue 36 item 6): engine/train/compose.py builds a rank's parts top to bottom;
checkpoints, comm wiring and live knobs take the parts they act on, not the Trainer, so no import
circle runs through the trainer. Walks every import statement (top level, in functions and under
TYPE_CHECKING) with `ast`. On the old code engine.train.trainer, checkpoint, comm_setup, live and
parallelize formed one circle."""
from __future__ import annotations

import ast
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
COMPOSITION = ("engine.train.trainer", "engine.train.compose", "engine.train.checkpoint", "engine.train.comm_setup", "engine.train.live",
               "engine.parallel.parallelize")


def _engine_modules() -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for p in (ROOT / "engine").rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in modules:
                found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
    return found


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        for nxt in graph.get(node, ()):
            if nxt == goal:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def test_no_import_circle_runs_through_the_composition_modules() -> None:
    modules = _engine_modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    circles = [m for m in COMPOSITION if _reaches(graph, m, m)]
    assert not circles, f"modules on an import circle: {circles}"


def test_checkpoint_comm_and_live_take_parts_not_the_trainer() -> None:
    takes_trainer = []
    for name in ("train/checkpoint", "train/comm_setup", "train/live", "train/compose", "parallel/parallelize",
                 "launch/preempt"):
        for node in ast.walk(ast.parse((ROOT / "engine" / f"{name}.py").read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for arg in node.args.args + node.args.kwonlyargs:
                    annotation = ast.unparse(arg.annotation) if arg.annotation else ""
                    if arg.arg == "trainer" and "Target" not in annotation or "Trainer" in annotation:
                        takes_trainer.append(f"{name}.{node.name}({arg.arg}: {annotation})")
    assert not takes_trainer, takes_trainer


def test_compose_builds_a_ranks_parts_without_a_trainer() -> None:
    from engine.train.compose import compose
    from engine.config.schema import load_config
    from engine.mesh import ParallelDims
    from engine.train.trainer import _NoMesh
    from profilers.collectives import CollectiveProfiler

    cfg = load_config(None, ["model.layers=1", "model.d_model=32", "model.heads=4", "model.seq_len=16",
                             "model.vocab=256", "batch.global=4"])
    parts = compose(cfg, dims=ParallelDims(1, 1, 1, 1), mesh=_NoMesh(), device=torch.device("cpu"),
                    mark=lambda: 0.0, collectives=CollectiveProfiler(enabled=False))
    assert parts.comm is None and parts.co2 is None and parts.user_dataset is None
    assert isinstance(parts.par.optimizer, torch.optim.Optimizer)
    assert sum(p.numel() for p in parts.par.parameters()) > 0
