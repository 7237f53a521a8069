"""This GPU's bf16 GEMM and fused-attention rates, and what they do to the simulator's prediction
of `bench/gpu_mfu.py`'s GPT.

    python bench/gpu_rates.py [--measured-step-s 0.3166] [--json rates.json]

Times the engine's linear GEMMs (x W^T, dy W, dy^T x at h x h, h x 4h, 4h x h, h x vocab) and
causal `scaled_dot_product_attention` forward + backward with `tuning.calibrate.calibration`'s probes
(the CPU calibration's own code, here on CUDA in bf16), at d_model 1024-8192 and 512-16384
tokens. Then prices gpu_mfu's 1.1 B GPT (20 layers, d_model 2048, seq 2048, micro 4, global 8,
bf16) on one GPU of the `dgx-h100` preset twice: with the preset's fitted GEMM curve, and with
the measured tables in its place; `--measured-step-s` adds the error of each against a step
time measured by gpu_mfu.py. Without CUDA it exits 2 with a message.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

GPT_1B = {"model": {"layers": 20, "d_model": 2048, "heads": 16, "seq_len": 2048, "vocab": 50304},
          "batch": {"global": 8, "micro": 4}, "precision": "bf16"}


def predict(tables: dict[str, list[tuple[float, float]]] | None) -> float:
    """Iteration seconds of GPT_1B on one GPU of dgx-h100, with `tables` replacing its GEMM curve."""
    from tuning.sim.hardware import PRESETS
    from tuning.sim.simulator import from_run_config, simulate

    cluster = PRESETS["dgx-h100"]
    if tables:
        cluster = dataclasses.replace(cluster, gemm_table=tuple(map(tuple, tables["gemm"])),
                                      attention_table=tuple(map(tuple, tables["attention"])))
    model, par = from_run_config(GPT_1B)
    return simulate(model, cluster, par).iteration_time_s


def measure() -> dict[str, list[tuple[float, float]]]:
    from tuning.calibrate.calibration import measure_attention, measure_linear_gemms

    gemm = measure_linear_gemms(tokens=(512, 2048, 8192, 16384), hiddens=(1024, 2048, 4096, 8192),
                                vocab=50304, device="cuda", dtype="bfloat16")
    attention = measure_attention(hiddens=(1024, 2048, 4096), heads=16, seqs=(512, 1024, 2048, 4096),
                                  batches=(1, 4), max_tokens=16384, device="cuda", dtype="bfloat16")
    return {"gemm": gemm, "attention": attention}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measured-step-s", type=float, default=None, help="gpu_mfu.py's median step (s)")
    ap.add_argument("--json", type=Path, default=None, help="write the measured tables here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu_rates.py needs a CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}); "
              "nothing was measured", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    tables = measure()
    peak = 989e12  # dgx-h100's peak (tuning/sim/hardware.py), for the efficiency column
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, points in tables.items():
        print(f"{name}: FLOPs per GEMM -> TFLOP/s (fraction of 989)")
        for flops, rate in points:
            print(f"  {flops:10.3g}  {rate / 1e12:7.1f}  {rate / peak:6.1%}")
    fitted, measured = predict(None), predict(tables)
    print(f"dgx-h100 prediction of gpu_mfu's GPT: fitted curve {fitted:.4f} s, measured tables {measured:.4f} s")
    if args.measured_step_s:
        for name, value in (("fitted curve", fitted), ("measured tables", measured)):
            print(f"  {name}: error {value / args.measured_step_s - 1:+.1%} against {args.measured_step_s:.4f} s")
    if args.json:
        args.json.write_text(json.dumps(tables))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
