"""Recording of functional collectives (DTensor: tensor and sequence parallel, redistributions).

DTensor issues its collectives as ``torch.ops._c10d_functional`` ops: ``all_reduce`` returns at
once with a tensor whose work is in flight, and ``wait_tensor`` on that tensor (DTensor's
``AsyncCollectiveTensor`` calls it before the first use) blocks until it is done. Each op is
recorded from issue to its ``wait_tensor``, with the nccl-tests bytes (all-gather: the output,
reduce-scatter and all-reduce: the input) and the group from its ``group_name`` argument.

Seam: the op packets on the ``torch.ops._c10d_functional`` namespace are replaced by timing
stand-ins, so every Python caller (funcol, DTensor placements, their backward functions) is
seen and nothing runs for other ops. Not a TorchDispatchMode: that costs a Python call on
every aten op (measured here: ~20 us per op, ~1,100 ops per tiny-GPT step), and
`torch.distributed.tensor.debug.CommDebugMode` counts collectives but times none. Calls made
from C++ (compiled graphs) are not seen.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from profilers.bandwidth import tensor_bytes  # the bytes of a tensor or a list of them, defined once

log = logging.getLogger(__name__)

# op -> (nccl-tests op, index of group_name, index of group_size or None, bytes x group_size)
OPS: dict[str, tuple[str, int, int | None, bool]] = {
    "all_reduce": ("all_reduce", 2, None, False),
    "all_reduce_": ("all_reduce", 2, None, False),
    "all_reduce_coalesced": ("all_reduce", 2, None, False),
    "all_gather_into_tensor": ("all_gather", 2, 1, True),
    "all_gather_into_tensor_coalesced": ("all_gather", 2, 1, True),
    "reduce_scatter_tensor": ("reduce_scatter", 3, 2, False),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 3, 2, False),
    "all_to_all_single": ("all_to_all", 3, None, False),
    "broadcast": ("broadcast", 2, None, False),
}
"""The ``_c10d_functional`` ops recorded (schemas of torch 2.6-2.13)."""

AUTOGRAD_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
"""The same ops under ``_c10d_functional_autograd`` (funcol's ``*_autograd`` variants)."""


def resolve_group(group: Any) -> Any:
    """The ProcessGroup of a group given as a ProcessGroup or its name (names are reused after a
    re-initialisation, so they are resolved at every call: one dictionary lookup in c10d)."""
    if not isinstance(group, str):
        return group
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group)


def _group_size(group: Any) -> int:
    return resolve_group(group).size()


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in _tensors(v)] if isinstance(value, (list, tuple)) else []


class _InFlight:
    """Issued functional collectives by the address of their output, until its ``wait_tensor``.

    By address, not by tensor object: DTensor waits on an alias of the output (a new Python
    object over the same memory) when autograd records the forward."""

    def __init__(self) -> None:
        self._by_ptr: dict[int, tuple[Any, Any, float, Any]] = {}
        self._lock = threading.Lock()

    def add(self, outputs: list[torch.Tensor], entry: tuple[Any, Any, float, Any]) -> None:
        with self._lock:
            if len(self._by_ptr) > 4096:  # results dropped without a wait: forget them
                self._by_ptr.clear()
            for t in outputs[:1]:  # coalesced ops: the first output's wait ends the call
                if t.numel():
                    self._by_ptr[t.data_ptr()] = entry

    def pop(self, tensor: torch.Tensor) -> tuple[Any, Any, float, Any] | None:
        if not tensor.numel():
            return None
        with self._lock:
            return self._by_ptr.pop(tensor.data_ptr(), None)


_IN_FLIGHT = _InFlight()


class OpProxy:
    """Stands in for one op packet of a ``torch.ops`` namespace: subclasses define ``__call__``;
    everything else (``.default``, schema, hashing, equality) is the packet's."""

    def __init__(self, name: str, packet: Any) -> None:
        self._name, self._packet = name, packet

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._packet, attr)

    def __eq__(self, other: object) -> bool:
        return other is self or self._packet == other

    def __hash__(self) -> int:
        return hash(self._packet)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._packet!r})"


class TimedOp(OpProxy):
    """Records calls of its op packet (``torch.ops._c10d_functional``) made while a profiler is
    active."""

    def __init__(self, name: str, packet: Any, active: Callable[[], Any]) -> None:
        super().__init__(name, packet)
        self._active = active

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        profiler = self._active()
        if profiler is None:
            return self._packet(*args, **kwargs)
        if self._name == "wait_tensor":
            return _wait(self._packet, args, kwargs)
        try:
            op, name_at, size_at, times_size = OPS[self._name]
            group = args[name_at]
            group_size = args[size_at] if size_at is not None else _group_size(group)
            nbytes = tensor_bytes(args[0]) * (group_size if times_size else 1)
            call = profiler.call(op, nbytes, group_size, group, functional=True)
            start, pending = profiler.begin(call, next(iter(_tensors(args[0])), None))
        except Exception as exc:  # never let profiling break a collective
            log.debug("functional collective %s not recorded: %s", self._name, exc)
            return self._packet(*args, **kwargs)
        out = self._packet(*args, **kwargs)
        if _is_fake(out):  # a dry run (FakeTensorMode): nothing to wait for, no address to key the wait by
            profiler.end(call, start, pending)
            return out
        _IN_FLIGHT.add(_tensors(out), (profiler, call, start, pending))
        return out


def _is_fake(value: Any) -> bool:
    """Whether `value` holds torch's fake tensors (shapes without storage, `FakeTensorMode`)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(t, FakeTensor) for t in _tensors(value)[:1])


def _wait(packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensor = args[0] if args else kwargs.get("tensor")
    out = packet(*args, **kwargs)
    entry = _IN_FLIGHT.pop(tensor) if isinstance(tensor, torch.Tensor) and not _is_fake(tensor) else None
    if entry is not None:
        profiler, call, start, pending = entry
        profiler.end(call, start, pending)
    return out


def install(originals: dict[tuple[Any, str], Any], active: Callable[[], Any]) -> None:
    """Replace the op packets; ``originals[(namespace, name)]`` gets each replaced packet."""
    namespaces = [(torch.ops._c10d_functional, (*OPS, "wait_tensor")),
                  (torch.ops._c10d_functional_autograd, AUTOGRAD_OPS)]
    for namespace, names in namespaces:
        for name in names:
            try:
                packet = getattr(namespace, name)
            except (AttributeError, RuntimeError):  # an op this torch does not have
                continue
            if isinstance(packet, TimedOp):
                continue
            originals[(namespace, name)] = packet
            setattr(namespace, name, TimedOp(name, packet, active))
