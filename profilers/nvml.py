"""NVIDIA GPU sampling through NVML (the ``nvidia-ml-py`` package, module ``pynvml``).

`NvmlSampler` (one per node) emits, as kind ``gpu`` for every GPU i: ``gpu{i}/util(%)``,
``gpu{i}/mem_util(%)``, ``gpu{i}/mem_used(GiB)``, ``gpu{i}/mem_total(GiB)``,
``gpu{i}/power(W)``, ``gpu{i}/temp(C)``, ``gpu{i}/sm_clock(MHz)``, ``gpu{i}/mem_clock(MHz)``,
``gpu{i}/pcie_tx(B/s)``, ``gpu{i}/pcie_rx(B/s)`` and, from the second sample on where the
driver has NVLink counters, ``gpu{i}/nvlink_tx(B/s)`` and ``gpu{i}/nvlink_rx(B/s)``.
Every NVML call is guarded: a field the driver or GPU lacks is skipped from then on.
Without NVML or a GPU, "no NVIDIA GPU" is logged once and the sampler does nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from profilers.base import Emit, Sampler

log = logging.getLogger(__name__)
GIB = float(1 << 30)

_state: dict[str, Any] = {"checked": False, "ok": False, "reason": "", "warned": False}
_init_lock = threading.Lock()


def _pynvml() -> Any:
    import pynvml  # imported lazily: engine/ must import without pynvml

    return pynvml


def _init() -> bool:
    """Initialise NVML once per process; False (with the reason kept) when unavailable."""
    with _init_lock:
        if _state["checked"]:
            return bool(_state["ok"])
        _state["checked"] = True
        try:
            nv = _pynvml()
            nv.nvmlInit()
            count = nv.nvmlDeviceGetCount()
            _state["ok"] = count > 0
            _state["reason"] = "" if count else "NVML reports 0 devices"
        except ImportError as exc:
            _state["reason"] = f"pynvml not installed ({exc}); pip install nvidia-ml-py"
        except Exception as exc:  # pynvml.NVMLError_LibraryNotFound without a driver
            _state["reason"] = f"{type(exc).__name__}: {exc}"
        return bool(_state["ok"])


def _warn_once() -> None:
    if not _state["warned"]:
        _state["warned"] = True
        log.warning("no NVIDIA GPU: GPU sampling disabled (%s)", _state["reason"])


def nvml_available() -> bool:
    """Whether NVML is installed, initialises, and sees at least one GPU."""
    return _init()


def unavailable_reason() -> str:
    """Why NVML is not available ("" when it is)."""
    _init()
    return str(_state["reason"])


def _safe(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception:
        return None


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def gpu_inventory() -> list[dict[str, Any]]:
    """Static facts about each GPU (name, memory, driver, PCIe, NVLink links); [] without NVML."""
    if not _init():
        return []
    nv = _pynvml()
    driver = _text(_safe(nv.nvmlSystemGetDriverVersion))
    out = []
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        mem = _safe(lambda: nv.nvmlDeviceGetMemoryInfo(h))
        power = _safe(lambda: nv.nvmlDeviceGetPowerManagementLimit(h))
        links = [link for link in range(18)
                 if _safe(lambda link=link: nv.nvmlDeviceGetNvLinkState(h, link)) == 1]
        out.append({
            "index": i, "name": _text(_safe(lambda: nv.nvmlDeviceGetName(h))),
            "uuid": _text(_safe(lambda: nv.nvmlDeviceGetUUID(h))),
            "memory_total(GiB)": mem.total / GIB if mem is not None else None,
            "driver": driver, "power_limit(W)": power / 1000 if power else None,
            "max_sm_clock(MHz)": _safe(lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)),
            "pcie_gen": _safe(lambda: nv.nvmlDeviceGetMaxPcieLinkGeneration(h)),
            "pcie_width": _safe(lambda: nv.nvmlDeviceGetMaxPcieLinkWidth(h)),
            "nvlink_links": len(links),
        })
    return out


class NvmlSampler(Sampler):
    """Samples every GPU of this node every ``interval`` seconds; a no-op without NVML."""

    kind = "gpu"

    def __init__(self, *, interval: float = 1.0, emit: Emit | None = None) -> None:
        super().__init__(interval=interval, emit=emit)
        self._skip: set[str] = set()  # fields this driver refused once: not asked again
        self._nvlink_last: dict[int, tuple[float, float, float]] = {}

    @property
    def available(self) -> bool:
        """Whether NVML sees a GPU; logs "no NVIDIA GPU" once when not."""
        ok = _init()
        if not ok:
            _warn_once()
        return ok

    def sample(self) -> dict[str, float]:
        """One sample of every GPU ({} without NVML)."""
        if not self.available:
            return {}
        nv = _pynvml()
        out: dict[str, float] = {}
        for i in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(i)
            for name, value in self._device(nv, i, handle).items():
                out[f"gpu{i}/{name}"] = float(value)
        return out

    def _field(self, out: dict[str, float], name: str, call: Callable[[], Any]) -> None:
        if name in self._skip:
            return
        try:
            value = call()
        except Exception:
            self._skip.add(name)
            return
        if value is not None:
            out[name] = value

    def _device(self, nv: Any, index: int, h: Any) -> dict[str, float]:
        out: dict[str, float] = {}
        util = _safe(lambda: nv.nvmlDeviceGetUtilizationRates(h))
        if util is not None:
            out["util(%)"], out["mem_util(%)"] = util.gpu, util.memory
        mem = _safe(lambda: nv.nvmlDeviceGetMemoryInfo(h))
        if mem is not None:
            out["mem_used(GiB)"], out["mem_total(GiB)"] = mem.used / GIB, mem.total / GIB
        self._field(out, "power(W)", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0)
        self._field(out, "temp(C)",
                    lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        self._field(out, "sm_clock(MHz)", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
        self._field(out, "mem_clock(MHz)",
                    lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM))
        # NVML reports PCIe throughput in KB/s over a short window
        self._field(out, "pcie_tx(B/s)", lambda: nv.nvmlDeviceGetPcieThroughput(
            h, nv.NVML_PCIE_UTIL_TX_BYTES) * 1024.0)
        self._field(out, "pcie_rx(B/s)", lambda: nv.nvmlDeviceGetPcieThroughput(
            h, nv.NVML_PCIE_UTIL_RX_BYTES) * 1024.0)
        if "nvlink" not in self._skip:
            try:
                out.update(self._nvlink(nv, index, h))
            except Exception:
                self._skip.add("nvlink")
        return out

    def _nvlink(self, nv: Any, index: int, h: Any) -> dict[str, float]:
        """NVLink rates from the cumulative KiB counters (field values summed over links)."""
        fields = [nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX]
        values = nv.nvmlDeviceGetFieldValues(h, fields)
        if any(v.nvmlReturn != nv.NVML_SUCCESS for v in values):
            raise RuntimeError("no NVLink throughput counters")
        tx, rx = (float(v.value.ullVal) * 1024.0 for v in values)
        now = time.monotonic()
        last, self._nvlink_last[index] = self._nvlink_last.get(index), (now, tx, rx)
        if last is None or now <= last[0]:
            return {}
        dt = now - last[0]
        return {"nvlink_tx(B/s)": (tx - last[1]) / dt, "nvlink_rx(B/s)": (rx - last[2]) / dt}
