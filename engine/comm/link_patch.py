"""Every collective and point-to-point send issued through `torch.distributed` pays the emulated
links it really crosses (`LinkTopology`): the heterogeneous side of link emulation.

`emulate_topology(topology)` replaces the c10d functions (as `profilers.collectives` does, and
below it, so recorded times include the emulated link) with wrappers that:
- collectives (all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, ...): finish no
  earlier than join + `topology.delay_for(op, bytes, ranks of the group)`, where join is when the
  LAST rank of the group issued it (a ring sends nothing before all its members are there; a
  rank that waited for a late peer does not get that wait counted as link time). The ranks
  learn the join time from an 8-byte MAX all_reduce of their issue times (wall clock, shared
  by the ranks of one host) issued just before the real collective (ours: its real cost is part
  of the emulated time, as it runs inside it). A synchronous call sleeps what is left, an
  asynchronous one returns a Work whose `wait()` does;
- send / isend: sleep `topology.p2p_delay(bytes, me, peer)` before the real send is issued, so the
  receiver gets the data no earlier than the slow hop allows (ours: the sender is held for the
  transfer, as a blocking send on that link would be; recv/irecv add nothing).

- functional collectives (DTensor: tensor and sequence parallel), the op packets of
  `torch.ops._c10d_functional`: the issuing call returns no earlier than join + the delay
  (ours: DTensor waits for each result right before its first use, so holding the issue is
  what a slow link costs it).

Left to other layers: DDP's bucket all-reduces (C++ reducer) are delayed by the comm hook
wrapper (`LinkEmulator.wrap_hook`, with `topology.link_for(dp ranks)`), and a Work consumed
through `get_future()` (DDP comm hooks) is not delayed here, so a bucket never pays twice.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from engine.comm.link import Join, LinkTopology
from engine.torch_compat import c10d_functional_ops, default_group
from profilers.bandwidth import tensor_bytes  # the bytes of a tensor or a list of them, defined once
from profilers.collectives import WorkProxy, call_argument
from profilers.functional import OPS, OpProxy, resolve_group

_COLLECTIVES: dict[str, tuple[str, str, int]] = {  # function -> (op, bytes argument, position)
    "all_reduce": ("all_reduce", "tensor", 0), "all_gather": ("all_gather", "tensor_list", 0),
    "all_gather_into_tensor": ("all_gather", "output_tensor", 0),
    "reduce_scatter": ("reduce_scatter", "input_list", 1),
    "reduce_scatter_tensor": ("reduce_scatter", "input", 1), "broadcast": ("broadcast", "tensor", 0),
    "reduce": ("reduce", "tensor", 0), "all_to_all": ("all_to_all", "input_tensor_list", 1),
    "all_to_all_single": ("all_to_all", "input", 1),
}
_SENDS = ("send", "isend")


class _State:
    topology: LinkTopology | None = None
    originals: dict[tuple[Any, str], Callable[..., Any]] = {}
    ranks: dict[str, tuple[int, ...]] = {}


_STATE = _State()
_LOCK = threading.Lock()


def emulate_topology(topology: LinkTopology | None) -> None:
    """Make every later collective and send pay `topology`'s links; None restores torch's functions.

    Install it before anything else wraps torch.distributed (the Trainer does, before its
    CollectiveProfiler), so the profiler's records include the emulated time.
    """
    import torch.distributed.distributed_c10d as c10d

    with _LOCK:
        _STATE.topology = topology
        _STATE.ranks = {}
        if topology is None:
            for (module, name), original in _STATE.originals.items():
                setattr(module, name, original)
            _STATE.originals = {}
            return
        if _STATE.originals:
            return
        for name in (*_COLLECTIVES, *_SENDS):
            original = getattr(c10d, name)
            wrapper = _make_wrapper(name, original)
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    _STATE.originals[(module, name)] = original
                    setattr(module, name, wrapper)
        _install_functional()


def _install_functional() -> None:
    namespace = c10d_functional_ops()
    for name in OPS:
        try:
            packet = getattr(namespace, name)
        except (AttributeError, RuntimeError):  # an op this torch does not have
            continue
        _STATE.originals[(namespace, name)] = packet
        setattr(namespace, name, _DelayedOp(name, packet))


class _DelayedOp(OpProxy):
    """Stands in for one `torch.ops._c10d_functional` op packet: the call returns no earlier than
    join (the last rank's issue) + the emulated delay."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        topology = _STATE.topology
        if topology is None:
            return self._packet(*args, **kwargs)
        start = time.time()
        op, name_at, size_at, times_size = OPS[self._name]
        pg = resolve_group(args[name_at])
        ranks = _group_ranks(pg)
        nbytes = tensor_bytes(args[0]) * (len(ranks) if times_size else 1)
        seconds = topology.delay_for(op, nbytes, ranks)
        joined = Join(start, pg) if seconds > 0 else None
        out = self._packet(*args, **kwargs)
        if joined is not None:
            _sleep_until(joined.time() + seconds)
        return out


def _group_ranks(group: Any) -> tuple[int, ...]:
    """Global ranks of `group` (None: the world), cached by the group's name."""
    pg = group if group is not None else default_group()
    key = pg.group_name
    if key not in _STATE.ranks:
        _STATE.ranks[key] = tuple(dist.get_process_group_ranks(pg))
    return _STATE.ranks[key]


def _make_wrapper(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    import inspect

    params = list(inspect.signature(original).parameters)

    def arg(args: tuple, kwargs: dict, key: str, default: Any = None) -> Any:
        return call_argument(params, args, kwargs, key, default)

    def send_wrapper(*args: Any, **kwargs: Any) -> Any:
        topology = _STATE.topology
        if topology is not None:
            group = arg(args, kwargs, "group")
            dst = arg(args, kwargs, "dst")
            if dst is None:
                dst = dist.get_global_rank(group, arg(args, kwargs, "group_dst"))
            seconds = topology.p2p_delay(tensor_bytes(arg(args, kwargs, "tensor")), dist.get_rank(), dst)
            if seconds > 0:
                time.sleep(seconds)
        return original(*args, **kwargs)

    op, payload, _ = _COLLECTIVES.get(name, ("", "", 0))

    def collective_wrapper(*args: Any, **kwargs: Any) -> Any:
        topology = _STATE.topology
        if topology is None:
            return original(*args, **kwargs)
        start = time.time()
        group = arg(args, kwargs, "group")
        seconds = topology.delay_for(op, tensor_bytes(arg(args, kwargs, payload)), _group_ranks(group))
        if seconds <= 0:
            return original(*args, **kwargs)
        joined = Join(start, group)
        result = original(*args, **kwargs)
        if isinstance(result, dist.Work):
            return _DelayedWork(result, joined, seconds)
        _sleep_until(joined.time() + seconds)
        return result

    wrapper = send_wrapper if name in _SENDS else collective_wrapper
    wrapper.__name__ = name
    wrapper.__doc__ = original.__doc__
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def _sleep_until(deadline: float) -> None:
    """Sleep until wall-clock time `deadline` (time.time(): the clock the ranks exchange)."""
    remaining = deadline - time.time()
    if remaining > 0:
        time.sleep(remaining)


class _DelayedWork(WorkProxy):
    """An asynchronous collective whose `wait()` returns no earlier than join + its emulated link time."""

    def __init__(self, inner: dist.Work, joined: Join, seconds: float) -> None:
        super().__init__(inner)
        self._joined, self._seconds = joined, seconds

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        result = self._inner.wait(*args, **kwargs)
        _sleep_until(self._joined.time() + self._seconds)
        return result

    def is_completed(self) -> bool:
        return (self._inner.is_completed() and self._joined.done()
                and time.time() >= self._joined.time() + self._seconds)
