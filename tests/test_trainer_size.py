"""The Trainer keeps orchestration (build, step, evaluate, run loop, record) and stays small: the
data's work (batches, packing, CP sharding), adaptive-SP planning, loss reduction and memory
records live in their own modules (issue 51 item 5)."""
from __future__ import annotations

import ast
from pathlib import Path

TRAIN = Path(__file__).resolve().parent.parent / "engine" / "train" / "trainer.py"
MAX_TRAINER_LINES = 300


def _class_lines(tree: ast.Module, name: str) -> int:
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    return node.end_lineno - node.lineno + 1


def test_trainer_class_is_under_300_lines():
    lines = _class_lines(ast.parse(TRAIN.read_text()), "Trainer")
    assert lines < MAX_TRAINER_LINES, f"class Trainer is {lines} lines; keep it under {MAX_TRAINER_LINES}"


def test_the_size_check_counts_a_whole_class():
    source = "class Trainer:\n" + "".join(f"    x{i} = {i}\n" for i in range(MAX_TRAINER_LINES))
    assert _class_lines(ast.parse(source), "Trainer") == MAX_TRAINER_LINES + 1
