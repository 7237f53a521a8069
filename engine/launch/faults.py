"""Fault injection for reliability tests: WORKBENCH_FAULT="rank=1,step=2,kind=raise".

kind: raise (an exception in that rank), kill (SIGKILL to itself), hang (sleep forever inside the
step, so the other ranks block in a collective until the process-group timeout), oom (raise the
CUDA out-of-memory error type). Unset in normal use; read once per rank.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass


class InjectedFault(RuntimeError):
    """The exception an injected `raise` fault throws."""


@dataclass(frozen=True, slots=True)
class Fault:
    rank: int
    step: int
    kind: str

    def maybe_fire(self, rank: int, step: int) -> None:
        if rank != self.rank or step != self.step:
            return
        if self.kind == "raise":
            raise InjectedFault(f"injected fault at step {step}")
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            while True:
                time.sleep(3600)
        if self.kind == "oom":
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory (injected)")


def from_env() -> Fault | None:
    spec = os.environ.get("WORKBENCH_FAULT")
    if not spec:
        return None
    parts = dict(item.split("=", 1) for item in spec.split(","))
    return Fault(rank=int(parts.get("rank", 0)), step=int(parts.get("step", 0)), kind=parts.get("kind", "raise"))
