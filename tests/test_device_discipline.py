"""Every tensor the engine hands to a collective lives on its group's device; host objects go
through the host group. Checked on CPU by tests/device_check.py (a host/device split on one
CPU: see its docstring), over 2 real gloo ranks through the engine's collective paths."""
from __future__ import annotations

import json
import math

import pytest
import torch

from parallel_harness import run_ranks

TINY = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=16", "model.vocab=256",
        "train.lr=0.003", "train.warmup_steps=0", "batch.global=8", "batch.micro=2",
        "profile.host_interval_s=0", "profile.nvml_interval_s=0", "train.steps=3", "train.eval_interval=3"]
# each path of the engine that issues its own collectives (DDP's, FSDP2's and DTensor's are torch's)
PATHS = {
    "dp2-lgreco": ["parallel.dp=2", "comm.compressor=topk", "comm.adaptive=true", "comm.adaptive_interval=1"],
    "dp2-lgreco-live": ["parallel.dp=2", "comm.compressor=topk", "comm.adaptive=true",
                        "comm.adaptive_interval=1", "comm.density=0.1", "live.every=2"],
    "dp2-co2": ["parallel.dp=2", "co2.enabled=true", "co2.tau=2"],
    "dp2-zero1": ["parallel.dp=2", "parallel.zero=1"],
    "dp2-bidirectional": ["parallel.dp=2", "comm.compressor=topk", "comm.bidirectional=true", "comm.density=0.1"],
    "dp2-zero2-randk": ["parallel.dp=2", "parallel.zero=2", "comm.compressor=randk", "comm.density=0.1"],
    "pp2": ["parallel.pp=2", "train.grad_clip=0.5"],
    "tp2": ["parallel.tp=2"],
    "dp2-ep2-moe": ["parallel.dp=2", "parallel.ep=2", "model.experts=4", "comm.moe_compression=lsh",
                    "comm.moe_hierarchical=true", "link.ranks_per_node=1", "train.grad_clip=0.5"],
}


def _engine_paths(rank: int, world: int, run_dir: str) -> dict[str, object]:
    from pathlib import Path

    from device_check import DeviceDiscipline
    from engine.config.schema import load_config
    from engine.device import init_host_group
    from engine.train.live import KnobChannel
    from engine.train.trainer import Trainer

    import torch.distributed.optim  # noqa: F401 - scripts its optimizers on import: before the patches

    init_host_group(side=True)  # a gloo group apart from the world group, as next to NCCL
    out: dict[str, object] = {}
    for name, overrides in PATHS.items():
        cfg = load_config(None, TINY + overrides)
        folder = Path(run_dir) / name
        channel = KnobChannel(folder, cfg.live.every, 30.0) if cfg.live.every else None
        try:
            with DeviceDiscipline():
                trainer = Trainer(cfg, device=torch.device("cpu"), run_dir=folder)
                out[name] = [m.loss for m in trainer.run(on_boundary=channel)]
        except Exception as exc:  # noqa: BLE001 - every path's verdict goes back to the test
            out[name] = f"{type(exc).__name__}: {exc}"
            _release_profiler()  # a Trainer that failed while building left its profiler enabled
    return out


def _release_profiler() -> None:
    from profilers import collectives

    if collectives._PATCHES.active is not None:
        collectives._PATCHES.active.disable()


def _checker_itself(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from device_check import DeviceDiscipline, DeviceDisciplineError, check
    from engine.device import host_group, init_host_group

    side = init_host_group(side=True)
    assert init_host_group() is side and host_group() is side and side is not dist.group.WORLD  # once per world
    seen = []
    host = torch.zeros(1)
    host._device_check_host_born = "engine/x.py:1"  # as the mode tags a device-less factory
    with DeviceDiscipline():
        for group in (None, host_group()):
            try:
                check("all_reduce", group, [host])
                seen.append("accepted")
            except DeviceDisciplineError as exc:
                seen.append(str(exc))
        try:
            dist.broadcast_object_list([{"knob": 1}], src=0)
        except DeviceDisciplineError as exc:
            seen.append(str(exc))
        dist.broadcast_object_list([{"knob": 1}], src=0, group=host_group())
    return seen


@pytest.mark.slow
def test_checker_rejects_host_tensors_and_objects_on_device_groups():
    got = run_ranks(2, _checker_itself, timeout=60)[0]
    assert "engine/x.py:1" in got[0] and "No backend type associated with device type cpu" in got[0]
    assert got[1] == "accepted"  # the host group takes host tensors
    assert "host objects go through engine.device.host_group()" in got[2]


@pytest.mark.slow
def test_engine_collectives_keep_device_discipline(tmp_path):
    live = tmp_path / "dp2-lgreco-live"
    live.mkdir()
    (live / "knobs-0.json").write_text(json.dumps({"knobs": {}}))
    (live / "knobs-1.json").write_text(json.dumps({"knobs": {"comm.density": 0.05}}))
    results = run_ranks(2, _engine_paths, str(tmp_path), timeout=240)
    failures = {name: v for name, v in results[0].items() if isinstance(v, str)}
    failures.update({f"{name} (rank 1)": v for name, v in results[1].items() if isinstance(v, str)})
    assert not failures, "\n".join(f"{k}: {v}" for k, v in failures.items())
    for name in PATHS:
        losses = results[0][name]
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses), (name, losses)
        assert results[1][name] == losses, name  # the global loss, equal on every rank


INPUT_PIPELINE = "engine/data/corpus.py:"  # batches are drawn on the host by design, then copied non_blocking


def test_train_step_reads_the_device_twice_whatever_the_accumulation():
    """The engine's own host reads in a step (`.item()`, `.tolist()`, `.cpu()`, `int()`, `float()`,
    `bool()` of a device tensor: tests/device_check.py's HostSyncs): one for the reported loss, one
    for the clipping coefficient; none per micro-batch (torch's CPU AdamW reads its step counters:
    not ours). Before: also `float(norm)` in Trainer._clip, a second read of the norm."""
    from device_check import HostSyncs
    from engine.config.schema import load_config
    from engine.train.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config(None, TINY + ["batch.micro=1", "profile.enabled=false", "train.eval_interval=0"])
    trainer = Trainer(cfg, device=torch.device("cpu"))
    assert cfg.grad_accum == 8
    with HostSyncs() as syncs:
        trainer.train_step(0)
    ours = sorted(s for s in syncs.seen if not s.startswith(INPUT_PIPELINE))
    assert ours == sorted(["engine/train/loss.py:<lambda> item()", "engine/parallel/data.py:clip_grad_norm item()"]), syncs.seen


# what a step must read on the host, and why; every other read of a device tensor is a stall
NEEDED = {
    "engine/train/loss.py:result item()": "the step's loss, read after the optimizer step is queued",
    "engine/parallel/data.py:clip_grad_norm item()": "the clipping coefficient, a Python float for every grad kind",
    "engine/model/moe.py:run_experts tolist()": "each expert's rows as Python ints for split (dropless MoE), per layer",
    "engine/parallel/expert.py:__call__ tolist()": "all_to_all_single's split sizes as Python ints, per layer",
}
SYNC_PATHS = {
    "topk": ["parallel.dp=2", "comm.compressor=topk", "comm.density=0.1"],
    "randk": ["parallel.dp=2", "comm.compressor=randk", "comm.density=0.1"],
    "int8": ["parallel.dp=2", "comm.compressor=int8"],
    "bidirectional-topk": ["parallel.dp=2", "comm.compressor=topk", "comm.bidirectional=true", "comm.density=0.1"],
    "bidirectional-randk": ["parallel.dp=2", "comm.compressor=randk", "comm.bidirectional=true", "comm.density=0.1"],
    "zero2-randk": ["parallel.dp=2", "parallel.zero=2", "comm.compressor=randk", "comm.density=0.1"],
    "zero2-topk": ["parallel.dp=2", "parallel.zero=2", "comm.compressor=topk", "comm.density=0.1"],
    "moe": ["parallel.dp=2", "model.experts=4"],
    "moe-ep2": ["parallel.dp=2", "parallel.ep=2", "model.experts=4"],
    "moe-ep2-hierarchical": ["parallel.dp=2", "parallel.ep=2", "model.experts=4", "comm.moe_hierarchical=true",
                             "link.ranks_per_node=1"],
}


def _step_syncs(rank: int, world: int) -> dict[str, list[str]]:
    """Each path's host syncs in its second step (the first builds DDP's buckets, FSDP2's state)."""
    from device_check import HostSyncs
    from engine.config.schema import load_config
    from engine.train.trainer import Trainer

    out = {}
    for name, overrides in SYNC_PATHS.items():
        cfg = load_config(None, TINY + overrides + ["train.grad_clip=0.5"])
        trainer = Trainer(cfg, device=torch.device("cpu"))
        trainer.train_step(0)
        with HostSyncs() as syncs:
            trainer.train_step(1)
        out[name] = syncs.seen
        trainer.collectives.disable()
    return out


@pytest.mark.slow
def test_compression_hooks_and_moe_steps_make_only_the_needed_host_syncs():
    """Top-k, int8, Rand-k (plain, bidirectional, FSDP2) and MoE steps at dp=2 read the device only
    for the loss, the clipping coefficient and (MoE) one split-size read per layer and micro-batch.
    Before: int(indices.max()) per Top-k bucket, float(absmax) per int8 bucket, randperm on the
    host per Rand-k bucket / shard, MoE statistics .cpu() twice per layer and micro-batch, two
    or three split-size reads per expert-parallel layer."""
    from collections import Counter

    results = run_ranks(2, _step_syncs, timeout=240)
    moe_reads = 2 * 2  # 2 MoE layers x 2 micro-batches (batch 8 over dp 2, micro 2)
    wrong = {}
    for name in SYNC_PATHS:
        for rank, seen in enumerate(r[name] for r in results):
            counts = Counter(s for s in seen if not s.startswith(INPUT_PIPELINE))
            want = Counter({"engine/train/loss.py:result item()": 1, "engine/parallel/data.py:clip_grad_norm item()": 1})
            layer_reads = sum(counts[k] for k in ("engine/model/moe.py:run_experts tolist()",
                                                  "engine/parallel/expert.py:__call__ tolist()"))
            if name.startswith("moe") and layer_reads == moe_reads:  # one read per layer, either place
                want.update({k: counts[k] for k in ("engine/model/moe.py:run_experts tolist()",
                                                    "engine/parallel/expert.py:__call__ tolist()") if counts[k]})
            if counts != want:
                wrong[f"{name} rank {rank}"] = dict(counts - want)
    assert not wrong, "\n".join(f"{k}: extra host syncs {v}" for k, v in wrong.items())
