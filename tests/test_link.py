"""Alpha-beta link emulation: delay math, non-blocking hook wrapper, explicit collectives, DDP."""

from __future__ import annotations

import time

import pytest
import torch
from parallel_harness import run_ranks

from engine.comm.compress import apply_compression
from engine.comm.link import LinkEmulator, bus_factor


def test_bus_factors() -> None:
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_gather", 4) == 0.75
    assert bus_factor("reduce_scatter", 8) == 7 / 8
    assert bus_factor("broadcast", 4) == 1.0
    assert bus_factor("send", 2) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError, match="unknown collective 'gather_all'"):
        bus_factor("gather_all", 2)


def test_delay_math() -> None:
    link = LinkEmulator(gbps=1.0, latency_us=50.0)
    assert link.bytes_per_s == 125e6
    # 4 MB of gradients at 1 Gbps, 2 ranks: 4e6 x 1 / 125e6 = 32 ms (+ 50 us): tens of ms
    assert link.delay_for("all_reduce", 4e6, 2) == pytest.approx(0.032 + 50e-6)
    assert link.delay_for("all_reduce", 4e6, 4) == pytest.approx(0.048 + 50e-6)
    assert link.delay_for("all_gather", 4e6, 4) == pytest.approx(0.024 + 50e-6)
    assert link.delay_for("all_reduce", 4e6, 1) == 0.0
    assert link.wire_delay(1e6, num_ops=3) == pytest.approx(0.008 + 150e-6)
    fast = LinkEmulator(gbps=800.0)
    assert fast.delay_for("all_reduce", 4e6, 2) == pytest.approx(4e6 / 100e9)


def test_validation_messages() -> None:
    with pytest.raises(ValueError, match=r"link.gbps=0 must be > 0"):
        LinkEmulator(gbps=0)
    with pytest.raises(ValueError, match=r"link.latency_us=-1 must be >= 0"):
        LinkEmulator(gbps=1, latency_us=-1)


class _FakeBucket:
    def __init__(self, numel: int) -> None:
        self._buf = torch.ones(numel)

    def buffer(self) -> torch.Tensor:
        return self._buf

    def index(self) -> int:
        return 0


def _done_hook(_state: object, bucket: _FakeBucket) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer() * 2)
    return fut


class _FakeClock:
    """Stands in for engine.comm.link's `time`: perf_counter reads a counter that only sleep moves,
    so the emulator's arithmetic is checked exactly (the real waits: bench/timing_claims.py)."""

    def __init__(self) -> None:
        self.now, self.slept = 100.0, []

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class _FakeTimer:
    """Records each future's deadline instead of completing it on a thread."""

    def __init__(self) -> None:
        self.pending: list[tuple[float, torch.futures.Future, object]] = []

    def complete_at(self, deadline: float, fut: torch.futures.Future, value: object) -> None:
        self.pending.append((deadline, fut, value))


@pytest.fixture
def clock(monkeypatch) -> tuple[_FakeClock, _FakeTimer]:
    from engine.comm import link as link_mod

    fake, timer = _FakeClock(), _FakeTimer()
    monkeypatch.setattr(link_mod, "time", fake)
    monkeypatch.setattr(link_mod, "_timer", lambda: timer)
    return fake, timer


def test_wrapped_hook_completes_after_delay_without_blocking(clock) -> None:
    fake, timer = clock
    numel = 1000
    link = LinkEmulator(gbps=numel * 4 * 8 / 1e9 / 0.3)  # a 4 kB bucket takes 300 ms
    delay = link.delay_for("all_reduce", numel * 4, 2)
    assert delay == pytest.approx(0.3)
    hook = link.wrap_hook(_done_hook, group_size=2)
    fut = hook(None, _FakeBucket(numel))
    assert not fut.done() and fake.slept == []  # the training thread was not held up
    [(deadline, pending, value)] = timer.pending
    assert deadline == pytest.approx(100.0 + delay) and pending is fut
    fut.set_result(value)
    assert torch.equal(fut.wait(), torch.full((numel,), 2.0))
    # one link: a second bucket issued at once starts when the first is done
    hook(None, _FakeBucket(numel))
    assert timer.pending[1][0] == pytest.approx(100.0 + 2 * delay)


def test_wrapped_hook_custom_cost_and_errors(clock) -> None:
    _, timer = clock
    link = LinkEmulator(gbps=1.0)
    hook = link.wrap_hook(_done_hook, group_size=2, cost=lambda s, b: 0.05)
    hook(None, _FakeBucket(10))
    assert timer.pending[0][0] == pytest.approx(100.05)

    def failing(_s: object, _b: object) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_exception(RuntimeError("boom"))
        return fut

    with pytest.raises(RuntimeError, match="boom"):
        link.wrap_hook(failing, group_size=2)(None, _FakeBucket(10)).wait()


def test_emulated_sleeps_only_the_remainder(clock) -> None:
    fake, _ = clock
    link = LinkEmulator(gbps=8e-3)  # 1 MB/s
    delay = link.delay_for("broadcast", 60_000, 2)  # 60 ms

    def op(seconds: float):
        def run() -> str:
            fake.now += seconds  # the real collective took this long
            return "done"
        return run

    assert link.emulated(op(0.04), op="broadcast", nbytes=60_000, group_size=2) == "done"
    assert fake.slept == [pytest.approx(delay - 0.04)]  # not 40 + 60 ms
    link.emulated(op(0.08), op="broadcast", nbytes=60_000, group_size=2)
    assert len(fake.slept) == 1  # the real op was already slower
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(1)
    link.emulated(fut, op="broadcast", nbytes=60_000, group_size=2, started_at=fake.now - 0.05)
    assert fake.slept[1] == pytest.approx(delay - 0.05)  # 50 of the 60 ms were already spent


# ---- 2-rank gloo DDP ---------------------------------------------------------------------


NUMEL_BYTES = 4 * (32 * 64 + 64 + 64 * 16 + 16)
TARGET = 0.15  # seconds the dense bucket takes on the emulated link


def _link_steps(rank: int, world: int) -> dict:
    link = LinkEmulator(gbps=NUMEL_BYTES * 8 / 1e9 / TARGET)
    times = {}
    for compressor in ("none", "fp16"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
        ddp = torch.nn.parallel.DistributedDataParallel(model)  # one bucket
        state = apply_compression(ddp, compressor, link=link)
        x = torch.randn(4, 32)
        took = []
        for _ in range(2):
            start = time.perf_counter()
            ddp(x).sum().backward()  # DDP waits for the bucket's future at the end of backward
            took.append(time.perf_counter() - start)
        times[compressor] = {"took": took, "wire": state.wire_bytes, "dense": state.dense_bytes}
    return times


@pytest.mark.slow
def test_ddp_step_waits_for_the_emulated_link() -> None:
    for res in run_ranks(2, _link_steps):
        assert min(res["none"]["took"]) >= TARGET
        assert min(res["fp16"]["took"]) >= TARGET / 2  # half the bytes, half the wait
        assert res["fp16"]["wire"] * 2 == res["none"]["wire"]
