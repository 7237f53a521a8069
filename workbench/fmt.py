"""Numbers for people: one formatting rule for every table the CLI and the dashboard print.

`num(45815.01329358271)` is `45,815`, `num(48.61357569694519)` is `48.61`, `num(0.000123)` is
`0.000123`; None and NaN read `n/a`. Units go in the column header, not in the cell.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def num(value: Any, digits: int = 4) -> str:
    """A number with about `digits` significant digits, thousands separated; other values as str()."""
    if value is None:
        return "n/a"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, int) or float(value).is_integer() and abs(value) < 1e12:
        return f"{int(value):,}"
    size = abs(value)
    if size >= 1e12 or size < 1e-3:
        return f"{value:.{digits}g}"
    if size >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    decimals = max(0, digits - 1 - math.floor(math.log10(size)))
    return f"{value:,.{decimals}f}".rstrip("0").rstrip(".") if decimals else f"{value:,.0f}"


def nums(values: Iterable[Any] | None, digits: int = 4) -> str:
    """Several numbers, comma separated ('-' when there are none)."""
    if values is None:
        return "-"
    out = [num(v, digits) for v in values]
    return ", ".join(out) if out else "-"


def pct(value: Any) -> str:
    """A fraction as a percentage: 0.4213 -> '42.1%'."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{100 * value:.1f}%"


def ratio(value: Any) -> str:
    """A ratio of two like quantities: 0.25 -> '0.25x'."""
    return "n/a" if value is None else f"{num(value, 3)}x"


def gib(num_bytes: Any) -> str:
    """Bytes as GiB with about four significant digits."""
    return "n/a" if num_bytes is None else num(num_bytes / 2**30)


def size(num_bytes: Any) -> str:
    """Bytes in binary units: 2585806560 -> '2.408 GiB', 512 -> '512 B'."""
    if num_bytes is None or (isinstance(num_bytes, float) and not math.isfinite(num_bytes)):
        return "n/a"
    value, unit = float(num_bytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            break
        value /= 1024
    return f"{num(round(value)) if unit == 'B' else num(value)} {unit}"


def count(value: Any) -> str:
    """A count (a mean over ranks may be fractional): rounded to a whole number, thousands separated."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{math.floor(value + 0.5):,}"


def seconds(value: Any) -> str:
    """A duration in the unit that reads best: 3e-07 -> '0.3 µs', 0.0042 -> '4.2 ms', 12.5 -> '12.5 s'."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    size_ = abs(value)
    if size_ == 0 or size_ >= 1:
        return f"{num(value)} s"
    if size_ >= 1e-3:
        return f"{num(value * 1e3, 3)} ms"
    return f"{num(value * 1e6, 3)} µs"


def layout(lay: dict[str, Any] | None, config: dict[str, Any] | None = None) -> str:
    """A run's parallel layout, every axis: 'dp2 · tp1 · pp1 · cp1 · ep1', from its layout record
    (dp, tp, pp; cp when > 1) and its config's parallel section (ep, and cp in older records)."""
    axes = {"cp": 1, "ep": 1, **((config or {}).get("parallel") or {}), **(lay or {})}
    return " · ".join(f"{axis}{axes.get(axis, '?')}" for axis in ("dp", "tp", "pp", "cp", "ep"))


def frame(df: Any, columns: dict[str, Any]) -> Any:
    """A copy of a DataFrame for display: each named column passed through its formatter (num, size, ...)."""
    out = df.copy()
    for column, formatter in columns.items():
        if column in out:
            out[column] = [formatter(v) for v in out[column]]
    return out


def bandwidth(gb_per_s: Any) -> str:
    """A bandwidth given in GB/s (1e9 B/s, as nccl-tests' busbw) in the decimal unit that reads best:
    1.49e-07 -> '149 B/s', 0.0227 -> '22.7 MB/s', 1.908 -> '1.908 GB/s'."""
    if gb_per_s is None or (isinstance(gb_per_s, float) and not math.isfinite(gb_per_s)):
        return "n/a"
    value = float(gb_per_s) * 1e9
    for unit in ("B/s", "kB/s", "MB/s", "GB/s", "TB/s"):
        if abs(value) < 1000 or unit == "TB/s":
            break
        value /= 1000
    return f"{num(value, 4)} {unit}"


QUANTITY_NAMES = {
    "cpu": "CPU busy", "rss": "resident memory", "peak_rss": "peak resident memory",
    "sys_mem_used": "system memory used",
    "sys_mem": "system memory used", "net_rx": "network received", "net_tx": "network sent", "params": "parameters",
    "grads": "gradients", "optimizer": "optimizer state", "activations": "activations", "allocated": "allocated",
    "peak_allocated": "peak allocated", "peak_reserved": "peak reserved", "peak_memory": "peak memory",
    "util": "busy", "mem_util": "memory bus busy", "mem_used": "memory used", "mem_total": "memory total",
    "memory_total": "memory total", "power": "power draw", "power_limit": "power limit", "temp": "temperature",
    "sm_clock": "SM clock", "max_sm_clock": "SM clock, maximum", "mem_clock": "memory clock",
    "pcie_rx": "PCIe received", "pcie_tx": "PCIe sent", "nvlink_rx": "NVLink received", "nvlink_tx": "NVLink sent",
    "cpu_count": "CPU cores (logical)", "cpu_count_physical": "CPU cores (physical)", "os": "operating system",
    "hostname": "host name", "machine": "architecture", "python": "Python version", "uuid": "UUID",
    "pcie_gen": "PCIe generation", "pcie_width": "PCIe lanes (count)", "nvlink_links": "NVLink links (count)",
}
"""What a recorded name (the part before its unit) means, for legends and tables."""
UNIT_NAMES = {"B/s": "bytes/s", "C": "°C"}


def split_unit(name: str) -> tuple[str, str]:
    """'rss(GiB)' -> ('rss', 'GiB'); a name without a unit -> (name, '')."""
    if name.endswith(")") and "(" in name:
        stem, _, unit = name[:-1].rpartition("(")
        return stem, unit
    return name, ""


def quantity(name: str) -> str:
    """A recorded name as people read it, its unit kept: 'estimate_activations(GiB)' -> 'activations,
    estimated (GiB)', 'gpu0/util(%)' -> 'GPU 0 busy (%)', 'net_rx(B/s)' -> 'network received (bytes/s)'."""
    stem, unit = split_unit(name)
    device, _, stem = stem.rpartition("/")
    estimated = stem.startswith("estimate_")
    stem = stem.removeprefix("estimate_")
    text = QUANTITY_NAMES.get(stem, stem.replace("_", " "))
    if device:
        text = f"{device.upper().replace('GPU', 'GPU ')} {text}" if device.startswith("gpu") else f"{device} {text}"
    text += ", estimated" if estimated else ""
    return f"{text} ({UNIT_NAMES.get(unit, unit)})" if unit else text
