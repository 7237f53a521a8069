"""Communication techniques: gradient compression hooks, L-GreCo adaptive levels, CO2, link emulation."""

from engine.comm.adaptive import (
    AdaptiveCompressor,
    adaptive_hook,
    apply_adaptive,
    measure_errors,
    solve_levels,
)
from engine.comm.co2 import CO2
from engine.comm.compress import COMPRESSORS, CompressionState, apply_compression, make_comm_hook
from engine.comm.link import LinkEmulator, bus_factor

__all__ = [
    "COMPRESSORS",
    "CO2",
    "AdaptiveCompressor",
    "CompressionState",
    "LinkEmulator",
    "adaptive_hook",
    "apply_adaptive",
    "apply_compression",
    "bus_factor",
    "make_comm_hook",
    "measure_errors",
    "solve_levels",
]
