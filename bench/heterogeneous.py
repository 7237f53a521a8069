"""Holmes-style placement vs naive placement on two emulated NIC groups joined by a slow link.

World 4, pp=2 x dp=2. The emulated network (engine link.groups): group "ib" = ranks 0 and 2,
group "eth" = ranks 1 and 3, each fast inside (100 Gbit/s, 5 us), 1 Gbit/s (50 us) between
them: the job's ranks alternate between two clusters, as a scheduler listing nodes by name can
hand them out. A communication-bound setting (16 tokens per step, 12.6M parameters: each stage's
gradient all-reduce is 25 MB, 0.2 s at 1 Gbit/s), as a large model's is over Ethernet in Holmes'
setting; the machine's 2 cores run all 4 ranks. The naive placement (rank order) puts each stage's dp pair (0,1) and (2,3) across
the slow link; Holmes puts each stage inside one group and only the pipeline's sends across.

Prints measured tokens/s of each placement (interleaved repeats, medians), their ratio, and the
simulator's predicted ratio for the same pair (tuning/sim/network.py on this host's calibrated
profile), with the gap between the two ratios.

    python bench/heterogeneous.py [--rounds 3] [--steps 7] [--inter-gbps 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config.schema import load_config  # noqa: E402
from engine.launch.local import launch  # noqa: E402

GROUPS = ("link.groups=[{name: ib, ranks: [0, 2], gbps: 100, latency_us: 5}, "
          "{name: eth, ranks: [1, 3], gbps: 100, latency_us: 5}]")
BASE = ["parallel.pp=2", "parallel.dp=2", "parallel.schedule=1f1b", "model.layers=4", "model.d_model=512",
        "model.heads=4", "model.seq_len=4", "batch.global=4", "batch.micro=1", "data.source=synthetic",
        "profile.host_interval_s=0", "profile.nvml_interval_s=0", "train.eval_interval=0",
        "train.warmup_steps=0", GROUPS, "link.inter_gbps=1", "link.inter_latency_us=50"]
PLACEMENTS = {"naive": ["parallel.placement=naive"], "holmes": ["parallel.placement=holmes"]}


# where a step's time goes, per rank (medians over the steps after the first two): the pipeline
# schedule (forward, backward, waits), the dp gradient all-reduce (real + emulated link, from the
# last rank's join), and the optimizer phase (that all-reduce + clip + AdamW)
PARTS = {"schedule": ("schedule", "@total"), "dp_allreduce": ("comm", "dp:all_reduce/time(s)"),
         "optimizer_phase": ("breakdown", "optimizer(s)"), "data": ("breakdown", "data(s)"),
         "fwd+bwd": ("breakdown", "forward(s)", "backward(s)"), "bubble": ("breakdown", "bubble(s)"),
         "comm_exposed": ("breakdown", "comm_exposed(s)"), "other": ("breakdown", "other(s)")}


def measure(name: str, steps: int, home: Path, extra: list[str]) -> tuple[float, dict[str, float]]:
    """Tokens/s of one launch (tokens per step / the median steady step time) and its step parts (s)."""
    from profilers.store import RunStore

    cfg = load_config(None, BASE + extra + PLACEMENTS[name] + [f"train.steps={steps}", f"name=het-{name}"])
    result = launch(cfg, home=home)
    store = RunStore.open_home(home)
    parts = {}
    for part, (kind, *metrics) in PARTS.items():
        per_metric = [[r.value for r in store.metrics(result.run_id, kind=kind, name=m) if r.step >= 2]
                      for m in metrics]
        parts[part] = sum(statistics.median(v) if v else float("nan") for v in per_metric)
    return cfg.batch.global_ * cfg.model.seq_len / float(result.summary["step_time_s"]), parts


def predicted(steps: int, extra_overrides: list[str]) -> dict[str, dict[str, float]]:
    """The simulator's tokens/s and breakdown of each placement on this host's calibrated profile."""
    import dataclasses

    from engine.comm.link import topology_of
    from tuning.calibrate.calibration import calibrate_local, measure_allreduce, measure_host
    from tuning.sim.network import simulate_placement
    from tuning.sim.simulator import from_run_config

    # every collective that matters here (the dp all-reduces) runs in a 2-rank group: the host's own
    # gloo all-reduce is fitted at that size
    host = measure_host()
    alpha, busbw = measure_allreduce(2)
    profile = calibrate_local(4, host=host, allreduce=(alpha, busbw))  # with the multi-rank and pipeline overheads
    # gloo's copies are CPU work: timed with 2 processes on the cores, run with 4 ranks on them (both
    # stages' pairs all-reduce at once), so they get the same measured per-rank share as compute
    busbw *= host.shares[4] / host.shares[2]
    profile = dataclasses.replace(profile, intra_bw_gb_s=busbw, inter_bw_gb_s=busbw)
    print(f"calibrated host: gloo all-reduce {profile.intra_bw_gb_s:.3f} GB/s bus, {profile.intra_latency_s * 1e3:.2f} ms "
          f"alpha; each rank {profile.calibration_cpu_share:.2f} of a core", flush=True)
    out = {}
    for name, extra in PLACEMENTS.items():
        cfg = load_config(None, BASE + extra_overrides + extra + [f"train.steps={steps}"])
        model, par = from_run_config(cfg.to_dict())
        topo = topology_of(cfg.link.groups, inter_gbps=cfg.link.inter_gbps, inter_latency_us=cfg.link.inter_latency_us)
        out[name] = simulate_placement(model, profile, par, topology=topo, placement=cfg.parallel.placement)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--inter-gbps", type=float, default=1.0, help="the link between the groups (Gbit/s)")
    args = ap.parse_args()
    extra = [f"link.inter_gbps={args.inter_gbps}"]
    print(f"host: {os.cpu_count()} cpus, load1 {os.getloadavg()[0]:.1f} at start (other jobs share the machine); "
          f"inter-group link {args.inter_gbps} Gbit/s")
    sim = predicted(args.steps, extra)
    print("simulated tokens/s: " + ", ".join(f"{k} {v['tokens_per_s']:.1f}" for k, v in sim.items()), flush=True)
    got: dict[str, list[float]] = {name: [] for name in PLACEMENTS}
    step_parts: dict[str, list[dict[str, float]]] = {name: [] for name in PLACEMENTS}
    with tempfile.TemporaryDirectory(prefix="bench-het-") as tmp:
        for r in range(args.rounds):  # interleaved: a slow phase of the shared machine hits both
            for name in PLACEMENTS:
                t0 = time.perf_counter()
                tps, part = measure(name, args.steps, Path(tmp), extra)
                got[name].append(tps)
                step_parts[name].append(part)
                print(f"round {r + 1} {name:7s} {tps:8.1f} tokens/s  ({time.perf_counter() - t0:.0f} s, load1 "
                      f"{os.getloadavg()[0]:.1f}); per rank: " + ", ".join(f"{k} {v:.3f} s" for k, v in part.items()),
                      flush=True)
    med = {name: statistics.median(v) for name, v in got.items()}
    ratio, sim_ratio = med["holmes"] / med["naive"], sim["holmes"]["tokens_per_s"] / sim["naive"]["tokens_per_s"]
    print(f"\n{'placement':10s} {'measured tok/s':>15s} {'simulated tok/s':>16s}  simulated breakdown (s)")
    for name in PLACEMENTS:
        s = sim[name]
        parts = ", ".join(f"{k[:-2]} {s[k]:.3f}" for k in ("compute_s", "bubble_s", "pp_comm_s", "dp_comm_exposed_s",
                                                          "optimizer_s"))
        print(f"{name:10s} {med[name]:15.1f} {s['tokens_per_s']:16.1f}  {parts}")
    print("measured step parts (s, medians over rounds, ranks, steps): " + "; ".join(
        f"{name} " + ", ".join(f"{k} {statistics.median(p[k] for p in step_parts[name]):.3f}" for k in PARTS)
        for name in PLACEMENTS))
    print(f"\nholmes / naive tokens/s: measured {ratio:.2f}x (goal >= 1.5x), simulated {sim_ratio:.2f}x; "
          f"simulated ratio off by {100 * (sim_ratio - ratio) / ratio:+.1f}% (goal within 15%)")


if __name__ == "__main__":
    main()
