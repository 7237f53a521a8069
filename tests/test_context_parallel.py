"""Context parallelism (Ulysses all-to-all and ring attention): loss parity with one process.

Parity rule (issue 19): fp32, tiny GPT, 5 AdamW steps with clipping, the same global batch:
max abs loss difference <= 1e-4 against the single-process run, for cp=2 and cp=4 with each
implementation, and with dp=2 and tp=2 beside cp=2 (world 4).
"""
from __future__ import annotations

import contextlib

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

    from engine.model import loss_fn
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
    from engine.model import build_model
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
    from engine.model import build_model
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
    (["parallel.cp=2", "parallel.dp=2", "parallel.zero=3"], r"does not combine with parallel.zero > 0"),
    (["parallel.cp=2", "parallel.cp_impl=ring", "data.lengths=lognormal"], r"parallel.cp_impl='ring': has no packed-document masks"),
    (["parallel.cp_impl=zigzag"], r"parallel.cp_impl='zigzag': must be one of ulysses, ring"),
    (["data.lengths=zipf"], r"data.lengths='zipf': must be one of fixed, lognormal, pareto or a file"),
    (["data.length_max=65"], r"data.length_max=65: must be in \[0, model.seq_len=64\]"),
])
def test_context_parallel_validation(bad, match):
    from engine.config import load_config
    from engine.errors import ConfigError, ConfigErrors

    with pytest.raises((ConfigError, ConfigErrors), match=match):
        load_config(None, ["model.heads=4", "model.d_model=32", "model.seq_len=64"] + bad)


def test_world_size_counts_cp_and_the_mesh_puts_cp_between_dp_and_tp():
    from engine.config import load_config
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
    from engine.config import load_config
    from engine.launch import launch
    from engine.train import Trainer
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
