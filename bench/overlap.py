"""CO2 under an emulated 1 Gbps link: step time vs no communication at all, and vs plain DDP.

Three runs of the same model at dp=2, repeated in alternating order (medians):
- no communication: CO2 with tau longer than the run (each rank trains locally, never syncs);
- CO2 (tau 8): the outer all-reduce of parameter deltas overlaps the next tau local steps;
- plain DDP: the gradient all-reduce every step, overlapped with backward bucket by bucket.
Targets: CO2 <= 1.15x no-communication; DDP >= 1.5x CO2.

    python bench/overlap.py [--steps 24] [--repeats 2] [--gbps 1]
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

# a wide, shallow model with a small batch: gradients are big next to the compute, as on a
# slow cluster link
MODEL = ["model.layers=2", "model.d_model=512", "model.heads=8", "model.seq_len=32", "batch.global=8",
         "batch.micro=4", "parallel.dp=2", "train.warmup_steps=0", "profile.host_interval_s=0",
         "profile.nvml_interval_s=0", "train.timeout_s=600"]


def configs(steps: int, gbps: float) -> dict[str, list[str]]:
    link = [f"link.gbps={gbps}", "link.latency_us=50"]
    return {"no communication": ["co2.enabled=true", f"co2.tau={10 * steps}"] + link,
            "co2 tau8": ["co2.enabled=true", "co2.tau=8"] + link,
            "plain ddp": link}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gbps", type=float, default=1.0)
    args = ap.parse_args()
    runs = configs(args.steps, args.gbps)
    times: dict[str, list[float]] = {k: [] for k in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for name in (runs if rep % 2 == 0 else reversed(list(runs))):
                cfg = load_config(None, MODEL + runs[name] + [f"train.steps={args.steps}", "profile.warmup_steps=2"])
                times[name].append(launch(cfg, home=Path(tmp)).summary["step_time_s"])
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"dp=2, emulated {args.gbps} Gbps link, {args.steps} steps x {args.repeats} (load avg {os.getloadavg()[0]:.1f})")
    for name, t in med.items():
        print(f"{name:18s} {t * 1000:8.1f} ms/step")
    print(f"CO2 / no communication: {med['co2 tau8'] / med['no communication']:.3f}  (target <= 1.15)")
    print(f"plain DDP / CO2:        {med['plain ddp'] / med['co2 tau8']:.3f}  (target >= 1.5)")


if __name__ == "__main__":
    main()
