"""The engine's AdamW step, fused (one kernel) against the foreach default, on this host.

The engine builds AdamW with `fused=True` where torch has the kernel (CPU, CUDA:
`engine.parallel.zero.fused_supported`). Prints the median step time of each, interleaved over
repeats (a slow phase of a shared machine hits both), and their ratio, at a few model sizes; one
thread, fp32, gradients set, states warm.

    python bench/optimizer.py [--repeats 7] [--params 1e6 6.3e6 25e6]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def step_seconds(opt: torch.optim.Optimizer) -> float:
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--params", type=float, nargs="+", default=[1e6, 6.3e6, 25e6])
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"host: {os.cpu_count()} cpus, load1 {os.getloadavg()[0]:.1f}; torch {torch.__version__}, 1 thread, fp32")
    print(f"{'params':>10s} {'foreach ms':>11s} {'fused ms':>9s} {'foreach / fused':>16s}")
    for n in (int(x) for x in args.params):
        params = [torch.nn.Parameter(torch.randn(n // 12)) for _ in range(12)]
        for p in params:
            p.grad = torch.randn_like(p)
        opts = {"foreach": torch.optim.AdamW(params, lr=1e-3, foreach=True),
                "fused": torch.optim.AdamW(params, lr=1e-3, fused=True)}
        times: dict[str, list[float]] = {name: [] for name in opts}
        for opt in opts.values():
            opt.step()  # states allocated
        for _ in range(args.repeats):
            for name, opt in opts.items():
                times[name].append(step_seconds(opt))
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"{n:10,d} {med['foreach'] * 1e3:11.1f} {med['fused'] * 1e3:9.1f} {med['foreach'] / med['fused']:15.2f}x")


if __name__ == "__main__":
    main()
