"""A run's record in the store, shared by every launcher (engine/launch/local.py, engine/launch/slurm.py) and by a
rank of an outside torchrun (engine/launch/worker.py): register the run, find the root cause of a failure,
summarize and finish it (RunResult).
"""
from __future__ import annotations

import json
import re
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config.schema import RunConfig, validate
from engine.errors import RankFailure
from engine.mesh import ParallelDims


@dataclass(slots=True)
class RunResult:
    run_id: str
    status: str  # completed | failed | interrupted | pruned
    world_size: int
    run_dir: Path
    steps: list[dict[str, Any]] = field(default_factory=list)  # rank 0's {step, loss, step_time_s, tokens_per_s}
    error: str | None = None
    error_rank: int | None = None
    wall_s: float = 0.0
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def final_loss(self) -> float | None:
        return self.steps[-1]["loss"] if self.steps else None


_EXIT_RE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)", re.S)


_PEER_ERRORS = ("Terminated: terminated by the launcher", "Connection closed by peer", "Connection reset by peer", "remote worker", "Broken pipe",
                "Socket Timeout", "NCCL communicator was aborted")


_TIMEOUT_ERRORS = ("Timed out", "timed out")


def _hung_rank(errors: list[dict[str, Any]], log: str) -> RankFailure | None:
    """A hang: some ranks timed out waiting in a collective, and a rank that reported nothing of its
    own was stopped by the launcher afterwards; that silent rank is the root cause."""
    waited = [e for e in errors if any(p in e["reason"] for p in _TIMEOUT_ERRORS)]
    if not waited:
        return None
    reported = {e["rank"] for e in errors}
    stopped = {e["rank"] for e in errors if e["reason"].startswith("Terminated:")}
    stopped |= {int(m.group(1)) for m in _EXIT_RE.finditer(log)
                if int(m.group(1)) not in reported and int(m.group(2)) == -signal.SIGTERM}
    stopped -= {e["rank"] for e in waited}
    if not stopped:
        return None
    first, rank = min(waited, key=lambda e: e["time"]), min(stopped)
    where = next((e["traceback"] for e in errors if e["rank"] == rank), "")  # where it was stuck
    return RankFailure(rank, f"hung: rank {first['rank']} timed out waiting for it in a collective "
                       f"({first['reason'].splitlines()[0][-160:]}); the launcher stopped it", where)


def first_failure(run_dir: Path, log: str = "") -> RankFailure:
    """The root cause of a failed run from its ranks' error files and torchrun's log (if any): a rank's own error first, then a hung rank, then a rank killed by a signal (from
    torchrun's report), then errors that only echo a dead or hung peer; earliest first within each."""
    errors = []
    for path in run_dir.glob("error-rank*.json"):
        try:
            errors.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    own = [e for e in errors if not any(p in e["reason"] for p in _PEER_ERRORS + _TIMEOUT_ERRORS)]
    if own:
        first = min(own, key=lambda e: e["time"])
        return RankFailure(first["rank"], first["reason"], first["traceback"])
    hung = _hung_rank(errors, log)
    if hung is not None:
        return hung
    for m in _EXIT_RE.finditer(log):
        code = int(m.group(2))
        if code < 0:
            return RankFailure(int(m.group(1)), f"killed by signal {-code} ({signal.Signals(-code).name})")
    if errors:
        first = min(errors, key=lambda e: e["time"])
        return RankFailure(first["rank"], first["reason"], first["traceback"])
    m = _EXIT_RE.search(log)
    if m:
        return RankFailure(int(m.group(1)), f"exit code {m.group(2)}")
    return RankFailure(None, "the launcher failed before any rank reported", log[-2000:])


def stop_status(exc: BaseException) -> tuple[str, str]:
    """(status, reason) of a run its caller stopped: a trial the tuner pruned reads 'pruned'
    (optuna.TrialPruned, known by name: the engine does not import optuna), else 'interrupted'."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", "interrupted by the user (Ctrl-C)"
    if type(exc).__name__ == "TrialPruned":
        return "pruned", f"pruned by the tuner at step {exc}"
    return "interrupted", f"stopped by the caller: {type(exc).__name__}: {exc}"


def telemetry_summary(server) -> dict[str, Any]:
    """What the run's summary says about its telemetry server: connections refused for a bad token,
    records refused for naming another run."""
    return {"telemetry_refused": server.connections_refused, "telemetry_records_refused": server.records_refused}


def run_host() -> dict[str, object]:
    """The runs table's `host` of a run this process starts: this machine, and the CUDA allocator settings its
    ranks get (`engine.device.cuda_alloc_conf`)."""
    from engine.device import cuda_alloc_conf
    from profilers.host import host_info

    return {**host_info(), "cuda_alloc_conf": cuda_alloc_conf()}


def register(cfg: RunConfig, *, home: str | Path | None, run_id: str | None, parent: str | None,
             join: bool = False):
    """Validate and record a new run (status running) with its config file; every launcher starts here.
    Returns (store, run_id, run_dir, config path)."""
    from profilers.host import software_versions
    from profilers.store import RunStore, default_home

    validate(cfg)
    if cfg.train.resume_from:  # the checkpoint reader imports torch: a run that resumes nothing never does
        from engine.train.checkpoint import check_resume

        check_resume(cfg)  # a wrong or damaged checkpoint: one line here, not a traceback from every rank
    dims = ParallelDims(cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, cfg.world_size, cp=cfg.parallel.cp)
    home = Path(home) if home else default_home()
    run_id = run_id or f"{cfg.name}-{uuid.uuid4().hex[:8]}"
    run_dir = home / "runs" / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir / "config.json"
    cfg_path.write_text(json.dumps(cfg.to_dict(), indent=2))
    store = RunStore.open_home(home)
    store.create_run(run_id, name=cfg.name, config=cfg.to_dict(), world_size=cfg.world_size,
                     layout=dims.describe(), host=run_host(), versions=software_versions(),
                     emulated=cfg.link.gbps > 0 or bool(cfg.link.groups), parent=parent, join=join)
    return store, run_id, run_dir, cfg_path


def finish(store, run_id: str, status: str, cfg: RunConfig, run_dir: Path, started: float,
           failure: RankFailure | None, raise_on_failure: bool, extra_summary: dict[str, Any] | None = None,
           first: bool = False) -> RunResult:
    """Record the run's outcome and summary (every launcher ends here); raise the failure if asked."""
    result = _result(store, run_id, status, cfg, run_dir, started, failure)
    result.summary.update(extra_summary or {})
    store.finish_run(run_id, status, error=result.error, error_rank=result.error_rank, summary=result.summary,
                     first=first)
    if failure is not None and raise_on_failure:
        raise failure
    return result


def rank0_steps(store, run_id: str) -> list[dict[str, Any]]:
    """Rank 0's per-step records from the store: {step, loss, step_time_s, tokens_per_s, mfu}."""
    steps: dict[int, dict[str, Any]] = {}
    names = {"loss": "loss", "step_time(s)": "step_time_s", "tokens_per_s": "tokens_per_s", "mfu": "mfu"}
    for rec in store.metrics(run_id, kind="step", rank=0):
        if rec.name in names:
            steps.setdefault(rec.step, {"step": rec.step})[names[rec.name]] = rec.value
    return [steps[k] for k in sorted(steps)]


def run_summary(store, run_id: str, cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    """The summary a finished run keeps in the store (our launcher and an outside torchrun alike)."""
    summary = summarize(rank0_steps(store, run_id), warmup=cfg.profile.warmup_steps)
    summary.update(store.wire_totals(run_id))
    for rec in store.metrics(run_id, kind="eval", name="val_loss", rank=0):
        summary["val_loss"] = rec.value
    traces = sorted(str(p) for p in (run_dir / "traces").glob("*.json*"))
    if traces:
        summary["traces"] = traces
    return summary


def _result(store, run_id: str, status: str, cfg: RunConfig, run_dir: Path, started: float,
            failure: RankFailure | None) -> RunResult:
    ordered = rank0_steps(store, run_id)
    summary = run_summary(store, run_id, cfg, run_dir)
    return RunResult(run_id=run_id, status=status, world_size=cfg.world_size, run_dir=run_dir, steps=ordered,
                     error=str(failure) if failure else None, error_rank=failure.rank if failure else None,
                     wall_s=time.time() - started, summary=summary)


def summarize(steps: list[dict[str, Any]], *, warmup: int) -> dict[str, Any]:
    """Steady-state throughput (median over the steps after warm-up) and the final loss."""
    import statistics

    steady = steps[warmup:] or steps
    out: dict[str, Any] = {"steps": len(steps)}
    if steps:
        out["final_loss"] = steps[-1].get("loss")
    tps = [s["tokens_per_s"] for s in steady if "tokens_per_s" in s]
    if tps:
        out["tokens_per_s"] = statistics.median(tps)
        out["step_time_s"] = statistics.median(s["step_time_s"] for s in steady if "step_time_s" in s)
    mfu = [s["mfu"] for s in steady if "mfu" in s]
    if mfu:
        out["mfu"] = statistics.median(mfu)
    return out
