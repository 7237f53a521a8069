"""Context parallelism (Ulysses all-to-all and ring attention): loss parity with one process.

Parity rule (issue 19): fp32, tiny GPT, 5 AdamW steps with clipping, the same global batch:
max abs loss difference <= 1e-4 against the single-process run, for cp=2 and cp=4 with each
implementation, and with dp=2 and tp=2 beside cp=2 (world 4).
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

from parallel_harness import global_batches, micro_batches, run_ranks, tiny_model_config, train_steps

STEPS, GLOBAL_BATCH, MICRO, LR, MAX_NORM = 5, 8, 2, 1e-2, 0.5
TOL = 1e-4
IMPLS = ("ulysses", "ring")


def _batches() -> list[torch.Tensor]:
    cfg = tiny_model_config()
    return global_batches(steps=STEPS, global_batch=GLOBAL_BATCH, seq_len=cfg.seq_len, vocab=cfg.vocab)


def _cp_train(model, opt, *, cp_mesh, dp: int, dp_rank: int, grad_group) -> list[float]:
    """Like parallel_harness.train_steps, with each micro-batch cut along the sequence over cp."""
    import torch.distributed as dist

    from engine.model.gpt import loss_fn
    from engine.parallel.context import chunk_positions, shard_sequence
    from engine.parallel.data import clip_grad_norm, no_sync_context

    cp, cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()
    losses = []
    for batch in _batches():
        mbs = micro_batches(batch, dp_rank=dp_rank, dp=dp, micro=MICRO)
        total = torch.zeros(())
        for i, mb in enumerate(mbs):
            x, y = mb[:, :-1], mb[:, 1:]
            pos = chunk_positions(x.shape[1], cp=cp, cp_rank=cp_rank)
            ctx = no_sync_context(model) if i < len(mbs) - 1 else contextlib.nullcontext()
            with ctx:
                logits = model(shard_sequence(x, cp=cp, cp_rank=cp_rank), positions=pos)
                loss = loss_fn(logits, shard_sequence(y, cp=cp, cp_rank=cp_rank)) / len(mbs)
                loss.backward()
            total += loss.detach()
        dist.all_reduce(total, group=grad_group)
        losses.append(total.item() / (dp * cp))
        clip_grad_norm(list(model.parameters()), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def _run_layout(mesh, impl: str, *, dp: int, tp: int) -> list[float]:
    from engine.model.gpt import build_model
    from engine.parallel.context import apply_context_parallel
    from engine.parallel.data import apply_data_parallel
    from engine.parallel.tensor import apply_tensor_parallel
    from engine.parallel.zero import build_optimizer

    model = build_model(tiny_model_config(), seed=0)
    if tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    apply_context_parallel(model, mesh["cp"], impl=impl)
    grad_mesh = mesh["dp_cp"] if dp > 1 else mesh["cp"]
    model = apply_data_parallel(model, dp_mesh=grad_mesh)
    opt = build_optimizer(model, stage=0, lr=LR, weight_decay=0.1)
    dp_rank = mesh["dp"].get_local_rank() if dp > 1 else 0
    return _cp_train(model, opt, cp_mesh=mesh["cp"], dp=dp, dp_rank=dp_rank, grad_group=grad_mesh.get_group())


def _cp_only_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    return {impl: _run_layout(mesh, impl, dp=1, tp=1) for impl in IMPLS}


def _mixed_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    dp_cp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp_cp["dp", "cp"]._flatten("dp_cp")
    cp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    out = {}
    for impl in IMPLS:
        out[f"dp2-cp2-{impl}"] = _run_layout(dp_cp, impl, dp=2, tp=1)
        out[f"cp2-tp2-{impl}"] = _run_layout(cp_tp, impl, dp=1, tp=2)
    return out


@pytest.fixture(scope="module")
def reference() -> list[float]:
    from engine.model.gpt import build_model
    from engine.parallel.zero import build_optimizer

    model = build_model(tiny_model_config(), seed=0)
    opt = build_optimizer(model, stage=0, lr=LR, weight_decay=0.1)
    return train_steps(model, opt, _batches(), micro=MICRO, max_norm=MAX_NORM,
                       clip=torch.nn.utils.clip_grad_norm_)["loss"]


def _assert_parity(got: list[float], ref: list[float]) -> None:
    assert len(got) == STEPS
    assert max(abs(a - b) for a, b in zip(got, ref)) <= TOL, (got, ref)


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_alone_matches_single_process(reference, cp):
    for out in run_ranks(cp, _cp_only_body):
        for impl in IMPLS:
            _assert_parity(out[impl], reference)


def test_cp2_with_dp2_and_with_tp2_matches_single_process(reference):
    outs = run_ranks(4, _mixed_body)
    for out in outs:
        for name, losses in out.items():
            _assert_parity(losses, reference)
    assert set(outs[0]) == {f"{a}-{impl}" for a in ("dp2-cp2", "cp2-tp2") for impl in IMPLS}


@pytest.mark.parametrize("bad, match", [
    (["parallel.cp=3"], r"parallel.cp=3: with cp_impl=ulysses, tp\*cp = 1\*3 must divide model.heads=4"),
    (["parallel.cp=2", "parallel.tp=4", "model.heads=4"], r"tp\*cp = 4\*2 must divide model.heads=4"),
    (["parallel.cp=2", "parallel.cp_impl=ring", "model.seq_len=15"], r"model.seq_len=15: must be divisible by parallel.cp=2"),
    (["parallel.cp=2", "parallel.pp=2"], r"does not combine with parallel.pp > 1"),
    (["parallel.cp=2", "parallel.dp=2", "co2.enabled=true"], r"does not combine with co2.enabled"),
    (["parallel.cp=2", "parallel.cp_impl=ring", "data.lengths=lognormal"], r"parallel.cp_impl='ring': has no packed-document masks"),
    (["parallel.cp_impl=zigzag"], r"parallel.cp_impl='zigzag': must be one of ulysses, ring"),
    (["data.lengths=zipf"], r"data.lengths='zipf': must be one of fixed, lognormal, pareto or a file"),
    (["data.length_max=65"], r"data.length_max=65: must be in \[0, model.seq_len=64\]"),
])
def test_context_parallel_validation(bad, match):
    from engine.config.schema import load_config
    from engine.errors import ConfigError, ConfigErrors

    with pytest.raises((ConfigError, ConfigErrors), match=match):
        load_config(None, ["model.heads=4", "model.d_model=32", "model.seq_len=64"] + bad)


def test_world_size_counts_cp_and_the_mesh_puts_cp_between_dp_and_tp():
    from engine.config.schema import load_config
    from engine.mesh import ParallelDims

    assert load_config(None, ["parallel.dp=2", "parallel.cp=2"]).world_size == 4
    dims = ParallelDims(2, 2, 1, 8, cp=2)
    assert [tuple(dims.coords(r).values()) for r in (0, 1, 2, 3, 4)] == [
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 1, 1), (0, 1, 0, 0)]  # (pp, dp, cp, tp)
    with pytest.raises(Exception, match=r"dp\(2\) \* tp\(2\) \* pp\(1\) \* cp\(2\) = 8.*must equal world_size\(4\)"):
        ParallelDims(2, 2, 1, 4, cp=2)


def test_search_space_layouts_with_cp():
    from tuning.space import layouts, parse_layout

    assert "dp1-tp1-pp1-cp4" in layouts(4, cp=True) and "dp2-tp1-pp1-cp2" in layouts(4, cp=True)
    assert len(layouts(4, cp=True)) == 10  # two factors of 2 over four axes: C(5, 3)
    assert parse_layout("dp2-tp1-pp1-cp2") == {"parallel.dp": 2, "parallel.tp": 1, "parallel.pp": 1, "parallel.cp": 2}
    assert parse_layout("dp2-tp1-pp2") == {"parallel.dp": 2, "parallel.tp": 1, "parallel.pp": 2}


@pytest.mark.xdist_group("launch")
def test_engine_dp2_cp2_ring_matches_single_process(tmp_path):
    """Through the launcher and the train loop: data sharded along the sequence, positions,
    loss averaged over dp x cp, evaluation, the layout in the store."""
    from engine.config.schema import load_config
    from engine.launch.local import launch
    from engine.train.trainer import Trainer
    from profilers.store import RunStore

    tiny = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=16", "train.steps=5",
            "train.lr=0.003", "batch.global=8", "batch.micro=2", "train.grad_clip=0.5", "train.eval_interval=5",
            "profile.host_interval_s=0", "profile.nvml_interval_s=0"]
    torch.set_num_threads(1)
    ref = list(Trainer(load_config(None, tiny), device=torch.device("cpu")).run())
    cfg = load_config(None, tiny + ["parallel.dp=2", "parallel.cp=2", "parallel.cp_impl=ring"])
    result = launch(cfg, home=tmp_path)
    got = [s["loss"] for s in result.steps]
    assert max(abs(a - m.loss) for a, m in zip(got, ref)) <= TOL, (got, [m.loss for m in ref])
    assert abs(result.summary["val_loss"] - ref[-1].val_loss) <= TOL
    assert RunStore.open_home(tmp_path).run(result.run_id)["layout"]["cp"] == 2


# ---------------------------------------------------------------- grouped-query K/V through cp (issue 48)

def _gqa_body(rank: int, world_size: int, impl: str, heads: int, kv_heads: int, window: int | None) -> dict:
    """One attention call on this rank's chunk; the full-sequence inputs are the same on every rank
    (seeded), so each rank also computes the one-process answer. K/V bytes counted by the
    collectives profiler (the functional all_to_all's input, the ring's sends)."""
    import torch.distributed as dist

    from engine.parallel.context import local_attention, ring_attention_cpu, shard_sequence, ulysses_attention
    from profilers.collectives import CollectiveProfiler

    g = torch.Generator().manual_seed(0)
    b, t, d = 2, 16, 8
    q, k, v = (torch.randn(b, h, t, d, generator=g) for h in (heads, kv_heads, kv_heads))
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = local_attention(*ref_in, window=window)
    ref.sum().backward()
    mine = [shard_sequence(x, cp=world_size, cp_rank=rank, dim=2).requires_grad_() for x in (q, k, v)]
    core = ulysses_attention if impl == "ulysses" else ring_attention_cpu
    with CollectiveProfiler() as prof:
        out = core(*mine, group=dist.group.WORLD, window=window)
        out.sum().backward()
        events = prof.drain()
    errs = [(out - shard_sequence(ref, cp=world_size, cp_rank=rank, dim=2)).abs().max().item()]
    errs += [(x.grad - shard_sequence(r.grad, cp=world_size, cp_rank=rank, dim=2)).abs().max().item()
             for x, r in zip(mine, ref_in)]
    return {"err": max(errs), "bytes": sorted(int(e["bytes"]) for e in events if e["op"] in ("all_to_all", "send"))}


@pytest.mark.parametrize("impl, cp, heads, kv_heads, window", [
    ("ulysses", 2, 4, 2, None), ("ulysses", 2, 4, 2, 3), ("ulysses", 4, 8, 2, None), ("ring", 2, 4, 2, None),
    ("ring", 4, 4, 1, None)])
def test_kv_heads_travel_unrepeated_and_attention_matches_one_process(impl, cp, heads, kv_heads, window):
    """Output and q/k/v gradients equal one process's; K/V messages are their own heads' size:
    Ulysses' k and v all-to-alls carry max(kv, lcm(kv, cp)) heads (kv=2 at cp=4: 4 of 8), the ring's
    K/V block kv heads (e19d228 repeated them to the query heads first)."""
    b, t, d = 2, 16, 8
    per_head = b * (t // cp) * d * 4  # one head of one rank's chunk, fp32
    for out in run_ranks(cp, _gqa_body, impl, heads, kv_heads, window):
        assert out["err"] <= 1e-5, out
        if impl == "ulysses":  # forward q, k, v, out; backward their gradients
            sent_kv = math.lcm(kv_heads, cp)
            assert out["bytes"] == sorted([heads * per_head] * 4 + [sent_kv * per_head] * 4), out["bytes"]
        else:  # stacked K and V, cp - 1 steps forward; backward K/V again and their gradients, cp - 1 each
            assert out["bytes"] == [2 * kv_heads * per_head] * (3 * (cp - 1)), out["bytes"]


def _saved_body(rank: int, world_size: int, score_chunk: int) -> dict:
    """One ring attention call on this rank's chunk with its query rows in chunks of `score_chunk` scores:
    the bytes autograd saved for its backward (saved_tensors_hooks), and the output's and q/k/v
    gradients' largest difference from one process."""
    import torch.distributed as dist

    from engine.parallel import context
    from engine.parallel.context import local_attention, ring_attention_cpu, shard_sequence

    context.SCORE_CHUNK = score_chunk
    g = torch.Generator().manual_seed(0)
    b, t, d = 1, 256, 8
    q, k, v = (torch.randn(b, h, t, d, generator=g) for h in (4, 2, 2))
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = local_attention(*ref_in)
    ref.sum().backward()
    mine = [shard_sequence(x, cp=world_size, cp_rank=rank, dim=2).requires_grad_() for x in (q, k, v)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel() * x.element_size()) or x,
                                                  lambda x: x):
        out = ring_attention_cpu(*mine, group=dist.group.WORLD)
    out.sum().backward()
    errs = [(out - shard_sequence(ref, cp=world_size, cp_rank=rank, dim=2)).abs().max().item()]
    errs += [(x.grad - shard_sequence(r.grad, cp=world_size, cp_rank=rank, dim=2)).abs().max().item()
             for x, r in zip(mine, ref_in)]
    return {"saved": sum(saved), "err": max(errs)}


def test_ring_attention_keeps_flash_attentions_tensors_for_backward():
    """Issue 62: the CPU ring keeps what flash attention keeps, its local q, k, v, the output and the
    log-sum-exp (O(s/cp x d) per rank), not a block's (s/cp)^2 scores: 4 q heads, 2 kv heads, d 8, 128 local
    tokens keep 51,200 bytes where one block's fp32 scores are 262,144 (before: 854,016 on rank 0). Query rows in
    chunks of 32 (scores budget 4 heads x 128 keys x 32) give the one-process answer."""
    b, heads, kv_heads, tokens, d = 1, 4, 2, 128, 8
    flash = 4 * b * tokens * (2 * heads * d + 2 * kv_heads * d + heads)  # q, out; k, v; lse: fp32
    scores = 4 * b * heads * tokens * tokens
    for out in run_ranks(2, _saved_body, b * heads * tokens * 32):
        assert out["err"] <= 1e-5, out
        assert out["saved"] == flash == 51200 and out["saved"] < scores / 5, out


LLAMA_GQA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}


@pytest.fixture(scope="module")
def cp_bytes_runs(tmp_path_factory) -> dict:
    """Llama 4 q / 2 kv heads at cp2 through the launcher, each cp core: the collectives profiler's
    bytes per step and rank, as the run store holds them."""
    import json

    from engine.config.schema import load_config
    from engine.launch.local import launch
    from profilers.store import RunStore

    home = tmp_path_factory.mktemp("cp_bytes")
    runs = {}
    for impl in IMPLS:
        cfg = load_config(None, [f"model.hf={json.dumps(LLAMA_GQA)}", "model.seq_len=16", "train.steps=2",
                                 "batch.global=4", "batch.micro=2", "parallel.cp=2", f"parallel.cp_impl={impl}",
                                 "profile.host_interval_s=0", "profile.nvml_interval_s=0", "train.eval_interval=0"])
        result = launch(cfg, home=home)
        assert result.status == "completed", result.error
        runs[impl] = (cfg, {(r.step, r.rank, r.name): r.value
                            for r in RunStore.open_home(home).metrics(result.run_id, kind="comm")})
    return runs


@pytest.mark.xdist_group("launch")
def test_gqa_model_sends_kv_heads_over_heads_of_the_kv_bytes(cp_bytes_runs):
    """Per step and rank, 2 layers x 2 micro-batches of b=2 x 8 local tokens x head_dim 8, fp32:
    Ulysses sends q and the output at 4 heads and k, v at 2 (e19d228: 65536 B, k/v at 4 heads);
    the ring sends K/V at 2 heads (e19d228: 32768 B): half the K/V bytes, kv_heads/heads; its backward sends K/V
    again with their gradients (flash attention's ring backward, as the simulator prices it)."""
    head = 2 * 8 * 8 * 4
    layers_micro = 2 * 2
    expected = {"ulysses": ("cp:all_to_all/bytes", layers_micro * 2 * (2 * 4 * head + 2 * 2 * head)),
                "ring": ("cp:send/bytes", layers_micro * 3 * (2 * 2 * head))}
    for impl, (name, want) in expected.items():
        metrics = cp_bytes_runs[impl][1]
        got = {key: value for key, value in metrics.items() if key[2] == name}
        assert len(got) == 4 and set(got.values()) == {want}, (impl, got, want)
    assert expected["ulysses"][1] == 49152 and expected["ring"][1] == 24576


@pytest.mark.xdist_group("launch")
def test_simulator_prices_the_cp_bytes_the_profiler_counted(cp_bytes_runs):
    """tuning/sim/context.py's Ulysses bytes for the same run config are the counted number."""
    from tuning.sim.context import ulysses_step_bytes
    from tuning.sim.spec import columns
    from tuning.sim.simulator import from_run_config

    cfg, metrics = cp_bytes_runs["ulysses"]
    model, spec = from_run_config(cfg.to_dict())
    priced = float(ulysses_step_bytes(model, columns(spec), spec.cp))
    counted = {value for (step, rank, name), value in metrics.items() if name == "cp:all_to_all/bytes"}
    assert counted == {priced}, (counted, priced)
