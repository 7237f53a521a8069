"""The Slurm launcher: one run = one batch job of `cluster.nodes` nodes; srun starts one torchrun per
node, and torchrun's c10d rendezvous starts `engine.worker` on every rank (torchtitan's
multinode_trainer.slurm does the same).

The launcher process owns the run's row and the telemetry writer, exactly as `engine.launch` does:
the ranks stream their records to it over TCP (`cluster.telemetry_host`), so the store is written
by one process on one machine. Job state comes from `scontrol show job` (falling back to
`squeue -t all`), not sacct: sacct needs slurmdbd, which many clusters have but a small one may not.
sbatch/srun directly, not submitit: submitit follows its jobs with sacct, and without slurmdbd
its state stays UNKNOWN and result() of a cancelled job hangs (measured, platform.md).
A stopped, pruned or timed-out run is `scancel`led and waited for until Slurm reports no step left;
a job Slurm ends itself (time limit, node failure, preemption, a user's scancel) fails the run with
Slurm's own words.
"""
from __future__ import annotations

import datetime
import os
import re
import shlex
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import RunConfig

# Slurm job states (squeue(1) "JOB STATE CODES") grouped as the dashboard shows them
QUEUED = ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED")
RUNNING = ("RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "RESIZING", "STOPPED")
# ended by Slurm (or someone's scancel), not by the ranks: the run fails with Slurm's reason
KILLED = ("CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
POLL_S = 0.5
RDZV_PORT_BASE = 29500  # multi-node rendezvous port = base + job id % 10000, so jobs sharing a node differ

JobCallback = Callable[["JobState"], None]


class SlurmError(RuntimeError):
    """A Slurm command failed (sbatch refused the job, no controller answers); the message is Slurm's."""


@dataclass(frozen=True, slots=True)
class JobState:
    """One look at a job: Slurm's state, reason, exit code and times (epoch seconds, None until known)."""

    job_id: str
    state: str  # Slurm's JobState, e.g. PENDING, RUNNING, COMPLETED, CANCELLED, TIMEOUT; UNKNOWN once purged
    reason: str = "None"
    exit_code: str = "0:0"
    submitted: float | None = None
    started: float | None = None
    ended: float | None = None

    @property
    def phase(self) -> str:
        """queued | running | done: what the dashboard shows per job."""
        if self.state in QUEUED:
            return "queued"
        return "running" if self.state in RUNNING else "done"

    @property
    def queued_s(self) -> float | None:
        """Seconds between submission and start (so far, while still queued)."""
        if self.submitted is None:
            return None
        return (self.started or time.time()) - self.submitted

    @property
    def run_s(self) -> float | None:
        """Seconds between start and end (so far, while running)."""
        if self.started is None:
            return None
        return (self.ended or time.time()) - self.started

    def to_dict(self) -> dict[str, Any]:
        return {"slurm_job_id": self.job_id, "slurm_state": self.state, "slurm_phase": self.phase,
                "queued_s": self.queued_s, "run_s": self.run_s}


# ------------------------------------------------------------------ the batch script (pure)

def ranks_per_node(cfg: RunConfig) -> int:
    return cfg.world_size // cfg.cluster.nodes


def srun_command(cfg_path: Path, run_dir: Path, *, nodes: int, nproc: int) -> list[str]:
    """srun starting one torchrun per node; `$HEAD`, `$PORT` and `$SLURM_JOB_ID` are the script's."""
    from engine.launch import torchrun_command

    srun = ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if nodes == 1:  # --standalone: torchrun picks a free port, so jobs sharing a node never clash
        return srun + torchrun_command(cfg_path, run_dir, nproc=nproc)
    return srun + torchrun_command(cfg_path, run_dir, nproc=nproc, nnodes=nodes, node_rank=None,
                                   rdzv_endpoint="$HEAD:$PORT", rdzv_id="$SLURM_JOB_ID")


def shell_line(cmd: list[str]) -> str:
    """One shell line; arguments holding the script's variables are double-quoted so they expand."""
    return " ".join(f'"{a}"' if "$" in a else shlex.quote(a) for a in cmd)


def sbatch_options(cfg: RunConfig, *, job_name: str, output: Path) -> list[str]:
    """The job's #SBATCH options: one task (torchrun) per node, its ranks' CPUs and GPUs."""
    c, nproc = cfg.cluster, ranks_per_node(cfg)
    opts = [f"--job-name={job_name}", f"--nodes={c.nodes}", "--ntasks-per-node=1",
            f"--cpus-per-task={nproc * c.cpus_per_rank}", f"--output={output}"]
    if c.gpus_per_node:
        opts.append(f"--gpus-per-node={c.gpus_per_node}")
    for key in ("partition", "account", "time", "constraint"):
        if getattr(c, key) is not None:
            opts.append(f"--{key}={getattr(c, key)}")
    return opts + list(c.sbatch or [])


def batch_script(cfg: RunConfig, *, job_name: str, output: Path, env: dict[str, str], srun: list[str]) -> str:
    """The whole batch script of one run (what `--dry-run` prints and sbatch receives)."""
    lines = ["#!/bin/bash"] + [f"#SBATCH {o}" for o in sbatch_options(cfg, job_name=job_name, output=output)]
    lines += ["", "# the workbench's run: ranks stream telemetry to the launcher, which owns the run store"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines += list(cfg.cluster.setup or [])
    if cfg.cluster.nodes > 1:
        lines += ['HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                  f"PORT=$(( {RDZV_PORT_BASE} + SLURM_JOB_ID % 10000 ))"]
    lines += ["exec " + shell_line(srun)]
    return "\n".join(lines) + "\n"


def rank_env(*, run_id: str, home: Path, telemetry: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """What every rank needs from the launcher (exported in the script, so it is there on every node)."""
    return {"WORKBENCH_RUN_ID": run_id, "WORKBENCH_HOME": str(home), "WORKBENCH_TELEMETRY": telemetry,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1", **(extra or {})}


def dry_run(cfg: RunConfig, *, home: str | Path | None = None, run_id: str | None = None) -> str:
    """The batch script and srun line a run would be submitted with; nothing is written or submitted."""
    from profilers.store import default_home

    home = Path(home) if home else default_home()
    run_id = run_id or f"{cfg.name}-<id>"
    run_dir = home / "runs" / run_id
    srun = srun_command(run_dir / "config.json", run_dir, nodes=cfg.cluster.nodes, nproc=ranks_per_node(cfg))
    env = rank_env(run_id=run_id, home=home, telemetry=f"{telemetry_host(cfg)}:<port>")
    script = batch_script(cfg, job_name=run_id, output=run_dir / "slurm-%j.out", env=env, srun=srun)
    return f"# sbatch {run_dir / 'job.sbatch'}\n{script}\n# srun line:\n{shell_line(srun)}\n"


# ------------------------------------------------------------------ Slurm commands

def telemetry_host(cfg: RunConfig) -> str:
    return cfg.cluster.telemetry_host or socket.gethostname()


def client_env() -> dict[str, str]:
    """This process's environment without an enclosing job's SLURM_* variables (a tuner worker runs
    inside a job): a nested sbatch would inherit its sizes. SLURM_CONF names the cluster, so it stays;
    the user's own SBATCH_* defaults (SBATCH_ACCOUNT, ...) stay too."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


def _slurm(*cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(cmd), env=client_env(), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmError(f"`{cmd[0]}` not found: --launcher slurm needs Slurm's client commands on PATH") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(cmd)}` did not answer within {timeout:.0f} s (is slurmctld up?)") from None


def submit(script: Path) -> str:
    """sbatch the script; returns the job id."""
    out = _slurm("sbatch", "--parsable", str(script))
    if out.returncode:
        raise SlurmError(f"sbatch refused {script}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip().split(";")[0]


def _epoch(text: str | None) -> float | None:
    try:
        return datetime.datetime.fromisoformat(text).timestamp() if text else None
    except ValueError:  # Unknown, None, N/A
        return None


def parse_scontrol(text: str) -> dict[str, str]:
    """`scontrol show job -o` output as a dict (Key=Value pairs; values hold no spaces we read)."""
    return dict(re.findall(r"(\w[\w/:]*)=(\S*)", text))


def job_state(job_id: str) -> JobState:
    """The job's state now; UNKNOWN once Slurm forgot it (MinJobAge after its end)."""
    out = _slurm("scontrol", "show", "job", "-o", job_id)
    if out.returncode == 0 and "JobState=" in out.stdout:
        f = parse_scontrol(out.stdout)
        return JobState(job_id, f.get("JobState", "UNKNOWN"), f.get("Reason", "None"), f.get("ExitCode", "0:0"),
                        _epoch(f.get("SubmitTime")), _epoch(f.get("StartTime")) if f.get("JobState") not in QUEUED
                        else None, _epoch(f.get("EndTime")))
    out = _slurm("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T|%r|%V|%S|%e")
    parts = out.stdout.strip().split("|")
    if out.returncode == 0 and len(parts) == 5:
        state = parts[0]
        return JobState(job_id, state, parts[1], "?", _epoch(parts[2]), None if state in QUEUED else _epoch(parts[3]),
                        _epoch(parts[4]))
    return JobState(job_id, "UNKNOWN")


def cancel(job_id: str, *, wait_s: float = 60.0) -> JobState:
    """scancel the job and wait until Slurm has no step of it left (its processes are gone then)."""
    _slurm("scancel", job_id)
    deadline = time.time() + wait_s
    state = job_state(job_id)
    while state.state in QUEUED + RUNNING and time.time() < deadline:
        time.sleep(POLL_S)
        state = job_state(job_id)
    return state


def slurm_reason(state: JobState, output: str) -> str:
    """Why Slurm ended the job, in Slurm's words: its state, reason and exit code, and the
    `*** JOB n ON node CANCELLED AT ... DUE TO TIME LIMIT ***` line slurmstepd writes to the output."""
    said = [line.split("error:", 1)[-1].strip() for line in output.splitlines() if f"*** JOB {state.job_id} " in line]
    words = f"Slurm ended job {state.job_id} as {state.state}"
    if state.reason not in ("None", ""):
        words += f" (reason {state.reason})"
    words += f", exit code {state.exit_code}"
    return words + (f": {said[-1]}" if said else "")


# ------------------------------------------------------------------ the launcher

def launch_slurm(cfg: RunConfig, *, home: str | Path | None = None, run_id: str | None = None,
                 timeout_s: float | None = None, on_progress: Callable[[dict[str, Any]], None] | None = None,
                 parent: str | None = None, raise_on_failure: bool = True, extra_env: dict[str, str] | None = None,
                 on_job: JobCallback | None = None):
    """Register the run, submit its job, stream telemetry into the store, follow the job to its end.
    `timeout_s` counts running time only: time in the queue is the cluster's, recorded as queued_s."""
    from engine.errors import RankFailure
    from engine.launch import finish, register
    from profilers.telemetry import TelemetryServer

    store, run_id, run_dir, cfg_path = register(cfg, home=home, run_id=run_id, parent=parent)
    home = run_dir.parent.parent
    server = TelemetryServer(store, host=telemetry_host(cfg))
    srun = srun_command(cfg_path, run_dir, nodes=cfg.cluster.nodes, nproc=ranks_per_node(cfg))
    env = rank_env(run_id=run_id, home=home, telemetry=server.start(), extra=extra_env)
    script = run_dir / "job.sbatch"
    script.write_text(batch_script(cfg, job_name=run_id, output=run_dir / "slurm-%j.out", env=env, srun=srun))
    started = time.time()
    try:
        job_id = submit(script)
    except SlurmError as exc:  # refused (a partition that does not exist, a time over the limit): no job
        server.stop()
        return finish(store, run_id, "failed", cfg, run_dir, started, RankFailure(None, str(exc)), raise_on_failure)
    state = None
    try:
        store.update_run(run_id, summary={"slurm_job_id": job_id})
        status, state = _follow(job_id, store, run_id, timeout_s, on_progress, on_job, server)
    except BaseException as exc:  # Ctrl-C, a pruned trial, a dead controller: no job may outlive the run
        try:
            state = cancel(job_id)
        except SlurmError:  # the controller went away: say why the run stopped, not this
            state = None
        server.stop()
        reason = "interrupted by the user (Ctrl-C)" if isinstance(exc, KeyboardInterrupt) else \
            f"stopped by the caller: {type(exc).__name__}: {exc}"
        store.finish_run(run_id, "interrupted", error=reason, summary=state.to_dict() if state else None)
        if on_job and state:
            on_job(state)
        raise
    if state.phase != "done":  # our timeout or a store failure: the job still runs
        state = cancel(job_id)
    server.stop()
    if on_job:
        on_job(state)
    status, failure = _outcome(status, state, run_dir, server, timeout_s)
    return finish(store, run_id, status, cfg, run_dir, started, failure, raise_on_failure,
                  extra_summary=state.to_dict())


def _outcome(status: str, state: JobState, run_dir: Path, server, timeout_s: float | None):
    """(final status, root cause or None) of a job that has ended."""
    from engine.errors import RankFailure
    from engine.launch import first_failure

    job_id = state.job_id
    if server.error is not None and status != "timeout":
        return "failed", RankFailure(None, f"the run store could not take this run's telemetry "
                                     f"({server.records_failed} records not stored): {server.error}; "
                                     f"Slurm job {job_id} was cancelled")
    if status == "timeout":
        return "failed", RankFailure(None, f"timed out after {timeout_s:.0f} s running; Slurm job {job_id} was cancelled")
    if status != "failed":
        return status, None
    output = _read(run_dir / f"slurm-{job_id}.out")
    if state.state in KILLED:  # the ranks saw only SIGTERM: Slurm's words say why
        return "failed", RankFailure(None, slurm_reason(state, output))
    return "failed", first_failure(run_dir, output)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _follow(job_id: str, store, run_id: str, timeout_s: float | None, on_progress, on_job: JobCallback | None,
            server) -> tuple[str, JobState]:
    """Poll the job until it ends; report each phase change, new steps and our own timeout."""
    last_phase, last_step, running_since = None, -1, None
    while True:
        state = job_state(job_id)
        if state.phase != last_phase:
            last_phase = state.phase
            if state.phase == "running" and state.started:
                store.update_run(run_id, started=state.started)  # the run's clock starts when the job does
                running_since = time.time()
            if on_job is not None:
                on_job(state)
        if state.phase == "done" or state.state == "UNKNOWN":
            return ("completed" if state.state == "COMPLETED" else "failed"), state
        if server.error is not None:
            return "store_error", state
        if timeout_s is not None and running_since is not None and time.time() - running_since > timeout_s:
            return "timeout", state
        if on_progress is not None:
            latest = store.latest_steps(run_id, n=1)
            if latest and latest[-1]["step"] != last_step:
                last_step = latest[-1]["step"]
                on_progress(latest[-1])
        time.sleep(POLL_S)

