"""Every private torch symbol the engine uses, named once (issue 36.5).

torch's pipelining, context-parallel, FSDP2 and c10d internals the engine builds on are not public
API: they move or change between releases. The engine imports them from here only, so a new torch
breaks in one file with one clear line, and `tests/test_torch_compat.py` imports every symbol below
and checks it does what the engine expects on the installed torch.

Tested: torch 2.13.0 (TESTED_TORCH; pyproject.toml's [tool.workbench] tested-torch states the same range). Another version imports
with a warning; a symbol missing there raises an ImportError naming it and the tested range.
Lazily imported symbols (context parallel, replicate, the fused-kernel devices) are looked up on
first use, as the engine did before. tuning/ takes `_Action` from here too; profilers/ imports
nothing of ours, so its one private name, the `torch.ops._c10d_functional` namespace it times
(profilers/functional.py), stays there.
"""
from __future__ import annotations

import copy
import functools
import importlib
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

TESTED_TORCH = ((2, 13), (2, 14))  # [low, high): the releases this adapter was tested on
TESTED_RANGE = "torch>=2.13,<2.14"


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of `version` (default: the installed torch), e.g. "2.13.0+cpu" -> (2, 13)."""
    major, minor = (version or torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def version_problem(version: str | None = None) -> str | None:
    """None inside the tested range; else one line naming the version and the range."""
    got = torch_version(version)
    low, high = TESTED_TORCH
    if low <= got < high:
        return None
    return (f"torch {version or torch.__version__} is outside the range the engine's private-API adapter "
            f"(engine/torch_compat.py) was tested on: {TESTED_RANGE}; run tests/test_torch_compat.py on it")


def _private(module: str, name: str) -> Any:
    """`module.name`, or an ImportError naming the symbol, the installed torch and the tested range."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"{module}.{name} is not in torch {torch.__version__} (engine/torch_compat.py, "
                          f"tested on {TESTED_RANGE}): {exc}") from exc


_problem = version_problem()
if _problem:
    warnings.warn(_problem, RuntimeWarning, stacklevel=2)

# ---- pipelining: schedules as action lists, torch's runtime executes them
_SCHEDULES = "torch.distributed.pipelining.schedules"
# resolved on first use (`__getattr__` below): importing pipelining costs a process about 0.5 s (it imports
# dynamo), DTensor's utilities another 0.5, and a run without pp (or without DTensor) never touches them
_ON_FIRST_USE: dict[str, Callable[[], Any]] = {
    "_Action": lambda: _private(_SCHEDULES, "_Action"),
    "_ComputationType": lambda: _private(_SCHEDULES, "_ComputationType"),
    "_format_pipeline_order": lambda: _private(_SCHEDULES, "_format_pipeline_order"),
    "_PipelineScheduleRuntime": lambda: _private(_SCHEDULES, "_PipelineScheduleRuntime"),
    "_add_send_recv": lambda: _private(_SCHEDULES, "_add_send_recv"),
    "generate_stage_to_rank_mapping": lambda: _private("torch.distributed.pipelining._utils",
                                                       "generate_stage_to_rank_mapping"),
}

# ---- ZeRO, FSDP2, functional collectives
_flatten_dense_tensors = _private("torch._utils", "_flatten_dense_tensors")
_unflatten_dense_tensors = _private("torch._utils", "_unflatten_dense_tensors")
_ON_FIRST_USE["ReduceScatter"] = lambda: _private("torch.distributed.fsdp._fully_shard._fsdp_api", "ReduceScatter")
_ON_FIRST_USE["all_to_all_single_autograd"] = lambda: _private("torch.distributed._functional_collectives",
                                                               "all_to_all_single_autograd")


# ---- meta construction (engine/model/meta_init.py): record a constructor's ops, place a shard in its tensor
TorchDispatchMode = _private("torch.utils._python_dispatch", "TorchDispatchMode")
tree_flatten = _private("torch.utils._pytree", "tree_flatten")
tree_map_only = _private("torch.utils._pytree", "tree_map_only")
_ON_FIRST_USE["compute_local_shape_and_global_offset"] = lambda: _private("torch.distributed.tensor._utils",
                                                                        "compute_local_shape_and_global_offset")


def __getattr__(name: str) -> Any:
    """The `_ON_FIRST_USE` symbols, resolved (and kept) when first imported from this module."""
    if name not in _ON_FIRST_USE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = _ON_FIRST_USE[name]()
    return value


def rank_operations(schedule_cls: type, fake: Any, rank: int) -> list:
    """torch's own action list of one rank (`Schedule*._calculate_single_rank_operations`), run on
    `fake`, a stand-in carrying the attributes it reads (n_local_stages, pp_group_size,
    _n_microbatches, ...)."""
    return schedule_cls._calculate_single_rank_operations(fake, rank)


def add_bubbles_to_actions(fake: Any, num_stages: int) -> dict:
    """ZB1P's orders padded with torch's bubbles (`ScheduleInterleavedZeroBubble._add_bubbles_to_actions`)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    return ScheduleInterleavedZeroBubble._add_bubbles_to_actions(fake, num_stages)


def prepare_schedule_with_comms(runner: Any, actions: dict) -> None:
    """Load compute-only `actions` into a `_PipelineScheduleRuntime` (it adds send/recv)."""
    runner._prepare_schedule_with_comms(actions)


# ---- c10d
def default_group() -> Any:
    """The default (world) process group."""
    return torch.distributed.distributed_c10d._get_default_group()


def rank_not_in_group(group: Any) -> bool:
    """Whether this rank is outside `group`."""
    return torch.distributed.distributed_c10d._rank_not_in_group(group)


def c10d_functional_ops() -> Any:
    """The `torch.ops._c10d_functional` namespace (DTensor's functional collectives)."""
    return torch.ops._c10d_functional


def ddp_ignore_params(model: torch.nn.Module, names: list[str]) -> None:
    """Parameters DDP leaves alone (`DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`)."""
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def fused_kernel_devices() -> list[str]:
    """Device types with fused optimizer kernels (`torch.utils._foreach_utils`)."""
    return list(_private("torch.utils._foreach_utils", "_get_fused_kernels_supported_devices")())


def replicate_with_fsdp() -> Any:
    """FSDP2's `replicate` (`torch.distributed._composable.replicate_with_fsdp`)."""
    return _private("torch.distributed._composable.replicate_with_fsdp", "replicate")


# ---- context parallel (CUDA ring attention)
def cp_attention() -> ModuleType:
    """torch's context-parallel attention module (`torch.distributed.tensor.experimental._attention`)."""
    return _private("torch.distributed.tensor.experimental", "_attention")


def enable_ring_attention_dispatch(*, load_balance: bool = False) -> None:
    """From here on, SDPA on sequence-sharded DTensors runs torch's ring attention."""
    module = cp_attention()
    module._cp_options.enable_load_balance = load_balance
    module._enable_context_parallel_dispatcher()


# ---- the dry run (engine/train/dryrun.py): one step at the real world size on torch's fake backend
TorchDispatchMode = _private("torch.utils._python_dispatch", "TorchDispatchMode")
LOCAL_SCALAR_DENSE = torch.ops.aten._local_scalar_dense.default  # a host read of a tensor's value (.item())


def fake_store() -> Any:
    """The store of torch's `fake` process-group backend (`torch.testing._internal.distributed.fake_pg`)."""
    return _private("torch.testing._internal.distributed.fake_pg", "FakeStore")()


def fake_tensor_mode() -> type:
    """`torch._subclasses.fake_tensor.FakeTensorMode`: tensors with shapes and no storage."""
    return _private("torch._subclasses.fake_tensor", "FakeTensorMode")


def is_fake(tensor: torch.Tensor) -> bool:
    """`torch._subclasses.fake_tensor.is_fake`: a fake tensor (shapes, no storage), also inside a wrapper."""
    return _private("torch._subclasses.fake_tensor", "is_fake")(tensor)


def unset_fake_temporarily() -> Any:
    """`torch._subclasses.fake_tensor.unset_fake_temporarily()`: real tensors inside the fake mode."""
    return _private("torch._subclasses.fake_tensor", "unset_fake_temporarily")()


@functools.cache
def memory_trackers() -> tuple[type, type]:
    """(`MemTracker`, `FSDPMemTracker`) of `torch.distributed._tools`: peak bytes per category, each with
    `_RunningModulesOnly`'s peak update (and FSDPMemTracker still a MemTracker)."""
    mem_tracker = _private("torch.distributed._tools.mem_tracker", "MemTracker")
    fsdp_tracker = _private("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker")
    fast = type("MemTracker", (_RunningModulesOnly, mem_tracker), {})
    return fast, type("FSDPMemTracker", (fsdp_tracker, fast), {})


class _RunningModulesOnly:
    """A MemTracker whose peak update (run on every op) visits only the modules running now. torch's
    `MemTracker._update_peak_stats` walks every module it has seen to ask whether it is running (in
    `ModTracker.parents`): ops x modules, 78% of an 8B dry run's 290 s here (a weak-dict walk of ~355 modules
    on each of 241k ops). This one finds the running ones through an index by name, rebuilt when a module
    joins or leaves or the stats are reset, and updates the same modules with the same values."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.memory_tracking = _counted_weak_dict()()
        self._by_name: dict[str, list] = {}
        self._indexed: tuple[int, int] | None = None
        self._total_key = _private("torch.distributed._tools.mem_tracker", "_TOTAL_KEY")

    def _update_peak_stats(self, peak_state: Any) -> None:
        total = self._total_key
        tracking = self.memory_tracking
        if self._indexed != (tracking.version, len(tracking)):
            self._by_name = {}
            for stats in tracking.values():
                self._by_name.setdefault(stats.mod_fqn, []).append(stats)
            self._indexed = (tracking.version, len(tracking))
        snap = self._curr_mem_snap
        for name in self._mod_tracker.parents:
            for stats in self._by_name.get(name, ()):
                if peak_state in stats.snapshots:
                    for dev, dev_snap in snap.items():
                        if stats.local_peak.get(dev, 0) < dev_snap[total]:
                            stats.local_peak[dev] = dev_snap[total]
                            stats.snapshots[peak_state][-1][dev] = copy.deepcopy(dev_snap)
        for dev, dev_snap in snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[total]:
                self._peak_mem[dev] = dev_snap[total]
                self._peak_mem_snap[dev] = copy.deepcopy(dev_snap)


@functools.cache
def _counted_weak_dict() -> type:
    """torch's WeakIdKeyDictionary (a tracker's `memory_tracking`), counting its insertions and clears."""

    class Counted(_private("torch.utils.weak", "WeakIdKeyDictionary")):  # type: ignore[misc]
        version = 0

        def __setitem__(self, key: Any, value: Any) -> None:
            self.version += 1
            super().__setitem__(key, value)

        def clear(self) -> None:
            self.version += 1
            super().clear()

    return Counted


def own_sharding_fake_mode() -> Any:
    """A context in which DTensor's sharding propagation computes output shapes under a fake mode of
    its own. It reuses the ambient one (`detect_fake_mode`), so under a dry run's FakeTensorMode the
    memory trackers counted its global-shape scratch tensors, which its lru_cache keeps alive (fused
    AdamW on Llama-3-8B over 64 ranks: 120 GiB of "optimizer state" for 0.93 GiB of real states)."""
    import contextlib

    module = importlib.import_module("torch.distributed.tensor._sharding_prop")
    own = fake_tensor_mode()()

    @contextlib.contextmanager
    def scope():
        saved = module.detect_fake_mode
        module.detect_fake_mode = lambda *args: own
        try:
            yield
        finally:
            module.detect_fake_mode = saved

    return scope()


def tracker_in_backward(tracker: Any) -> bool:
    """Whether a `MemTracker` / `FSDPMemTracker` is inside a backward pass (its `ModTracker.is_bw`)."""
    return bool(tracker._mod_tracker.is_bw)


def set_static_stage_meta(stage: Any, inputs: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...]) -> None:
    """Give a `PipelineStage` the example inputs and outputs its constructor takes (`input_args`,
    `output_args`) after the fact, so the schedule's warm-up settles on static metadata and never
    asks a peer for shapes."""
    extract = _private("torch.distributed.pipelining._utils", "extract_tensor_metas")
    stage_meta = _private("torch.distributed.pipelining._utils", "_StageMeta")
    stage._user_meta = stage_meta(inputs=extract(inputs), outputs=extract(outputs))
