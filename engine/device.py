"""Device, backend, process groups and peak FLOP/s: where every tensor and collective goes.

The one answer to "which device, which group": a tensor that enters a collective lives on
`comm_device(group)` (CUDA for an NCCL group, CPU for gloo); a host object (a solved plan,
live knobs, a stop flag) or a host tensor goes through `host_group()`, a CPU-capable group
of all ranks (the world group itself on gloo, a gloo side group next to NCCL).
"""
from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from engine.peaks import peak_bf16

if TYPE_CHECKING:  # torch loads in the functions that use it: a launcher's or a CLI's choice of backend stays light
    import torch

# the device nodes a GPU driver makes on Linux (NVIDIA, WSL2's, ROCm's): without one CUDA cannot be usable
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def gpu_driver_present() -> bool:
    """False only where no GPU can be usable: Linux without any of GPU_DEVICE_NODES (answered without torch,
    whose import costs a `workbench run` or `tune` about 2 s of CPU); elsewhere True, and torch decides."""
    return not sys.platform.startswith("linux") or any(map(os.path.exists, GPU_DEVICE_NODES))


def pick_backend(requested: str) -> str:
    """'auto' is nccl when CUDA is usable, gloo otherwise."""
    if requested != "auto":
        return requested
    if not gpu_driver_present():
        return "gloo"
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def check_ranks_fit_gpus(requested: str, ranks_per_node: int) -> None:
    """Refuse, before any process starts, NCCL ranks this node has no GPU for: NCCL takes one GPU
    per rank and refuses two ranks on one device (on a 1-GPU box rank 1 would ask for cuda:1)."""
    from engine.errors import ConfigError

    if pick_backend(requested) != "nccl":
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if ranks_per_node > gpus:
        chosen = " (auto chose nccl: CUDA is usable)" if requested == "auto" else ""
        raise ConfigError("backend", requested, f"NCCL needs one GPU per rank{chosen}: {ranks_per_node} ranks on "
                                                f"this node, {gpus} GPU(s) visible; use at most {gpus} rank(s) per "
                                                "node, or backend=gloo to run the ranks on the CPU")


def pick_device(backend: str, local_rank: int) -> torch.device:
    """The rank's compute device: its local GPU under NCCL, else the CPU."""
    import torch

    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


# ------------------------------------------------------------------ CUDA allocator
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
# torchtitan's run_train.sh exports expandable segments for every run. Measured here (docs/gpu.md, 2026-11-27):
# `plan`'s pick for Llama-3.2-1B on one H100 (micro 8, 77.5 GiB priced) ran out of memory under the default
# caching allocator with 5.9 GiB reserved but unallocated, and trained with expandable segments at 77.6 GiB peak.
DEFAULT_ALLOC_CONF = "expandable_segments:True"


def cuda_alloc_conf(environ: Mapping[str, str] = os.environ) -> str:
    """The CUDA caching allocator's settings every rank runs with: the user's PYTORCH_CUDA_ALLOC_CONF if set,
    else expandable segments (what `plan`'s memory figures assume: no blocks stranded by fragmentation)."""
    return environ.get(ALLOC_CONF) or DEFAULT_ALLOC_CONF


def use_default_cuda_allocator() -> None:
    """Give this process `cuda_alloc_conf()` before CUDA allocates (ranks an outside torchrun starts, benches)."""
    os.environ[ALLOC_CONF] = cuda_alloc_conf()


# ------------------------------------------------------------------ process groups
_HOST: dict[str, Any] = {}


def init_distributed(backend: str, *, rank: int, world_size: int, timeout_s: float,
                     device: torch.device | None = None) -> None:
    """The world process group on `backend`, and the host group next to it (`init_host_group`)."""
    kwargs: dict[str, Any] = {}
    if backend == "nccl" and device is not None and device.type == "cuda":
        kwargs["device_id"] = device  # NCCL binds the communicator to this rank's GPU eagerly
    import torch.distributed as dist

    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    init_host_group(timeout_s=timeout_s)


def init_host_group(*, side: bool | None = None, timeout_s: float | None = None) -> Any:
    """The CPU-capable group of all ranks for host objects, created once per world; every rank
    calls it (the Trainer does, so a world started without `init_distributed` gets one too).

    `side=None` makes a gloo side group only where the world group cannot carry CPU tensors
    (NCCL); `side=True` always does (the device-discipline test uses it to tell the groups apart).
    """
    import torch.distributed as dist

    if _current_host() is not None:
        return _current_host()
    if side is None:
        side = dist.get_backend() != "gloo"
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    group = dist.new_group(backend="gloo", timeout=timeout) if side else dist.group.WORLD
    _HOST.update(group=group, world=dist.group.WORLD)
    return group


def host_group() -> Any:
    """The group for host objects and host tensors (see the module docstring)."""
    import torch.distributed as dist

    if _current_host() is not None:
        return _current_host()
    if dist.get_backend() == "gloo":
        return dist.group.WORLD  # gloo carries CPU tensors: the world group serves the host too
    raise RuntimeError("no host group: start ranks with engine.device.init_distributed, "
                       "or call init_host_group() on every rank after init_process_group")


def _current_host() -> Any:
    """The host group made for the current world, or None (none yet, or made for an old world)."""
    import torch.distributed as dist

    world = dist.group.WORLD
    return _HOST["group"] if world is not None and _HOST.get("world") is world else None


def comm_device(group: Any = None) -> torch.device:
    """The device a tensor must live on to enter `group`'s collectives."""
    import torch
    import torch.distributed as dist

    if group is not None and group is _current_host():
        return torch.device("cpu")
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ------------------------------------------------------------------ peak FLOP/s
def peak_flops(device: torch.device) -> float | None:
    """Peak FLOP/s of one device, or None when unknown (MFU then reads n/a, never a guess).

    WORKBENCH_PEAK_FLOPS overrides, e.g. with the GEMM rate `workbench calibrate` measured on a CPU.
    """
    if os.environ.get("WORKBENCH_PEAK_FLOPS"):
        return float(os.environ["WORKBENCH_PEAK_FLOPS"])
    if device.type == "cuda":
        import torch

        return peak_bf16(torch.cuda.get_device_name(device))
    return None
