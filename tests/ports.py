"""A port for a server the suite starts and can only name a port to (streamlit, slurmctld, slurmd).

Such a server binds the port some time after we pick it. A port from bind(0) is in the kernel's
ephemeral range, which every outgoing connection and every bind(0) of a second suite draws from
too, so it may be taken in between. Below that range only another explicit pick can take it.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10000  # well above the well-known and registered ports services here listen on


def ephemeral_range() -> tuple[int, int]:
    """The kernel's (first, last) port for bind(0) and outgoing connections."""
    lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(lo), int(hi)


def server_port() -> int:
    """A free 127.0.0.1 TCP port below the ephemeral range, drawn at random so parallel suites differ."""
    first_ephemeral, _ = ephemeral_range()
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(_LOWEST, first_ephemeral) if first_ephemeral > _LOWEST + 1000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port in {_LOWEST}-{first_ephemeral - 1} after 100 draws")
