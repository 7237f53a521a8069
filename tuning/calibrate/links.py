"""Gloo collectives of this host timed in situ (after a slice of compute, as in a training step) and
fitted to alpha-beta, for the simulator's CPU profile (`tuning.calibrate.calibration`)."""
from __future__ import annotations

import statistics

from tuning.sim.hardware import fit_alpha_beta


IN_SITU_WORK_S = 0.005  # host compute before each timed collective (`commbench(work_s=...)`)


def measure_allreduce(world: int, *, max_bytes: int = 16 << 20, iters: int = 20, repeats: int = 3,
                      work_s: float = IN_SITU_WORK_S) -> tuple[float, float]:
    """(alpha s, busbw GB/s) of gloo all_reduce over `world` processes (commbench, relative fit).

    Timed in situ: every call follows `work_s` of compute on each rank, as in a training step, and
    the compute's own time is subtracted. Back to back, the ranks stay in lockstep and the gloo
    threads awake; after compute they are not: on this 2-core host a small all-reduce cost 2-4 ms
    in situ against 1-2 ms back to back, and the engine's runs saw about 2 ms per tensor-parallel
    all-reduce and 3.4 ms per FSDP2 collective. The per-size median over `repeats` spawns is fitted
    (each in-situ time is a difference of two noisy loops). `work_s=0`: the back-to-back loop.
    """
    from profilers.bandwidth import bus_factor

    return _fit_in_situ("all_reduce", world, bus_factor("all_reduce", world), max_bytes=max_bytes, iters=iters,
                        repeats=repeats, work_s=work_s)


def measure_p2p(*, max_bytes: int = 4 << 20, iters: int = 20, repeats: int = 3,
                work_s: float = IN_SITU_WORK_S) -> tuple[float, float]:
    """(alpha s, GB/s) of a gloo send/recv between 2 processes: what a pipeline stage boundary costs.
    In situ, as `measure_allreduce` (back to back the alpha came out anywhere in 0.2-2.4 ms)."""
    return _fit_in_situ("sendrecv", 2, 1.0, max_bytes=max_bytes, iters=iters, repeats=repeats, work_s=work_s)


def measure_fsdp_collectives(world: int, *, max_bytes: int = 4 << 20, iters: int = 20, repeats: int = 3,
                             work_s: float = IN_SITU_WORK_S) -> dict[str, float]:
    """FSDP's two collectives at `world` ranks, in situ as `measure_allreduce`: the `ClusterSpec` fields
    (alpha s, busbw GB/s) of all_gather_into_tensor and reduce_scatter_tensor. On gloo they are not the
    all-reduce: at 2 ranks a 1 MB reduce-scatter cost 4.2 ms where the 1 MB all-reduce (twice the bus bytes)
    cost 3.0 ms, and the engine's ZeRO-3 runs recorded about 3.4 ms per FSDP2 collective."""
    from profilers.bandwidth import bus_factor

    out = {}
    for op, key in (("all_gather", "allgather"), ("reduce_scatter", "reduce_scatter")):
        alpha, busbw = _fit_in_situ(op, world, bus_factor(op, world), max_bytes=max_bytes, iters=iters,
                                    repeats=repeats, work_s=work_s)
        out.update({f"{key}_latency_s": alpha, f"{key}_bw_gb_s": busbw})
    return out


def _fit_in_situ(op: str, world: int, factor: float, *, max_bytes: int, iters: int, repeats: int,
                 work_s: float) -> tuple[float, float]:
    """(alpha s, GB/s) of `op` at `world` ranks: the per-size median over `repeats` commbench
    spawns (`work_s` of compute before each call), fitted on relative error."""
    from profilers.commbench import spawn_commbench, sweep_sizes

    samples: dict[int, list[float]] = {}
    for _ in range(repeats):
        for r in spawn_commbench(world, [op], sweep_sizes(4096, max_bytes, 4), iters, work_s=work_s):
            samples.setdefault(r["size"], []).append(r["time(s)"])
    sizes = sorted(samples)
    return fit_alpha_beta(sizes, [max(statistics.median(samples[n]), 1e-5) for n in sizes], factor, relative=True)
