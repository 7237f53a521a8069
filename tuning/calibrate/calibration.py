"""Calibrate the simulator on this machine (CPU, gloo) and map engine run configs onto it.

`calibrate_local(world)` measures what the simulator's CPU model needs with micro-benchmarks
only: GEMM rates at the engine's shapes (forward + both backward GEMMs of a linear layer), the
bandwidth of the memory-bound kernels (LayerNorm, GELU, residual add), the AdamW step rate, a
gloo all-reduce alpha-beta fit, and the framework overhead (eager dispatch and autograd) fitted
from tiny in-process training runs of the engine's model (d_model 32, seq 16) that are not in
the validation set. `predict_run(cfg, cluster)` prices an engine `RunConfig` on that profile:
fp32 (4 bytes), one "GPU" per rank, one node. `compare_measured` launches real runs and
returns the simulated-vs-measured table (bench/simulator.py prints it, docs/simulator.md
records it). No parameter is ever fitted to the validation configs.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tuning.calibrate.kernels import (  # noqa: F401  (re-exported: one import path for callers and tests)
    CALIBRATION_HIDDEN, CALIBRATION_TOKENS, OPTIMIZER_BYTES_PER_PARAM, HostProfile, measure_attention,
    measure_linear_gemms, measure_nongemm_bandwidth, measure_optimizer_rate, measure_weight_stream, speed_index)
from tuning.calibrate.links import IN_SITU_WORK_S, measure_allreduce, measure_fsdp_collectives, measure_p2p  # noqa: F401
from tuning.calibrate.runs import (  # noqa: F401
    BASE_OVERRIDES, CHECK_REPEATS, CHECK_STEPS, CHECK_THRESHOLD, OVERHEAD_RUNS, VALIDATION_CONFIGS, check_calibration,
    check_error, check_overrides, check_verdict, layer_growth, measure_overheads, measure_parallel_overheads, measure_rank_overheads, measure_run,
    predict_run)
from tuning.calibrate.share import (  # noqa: F401
    busy_reason, consistent_shares, cpu_share, lockstep_rate, measure_cpu_share, measure_rate_share, rate_share)
from tuning.sim.hardware import ClusterSpec, cpu_profile

if TYPE_CHECKING:
    import pandas as pd


def measure_host(progress: Callable[[str], None] = lambda _: None) -> HostProfile:
    """Run every single-process micro-benchmark (about 10 s on an idle 2-core host); `progress`
    hears the name of each one as it starts."""
    import torch

    load1 = os.getloadavg()[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        progress("GEMMs at the engine's shapes")
        gemm = measure_linear_gemms()
        progress("attention at the engine's shapes")
        attention = measure_attention()
        progress("memory-bound ops")
        nongemm = measure_nongemm_bandwidth()
        progress("optimizer rate (clip + AdamW)")
        optimizer = measure_optimizer_rate()
        progress("weight streaming of few-token linear layers")
        weight = measure_weight_stream()
    finally:
        torch.set_num_threads(threads)
    host = HostProfile(gemm_points=gemm, nongemm_gb_s=nongemm, optimizer_gb_s=optimizer,
                       overheads={}, cpus=len(os.sched_getaffinity(0)), load1=load1, attention_points=attention,
                       weight_gb_s=weight)
    base = _profile(host, world=1, allreduce=(0.0, 1.0), overheads=False)
    progress("framework overhead (tiny runs)")
    host.overheads = measure_overheads(base)
    return host


def _profile(host: HostProfile, *, world: int, allreduce: tuple[float, float], share: float = 1.0,
             overheads: bool = True, rank: dict[str, float] | None = None) -> ClusterSpec:
    # Ranks time-share the cores (with each other and with other users): each rank's compute
    # and host-side work runs at `share` of the single-process rate (measure_rate_share). `rank`
    # adds what a launched multi-rank run costs beyond that (measure_rank_overheads, already at world).
    ovh = {k: v / share for k, v in host.overheads.items()} if overheads else {}
    if overheads and rank:
        ovh["overhead_step_s"] = ovh.get("overhead_step_s", 0.0) + rank.get("overhead_rank_step_s", 0.0)
        ovh["overhead_layer_s"] = ovh.get("overhead_layer_s", 0.0) + rank.get("overhead_rank_layer_s", 0.0)
    return cpu_profile(
        name=f"cpu-local-{world}", gemm_points=[(f, r * share) for f, r in host.gemm_points],
        attention_points=[(f, r * share) for f, r in host.attention_points],
        intra=allreduce, gpus_per_node=world, memory_gb=_memory_gb() / world,
        hbm_gb_s=host.nongemm_gb_s * share, weight_stream_gb_s=host.weight_gb_s * share,
        overheads={**ovh, "optimizer_gb_s": host.optimizer_gb_s * share},
    )


def _check_load(profile: ClusterSpec, host: HostProfile, world: int, share: float) -> ClusterSpec:
    """Measure each rank's real CPU share, record it with the load, warn when the host is busy."""
    import warnings

    measured = measure_cpu_share(world) / max(measure_cpu_share(1), 1e-9)
    even = cpu_share(world, cpus=host.cpus, background=host.load1 - 1.0)  # what a quiet host should give
    reason = busy_reason(load1=host.load1, cpus=host.cpus, measured_share=min(measured, 1.0), model_share=even)
    if reason:
        warnings.warn(f"calibration on a busy machine: {reason}; rerun `workbench calibrate` when it is quiet",
                      RuntimeWarning, stacklevel=3)
    return dataclasses.replace(profile, calibration_load1=host.load1, calibration_cpu_share=min(measured, 1.0))


def _memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError):
        return 8.0


def calibrate_local(world: int, *, host: HostProfile | None = None,
                    allreduce: tuple[float, float] | None = None, share: float | None = None,
                    parallel: bool = True, progress: Callable[[str], None] = lambda _: None) -> ClusterSpec:
    """A `cpu-local-{world}` profile: `world` ranks ("GPUs") on this one node, fp32 rates.

    Measures what is not given: the host (`measure_host`) and the gloo all-reduce at `world`
    ranks (`measure_allreduce`; unused at world 1). The compute share per rank is measured with
    `world` processes running the engine's kernel mix together (`measure_rate_share`); tiny launched
    data-parallel runs add the multi-rank per-step and per-layer host time (`measure_rank_overheads`).
    """
    if world < 1:
        raise ValueError(f"world={world} must be >= 1")
    host = host or measure_host(progress)  # `progress` hears each measurement's name as it starts
    if allreduce is None and world > 1:
        progress(f"gloo all-reduce at {world} ranks")
    if allreduce is None:
        allreduce = measure_allreduce(world) if world > 1 else (0.0, 1.0)
    if share is None:
        share = _measured_share(host, world, progress)
    profile = _profile(host, world=world, allreduce=allreduce, share=share)
    if world > 1 and parallel:
        if world not in host.rank_overheads:
            progress(f"multi-rank step overhead (tiny {world}-rank runs)")
            host.rank_overheads[world] = measure_rank_overheads(profile, world)
        profile = _profile(host, world=world, allreduce=allreduce, share=share, rank=host.rank_overheads[world])
    profile = _check_load(profile, host, world, share)
    if world == 1 or not parallel:
        return profile
    if host.parallel is None:  # measured once at 2 ranks, scaled to `world` by the CPU share
        two_ar = allreduce if world == 2 else measure_allreduce(2)
        two_share_ = _measured_share(host, 2, progress)
        if 2 not in host.rank_overheads:
            progress("multi-rank step overhead (tiny 2-rank runs)")
            host.rank_overheads[2] = measure_rank_overheads(_profile(host, world=2, allreduce=two_ar,
                                                                     share=two_share_), 2)
        two = _profile(host, world=2, allreduce=two_ar, share=two_share_, rank=host.rank_overheads[2])
        two = dataclasses.replace(two, **_fsdp_links(host, 2, progress))
        progress("tensor-parallel and FSDP dispatch, pipeline sends (2-rank runs)")
        host.parallel = {**measure_parallel_overheads(two), "share": two_share_}
        host.p2p = measure_p2p()
    scale = host.parallel["share"] / share
    return dataclasses.replace(
        profile, **_fsdp_links(host, world, progress), overhead_tp_layer_s=host.parallel["overhead_tp_layer_s"] * scale,
        overhead_fsdp_layer_s=host.parallel["overhead_fsdp_layer_s"] * scale,
        p2p_latency_s=host.p2p[0], p2p_bw_gb_s=host.p2p[1] * share)


def _fsdp_links(host: HostProfile, world: int, progress: Callable[[str], None]) -> dict[str, float]:
    """FSDP's all-gather and reduce-scatter alpha-beta at `world` ranks, measured once per host profile."""
    if world not in host.fsdp_links:
        progress(f"gloo all-gather and reduce-scatter at {world} ranks")
        host.fsdp_links[world] = measure_fsdp_collectives(world)
    return host.fsdp_links[world]


def _measured_share(host: HostProfile, world: int, progress: Callable[[str], None]) -> float:
    """The per-rank compute share at `world` ranks, measured once per host profile (1.0 at one rank),
    made consistent with the shares measured at the profile's other world sizes (`consistent_shares`)."""
    if world not in host.shares:
        if world > 1:
            progress(f"per-rank compute share ({world} processes together)")
        host.shares[world] = measure_rate_share(world)
    return consistent_shares(host.shares)[world]


def two_share(host: HostProfile) -> float:
    return cpu_share(2, cpus=host.cpus, background=host.load1 - 1.0)


def compare_measured(configs: dict[str, list[str]] | None = None, *, rounds: int = 2,
                     host: HostProfile | None = None,
                     on_row: Callable[[dict[str, Any]], None] | None = None) -> pd.DataFrame:
    """Simulated vs measured step time of engine configs on this machine.

    Calibrates first (host micro-benchmarks, then per world size the CPU share and the gloo
    all-reduce), then launches every config `rounds` times, interleaved (round 1 of every
    config, then round 2, ...) so slow phases of a shared machine spread over all of them.
    Columns: config, world, measured_s (median over rounds of each run's median steady step),
    simulated_s, error_pct ((sim - meas) / meas), load1 (mean 1-min load during its runs), speed
    (median `speed_index` taken just before its runs) and error_at_speed_pct (the error of
    simulated_s / speed: the model's error with the host's drift since calibration taken out).
    `table.attrs` holds the host profile, the cluster profile per world size and every run.
    """
    import pandas as pd

    from engine.config.schema import load_config

    configs = configs or VALIDATION_CONFIGS
    cfgs = {name: load_config(None, BASE_OVERRIDES + ov) for name, ov in configs.items()}
    host = host or measure_host()
    worlds = sorted({c.world_size for c in cfgs.values()})
    for w in worlds:  # every share first, so each world's is consistent with the others' (consistent_shares)
        _measured_share(host, w, lambda _: None)
    clusters = {w: calibrate_local(w, host=host) for w in worlds}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cfgs}
    for _ in range(rounds):
        for name, cfg in cfgs.items():
            speed = speed_index(host)
            runs[name].append({**measure_run(cfg), "speed": speed})
            if on_row is not None:
                on_row({"config": name, **runs[name][-1]})
    rows = []
    for name, cfg in cfgs.items():
        measured = statistics.median(r["step_time_s"] for r in runs[name])
        simulated = predict_run(cfg, clusters[cfg.world_size]).iteration_time_s
        speed = statistics.median(r["speed"] for r in runs[name])
        rows.append({"config": name, "world": cfg.world_size, "measured_s": measured,
                     "simulated_s": simulated, "error_pct": 100.0 * (simulated - measured) / measured,
                     "load1": statistics.mean(r["load1"] for r in runs[name]), "speed": speed,
                     "error_at_speed_pct": 100.0 * (simulated / speed - measured) / measured})
    table = pd.DataFrame(rows)
    table.attrs.update(host=host, clusters=clusters, runs=runs)
    return table


__all__ = [  # the orchestration here, and the measurements it composes (re-exported: one import path)
    "BASE_OVERRIDES", "CALIBRATION_HIDDEN", "CALIBRATION_TOKENS", "CHECK_REPEATS", "CHECK_STEPS", "CHECK_THRESHOLD",
    "HostProfile", "check_verdict",
    "IN_SITU_WORK_S", "OPTIMIZER_BYTES_PER_PARAM", "OVERHEAD_RUNS", "VALIDATION_CONFIGS", "busy_reason", "calibrate_local",
    "check_calibration", "check_error", "check_overrides", "compare_measured", "consistent_shares", "cpu_share",
    "layer_growth", "lockstep_rate", "measure_allreduce", "measure_attention", "measure_cpu_share", "measure_fsdp_collectives",
    "measure_host", "measure_linear_gemms", "measure_nongemm_bandwidth", "measure_optimizer_rate", "measure_overheads",
    "measure_p2p", "measure_parallel_overheads", "measure_rank_overheads", "measure_rate_share", "measure_run",
    "measure_weight_stream", "predict_run", "rate_share", "speed_index", "two_share",
]
