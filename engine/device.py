"""Device, backend and peak-FLOP/s lookup."""
from __future__ import annotations

import os

import torch

# Dense 16-bit tensor-core peaks from vendor datasheets (shared/reference/formulas.md); fp32 runs
# on these GPUs use TF32 at half that rate, which we do not assume: MFU is against the bf16 peak.
_GPU_PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def pick_backend(requested: str) -> str:
    """'auto' is nccl when CUDA is usable, gloo otherwise."""
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def pick_device(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def peak_flops(device: torch.device) -> float | None:
    """Peak FLOP/s of one device, or None when unknown (MFU then reads n/a, never a guess).

    WORKBENCH_PEAK_FLOPS overrides, e.g. with the GEMM rate `workbench calibrate` measured on a CPU.
    """
    if os.environ.get("WORKBENCH_PEAK_FLOPS"):
        return float(os.environ["WORKBENCH_PEAK_FLOPS"])
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in _GPU_PEAK_BF16.items():
            if key in name:
                return value
    return None
