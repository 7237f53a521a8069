"""Shared by the bench scripts that time whole processes: one child's CPU and wall, and the medians per arm."""
from __future__ import annotations

import resource
import statistics
import subprocess
import time


def child_cost(argv: list[str], **run_kwargs) -> tuple[float, float]:
    """CPU (user + system of the child and every process under it it waited for, from rusage) and wall seconds
    of one `subprocess.run(argv, check=True, **run_kwargs)`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    subprocess.run(argv, check=True, **run_kwargs)
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall


def medians(runs: dict[str, list[tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    """Per arm, the median CPU and the median wall of its (cpu, wall) runs."""
    return {arm: (statistics.median(c for c, _ in r), statistics.median(w for _, w in r)) for arm, r in runs.items()}
