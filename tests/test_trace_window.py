"""profile.trace_steps=[a, b] records the training steps a..b: one ProfilerStep span and one
optimizer step each (issue 40 reported one step for [2, 3]; not reproduced on this code: one
process, 2 ranks dp2 and pp2 each recorded ProfilerStep#2, #3 and two AdamW steps)."""
from __future__ import annotations

import collections
import json

import torch

from engine.config.schema import load_config


def test_a_two_step_window_records_two_training_steps(tmp_path):
    from engine.train.trainer import Trainer

    cfg = load_config(None, ["model.layers=1", "model.d_model=32", "model.heads=4", "model.seq_len=16",
                             "model.vocab=256", "batch.global=4", "train.steps=5", "profile.trace_steps=[2, 3]",
                             "train.timeout_s=60"])
    list(Trainer(cfg, device=torch.device("cpu"), run_dir=tmp_path).run())
    [trace] = (tmp_path / "traces").glob("*.json")
    names = collections.Counter(e.get("name") for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X")
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == ["ProfilerStep#2", "ProfilerStep#3"]
    assert sum(v for n, v in names.items() if n.startswith("Optimizer.step#")) == 2
