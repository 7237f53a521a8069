"""State outside the model and optimizer that a resumed run must get back (real gloo ranks):
the pipeline split layer_split=auto chose, and the compressors' memories (residuals, Rand-k
counters, PowerSGD's state, L-GreCo's levels)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from parallel_harness import run_ranks

from engine.config.schema import load_config
from engine.train.trainer import Trainer

TINY = ["model.layers=4", "model.d_model=32", "model.heads=4", "model.seq_len=16", "model.vocab=256",
        "train.steps=4", "train.lr=0.003", "train.warmup_steps=0", "train.schedule=constant",
        "batch.global=8", "profile.enabled=false", "train.timeout_s=60"]


def _trainer(overrides: list[str]) -> Trainer:
    return Trainer(load_config(None, TINY + overrides), device=torch.device("cpu"))


def _split_resume(rank: int, world: int, tmp: str) -> list[list[str]]:
    """pp2 with layer_split [3, 1] checkpoints at step 2; a layer_split=auto run resumes from it."""
    pp2 = ["parallel.pp=2", "batch.micro=4"]
    list(_trainer(pp2 + ["parallel.layer_split=[3, 1]", "train.checkpoint_interval=2",
                         f"train.checkpoint_dir={tmp}"]).run())
    resumed = _trainer(pp2 + ["parallel.layer_split=auto", f"train.resume_from={Path(tmp) / 'step000002'}"])
    return [sorted(m.layers.keys()) for m in resumed.par.modules]


@pytest.mark.slow
def test_layer_split_auto_resumes_with_the_checkpoints_split(tmp_path):
    """The measured split depends on timings: a resumed run takes the one its checkpoint ran with."""
    stages = run_ranks(2, _split_resume, str(tmp_path), timeout=180)
    assert stages == [[["0", "1", "2"]], [["3"]]]



COMPRESSED = {  # dp2 runs whose compressor keeps memory between steps
    "topk": ["comm.compressor=topk"],
    "int8": ["comm.compressor=int8"],
    "randk-bidirectional": ["comm.compressor=randk", "comm.bidirectional=true"],
    "powersgd": ["comm.compressor=powersgd"],
    "lgreco": ["comm.compressor=topk", "comm.adaptive=true", "comm.adaptive_interval=2"],
    "zero3-topk": ["comm.compressor=topk", "parallel.zero=3"],
}


def _compressed_resume(rank: int, world: int, tmp: str) -> dict[str, tuple[list[float], list[float]]]:
    """Each compressor: 5 steps checkpointing at step 3 (after DDP rebuilt its buckets and PowerSGD
    started compressing), and a run resumed from it; (uninterrupted steps 3-4, resumed steps 3-4)."""
    out = {}
    for name, knobs in COMPRESSED.items():
        run = ["parallel.dp=2", "batch.micro=4", "train.steps=5", *knobs]
        folder = Path(tmp) / name
        full = [m.loss for m in _trainer(run + ["train.checkpoint_interval=3", f"train.checkpoint_dir={folder}"]).run()]
        resumed = [m.loss for m in _trainer(run + [f"train.resume_from={folder / 'step000003'}"]).run()]
        out[name] = (full[3:], resumed)
    return out


@pytest.mark.slow
def test_compressor_memory_resumes_exactly(tmp_path):
    """Residuals, Rand-k's counters, PowerSGD's memories and L-GreCo's levels come back with the
    checkpoint, in the bucket order they were made in: the resumed losses equal the uninterrupted ones."""
    got = run_ranks(2, _compressed_resume, str(tmp_path), timeout=300)[0]
    diffs = {name: max(abs(a - b) for a, b in zip(*pair)) if len(pair[1]) == 2 else float("inf")
             for name, pair in got.items()}
    assert all(d <= 1e-6 for d in diffs.values()), diffs


def test_compressor_state_into_other_degrees_is_refused():
    """A compressor's memory is per rank: resuming it in other degrees is one clear error."""
    from types import SimpleNamespace

    import torch

    from engine.train.checkpoint import RankState, _comm_resumes
    from engine.comm.compress import CompressionState

    state = CompressionState(compressor="topk")
    parts = RankState(par=None, layout={"dp": 4, "tp": 1, "pp": 1, "cp": 1, "ep": 1}, coords={"dp": 0, "tp": 0},
                      rank=0, device=torch.device("cpu"), seed=0, dropout=0.0, data_source="text",
                      compressor="topk", zero=0, comm=SimpleNamespace(compressor_state=state))
    meta = {"dp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "comm": "CompressionState:topk:ddp"}
    with pytest.raises(ValueError, match=r"compressor state .* resumes only in its own degrees \(dp=2"):
        _comm_resumes(parts, meta)
    assert _comm_resumes(parts, {**meta, "dp": 4})
    assert not _comm_resumes(parts, {**meta, "dp": 4, "comm": "CompressionState:randk:ddp"})
