"""Context parallelism with ZeRO 1-3 through the engine's Trainer (issue 62 item 5): ZeRO shards over
dp x cp flattened (the "dp_cp" mesh axis), as torchtitan's dp_shard_cp; 4 real gloo ranks.

Parity rule (issue 19): fp32, tiny GPT, AdamW with weight decay and clipping, gradient accumulation:
losses and final weights within 1e-4 of one process. With dropout (ulysses only: the ring has no
attention dropout) one process cannot match (each rank draws masks for its own chunk), so ZeRO 1-3
are held to plain data parallelism (ZeRO 0) of the same layout, which draws the same masks.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config.schema import load_config
from engine.train.trainer import Trainer
from parallel_harness import run_ranks

TOL = 1e-4
TINY = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=16", "model.vocab=256",
        "train.steps=4", "train.lr=0.01", "train.warmup_steps=0", "train.schedule=constant",
        "train.weight_decay=0.1", "train.grad_clip=0.5", "batch.global=8", "batch.micro=2",
        "train.eval_interval=0", "profile.enabled=false", "train.timeout_s=60"]
CP2_DP2 = ["parallel.cp=2", "parallel.dp=2"]
CP2_TP2 = ["parallel.cp=2", "parallel.tp=2"]
DROPOUT = ["model.dropout=0.1", "parallel.cp_impl=ulysses"]


def _train(overrides: list[str]) -> dict:
    """Losses and the full final weights (DTensor shards gathered) of a Trainer run on this rank."""
    trainer = Trainer(load_config(None, TINY + overrides), device=torch.device("cpu"))
    losses = [m.loss for m in trainer.run()]
    weights = {}
    for name, p in trainer.par.modules[0].named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        weights[name.removeprefix("module.")] = full.detach().clone()
    return {"loss": losses, "weights": weights, "shards": _shard_ranks(trainer)}


def _shard_ranks(trainer: Trainer) -> int:
    """How many ranks ZeRO shards over: the ZeRO-1 optimizer's group, else the FSDP2 mesh of the
    parameters (1: not sharded)."""
    import torch.distributed as dist

    group = getattr(trainer.par.optimizer, "process_group", None)
    if group is not None:
        return dist.get_world_size(group)
    meshes = [p.device_mesh for p in trainer.par.parameters() if hasattr(p, "device_mesh")]
    names = [m.mesh_dim_names or () for m in meshes]
    return max((m.size(n.index("dp_cp")) if "dp_cp" in n else 1 for m, n in zip(meshes, names)), default=1)


def _runs_body(rank: int, world: int, runs: dict[str, list[str]]) -> dict:
    return {name: _train(overrides) for name, overrides in runs.items()}


def _assert_same(run: dict, ref: dict) -> None:
    """Losses and final weights within TOL."""
    diff = max(abs(a - b) for a, b in zip(run["loss"], ref["loss"]))
    assert len(run["loss"]) == len(ref["loss"]) and diff <= TOL, (run["loss"], ref["loss"])
    assert run["weights"].keys() == ref["weights"].keys()
    worst = max((run["weights"][k] - ref["weights"][k]).abs().max().item() for k in ref["weights"])
    assert worst <= TOL, worst


@pytest.fixture(scope="module")
def reference() -> dict:
    torch.set_num_threads(1)
    return _train([])


@pytest.fixture(scope="module")
def cp2_dp2() -> list[dict]:
    runs = {f"zero{z}-{impl}": CP2_DP2 + [f"parallel.zero={z}", f"parallel.cp_impl={impl}"]
            for z in (1, 2, 3) for impl in ("ulysses", "ring")}
    runs |= {f"dropout-zero{z}": CP2_DP2 + DROPOUT + [f"parallel.zero={z}"] for z in (0, 1, 2, 3)}
    return run_ranks(4, _runs_body, runs, timeout=240)


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("impl", ["ulysses", "ring"])
def test_cp2_dp2_zero_matches_single_process(cp2_dp2, reference, zero, impl):
    for out in cp2_dp2:
        _assert_same(out[f"zero{zero}-{impl}"], reference)
        assert out[f"zero{zero}-{impl}"]["shards"] == 4  # dp x cp


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_cp2_dp2_zero_with_dropout_matches_plain_data_parallel(cp2_dp2, reference, zero):
    for out in cp2_dp2:
        _assert_same(out[f"dropout-zero{zero}"], out["dropout-zero0"])
        assert out["dropout-zero0"]["loss"] != reference["loss"]  # dropout really changed the losses


def test_cp2_tp2_zero_matches_single_process(reference):
    """dp 1: ZeRO shards over the cp ranks alone (FSDP2 over tp's DTensors, DTensorZeroOptimizer)."""
    runs = {f"zero{z}": CP2_TP2 + [f"parallel.zero={z}"] for z in (1, 2, 3)}
    for out in run_ranks(4, _runs_body, runs, timeout=240):
        for name in runs:
            _assert_same(out[name], reference)
            assert out[name]["shards"] == 2  # the cp ranks


def _resume_body(rank: int, world: int, tmp: str) -> dict:
    """Each stage: 4 steps checkpointing at step 2, and a run resumed from it; (uninterrupted
    steps 2-3 and final weights, the resumed ones)."""
    out = {}
    for zero in (1, 2, 3):
        run = CP2_DP2 + DROPOUT + [f"parallel.zero={zero}"]
        folder = Path(tmp) / f"zero{zero}"
        full = _train(run + ["train.checkpoint_interval=2", f"train.checkpoint_dir={folder}"])
        resumed = _train(run + [f"train.resume_from={folder / 'step000002'}"])
        out[zero] = ({**full, "loss": full["loss"][2:]}, resumed)
    return out


def test_cp2_dp2_zero_resumes_exactly(tmp_path):
    """Optimizer shards saved by their dp x cp owner come back to it, with each rank's dropout stream."""
    for out in run_ranks(4, _resume_body, str(tmp_path), timeout=240):
        for zero, (full, resumed) in out.items():
            assert len(resumed["loss"]) == 2, zero
            _assert_same(resumed, full)


def test_cp_with_zero_is_accepted_and_the_other_refusals_stay():
    from engine.errors import ConfigError, ConfigErrors

    for zero in (1, 2, 3):
        assert load_config(None, TINY + CP2_DP2 + [f"parallel.zero={zero}"]).parallel.zero == zero
    with pytest.raises((ConfigError, ConfigErrors), match=r"does not combine with parallel.pp > 1"):
        load_config(None, TINY + CP2_DP2 + ["parallel.zero=3", "parallel.pp=2"])


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_memory_estimate_shards_the_model_state_over_dp_x_cp(zero):
    """engine/train/memory.py: cp2 x dp2 holds the model state of dp4 (ZeRO's N is dp x cp) at the
    same gradient accumulation (2 micro-batches: dp4 takes twice the global batch)."""
    from engine.train.memory import estimate_memory

    def state(layout: list[str]) -> dict:
        est = estimate_memory(load_config(None, TINY + layout + [f"parallel.zero={zero}"]))
        return {k: est[k] for k in ("params", "grads", "optimizer")}

    assert state(CP2_DP2) == state(["parallel.dp=4", "batch.global=16"])
