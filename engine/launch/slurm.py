"""The Slurm launcher: one run = one batch job of `cluster.nodes` nodes; srun starts one torchrun per
node, and torchrun's c10d rendezvous starts `engine.launch.worker` on every rank (torchtitan's
multinode_trainer.slurm does the same).

The launcher process owns the run's row and the telemetry writer, exactly as `engine.launch.local` does:
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
import logging
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config.schema import RunConfig
from engine.device import ALLOC_CONF, cuda_alloc_conf
from engine.launch.preempt import ENV as PREEMPTIBLE_ENV
from engine.launch.preempt import requeue_lines

# Slurm job states (squeue(1) "JOB STATE CODES") grouped as the dashboard shows them
QUEUED = ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED")
RUNNING = ("RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "RESIZING", "STOPPED")
# ended by Slurm (or someone's scancel), not by the ranks: the run fails with Slurm's reason
KILLED = ("CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
POLL_S = 0.5
QUERY_PATIENCE_S = 300.0  # how long a job's state may go unanswered (a busy controller) before the run gives up
RDZV_PORT_BASE = 29500  # multi-node rendezvous port = base + job id % 10000, so jobs sharing a node differ

JobCallback = Callable[["JobState"], None]
log = logging.getLogger(__name__)


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


def srun_command(cfg_path: Path, run_dir: Path, *, nodes: int, nproc: int, cpus_per_rank: int = 1,
                 gpus_per_node: int = 0, preemptible: bool = False) -> list[str]:
    """srun starting one torchrun per node; `$HEAD`, `$PORT` and `$SLURM_JOB_ID` are the script's.

    The step asks for its CPUs itself: since Slurm 22.05 srun no longer inherits sbatch's
    --cpus-per-task, and without it a node's ranks may share one core. With GPUs the one task gets the
    node's `nproc` GPUs and each rank binds the one at its LOCAL_RANK (engine.device)."""
    from engine.launch.torchrun import torchrun_command

    srun = ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", f"--cpus-per-task={nproc * cpus_per_rank}",
            "--kill-on-bad-exit=1"]
    if gpus_per_node:
        srun.append(f"--gpus-per-task={nproc}")
    if preemptible:  # torchrun would die of Slurm's SIGUSR1: it runs with the signal ignored (engine/launch/preempt.py)
        srun += [sys.executable, "-m", "engine.launch.preempt"]
    if nodes == 1:  # --standalone: torchrun picks a free port, so jobs sharing a node never clash
        return srun + torchrun_command(cfg_path, run_dir, nproc=nproc)
    return srun + torchrun_command(cfg_path, run_dir, nproc=nproc, nnodes=nodes, node_rank=None,
                                   rdzv_endpoint="$HEAD:$PORT", rdzv_id="$SLURM_JOB_ID")


def job_srun(cfg: RunConfig, cfg_path: Path, run_dir: Path) -> list[str]:
    """The srun line of `cfg`'s job."""
    c = cfg.cluster
    return srun_command(cfg_path, run_dir, nodes=c.nodes, nproc=ranks_per_node(cfg), cpus_per_rank=c.cpus_per_rank,
                        gpus_per_node=c.gpus_per_node, preemptible=c.signal_s > 0)


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
    if c.signal_s:  # the ranks checkpoint on it and the script requeues the job (engine/launch/preempt.py)
        opts += [f"--signal=USR1@{c.signal_s}", "--requeue", "--open-mode=append"]
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
    if not cfg.cluster.signal_s:
        return "\n".join(lines + ["exec " + shell_line(srun)]) + "\n"
    return "\n".join(lines + [shell_line(srun)] + requeue_lines(output.parent)) + "\n"  # output: the run folder's


def rank_env(cfg: RunConfig, *, run_id: str, home: Path, telemetry: str,
             extra: dict[str, str] | None = None) -> dict[str, str]:
    """What every rank needs from the launcher (exported in the script, so it is there on every node)."""
    env = {"WORKBENCH_RUN_ID": run_id, "WORKBENCH_HOME": str(home), "WORKBENCH_TELEMETRY": telemetry,
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1",
           ALLOC_CONF: cuda_alloc_conf()}
    if cfg.cluster.signal_s:
        env[PREEMPTIBLE_ENV] = "1"
    return {**env, **(extra or {})}


def dry_run(cfg: RunConfig, *, home: str | Path | None = None, run_id: str | None = None) -> str:
    """The batch script and srun line a run would be submitted with; nothing is written or submitted."""
    from profilers.store import default_home

    home = Path(home) if home else default_home()
    run_id = run_id or f"{cfg.name}-<id>"
    run_dir = home / "runs" / run_id
    srun = job_srun(cfg, run_dir / "config.json", run_dir)
    env = rank_env(cfg, run_id=run_id, home=home, telemetry=f"{telemetry_host(cfg)}:<port>")
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


def require_sbatch() -> None:
    """SlurmError in one line unless Slurm's `sbatch` is on PATH: checked before a run is registered."""
    import shutil

    if shutil.which("sbatch") is None:
        raise SlurmError("--launcher slurm: `sbatch` is not on PATH; install Slurm's client commands "
                         "(Debian: slurm-client) or load your site's Slurm module, or use --launcher local")


def _slurm(*cmd: str, timeout: float = 30, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(cmd), env={**client_env(), **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)
    except FileNotFoundError:
        raise SlurmError(f"`{cmd[0]}` not found: --launcher slurm needs Slurm's client commands on PATH") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(cmd)}` did not answer within {timeout:.0f} s (is slurmctld up?)") from None


def submit(script: Path, *, secret_env: dict[str, str] | None = None) -> str:
    """sbatch the script; returns the job id. `secret_env` (the telemetry token) reaches the job through
    sbatch's environment (--export=ALL, Slurm's default), so it is never written into the script file."""
    out = _slurm("sbatch", "--parsable", "--export=ALL", str(script), env=secret_env)
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


def _query(job_id: str) -> JobState | None:
    """One look: scontrol, then squeue. None when neither answered (a busy or restarting controller);
    UNKNOWN only when Slurm says it does not know the job (purged MinJobAge after its end)."""
    said = []
    try:
        out = _slurm("scontrol", "show", "job", "-o", job_id)
        if out.returncode == 0 and "JobState=" in out.stdout:
            f = parse_scontrol(out.stdout)
            return JobState(job_id, f.get("JobState", "UNKNOWN"), f.get("Reason", "None"), f.get("ExitCode", "0:0"),
                            _epoch(f.get("SubmitTime")), _epoch(f.get("StartTime")) if f.get("JobState") not in QUEUED
                            else None, _epoch(f.get("EndTime")))
        said.append(out.stderr)
        out = _slurm("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T|%r|%V|%S|%e")
    except SlurmError as exc:  # a query that did not answer in time
        log.warning("slurm: %s", exc)
        return None
    parts = out.stdout.strip().split("|")
    if out.returncode == 0 and len(parts) == 5:
        state = parts[0]
        return JobState(job_id, state, parts[1], "?", _epoch(parts[2]), None if state in QUEUED else _epoch(parts[3]),
                        _epoch(parts[4]))
    said.append(out.stderr)
    if any("Invalid job id" in text for text in said) or (out.returncode == 0 and not out.stdout.strip()):
        return JobState(job_id, "UNKNOWN")
    log.warning("slurm: no answer about job %s: %s", job_id, " | ".join(t.strip() for t in said if t.strip()))
    return None


def job_state(job_id: str, *, patience_s: float = QUERY_PATIENCE_S) -> JobState:
    """The job's state now; UNKNOWN once Slurm forgot it (MinJobAge after its end).

    A query neither scontrol nor squeue answers is retried with backoff (0.5 s doubling to 8 s):
    a busy controller must never end a trial. After `patience_s` without an answer: SlurmError."""
    deadline, delay = time.monotonic() + patience_s, 0.5
    while True:
        state = _query(job_id)
        if state is not None:
            return state
        if time.monotonic() + delay > deadline:
            raise SlurmError(f"Slurm did not answer about job {job_id} for {patience_s:.0f} s "
                             "(scontrol and squeue failed; is slurmctld up?)")
        time.sleep(delay)
        delay = min(2 * delay, 8.0)


def cancel(job_id: str, *, wait_s: float = 120.0) -> JobState:
    """scancel the job and wait until Slurm has no step of it left (its processes are gone then).
    scancel and the queries are retried while the controller does not answer; SlurmError if the job
    is still there after `wait_s`."""
    deadline, delay = time.monotonic() + wait_s, 0.5
    while True:
        try:
            out = _slurm("scancel", job_id)
            if out.returncode == 0 or "Invalid job id" in out.stderr:
                break
        except SlurmError:
            pass
        if time.monotonic() + delay > deadline:
            raise SlurmError(f"scancel {job_id} failed for {wait_s:.0f} s: job {job_id} may still hold its nodes")
        time.sleep(delay)
        delay = min(2 * delay, 8.0)
    state = job_state(job_id, patience_s=max(deadline - time.monotonic(), 1.0))
    while state.state in QUEUED + RUNNING:
        if time.monotonic() > deadline:
            raise SlurmError(f"job {job_id} is still {state.state} {wait_s:.0f} s after scancel")
        time.sleep(POLL_S)
        state = job_state(job_id, patience_s=max(deadline - time.monotonic(), 1.0))
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
    from engine.launch.run_record import finish, register, telemetry_summary
    from profilers.telemetry import TOKEN_ENV, TelemetryServer

    require_sbatch()
    store, run_id, run_dir, cfg_path = register(cfg, home=home, run_id=run_id, parent=parent)
    home = run_dir.parent.parent
    server = TelemetryServer(store, run_id=run_id, host=telemetry_host(cfg))
    srun = job_srun(cfg, cfg_path, run_dir)
    env = rank_env(cfg, run_id=run_id, home=home, telemetry=server.start(), extra=extra_env)
    script = run_dir / "job.sbatch"
    script.write_text(batch_script(cfg, job_name=run_id, output=run_dir / "slurm-%j.out", env=env, srun=srun))
    started = time.time()
    try:
        job_id = submit(script, secret_env={TOKEN_ENV: server.token})
    except SlurmError as exc:  # refused (a partition that does not exist, a time over the limit): no job
        server.stop()
        return finish(store, run_id, "failed", cfg, run_dir, started, RankFailure(None, str(exc)), raise_on_failure)
    state = None
    try:
        store.update_run(run_id, summary={"slurm_job_id": job_id})
        status, state = _follow(job_id, store, run_id, timeout_s, on_progress, on_job, server)
    except BaseException as exc:  # Ctrl-C, a pruned trial, a dead controller: no job may outlive the run
        state = _cancel_or_keep(job_id, None)
        server.stop()
        from engine.launch.run_record import stop_status

        status, reason = stop_status(exc)
        store.finish_run(run_id, status, error=reason, summary=state.to_dict() if state else None)
        if on_job and state:
            on_job(state)
        raise
    if state.phase != "done" or state.state == "UNKNOWN":  # our timeout, a store failure: the job may still run
        state = _cancel_or_keep(job_id, state)
    server.stop()
    if on_job:
        on_job(state)
    status, failure = _outcome(status, state, run_dir, server, timeout_s)
    return finish(store, run_id, status, cfg, run_dir, started, failure, raise_on_failure,
                  extra_summary={**state.to_dict(), **telemetry_summary(server)})


def _cancel_or_keep(job_id: str, state: JobState | None) -> JobState | None:
    """Cancel the job and wait until none of it is left; if Slurm never answers, log it and keep `state`
    (the run's own outcome is what the user needs to read, not the controller's)."""
    try:
        return cancel(job_id)
    except SlurmError as exc:
        log.error("slurm: %s", exc)
        return state


def _outcome(status: str, state: JobState, run_dir: Path, server, timeout_s: float | None):
    """(final status, root cause or None) of a job that has ended."""
    from engine.errors import RankFailure
    from engine.launch.run_record import first_failure

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
    """Poll the job until it ends; report each phase change, new steps and our own timeout. The end is logged
    with every state the job went through (a requeued job: ... -> RUNNING -> PENDING -> ...)."""
    last_phase, last_step, running_since, seen = None, -1, None, []
    while True:
        state = job_state(job_id)
        if not seen or seen[-1] != state.state:
            seen.append(state.state)
        if state.phase != last_phase:
            last_phase = state.phase
            if state.phase == "running" and state.started:
                store.update_run(run_id, started=state.started)  # the run's clock starts when the job does
                running_since = time.time()
            if on_job is not None:
                on_job(state)
        if state.phase == "done" or state.state == "UNKNOWN":
            log.log(logging.INFO if state.state == "COMPLETED" else logging.WARNING,
                    "slurm: job %s ended %s (reason %s, exit code %s); its states: %s", job_id, state.state,
                    state.reason, state.exit_code, " -> ".join(seen))
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
