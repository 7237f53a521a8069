"""Checkpoints: save at step k, resume to the same trajectory.

For pp=1 the model and optimizer are saved as full (unsharded) state dicts keyed by parameter
name (torch.distributed.checkpoint.state_dict gathers DDP, DTensor-TP and FSDP2 shards), so a
checkpoint is layout-independent across dp/tp/ZeRO-2/3. ZeRO-1 consolidates its optimizer state on
rank 0. Pipeline runs save one file per stage rank (same-layout resume). Loading always uses
`torch.load(weights_only=True)`.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from engine.train import Trainer



def _dcp():
    """torch.distributed.checkpoint and .optim, imported on first use (about 1.5 s of a rank's start)."""
    from torch.distributed.checkpoint import state_dict
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return state_dict, state_dict.StateDictOptions(full_state_dict=True), ZeroRedundancyOptimizer


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(trainer: Trainer, step: int, folder: Path) -> Path:
    """Write the checkpoint of `step` (all ranks call this); returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    par, coords = trainer.par, trainer.coords
    if par.pipeline is not None:
        path = folder / f"step{step:06d}-pp{coords['pp']}"
        if coords["dp"] == 0 and coords["tp"] == 0:
            torch.save({"step": step, "modules": [m.state_dict() for m in par.modules],
                        "optim": par.optimizer.state_dict()}, path.with_suffix(".pt"))
        _barrier()
        return folder / f"step{step:06d}"
    sd, full, zero1 = _dcp()
    model = par.modules[0]
    model_sd = sd.get_model_state_dict(model, options=full)
    if isinstance(par.optimizer, zero1):
        par.optimizer.consolidate_state_dict(to=0)
        optim_sd = par.optimizer.state_dict() if _rank() == 0 else None
    else:
        optim_sd = sd.get_optimizer_state_dict(model, par.optimizer, options=full)
    path = folder / f"step{step:06d}.pt"
    if _rank() == 0:
        tmp = path.with_suffix(".tmp")
        torch.save({"step": step, "model": model_sd, "optim": optim_sd}, tmp)
        tmp.replace(path)  # a reader never sees a half-written checkpoint
    _barrier()
    return path


def load(trainer: Trainer, path: str | Path) -> int:
    """Restore model and optimizer from `path`; returns the step to continue from."""
    par, coords = trainer.par, trainer.coords
    p = Path(path)
    if par.pipeline is not None:
        stem = p.with_suffix("") if p.suffix == ".pt" else p
        stem = Path(str(stem).split("-pp")[0])
        data = torch.load(f"{stem}-pp{coords['pp']}.pt", weights_only=True, map_location="cpu")
        for module, sd in zip(par.modules, data["modules"], strict=True):
            module.load_state_dict(sd)
        par.optimizer.load_state_dict(data["optim"])
        return int(data["step"])
    data = torch.load(p, weights_only=True, map_location="cpu")
    sd, full, zero1 = _dcp()
    model = par.modules[0]
    sd.set_model_state_dict(model, data["model"], options=full)
    if isinstance(par.optimizer, zero1):
        par.optimizer.load_state_dict(data["optim"])
    else:
        sd.set_optimizer_state_dict(model, par.optimizer, data["optim"], options=full)
    return int(data["step"])
