"""Simulator benchmarks: search speed at Frontier scale and the published-results check.

Run: `python bench/simulator.py`. Parts:
- `print_search_speed()`: configurations of a 1T-parameter GPT on 3,072 GPUs evaluated by the
  vectorised enumeration, the time it took and the configurations per second (issue 16 target:
  >= 1,000,000/s on this 2-core machine).
- `print_published_comparison()`: every published row (tuning/data/published.yaml) simulated with the
  terms fitted on every row (in sample: the fit reads rows flagged `fitted: false` too), their median
  |error| overall and per group, the ranking per table (Spearman, top-1 regret), and each row flagged
  `fitted: false` assessed leave-one-out against the domain of validity: inside or extrapolated, and
  whether its interval covers the measurement (`--published` runs only this part; the out-of-sample
  figures are leave-one-source-out's, `workbench simulate --validate`).
- `print_measured_comparison()`: calibrates this machine (micro-benchmarks only), launches the
  engine's validation configs (1, 2 and 4 ranks, 2 interleaved rounds) and prints simulated vs
  measured step time with the median and max |error| (docs/simulator.md, "Validation on this
  machine"). Takes several minutes on 2 cores; `--measured` runs only it, `--save FILE` pickles its
  table with the host profile, clusters and runs (`pd.read_pickle(FILE).attrs`) to re-price offline.
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

from tuning.sim.hardware import load_cluster  # noqa: E402
from tuning.sim.published import summarize  # noqa: E402
from tuning.search import best_configs, enumerate_configs, published_comparison  # noqa: E402
from tuning.sim.simulator import ModelSpec  # noqa: E402

GPT_1T = ModelSpec(layers=128, hidden=25600, heads=160, seq=2048, vocab=51200)  # Narayanan Table 1
SHOWN = ["tp", "pp", "dp", "virtual", "micro", "zero", "recompute", "sequence_parallel",
         "iteration_time_s", "tflops_per_gpu", "mfu", "memory_per_gpu_gb"]


def print_search_speed(*, cluster: str = "dgx-a100-80gb", gpus: int = 3072,
                       global_batch: int = 3072, repeats: int = 5) -> dict[str, float]:
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
    """Print simulated vs published throughput per row, the in-sample error summary of the rows flagged
    `fitted: false`, the ranking per table and the leave-one-out coverage of the domain's intervals."""
    from tuning.sim.published import sources
    from tuning.sim.domain import held_out_coverage
    from tuning.sim.validation import ranking

    table = published_comparison()
    cols = ["id", "hardware", "framework", "class", "layout", "metric", "published", "simulated", "error_pct", "fitted"]
    with pd.option_context("display.width", 250, "display.max_columns", 20, "display.max_rows", 400):
        print(table[cols].round(1).to_string(index=False))
        for name, df in summarize(table).items():
            print(f"in-sample |error| (terms fitted on every row, these included) of rows flagged fitted: false, "
                  f"by {name}:")
            print(df.round(1).to_string(index=False))
        print("ranking per table:")
        print(ranking(table, sources()).drop(columns=["source"]).round(3).to_string(index=False))
        cover = held_out_coverage()
        print(f"held-out rows, leave-one-out: {int(cover['covered'].sum())} of {len(cover)} inside their interval, "
              f"{int((~cover['inside']).sum())} flagged extrapolated "
              f"({int(cover.loc[~cover['inside'], 'covered'].sum())} of those covered)")
    return table


def print_measured_comparison(*, rounds: int = 2, save: Path | None = None) -> pd.DataFrame:
    """Print the simulated-vs-measured step-time table of the engine on this machine; with `save`,
    pickle the table with its host profile, clusters and runs there, to re-price them offline."""
    from tuning.calibrate.calibration import compare_measured, consistent_shares

    start_load = os.getloadavg()
    table = compare_measured(rounds=rounds, on_row=lambda row: print(json.dumps(row), flush=True))
    if save is not None:
        table.to_pickle(save)
    host = table.attrs["host"]
    print(f"calibration: load1 {host.load1:.1f}, cpus {host.cpus}, non-GEMM {host.nongemm_gb_s:.2f} GB/s, "
          f"optimizer (clip + AdamW) {host.optimizer_gb_s:.2f} GB/s, overheads "
          + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in host.overheads.items()))
    used = consistent_shares(host.shares)
    print("measured per-rank compute share: " + ", ".join(f"world {w}: {v:.2f} (priced {used[w]:.2f})"
                                                           for w, v in sorted(host.shares.items()))
          + "; multi-rank extras: " + ", ".join(
              f"world {w}: {o['overhead_rank_step_s'] * 1e3:.2f} ms/step, {o['overhead_rank_layer_s'] * 1e3:.2f} ms/layer-mb"
              for w, o in sorted(host.rank_overheads.items())))
    for world, spec in table.attrs["clusters"].items():
        print(f"  world {world}: GEMM peak {spec.peak_flops / 1e9:.1f} GFLOP/s per rank, all-reduce "
              f"alpha {spec.intra_latency_s * 1e3:.2f} ms, busbw {spec.intra_bw_gb_s:.2f} GB/s")
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.round({"measured_s": 4, "simulated_s": 4, "error_pct": 1, "load1": 1, "speed": 2,
                           "error_at_speed_pct": 1}).to_string(index=False))
    errors, at_speed = table["error_pct"].abs(), table["error_at_speed_pct"].abs()
    print(f"{len(table)} configs: median |error| {errors.median():.1f}%, max {errors.max():.1f}% "
          f"(target median <= 10%); load1 at start {start_load[0]:.1f}, at end {os.getloadavg()[0]:.1f}")
    print(f"with the host's drift since calibration taken out (speed index {table['speed'].min():.2f}-"
          f"{table['speed'].max():.2f}): median |error| {at_speed.median():.1f}%, max {at_speed.max():.1f}%")
    return table


def print_moe_and_context(*, cluster: str = "dgx-a100-80gb", repeats: int = 3) -> None:
    """Issues 18/19: search speed of the dense 1T space without and with the cp axes (interleaved,
    medians), and the best configurations of an 8-expert top-2 MoE and a 128K-token GPT."""
    spec = load_cluster(cluster)
    spaces = {"dense space, cp=1 (the space before issue 19)": {"cp": [1]}, "with cp and cp_impl": {}}
    times: dict[str, list[float]] = {k: [] for k in spaces}
    sizes: dict[str, int] = {}
    for _ in range(repeats):
        for name, axes in spaces.items():
            start = time.perf_counter()
            sizes[name] = len(enumerate_configs(GPT_1T, spec, 3072, 3072, axes=axes))
            times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        seconds = statistics.median(values)
        print(f"search, {name}: {sizes[name]:,} configs in {seconds:.3f} s, {sizes[name] / seconds:,.0f} configs/s")
    shown = ["tp", "pp", "dp", "cp", "cp_impl", "ep", "micro", "zero", "recompute", "iteration_time_s",
             "all_to_all_s", "cp_comm_s", "memory_per_gpu_gb"]
    moe = ModelSpec(layers=24, hidden=2048, heads=16, seq=2048, vocab=51200, experts=8, top_k=2)
    long = ModelSpec(layers=32, hidden=4096, heads=32, seq=131072, vocab=51200)
    for title, model, gpus, batch in (("8 experts, top-2", moe, 64, 256), ("128K-token sequences", long, 64, 8)):
        df = enumerate_configs(model, spec, gpus, batch)
        print(f"{title}: {len(df):,} configs, {model.params / 1e9:.1f}B params "
              f"({model.active_params / 1e9:.1f}B active) on {gpus} GPUs")
        with pd.option_context("display.width", 200, "display.max_columns", 20):
            print(best_configs(df, 5)[shown].round(4).to_string(index=False))


def main() -> None:
    """Run every part of the simulator benchmark (`--measured [--save FILE]`: only the measured one)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", action="store_true", help="only the measured comparison on this machine")
    parser.add_argument("--save", type=Path, help="pickle the measured table, host profile and runs here")
    parser.add_argument("--published", action="store_true", help="only the published comparison")
    args = parser.parse_args()
    if args.published:
        print_published_comparison()
        return
    if args.measured:
        print_measured_comparison(save=args.save)
        return
    print_search_speed()
    print()
    print_moe_and_context()
    print()
    print_published_comparison()
    print()
    print_measured_comparison(save=args.save)


if __name__ == "__main__":
    main()
