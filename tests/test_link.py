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


def test_wrapped_hook_completes_after_delay_without_blocking() -> None:
    numel = 1000
    link = LinkEmulator(gbps=numel * 4 * 8 / 1e9 / 0.3)  # a 4 kB bucket takes 300 ms
    delay = link.delay_for("all_reduce", numel * 4, 2)
    assert delay == pytest.approx(0.3)
    hook = link.wrap_hook(_done_hook, group_size=2)
    start = time.perf_counter()
    fut = hook(None, _FakeBucket(numel))
    returned = time.perf_counter() - start
    value = fut.wait()
    total = time.perf_counter() - start
    assert returned < delay / 3  # the training thread was not held up
    assert total >= delay
    assert torch.equal(value, torch.full((numel,), 2.0))


def test_wrapped_hook_custom_cost_and_errors() -> None:
    link = LinkEmulator(gbps=1.0)
    hook = link.wrap_hook(_done_hook, group_size=2, cost=lambda s, b: 0.05)
    start = time.perf_counter()
    hook(None, _FakeBucket(10)).wait()
    assert time.perf_counter() - start >= 0.05

    def failing(_s: object, _b: object) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_exception(RuntimeError("boom"))
        return fut

    with pytest.raises(RuntimeError, match="boom"):
        link.wrap_hook(failing, group_size=2)(None, _FakeBucket(10)).wait()


def test_emulated_sleeps_only_the_remainder() -> None:
    link = LinkEmulator(gbps=8e-3)  # 1 MB/s
    delay = link.delay_for("broadcast", 60_000, 2)  # 60 ms
    start = time.perf_counter()
    out = link.emulated(lambda: time.sleep(0.04) or "done", op="broadcast", nbytes=60_000, group_size=2)
    took = time.perf_counter() - start
    assert out == "done"
    assert delay <= took < delay + 0.035  # not 40 + 60 ms
    start = time.perf_counter()
    link.emulated(lambda: time.sleep(0.08), op="broadcast", nbytes=60_000, group_size=2)
    assert time.perf_counter() - start < 0.08 + 0.035  # the real op was already slower
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(1)
    start = time.perf_counter()
    link.emulated(fut, op="broadcast", nbytes=60_000, group_size=2, started_at=start - 0.05)
    assert 0.005 <= time.perf_counter() - start < 0.045  # 50 of the 60 ms were already spent


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
