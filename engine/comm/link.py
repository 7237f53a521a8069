"""Alpha-beta emulation of a slower link, so one machine can show how a run behaves on one.

time(op, bytes) = latency + bytes x bus_factor(op, n) / bandwidth (alpha-beta model with the
nccl-tests bus factors, /work/shared/reference/formulas.md). The emulator only ever adds
waiting: a collective that already took longer than the model says is not delayed further.
"""

import heapq
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from engine.device import comm_device
from engine.torch_compat import default_group, rank_not_in_group
from profilers.bandwidth import bus_factor  # the one definition (nccl-tests); re-exported here

HookFn = Callable[[Any, dist.GradBucket], torch.futures.Future]
CostFn = Callable[[Any, dist.GradBucket], float]

@dataclass(kw_only=True, slots=True, frozen=True)
class LinkEmulator:
    """A link of `gbps` gigabits per second and `latency_us` microseconds per collective."""

    gbps: float
    """Bus bandwidth of the emulated link in Gbit/s (1 Gbit = 1e9 bits)."""
    latency_us: float = 0.0
    """Fixed cost (alpha) per collective in microseconds."""

    def __post_init__(self) -> None:
        if self.gbps <= 0:
            raise ValueError(f"link.gbps={self.gbps} must be > 0; e.g. 1, 10, 80 or 800")
        if self.latency_us < 0:
            raise ValueError(f"link.latency_us={self.latency_us} must be >= 0")

    @property
    def bytes_per_s(self) -> float:
        """Bandwidth in bytes per second."""
        return self.gbps * 1e9 / 8.0

    def delay_for(self, op: str, nbytes: float, group_size: int) -> float:
        """Seconds `op` on a buffer of `nbytes` takes over this link among `group_size` ranks."""
        if group_size <= 1:
            return 0.0
        return self.latency_us * 1e-6 + nbytes * bus_factor(op, group_size) / self.bytes_per_s

    def wire_delay(self, wire_bytes: float, num_ops: int = 1) -> float:
        """Seconds for `num_ops` collectives that put `wire_bytes` (bus factors applied) on the link."""
        if wire_bytes <= 0 and num_ops <= 0:
            return 0.0
        return num_ops * self.latency_us * 1e-6 + wire_bytes / self.bytes_per_s

    def wrap_hook(self, hook: HookFn, *, group_size: int, cost: CostFn | None = None, group: Any = None) -> HookFn:
        """Wrap a DDP comm hook so each bucket's future completes no earlier than start + delay.

        start: when the last rank of `group` (the dp process group) launched the bucket (`Join`),
        or, without a group, when this rank did.

        The delay runs on a timer thread, so backward keeps going while the "link" is busy, as it
        would on a real slow link. `cost(state, bucket)` gives the delay in seconds once the real
        collective is done (so compressed hooks can report their real wire bytes); by default it
        is a dense fp32-sized all_reduce of the bucket.
        """

        def default_cost(_state: Any, bucket: dist.GradBucket) -> float:
            buf = bucket.buffer()
            return self.delay_for("all_reduce", buf.numel() * buf.element_size(), group_size)

        cost_fn = cost or default_cost
        link_free = [0.0]  # one link: a bucket's transfer starts when the previous one is done
        lock = threading.Lock()

        def emulated_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            start = time.perf_counter()
            join = Join(time.time(), group) if group is not None and group_size > 1 else None
            inner = hook(state, bucket)
            out: torch.futures.Future = torch.futures.Future()

            def on_done(fut: torch.futures.Future) -> None:
                try:
                    value = fut.value()
                    seconds = cost_fn(state, bucket)
                except Exception as exc:  # noqa: BLE001 - forwarded to DDP through the future
                    out.set_exception(exc)
                    return
                joined = start if join is None else start + max(0.0, join.time() - join.start)
                with lock:
                    deadline = max(joined, link_free[0]) + seconds
                    link_free[0] = deadline
                _timer().complete_at(deadline, out, value)

            inner.add_done_callback(on_done)
            return out

        return emulated_hook

    def emulated(
        self,
        work_or_fn: Any,
        *,
        op: str,
        nbytes: float,
        group_size: int,
        started_at: float | None = None,
    ) -> Any:
        """Run (a callable) or wait for (a Work / Future) a collective, then sleep what is left.

        The total time from `started_at` (default: now) is at least `delay_for(op, nbytes, n)`;
        only the time beyond what the real collective took is slept. Returns what the callable
        returned (or the waited object).
        """
        start = time.perf_counter() if started_at is None else started_at
        result = work_or_fn() if callable(work_or_fn) and not _is_waitable(work_or_fn) else work_or_fn
        if _is_waitable(result):
            result.wait()
        remaining = start + self.delay_for(op, nbytes, group_size) - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return result


class Join:
    """When the last rank of `group` (None: the world) issued a collective: the MAX of the ranks'
    issue times `start` (wall clock, time.time(): shared by the ranks of one host), exchanged by
    an 8-byte all_reduce on the process group itself (below torch.distributed's functions, so no
    wrapper, emulated link or profiler sees it). Issue it just before the real collective, in the
    same order on every rank; `time()` waits for it (ours: a ring sends nothing before its last
    member is there, so an emulated link time counts from then).
    """

    def __init__(self, start: float, group: Any = None) -> None:
        self.start = start
        self._work = None
        pg = group if group is not None else default_group()
        self._stamp = torch.tensor([start], dtype=torch.float64, device=comm_device(pg))  # NCCL: CUDA only
        if not rank_not_in_group(pg):
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX
            self._work = pg.allreduce([self._stamp], opts)

    def time(self) -> float:
        """The last rank's issue time (waits for the exchange)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return float(self._stamp.item())

    def done(self) -> bool:
        return self._work is None or self._work.is_completed()


def _is_waitable(obj: Any) -> bool:
    return isinstance(obj, (dist.Work, torch.futures.Future))


class _Timer:
    """One daemon thread that completes futures at their deadlines (earliest first)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, torch.futures.Future, Any]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="link-emulator", daemon=True)
        self._thread.start()

    def complete_at(self, deadline: float, fut: torch.futures.Future, value: Any) -> None:
        if deadline <= time.perf_counter():
            fut.set_result(value)
            return
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._seq), fut, value))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                deadline, _, fut, value = self._heap[0]
                wait = deadline - time.perf_counter()
                if wait > 0:
                    self._cond.wait(timeout=wait)
                    continue
                heapq.heappop(self._heap)
            fut.set_result(value)


_TIMER: _Timer | None = None
_TIMER_LOCK = threading.Lock()


def _timer() -> _Timer:
    global _TIMER
    with _TIMER_LOCK:
        if _TIMER is None:
            _TIMER = _Timer()
        return _TIMER


# ---- heterogeneous links: named rank groups joined by an inter-group link ------------------


@dataclass(kw_only=True, slots=True, frozen=True)
class RankGroup:
    """Ranks that share one NIC type (e.g. an InfiniBand island) and the link between them."""

    name: str
    ranks: tuple[int, ...]
    gbps: float
    latency_us: float = 0.0


@dataclass(kw_only=True, slots=True, frozen=True)
class LinkTopology:
    """Rank groups with their own intra-group link, joined by one inter-group link (Holmes' setting:
    clusters whose NICs differ, joined by Ethernet).

    A collective over a set of ranks runs as one ring (ours, as NCCL builds rings): inside one
    group it runs at that group's link; a ring spanning groups crosses the inter-group link (at
    least twice) and every group it touches, so it runs at the slowest of those hops and pays
    the largest latency. A point-to-point send crosses exactly one hop: the intra-group link of
    its group, or the inter-group link.
    """

    groups: tuple[RankGroup, ...]
    inter_gbps: float
    inter_latency_us: float = 0.0

    def group_of(self, rank: int) -> RankGroup:
        for group in self.groups:
            if rank in group.ranks:
                return group
        raise ValueError(f"rank {rank} is in no link.groups entry ({', '.join(g.name for g in self.groups)})")

    def link_for(self, ranks: Sequence[int]) -> LinkEmulator:
        """The link a ring collective over `ranks` (global ranks) really runs at."""
        touched = {self.group_of(r).name: self.group_of(r) for r in ranks}.values()
        hops = [(g.gbps, g.latency_us) for g in touched]
        if len(hops) > 1:
            hops.append((self.inter_gbps, self.inter_latency_us))
        return LinkEmulator(gbps=min(g for g, _ in hops), latency_us=max(lat for _, lat in hops))

    def delay_for(self, op: str, nbytes: float, ranks: Sequence[int]) -> float:
        """Seconds collective `op` on `nbytes` takes among `ranks` over the links it crosses."""
        return self.link_for(ranks).delay_for(op, nbytes, len(ranks))

    def p2p_delay(self, nbytes: float, src: int, dst: int) -> float:
        """Seconds a send of `nbytes` from `src` to `dst` takes on the one hop between them."""
        if src == dst:
            return 0.0
        return self.link_for((src, dst)).delay_for("send", nbytes, 2)


def topology_of(groups: Sequence[Any], *, inter_gbps: float, inter_latency_us: float = 0.0) -> LinkTopology:
    """A LinkTopology from `link.groups` entries (anything with name, ranks, gbps, latency_us)."""
    return LinkTopology(groups=tuple(RankGroup(name=g.name, ranks=tuple(g.ranks), gbps=g.gbps,
                                               latency_us=g.latency_us) for g in groups),
                        inter_gbps=inter_gbps, inter_latency_us=inter_latency_us)
