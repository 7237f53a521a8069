"""Simulator benchmarks: search speed at Frontier scale and the published-results check.

Run: `python bench/simulator.py`. Parts:
- `print_search_speed()`: configurations of a 1T-parameter GPT on 3,072 GPUs evaluated by the
  vectorised enumeration, the time it took and the configurations per second (issue 16 target:
  >= 1,000,000/s on this 2-core machine).
- `print_published_comparison()`: every published row (tuning/data/published.yaml) simulated, and
  the held-out median |error| overall and per strategy class (`workbench simulate --validate`).
- `print_measured_comparison()`: calibrates this machine (micro-benchmarks only), launches the
  engine's validation configs (1, 2 and 4 ranks, 2 interleaved rounds) and prints simulated vs
  measured step time with the median and max |error| (docs/simulator.md, "Validation on this
  machine"). Takes several minutes on 2 cores.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import pandas as pd  # noqa: E402

from tuning.hardware import load_cluster  # noqa: E402
from tuning.published import summarize  # noqa: E402
from tuning.search import best_configs, enumerate_configs, published_comparison  # noqa: E402
from tuning.simulator import ModelSpec  # noqa: E402

GPT_1T = ModelSpec(layers=128, hidden=25600, heads=160, seq=2048, vocab=51200)  # Narayanan Table 1
SHOWN = ["tp", "pp", "dp", "virtual", "micro", "zero", "recompute", "sequence_parallel",
         "iteration_time_s", "tflops_per_gpu", "mfu", "memory_per_gpu_gb"]


def print_search_speed(*, cluster: str = "dgx-a100-80gb", gpus: int = 3072,
                       global_batch: int = 3072, repeats: int = 3) -> dict[str, float]:
    """Time the exhaustive search of the 1T space; prints and returns count and seconds."""
    spec = load_cluster(cluster)
    times, df = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        df = enumerate_configs(GPT_1T, spec, gpus, global_batch)
        times.append(time.perf_counter() - start)
    assert df is not None
    seconds = statistics.median(times)
    print(f"search speed: {len(df):,} configs of a {GPT_1T.params / 1e9:.0f}B-parameter GPT on "
          f"{gpus:,} GPUs ({cluster}) in {seconds:.3f} s (median of {repeats}), "
          f"{len(df) / seconds:,.0f} configurations/s; {int(df.fits.sum()):,} fit in memory; "
          f"cpus={os.cpu_count()}")
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(best_configs(df, 5)[SHOWN].round(3).to_string(index=False))
    return {"configs": float(len(df)), "seconds": seconds}


def print_published_comparison() -> pd.DataFrame:
    """Print simulated vs published throughput per row and the held-out error summary."""
    table = published_comparison()
    cols = ["id", "hardware", "class", "layout", "metric", "published", "simulated", "error_pct", "fitted"]
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_rows", 200):
        print(table[cols].round(1).to_string(index=False))
        for name, df in summarize(table).items():
            print(f"held-out |error| by {name}:")
            print(df.round(1).to_string(index=False))
    return table


def print_measured_comparison(*, rounds: int = 2) -> pd.DataFrame:
    """Print the simulated-vs-measured step-time table of the engine on this machine."""
    from tuning.calibration import compare_measured

    start_load = os.getloadavg()
    table = compare_measured(rounds=rounds, on_row=lambda row: print(json.dumps(row), flush=True))
    host = table.attrs["host"]
    print(f"calibration: load1 {host.load1:.1f}, cpus {host.cpus}, non-GEMM {host.nongemm_gb_s:.2f} GB/s, "
          f"AdamW {host.optimizer_gb_s:.2f} GB/s, overheads "
          + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in host.overheads.items()))
    for world, spec in table.attrs["clusters"].items():
        print(f"  world {world}: GEMM peak {spec.peak_flops / 1e9:.1f} GFLOP/s per rank, all-reduce "
              f"alpha {spec.intra_latency_s * 1e3:.2f} ms, busbw {spec.intra_bw_gb_s:.2f} GB/s")
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.round({"measured_s": 4, "simulated_s": 4, "error_pct": 1, "load1": 1}).to_string(index=False))
    errors = table["error_pct"].abs()
    print(f"{len(table)} configs: median |error| {errors.median():.1f}%, max {errors.max():.1f}% "
          f"(target median <= 15%); load1 at start {start_load[0]:.1f}, at end {os.getloadavg()[0]:.1f}")
    return table


def main() -> None:
    """Run every part of the simulator benchmark."""
    print_search_speed()
    print()
    print_published_comparison()
    print()
    print_measured_comparison()


if __name__ == "__main__":
    main()
