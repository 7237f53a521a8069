"""Memory per rank: peak memory of a step and the model-state bytes this rank holds.

On CUDA the peak is ``torch.cuda.max_memory_allocated`` since the last reset (reset per step,
so each step reports its own peak). On CPU there is no resettable allocator peak: the figures
are the current RSS and the process-lifetime peak RSS (``resource.getrusage``).
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from typing import Any

import psutil
import torch

GIB = float(1 << 30)


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def peak_memory(device: torch.device | str = "cpu", *, reset: bool = True) -> dict[str, float]:
    """Memory figures in GiB for telemetry kind ``memory``.

    CUDA: ``peak_allocated(GiB)``, ``peak_reserved(GiB)``, ``allocated(GiB)``; the peak
    counters are reset when ``reset`` (call once per step). CPU: ``rss(GiB)`` and
    ``peak_rss(GiB)`` (lifetime peak; cannot be reset).
    """
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        out = {"peak_allocated(GiB)": torch.cuda.max_memory_allocated(device) / GIB,
               "peak_reserved(GiB)": torch.cuda.max_memory_reserved(device) / GIB,
               "allocated(GiB)": torch.cuda.memory_allocated(device) / GIB}
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return out
    return {"rss(GiB)": psutil.Process().memory_info().rss / GIB,
            "peak_rss(GiB)": _peak_rss_bytes() / GIB}


def local_bytes(tensor: Any) -> int:
    """Bytes this rank holds for ``tensor``: a DTensor counts only its local shard."""
    if tensor is None:
        return 0
    to_local = getattr(tensor, "to_local", None)
    if callable(to_local):
        tensor = to_local()
    if not isinstance(tensor, torch.Tensor):
        return 0
    return tensor.numel() * tensor.element_size()


def _unique(tensors: Iterable[Any]) -> Iterable[Any]:
    seen: set[int] = set()
    for tensor in tensors:
        if tensor is not None and id(tensor) not in seen:
            seen.add(id(tensor))
            yield tensor


def model_state_memory(model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer | None = None) -> dict[str, float]:
    """``params(GiB)``, ``grads(GiB)`` and ``optimizer(GiB)`` actually held by this rank.

    Sharded parameters (FSDP2/ZeRO-3, tensor parallel DTensors) count their local shard; a
    `ZeroRedundancyOptimizer` counts the state of its local optimizer (its shard).
    """
    params = list(_unique(model.parameters()))
    out = {"params(GiB)": sum(local_bytes(p) for p in params) / GIB,
           "grads(GiB)": sum(local_bytes(p.grad) for p in params) / GIB,
           "optimizer(GiB)": 0.0}
    if optimizer is not None:
        inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local shard
        states = (v for state in inner.state.values() for v in state.values())
        out["optimizer(GiB)"] = sum(local_bytes(v) for v in _unique(states)
                                    if isinstance(v, torch.Tensor) and v.dim() > 0) / GIB
    return out
