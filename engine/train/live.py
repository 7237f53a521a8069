"""The engine's side of live in-job tuning: at every `live.every` steps, rank 0 announces the
boundary and waits for the tuner's next knobs; all ranks apply them at the same step.

The tuner only writes knob files and reads results from the store (data flows one way):
rank 0 writes `boundary-{i}.json`, the tuner answers `knobs-{i}.json` ({"knobs": {...}} or
{"stop": true}); rank 0 broadcasts the answer so every rank switches at the same boundary.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from engine.device import host_group

if TYPE_CHECKING:
    from engine.config.schema import RunConfig

# knobs that change what the model learns, not how fast: only a loss-aware objective can score them
LR_LIKE = ("train.lr", "co2.outer_lr")


def _ddp_hook_reason(cfg: RunConfig) -> str | None:
    """Why the run has no DDP comm hook (the carrier of compression and link emulation), or None."""
    p = cfg.parallel
    if p.dp == 1:
        return "parallel.dp=1 has no gradient communication"
    if cfg.co2.enabled:
        return "co2.enabled=true replaces the DDP gradient hook (CO2 reads its link once, at start)"
    if p.pp > 1 or p.tp > 1 or p.zero >= 2:
        return (f"parallel.pp={p.pp}, tp={p.tp}, zero={p.zero}: gradients do not go through a DDP comm hook "
                "(it needs pp=1, tp=1, zero<=1)")
    return None


def _inert_reason(start: RunConfig, now: RunConfig, key: str) -> str | None:
    """Why live knob `key` cannot act in a run started as `start` once its knobs make it `now`."""
    if key in ("link.gbps", "link.latency_us"):
        if start.link.gbps <= 0:
            return "link.gbps=0 at start installs no link emulator; start the run with link.gbps > 0"
        if key == "link.latency_us" and now.link.gbps <= 0:
            return "link.latency_us does nothing while link.gbps=0 (no emulated link)"
        return _ddp_hook_reason(start)
    if key == "comm.density":
        if start.comm.compressor not in ("topk", "randk"):
            return f"comm.compressor={start.comm.compressor} has no density (topk and randk do)"
        return _ddp_hook_reason(start)
    if key == "comm.rank":
        if start.comm.compressor != "powersgd":
            return f"comm.compressor={start.comm.compressor} has no rank (powersgd does)"
        return _ddp_hook_reason(start)
    if key in ("co2.tau", "co2.outer_lr"):
        if not start.co2.enabled or start.parallel.dp == 1:
            return f"{key} needs CO2 running (co2.enabled=true and parallel.dp > 1)"
        return None
    if key in ("batch.micro", "batch.accum") and start.parallel.pp > 1:
        return f"parallel.pp={start.parallel.pp}: the pipeline fixes its micro-batch count when it is built"
    return None


def inert_knobs(start: RunConfig, knobs: dict[str, Any]) -> dict[str, str]:
    """{knob: why it cannot act} for the live `knobs` in a run started as `start` (empty: all act).

    The one rule for the engine (`apply_live_knobs` refuses them) and the live tuner (it refuses
    such a space before the run, and prunes a segment whose combination makes a knob inert).
    """
    from engine.config.schema import replace

    live = {k: v for k, v in knobs.items() if k != "batch.accum"}
    now = replace(start, live) if live else start
    reasons = {key: _inert_reason(start, now, key) for key in knobs}
    return {key: why for key, why in reasons.items() if why is not None}


class StopRun(Exception):
    """The tuner asked the run to end at this boundary."""


class KnobTarget(Protocol):
    """What the channel drives at a boundary (engine/train/trainer.py's Trainer is one)."""

    rank: int

    def apply_knobs(self, knobs: dict[str, Any], step: int = -1) -> None: ...


class KnobChannel:
    def __init__(self, run_dir: Path, every: int, wait_s: float) -> None:
        self.run_dir, self.every, self.wait_s = run_dir, every, wait_s

    def _await_knobs(self, index: int, step: int) -> dict[str, Any]:
        (self.run_dir / f"boundary-{index}.json").write_text(json.dumps({"step": step, "time": time.time()}))
        answer = self.run_dir / f"knobs-{index}.json"
        deadline = time.time() + self.wait_s
        while not answer.exists():
            if time.time() > deadline:
                raise TimeoutError(f"no knobs from the tuner for boundary {index} (step {step}) "
                                   f"within live.wait_s={self.wait_s:.0f} s")
            time.sleep(0.02)
        return json.loads(answer.read_text())

    def __call__(self, trainer: KnobTarget, step: int) -> None:
        if step % self.every:
            return
        index = step // self.every
        msg = [self._await_knobs(index, step) if trainer.rank == 0 else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(msg, src=0, group=host_group())  # host objects: the host group
        answer = msg[0]
        if answer.get("stop"):
            raise StopRun(step)
        trainer.apply_knobs(answer.get("knobs", {}), step)
