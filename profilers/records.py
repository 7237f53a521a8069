"""The one telemetry record format shared by every profiler, the telemetry path and the store.

A `Record` is one measured value: which run, which rank, which step, what kind of value, its
name (the name carries the unit, e.g. ``step_time(s)``), the value and the Unix time it was
taken. ``step`` is -1 for records not tied to a step (host and GPU samples, run-level facts).

Kinds and example names (docs/architecture.md):

| kind        | names                                                                         |
|-------------|-------------------------------------------------------------------------------|
| `step`      | `loss`, `step_time(s)`, `tokens_per_s`, `mfu`, `lr`, `grad_norm`              |
| `breakdown` | `data(s)`, `forward(s)`, `backward(s)`, `optimizer(s)`, `comm_exposed(s)`,    |
|             | `bubble(s)`, `other(s)`                                                       |
| `comm`      | `{op}/bytes`, `{op}/time(s)`, `{op}/busbw(GB/s)`, `wire_bytes`, `dense_bytes` |
| `memory`    | `peak_allocated(GiB)`, `rss(GiB)`, `params(GiB)`, `grads(GiB)`, ...           |
| `gpu`       | `gpu{i}/util(%)`, `gpu{i}/mem_used(GiB)`, `gpu{i}/power(W)`, ...              |
| `host`      | `cpu(%)`, `rss(GiB)`, `sys_mem_used(GiB)`, `net_rx(B/s)`, `net_tx(B/s)`       |
| `eval`      | `val_loss`                                                                    |
| `knob`      | a knob changed at a step boundary, e.g. `comm.density`                        |
| `moe`       | `tokens/e{i}` (tokens this rank routed to expert i), `drop_rate`, `imbalance` |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KINDS: tuple[str, ...] = ("step", "breakdown", "comm", "memory", "gpu", "host", "eval", "knob", "moe")
"""The record kinds the dashboard knows; other kinds are stored but not specially drawn."""

PHASES: tuple[str, ...] = ("data", "forward", "backward", "optimizer", "comm_exposed", "bubble", "other")
"""Named phases of a step (`breakdown` records: `{phase}(s)`), in display order; ``other`` is computed, never timed."""

NO_STEP = -1
"""The step of a record not tied to a training step."""


@dataclass(slots=True)
class Record:
    """One telemetry value.

    Attributes:
        run_id: the run this value belongs to.
        rank: the global rank that measured it (0 for node-level samplers run on rank 0).
        step: the training step, or -1 (`NO_STEP`) for values not tied to a step.
        kind: the record kind (see `KINDS`).
        name: the value's name with its unit, e.g. ``forward(s)`` or ``all_reduce/bytes``.
        value: the measured value as a float.
        time: Unix seconds when it was measured.
    """

    run_id: str
    rank: int
    step: int
    kind: str
    name: str
    value: float
    time: float

    def to_row(self) -> tuple[str, int, int, str, str, float, float]:
        """The record as a tuple in field order (the metrics table's column order)."""
        return (self.run_id, self.rank, self.step, self.kind, self.name, self.value, self.time)

    def to_list(self) -> list[Any]:
        """The record as a JSON-friendly list in field order (the wire format)."""
        return [self.run_id, self.rank, self.step, self.kind, self.name, self.value, self.time]

    @classmethod
    def from_row(cls, row: tuple[Any, ...] | list[Any]) -> Record:
        """Build a record from a row or wire list in field order, coercing the types."""
        run_id, rank, step, kind, name, value, time = row
        return cls(str(run_id), int(rank), int(step), str(kind), str(name), float(value), float(time))
