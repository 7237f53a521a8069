"""A checkpointed run that several resume tests continue from, launched once per worker: the tests that resume one
saved layout in two others each trained the same 6 steps again (4 of the suite's 163 torchrun launches, about 10
CPU seconds each)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

_SAVED: dict[tuple[str, ...], tuple[Any, Path]] = {}


def saved_run(overrides: list[str], factory: pytest.TempPathFactory, *, every: int = 3) -> tuple[Any, Path]:
    """(the launched run's result, its checkpoint folder) of `overrides` checkpointed every `every` steps, launched
    the first time these overrides are asked for in this process (its own home and folder under pytest's base
    temporary directory, never written again)."""
    key = tuple(overrides) + (str(every),)
    if key not in _SAVED:
        from engine.config.schema import load_config
        from engine.launch.local import launch

        home = factory.mktemp("saved-run")
        ckpt = home / "ckpt"
        cfg = load_config(None, [*overrides, f"train.checkpoint_interval={every}", f"train.checkpoint_dir={ckpt}"])
        _SAVED[key] = (launch(cfg, home=home), ckpt)
    return _SAVED[key]
