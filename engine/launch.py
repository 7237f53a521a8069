"""launch(): run the ranks of one config through torch's elastic launcher (torchrun).

The launcher process owns the run's row in the store and the one telemetry writer; the ranks run
in their own process session so that success, a rank failure, Ctrl-C or a timeout all end with
no process left behind. A failing rank's exception comes back as RankFailure(rank, traceback).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import RunConfig, validate
from engine.errors import JoinTimeout, RankFailure
from engine.mesh import ParallelDims

Progress = Callable[[dict[str, Any]], None]


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


RDZV_TIMEOUT_S = 300.0  # a multi-node run's nodes must all join the rendezvous within this (torchrun's own: 600)


def torchrun_command(cfg_path: Path, run_dir: Path, *, nproc: int, nnodes: int = 1, node_rank: int | None = 0,
                     rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                     rdzv_timeout_s: float = RDZV_TIMEOUT_S) -> list[str]:
    """The exact torchrun command line of a run (also what `workbench export --format torchrun` prints).
    node_rank=None leaves node ranks to the c10d rendezvous (one srun task per node starts the same line);
    a node gives up when not every node joined within rdzv_timeout_s."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--max-restarts=0"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}"] + ([f"--node-rank={node_rank}"] if node_rank is not None else [])
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        cmd += [f"--rdzv-id={rdzv_id}"] if rdzv_id else []
        # node 0 hosts the rendezvous store, the others never: torchrun guesses it by host name, so a node
        # whose name resolves to another interface (a namespace) would not host, and on one machine every
        # node would try to (the first to bind wins and node 0 fails: EADDRINUSE)
        conf = ([f"is_host={int(node_rank == 0)}"] if node_rank is not None else []) + \
            [f"join_timeout={rdzv_timeout_s:.0f}"]
        cmd += [f"--rdzv-conf={','.join(conf)}"]
        if node_rank is not None and "$" not in rdzv_endpoint:  # the address peers reach this node by
            cmd += [f"--local-addr={route_source(rdzv_endpoint)}"]
    return cmd + ["-m", "engine.worker", "--config", str(cfg_path), "--run-dir", str(run_dir)]


def route_source(endpoint: str) -> str:
    """This machine's address on the route to `endpoint` ('host:port'): what the other nodes reach it by.
    torchrun would advertise its host name, which may resolve to another interface (or none the peers see)."""
    import socket

    host = endpoint.rpartition(":")[0] or endpoint
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))  # UDP: no packet is sent, the kernel only picks the route
            return s.getsockname()[0]
        except OSError:
            return socket.gethostname()


def _kill_session(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    """SIGTERM the run's whole process session, then SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + wait
        while time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    _wait_session_gone(proc.pid)


def _wait_session_gone(pgid: int, timeout_s: float = 15.0) -> None:
    """Until no live process of the session is left: a SIGKILLed rank takes a while to exit on a busy
    machine (a 2-node test saw all 4 ranks still listed when the launcher had returned)."""
    import psutil

    def alive() -> bool:
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                    return True
            except (psutil.Error, ProcessLookupError, PermissionError):
                continue
        return False

    deadline = time.time() + timeout_s
    while alive() and time.time() < deadline:
        time.sleep(0.1)


def die_with_parent() -> None:
    """In a child: get SIGTERM when its parent dies. The launcher sets it on torchrun (a killed tuner
    leaves no ranks behind) and every rank sets it on itself: a SIGKILLed torchrun cannot stop its ranks,
    which trained on as orphans until the other node's launcher timed out (2 nodes, 240 s)."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


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


def _first_failure(run_dir: Path, log: str) -> RankFailure:
    """The root cause: a rank's own error first, then a hung rank, then a rank killed by a signal (from
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


def launch(cfg: RunConfig, *, home: str | Path | None = None, run_id: str | None = None, nnodes: int = 1,
           node_rank: int = 0, rdzv_endpoint: str | None = None, timeout_s: float | None = None,
           on_progress: Progress | None = None, parent: str | None = None, raise_on_failure: bool = True,
           extra_env: dict[str, str] | None = None, launcher: str = "local",
           on_job: Callable[[Any], None] | None = None, rdzv_timeout_s: float = RDZV_TIMEOUT_S,
           device_memory_gib: float | None = None) -> RunResult:
    """Validate, register the run, start the ranks, stream telemetry into the store, wait.
    launcher="slurm" submits the run as one Slurm job of cfg.cluster instead (engine/slurm.py);
    `on_job` then hears each change of the job's state (queued, running, done). A run targeting
    GPUs (or `device_memory_gib` per rank) is dry-run first and refused in one line if its busiest
    rank would not fit (engine/dryrun.py `preflight`), before anything is registered or started."""
    from engine.dryrun import preflight
    from profilers.telemetry import TOKEN_ENV, TelemetryServer

    validate(cfg)
    if launcher == "slurm":
        from engine.slurm import launch_slurm

        preflight(cfg, device_memory_gib=device_memory_gib)
        return launch_slurm(cfg, home=home, run_id=run_id, timeout_s=timeout_s, on_progress=on_progress,
                            parent=parent, raise_on_failure=raise_on_failure, extra_env=extra_env, on_job=on_job)
    if launcher != "local":
        raise ValueError(f"launcher={launcher!r} must be local or slurm")
    if cfg.world_size % nnodes:
        raise ValueError(f"world size {cfg.world_size} is not divisible by nnodes={nnodes}")
    from engine.device import check_ranks_fit_gpus

    check_ranks_fit_gpus(cfg.backend, cfg.world_size // nnodes)  # the GPUs there are, before any dry run of them
    preflight(cfg, device_memory_gib=device_memory_gib)
    store, run_id, run_dir, cfg_path = register(cfg, home=home, run_id=run_id, parent=parent, join=nnodes > 1)
    home = run_dir.parent.parent
    server = TelemetryServer(store, run_id=run_id)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1",
           "WORKBENCH_TELEMETRY": server.start(), "WORKBENCH_RUN_ID": run_id, "WORKBENCH_HOME": str(home),
           "WORKBENCH_NODE_RANK": str(node_rank), **(extra_env or {}), TOKEN_ENV: server.token}
    cmd = torchrun_command(cfg_path, run_dir, nproc=cfg.world_size // nnodes, nnodes=nnodes,
                           node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_timeout_s=rdzv_timeout_s)
    started = time.time()
    status, failure = "completed", None
    log_path = run_dir / ("launcher.log" if nnodes == 1 else f"launcher-node{node_rank}.log")  # one per node
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent)
        try:
            status = _wait(proc, store, run_id, started, timeout_s, on_progress, server)
        except BaseException as exc:  # Ctrl-C, or the caller stopped the run (a pruned trial)
            _kill_session(proc)
            server.stop()
            status, reason = stop_status(exc)
            store.finish_run(run_id, status, error=reason)
            raise
        finally:
            _kill_session(proc)
            server.stop()
    log_text = log_path.read_text(errors="replace")
    if server.error is not None and status != "timeout":  # e.g. a full disk: never a silent loss
        status, failure = "failed", RankFailure(None, f"the run store could not take this run's telemetry "
                                                f"({server.records_failed} records not stored): {server.error}; "
                                                "the run was stopped")
    elif status == "timeout":
        status, failure = "failed", RankFailure(None, f"timed out after {timeout_s:.0f} s; every rank was stopped")
    elif status == "failed" and nnodes > 1 and "RendezvousTimeoutError" in log_text:
        failure = JoinTimeout(None, f"node {node_rank} of {nnodes} waited {rdzv_timeout_s:.0f} s at the rendezvous "
                              f"{rdzv_endpoint} and not every node joined; start the same `workbench run` with "
                              f"--nnodes {nnodes} --node-rank I --rdzv-endpoint {rdzv_endpoint} on each other "
                              "node (or raise --rdzv-timeout)")
    elif status == "failed":
        failure = _first_failure(run_dir, log_text)
    if nnodes > 1 and failure is not None and not isinstance(failure, JoinTimeout):
        failure = node_failure(store, run_id, failure, node_rank=node_rank, nnodes=nnodes, returncode=proc.returncode)
    return finish(store, run_id, status, cfg, run_dir, started, failure, raise_on_failure,
                  extra_summary=telemetry_summary(server), first=nnodes > 1)


def node_ranks(store, run_id: str, node_rank: int) -> list[int]:
    """The global ranks that node `node_rank` ran (each rank records its launcher's node rank)."""
    return sorted({r.rank for r in store.metrics(run_id, kind="node", name="node_rank") if r.value == node_rank})


def node_failure(store, run_id: str, failure: RankFailure, *, node_rank: int, nnodes: int,
                 returncode: int | None) -> RankFailure:
    """A multi-node failure says which node (its host and ranks) and how its torchrun ended."""
    import socket

    ranks = node_ranks(store, run_id, node_rank)
    how = f"its torchrun was killed by signal {-returncode} ({signal.Signals(-returncode).name})" \
        if returncode is not None and returncode < 0 else failure.reason
    rank = failure.rank if failure.rank is not None else (ranks[0] if ranks else None)
    return RankFailure(rank, f"node {node_rank} of {nnodes} ({socket.gethostname()}, ranks "
                       f"{', '.join(map(str, ranks)) or '?'}): {how}", failure.traceback)


def telemetry_summary(server) -> dict[str, Any]:
    """What the run's summary says about its telemetry server: connections refused for a bad token,
    records refused for naming another run."""
    return {"telemetry_refused": server.connections_refused, "telemetry_records_refused": server.records_refused}


def register(cfg: RunConfig, *, home: str | Path | None, run_id: str | None, parent: str | None,
             join: bool = False):
    """Validate and record a new run (status running) with its config file; every launcher starts here.
    Returns (store, run_id, run_dir, config path)."""
    from profilers.host import host_info, software_versions
    from profilers.store import RunStore, default_home

    validate(cfg)
    from engine.checkpoint import check_resume

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
                     layout=dims.describe(), host=host_info(), versions=software_versions(),
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


def _wait(proc: subprocess.Popen, store, run_id: str, started: float, timeout_s: float | None,
          on_progress: Progress | None, server) -> str:
    last_step = -1
    while proc.poll() is None:
        if server.error is not None:
            return "store_error"
        if timeout_s is not None and time.time() - started > timeout_s:
            return "timeout"
        if on_progress is not None:
            latest = store.latest_steps(run_id, n=1)
            if latest and latest[-1]["step"] != last_step:
                last_step = latest[-1]["step"]
                on_progress(latest[-1])
        time.sleep(0.2)
    return "completed" if proc.returncode == 0 else "failed"


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


def first_failure(run_dir: Path, log: str = "") -> RankFailure:
    """The root cause of a failed run from its ranks' error files (and torchrun's log, if any)."""
    return _first_failure(run_dir, log)


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
