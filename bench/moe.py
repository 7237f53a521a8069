"""MoE all_to_all at ep=4 on the emulated 1 Gbps link: what LSH-MoE compression cuts and costs,
and hierarchical vs flat all_to_all.

1. bytes: all_to_all bytes per rank of the uncompressed run over those of the LSH run (the
   profiler's records of what was actually sent, the per-expert count exchanges included);
2. quality: the LSH run's validation loss (8 fixed batches) after --steps steps relative to the
   uncompressed run's (same model, seed and batches);
3. time: median step time of hierarchical (2 emulated nodes of 2 ranks) over flat all_to_all,
   measured in alternating order over --repeats short runs.

    python bench/moe.py [--steps 150] [--time-steps 20] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config.schema import load_config  # noqa: E402
from engine.launch.local import launch  # noqa: E402
from profilers.store import RunStore  # noqa: E402

MODEL = ["model.layers=2", "model.d_model=64", "model.heads=4", "model.seq_len=64", "model.experts=8",
         "model.top_k=2", "model.capacity_factor=1.25", "batch.global=16", "batch.micro=4", "parallel.dp=4",
         "parallel.ep=4", "train.lr=0.003", "train.warmup_steps=10", "data.source=text",
         "profile.host_interval_s=0", "profile.nvml_interval_s=0", "link.gbps=1", "link.latency_us=100",
         "link.ranks_per_node=2"]  # two emulated nodes of 2 ranks for every variant
VARIANTS = {
    "flat": [],
    "lsh": ["comm.moe_compression=lsh", "comm.lsh_hashes=1"],
    "hierarchical": ["comm.moe_hierarchical=true"],
}


def run(name: str, steps: int, home: Path, extra: tuple[str, ...] = ()) -> dict:
    cfg = load_config(None, MODEL + VARIANTS[name] + list(extra) + [f"train.steps={steps}", f"train.eval_interval={steps}",
                                                                     "train.eval_batches=8"])
    r = launch(cfg, home=home)
    comm = RunStore.open_home(home).comm_totals(r.run_id)
    a2a = {k: v for k, v in comm.items() if k.endswith("all_to_all")}
    return {"loss": r.summary["val_loss"], "step": r.summary["step_time_s"],
            "a2a_bytes": sum(v["bytes"] for v in a2a.values()), "a2a_time": sum(v["time(s)"] for v in a2a.values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--time-steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lsh-buckets", default="16,32", help="comma-separated comm.lsh_buckets to compare")
    args = ap.parse_args()
    buckets = [int(b) for b in args.lsh_buckets.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        flat = run("flat", args.steps, home)
        lshs = {b: run("lsh", args.steps, home, (f"comm.lsh_buckets={b}",)) for b in buckets}
        times: dict[str, list[float]] = {"flat": [], "hierarchical": []}
        for i in range(args.repeats):  # alternate the order so drift in machine load hits both alike
            order = ["flat", "hierarchical"] if i % 2 == 0 else ["hierarchical", "flat"]
            for name in order:
                times[name].append(run(name, args.time_steps, home)["step"])
    print(f"ep=4, 8 experts top-2, emulated link 1 Gbps / 100 us, {args.steps} steps")
    print(f"{'':>24} {'flat':>12}" + "".join(f" {'lsh ' + str(b):>12}" for b in buckets))
    rows = (("all_to_all MB per rank", "a2a_bytes", 1e-6, ".2f"), ("all_to_all s per rank", "a2a_time", 1, ".2f"),
            ("val loss", "loss", 1, ".4f"))
    for label, key, scale, fmt in rows:
        print(f"{label:>24} {flat[key] * scale:>12{fmt}}" + "".join(f" {lshs[b][key] * scale:>12{fmt}}" for b in buckets))
    for b, lsh in lshs.items():
        print(f"LSH {b} buckets: bytes cut {flat['a2a_bytes'] / lsh['a2a_bytes']:.2f}x (goal >= 2x), "
              f"loss vs uncompressed {lsh['loss'] / flat['loss'] - 1:+.2%} (goal within 3%)")
    f, h = statistics.median(times["flat"]), statistics.median(times["hierarchical"])
    print(f"step time median over {args.repeats} runs of {args.time_steps} steps: flat {f:.3f} s, "
          f"hierarchical {h:.3f} s, ratio hierarchical/flat {h / f:.3f}")


if __name__ == "__main__":
    main()
