"""The profiler base: a sampler runs in a background thread and emits named values.

Every periodic sampler (NVML, host) follows the same contract so the engine can start them
all the same way and the conformance test can check them all at once:

- ``start()`` begins sampling (idempotent), ``stop()`` ends it and joins the thread
  (idempotent, safe without ``start``), ``sample()`` takes one sample now and returns
  ``{name: value}``; every sample is also passed to ``emit(kind, name, value)``.
- Overhead budget: a sample costs at most a few milliseconds and runs off the training thread,
  once per ``interval`` seconds (default 1 s): well under 1% of one core. A sampler never
  raises into its caller: a failing field is skipped, a failing sample is logged once.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from typing import Callable

Emit = Callable[[str, str, float], None]
"""A sink for samples: ``emit(kind, name, value)``."""

log = logging.getLogger(__name__)


class Sampler(ABC):
    """A periodic sampler in a daemon thread; subclasses implement `sample()`."""

    kind: str = "sampler"

    def __init__(self, *, interval: float = 1.0, emit: Emit | None = None) -> None:
        self.interval = float(interval)
        self._emit = emit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    @abstractmethod
    def sample(self) -> dict[str, float]:
        """Take one sample now and return ``{name: value}`` (empty when unavailable)."""

    @property
    def available(self) -> bool:
        """Whether this sampler can measure anything here."""
        return True

    def record(self) -> dict[str, float]:
        """Take one sample, pass each value to ``emit``, and return it; never raises."""
        try:
            values = self.sample()
        except Exception as exc:  # a sampler must never crash its host process
            if not self._warned:
                log.warning("%s sample failed: %s", type(self).__name__, exc)
                self._warned = True
            return {}
        if self._emit is not None:
            for name, value in values.items():
                try:
                    self._emit(self.kind, name, float(value))
                except Exception as exc:
                    log.debug("emit failed for %s: %s", name, exc)
        return values

    def start(self) -> None:
        """Start the sampling thread (no-op when already running or unavailable)."""
        if self._thread is not None or not self.available:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=type(self).__name__, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the sampling thread and wait for it; safe to call twice or without start."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=max(2.0, 2 * self.interval))

    @property
    def running(self) -> bool:
        """Whether the sampling thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.record()
            self._stop.wait(self.interval)

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
