"""Composition in one place (issue 36 item 6): engine/train/compose.py builds a rank's parts top to bottom;
checkpoints, comm wiring and live knobs take the parts they act on, not the Trainer, so no import
circle runs through the trainer. Walks every import statement (top level, in functions and under
TYPE_CHECKING) with `ast`. On the old code engine.train.trainer, checkpoint, comm_setup, live and
parallelize formed one circle."""
from __future__ import annotations

import ast

import torch

from tests.test_architecture import ROOT, circles, import_graph

COMPOSITION = ("engine.train.trainer", "engine.train.compose", "engine.train.checkpoint", "engine.train.comm_setup", "engine.train.live",
               "engine.parallel.parallelize")


def test_no_import_circle_runs_through_the_composition_modules() -> None:
    graph, _ = import_graph(ROOT)  # every import, inside functions too (tests/test_architecture.py)
    on_circles = [m for m in COMPOSITION if any(m in circle for circle in circles(graph))]
    assert not on_circles, f"modules on an import circle: {on_circles}"


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
