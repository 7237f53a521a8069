"""The Python link emulator against a kernel-shaped link: 2 gloo ranks all-reduce the same bytes
(a) in two network namespaces whose veth links a tbf qdisc holds to `--gbps`, and (b) on loopback
with `LinkEmulator(gbps)` adding the model's wait. Rounds alternate (a) and (b); each prints the
median over its iterations, and the summary the median per mode and their ratio (root; tests/netns.py).

    python -m bench.kernel_links --gbps 1 --mb 32 --iters 5 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def rank_main(args: argparse.Namespace) -> None:
    """One rank: `iters` timed all-reduces of `mb` MiB; rank 0 prints the median seconds as JSON."""
    import torch
    import torch.distributed as dist

    from engine.comm.link import LinkEmulator

    dist.init_process_group("gloo", init_method=f"tcp://{args.addr}:{args.port}", rank=args.rank, world_size=2)
    tensor = torch.ones(int(args.mb * 2**20) // 4)
    link = LinkEmulator(gbps=args.gbps) if args.mode == "emulated" else None
    times = []
    for i in range(args.iters + 1):  # the first one warms the connections
        dist.barrier()
        start = time.perf_counter()
        if link is None:
            dist.all_reduce(tensor)
        else:
            link.emulated(lambda: dist.all_reduce(tensor), op="all_reduce", nbytes=tensor.numel() * 4, group_size=2)
        if i:
            times.append(time.perf_counter() - start)
    if args.rank == 0:
        print(json.dumps({"median_s": statistics.median(times)}), flush=True)
    dist.destroy_process_group()


def _ranks(cmds: list[list[str]], env: list[dict[str, str]]) -> float:
    procs = [subprocess.Popen(c, cwd=REPO, env={**os.environ, **e, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                              text=True) for c, e in zip(cmds, env)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed: {[p.returncode for p in procs]}")
    return float(json.loads(outs[0].strip().splitlines()[-1])["median_s"])


def _rank_cmd(rank: int, addr: str, port: int, mode: str, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "bench.kernel_links", "--rank", str(rank), "--addr", addr, "--port", str(port),
            "--mode", mode, "--gbps", str(args.gbps), "--mb", str(args.mb), "--iters", str(args.iters)]


def main(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO))
    from engine.comm.link import LinkEmulator
    from tests.netns import NetnsCluster, free_port

    cluster = NetnsCluster(nodes=2).start()
    try:
        for i in range(2):
            cluster.shape(i, f"{args.gbps}gbit")
        kernel, emulated = [], []
        for r in range(args.rounds):
            port = 29600 + r
            kernel.append(_ranks([cluster.command(i, _rank_cmd(i, cluster.addr(0), port, "kernel", args))
                                  for i in range(2)], [cluster.env(i) for i in range(2)]))
            port = free_port()
            emulated.append(_ranks([_rank_cmd(i, "127.0.0.1", port, "emulated", args) for i in range(2)], [{}, {}]))
            print(f"round {r}: kernel-shaped {kernel[-1]:.4f} s, emulated {emulated[-1]:.4f} s", flush=True)
    finally:
        cluster.stop()
    model = LinkEmulator(gbps=args.gbps).delay_for("all_reduce", args.mb * 2**20, 2)
    k, e = statistics.median(kernel), statistics.median(emulated)
    print(f"all_reduce of {args.mb} MiB between 2 ranks at {args.gbps} Gbit/s: kernel-shaped {k:.4f} s, "
          f"emulated {e:.4f} s, model {model:.4f} s; emulated / kernel = {e / k:.3f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gbps", type=float, default=1.0)
    ap.add_argument("--mb", type=float, default=32.0)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--addr", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--mode", choices=("kernel", "emulated"), default="kernel")
    parsed = ap.parse_args()
    rank_main(parsed) if parsed.rank is not None else main(parsed)
