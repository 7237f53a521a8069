"""How much of a core each rank gets when `world` ranks share this host: busy-loop CPU shares, the
engine's kernel mix run alone and together (`measure_rate_share`), the even-share model and the
verdict on a busy machine; used by `tuning.calibrate.calibration`."""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any


def consistent_shares(shares: Mapping[int, float]) -> dict[int, float]:
    """Measured per-rank shares by world size, each raised to what a larger world's measurement
    implies (ours): `w` ranks on the cores that `v > w` ranks shared get at least the throughput the
    `v` ranks got together, so share(w) >= min(1, v * share(v) / w). One measurement is a ~10 s
    sample of a host whose phases last longer: on a quiet host here 2 ranks measured 0.98, 0.91 and
    0.52 back to back, and a calibration measured 0.55 at 2 ranks beside 0.50 at 4 (4 x 0.50 = 2.0
    cores of throughput, so 2 ranks get 1.0 each); 6 of its 7 world-2 runs were priced too slow."""
    return {w: max(s, min(1.0, max([v * shares[v] / w for v in shares if v > w], default=0.0)))
            for w, s in shares.items()}


def _spin(seconds: float, barrier: Any, out: Any) -> None:
    """Worker of measure_cpu_share: busy-loop for `seconds` of wall time, report (cpu s, wall s)."""
    barrier.wait()
    t0, c0, x = time.perf_counter(), time.process_time(), 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(2000):
            x += 1
    out.put((time.process_time() - c0, time.perf_counter() - t0))


def measure_cpu_share(world: int, *, seconds: float = 0.5) -> float:
    """Median share of a core that each of `world` concurrent busy processes really got.

    CPU time over wall time of `world` processes started together (one in-process at world 1): on
    a quiet 2-core host 1.0 up to 2 processes; under other users' load it drops. Calibration compares
    it with the even-share model (`cpu_share`) and warns when they disagree or the host is busy.
    """
    import multiprocessing as mp

    if world == 1:
        ctx_queue: Any = __import__("queue").Queue()
        _spin(seconds, type("NoBarrier", (), {"wait": staticmethod(lambda: None)})(), ctx_queue)
        cpu, wall = ctx_queue.get()
        return min(1.0, cpu / wall)
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=_spin, args=(seconds, barrier, out)) for _ in range(world)]
    for p in procs:
        p.start()
    shares = [min(1.0, cpu / wall) for cpu, wall in (out.get(timeout=120) for _ in procs)]
    for p in procs:
        p.join(timeout=30)
    return statistics.median(shares)


def _kernel_worker(inbox: Any, out: Any) -> None:
    """Worker of measure_rate_share: the engine's kernel mix (a linear layer's three GEMMs, LayerNorm,
    GELU, an add) on one thread. Each message (loops, start_at) runs it `loops` times from `start_at`
    and reports the (start, end) perf_counter (CLOCK_MONOTONIC: one clock for every process on the host);
    None ends the worker."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    x, w, dy = torch.randn(512, 128), torch.randn(512, 128), torch.randn(512, 512)

    def step() -> None:
        x @ w.T, dy @ w, dy.T @ x, F.layer_norm(dy, (512,)), F.gelu(dy), dy + dy

    for _ in range(3):
        step()  # warm-up
    out.put(None)  # ready
    while (msg := inbox.get()) is not None:
        loops, start_at = msg
        time.sleep(max(0.0, start_at - time.perf_counter()))
        t0 = time.perf_counter()
        for _ in range(loops):
            step()
        out.put((t0, time.perf_counter()))


def lockstep_rate(loops: int, spans: Sequence[tuple[float, float]]) -> float:
    """Rate of ranks that each ran `loops` in their (start, end) spans, as ranks in lockstep see it:
    every rank waits for the last, so the work takes from the first start to the last end. Each rank's
    own window would overstate it: one scheduled late runs alone at the end (seen: 179 against 66-108
    loops/s at 4 ranks on 2 cores, a median share of 0.81 above the cores' 0.5)."""
    return loops / (max(end for _, end in spans) - min(start for start, _ in spans))


def rate_share(alone: Sequence[float], together: Sequence[float], *, world: int, cpus: int) -> float:
    """Throughput share of each concurrent rank: the median over paired repeats of (rate of the ranks
    run together / rate of one process alone just before), at most min(1, cpus / world): `world`
    one-thread ranks cannot get more than the cores. Pairs cancel the host's drift between repeats
    (one process alone ran at 89-204 loops/s within two minutes here). Unlike the even-share model it
    includes what busy loops do not see: cores that are hardware threads of one physical core, shared
    caches and memory bandwidth, and the load of other users at that moment."""
    ratios = [t / a for a, t in zip(alone, together, strict=True)]
    return min(1.0, cpus / world, statistics.median(ratios))


def measure_rate_share(world: int, *, seconds: float = 0.5, repeats: int = 8) -> float:
    """Measured per-rank compute share at `world` ranks (`rate_share`): `world` workers started once;
    in each of `repeats` pairs, one runs the kernel mix alone, then all run it together, timed in
    lockstep (`lockstep_rate`), each a fixed amount of work: about `seconds` alone. 1.0 at world 1."""
    import multiprocessing as mp

    if world == 1:
        return 1.0
    ctx = mp.get_context("spawn")
    inboxes, out = [ctx.Queue() for _ in range(world)], ctx.Queue()
    procs = [ctx.Process(target=_kernel_worker, args=(inbox, out), daemon=True) for inbox in inboxes]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            out.get(timeout=300)

        def rate(ranks: int, loops: int) -> float:
            start_at = time.perf_counter() + 0.05
            for inbox in inboxes[:ranks]:
                inbox.put((loops, start_at))
            return lockstep_rate(loops, [out.get(timeout=300) for _ in range(ranks)])

        loops = max(20, round(rate(1, 30) * seconds))  # size the work on this host's speed
        alone, together = [], []
        for _ in range(repeats):
            alone.append(rate(1, loops))
            together.append(rate(world, loops))
    finally:
        for inbox in inboxes:
            inbox.put(None)
        for p in procs:
            p.join(timeout=30)
    return rate_share(alone, together, world=world, cpus=len(os.sched_getaffinity(0)))


def host_load() -> tuple[float, int]:
    """(1-minute load average, cores this process may use) of this host now."""
    return os.getloadavg()[0], len(os.sched_getaffinity(0))


def check_load_limit(cpus: int) -> float:
    """The load1 below which `workbench calibrate`'s check run is worth its minutes: one runnable task per
    core. Above it the check measured a busy host (issue 65: +290.7% at load 6-16 on 2 cores, after 391 s)."""
    return float(cpus)


def busy_reason(*, load1: float, cpus: int, measured_share: float, model_share: float) -> str | None:
    """Why this host is too busy for a trustworthy calibration, or None.

    Busy: other users' load (the 1-min load minus our own calibration process) above half the
    cores, or the measured per-rank CPU share more than 25% away from the even-share model.
    """
    background = load1 - 1.0
    if background > 0.5 * cpus:
        return (f"load1={load1:.1f} on {cpus} cpus: other processes hold the cores; calibrated rates will "
                f"not match a quiet machine (each rank measured {measured_share:.2f} of a core)")
    if abs(measured_share - model_share) > 0.25 * model_share:
        return (f"each rank got {measured_share:.2f} of its share of a core, the even-share model expects "
                f"{model_share:.2f}: the machine's load changed while calibrating")
    return None


def cpu_share(world: int, *, cpus: int, background: float) -> float:
    """Compute share of each of `world` ranks relative to the single calibration process.

    Runnable tasks share the cores evenly (the Linux CFS ideal): with `background` tasks of
    other users, a process gets min(1, cpus / (background + n)) of a core when n of ours run.
    The host was measured with n = 1, the ranks run with n = world.
    """
    def alone(n: int) -> float:
        return min(1.0, cpus / (max(background, 0.0) + n))

    return alone(world) / alone(1)
