"""Device discipline checked on a CPU-only machine (test-only).

On a GPU, NCCL rejects a CPU tensor ("No backend type associated with device type cpu"), and
a host object sent through an NCCL group costs a device copy and a sync. On CPU + gloo every
tensor is a CPU tensor, so nothing fails; this checker brings the host/device split back:

- a tensor that project code (engine/, profilers/, tuning/) creates with a factory function
  (`torch.tensor`, `torch.zeros`, ...) without naming a device is a *host* tensor: on a GPU it
  would be on the CPU. `.to(device)` / `.cuda()` turn it into a device tensor;
- every process group is a *device* group (as under NCCL) except `engine.device.host_group()`;
- a collective on a device group raises `DeviceDisciplineError` for a host tensor or a host
  object (`*_object` / `*_object_list` collectives), naming where the tensor was created.

Usage, inside a rank after init_process_group("gloo"): `init_host_group(side=True)`, then
`with DeviceDiscipline(): ...`.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tuple(str(ROOT / p) + "/" for p in ("engine", "profilers", "tuning"))
FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor", "scalar_tensor")
MOVES = ("to", "cuda")
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "reduce",
               "gather", "scatter", "broadcast_object_list", "all_gather_object", "gather_object",
               "scatter_object_list")
# not wrapped: point-to-point (pipelining's P2POp checks `op in (dist.isend, dist.irecv)` by
# identity; its activations are torch's, on the stage's device) and barrier (no tensor)
_TAG = "_device_check_host_born"


class DeviceDisciplineError(RuntimeError):
    """A host tensor or host object entered a collective of a device group."""


def _project_caller() -> str | None:
    """'engine/train/trainer.py:163' when project code itself called the factory, else None (torch's
    own factories, e.g. an optimizer's state, are torch's business)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(PROJECT):
        return None
    return f"{Path(frame.f_code.co_filename).relative_to(ROOT)}:{frame.f_lineno}"


def _names_device(args: tuple, kwargs: dict) -> bool:
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, str, int, torch.Tensor)) and not isinstance(a, bool) for a in args)


def _factory(fn: Any) -> Any:
    def factory(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if kwargs.get("device") is None and isinstance(out, torch.Tensor):
            where = _project_caller()
            if where is not None:
                setattr(out, _TAG, where)
        return out

    return factory


def _move(fn: Any, always: bool) -> Any:
    def move(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = fn(self, *args, **kwargs)
        if getattr(out, _TAG, None) and (always or _names_device(args, kwargs)):
            out = out.view_as(out)  # moved to the device: a new object without the host tag
        return out

    return move


class DeviceDiscipline:
    """Tags host-born tensors and checks every torch.distributed collective while active.

    Plain attribute patches, not a TorchFunctionMode: DDP runs comm hooks (where L-GreCo
    solves) without the caller's mode stack, and a patched attribute is seen in every thread.
    """

    def __enter__(self) -> DeviceDiscipline:
        self._saved = [(torch, n, getattr(torch, n)) for n in FACTORIES]
        self._saved += [(torch.Tensor, n, getattr(torch.Tensor, n)) for n in MOVES]
        self._saved += [(dist, n, getattr(dist, n)) for n in COLLECTIVES if hasattr(dist, n)]
        for owner, name, fn in self._saved:
            if owner is torch:
                setattr(owner, name, _factory(fn))
            elif owner is torch.Tensor:
                setattr(owner, name, _move(fn, always=name == "cuda"))
            else:
                setattr(owner, name, _checked(name, fn))
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)


def _checked(name: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        check(name, kwargs.get("group"), list(args) + list(kwargs.values()))
        return fn(*args, **kwargs)

    return wrapper


def check(name: str, group: Any, args: list[Any]) -> None:
    """Raise unless every tensor of a device-group collective is a device tensor."""
    from engine.device import host_group

    if group is not None and group is host_group():
        return
    if name.endswith(("_object", "_object_list")):
        raise DeviceDisciplineError(f"{name} on a device group: host objects go through "
                                    "engine.device.host_group()")
    for value in args:
        for tensor in value if isinstance(value, (list, tuple)) else [value]:
            where = getattr(tensor, _TAG, None) if isinstance(tensor, torch.Tensor) else None
            if where:
                raise DeviceDisciplineError(
                    f"{name}: a host tensor created without a device at {where} enters a collective "
                    "of a device group (NCCL: No backend type associated with device type cpu)")


# ---- host syncs --------------------------------------------------------------------------------

# what a read of a device tensor costs on a GPU: the host waits for the stream to reach it
READS = {"item": "item()", "tolist": "tolist()", "cpu": "cpu()", "numpy": "numpy()", "__int__": "int()",
         "__index__": "int()", "__float__": "float()", "__bool__": "bool()"}
# drawn without device=: on the CPU, then copied to the device (a blocking copy is a stream sync)
HOST_DRAWS = ("randperm", "randint", "rand", "randn", "multinomial", "normal", "bernoulli")


class HostSyncs:
    """Records the host syncs project code (engine/, profilers/, tuning/) makes while active: a
    read of a device tensor (`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `int()`, `float()`,
    `bool()`) and a random draw on the host (`torch.randperm(...)` and kin without `device=`).

    On CPU every tensor is a CPU tensor, so this brings the split back as `DeviceDiscipline`
    does: a tensor project code made with a factory without naming a device is a host tensor
    (reading it costs nothing); every other tensor is a device tensor. `seen` lists each sync as
    'engine/model/moe.py:add cpu()' (file:function op), once per call. Only direct calls from project
    code count (torch's own reads inside its functions are torch's), as on a GPU
    `torch.cuda.set_sync_debug_mode` would show them.
    """

    def __init__(self) -> None:
        self.seen: list[str] = []

    def _where(self) -> str | None:
        frame = sys._getframe(2)
        if not frame.f_code.co_filename.startswith(PROJECT):
            return None
        return f"{Path(frame.f_code.co_filename).relative_to(ROOT)}:{frame.f_code.co_name}"

    def _read(self, name: str, fn: Any) -> Any:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            where = self._where()
            if where is not None and not getattr(tensor, _TAG, None):
                self.seen.append(f"{where} {READS[name]}")
            return fn(tensor, *args, **kwargs)

        return read

    def _draw(self, name: str, fn: Any) -> Any:
        def draw(*args: Any, **kwargs: Any) -> Any:
            where = self._where()
            if where is not None and kwargs.get("device") is None:
                self.seen.append(f"{where} {name} on the host")
            return fn(*args, **kwargs)

        return draw

    def __enter__(self) -> HostSyncs:
        self._saved = [(torch, n, getattr(torch, n)) for n in FACTORIES + HOST_DRAWS]
        self._saved += [(torch.Tensor, n, getattr(torch.Tensor, n)) for n in READS]
        for owner, name, fn in self._saved:
            if owner is torch.Tensor:
                setattr(owner, name, self._read(name, fn))
            elif name in HOST_DRAWS:
                setattr(owner, name, self._draw(name, fn))
            else:
                setattr(owner, name, _factory(fn))  # host tags, as DeviceDiscipline sets them
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)
