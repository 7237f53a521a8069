"""engine/torch_compat.py on the installed torch: every private symbol imports and does what the
engine expects of it (run this file on each torch the range in pyproject.toml claims)."""
from __future__ import annotations

import ast
import datetime
import os
import re
import socket
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from engine import torch_compat as tc

ROOT = Path(__file__).resolve().parent.parent


def test_installed_torch_is_in_the_tested_range_and_pyproject_states_it() -> None:
    assert tc.version_problem() is None, tc.version_problem()
    stated = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["workbench"]["tested-torch"]
    assert tc.TESTED_RANGE == stated  # one range, stated in both places
    low, high = tc.TESTED_TORCH
    assert tc.TESTED_RANGE == f"torch>={low[0]}.{low[1]},<{high[0]}.{high[1]}"


def test_a_version_outside_the_range_is_named_with_the_range() -> None:
    assert tc.torch_version("2.13.0+cpu") == (2, 13) and tc.torch_version("2.14.0a0+git") == (2, 14)
    assert tc.version_problem("2.13.1") is None
    line = tc.version_problem("2.12.0")
    assert line and "torch 2.12.0" in line and "torch>=2.13,<2.14" in line and "engine/torch_compat.py" in line
    assert tc.version_problem("2.14.0")


def test_a_missing_symbol_raises_one_line_naming_it() -> None:
    with pytest.raises(ImportError, match=r"torch\.distributed\.pipelining\.schedules\._Gone is not in torch .*"
                                          r"tested on torch>=2.13,<2.14"):
        tc._private("torch.distributed.pipelining.schedules", "_Gone")


def test_no_private_torch_import_outside_the_adapter() -> None:
    """engine/ reaches torch's private names only through engine/torch_compat.py."""
    private = re.compile(r"(^|\.)_[a-z]")
    found = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        if path.name == "torch_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                if private.search(node.module) or any(a.name.startswith("_") for a in node.names):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = ast.unparse(node.value)
                if base.startswith(("torch", "dist", "c10d", "Schedule", "DistributedDataParallel", "runner", "cp_attention")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {base}.{node.attr}")
    assert found == []


def test_pipelining_actions_and_lowering() -> None:
    F, B = tc._ComputationType.FORWARD, tc._ComputationType.FULL_BACKWARD
    for name in ("FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "OVERLAP_F_B", "SEND_F", "RECV_F"):
        assert hasattr(tc._ComputationType, name)
    action = tc._Action(1, F, 0)
    assert str(action) == "1F0" and action.stage_index == 1 and action.microbatch_index == 0
    assert action.computation_type == F and F.value == "F" and B.value == "B"
    lowered = tc._add_send_recv({0: [tc._Action(0, F, 0)], 1: [tc._Action(1, F, 0)]},
                                stage_to_rank=lambda s: s, num_stages=2)
    assert [str(a) for a in lowered[0]] == ["0F0", "0SEND_F0"] and [str(a) for a in lowered[1]] == ["1RECV_F0", "1F0"]
    assert tc.generate_stage_to_rank_mapping(2, 4, style="loop") == {0: 0, 1: 1, 2: 0, 3: 1}
    assert tc.generate_stage_to_rank_mapping(2, 4, style="v") == {0: 0, 1: 1, 2: 1, 3: 0}
    grid = tc._format_pipeline_order({0: [tc._Action(0, F, 0), None], 1: [None, tc._Action(1, F, 0)]})
    assert "0F0" in grid and "1F0" in grid
    assert hasattr(tc._PipelineScheduleRuntime, "_prepare_schedule_with_comms")


def test_torch_computes_the_interleaved_and_zero_bubble_orders() -> None:
    """The schedules' private order functions, run on the stand-in the engine passes them."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble

    fake = SimpleNamespace(n_local_stages=2, pp_group_size=2, _n_microbatches=2, microbatches_per_round=2,
                           stage_index_to_group_rank={0: 0, 1: 1, 2: 0, 3: 1})
    order = [str(a) for a in tc.rank_operations(ScheduleInterleaved1F1B, fake, 0) if a is not None]
    assert sorted(order) == ["0B0", "0B1", "0F0", "0F1", "2B0", "2B1", "2F0", "2F1"]
    assert order[:2] == ["0F0", "0F1"]
    zb = {r: tc.rank_operations(ScheduleInterleavedZeroBubble, fake, r) for r in range(2)}
    fake.pipeline_order = zb
    padded = tc.add_bubbles_to_actions(fake, 4)
    kinds = {a.computation_type.value for a in padded[0] if a is not None}
    assert kinds == {"F", "I", "W"}  # zero bubble splits the backward


def test_flatten_fused_devices_fsdp_and_functional() -> None:
    a, b = torch.arange(3.0), torch.ones(2, 2)
    flat = tc._flatten_dense_tensors([a, b])
    assert flat.tolist() == [0.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0]
    back = tc._unflatten_dense_tensors(flat, [a, b])
    assert torch.equal(back[0], a) and torch.equal(back[1], b)
    assert "cpu" in tc.fused_kernel_devices()
    assert isinstance(tc.ReduceScatter, type) and hasattr(tc.ReduceScatter, "__call__")
    assert callable(tc.all_to_all_single_autograd) and callable(tc.replicate_with_fsdp())
    ops = tc.c10d_functional_ops()
    assert hasattr(ops, "all_reduce") and hasattr(ops, "wait_tensor")
    cp = tc.cp_attention()
    assert hasattr(cp._cp_options, "enable_load_balance") and callable(cp._enable_context_parallel_dispatcher)


def test_c10d_groups_and_ddp_ignore_on_one_rank() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        group = tc.default_group()
        assert group is dist.group.WORLD and not tc.rank_not_in_group(group)
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        tc.ddp_ignore_params(model, ["1.weight"])
        assert model._ddp_params_and_buffers_to_ignore == ["1.weight"]
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        assert "1.weight" in ddp.parameters_to_ignore
    finally:
        dist.destroy_process_group()


def test_dry_run_symbols() -> None:
    """engine/train/dryrun.py's: the fake store and tensor mode, torch's trackers, the sharding propagation's
    own fake mode, static stage shapes, and the op a host read dispatches."""
    fake_mode = tc.fake_tensor_mode()
    with fake_mode():
        t = torch.ones(3)
    assert t.shape == (3,) and type(t).__name__ == "FakeTensor"
    assert type(tc.fake_store()).__name__ == "FakeStore"
    mem_tracker, fsdp_tracker = tc.memory_trackers()
    assert issubclass(fsdp_tracker, mem_tracker) and not tc.tracker_in_backward(mem_tracker())
    import torch.distributed.tensor._sharding_prop as sharding_prop

    before = sharding_prop.detect_fake_mode
    with tc.own_sharding_fake_mode():
        assert type(sharding_prop.detect_fake_mode()) is fake_mode
    assert sharding_prop.detect_fake_mode is before
    stage = SimpleNamespace()
    tc.set_static_stage_meta(stage, (torch.zeros(2, 3),), (torch.zeros(2, 4, requires_grad=True),))
    assert tuple(stage._user_meta.outputs[0].shape) == (2, 4) and stage._user_meta.is_complete_for_forward()

    class Reads(tc.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return 7.0 if func is tc.LOCAL_SCALAR_DENSE else func(*args, **(kwargs or {}))

    with Reads():
        assert torch.ones(1).item() == 7.0


def test_a_rank_without_pp_or_dtensor_does_not_import_pipelining_dynamo_or_dtensor() -> None:
    """The adapter resolves torch's pipelining and DTensor internals on first use: importing them costs a rank
    process about 1 s of its start (a 2-rank dp run 7.8 -> 6.3 s here), and every multi-rank test pays it per
    rank. The worker and trainer import without them; a pipeline module brings them."""
    import subprocess
    import sys

    probe = ("import sys, engine.launch.worker, engine.train.trainer; "
             "print(sorted(m for m in ('torch.distributed.pipelining', 'torch._dynamo', 'torch.distributed.tensor') "
             "if m in sys.modules)); import engine.parallel.pipeline; "
             "print('torch.distributed.pipelining' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout + out.stderr


def test_memory_trackers_keep_torchs_peaks_while_visiting_only_the_running_modules() -> None:
    """engine.torch_compat.memory_trackers' peak update looks up the running modules by name instead of walking
    every module on every op (78% of an 8B dry run's time): the peak snapshot and every module's peaks and
    snapshots equal torch's own tracker's, through micro-batches, resets and an optimizer step."""
    import torch
    from torch import nn
    from torch.distributed._tools.mem_tracker import MemTracker as TorchMemTracker

    from engine.torch_compat import memory_trackers

    def run(tracker_cls: type) -> tuple:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(4)])
        optimizer = torch.optim.AdamW(model.parameters())
        tracker = tracker_cls()
        tracker.track_external(model, optimizer)
        with tracker:
            for step in range(2):
                for _ in range(2):  # micro-batches, stats reset before each as the dry run does
                    tracker.reset_mod_stats()
                    model(torch.randn(8 * (step + 1), 32)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        modules = {s.mod_fqn: (dict(s.local_peak), s.snapshots) for s in tracker.memory_tracking.values()}
        return tracker.get_tracker_snapshot("peak"), modules

    fast, torchs = run(memory_trackers()[0]), run(TorchMemTracker)
    assert len(fast[1]) == 17 and fast[0]  # the 17 modules were tracked, a peak was taken
    assert fast == torchs
