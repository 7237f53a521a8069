"""The entry point of one rank, started by torchrun: `python -m engine.launch.worker --config run.json`.

Works under our launcher (which sets WORKBENCH_TELEMETRY and WORKBENCH_RUN_ID) and under an
external torchrun (multi-node), where rank 0 registers the run in the store itself.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config.schema import from_dict, load_yaml, validate
from engine.device import init_distributed, pick_backend, pick_device, use_default_cuda_allocator
from engine.errors import ConfigError
from engine.launch import preempt
from engine.launch.faults import from_env
from engine.launch.parent_death import die_with_parent
from engine.launch.run_record import first_failure, run_host, run_summary
from engine.mesh import ParallelDims, world_product
from engine.train import checkpoint as ckpt
from engine.train.live import KnobChannel, StopRun
from engine.train.trainer import Trainer
from profilers.host import HostSampler, software_versions
from profilers.store import RunStore, default_home
from profilers.telemetry import TOKEN_ENV, TelemetryClient


def _error_file(run_dir: Path, rank: int) -> Path:
    return run_dir / f"error-rank{rank}.json"


def write_error(run_dir: Path, rank: int, exc: BaseException) -> None:
    """Leave this rank's failure where the launcher finds it (first failure wins by time)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    payload = {"rank": rank, "reason": f"{type(exc).__name__}: {exc}", "time": time.time(),
               "traceback": "".join(traceback.format_exception(exc))}
    _error_file(run_dir, rank).write_text(json.dumps(payload))


def _load(path: str) -> dict:
    if path.endswith(".json"):
        return json.loads(Path(path).read_text())
    return load_yaml(path)


def _init(cfg, rank: int, world: int) -> torch.device:
    backend = pick_backend(cfg.backend)
    device = pick_device(backend, int(os.environ.get("LOCAL_RANK", 0)))
    if world > 1:  # the world group on `backend` and the CPU-capable host group beside it
        init_distributed(backend, rank=rank, world_size=world, timeout_s=cfg.train.timeout_s, device=device)
    return device


def _register_external_run(cfg, run_id: str, world: int, config_path: str) -> None:
    """Under an outside torchrun nobody else creates the run row: rank 0 does, as `launch` would.
    `cfg` is None when the config itself was refused: the run is still recorded, then failed."""
    with RunStore.open_home() as store:
        if store.run(run_id) is not None:
            return
        if cfg is None:
            store.create_run(run_id, name=Path(config_path).stem, config={}, world_size=world, host=run_host())
            return
        p = cfg.parallel
        store.create_run(run_id, name=cfg.name, config=cfg.to_dict(), world_size=world,
                         layout=ParallelDims(p.dp, p.tp, p.pp, cfg.world_size, cp=p.cp).describe(), host=run_host(),
                         versions=software_versions(), emulated=cfg.link.gbps > 0 or bool(cfg.link.groups))


def _finish_external_run(cfg, run_id: str, run_dir: Path, ok: bool) -> None:
    """Rank 0 of an outside torchrun finalises the row like `launch` does: status, summary, root cause.
    It runs after every rank's telemetry is flushed (success: after the barrier; failure: the failing
    rank wrote its error file before exiting, which is what stopped this rank)."""
    failure = None if ok else first_failure(run_dir)
    with RunStore.open_home() as store:
        summary = run_summary(store, run_id, cfg, run_dir) if cfg is not None else {}
        store.finish_run(run_id, "completed" if ok else "failed", error=str(failure) if failure else None,
                         error_rank=failure.rank if failure else None, summary=summary)


def _run_id() -> str:
    """Ours, else torchrun's --rdzv-id (its default "none" is shared by every launch: then the rendezvous
    port, which torchrun picks afresh per launch and gives every rank), else a fresh one (a single process)."""
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    if elastic == "none" and os.environ.get("MASTER_PORT"):
        elastic = f"torchrun-{os.environ.get('MASTER_ADDR', 'localhost')}-{os.environ['MASTER_PORT']}"
    return os.environ.get("WORKBENCH_RUN_ID") or elastic or uuid.uuid4().hex[:12]


def _samplers(cfg, client, local_rank: int, current_step: Callable[[], int] = lambda: -1) -> list:
    """Host and (local rank 0) NVML samplers whose samples carry the step running when taken."""
    from profilers.nvml import NvmlSampler

    def emit(kind: str, name: str, value: float) -> None:
        client.emit(current_step(), kind, name, value)

    out = []
    if cfg.profile.host_interval_s > 0:
        out.append(HostSampler(interval=cfg.profile.host_interval_s, emit=emit))
    if cfg.profile.nvml_interval_s > 0 and local_rank == 0:
        out.append(NvmlSampler(interval=cfg.profile.nvml_interval_s, emit=emit))
    for s in out:
        s.start()
    return out


def _preemption(cfg, run_dir: Path):
    """In a job that asked for Slurm's warning signal: (the installed handler, the checkpoint to resume from
    or None); else None."""
    if not preempt.enabled():
        return None
    handler = preempt.Preemption().install()
    return handler, (None if cfg.train.resume_from else preempt.resume_point(ckpt.checkpoint_folder(cfg, run_dir)))


class Terminated(BaseException):
    """The launcher stopped this rank (SIGTERM), usually because another rank failed. A BaseException, as
    KeyboardInterrupt is: code that must never raise into training (`except Exception` in the telemetry
    client and the collective profiler) would otherwise swallow it and the rank would train on."""


def _on_sigterm(signum, frame) -> None:
    raise Terminated("terminated by the launcher (SIGTERM)")


def _wind_down() -> None:
    """From here the rank only records its outcome: a launcher's SIGTERM (torchrun sends one as soon as a
    peer fails) must not cut that short; the writes are brief and the launcher SIGKILLs after its grace."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _end_ranks(ok: bool, rank: int, run_dir: Path) -> bool:
    """Wait for every rank (their telemetry is flushed by then) and leave the group; False if a peer
    failed meanwhile (gloo reports the closed connection, or the group's timeout fires)."""
    if not (ok and dist.is_initialized()):
        return ok
    try:
        dist.barrier()
        dist.destroy_process_group()
        return True
    except BaseException as exc:  # noqa: BLE001 - a peer's failure reaches us here
        write_error(run_dir, rank, exc)
        return False


def _finish_outside_run(cfg, run_id: str, run_dir: Path, ok: bool, config_path: str, world: int) -> None:
    try:  # SIGTERM is ignored by now (_wind_down): the outcome is written to the end
        _register_external_run(cfg, run_id, world, config_path)  # a no-op unless refused before registering
        _finish_external_run(cfg, run_id, run_dir, ok)
    except BaseException as exc:  # noqa: BLE001 - the store must not turn a finished run into a crash
        print(f"[rank 0] could not finalise run {run_id} in the store: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """One rank, from start to its exit code (0: it trained; 1: it failed, its error written)."""
    ap = argparse.ArgumentParser(prog="engine.launch.worker")
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", default=None)
    args = ap.parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    use_default_cuda_allocator()  # `launch` passes it; an outside torchrun does not
    signal.signal(signal.SIGTERM, _on_sigterm)  # unwind through `finally`: telemetry is flushed
    die_with_parent()  # a killed torchrun takes its ranks with it
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    external = not os.environ.get("WORKBENCH_TELEMETRY")
    run_id = _run_id()
    run_dir = Path(args.run_dir) if args.run_dir else default_home() / "runs" / run_id  # honours WORKBENCH_HOME

    client = TelemetryClient(os.environ.get("WORKBENCH_TELEMETRY") or None, run_id, rank,
                             token=os.environ.get(TOKEN_ENV))
    samplers: list = []
    ok, cfg = False, None
    try:
        cfg = validate(from_dict(_load(args.config)))
        if external and rank == 0:
            _register_external_run(cfg, run_id, world, args.config)
        if cfg.world_size != world:
            raise ConfigError("parallel", f"{world_product(cfg.parallel.cp)}={cfg.world_size}",
                              f"must equal WORLD_SIZE={world} of the launcher")
        device = _init(cfg, rank, world)
        client.emit(-1, "node", "node_rank", float(os.environ.get("WORKBENCH_NODE_RANK", 0)))  # which node ran it
        running = [-1]  # the step in progress: samples taken during it carry its number
        samplers = _samplers(cfg, client, int(os.environ.get("LOCAL_RANK", 0)), lambda: running[0])
        fault = from_env()
        preemption = _preemption(cfg, run_dir)
        if preemption is not None and preemption[1] is not None:  # a requeued job: continue where it stopped
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume_from=str(preemption[1])))
        trainer = Trainer(cfg, device=device, emit=client.emit, flush=client.flush, run_dir=run_dir)
        channel = KnobChannel(run_dir, cfg.live.every, cfg.live.wait_s) if cfg.live.every else None

        def boundary(t, step: int) -> None:
            running[0] = step
            if fault:
                fault.maybe_fire(rank, step)
            if channel:
                channel(t, step)
            if preemption is not None and step > t.start_step and preemption[0].agreed():
                client.emit(step, "event", "preempted", 1.0)
                preempt.checkpoint_and_leave(t.rank_state(), step, ckpt.checkpoint_folder(cfg, run_dir), run_dir,
                                             rank)

        try:
            for _ in trainer.run(on_boundary=boundary):
                pass
        except (StopRun, preempt.Preempted):
            pass
        ok = True
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the launcher with its rank
        _wind_down()
        write_error(run_dir, rank, exc)
        client.emit(-1, "event", "error", 1.0)
        print(f"[rank {rank}] {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    finally:
        _wind_down()
        for s in samplers:
            s.stop()
        client.close()
    ok = _end_ranks(ok, rank, run_dir)
    if external and rank == 0:
        _finish_outside_run(cfg, run_id, run_dir, ok, args.config, world)
    sys.stdout.flush()
    sys.stderr.flush()
    return 0 if ok else 1


def _own_signals() -> None:
    """A rank forked by engine.launch.agent inherits the elastic agent's handlers (SIGINT, SIGHUP and SIGQUIT
    raise its SignalException, an Exception that `except Exception` would swallow): back to Python's own."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


if __name__ == "__main__":
    import multiprocessing

    if multiprocessing.parent_process() is None:
        # ranks sometimes abort at interpreter exit after correct work (platform.md): leave at once
        os._exit(main())
    _own_signals()  # forked by engine.launch.agent: torch's elastic wrapper takes the exit code from SystemExit
    code = main()  # (os._exit would leave the agent waiting for a result that never comes)
    # a rank that trained then waits for the agent to read its result; an agent stopping instead (its launcher
    # died) SIGTERMs it, which _wind_down ignored: without this the agent waited 30 s to SIGKILL it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.exit(code)
