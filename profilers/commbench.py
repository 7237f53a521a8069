"""commbench: a bus-bandwidth sweep of each collective over message sizes, like nccl-tests.

`commbench` runs inside an initialised process group (every rank calls it); `spawn_commbench`
starts ``world`` real processes itself (for ``workbench commbench --world N``) and returns rank
0's rows; `format_busbw_table` prints them as nccl-tests does. Times are the mean over
``iters`` of the slowest rank; bandwidths follow the nccl-tests definitions (bandwidth.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from profilers.bandwidth import CANONICAL, algbw, all_gather_flat, busbw, reduce_scatter_flat
from profilers.rendezvous import hosted_store

SWEEP_OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast",
                              "all_to_all", "sendrecv")
"""The ops `commbench` sweeps by default (``sendrecv`` is a ring of isend/irecv pairs)."""


def sweep_sizes(min_bytes: int = 1024, max_bytes: int = 256 << 20, factor: int = 4) -> list[int]:
    """Message sizes from ``min_bytes`` to ``max_bytes``, multiplying by ``factor`` (2 or 4)."""
    if factor < 2 or min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(f"need factor>=2 and 1<=min_bytes<=max_bytes, got {factor=}, "
                         f"{min_bytes=}, {max_bytes=}")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def _bench_call(op: str, size: int, n: int, rank: int, device: torch.device
                ) -> tuple[Callable[[], None], int]:
    """A closure running one ``op`` of ``size`` bytes (float32), and the bytes it moves."""
    count = max(size // 4 // n, 1) * n  # divisible by n for gathers, scatters and all-to-all
    full = torch.ones(count, dtype=torch.float32, device=device)
    part = torch.ones(count // n, dtype=torch.float32, device=device)
    nbytes = count * 4
    if op == "all_reduce":
        return (lambda: dist.all_reduce(full)), nbytes
    if op == "all_gather":
        return (lambda: all_gather_flat(full, part)), nbytes
    if op == "reduce_scatter":
        return (lambda: reduce_scatter_flat(part, full)), nbytes
    if op == "broadcast":
        return (lambda: dist.broadcast(full, src=0)), nbytes
    if op == "all_to_all":
        out = torch.empty_like(full)
        return (lambda: dist.all_to_all_single(out, full)), nbytes
    if op == "sendrecv":
        inbox = torch.empty_like(full)

        def ring() -> None:
            works = [dist.isend(full, (rank + 1) % n), dist.irecv(inbox, (rank - 1) % n)]
            for work in works:
                work.wait()

        return ring, nbytes
    raise ValueError(f"commbench op {op!r} unknown; choose from {', '.join(SWEEP_OPS)}")


def commbench(ops: Sequence[str] = SWEEP_OPS, sizes: Sequence[int] | None = None,
              world: int | None = None, iters: int = 5, *, warmup: int = 1,
              device: torch.device | str | None = None, work_s: float = 0.0) -> list[dict[str, Any]]:
    """Sweep ``ops`` over ``sizes`` inside an initialised process group; every rank calls it.

    Returns rows ``{op, size, count, time(s), algbw(GB/s), busbw(GB/s)}`` (same on every
    rank): ``time(s)`` is the mean over ``iters`` of the slowest rank (max over ranks).
    ``work_s`` > 0 (CPU): each call follows about that much host compute on every rank, as in a
    training step, and ``time(s)`` is the mean iteration time minus that of the compute alone
    (the op "in situ": the ranks' drift apart during compute and the wake-up of idle
    communication threads included, which a back-to-back loop never sees).
    """
    if not dist.is_initialized():
        raise RuntimeError("commbench runs inside an initialised process group; "
                           "use spawn_commbench(world=N) to start one")
    n, rank = dist.get_world_size(), dist.get_rank()
    if world is not None and world != n:
        raise ValueError(f"world={world} but the process group has {n} ranks")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else torch.device("cpu")
    device = torch.device(device)
    rows = []
    work = _host_work(work_s, device) if work_s > 0 else None
    for op in ops:
        if op == "sendrecv" and n < 2:
            continue
        for size in (sizes if sizes is not None else sweep_sizes()):
            run, nbytes = _bench_call(op, size, n, rank, device)
            if work is not None:
                seconds = (_time_op(lambda: (work(), run()), iters, warmup, device)
                           - _time_op(work, iters, warmup, device))
            else:
                seconds = _time_op(run, iters, warmup, device)
            kind = CANONICAL[op]
            rows.append({"op": op, "size": nbytes, "count": nbytes // 4, "time(s)": seconds,
                         "algbw(GB/s)": algbw(nbytes, seconds),
                         "busbw(GB/s)": busbw(kind, nbytes, seconds, n)})
    return rows


def _host_work(seconds: float, device: torch.device) -> Callable[[], None]:
    """About `seconds` of single-thread matmuls, the same count on every rank (rank 0's timing)."""
    x = torch.randn(128, 128)
    t0 = time.perf_counter()
    for _ in range(20):
        x @ x
    per = (time.perf_counter() - t0) / 20
    count = torch.tensor([max(int(seconds / max(per, 1e-7)), 1)], device=device)
    dist.broadcast(count, src=0)
    reps = int(count.item())

    def work() -> None:
        for _ in range(reps):
            x @ x

    return work


def _time_op(run: Callable[[], None], iters: int, warmup: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        run()
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    sync()
    elapsed = torch.tensor([(time.perf_counter() - t0) / max(iters, 1)], dtype=torch.float64,
                           device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def format_busbw_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows of `commbench` as an nccl-tests style table, one block per op."""
    lines: list[str] = []
    by_op: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_op[row["op"]].append(row)
    for op, items in by_op.items():
        lines.append(f"# {op}")
        lines.append(f"#{'size':>12} {'count':>12} {'type':>6} {'time':>10} {'algbw':>8} "
                     f"{'busbw':>8}")
        lines.append(f"#{'(B)':>12} {'(elements)':>12} {'':>6} {'(us)':>10} {'(GB/s)':>8} "
                     f"{'(GB/s)':>8}")
        for r in items:
            lines.append(f" {r['size']:>12} {r['count']:>12} {'float':>6} "
                         f"{r['time(s)'] * 1e6:>10.1f} {r['algbw(GB/s)']:>8.3f} "
                         f"{r['busbw(GB/s)']:>8.3f}")
        avg = sum(r["busbw(GB/s)"] for r in items) / len(items)
        lines.append(f"# Avg bus bandwidth    : {avg:.3f} GB/s")
        lines.append("")
    return "\n".join(lines)


def spawn_commbench(world: int, ops: Sequence[str] = SWEEP_OPS,
                    sizes: Sequence[int] | None = None, iters: int = 5, *,
                    backend: str = "gloo", timeout: float = 600.0, work_s: float = 0.0) -> list[dict[str, Any]]:
    """Start ``world`` real processes (gloo by default), run `commbench` (``work_s`` as there),
    return rank 0's rows."""
    if world < 1:
        raise ValueError(f"world={world} must be >= 1")
    root = str(Path(__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory(prefix="commbench-") as tmp, hosted_store(world, timeout_s=timeout) as store_env:
        out = Path(tmp) / "rows.json"
        spec = json.dumps({"ops": list(ops), "sizes": list(sizes) if sizes else None,
                           "iters": iters, "backend": backend, "out": str(out), "work_s": work_s})
        env = {**os.environ, **store_env, "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        procs = [subprocess.Popen([sys.executable, "-m", "profilers.commbench", spec],
                                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for r in range(world)]
        errors = _wait_all(procs, timeout)
        if errors or not out.exists():
            raise RuntimeError("commbench failed: " + ("; ".join(errors) or "rank 0 wrote no rows"))
        return json.loads(out.read_text())


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[str]:
    deadline, errors = time.monotonic() + timeout, []
    for rank, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            return [f"timed out after {timeout:.0f} s"]
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-3:]
            errors.append(f"rank {rank} exited {proc.returncode}: {' | '.join(tail)}")
            for p in procs:  # a dead rank would leave the others waiting for their timeout
                p.kill()
    return errors


def _worker(spec: dict[str, Any]) -> None:
    import datetime

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if spec["backend"] == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(spec["backend"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    rows = commbench(spec["ops"], spec["sizes"], world, spec["iters"], work_s=spec.get("work_s", 0.0))
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # a rank of spawn_commbench
    _worker(json.loads(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo teardown sometimes aborts after correct work (platform.md)
