"""Bidirectional compression (engine/comm/bidirectional.py) on the example GPT: dense DP vs Rand-k
and Top-k compressed on both legs (and on one leg, for reference), same model, seed and batches.
Prints the bytes of each leg (measured by the hook from the tensors it sends, summed over the
run, rank 0, ring bus factors) and the final loss gap against dense.

    python bench/bidirectional.py [--steps 150] [--dp 2 4] [--density 0.1] [--both-legs-only]
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
from profilers.store import RunStore  # noqa: E402

MODEL = ["model.layers=2", "model.d_model=64", "model.heads=4", "model.seq_len=64", "batch.global=16",
         "batch.micro=4", "train.lr=0.003", "train.warmup_steps=10", "train.eval_batches=4",
         "profile.host_interval_s=0", "profile.nvml_interval_s=0", "data.source=text"]


def methods(density: float) -> dict[str, list[str]]:
    d = f"comm.density={density}"
    return {
        "dense": [],
        "randk both legs": ["comm.compressor=randk", d, "comm.bidirectional=true"],
        "topk+EF both legs": ["comm.compressor=topk", d, "comm.bidirectional=true"],
        "randk one leg": ["comm.compressor=randk", d],
        "topk+EF one leg": ["comm.compressor=topk", d],
    }


def run(over: list[str], dp: int, steps: int, home: Path) -> dict:
    cfg = load_config(None, MODEL + over + [f"parallel.dp={dp}", f"train.steps={steps}",
                                             f"train.eval_interval={steps}"])
    r = launch(cfg, home=home)
    if r.status != "completed":
        raise RuntimeError(f"{over} at dp={dp}: {r.status}")
    metrics = RunStore.open_home(home).metrics(r.run_id, kind="comm", rank=0)
    legs = {}
    for leg in ("reduce", "broadcast"):
        wire = sum(m.value for m in metrics if m.name == f"{leg}_leg_wire_bytes")
        dense = sum(m.value for m in metrics if m.name == f"{leg}_leg_dense_bytes")
        legs[leg] = (wire, dense)
    losses = [s["loss"] for s in r.steps]
    return {"legs": legs, "wire": r.summary["wire_bytes"], "dense": r.summary["dense_bytes"],
            "train": statistics.mean(losses[-10:]), "val": r.summary["val_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--dp", type=int, nargs="+", default=[2])
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--both-legs-only", action="store_true", help="skip the one-leg reference runs")
    args = ap.parse_args()
    table = {k: v for k, v in methods(args.density).items() if not (args.both_legs_only and "one leg" in k)}
    with tempfile.TemporaryDirectory() as tmp:
        for dp in args.dp:
            results = {name: run(over, dp, args.steps, Path(tmp)) for name, over in table.items()}
            base = results["dense"]
            print(f"\ndp={dp}, {args.steps} steps, density {args.density}, {MODEL[:4]} "
                  f"(load avg {os.getloadavg()[0]:.1f})")
            legs = next((r["legs"] for r in results.values() if r["legs"]["reduce"][1]), None)
            if legs:
                print(f"dense legs (rank 0, summed over the run): reduce {legs['reduce'][1] / 1e6:.3f} MB, "
                      f"broadcast {legs['broadcast'][1] / 1e6:.3f} MB")
            print(f"{'method':18s} {'reduce leg MB':>14s} {'bcast leg MB':>13s} {'leg ratios':>13s} "
                  f"{'wire/dense':>10s} {'train loss':>10s} {'gap':>7s} {'val loss':>9s} {'gap':>7s}")
            for name, r in results.items():
                (rw, rd), (bw, bd) = r["legs"]["reduce"], r["legs"]["broadcast"]
                ratios = f"{rw / rd:.3f}/{bw / bd:.3f}" if rd and bd else "-"
                print(f"{name:18s} {rw / 1e6:14.3f} {bw / 1e6:13.3f} {ratios:>13s} {r['wire'] / r['dense']:10.3f} "
                      f"{r['train']:10.4f} {r['train'] / base['train'] - 1:+7.1%} "
                      f"{r['val']:9.4f} {r['val'] / base['val'] - 1:+7.1%}")


if __name__ == "__main__":
    main()
