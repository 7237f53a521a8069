"""launch(): run the ranks of one config through torch's elastic launcher (torchrun).

The launcher process owns the run's row in the store and the one telemetry writer; the ranks run
in their own process session so that success, a rank failure, Ctrl-C or a timeout all end with
no process left behind. A failing rank's exception comes back as RankFailure(rank, traceback).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.config.schema import RunConfig, validate
from engine.device import ALLOC_CONF, cuda_alloc_conf
from engine.errors import JoinTimeout, RankFailure
from engine.launch.parent_death import die_with_parent
from engine.launch.run_record import RunResult, finish, first_failure, register, stop_status, telemetry_summary
from engine.launch.torchrun import RDZV_TIMEOUT_S, torchrun_command

Progress = Callable[[dict[str, Any]], None]
# "exec": a run whose ranks fork starts its agent as an interpreter of its own, not from the launcher's agent
# server (engine/launch/agent_server.py); bench/agent_server.py compares the two
AGENT_START_ENV = "WORKBENCH_AGENT_START"


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


def forks_ranks(cfg: RunConfig, *, nnodes: int, rdzv_endpoint: str | None) -> bool:
    """Whether this node's ranks fork from the torchrun agent (engine/launch/agent.py) instead of each starting
    its own interpreter: single-node gloo runs. NCCL ranks start as torchrun starts them (a fork from a
    process that has touched CUDA cannot use it; that path is the one the GPU checks ran), and so do the
    nodes of a multi-node run, whose line is the one `workbench export --format torchrun` prints."""
    from engine.device import pick_backend

    if os.environ.get("WORKBENCH_RANK_START") == "spawn":  # every rank its own interpreter, as torchrun does
        return False
    return nnodes == 1 and rdzv_endpoint is None and pick_backend(cfg.backend) == "gloo"


def _preflight(cfg: RunConfig, device_memory_gib: float | None) -> None:
    """engine/train/dryrun.py `preflight` where the run has a device memory to fit; a CPU run has none, and its
    launcher then never imports the dry run's torch (about 2 s of a `workbench run`'s or `tune`'s CPU)."""
    from engine.train.memory import device_memory_target

    if device_memory_target(cfg, device_memory_gib) is not None:
        from engine.train.dryrun import preflight

        preflight(cfg, device_memory_gib=device_memory_gib)


def launch(cfg: RunConfig, *, home: str | Path | None = None, run_id: str | None = None, nnodes: int = 1,
           node_rank: int = 0, rdzv_endpoint: str | None = None, timeout_s: float | None = None,
           on_progress: Progress | None = None, parent: str | None = None, raise_on_failure: bool = True,
           extra_env: dict[str, str] | None = None, launcher: str = "local",
           on_job: Callable[[Any], None] | None = None, rdzv_timeout_s: float = RDZV_TIMEOUT_S,
           device_memory_gib: float | None = None) -> RunResult:
    """Validate, register the run, start the ranks, stream telemetry into the store, wait.
    launcher="slurm" submits the run as one Slurm job of cfg.cluster instead (engine/launch/slurm.py);
    `on_job` then hears each change of the job's state (queued, running, done). A run targeting
    GPUs (or `device_memory_gib` per rank) is dry-run first and refused in one line if its busiest
    rank would not fit (engine/train/dryrun.py `preflight`), before anything is registered or started."""
    from profilers.telemetry import TOKEN_ENV, TelemetryServer

    validate(cfg)
    if launcher == "slurm":
        from engine.launch.slurm import launch_slurm

        _preflight(cfg, device_memory_gib)
        return launch_slurm(cfg, home=home, run_id=run_id, timeout_s=timeout_s, on_progress=on_progress,
                            parent=parent, raise_on_failure=raise_on_failure, extra_env=extra_env, on_job=on_job)
    if launcher != "local":
        raise ValueError(f"launcher={launcher!r} must be local or slurm")
    if cfg.world_size % nnodes:
        raise ValueError(f"world size {cfg.world_size} is not divisible by nnodes={nnodes}")
    from engine.device import check_ranks_fit_gpus

    check_ranks_fit_gpus(cfg.backend, cfg.world_size // nnodes)  # the GPUs there are, before any dry run of them
    _preflight(cfg, device_memory_gib)
    store, run_id, run_dir, cfg_path = register(cfg, home=home, run_id=run_id, parent=parent, join=nnodes > 1)
    home = run_dir.parent.parent
    server = TelemetryServer(store, run_id=run_id)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1",
           ALLOC_CONF: cuda_alloc_conf(),
           "WORKBENCH_TELEMETRY": server.start(), "WORKBENCH_RUN_ID": run_id, "WORKBENCH_HOME": str(home),
           "WORKBENCH_NODE_RANK": str(node_rank), **(extra_env or {}), TOKEN_ENV: server.token}
    cmd = torchrun_command(cfg_path, run_dir, nproc=cfg.world_size // nnodes, nnodes=nnodes,
                           node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_timeout_s=rdzv_timeout_s)
    forked = forks_ranks(cfg, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint)
    started = time.time()
    status, failure = "completed", None
    log_path = run_dir / ("launcher.log" if nnodes == 1 else f"launcher-node{node_rank}.log")  # one per node
    with open(log_path, "w") as log:
        if forked and os.environ.get(AGENT_START_ENV) != "exec":  # forked by this process's agent server
            from engine.launch.agent_server import start_agent

            proc = start_agent(cmd[cmd.index("torch.distributed.run") + 1:], env=env, log_path=str(log_path))
        else:
            if forked:  # the agent as an interpreter of its own, its ranks forked from it
                cmd[cmd.index("torch.distributed.run")] = "engine.launch.agent"
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
        failure = first_failure(run_dir, log_text)
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


