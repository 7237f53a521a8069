"""StepTimer: where one training step's time goes, per rank.

Phases: data, forward, backward, optimizer, comm_exposed, bubble, other. ``other`` is the step
time minus the named phases, so the parts always add up to the step time. A phase may be
entered several times in a step (one forward per micro-batch): its times add up.

On CPU the timer uses ``time.perf_counter``. On CUDA it records a pair of CUDA events per phase
and resolves them lazily in `StepTimer.end_step`, which synchronises once on the step's end
event; nothing in the hot path synchronises. With ``cuda_events=False`` on CUDA it falls back
to perf_counter plus a ``torch.cuda.synchronize()`` at every phase boundary: exact wall times,
at the cost of serialising the host with the device.

Time measured elsewhere joins the breakdown through `move` (re-attribute seconds from one
phase to another). On CUDA such time is a span between two `mark`s (CUDA events on the stream
the work ran on) and `move` takes a function that `end_step` calls after its synchronise, when
the events can be read; a host clock around asynchronous launches is never used there.

Overhead budget: two perf_counter calls (or two event records) per phase, a few microseconds
per step; one device synchronise per step on CUDA.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from profilers.records import PHASES

if TYPE_CHECKING:  # torch loads with a StepTimer: `workbench show` reads `unexplained` without it
    import torch


def as_metrics(breakdown: dict[str, float]) -> dict[str, float]:
    """Phase seconds as telemetry names with their unit: ``{"forward(s)": 0.12, ...}``."""
    return {f"{phase}(s)": seconds for phase, seconds in breakdown.items()}


class StepTimer:
    """Per-step phase breakdown in seconds; see the module docstring."""

    def __init__(self, device: torch.device | str = "cpu", *, cuda_events: bool = True,
                 enabled: bool = True) -> None:
        import torch

        self.device = torch.device(device)
        self.enabled = enabled
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._events = self._cuda and cuda_events
        self._sync = self._cuda and not cuda_events
        self._host: dict[str, float] = defaultdict(float)
        self._pairs: list[tuple[str, Any, Any]] = []
        self._moves: list[tuple[str, str, float | Callable[[], float]]] = []
        self._last_end: dict[str, Any] = {}
        self._t0 = 0.0
        self._start_event: Any = None
        self._in_step = False
        self.step_time = 0.0
        """The last step's total time in seconds (the sum of `end_step`'s values)."""

    def start_step(self) -> None:
        """Begin a step: the clock for ``other`` and the step time starts here."""
        if not self.enabled:
            return
        self._host.clear()
        self._pairs.clear()
        self._moves.clear()
        self._last_end.clear()
        self._in_step = True
        if self._events:
            self._start_event = self._event()
        else:
            self._barrier()
            self._t0 = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the enclosed code as phase ``name`` (adds up if entered several times)."""
        if not (self.enabled and self._in_step):
            yield
            return
        if name == "other":
            raise ValueError("phase 'other' is computed as step time minus the named phases")
        if self._events:
            start = self._event()
            try:
                yield
            finally:
                end = self._last_end[name] = self._event()
                self._pairs.append((name, start, end))
            return
        self._barrier()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._barrier()
            end = self._last_end[name] = time.perf_counter()
            self._host[name] += end - t0

    def mark(self) -> Any:
        """Now on this timer's clock: a CUDA event recorded on the current stream, or a
        perf_counter float; None when the timer is off or outside a step."""
        if not (self.enabled and self._in_step):
            return None
        if self._events:
            return self._event()
        self._barrier()
        return time.perf_counter()

    def last_end(self, name: str) -> Any:
        """The mark at which phase ``name`` last ended in this step (None if it did not run)."""
        return self._last_end.get(name)

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two marks, 0.0 if either is None; CUDA marks only from `end_step` on."""
        if start is None or end is None:
            return 0.0
        if self._events:
            return start.elapsed_time(end) / 1000.0
        return end - start

    def move(self, src: str, dst: str, seconds: float | Callable[[], float]) -> None:
        """Re-attribute ``seconds`` measured inside phase ``src`` to phase ``dst`` at `end_step`.

        Pass a function to defer reading CUDA events until `end_step` has synchronised.
        """
        if self.enabled and self._in_step:
            if "other" in (src, dst):
                raise ValueError("phase 'other' is computed as step time minus the named phases")
            self._moves.append((src, dst, seconds))

    def add(self, name: str, seconds: float) -> None:
        """Add time measured elsewhere (e.g. exposed communication) to phase ``name``."""
        if self.enabled and self._in_step:
            if name == "other":
                raise ValueError("phase 'other' is computed as step time minus the named phases")
            self._host[name] += float(seconds)

    def end_step(self) -> dict[str, float]:
        """End the step and return ``{phase: seconds}`` for every phase, ``other`` included.

        The values add up to the step time (`step_time`). ``other`` is negative only if
        time passed to `add` overlaps timed phases.
        """
        if not (self.enabled and self._in_step):
            return {}
        self._in_step = False
        if self._events:
            end = self._event()
            end.synchronize()  # the one synchronise per step: resolves every event before it
            total = self._start_event.elapsed_time(end) / 1000.0
            for name, start, stop in self._pairs:
                self._host[name] += start.elapsed_time(stop) / 1000.0
        else:
            self._barrier()
            total = time.perf_counter() - self._t0
        for src, dst, seconds in self._moves:
            moved = float(seconds() if callable(seconds) else seconds)
            if moved > 0:
                self._host[src] -= moved
                self._host[dst] += moved
        out = {phase: 0.0 for phase in PHASES}
        out.update(self._host)
        named = sum(v for k, v in out.items() if k != "other")
        out["other"] = total - named
        self.step_time = total
        return out

    def _event(self) -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _barrier(self) -> None:
        if self._sync:
            import torch

            torch.cuda.synchronize(self.device)


def unexplained(breakdown: dict[str, float], wall_s: float) -> float:
    """Fraction of a step's wall time that its timed phases do not explain.

    ``wall_s`` must be measured independently of the timer (the trainer's own clock around
    the step, ``wall_time(s)``): ``other`` is left out, since it is computed as whatever the
    named phases miss and would make any breakdown add up. Positive: time no phase measured
    (e.g. a phase dropped); negative: phases overlapping or counted twice.
    """
    named = sum(v for k, v in breakdown.items() if k != "other")
    return (wall_s - named) / wall_s if wall_s > 0 else 0.0


def check_breakdown(breakdown: dict[str, float], wall_s: float, *, tolerance: float = 0.02,
                    slack_s: float = 1e-3) -> str | None:
    """None when the named phases add up to ``wall_s`` within ``tolerance`` (plus ``slack_s``
    of clock reads between phases); else one line saying what is missing."""
    named = sum(v for k, v in breakdown.items() if k != "other")
    if abs(wall_s - named) <= tolerance * wall_s + slack_s:
        return None
    return (f"breakdown phases sum to {named:.4f} s but the step took {wall_s:.4f} s: "
            f"{unexplained(breakdown, wall_s):+.1%} unexplained (tolerance {tolerance:.0%})")
