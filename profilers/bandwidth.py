"""What a collective costs on the wire, by the nccl-tests definitions, and the analysis of recorded
collective events (profilers/collectives.py records them; profilers/commbench.py sweeps sizes).

Bandwidths follow nccl-tests (doc/PERFORMANCE.md, see shared/reference/formulas.md):
``algbw = bytes / time`` and ``busbw = algbw x factor`` with, for n ranks, all_reduce 2(n-1)/n;
all_gather, reduce_scatter and all_to_all (n-1)/n, where ``bytes`` is the *total* size (all_gather
output, reduce_scatter input, all_to_all input per rank); broadcast, reduce, send and recv 1. GB/s
here are 1e9 bytes per second, as in nccl-tests.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a collective runs: the dashboard reads these tables without it
    import torch


CANONICAL: dict[str, str] = {
    "all_reduce": "all_reduce", "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "broadcast": "broadcast", "reduce": "reduce",
    "all_to_all": "all_to_all", "all_to_all_single": "all_to_all", "send": "send",
    "recv": "recv", "isend": "send", "irecv": "recv", "sendrecv": "sendrecv",
    "ddp_bucket": "all_reduce",
}


def all_gather_flat(output: torch.Tensor, tensor: torch.Tensor, **kwargs: Any) -> Any:
    """All-gather `tensor` from every rank into the flat `output`: `all_gather_single` where torch has
    it (2.13), else `all_gather_into_tensor` (the same call in older torch: 2.11 here). Looked up per
    call, so the profiler's patch of either one sees it."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, **kwargs)


def reduce_scatter_flat(output: torch.Tensor, tensor: torch.Tensor, **kwargs: Any) -> Any:
    """Reduce the flat `tensor` over the ranks and keep this rank's shard in `output`:
    `reduce_scatter_single` where torch has it (2.13), else `reduce_scatter_tensor` (2.11 here)."""
    import torch.distributed as dist

    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, tensor, **kwargs)


def bus_factor(op: str, n: int) -> float:
    """The nccl-tests bus bandwidth factor of ``op`` over ``n`` ranks (doc/PERFORMANCE.md)."""
    kind = CANONICAL.get(op, op)
    if n < 1:
        raise ValueError(f"group size n={n} must be >= 1")
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if kind in ("broadcast", "reduce", "send", "recv", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}; known: {', '.join(sorted(CANONICAL))}")


def sent_bytes(event: dict[str, Any]) -> float:
    """Bytes one rank put on the wire for a recorded collective: its nccl-tests ``bytes`` times the
    bus factor (on a ring: 2(n-1)/n of an all_reduce buffer, the n-1 other ranks' inputs of an
    all_gather, ...), the unit compression hooks report ``wire_bytes`` in; 0 for a receive."""
    if event["op"] == "recv":
        return 0.0
    return event["bytes"] * bus_factor(event["op"], max(int(event["group_size"]), 1))


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 B/s): bytes / time; 0 for a zero time."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def busbw(op: str, nbytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth in GB/s: ``algbw x bus_factor(op, n)`` (nccl-tests definitions)."""
    return algbw(nbytes, seconds) * bus_factor(op, n)


def tensor_bytes(value: Any) -> int:
    """The bytes of a tensor or a (nested) list of them; 0 for anything else."""
    if hasattr(value, "element_size") and hasattr(value, "numel"):  # a tensor, without importing torch here
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def event_key(event: dict[str, Any]) -> str:
    """``axis:op`` (``tp:all_reduce``) for a labelled group, else the bare op name."""
    axis = event.get("axis")
    return f"{axis}:{event['op']}" if axis else event["op"]


def split_key(key: str) -> tuple[str, str]:
    """(axis, op) of an `event_key`; axis "" for an unlabelled one."""
    axis, _, op = key.rpartition(":")
    return axis, op


def aggregate(events: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per `event_key`: total ``bytes``, ``time(s)`` (sum of durations), ``count``,
    ``busbw(GB/s)`` (bus bytes over total time, i.e. time-weighted) and ``exposed(s)`` (union
    of intervals)."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        groups[event_key(event)].append(event)
    out = {}
    for op, items in groups.items():
        seconds = sum(e["time"] for e in items)
        bus_bytes = sum(e["busbw"] * e["time"] for e in items) * 1e9
        out[op] = {"bytes": float(sum(e["bytes"] for e in items)), "time(s)": seconds,
                   "count": float(len(items)),
                   "busbw(GB/s)": bus_bytes / seconds / 1e9 if seconds > 0 else 0.0,
                   "exposed(s)": union_time(items)}
    return out


def blocking_time(events: Sequence[dict[str, Any]], scope: str) -> float:
    """Seconds of functional collectives issued in ``scope`` (union of issue-to-wait spans).

    DTensor waits for each result before the op that uses it, on the issuing stream: this
    time is on the critical path, i.e. exposed communication, not compute."""
    return union_time([e for e in events if e.get("functional") and e.get("scope") == scope])


def union_time(events: Sequence[dict[str, Any]], start: float | None = None,
               end: float | None = None) -> float:
    """Seconds covered by at least one event's [start, end], optionally clipped to a window
    (e.g. the communication left after backward compute ended: ``union_time(ev, t_bwd)``)."""
    spans = sorted((max(e["start"], start if start is not None else e["start"]),
                    min(e["end"], end if end is not None else e["end"])) for e in events)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            total += (cur_e - cur_s) if cur_e is not None else 0.0
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + ((cur_e - cur_s) if cur_e is not None else 0.0)
