"""What bounds a run, and what to try: a short diagnosis from its recorded telemetry (issue 52 item 10).

`diagnose(store, run_id)` reads the run's step-time breakdown per rank (steady steps: the first
tenth, at least one, is warm-up), its collectives and its config, and names what takes the step:
exposed communication (balanced, or one rank waiting far longer: an unbalanced link), a slow rank
(the others wait for it), the pipeline bubble, a memory-bound optimizer step, data loading. Each
finding carries suggestions, each priced for this run:

- basis "simulator": the config change goes through the simulator (tuning/sim/simulator.py) for the run
  as recorded and as changed, on this home's calibrated profile (`workbench calibrate`) or else a
  profile fitted to the run (its compute rate and bus bandwidth). Each simulated part (compute,
  communication, bubble, optimizer) is scaled by the run's measured part over the simulated one, so
  the recorded config prices back to the measured step and the change moves only what the
  simulator says it moves; data loading, which the simulator does not model, is held.
- basis "measured breakdown": what the simulator cannot price (a rank slower than its peers, input
  the ranks wait for) is priced from the breakdown itself: the step if that time were the median
  rank's, or hidden.

Each suggestion is one printed command away: `workbench run <home>/runs/<id>/config.json --set ...`
(the config the launcher wrote), or the command that checks the suspect. Pure analysis: returns
dataclasses; `workbench show` and the Run page render them (STYLE habit 7).
"""
from __future__ import annotations

import shlex
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from profilers.records import PHASES
from profilers.store import RunStore, default_home

EXPOSED_COMM = 0.20  # a rank's share of the step in exposed communication worth a finding
BUBBLE = 0.15
OPTIMIZER = 0.20
DATA = 0.15
SLOW_RANK = 1.25  # a rank computing this much longer than the other ranks' median is slow
SPREAD = 0.20  # exposed-comm shares this far apart between ranks: one rank waits far longer
PARTS = {"compute": ("forward", "backward", "other"), "comm": ("comm_exposed",), "bubble": ("bubble",),
         "optimizer": ("optimizer",)}
"""Measured phases (profilers.records.PHASES) per simulated part; data loading has no simulated part."""


@dataclass(frozen=True, slots=True)
class Suggestion:
    """One thing to try, priced: the step time predicted if it were applied."""

    action: str
    overrides: tuple[str, ...]  # `--set` items for the run's config; empty: no config change
    predicted_step_s: float | None
    predicted_tokens_per_s: float | None
    basis: str  # "simulator" | "measured breakdown"
    command: str


@dataclass(frozen=True, slots=True)
class Finding:
    """One bottleneck: its kind, a sentence with the evidence, the share of the step it takes."""

    kind: str  # exposed_comm | unbalanced_comm | slow_rank | pipeline_bubble | optimizer | data_loading
    headline: str
    share: float
    rank: int | None
    suggestions: tuple[Suggestion, ...] = ()


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """What bounds a run: the measured step, the findings (largest share first) and the pricing profile."""

    run_id: str
    step_s: float
    tokens_per_step: float
    findings: tuple[Finding, ...]
    profile: str
    shares: dict[int, dict[str, float]] = field(default_factory=dict)  # per rank: phase -> share of its step


@dataclass(slots=True)
class _Run:
    run_id: str
    config: dict[str, Any]
    world: int
    phases: pd.DataFrame  # index rank, columns PHASES (mean seconds of the steady steps)
    collectives: dict[str, dict[str, float]]
    busbw: dict[int, float]  # rank -> median bus bandwidth of its busiest collective (GB/s)
    config_path: str

    @property
    def step_s(self) -> float:
        return float(self.phases.sum(axis=1).max())

    @property
    def tokens_per_step(self) -> float:
        batch, model = self.config.get("batch", {}), self.config.get("model", {})
        return float(batch.get("global", 8)) * float(model.get("seq_len", 64))


def diagnose(store: RunStore, run_id: str, *, home: str | Path | None = None,
             collectives: dict[str, dict[str, float]] | None = None) -> Diagnosis | None:
    """The run's diagnosis; None when it has no breakdown to read (no step yet, profiling off).
    ``collectives``: the run's `RunStore.comm_totals` where the caller read them already."""
    run = _read(store, run_id, home, collectives)
    if run is None:
        return None
    shares = {int(r): {p: float(v) / max(float(row.sum()), 1e-12) for p, v in row.items()}
              for r, row in run.phases.iterrows()}
    pricer = _Pricer(run, home)
    findings = [f for f in (_comm(run, shares, pricer), _slow_rank(run, shares), _bubble(run, shares, pricer),
                            _optimizer(run, shares, pricer), _data(run, shares)) if f is not None]
    findings = _root_causes(findings)
    findings.sort(key=lambda f: -f.share)
    return Diagnosis(run_id, run.step_s, run.tokens_per_step, tuple(findings), pricer.profile_name, shares)


def _read(store: RunStore, run_id: str, home: str | Path | None,
          collectives: dict[str, dict[str, float]] | None = None) -> _Run | None:
    info = store.run(run_id)
    steps = store.recorded_steps(run_id, "breakdown")
    if info is None or not steps:
        return None
    steady = steps[max(1, len(steps) // 10):] or steps  # averaged in SQL: the whole table took 0.2 s at 100k records
    phases = store.breakdown_means(run_id, steady[0]).reindex(columns=list(PHASES), fill_value=0.0)
    collectives = store.comm_totals(run_id) if collectives is None else collectives
    root = Path(home) if home is not None else (Path(store.path).parent if isinstance(store.path, Path)
                                                else default_home())
    return _Run(run_id, info.get("config") or {}, int(info.get("world_size") or len(phases)), phases.fillna(0.0),
                collectives, _median_busbw(store, run_id, list(collectives)),
                str(root / "runs" / run_id / "config.json"))


def _median_busbw(store: RunStore, run_id: str, ops: Sequence[str]) -> dict[int, float]:
    """Rank -> median bus bandwidth (GB/s) of the collective with the most records (read by name: the
    whole run's collectives took 0.07 s at 100k records)."""
    per_op = [store.metrics(run_id, kind="comm", name=f"{op}/busbw(GB/s)") for op in ops]
    if not any(per_op):
        return {}
    values: dict[int, list[float]] = {}
    for rec in max(per_op, key=len):
        values.setdefault(int(rec.rank), []).append(float(rec.value))
    return {rank: statistics.median(v) for rank, v in sorted(values.items())}


def _command(run: _Run, overrides: Sequence[str]) -> str:
    sets = "".join(f" --set {shlex.quote(o)}" for o in overrides)
    return f"workbench run {shlex.quote(run.config_path)}{sets}"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _busiest_collective(run: _Run) -> str:
    """The collective that took the most time, as 'dp all_reduce' (axis and op), or 'collectives'."""
    if not run.collectives:
        return "collectives"
    key = max(run.collectives, key=lambda k: run.collectives[k].get("time(s)", 0.0))
    axis, _, op = key.rpartition(":")
    return f"{axis} {op}".strip()


# ---------------------------------------------------------------- pricing
class _Pricer:
    """The simulator's what-if for one run, its parts scaled to the run's measured parts."""

    def __init__(self, run: _Run, home: str | Path | None) -> None:
        self.run = run
        mean = run.phases.mean()
        self.measured = {part: float(sum(mean[p] for p in phases)) for part, phases in PARTS.items()}
        self.held = float(mean["data"])  # the simulator has no data loading: held as measured
        self.cluster, self.profile_name = self._cluster(home)
        base = self._parts(run.config)
        self.scale = {}
        if base is not None:
            general = self.measured["compute"] / base["compute"] if base["compute"] > 0 else 1.0
            self.scale = {part: (self.measured[part] / base[part] if base[part] > 1e-12 else general) for part in PARTS}

    def _cluster(self, home: str | Path | None) -> tuple[Any, str]:
        from tuning.warmstart import local_profile

        try:
            profile = local_profile(self.run.world, home)
        except (OSError, ValueError, KeyError):
            profile = None
        if profile is not None:
            return profile, f"this machine's calibrated profile {profile.name} (workbench calibrate)"
        return self._fitted(), "a profile fitted to this run (its compute rate and bus bandwidth)"

    def _fitted(self) -> Any:
        """A one-node profile whose GEMM rate and link reproduce this run's compute and bandwidth."""
        import psutil

        from tuning.calibrate.calibration import predict_run
        from tuning.sim.hardware import cpu_profile

        def profile(rate: float, bw: float) -> Any:
            return cpu_profile(name="fitted to the run", gemm_points=[(1e3, rate), (1e18, rate)], intra=(2e-5, bw),
                               gpus_per_node=max(self.run.world, 1), memory_gb=psutil.virtual_memory().total / 1e9)

        bw = statistics.median(self.run.busbw.values()) if self.run.busbw else 1.0
        try:
            probe = predict_run(_config(self.run.config, []), profile(1e10, max(bw, 1e-6)))
            flops = probe.flops_per_iteration / max(self.run.world, 1)
            rate = flops / self.measured["compute"] if self.measured["compute"] > 0 else 1e10
        except Exception:  # noqa: BLE001 - a config the simulator cannot price: no simulator prices
            return None
        return profile(max(rate, 1.0), max(bw, 1e-6))

    def _parts(self, config: dict[str, Any]) -> dict[str, float] | None:
        from tuning.calibrate.calibration import predict_run

        if self.cluster is None:
            return None
        try:
            b = predict_run(_config(config, []), self.cluster).breakdown
        except Exception:  # noqa: BLE001 - ValueError / ConfigError: this change cannot be priced here
            return None
        comm = b.get("dp_comm_exposed", 0.0) + b.get("pp_comm", 0.0)
        compute = sum(v for k, v in b.items() if k not in ("dp_comm_exposed", "pp_comm", "bubble", "optimizer"))
        return {"compute": compute, "comm": comm, "bubble": b.get("bubble", 0.0), "optimizer": b.get("optimizer", 0.0)}

    def price(self, action: str, overrides: Sequence[str], tokens_factor: float = 1.0) -> Suggestion | None:
        """The step predicted with `overrides` applied (None when the change is invalid for this run)."""
        from engine.errors import ConfigError

        try:
            changed = _config(self.run.config, overrides).to_dict()
        except (ConfigError, ValueError, TypeError):
            return None
        parts = self._parts(changed) if self.scale else None
        if parts is None:
            return None
        step = sum(parts[k] * self.scale[k] for k in PARTS) + self.held
        tokens = self.run.tokens_per_step * tokens_factor
        return Suggestion(action, tuple(overrides), step, tokens / step if step > 0 else None, "simulator",
                          _command(self.run, overrides))


def _config(config: dict[str, Any], overrides: Sequence[str]) -> Any:
    """The run's config with `overrides`, built and validated as `workbench run` would."""
    from engine.config.schema import apply_overrides, from_dict
    from engine.config.validate import validate

    cfg = from_dict(apply_overrides(config, list(overrides)))
    validate(cfg)
    return cfg


def _measured(run: _Run, action: str, step: float, command: str) -> Suggestion:
    return Suggestion(action, (), step, run.tokens_per_step / step if step > 0 else None, "measured breakdown", command)


def _priced(pricer: _Pricer, options: Sequence[tuple[str, Sequence[str], float]]) -> tuple[Suggestion, ...]:
    """The options that are valid for this run, priced, the fastest (tokens/s) first."""
    out = [s for s in (pricer.price(a, o, f) for a, o, f in options) if s is not None]
    return tuple(sorted(out, key=lambda s: -(s.predicted_tokens_per_s or 0.0)))


# ---------------------------------------------------------------- findings
def _comm_options(run: _Run) -> list[tuple[str, list[str], float]]:
    comm = run.config.get("comm", {}) or {}
    par, ddp = run.config.get("parallel", {}) or {}, run.config.get("ddp", {}) or {}
    options: list[tuple[str, list[str], float]] = []
    if comm.get("compressor", "none") == "none":
        options.append(("send the gradients in fp16 (half the bytes)", ["comm.compressor=fp16"], 1.0))
        options.append(("compress the gradients with PowerSGD (rank 4)", ["comm.compressor=powersgd", "comm.rank=4"], 1.0))
    bucket = float(ddp.get("bucket_cap_mb", 25.0))
    options.append((f"fewer, larger gradient buckets ({bucket * 4:g} MB): fewer collective latencies",
                    [f"ddp.bucket_cap_mb={bucket * 4:g}"], 1.0))
    global_ = int((run.config.get("batch") or {}).get("global", 8))
    options.append((f"twice the tokens per step (batch.global={2 * global_}): one all-reduce per twice the work",
                    [f"batch.global={2 * global_}"], 2.0))
    if int(par.get("tp", 1)) > 1:
        options.append(("halve tensor parallelism, double data parallelism",
                        [f"parallel.tp={int(par['tp']) // 2}", f"parallel.dp={2 * int(par.get('dp', 1))}"], 1.0))
    return options


def _comm(run: _Run, shares: dict[int, dict[str, float]], pricer: _Pricer) -> Finding | None:
    """Exposed communication: high on every rank, or on one rank far more than on another."""
    comm = {r: s["comm_exposed"] for r, s in shares.items()}
    worst, least = max(comm, key=comm.get), min(comm, key=comm.get)
    if comm[worst] < EXPOSED_COMM:
        return None
    what = _busiest_collective(run)
    if comm[worst] - comm[least] >= SPREAD:
        link = ""
        if worst in run.busbw and least in run.busbw:
            link = f"; its {what} bus bandwidth {run.busbw[worst]:.3g} GB/s, rank {least}'s {run.busbw[least]:.3g} GB/s"
        headline = (f"rank {worst} spends {_pct(comm[worst])} of its step in exposed {what} (rank {least}: "
                    f"{_pct(comm[least])}): a straggler or an unbalanced link{link}")
        check = _measured(run, f"find what holds rank {worst}'s collectives back: a bus bandwidth sweep of these "
                               f"ranks (the step if rank {worst} waited as little as rank {least})",
                          run.step_s - (comm[worst] - comm[least]) * float(run.phases.loc[worst].sum()),
                          f"workbench commbench --world {run.world}")
        return Finding("unbalanced_comm", headline, comm[worst], worst, (check, *_priced(pricer, _comm_options(run))))
    mean = statistics.fmean(comm.values())
    spread = f" (rank {worst}: {_pct(comm[worst])})" if comm[worst] - mean >= 0.05 else ""
    headline = (f"every rank spends {_pct(mean)} of its step in exposed {what}{spread}: communication the "
                "backward pass does not hide")
    return Finding("exposed_comm", headline, comm[worst], None, _priced(pricer, _comm_options(run)))


def _slow_rank(run: _Run, shares: dict[int, dict[str, float]]) -> Finding | None:
    """A rank whose compute takes SLOW_RANK x the other ranks' median: the others wait for it."""
    if len(run.phases) < 2:
        return None
    compute = run.phases[["forward", "backward", "other"]].sum(axis=1)
    slow = int(compute.idxmax())
    others = statistics.median(float(v) for r, v in compute.items() if r != slow)
    if others <= 0 or compute[slow] < SLOW_RANK * others:
        return None
    excess = float(compute[slow]) - others
    waiting = statistics.fmean(s["comm_exposed"] for r, s in shares.items() if r != slow)
    headline = (f"rank {slow} computes {compute[slow] * 1e3:.3g} ms a step, {compute[slow] / others:.1f}x the other "
                f"ranks' median ({others * 1e3:.3g} ms): a slow rank; the others wait for it in exposed "
                f"{_busiest_collective(run)} ({_pct(waiting)} of their step)")
    fix = _measured(run, f"give rank {slow} the speed of its peers (another process on its core? a slower "
                         "device? an uneven layer split): the step if it computed at the median rank's speed",
                    run.step_s - excess, _command(run, []))
    return Finding("slow_rank", headline, excess / run.step_s, slow, (fix,))


def _bubble(run: _Run, shares: dict[int, dict[str, float]], pricer: _Pricer) -> Finding | None:
    par = run.config.get("parallel", {}) or {}
    bubble = statistics.fmean(s["bubble"] for s in shares.values())
    if int(par.get("pp", 1)) < 2 or bubble < BUBBLE:
        return None
    batch = run.config.get("batch", {}) or {}
    micro, global_, dp = int(batch.get("micro", 4)), int(batch.get("global", 8)), int(par.get("dp", 1))
    n = global_ // max(dp * micro, 1)
    headline = (f"{_pct(bubble)} of the step is pipeline bubble ({par.get('schedule', '1f1b')}, pp{par['pp']}, "
                f"{n} micro-batches per step): stages idle while the pipeline fills and drains")
    options: list[tuple[str, list[str], float]] = []
    if micro > 1:
        options.append((f"smaller micro-batches: {2 * n} per step (batch.micro={micro // 2})", [f"batch.micro={micro // 2}"], 1.0))
    options.append((f"twice the micro-batches by a larger step (batch.global={2 * global_})", [f"batch.global={2 * global_}"], 2.0))
    options.append(("an interleaved schedule, 2 stages per rank", ["parallel.schedule=interleaved", "parallel.virtual=2"], 1.0))
    return Finding("pipeline_bubble", headline, bubble, None, _priced(pricer, options))


def _optimizer(run: _Run, shares: dict[int, dict[str, float]], pricer: _Pricer) -> Finding | None:
    share = statistics.fmean(s["optimizer"] for s in shares.values())
    if share < OPTIMIZER:
        return None
    par = run.config.get("parallel", {}) or {}
    seconds = float(run.phases["optimizer"].mean())
    headline = (f"the optimizer step takes {_pct(share)} of the step ({seconds * 1e3:.3g} ms): memory-bound, it "
                "streams every parameter, gradient and Adam state once per step whatever the batch")
    options: list[tuple[str, list[str], float]] = []
    if int(par.get("dp", 1)) > 1 and int(par.get("zero", 0)) == 0:
        options.append((f"ZeRO-1: each of the {par['dp']} dp ranks updates 1/{par['dp']} of the optimizer state",
                        ["parallel.zero=1"], 1.0))
    global_ = int((run.config.get("batch") or {}).get("global", 8))
    options.append((f"twice the tokens per optimizer step (batch.global={2 * global_})", [f"batch.global={2 * global_}"], 2.0))
    return Finding("optimizer", headline, share, None, _priced(pricer, options))


def _data(run: _Run, shares: dict[int, dict[str, float]]) -> Finding | None:
    data = {r: s["data"] for r, s in shares.items()}
    worst = max(data, key=data.get)
    if data[worst] < DATA:
        return None
    source = (run.config.get("data") or {}).get("source", "text")
    seconds = float(run.phases.loc[worst, "data"])
    every = min(data.values()) >= DATA
    who = f"every rank's step (rank {worst}: {seconds * 1e3:.3g} ms" if every else \
        f"rank {worst}'s step ({seconds * 1e3:.3g} ms"
    headline = (f"loading data takes {_pct(data[worst])} of {who}, data.source={source}): the ranks wait for "
                "their input")
    fix = _measured(run, "read pre-tokenized tokens (`workbench tokenize SRC -o tokens.bin`, then data.source=tokens "
                         "data.path=tokens.bin): the step if loading were that fast",
                    run.step_s - seconds, "workbench tokenize --help")
    return Finding("data_loading", headline, data[worst], None if every else worst, (fix,))


def _root_causes(findings: list[Finding]) -> list[Finding]:
    """A slow rank makes the others wait in their collectives: that wait is its symptom, not a
    second bottleneck, so an unbalanced-communication finding on another rank is folded into it."""
    slow = next((f for f in findings if f.kind == "slow_rank"), None)
    if slow is None:
        return findings
    return [f for f in findings if not (f.kind == "unbalanced_comm" and f.rank != slow.rank)]
