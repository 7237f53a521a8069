"""Shared by the bench scripts: run a function on N real gloo ranks and get rank 0's result."""
from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from profilers.rendezvous import hosted_store  # noqa: E402


def _rank_main(rank: int, world: int, store_env: dict[str, str], fn: Callable[..., Any], args: tuple, out: str) -> None:
    os.environ.update(store_env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    result = fn(rank, world, *args)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # ranks sometimes abort at interpreter exit (shared/reference/platform.md)


def run_world(fn: Callable[..., Any], world: int, *args: Any) -> Any:
    """Run `fn(rank, world, *args)` on `world` spawned gloo ranks; returns rank 0's JSON result."""
    with tempfile.TemporaryDirectory() as tmp, hosted_store(world, timeout_s=600) as store_env:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_rank_main, args=(world, store_env, fn, args, out), nprocs=world,
                           start_method="spawn")
        return json.loads(Path(out).read_text())


def timed(fn: Callable[[], Any]) -> float:
    """Seconds of one call, ranks lined up first so every rank times the same step."""
    import time

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved_main(measure: Callable[..., Any]) -> tuple[Any, Any]:
    """The shared CLI of the interleaved A/B benches: parse --world/--rounds/--steps/--global-batch,
    run `measure(rank, world, args)` on the ranks (args.tmp is a scratch folder); returns (args, result)."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (benches that support it)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        return args, run_world(measure, args.world, args)
