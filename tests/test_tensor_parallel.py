"""Tensor parallelism (DTensor Megatron plan), alone and with data parallelism: loss parity with one process.

Parity rule (issue 4): fp32, tiny GPT, 5 AdamW steps with clipping, the same global batch:
max abs loss difference <= 1e-4 against the single-process run; the global grad norms match too.
"""
from __future__ import annotations

import pytest
import torch

from parallel_harness import global_batches, run_ranks, tiny_model_config, train_steps

STEPS, GLOBAL_BATCH, MICRO, LR, MAX_NORM = 5, 8, 2, 1e-2, 0.5
TOL = 1e-4


def _batches() -> list[torch.Tensor]:
    cfg = tiny_model_config()
    return global_batches(steps=STEPS, global_batch=GLOBAL_BATCH, seq_len=cfg.seq_len, vocab=cfg.vocab)


def _tp_model(tp_mesh, sequence_parallel: bool):
    from engine.model.gpt import build_model
    from engine.parallel.tensor import apply_tensor_parallel

    return apply_tensor_parallel(build_model(tiny_model_config(), seed=0), tp_mesh,
                                 sequence_parallel=sequence_parallel)


def _first_grads(model) -> dict[str, torch.Tensor]:
    """Full gradients after one backward of the first micro-batch of the first global batch."""
    from torch.distributed.tensor import DTensor

    from engine.model.gpt import loss_fn

    mb = _batches()[0][:MICRO]
    loss_fn(model(mb[:, :-1]), mb[:, 1:]).backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _tp_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from engine.parallel.zero import build_optimizer

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    out = {}
    for sp in (False, True):
        model = _tp_model(mesh, sp)
        out[f"kinds_sp{sp}"] = {n: type(p).__name__ for n, p in model.named_parameters()}
        out[f"local_sp{sp}"] = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()
                                if isinstance(p, DTensor)}
        out[f"grads_sp{sp}"] = _first_grads(model)
        opt = build_optimizer(model, stage=0, lr=LR, weight_decay=0.1)
        # micro-batches of 4: two per step here (the reference takes four of 2; same global batch)
        out[f"run_sp{sp}"] = train_steps(model, opt, _batches(), micro=2 * MICRO, max_norm=MAX_NORM)
    return out


def _tp_foreach_body(rank: int, world_size: int) -> dict:
    """TP with AdamW's foreach kernels, its default on CUDA (CPU defaults to the per-tensor loop)."""
    from torch.distributed.device_mesh import init_device_mesh

    from engine.parallel.zero import build_optimizer

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = _tp_model(mesh, sequence_parallel=False)
    opt = build_optimizer(model, stage=0, lr=LR, weight_decay=0.1)
    for group in opt.param_groups:
        group["foreach"] = True
    return train_steps(model, opt, _batches(), micro=2 * MICRO, max_norm=MAX_NORM)


def _dp_tp_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from engine.parallel.data import apply_data_parallel
    from engine.parallel.zero import build_optimizer

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    out = {}
    for sp in (False, True):
        model = apply_data_parallel(_tp_model(mesh["tp"], sp), dp_mesh=mesh["dp"])
        opt = build_optimizer(model, stage=0, lr=LR, weight_decay=0.1)
        out[f"run_sp{sp}"] = train_steps(model, opt, _batches(), dp_rank=dp_rank, dp=2, micro=MICRO,
                                         max_norm=MAX_NORM, dp_group=mesh["dp"].get_group())
    return out


@pytest.fixture(scope="module")
def reference() -> dict:
    from engine.model.gpt import build_model
    from engine.parallel.zero import build_optimizer

    model = build_model(tiny_model_config(), seed=0)
    grads = _first_grads(model)
    opt = build_optimizer(model, stage=0, lr=LR, weight_decay=0.1)
    run = train_steps(model, opt, _batches(), micro=MICRO, max_norm=MAX_NORM,
                      clip=torch.nn.utils.clip_grad_norm_)
    return {"grads": grads, **run}


def _assert_parity(run: dict, ref: dict) -> None:
    loss_diff = max(abs(a - b) for a, b in zip(run["loss"], ref["loss"]))
    assert loss_diff <= TOL, (run["loss"], ref["loss"])
    assert run["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert max(ref["grad_norm"]) > MAX_NORM  # clipping was active, so the norm mattered


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return run_ranks(2, _tp_body)


@pytest.mark.parametrize("sp", [False, True])
def test_tp2_loss_and_grad_norm_match_single_process(tp2, reference, sp):
    for out in tp2:
        _assert_parity(out[f"run_sp{sp}"], reference)


@pytest.mark.parametrize("sp", [False, True])
def test_tp2_shards_block_weights_and_keeps_embeddings_plain(tp2, sp):
    kinds, local = tp2[0][f"kinds_sp{sp}"], tp2[0][f"local_sp{sp}"]
    assert kinds["tok_emb.weight"] == "Parameter" and kinds["pos_emb.weight"] == "Parameter"
    assert local["layers.0.attn.wq.weight"] == (16, 32)  # column-parallel: output rows split
    assert local["layers.0.attn.wo.weight"] == (32, 16)  # row-parallel: input columns split
    assert local["layers.1.mlp.w1.weight"] == (64, 32) and local["layers.1.mlp.w2.weight"] == (32, 64)
    assert (kinds["layers.0.ln1.weight"] == "DTensor") is sp  # norms are DTensors only under SP


@pytest.mark.parametrize("sp", [False, True])
def test_tp2_first_gradients_equal_single_process_and_across_ranks(tp2, reference, sp):
    for name, ref_grad in reference["grads"].items():
        for out in tp2:
            torch.testing.assert_close(out[f"grads_sp{sp}"][name], ref_grad, atol=1e-6, rtol=1e-5,
                                       msg=lambda m: f"{name}: {m}")
        # replicated params: every tp rank holds the same full gradient, bit for bit
        assert torch.equal(tp2[0][f"grads_sp{sp}"][name], tp2[1][f"grads_sp{sp}"][name]), name


def test_tp2_steps_with_adamw_foreach_kernels_as_on_cuda(reference):
    """TP leaves embeddings plain tensors beside DTensor weights; foreach AdamW (CUDA's default)
    refused that mix ("got mixed torch.Tensor and DTensor") on the first H100 run."""
    for out in run_ranks(2, _tp_foreach_body):
        _assert_parity(out, reference)


def test_dp2_x_tp2_matches_single_process(reference):
    outs = run_ranks(4, _dp_tp_body)
    for out in outs:
        for sp in (False, True):
            _assert_parity(out[f"run_sp{sp}"], reference)


def test_tensor_parallel_refuses_tp_that_does_not_divide_heads():
    from engine.parallel.tensor import apply_tensor_parallel

    class FakeMesh:
        def size(self) -> int:
            return 3

    from engine.model.gpt import build_model

    with pytest.raises(ValueError, match=r"tp=3 must divide model.heads=4 .*; try 1, 2, 4"):
        apply_tensor_parallel(build_model(tiny_model_config(), seed=0), FakeMesh())
