"""The collective profiler: records every collective a rank issues, with its bandwidths by the
nccl-tests definitions (profilers/bandwidth.py; the size sweep is profilers/commbench.py).

`CollectiveProfiler` records every collective issued through ``torch.distributed`` while it
is enabled, by replacing the functions of ``torch.distributed`` with timing wrappers (c10d
calls: DDP compressors, CO2, ZeRO, FSDP2's all-gather and reduce-scatter, pipeline
``batch_isend_irecv`` of ``P2POp(isend/irecv)``). DDP's bucket all-reduces do not go through
Python, so they are recorded by a DDP comm hook (`CollectiveProfiler.allreduce_hook`, or any
hook wrapped by `CollectiveProfiler.wrap_comm_hook`). Functional collectives (DTensor: tensor
and sequence parallel, redistributions) are recorded by `profilers.functional`, which times
the ``torch.ops._c10d_functional`` ops from issue to ``wait_tensor``.

Each event carries the mesh ``axis`` of its process group (`CollectiveProfiler.name_groups`),
so per-step metrics read ``tp:all_reduce/bytes``, ``dp:all_gather/bytes`` (FSDP2),
``pp:send/bytes``; a group without a name keeps the bare op name.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from profilers.bandwidth import CANONICAL, aggregate, algbw, busbw, tensor_bytes

log = logging.getLogger(__name__)

"""torch.distributed function name (or sweep name) -> the nccl-tests op it is costed as."""

PATCHED: tuple[str, ...] = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "send", "recv", "isend", "irecv",
    "all_to_all", "all_to_all_single",
)
"""The torch.distributed functions the profiler wraps (barrier is deliberately left out)."""

# (argument name, position) of the tensor(s) whose size is the nccl-tests "bytes" of each op
_BYTES_ARG: dict[str, tuple[str, int]] = {
    "all_reduce": ("tensor", 0), "all_gather": ("tensor_list", 0),
    "all_gather_into_tensor": ("output_tensor", 0), "all_gather_single": ("output_tensor", 0),
    "reduce_scatter": ("input_list", 1), "reduce_scatter_tensor": ("input", 1),
    "reduce_scatter_single": ("input", 1), "broadcast": ("tensor", 0), "reduce": ("tensor", 0),
    "send": ("tensor", 0), "recv": ("tensor", 0), "isend": ("tensor", 0), "irecv": ("tensor", 0),
    "all_to_all": ("input_tensor_list", 1), "all_to_all_single": ("input", 1),
}
_P2P = ("send", "recv", "isend", "irecv")
_ASYNC_ALWAYS = ("isend", "irecv")


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)) and value:
        return _first_tensor(value[0])
    return None


# Perf_counter for precise intervals, mapped onto Unix time so ranks' records line up.
_PC0, _EPOCH0 = time.perf_counter(), time.time()


def now() -> float:
    """Unix seconds with perf_counter resolution (the clock of every collective record)."""
    return _EPOCH0 + (time.perf_counter() - _PC0)


@dataclass(kw_only=True, slots=True)
class _Call:
    """One collective being recorded: what it is and where it ran."""

    op: str
    nbytes: int
    group_size: int
    axis: str = ""  # mesh axis of its process group ("tp", "dp", "pp"); "" when unnamed
    scope: str = ""  # the trainer's phase when it was issued (see `CollectiveProfiler.scope`)
    functional: bool = False  # a DTensor functional collective, waited on the issuing stream


@dataclass(kw_only=True, slots=True)
class _Pending:
    """A collective whose end is a CUDA event, resolved at `CollectiveProfiler.drain`."""

    call: _Call
    start: float
    start_event: Any
    end_event: Any = None


_local = threading.local()


@contextmanager
def _suppressed() -> Iterator[None]:
    """Inside a recording hook: the collectives it issues are already accounted for."""
    previous = getattr(_local, "suppress", False)
    _local.suppress = True
    try:
        yield
    finally:
        _local.suppress = previous


@dataclass(kw_only=True, slots=True)
class _Patches:
    originals: dict[tuple[Any, str], Callable[..., Any]] = field(default_factory=dict)
    active: CollectiveProfiler | None = None


_PATCHES = _Patches()
_PATCH_LOCK = threading.Lock()


def group_name(group: Any) -> str:
    """The c10d name of a process group (``None``: the default group), or of a group name."""
    if isinstance(group, str):
        return group
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    return group.group_name


class CollectiveProfiler:
    """Records op, bytes, group size, axis, start, end, algbw and busbw of each collective.

    Overhead budget: two clock reads, one dict and a group-size lookup per collective (a few
    microseconds), and one CUDA event pair per collective on GPU; no synchronisation until
    `drain`, which resolves CUDA events once per step. Nothing runs per non-collective op.
    """

    def __init__(self, *, enabled: bool = True) -> None:
        self._done: deque[dict[str, Any]] = deque()
        self._pending: deque[_Pending] = deque()
        self._wire = [0.0, 0.0]
        self._lock = threading.Lock()
        self._in_flight: dict[int, torch.futures.Future] = {}  # async collectives not yet recorded
        self._axes: dict[str, str] = {}
        self._scope = ""
        self._want = enabled
        self.enabled = False
        if enabled:
            self.enable()

    # -- patching ----------------------------------------------------------------------------
    def enable(self) -> None:
        """Install the wrappers in torch.distributed and make this the recording profiler."""
        from profilers import functional

        with _PATCH_LOCK:
            if _PATCHES.active not in (None, self):
                raise RuntimeError("another CollectiveProfiler is enabled in this process; "
                                   "disable it first")
            if not _PATCHES.originals:
                _install()
                functional.install(_PATCHES.originals, lambda: _PATCHES.active)
            _PATCHES.active = self
        self.enabled = True

    def disable(self) -> None:
        """Restore torch.distributed's own functions; recorded events stay until `drain`."""
        with _PATCH_LOCK:
            if _PATCHES.active is self:
                _uninstall()
                _PATCHES.active = None
        self.enabled = False

    def __enter__(self) -> CollectiveProfiler:
        self.enable()
        return self

    def __exit__(self, *exc: object) -> None:
        self.disable()

    # -- labels ------------------------------------------------------------------------------
    def name_groups(self, groups: dict[str, Any]) -> None:
        """Label the collectives of each process group with its mesh axis, e.g.
        ``{"tp": mesh["tp"].get_group()}``; ``None`` stands for the default group."""
        self._axes.update({group_name(g): axis for axis, g in groups.items()})

    def axis_of(self, group: Any) -> str:
        """The axis name given to ``group`` (a ProcessGroup, None or a group name), else ""."""
        try:
            return self._axes.get(group_name(group), "") if self._axes else ""
        except Exception:  # an unusual group object: record the collective unlabelled
            return ""

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Tag the collectives issued inside with ``name`` (e.g. the phase ``"forward"``);
        `blocking_time` sums the functional ones per scope."""
        previous, self._scope = self._scope, name
        try:
            yield
        finally:
            self._scope = previous

    def call(self, op: str, nbytes: int, group_size: int, group: Any, *,
             functional: bool = False) -> _Call:
        """Describe a collective about to be issued (its axis and scope filled in)."""
        return _Call(op=op, nbytes=int(nbytes), group_size=int(group_size),
                     axis=self.axis_of(group), scope=self._scope, functional=functional)

    # -- recording ---------------------------------------------------------------------------
    def _finish(self, call: _Call, start: float, end: float) -> None:
        seconds = max(end - start, 0.0)
        self._done.append({
            "op": call.op, "bytes": call.nbytes, "group_size": call.group_size,
            "axis": call.axis, "scope": call.scope, "functional": call.functional,
            "start": start, "end": end, "time": seconds, "algbw": algbw(call.nbytes, seconds),
            "busbw": busbw(call.op, call.nbytes, seconds, max(call.group_size, 1)),
        })

    def begin(self, call: _Call, tensor: torch.Tensor | None) -> tuple[float, _Pending | None]:
        """Start timing ``call``: a clock read, plus a CUDA event when ``tensor`` is on CUDA."""
        start = now()
        if tensor is not None and tensor.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return start, _Pending(call=call, start=start, start_event=event)
        return start, None

    def end(self, call: _Call, start: float, pending: _Pending | None) -> None:
        """Stop timing ``call`` (on CUDA: an event on the current stream, resolved at drain)."""
        if pending is None:
            self._finish(call, start, now())
            return
        # on the current stream, which the collective's work has been joined to: this event
        # completes when the collective does
        pending.end_event = torch.cuda.Event(enable_timing=True)
        pending.end_event.record()
        self._pending.append(pending)

    def _record_call(self, name: str, original: Callable[..., Any], names: list[str],
                     args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            call, tensor, is_async = self._describe(name, names, args, kwargs)
        except Exception as exc:  # never let profiling break a collective
            log.debug("collective profiler could not describe %s: %s", name, exc)
            return original(*args, **kwargs)
        start, pending = self.begin(call, tensor)
        with _suppressed():  # send() runs isend().wait(): record the outer call only
            result = original(*args, **kwargs)
        if not is_async or result is None:
            self.end(call, start, pending)
            return result
        def _on_done(_: Any = None) -> None:
            self.end(call, start, pending)

        try:
            future = result.get_future()
        except RuntimeError:  # gloo point-to-point works have no future: end at wait()
            return _TimedWork(result, _on_done)
        key = id(future)
        self._in_flight[key] = future

        def _on_future_done(_: Any = None) -> None:
            _on_done()
            self._in_flight.pop(key, None)

        future.add_done_callback(_on_future_done)
        return result

    def _describe(self, name: str, names: list[str], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> tuple[_Call, torch.Tensor | None, bool]:
        def get(arg: str, default: Any = None) -> Any:
            return call_argument(names, args, kwargs, arg, default)

        arg, position = _BYTES_ARG[name]
        payload = kwargs.get(arg, args[position] if position < len(args) else None)
        group = get("group")
        group_size = 2 if name in _P2P else dist.get_world_size(group)
        is_async = name in _ASYNC_ALWAYS or bool(get("async_op", False))
        call = self.call(CANONICAL[name], tensor_bytes(payload), group_size, group)
        return call, _first_tensor(payload), is_async

    def record_wire(self, wire_bytes: float, dense_bytes: float) -> None:
        """A compression hook reports what it put on the wire versus the dense gradient."""
        with self._lock:
            self._wire[0] += wire_bytes
            self._wire[1] += dense_bytes

    # -- DDP comm hooks ----------------------------------------------------------------------
    def allreduce_hook(self) -> Callable[[Any, Any], torch.futures.Future]:
        """A DDP comm hook equal to DDP's default (average by all-reduce) that records it.

        Register with ``ddp.register_comm_hook(process_group_or_None, hook)``.
        """
        def hook(state: Any, bucket: Any) -> torch.futures.Future:
            group = state if isinstance(state, dist.ProcessGroup) else None
            tensor = bucket.buffer()
            n = dist.get_world_size(group)
            call = self.call("all_reduce", tensor.numel() * tensor.element_size(), n, group)
            start, pending = self.begin(call, tensor)
            with _suppressed():
                work = dist.all_reduce(tensor.div_(n), group=group, async_op=True)

            def done(fut: torch.futures.Future) -> torch.Tensor:
                self.end(call, start, pending)
                return fut.value()[0]

            return work.get_future().then(done)

        return _annotated(hook)

    def wrap_comm_hook(self, hook: Callable[[Any, Any], torch.futures.Future]
                       ) -> Callable[[Any, Any], torch.futures.Future]:
        """Wrap any DDP comm hook: records a ``ddp_bucket`` event per bucket (dense bytes,
        hook start to future completion); the collectives it issues are recorded as
        themselves, and a compressor reports its wire bytes through `record_wire`."""
        def wrapped(state: Any, bucket: Any) -> torch.futures.Future:
            tensor = bucket.buffer()
            group = getattr(state, "process_group", state)
            group = group if isinstance(group, dist.ProcessGroup) else None
            n = dist.get_world_size(group)
            call = self.call("ddp_bucket", tensor.numel() * tensor.element_size(), n, group)
            start, pending = self.begin(call, tensor)
            fut = hook(state, bucket)

            def done(f: torch.futures.Future) -> Any:
                self.end(call, start, pending)
                return f.value()

            return fut.then(done)

        wrapped.__name__ = getattr(hook, "__name__", "hook")
        return _annotated(wrapped)

    # -- reading -----------------------------------------------------------------------------
    def _await_completed_callbacks(self, limit_s: float = 1.0) -> None:
        """Wait until every async collective whose future is complete has been recorded: the thread
        that completes a future marks it done before it runs the callbacks, so a caller chained to it
        (DDP's fp16 hook: `.then(decompress)`) may finish its step and drain while that thread is
        still before our record (a solo CI run: one fp16 bucket's all-reduce fell in the next step)."""
        deadline = time.monotonic() + limit_s
        while any(f.done() for f in list(self._in_flight.values())) and time.monotonic() < deadline:
            time.sleep(0.0002)

    def drain(self) -> list[dict[str, Any]]:
        """Every collective completed since the last drain, oldest first.

        Each is ``{op, bytes, group_size, axis, scope, functional, start, end, time, algbw,
        busbw}`` (Unix seconds, seconds, GB/s). CUDA-timed ones are resolved here (one event
        synchronise).
        """
        self._await_completed_callbacks()
        with self._lock:
            while self._pending and self._pending[0].end_event is not None:
                p = self._pending.popleft()
                p.end_event.synchronize()
                seconds = p.start_event.elapsed_time(p.end_event) / 1000.0
                self._finish(p.call, p.start, p.start + seconds)
            count = len(self._done)
            events = [self._done.popleft() for _ in range(count)]
        return sorted(events, key=lambda e: e["start"])

    def drain_wire(self) -> tuple[float, float]:
        """(wire_bytes, dense_bytes) reported by compression hooks since the last call."""
        with self._lock:
            wire, self._wire = self._wire, [0.0, 0.0]
        return wire[0], wire[1]

    def step_metrics(self, events: Sequence[dict[str, Any]] | None = None) -> dict[str, float]:
        """Telemetry values of one step: ``{key}/bytes``, ``{key}/time(s)``, ``{key}/count``,
        ``{key}/busbw(GB/s)`` per `event_key` (``tp:all_reduce``), plus ``wire_bytes`` and
        ``dense_bytes`` when reported. Drains the profiler when ``events`` is not given."""
        events = self.drain() if events is None else events
        out: dict[str, float] = {}
        for op, agg in aggregate(events).items():
            for key in ("bytes", "time(s)", "count", "busbw(GB/s)"):
                out[f"{op}/{key}"] = agg[key]
        wire, dense = self.drain_wire()
        if dense:
            out["wire_bytes"], out["dense_bytes"] = wire, dense
        return out


@contextmanager
def recorded(op: str, nbytes: int, group: Any, *, axis: str | None = None,
             tensor: torch.Tensor | None = None) -> Iterator[None]:
    """Record the block as one ``op`` collective of ``nbytes`` over ``group`` when a profiler is
    enabled (e.g. an all_to_all plus the emulated link's wait); collectives issued inside are not
    recorded again. ``axis`` labels it (default: the group's name); ``tensor`` on CUDA times it
    with events."""
    profiler = _PATCHES.active
    if profiler is None or getattr(_local, "suppress", False):
        yield
        return
    call = profiler.call(CANONICAL[op], nbytes, dist.get_world_size(group), group)
    if axis is not None:
        call.axis = axis
    start, pending = profiler.begin(call, tensor)
    with _suppressed():
        yield
    profiler.end(call, start, pending)


class WorkProxy(dist.Work):
    """A Work standing in for another (``inner``): every method is the inner Work's. Subclasses
    change ``wait`` / ``is_completed`` (`_TimedWork` here, the link emulator's delayed Work)."""

    def __init__(self, inner: dist.Work) -> None:
        super().__init__()
        self._inner = inner

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return self._inner.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return self._inner.source_rank()

    def result(self) -> list[torch.Tensor]:
        return self._inner.result()

    def synchronize(self) -> None:
        self._inner.synchronize()

    def get_future(self) -> torch.futures.Future:
        return self._inner.get_future()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _TimedWork(WorkProxy):
    """A Work without a future (gloo send/recv): the collective ends when ``wait()`` returns."""

    def __init__(self, inner: dist.Work, on_done: Callable[[], None]) -> None:
        super().__init__(inner)
        self._on_done: Callable[[], None] | None = on_done

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        result = self._inner.wait(*args, **kwargs)
        done, self._on_done = self._on_done, None
        if done is not None:
            done()
        return result


def call_argument(names: Sequence[str], args: tuple[Any, ...], kwargs: dict[str, Any], name: str,
                  default: Any = None) -> Any:
    """The value of parameter ``name`` in a call ``f(*args, **kwargs)`` of a function whose
    parameters are ``names`` (``inspect.signature(f).parameters``), else ``default``."""
    if name in kwargs:
        return kwargs[name]
    index = names.index(name) if name in names else len(args)
    return args[index] if index < len(args) else default


def _annotated(hook: Callable[..., Any]) -> Callable[..., Any]:
    """DDP's register_comm_hook checks real annotation objects (postponed ones are strings)."""
    hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                            "return": torch.futures.Future[torch.Tensor]}
    return hook


def _make_wrapper(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    import inspect

    names = list(inspect.signature(original).parameters)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        profiler = _PATCHES.active
        if profiler is None or getattr(_local, "suppress", False):
            return original(*args, **kwargs)
        return profiler._record_call(name, original, names, args, kwargs)

    wrapper.__name__ = name
    wrapper.__doc__ = original.__doc__
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def _install() -> None:
    import torch.distributed.distributed_c10d as c10d

    for name in PATCHED:
        original = getattr(c10d, name, None)
        if original is None:  # e.g. all_gather_single exists only in newer torch
            continue
        wrapper = _make_wrapper(name, original)
        for module in (dist, c10d):
            if getattr(module, name, None) is original:
                _PATCHES.originals[(module, name)] = original
                setattr(module, name, wrapper)


def _uninstall() -> None:
    for (module, name), original in _PATCHES.originals.items():
        setattr(module, name, original)
    _PATCHES.originals.clear()


