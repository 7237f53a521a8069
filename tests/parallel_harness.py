"""Run a function on N real gloo ranks (CPU, 127.0.0.1) and return each rank's result.

The one multi-process helper of the test suite (PyTorch's `DTensorTestBase` plays this role
upstream). Usage:

    def _body(rank: int, world_size: int, scale: float) -> float:   # top level: must pickle
        t = torch.ones(1) * scale
        dist.all_reduce(t)
        return t.item()

    assert run_ranks(2, _body, 3.0) == [6.0, 6.0]

`fn(rank, world_size, *args)` runs after `init_process_group("gloo")`; its return value must
pickle. A rank's exception is re-raised in the parent as `RankFailure` with its rank number and
traceback; a hang past `timeout` kills every rank and raises `RankFailure(None, ...)`.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp

from engine.errors import RankFailure
from profilers.rendezvous import hosted_store

# forkserver with torch preloaded: each rank forks from a clean server that already imported
# torch (~0.1 s) instead of re-importing it (~2 s per rank on this machine, spawn).
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor.parallel",
                             "torch.distributed.fsdp", "torch._dynamo", "engine.model.gpt"])
_GRACE_S = 5.0  # after one rank fails, how long the others get before they are killed


def _rank_main(rank: int, world_size: int, store_env: dict[str, str], out_dir: str, timeout_s: float,
               fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(store_env, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 2 cores shared by all ranks: one thread each (platform.md)
    out = Path(out_dir) / f"rank{rank}.pkl"
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        out.write_bytes(pickle.dumps(("err", (time.time(), traceback.format_exc()))))
        os._exit(1)
    out.write_bytes(pickle.dumps(result))
    # barrier + destroy + os._exit: the only exit that never aborted here (platform.md)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _read(out_dir: Path, rank: int) -> tuple[str, Any] | None:
    path = out_dir / f"rank{rank}.pkl"
    return pickle.loads(path.read_bytes()) if path.exists() else None


def _raise_first_failure(out_dir: Path, procs: list, world_size: int) -> None:
    # the earliest error is the cause; peers then fail in their collectives with a lost connection
    errors = [(got[1][0], rank, got[1][1]) for rank in range(world_size)
              if (got := _read(out_dir, rank)) is not None and got[0] == "err"]
    if errors:
        _, rank, tb = min(errors)
        raise RankFailure(rank, "exception in the rank function", tb)
    for rank, p in enumerate(procs):
        if p.exitcode not in (0, None):
            raise RankFailure(rank, f"exited with code {p.exitcode} and no result")


def _wait(procs: list, out_dir: Path, world_size: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    first_failure: float | None = None
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        failed = any(p.exitcode not in (0, None) for p in procs)
        if failed and first_failure is None:
            first_failure = now
        if now > deadline or (first_failure is not None and now - first_failure > _GRACE_S):
            break
        time.sleep(0.02)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    _raise_first_failure(out_dir, procs, world_size)
    if any(_read(out_dir, r) is None for r in range(world_size)):
        raise RankFailure(None, f"timed out after {timeout:.0f} s without results from every rank")


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the results by rank.

    `fn` must be a module-level function (it is pickled to the ranks). The process-group
    timeout is `timeout` too, so a hung collective fails inside the rank before the parent
    kills it.
    """
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp, hosted_store(world_size, timeout_s=timeout) as env:
        out_dir = Path(tmp)
        procs = [_CTX.Process(target=_rank_main, args=(r, world_size, env, tmp, timeout, fn, args),
                              daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        _wait(procs, out_dir, world_size, timeout)
        return [_read(out_dir, r)[1] for r in range(world_size)]


# ---------------------------------------------------------------- tiny-GPT parity helpers

def trainer_reference(overrides: list[str]) -> tuple[list[float], float | None]:
    """The single-process reference of a launched layout: the engine's own Trainer on one process,
    its per-step losses and final validation loss."""
    import torch

    from engine.config.schema import load_config
    from engine.train.trainer import Trainer

    torch.set_num_threads(1)
    steps = list(Trainer(load_config(None, overrides), device=torch.device("cpu")).run())
    return [m.loss for m in steps], steps[-1].val_loss


def assert_launch_follows(result: Any, ref: list[float], ref_val: float | None, *, steps: int,
                          tol: float = 1e-4) -> None:
    """A `launch()` result's `steps` losses and its validation loss within `tol` of the reference."""
    got = [s["loss"] for s in result.steps]
    assert len(got) == steps
    assert max(abs(a - b) for a, b in zip(got, ref)) <= tol, (got, ref)
    assert abs(result.summary["val_loss"] - ref_val) <= tol


def tiny_model_config() -> Any:
    """The parity-test model: 2 layers, d_model 32, 4 heads, seq 16, vocab 256, no dropout."""
    from engine.config.schema import ModelConfig

    return ModelConfig(layers=2, d_model=32, heads=4, seq_len=16, vocab=256, dropout=0.0)


def global_batches(*, steps: int, global_batch: int, seq_len: int, vocab: int, seed: int = 1) -> list[Any]:
    """One (global_batch, seq_len + 1) token tensor per optimizer step, the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (global_batch, seq_len + 1), generator=g) for _ in range(steps)]


def counting_batches(*, steps: int, global_batch: int, seq_len: int, vocab: int,
                     seed: int = 1234) -> list[tuple[Any, Any]]:
    """(inputs, targets) per step: counting sequences from random starts, learnable, so the loss
    falls within 5 steps (the pipeline parity tests)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab, (steps, global_batch, 1), generator=gen)
    tokens = (starts + torch.arange(seq_len + 1)) % vocab
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def single_process_losses(cfg: Any, batches: list[tuple[Any, Any]], *, seed: int, lr: float,
                          eval_after: int | None = None) -> list[float]:
    """The reference of the parity tests: the training loss of each step of one process (AdamW on
    the whole global batch); with `eval_after`, then the loss on batch 0 taken after that step."""
    import torch

    from engine.model.gpt import build_model, loss_fn

    model = build_model(cfg, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, eval_loss = [], None
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == eval_after:
            with torch.no_grad():
                eval_loss = loss_fn(model(batches[0][0]), batches[0][1]).item()
    return losses if eval_after is None else losses + [eval_loss]


def micro_batches(batch: Any, *, dp_rank: int, dp: int, micro: int) -> list[Any]:
    """This dp rank's contiguous slice of a global batch, cut into micro-batches."""
    per_rank = batch.shape[0] // dp
    mine = batch[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return list(mine.split(micro))


def train_steps(model: Any, optimizer: Any, batches: list[Any], *, dp_rank: int = 0, dp: int = 1,
                micro: int, max_norm: float, dp_group: Any = None,
                clip: Callable[..., Any] | None = None, measure: bool = False) -> dict[str, Any]:
    """Optimizer steps with gradient accumulation; returns the dp-mean loss and grad norm per step.

    `clip(params, max_norm) -> norm` defaults to engine.parallel.data.clip_grad_norm; with
    `measure`, also the model-state bytes after the last step (before zero_grad).
    """
    import torch
    import torch.distributed as dist

    from engine.train.memory import measure_model_state
    from engine.model.gpt import loss_fn
    from engine.parallel.data import clip_grad_norm, no_sync_context

    clip = clip or clip_grad_norm
    losses, norms, state = [], [], None
    for batch in batches:
        mbs = micro_batches(batch, dp_rank=dp_rank, dp=dp, micro=micro)
        total = torch.zeros(())
        for i, mb in enumerate(mbs):
            ctx = no_sync_context(model) if i < len(mbs) - 1 else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(model(mb[:, :-1]), mb[:, 1:]) / len(mbs)
                loss.backward()
            total += loss.detach()
        if dp > 1:
            dist.all_reduce(total, group=dp_group)
        losses.append(total.item() / dp)
        norms.append(float(clip(list(model.parameters()), max_norm)))
        optimizer.step()
        if measure:
            state = measure_model_state(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
    return {"loss": losses, "grad_norm": norms, "state": state}
