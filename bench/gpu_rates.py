"""The simulator's price of `bench/gpu_mfu.py`'s GPT on one H100, with the hardware-fact prior
(tuning/data/kernels.yaml `h100-published`) and with a kernel profile measured by `workbench calibrate --gpu`
(the default: the three H100 runs' medians, which kernels.yaml `h100` and the dgx-h100 preset hold).

    python bench/gpu_rates.py [--profile docs/data/h100_calibrate_2026-11-26/h100.yaml] [--measured-step-s 0.2984]

Runs anywhere (it prices, it does not measure): the profile is the measurement. `--measured-step-s`
(gpu_mfu.py's median step, engine with profilers off) adds each prediction's error beside it.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GPT_1B = {"model": {"layers": 20, "d_model": 2048, "heads": 16, "seq_len": 2048, "vocab": 50304},
          "batch": {"global": 8, "micro": 4}, "precision": "bf16"}  # gpu_mfu.py's GPT, one GPU, flash SDPA
PROFILE = ROOT / "docs" / "data" / "h100_calibrate_2026-11-26" / "h100.yaml"  # the runs' medians


def main(argv: list[str] | None = None) -> int:
    from tuning.sim.hardware import PRESETS, load_cluster
    from tuning.sim.simulator import from_run_config, simulate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, default=PROFILE, help="kernel profile from calibrate --gpu")
    ap.add_argument("--measured-step-s", type=float, default=None, help="gpu_mfu.py's median step (s)")
    args = ap.parse_args(argv)
    cluster = args.profile.with_name(f"{args.profile.stem}-cluster.yaml")
    model, par = from_run_config(GPT_1B)
    error = "  error" if args.measured_step_s else ""
    print(f"{'kernels':28} {'step (s)':>9} {'compute':>9} {'optimizer':>9}{error}")
    published = dataclasses.replace(PRESETS["dgx-h100"], kernels="h100-published")
    for name, spec in (("published (h100-published)", published), (f"measured ({args.profile.name})",
                                                                    load_cluster(cluster))):
        r = simulate(model, spec, par)
        err = f"  {r.iteration_time_s / args.measured_step_s - 1:+.1%}" if args.measured_step_s else ""
        parts = (r.iteration_time_s, r.breakdown["compute"], r.breakdown["optimizer"])
        print(f"{name[:28]:28} " + " ".join(f"{x:9.4f}" for x in parts) + err)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
