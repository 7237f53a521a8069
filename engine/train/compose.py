"""One rank's training parts, composed in one step: the model the config names, laid out in the
config's parallel layout, its optimizer, then the communication wired around them.

Read top to bottom, `compose()` is the order every combination in the compatibility matrix
(docs/compatibility.md) is built in:

1. the model: the built-in GPT, a Hugging Face model (`model.hf`) or a user's (`model.entry`);
2. `parallelize()`: pipeline stages, TP/SP, CP, EP, ZeRO/FSDP2 or DDP (engine/parallel/parallelize.py);
   DDP gets its comm hook chain here (compression -> link emulation -> recording);
3. the optimizer of the layout (ZeRO-1 partitions a DDP model's, FSDP2 shards stages 2-3);
4. FSDP2's compressed reduce-scatter (ZeRO-2/3 with randk/topk), or CO2's outer rounds.

The Trainer (engine/train/trainer.py) owns the loop; checkpoints (engine/train/checkpoint.py) and live knobs
(engine/train/comm_setup.py) take the parts they act on, never the Trainer.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.model.build import build_model
from engine.train.comm_setup import CommMonitor, build_optimizer, install_co2, install_comm, install_fsdp_comm
from engine.config.schema import RunConfig
from engine.mesh import ParallelDims
from engine.parallel.parallelize import Parallelized, parallelize


@dataclass(slots=True)
class Composed:
    """The parts `compose()` made: the parallelized model with its optimizer (`par`), the CommMonitor
    of its gradient traffic (None when DDP keeps its own all-reduce), CO2, and a user model's
    dataset and optional step function (`model.entry`)."""

    par: Parallelized
    comm: CommMonitor | None = None
    co2: Any = None
    user_dataset: Any = None
    user_step: Callable | None = None


def compose(cfg: RunConfig, *, dims: ParallelDims, mesh, device: torch.device, mark: Callable[[], Any],
            collectives, init_values: bool = True) -> Composed:
    """Build this rank's parts. `mesh` is the DeviceMesh (a stand-in raising on use in a
    single-process run), `mark` the step timer's clock, `collectives` the CollectiveProfiler the
    DDP hooks report to. `init_values=False` allocates this rank's parts without their initial
    values (the dry run, engine/train/dryrun.py: the same build, nothing drawn or read)."""
    model, user_dataset, user_step = _model(cfg)
    ddp_monitor: list[CommMonitor | None] = [None]

    def ddp_hooks(ddp: torch.nn.Module, group) -> None:
        ddp_monitor[0] = install_comm(ddp, group, cfg=cfg, mark=mark, collectives=collectives)

    par = parallelize(model, cfg, dims, mesh, device=device,
                      comm_hook_factory=ddp_hooks if dims.world_size > 1 else None, saved_split=_saved_split(cfg),
                      init_values=init_values)
    par.optimizer = build_optimizer(par, cfg, mesh)
    dp_group = mesh["dp"].get_group() if dims.dp > 1 else None
    comm = install_fsdp_comm(par, cfg=cfg, dp=dims.dp, dp_group=dp_group, mark=mark) or ddp_monitor[0]
    co2 = install_co2(par, cfg=cfg, dp=dims.dp, dp_group=dp_group)
    if co2 is not None:
        co2, comm = co2
    return Composed(par, comm, co2, user_dataset, user_step)


def _saved_split(cfg: RunConfig) -> list[int] | None:
    """layer_split=auto resumed: the split its checkpoint ran with (a measured split varies run to run)."""
    if cfg.parallel.layer_split != "auto" or not cfg.train.resume_from:
        return None
    from engine.train.checkpoint import saved_layer_split

    return saved_layer_split(cfg.train.resume_from, layers=cfg.model.layers, pp=cfg.parallel.pp)


def _model(cfg: RunConfig) -> tuple[torch.nn.Module, Any, Callable | None]:
    """The model the config names, with a user model's dataset and optional step function."""
    if cfg.model.entry:  # imported only because the config names it
        from engine.data.corpus import MapDataset, load_entry

        torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
        model, dataset, *step_fn = load_entry(cfg.model.entry)
        # optional third item: step_fn(model, inputs, targets, lr) -> loss runs a whole
        # optimizer step itself (e.g. extragradient: two gradient evaluations per step)
        return model, MapDataset(dataset), step_fn[0] if step_fn else None
    # on meta: parallelize() materialises only this rank's shards and stages (engine/model/meta_init.py)
    return build_model(cfg.model, seed=cfg.train.seed, device="meta"), None, None
