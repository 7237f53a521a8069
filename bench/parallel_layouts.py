"""Tokens/s and memory per rank for each layout of one model at world size 4.

Every layout is a real `launch()` of the same model and global batch; memory is what the ranks
measured (model state: params + grads + optimizer, local shards only; peak RSS) next to the
analytic estimate. Ends with the ZeRO-3 vs plain DP model-state ratio at dp=4 (target <= 0.35).

    python bench/parallel_layouts.py [--steps 6]
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

MODEL = ["model.layers=4", "model.d_model=128", "model.heads=4", "model.seq_len=64", "batch.global=16",
         "batch.micro=2", "profile.host_interval_s=0", "profile.nvml_interval_s=0", "train.warmup_steps=0"]
LAYOUTS = {
    "dp4": ["parallel.dp=4"],
    "dp4 zero1": ["parallel.dp=4", "parallel.zero=1"],
    "dp4 zero2": ["parallel.dp=4", "parallel.zero=2"],
    "dp4 zero3": ["parallel.dp=4", "parallel.zero=3"],
    "tp4": ["parallel.tp=4"],
    "pp4 1f1b": ["parallel.pp=4", "parallel.schedule=1f1b"],
    "pp2 interleaved": ["parallel.dp=2", "parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual=2"],
    "dp2 tp2": ["parallel.dp=2", "parallel.tp=2"],
    "dp2 pp2": ["parallel.dp=2", "parallel.pp=2"],
    "tp2 pp2": ["parallel.tp=2", "parallel.pp=2"],
    "dp2 tp2 zero3": ["parallel.dp=2", "parallel.tp=2", "parallel.zero=3"],
}
STATE = ("params(GiB)", "grads(GiB)", "optimizer(GiB)")


def measure(name: str, steps: int, home: Path) -> dict:
    cfg = load_config(None, MODEL + LAYOUTS[name] + [f"train.steps={steps}", f"name={name.replace(' ', '-')}"])
    result = launch(cfg, home=home)
    store = RunStore.open_home(home)
    mem: dict[int, dict[str, float]] = {}
    for rec in store.metrics(result.run_id, kind="memory"):
        mem.setdefault(rec.rank, {})[rec.name] = max(rec.value, mem.get(rec.rank, {}).get(rec.name, 0.0))
    state = [sum(m.get(k, 0.0) for k in STATE) for m in mem.values()]
    estimate = [sum(m.get("estimate_" + k, 0.0) for k in STATE) for m in mem.values()]
    bubble = store.breakdown_table(result.run_id)["bubble"].mean()
    return {"tokens_per_s": result.summary["tokens_per_s"], "state_mib": [s * 1024 for s in state],
            "estimate_mib": [e * 1024 for e in estimate], "bubble_s": bubble,
            "peak_rss_gib": max(m.get("peak_rss(GiB)", 0.0) for m in mem.values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in LAYOUTS:
            rows[name] = measure(name, args.steps, Path(tmp))
    print(f"world 4, {MODEL[:4]}, {args.steps} steps each (load avg {os.getloadavg()[0]:.1f})")
    print(f"{'layout':18s} {'tokens/s':>9s} {'bubble s':>9s} {'model state MiB per rank (measured | estimate)':>48s} {'peak RSS GiB':>12s}")
    for name, r in rows.items():
        state = " ".join(f"{s:6.2f}" for s in r["state_mib"])
        est = " ".join(f"{s:6.2f}" for s in r["estimate_mib"])
        print(f"{name:18s} {r['tokens_per_s']:9.0f} {r['bubble_s']:9.4f} {state:>28s} | {est:<28s} {r['peak_rss_gib']:8.3f}")
    dp = statistics.mean(rows["dp4"]["state_mib"])
    z3 = statistics.mean(rows["dp4 zero3"]["state_mib"])
    print(f"ZeRO-3 / plain DP model state per rank at dp=4: {z3 / dp:.3f}  (target <= 0.35)")


if __name__ == "__main__":
    main()
