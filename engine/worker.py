"""The entry point of one rank, started by torchrun: `python -m engine.worker --config run.json`.

Works under our launcher (which sets WORKBENCH_TELEMETRY and WORKBENCH_RUN_ID) and under an
external torchrun (multi-node), where rank 0 registers the run in the store itself.
"""
from __future__ import annotations

import argparse
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

from engine.config import from_dict, load_yaml, validate
from engine.device import init_distributed, pick_backend, pick_device
from engine.errors import ConfigError


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


def _register_external_run(cfg, run_id: str, world: int) -> None:
    """Under an external torchrun nobody else creates the run row: rank 0 does."""
    from profilers.host import host_info
    from profilers.store import RunStore

    store = RunStore.open_home()
    if store.run(run_id) is None:
        store.create_run(run_id, name=cfg.name, config=cfg.to_dict(), world_size=world, host=host_info(),
                         emulated=cfg.link.gbps > 0)


def _samplers(cfg, client, local_rank: int, current_step: Callable[[], int] = lambda: -1) -> list:
    """Host and (local rank 0) NVML samplers whose samples carry the step running when taken."""
    from profilers.host import HostSampler
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


class Terminated(Exception):
    """The launcher stopped this rank (SIGTERM), usually because another rank failed."""


def _on_sigterm(signum, frame) -> None:
    raise Terminated("terminated by the launcher (SIGTERM)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="engine.worker")
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", default=None)
    args = ap.parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    signal.signal(signal.SIGTERM, _on_sigterm)  # unwind through `finally`: telemetry is flushed
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    external = not os.environ.get("WORKBENCH_TELEMETRY")
    run_id = os.environ.get("WORKBENCH_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex[:12]
    run_dir = Path(args.run_dir or Path(".workbench") / "runs" / run_id)
    from profilers.telemetry import TelemetryClient

    client = TelemetryClient(os.environ.get("WORKBENCH_TELEMETRY") or None, run_id, rank)
    samplers: list = []
    ok = False
    try:
        cfg = validate(from_dict(_load(args.config)))
        if cfg.world_size != world:
            raise ConfigError("parallel", f"dp*tp*pp={cfg.world_size}",
                              f"must equal WORLD_SIZE={world} of the launcher")
        device = _init(cfg, rank, world)
        if external and rank == 0:
            _register_external_run(cfg, run_id, world)
        running = [-1]  # the step in progress: samples taken during it carry its number
        samplers = _samplers(cfg, client, int(os.environ.get("LOCAL_RANK", 0)), lambda: running[0])
        from engine.train import Trainer

        from engine.faults import from_env

        from engine.live import KnobChannel, StopRun

        fault = from_env()
        trainer = Trainer(cfg, device=device, emit=client.emit, flush=client.flush, run_dir=run_dir)
        channel = KnobChannel(run_dir, cfg.live.every, cfg.live.wait_s) if cfg.live.every else None

        def boundary(t, step: int) -> None:
            running[0] = step
            if fault:
                fault.maybe_fire(rank, step)
            if channel:
                channel(t, step)

        try:
            for _ in trainer.run(on_boundary=boundary):
                pass
        except StopRun:
            pass
        ok = True
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the launcher with its rank
        write_error(run_dir, rank, exc)
        client.emit(-1, "event", "error", 1.0)
        print(f"[rank {rank}] {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    finally:
        for s in samplers:
            s.stop()
        client.close()
    if ok and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # ranks sometimes abort at interpreter exit after correct work (platform.md): leave at once
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()
