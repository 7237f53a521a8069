"""Collective profiler: busbw math, recorded gloo collectives, DDP bucket hooks, commbench."""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from profilers.bandwidth import aggregate, algbw, bus_factor, busbw, union_time
from profilers.commbench import format_busbw_table, spawn_commbench, sweep_sizes
from profilers.rendezvous import hosted_store

WORLD = 2


# -- pure math -------------------------------------------------------------------------------
def test_busbw_matches_hand_computed_values() -> None:
    # 1 GB in 0.5 s is 2 GB/s of algbw; busbw = algbw x factor (nccl-tests PERFORMANCE.md)
    assert algbw(1e9, 0.5) == pytest.approx(2.0)
    assert busbw("all_reduce", 1e9, 0.5, 4) == pytest.approx(2.0 * 2 * 3 / 4)  # 3.0
    assert busbw("all_gather", 8e9, 2.0, 8) == pytest.approx(4.0 * 7 / 8)
    assert busbw("reduce_scatter_tensor", 6e9, 3.0, 3) == pytest.approx(2.0 * 2 / 3)
    assert busbw("all_to_all_single", 1e9, 1.0, 2) == pytest.approx(0.5)
    assert busbw("broadcast", 3e9, 1.0, 16) == pytest.approx(3.0)
    assert busbw("isend", 1e9, 1.0, 2) == pytest.approx(1.0)
    assert bus_factor("all_reduce", 1) == 0.0
    assert busbw("all_reduce", 1e9, 0.0, 2) == 0.0
    with pytest.raises(ValueError, match="unknown collective 'gossip'"):
        bus_factor("gossip", 2)
    with pytest.raises(ValueError, match="n=0 must be >= 1"):
        bus_factor("all_reduce", 0)


def test_sweep_sizes() -> None:
    sizes = sweep_sizes()
    assert sizes[0] == 1024 and sizes[-1] == 256 << 20 and len(sizes) == 10
    assert all(b == a * 4 for a, b in zip(sizes, sizes[1:]))
    assert len(sweep_sizes(factor=2)) == 19
    with pytest.raises(ValueError, match="factor>=2"):
        sweep_sizes(factor=1)


def test_aggregate_and_union_time() -> None:
    events = [
        {"op": "all_reduce", "bytes": 4e9, "group_size": 2, "start": 0.0, "end": 2.0, "time": 2.0,
         "busbw": busbw("all_reduce", 4e9, 2.0, 2)},
        {"op": "all_reduce", "bytes": 4e9, "group_size": 2, "start": 1.0, "end": 2.0, "time": 1.0,
         "busbw": busbw("all_reduce", 4e9, 1.0, 2)},
        {"op": "broadcast", "bytes": 1e9, "group_size": 2, "start": 5.0, "end": 6.0, "time": 1.0,
         "busbw": 1.0},
    ]
    agg = aggregate(events)
    assert agg["all_reduce"]["bytes"] == 8e9 and agg["all_reduce"]["count"] == 2
    assert agg["all_reduce"]["busbw(GB/s)"] == pytest.approx(8 / 3)  # bus bytes / total time
    assert agg["all_reduce"]["exposed(s)"] == pytest.approx(2.0)  # overlapping intervals once
    assert union_time(events) == pytest.approx(3.0)
    assert union_time(events, start=1.5) == pytest.approx(1.5)


def test_axis_keys_and_blocking_time() -> None:
    from profilers.bandwidth import blocking_time, event_key, split_key

    def ev(axis: str, scope: str, start: float, end: float, functional: bool = True) -> dict[str, Any]:
        return {"op": "all_reduce", "axis": axis, "scope": scope, "functional": functional, "bytes": 8,
                "group_size": 2, "start": start, "end": end, "time": end - start, "busbw": 1.0}

    events = [ev("tp", "forward", 0.0, 1.0), ev("tp", "forward", 0.5, 1.5), ev("tp", "backward", 2.0, 2.25),
              ev("dp", "backward", 2.0, 3.0, functional=False), ev("", "", 4.0, 5.0)]
    assert [event_key(e) for e in events] == ["tp:all_reduce"] * 3 + ["dp:all_reduce", "all_reduce"]
    assert split_key("tp:all_reduce") == ("tp", "all_reduce") and split_key("send") == ("", "send")
    assert blocking_time(events, "forward") == pytest.approx(1.5)  # overlapping spans once
    assert blocking_time(events, "backward") == pytest.approx(0.25)  # DDP's async bucket: not blocking
    assert set(aggregate(events)) == {"tp:all_reduce", "dp:all_reduce", "all_reduce"}


def test_drain_waits_for_the_record_of_an_async_collective_whose_future_is_complete(monkeypatch) -> None:
    """The thread completing a collective's future marks it done, then runs its callbacks; a caller
    chained to it (DDP's fp16 hook) may end its step and drain before our record runs. A solo CI run
    saw one fp16 bucket's all-reduce missing from its step (38918 wire bytes, not 117436 // 2)."""
    import threading
    import time

    from profilers import collectives
    from profilers.collectives import CollectiveProfiler

    monkeypatch.setattr(collectives.dist, "get_world_size", lambda group=None: 2)
    future = torch.futures.Future()
    future.add_done_callback(lambda _: time.sleep(0.3))  # the completing thread, descheduled before our record

    class Work:
        def get_future(self):
            return future

    prof = CollectiveProfiler(enabled=False)
    tensor = torch.zeros(10)
    work = prof._record_call("all_reduce", lambda *a, **k: Work(), ["tensor", "op", "group", "async_op"],
                             (tensor,), {"async_op": True})
    completing = threading.Thread(target=future.set_result, args=([tensor],))
    completing.start()
    work.get_future().wait()  # done: what DDP's hook chain sees
    events = prof.drain()
    completing.join()
    assert [(e["op"], e["bytes"]) for e in events] == [("all_reduce", 40)]


def test_step_metrics_wire_bytes_and_patching() -> None:
    import torch.distributed as dist

    from profilers.collectives import CollectiveProfiler

    original = dist.all_reduce
    prof = CollectiveProfiler(enabled=False)
    assert dist.all_reduce is original
    prof.record_wire(100, 400)
    prof.record_wire(50, 200)
    events = [{"op": "all_gather", "bytes": 1000, "group_size": 4, "start": 0.0, "end": 0.5,
               "time": 0.5, "busbw": busbw("all_gather", 1000, 0.5, 4)}]
    metrics = prof.step_metrics(events)
    assert metrics["wire_bytes"] == 150 and metrics["dense_bytes"] == 600
    assert metrics["all_gather/bytes"] == 1000 and metrics["all_gather/time(s)"] == 0.5
    assert metrics["all_gather/busbw(GB/s)"] == pytest.approx(1000 / 0.5 / 1e9 * 3 / 4)
    assert prof.drain_wire() == (0.0, 0.0)
    packet = torch.ops._c10d_functional.all_reduce
    with prof:
        assert dist.all_reduce is not original
        assert dist.distributed_c10d.all_reduce is dist.all_reduce
        timed = torch.ops._c10d_functional.all_reduce  # DTensor's functional collectives too
        assert timed is not packet and timed == packet and timed.default is packet.default
        with pytest.raises(RuntimeError, match="another CollectiveProfiler is enabled"):
            CollectiveProfiler()
    assert dist.all_reduce is original and dist.distributed_c10d.all_reduce is original
    assert torch.ops._c10d_functional.all_reduce is packet


def test_format_busbw_table() -> None:
    rows = [{"op": "all_reduce", "size": s, "count": s // 4, "time(s)": s / 1e9,
             "algbw(GB/s)": 1.0, "busbw(GB/s)": 1.0} for s in (1024, 4096)]
    text = format_busbw_table(rows)
    assert "# all_reduce" in text and "busbw" in text and "Avg bus bandwidth" in text
    assert any(line.split()[:2] == ["4096", "1024"] for line in text.splitlines())


# -- multi-rank ------------------------------------------------------------------------------
def _entry(fn: Callable[[int, int], Any], rank: int, store_env: dict[str, str], out: str) -> None:
    import torch.distributed as dist

    os.environ.update(store_env)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    result = fn(rank, WORLD)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _spawn(fn: Callable[[int, int], Any], tmp_path: Path) -> list[Any]:
    ctx = mp.get_context("spawn")
    with hosted_store(WORLD, timeout_s=60) as env:
        procs = [ctx.Process(target=_entry, args=(fn, r, env, str(tmp_path))) for r in range(WORLD)]
        for p in procs:
            p.start()
        deadline = time.time() + 60
        while time.time() < deadline and any(p.exitcode is None for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # one rank failed: the others would wait for their timeout
            time.sleep(0.05)
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0] * WORLD
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _collectives_rank(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from profilers.collectives import CollectiveProfiler

    original = dist.all_reduce
    prof = CollectiveProfiler()
    dist.all_reduce(torch.ones(1000))  # 4000 bytes
    out = torch.empty(20)
    dist.all_gather_into_tensor(out, torch.ones(10))  # noqa: deprecated alias, still in use  # nccl-tests bytes: the 80-byte output
    work = dist.all_reduce(torch.ones(250), async_op=True)  # 1000 bytes, timed to completion
    work.wait()
    peer = 1 - rank
    if rank == 0:
        dist.send(torch.ones(64), peer)
        dist.irecv(torch.empty(32), peer).wait()  # async point-to-point: timed to completion
    else:
        dist.recv(torch.empty(64), peer)
        dist.isend(torch.ones(32), peer).wait()
    dist.barrier()  # deliberately not recorded
    events = prof.drain()
    prof.disable()
    dist.all_reduce(torch.ones(8))  # after disable: not recorded
    return {"events": events, "after": prof.drain(), "restored": dist.all_reduce is original,
            "metrics": prof.step_metrics(events)}


def test_profiler_records_gloo_collectives(tmp_path: Path) -> None:
    for rank, result in enumerate(_spawn(_collectives_rank, tmp_path)):
        events = result["events"]
        ops = [(e["op"], e["bytes"], e["group_size"]) for e in events]
        p2p = [("send", 256, 2), ("recv", 128, 2)] if rank == 0 else [("recv", 256, 2),
                                                                       ("send", 128, 2)]
        assert ops == [("all_reduce", 4000, 2), ("all_gather", 80, 2), ("all_reduce", 1000, 2),
                       *p2p]
        for e in events:
            assert e["end"] >= e["start"] and e["time"] == pytest.approx(e["end"] - e["start"])
            assert e["time"] > 0
            assert e["busbw"] == pytest.approx(busbw(e["op"], e["bytes"], e["time"], 2))
        assert result["after"] == [] and result["restored"] is True
        assert result["metrics"]["all_reduce/bytes"] == 5000
        assert result["metrics"]["all_reduce/count"] == 2


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 300)
        self.b = torch.nn.Linear(300, 64)
        self.c = torch.nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * step + rank))


def _ddp_rank(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from profilers.collectives import CollectiveProfiler

    torch.manual_seed(0)
    reference = _Net()
    prof = CollectiveProfiler()
    result: dict[str, Any] = {"grad_bytes": sum(p.numel() * 4 for p in reference.parameters())}
    for label, make_hook in (("plain", lambda: prof.allreduce_hook()),
                             ("fp16", lambda: prof.wrap_comm_hook(fp16_compress_hook))):
        net = _Net()
        net.load_state_dict(reference.state_dict())
        model = DDP(net, bucket_cap_mb=0.02)  # small buckets: several per step
        model.register_comm_hook(None, make_hook())
        steps = []
        for step in range(2):
            model.zero_grad()
            model(_batch(rank, step)).pow(2).mean().backward()
            steps.append(prof.drain())
        # the hook must average like DDP's default: compare with both ranks' data by hand
        expected = _Net()
        expected.load_state_dict(reference.state_dict())
        for r in range(world):
            expected(_batch(r, 1)).pow(2).mean().div(world).backward()
        err = max((p.grad - q.grad).abs().max().item()
                  for p, q in zip(model.module.parameters(), expected.parameters()))
        result[label] = {"steps": steps, "max_grad_err": err}
    return result


def test_ddp_hooks_account_for_all_gradient_bytes(tmp_path: Path) -> None:
    for result in _spawn(_ddp_rank, tmp_path):
        grad_bytes = result["grad_bytes"]
        counts = [sum(e["op"] == "all_reduce" for e in ev) for ev in result["plain"]["steps"]]
        assert max(counts) >= 2, counts  # bucket_cap_mb forced several buckets
        for events in result["plain"]["steps"]:
            buckets = [e for e in events if e["op"] == "all_reduce"]
            assert sum(e["bytes"] for e in buckets) == grad_bytes
            assert all(e["group_size"] == WORLD and e["time"] > 0 for e in buckets)
            assert [e for e in events if e["op"] != "all_reduce"] == []
        assert result["plain"]["max_grad_err"] < 1e-5
        for events in result["fp16"]["steps"]:
            dense = [e for e in events if e["op"] == "ddp_bucket"]
            wire = [e for e in events if e["op"] == "all_reduce"]
            assert sum(e["bytes"] for e in dense) == grad_bytes
            # fp16 compression really halves what the collectives carry
            assert sum(e["bytes"] for e in wire) == grad_bytes // 2
        assert result["fp16"]["max_grad_err"] < 1e-2


def test_commbench_small_sweep_on_two_gloo_ranks() -> None:
    ops = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "sendrecv"]
    rows = spawn_commbench(2, ops, sizes=[1024, 65536], iters=2, timeout=60)
    assert [(r["op"], r["size"]) for r in rows] == [(op, s) for op in ops for s in (1024, 65536)]
    for row in rows:
        assert row["time(s)"] > 0 and row["busbw(GB/s)"] > 0
        assert row["algbw(GB/s)"] == pytest.approx(row["size"] / row["time(s)"] / 1e9)
        assert row["busbw(GB/s)"] == pytest.approx(busbw(row["op"] if row["op"] != "sendrecv"
                                                         else "send", row["size"],
                                                         row["time(s)"], 2))
    assert "# sendrecv" in format_busbw_table(rows)


def test_commbench_in_situ_subtracts_the_compute_between_calls() -> None:
    """work_s: each all_reduce follows 20 ms of host compute; what is reported is the collective's
    share of the iteration, far below the 20 ms the compute alone takes (with 2 ranks on 2 cores
    a 4 KB gloo all_reduce costs a few ms at most, in situ or not)."""
    rows = spawn_commbench(2, ["all_reduce"], sizes=[4096], iters=5, timeout=60, work_s=0.02)
    assert len(rows) == 1 and rows[0]["size"] == 4096 and rows[0]["op"] == "all_reduce"
    assert isinstance(rows[0]["time(s)"], float) and rows[0]["time(s)"] == rows[0]["time(s)"]  # reported, not NaN
    # the reported time against the 20 ms of compute: a timing claim, bench/timing_claims.py commbench


# -- functional collectives (DTensor), FSDP2, pipeline P2P ------------------------------------
def _summary(events: list[dict[str, Any]]) -> list[tuple[str, str, str, int, int]]:
    """(axis, op, scope, bytes, group size) per event, and whether each was timed."""
    assert all(e["time"] > 0 and e["busbw"] > 0 for e in events), events
    return [(e["axis"], e["op"], e["scope"], e["bytes"], e["group_size"]) for e in events]


def _tp_fsdp_pp_rank(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    from engine.model.gpt import build_model, loss_fn
    from engine.parallel.tensor import apply_tensor_parallel
    from parallel_harness import tiny_model_config
    from profilers.collectives import CollectiveProfiler

    cfg = tiny_model_config()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x = torch.randint(0, cfg.vocab, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    out: dict[str, Any] = {}
    prof = CollectiveProfiler()
    prof.name_groups({"tp": mesh.get_group()})
    for sp in (False, True):  # tensor parallel, then sequence parallel
        model = apply_tensor_parallel(build_model(cfg, seed=0), mesh, sequence_parallel=sp)
        with CommDebugMode() as upstream:  # torch's own count, the oracle
            with prof.scope("forward"):
                loss = loss_fn(model(x[:, :-1]), x[:, 1:])
            with prof.scope("backward"):
                loss.backward()
        out[f"sp={sp}"] = {"events": _summary(prof.drain()),
                           "upstream": {str(op).split(".")[-1]: n for op, n in upstream.get_comm_counts().items()}}
    model = build_model(cfg, seed=0)  # FSDP2 (ZeRO-3) over the same ranks, labelled dp
    prof.name_groups({"dp": mesh.get_group()})
    fully_shard(model, mesh=mesh)
    loss_fn(model(x[:, :-1]), x[:, 1:]).backward()
    out["fsdp"] = _summary(prof.drain())
    peer = 1 - rank  # the pipeline's P2P: batch_isend_irecv of P2POp(isend / irecv)
    ops = [dist.P2POp(dist.isend, torch.ones(16), peer), dist.P2POp(dist.irecv, torch.empty(16), peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out["p2p"] = _summary(prof.drain())
    prof.disable()
    return out


def test_dtensor_fsdp2_and_p2p_collectives_are_recorded_with_bytes_and_time() -> None:
    """TP/SP (functional collectives), FSDP2 and batch_isend_irecv are all recorded, timed,
    with nccl-tests bytes; the TP/SP counts equal torch's CommDebugMode's."""
    from parallel_harness import run_ranks, tiny_model_config

    cfg = tiny_model_config()
    act = 2 * cfg.seq_len * cfg.d_model * 4  # bytes of one (batch 2, seq, d_model) fp32 activation
    for result in run_ranks(WORLD, _tp_fsdp_pp_rank, timeout=120):
        tp, sp = result["sp=False"], result["sp=True"]
        # forward: one all-reduce after each row-parallel layer (attn.wo, mlp.w2) per block
        forward = [e for e in tp["events"] if e[2] == "forward"]
        assert forward == [("tp", "all_reduce", "forward", act, 2)] * (2 * cfg.layers)
        assert any(e[2] == "backward" for e in tp["events"])  # column-parallel input gradients
        assert {e[:2] for e in tp["events"]} == {("tp", "all_reduce")}
        assert len(tp["events"]) == tp["upstream"]["all_reduce"]
        # sequence parallel: all-reduces become all-gather + reduce-scatter pairs, over full activations
        ops = [e[1] for e in sp["events"]]
        assert ops.count("all_gather") == sp["upstream"]["all_gather_into_tensor"] > 0
        assert ops.count("reduce_scatter") == sp["upstream"]["reduce_scatter_tensor"] > 0
        assert all(e[3] == act for e in sp["events"] if e[2] == "forward")
        fsdp = {(e[0], e[1]) for e in result["fsdp"]}
        assert fsdp == {("dp", "all_gather"), ("dp", "reduce_scatter")}
        assert sorted(e[1:] for e in result["p2p"]) == [("recv", "", 64, 2), ("send", "", 64, 2)]
