"""Host metrics (psutil): this process's CPU and memory, the machine's memory and network.

`HostSampler` emits, as kind ``host``: ``cpu(%)`` (this process, 100 = one core busy),
``rss(GiB)``, ``sys_mem_used(GiB)``, ``sys_mem(%)``, and from the second sample on
``net_rx(B/s)`` and ``net_tx(B/s)`` (all interfaces, loopback included: gloo between local ranks
runs over it). `host_info` describes the machine and the software for the runs table.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
import time
from importlib import metadata

import psutil

from profilers.base import Emit, Sampler

GIB = float(1 << 30)
KEY_PACKAGES = ("torch", "numpy", "pandas", "optuna", "streamlit", "plotly", "psutil",
                "nvidia-ml-py", "pyyaml")


class HostSampler(Sampler):
    """Samples process CPU%, RSS, system memory and network throughput every ``interval`` s."""

    kind = "host"

    def __init__(self, *, interval: float = 1.0, emit: Emit | None = None,
                 pid: int | None = None) -> None:
        super().__init__(interval=interval, emit=emit)
        self._pid = pid
        self._proc: psutil.Process | None = None
        self._last_net: tuple[float, int, int] | None = None

    def sample(self) -> dict[str, float]:
        """One sample; the first one primes the CPU and network counters."""
        if self._proc is None:
            self._proc = psutil.Process(self._pid)
            self._proc.cpu_percent(None)  # the first call only starts the interval
        mem = psutil.virtual_memory()
        out = {"cpu(%)": self._proc.cpu_percent(None),
               "rss(GiB)": self._proc.memory_info().rss / GIB,
               "sys_mem_used(GiB)": (mem.total - mem.available) / GIB,
               "sys_mem(%)": float(mem.percent)}
        out.update(self._network())
        return out

    def _network(self) -> dict[str, float]:
        counters = psutil.net_io_counters()
        if counters is None:
            return {}
        now = time.monotonic()
        last, self._last_net = self._last_net, (now, counters.bytes_recv, counters.bytes_sent)
        if last is None or now <= last[0]:
            return {}
        dt = now - last[0]
        return {"net_rx(B/s)": (counters.bytes_recv - last[1]) / dt,
                "net_tx(B/s)": (counters.bytes_sent - last[2]) / dt}


def software_versions(packages: tuple[str, ...] = KEY_PACKAGES) -> dict[str, str | None]:
    """Installed versions of python, torch's CUDA/NCCL and key packages (None if absent)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    torch = sys.modules.get("torch")
    if torch is not None:
        out["cuda"] = getattr(torch.version, "cuda", None)
        try:
            nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
            out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else (
                str(nccl) if nccl else None)
        except Exception:
            out["nccl"] = None
    return out


def host_info() -> dict[str, object]:
    """The machine and software of this process, for the runs table's ``host`` column."""
    mem = psutil.virtual_memory()
    return {
        "hostname": socket.gethostname(),
        "os": f"{platform.system()} {platform.release()}",
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_count_physical": psutil.cpu_count(logical=False),
        "memory_total(GiB)": round(mem.total / GIB, 2),
        "python": platform.python_version(),
        "versions": software_versions(),
    }
