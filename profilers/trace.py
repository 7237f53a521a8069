"""An optional torch.profiler window: steps a..b of one rank exported as a Chrome trace.

The JSON file opens in Perfetto (ui.perfetto.dev) and chrome://tracing; on gloo it shows the
``gloo:all_reduce`` events next to the forward/backward kernels. Call `TraceWindow.step` at
the start of every step and `TraceWindow.close` when training ends (it exports a window that
is still open, e.g. when the run stops before step b).

Each step is a ``ProfilerStep#N`` span (N the training step: `TraceWindow.step` calls
``prof.step()``), and torch adds ``distributedInfo`` (rank, world size, backend) when the
process group is initialised: every rank writes one file into the same folder, which is what
Holistic Trace Analysis's ``TraceAnalysis(trace_dir=...)`` reads.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


class TraceWindow:
    """Profiles steps ``start_step..end_step`` (inclusive) and writes one trace file per rank."""

    def __init__(self, start_step: int, end_step: int, out_dir: str | Path, rank: int, *,
                 record_shapes: bool = False, with_stack: bool = False,
                 profile_memory: bool = False) -> None:
        if end_step < start_step or start_step < 0:
            raise ValueError(f"trace window steps {start_step}..{end_step} must satisfy "
                             "0 <= start_step <= end_step")
        self.start_step, self.end_step = int(start_step), int(end_step)
        self.out_dir, self.rank = Path(out_dir), int(rank)
        self.path: Path | None = None
        self._options = {"record_shapes": record_shapes, "with_stack": with_stack,
                         "profile_memory": profile_memory}
        self._prof: Any = None
        self._done = False

    @property
    def trace_path(self) -> Path:
        """Where this rank's trace goes."""
        return self.out_dir / f"trace_rank{self.rank}_steps{self.start_step}-{self.end_step}.json"

    @property
    def active(self) -> bool:
        """Whether the profiler is recording now."""
        return self._prof is not None

    def step(self, step_index: int) -> Path | None:
        """Call at the start of step ``step_index``: starts at a, stops and exports after b.

        Returns the trace path on the call that exported it, else None.
        """
        if self._done:
            return None
        if self._prof is None and self.start_step <= step_index <= self.end_step:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            # a schedule makes the profiler record ProfilerStep#N spans, one per prof.step()
            self._prof = torch.profiler.profile(activities=activities, schedule=self._schedule,
                                                **self._options)
            self._prof.step_num = step_index  # spans are named after the training step
            self._prof.start()
            return None
        if self._prof is not None and step_index > self.end_step:
            return self._export()
        if self._prof is not None:
            self._prof.step()  # ends ProfilerStep#(step_index - 1), opens ProfilerStep#step_index
        return None

    @staticmethod
    def _schedule(step: int) -> torch.profiler.ProfilerAction:
        # record every step of the window; `_export` stops and writes the trace
        return torch.profiler.ProfilerAction.RECORD

    def close(self) -> Path | None:
        """Stop and export a window still open (training ended inside it); else None."""
        return self._export() if self._prof is not None else None

    def _export(self) -> Path | None:
        prof, self._prof, self._done = self._prof, None, True
        try:
            prof.stop()
            self.out_dir.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(self.trace_path))
        except Exception as exc:  # a failed trace must not fail the run
            log.warning("trace export for rank %d failed: %s", self.rank, exc)
            return None
        self.path = self.trace_path
        return self.path
