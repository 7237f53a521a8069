"""Each gradient-compression method on the text corpus at dp=2: wire bytes vs dense, step time,
final val loss vs dense DP. Every method trains the same model from the same seed on the same
batches for the same steps; the sweep is repeated in alternating order and medians are reported.

    python bench/compression.py [--steps 150] [--repeats 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config.schema import load_config  # noqa: E402
from engine.launch.local import launch  # noqa: E402

MODEL = ["model.layers=2", "model.d_model=256", "model.heads=4", "model.seq_len=64", "batch.global=16",
         "batch.micro=8", "parallel.dp=2", "train.lr=0.002", "train.warmup_steps=10", "train.eval_batches=4",
         "profile.host_interval_s=0", "profile.nvml_interval_s=0", "data.source=text"]
METHODS = {
    "dense": [],
    "fp16": ["comm.compressor=fp16"],
    "bf16": ["comm.compressor=bf16"],
    "int8": ["comm.compressor=int8"],
    "topk 1%": ["comm.compressor=topk", "comm.density=0.01"],
    "randk 1%": ["comm.compressor=randk", "comm.density=0.01"],
    "powersgd r4": ["comm.compressor=powersgd", "comm.rank=4"],
    "l-greco topk": ["comm.compressor=topk", "comm.adaptive=true", "comm.density=0.01", "comm.adaptive_interval=25"],
    "co2 tau4": ["co2.enabled=true", "co2.tau=4"],
}


def run(name: str, steps: int, home: Path) -> dict:
    cfg = load_config(None, MODEL + METHODS[name] + [f"train.steps={steps}", f"train.eval_interval={steps}"])
    r = launch(cfg, home=home)
    return {"wire": r.summary["wire_bytes"], "dense": r.summary["dense_bytes"],
            "step": r.summary["step_time_s"], "val": r.summary["val_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    results: dict[str, list[dict]] = {m: [] for m in METHODS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            order = list(METHODS) if rep % 2 == 0 else list(reversed(METHODS))
            for name in order:
                results[name].append(run(name, args.steps, Path(tmp)))
    dense_val = statistics.median(r["val"] for r in results["dense"])
    print(f"dp=2, {args.steps} steps, {MODEL[:4]} (load avg {os.getloadavg()[0]:.1f}; "
          f"{args.repeats} repeat(s), alternating order, medians)")
    print(f"{'method':14s} {'dense/wire':>10s} {'step ms':>8s} {'val loss':>9s} {'val / dense':>11s}")
    for name, rs in results.items():
        cut = statistics.median(r["dense"] / r["wire"] for r in rs)
        step = statistics.median(r["step"] for r in rs) * 1000
        val = statistics.median(r["val"] for r in rs)
        print(f"{name:14s} {cut:9.1f}x {step:8.1f} {val:9.4f} {val / dense_val:10.3f}x")
    print("target: PowerSGD rank 4 or Top-k 1% cuts wire bytes >= 16x with final loss within 3% of dense")


if __name__ == "__main__":
    main()
