"""Peak FLOP/s of the accelerators we know, by device name: the one table the engine's MFU
(engine/device.py) and the simulator's hardware presets (tuning/sim/hardware.py) read. Torch-free."""
from __future__ import annotations

import re

# Dense (no sparsity) bf16 tensor-core peak per device torch sees, from vendor datasheets; the
# first row whose every pattern is a whole word of the lower-cased device name wins (most specific
# first; words split at spaces and hyphens, so "l4" is not found in "L40", nor "a10" in "A10G").
# fp32 runs use TF32 at half that rate, which we do not assume: MFU is against the bf16 peak.
# A peak of None marks a device we know but have no datasheet figure for: MFU reads n/a.
PEAK_BF16: tuple[tuple[tuple[str, ...], float | None], ...] = (
    (("h200", "nvl"), 836e12),   # nvidia.com/en-us/data-center/h200: H200 NVL 1,671 TFLOPS sparse
    (("h200",), 989e12),         # nvidia.com/en-us/data-center/h200: H200 SXM 1,979 TFLOPS sparse
    (("h100", "nvl"), 835e12),   # nvidia.com/en-us/data-center/h100: H100 NVL 1,671 sparse
    (("h100", "pcie"), 756e12),  # nvidia.com/en-us/data-center/h100: H100 PCIe 1,513 sparse
    (("h100",), 989e12),         # nvidia.com/en-us/data-center/h100: H100 SXM 1,979 sparse
    (("a100",), 312e12),         # nvidia.com/en-us/data-center/a100: 312 dense (SXM and PCIe)
    (("gh200",), 989e12),        # nvidia.com/en-us/data-center/grace-hopper-superchip: 1,979 sparse
    (("l40s",), 362e12),         # nvidia.com/en-us/data-center/l40s: 733 sparse
    (("l40",), 181e12),          # nvidia.com/en-us/data-center/l40: 362.1 sparse
    (("l4",), 121e12),           # nvidia.com/en-us/data-center/l4: 242 sparse
    (("a10g",), None),           # AWS A10G: NVIDIA publishes no tensor-core figure; not the A10
    (("a10",), 125e12),          # nvidia.com/en-us/data-center/products/a10-gpu: 250 sparse
    (("mi300x",), 1307.4e12),    # amd.com Instinct MI300X datasheet: 1,307.4 dense bf16
    (("mi250x",), 191.5e12),     # amd.com MI250X: 383 per package = 2 GCDs; torch sees one GCD
)


def peak_bf16(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a device by its name (`PEAK_BF16`), None when unknown."""
    words = set(re.split(r"[^a-z0-9]+", device_name.lower()))
    for patterns, peak in PEAK_BF16:
        if all(p in words for p in patterns):
            return peak
    return None
