"""A user's own model and dataset (model.entry = "module:function"): trained on 2 ranks like the
built-in GPT, matching one process."""
from __future__ import annotations

import sys

import torch

from engine.config.schema import load_config
from engine.launch.local import launch
from engine.train.trainer import Trainer

USER_MODULE = '''
import torch

def build():
    """A bag-of-embeddings classifier over 16-token inputs, and 64 labelled samples."""
    model = torch.nn.Sequential(torch.nn.Embedding(100, 16), torch.nn.Flatten(), torch.nn.Linear(16 * 16, 5))
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 100, (64, 16), generator=g)
    y = (x.sum(dim=1) % 5)
    return model, torch.utils.data.TensorDataset(x, y)
'''
OVERRIDES = ["model.entry=wb_user_model:build", "train.steps=5", "batch.global=8", "batch.micro=2",
             "train.warmup_steps=0", "train.lr=0.01", "profile.host_interval_s=0", "profile.nvml_interval_s=0",
             "train.eval_interval=5"]


def test_user_model_trains_on_two_ranks_like_one(tmp_path, monkeypatch):
    (tmp_path / "wb_user_model.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    torch.set_num_threads(1)
    ref = [m.loss for m in Trainer(load_config(None, OVERRIDES), device=torch.device("cpu")).run()]
    result = launch(load_config(None, OVERRIDES + ["parallel.dp=2"]), home=tmp_path,
                    extra_env={"PYTHONPATH": str(tmp_path)})
    got = [s["loss"] for s in result.steps]
    assert max(abs(a - b) for a, b in zip(got, ref)) <= 1e-4, (got, ref)
    assert ref[-1] < ref[0]
    assert result.summary["tokens_per_s"] > 0 and result.summary.get("mfu") is None
    sys.modules.pop("wb_user_model", None)
