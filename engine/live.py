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
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from engine.device import host_group

if TYPE_CHECKING:
    from engine.train import Trainer


class StopRun(Exception):
    """The tuner asked the run to end at this boundary."""


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

    def __call__(self, trainer: Trainer, step: int) -> None:
        if step % self.every:
            return
        index = step // self.every
        msg = [self._await_knobs(index, step) if trainer.rank == 0 else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(msg, src=0, group=host_group())  # host objects: the host group
        answer = msg[0]
        if answer.get("stop"):
            raise StopRun(step)
        trainer.current_step = step
        trainer.apply_knobs(answer.get("knobs", {}))
