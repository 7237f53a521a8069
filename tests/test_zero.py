"""ZeRO stages 1-3 at dp=2, alone and with tp=2: loss parity with one process, sharded memory, estimates.

Parity rule (issue 4): fp32, tiny GPT, 5 AdamW steps with clipping and gradient accumulation,
the same global batch: max abs loss difference <= 1e-4 against the single-process run.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from engine.config.schema import BatchConfig, ParallelConfig, RunConfig
from engine.train.memory import estimate_memory, measure_model_state
from parallel_harness import global_batches, micro_batches, run_ranks, tiny_model_config, train_steps

STEPS, GLOBAL_BATCH, MICRO, LR, MAX_NORM, TOL = 5, 8, 2, 1e-2, 0.5, 1e-4
# (ZeRO stage, sequence_parallel) at dp=2 x tp=2; stage 3 also recomputes activations
TP_CASES = ((1, True), (2, False), (3, True))


def _batches() -> list[torch.Tensor]:
    cfg = tiny_model_config()
    return global_batches(steps=STEPS, global_batch=GLOBAL_BATCH, seq_len=cfg.seq_len, vocab=cfg.vocab)


def _kept_after_forward(model) -> bool:
    """Whether a block weight is still unsharded (a plain tensor) between forward and backward."""
    from torch.distributed.tensor import DTensor

    from engine.model.gpt import loss_fn

    mb = _batches()[0][:MICRO]
    loss = loss_fn(model(mb[:, :-1]), mb[:, 1:])
    kept = not isinstance(model.layers["0"].mlp.w1.weight, DTensor)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return kept


def _no_sync_probe(model, dp_rank: int) -> tuple:
    """Gradient of tok_emb after a backward inside no_sync_context, then after a synced one.

    Each dp rank uses its own micro-batch, so unsynchronised DDP gradients differ across ranks;
    FSDP2 leaves the sharded gradients unset until the synchronised backward reduce-scatters.
    """
    from torch.distributed.tensor import DTensor

    from engine.model.gpt import loss_fn
    from engine.parallel.data import no_sync_context

    mb = _batches()[0][dp_rank * MICRO:(dp_rank + 1) * MICRO]
    weight = dict(model.named_parameters())[next(n for n, _ in model.named_parameters() if "tok_emb" in n)]
    seen = []
    for ctx in (no_sync_context(model), contextlib.nullcontext()):
        with ctx:
            loss_fn(model(mb[:, :-1]), mb[:, 1:]).backward()
        g = weight.grad
        seen.append(None if g is None else (g.full_tensor() if isinstance(g, DTensor) else g).clone())
    model.zero_grad(set_to_none=True)
    return tuple(seen)


def _peak_step(model, opt, dp_rank: int, stage: int) -> dict:
    """Model state at its peak in one more step, as the engine runs it (ZeRO-2/3 reduce-scatter
    every micro-batch, ZeRO-2 keeps parameters gathered between them): params and grads during
    backward, optimizer states after the step."""
    from engine.train.memory import ModelStatePeak
    from engine.model.gpt import loss_fn
    from engine.parallel.data import no_sync_context

    from engine.parallel.zero import keep_gathered

    mbs = micro_batches(_batches()[0], dp_rank=dp_rank, dp=2, micro=MICRO)
    between = {2: keep_gathered, 3: lambda _: contextlib.nullcontext()}.get(stage, no_sync_context)
    with ModelStatePeak([model]) as peak:
        for i, mb in enumerate(mbs):
            last = i == len(mbs) - 1
            with contextlib.nullcontext() if last else between(model):
                loss_fn(model(mb[:, :-1]), mb[:, 1:]).backward()
        opt.step()
    state = {**peak.peak, "optimizer": measure_model_state(model, opt)["optimizer"]}
    opt.zero_grad(set_to_none=True)
    return state


def _run(model, mesh, stage: int) -> dict:
    from engine.parallel.zero import build_optimizer

    group = mesh["dp"].get_group()
    opt = build_optimizer(model, stage=stage, lr=LR, weight_decay=0.1, process_group=group)
    out = train_steps(model, opt, _batches(), dp_rank=mesh["dp"].get_local_rank(), dp=2, micro=MICRO,
                      max_norm=MAX_NORM, dp_group=group, measure=True)
    return {**out, "peak": _peak_step(model, opt, mesh["dp"].get_local_rank(), stage)}


def _dp2_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from engine.model.gpt import build_model
    from engine.parallel.data import apply_data_parallel
    from engine.parallel.zero import apply_zero

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    out = {}
    for stage in (0, 1, 2, 3):
        model = build_model(tiny_model_config(), seed=0)
        if stage == 0:
            model = apply_data_parallel(model, process_group=mesh["dp"].get_group())
        else:
            model = apply_zero(model, mesh["dp"], stage=stage)
        if stage >= 2:
            out[f"kept{stage}"] = _kept_after_forward(model)
        if stage in (0, 3):
            out[f"probe{stage}"] = _no_sync_probe(model, mesh["dp"].get_local_rank())
        out[stage] = _run(model, mesh, stage)
    out["dropout"] = _dropout_runs(mesh)
    return out


def _dropout_runs(mesh) -> dict:
    """Stages 0-3 at dp=2 with dropout 0.1 from one seed: every stage draws the same masks on a
    rank (FSDP2, DDP and ZeroRedundancyOptimizer consume no random numbers). Against one process
    dropout cannot match: each dp rank draws masks for its own slice of the batch."""
    import dataclasses

    from engine.model.gpt import build_model
    from engine.parallel.data import apply_data_parallel
    from engine.parallel.zero import apply_zero

    runs = {}
    for stage in (0, 1, 2, 3):
        model = build_model(dataclasses.replace(tiny_model_config(), dropout=0.1), seed=0)
        model = apply_data_parallel(model, process_group=mesh["dp"].get_group()) if stage == 0 \
            else apply_zero(model, mesh["dp"], stage=stage)
        torch.manual_seed(1000 + mesh["dp"].get_local_rank())
        runs[stage] = _run(model, mesh, stage)["loss"]
    return runs


def _dp2_tp2_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from engine.model.gpt import build_model
    from engine.parallel.tensor import apply_tensor_parallel
    from engine.parallel.zero import apply_zero

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for stage, sp in TP_CASES:
        model = apply_tensor_parallel(build_model(tiny_model_config(), seed=0), mesh["tp"],
                                      sequence_parallel=sp)
        model.set_activation_checkpointing(stage == 3)
        out[stage] = _run(apply_zero(model, mesh["dp"], stage=stage), mesh, stage)
    return out


@pytest.fixture(scope="module")
def reference() -> dict:
    from engine.model.gpt import build_model
    from engine.parallel.zero import build_optimizer

    model = build_model(tiny_model_config(), seed=0)
    opt = build_optimizer(model, stage=0, lr=LR, weight_decay=0.1)
    return train_steps(model, opt, _batches(), micro=MICRO, max_norm=MAX_NORM,
                       clip=torch.nn.utils.clip_grad_norm_, measure=True)


@pytest.fixture(scope="module")
def dp2() -> list[dict]:
    return run_ranks(2, _dp2_body)


@pytest.fixture(scope="module")
def dp2_tp2() -> list[dict]:
    return run_ranks(4, _dp2_tp2_body)


def _assert_parity(run: dict, ref: dict) -> None:
    assert max(abs(a - b) for a, b in zip(run["loss"], ref["loss"])) <= TOL, (run["loss"], ref["loss"])
    assert run["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert max(ref["grad_norm"]) > MAX_NORM  # clipping was active


def _config(*, dp: int, tp: int, zero: int, sp: bool = False) -> RunConfig:
    return RunConfig(model=tiny_model_config(),
                     parallel=ParallelConfig(dp=dp, tp=tp, zero=zero, sequence_parallel=sp),
                     batch=BatchConfig(global_=GLOBAL_BATCH, micro=MICRO))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_dp2_matches_single_process(dp2, reference, stage):
    for out in dp2:
        _assert_parity(out[stage], reference)


@pytest.mark.parametrize("stage,sp", TP_CASES)
def test_zero_dp2_x_tp2_matches_single_process(dp2_tp2, reference, stage, sp):
    for out in dp2_tp2:
        _assert_parity(out[stage], reference)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_dp2_with_dropout_and_weight_decay_matches_ddp(dp2, stage):
    for out in dp2:
        runs = out["dropout"]
        assert max(abs(a - b) for a, b in zip(runs[stage], runs[0])) <= TOL, (runs[stage], runs[0])
        assert runs[0] != out[0]["loss"]  # dropout really changed the losses


def test_zero2_keeps_parameters_after_forward_and_zero3_reshards(dp2):
    assert dp2[0]["kept2"] and dp2[1]["kept2"]
    assert not dp2[0]["kept3"] and not dp2[1]["kept3"]


def test_no_sync_context_skips_the_gradient_reduction(dp2):
    (ddp_local0, ddp_synced0), (ddp_local1, ddp_synced1) = dp2[0]["probe0"], dp2[1]["probe0"]
    assert not torch.allclose(ddp_local0, ddp_local1)  # DDP: local gradients, not yet averaged
    torch.testing.assert_close(ddp_synced0, ddp_synced1)
    for out in dp2:
        fsdp_local, fsdp_synced = out["probe3"]
        assert fsdp_local is None and fsdp_synced is not None  # FSDP2: reduce-scatter only when synced


def test_zero_stages_shard_what_they_promise(dp2):
    plain = dp2[0][0]["state"]
    for out in dp2:
        s1, s2, s3 = (out[k]["state"] for k in (1, 2, 3))
        assert s1["params"] == plain["params"] and s1["grads"] == plain["grads"]
        assert s1["optimizer"] < 0.6 * plain["optimizer"]
        assert s2["grads"] < 0.6 * plain["grads"] and s2["optimizer"] < 0.6 * plain["optimizer"]
        assert _model_state(s3) < 0.6 * _model_state(plain)
    both = sum(out[1]["state"]["optimizer"] for out in dp2)
    assert both == pytest.approx(plain["optimizer"], rel=0.01)  # a partition: nothing lost, nothing doubled


def _model_state(memory: dict) -> float:
    """Parameter + gradient + optimizer bytes of an estimate or a measurement."""
    return memory["params"] + memory["grads"] + memory["optimizer"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_estimate_within_10_percent_of_measured_peak_dp2(dp2, stage):
    """Each component at the peak (params + grads during backward): ZeRO-2 per block holds
    one block's full gradients, a single root group would hold all of them (issue 14)."""
    est = estimate_memory(_config(dp=2, tp=1, zero=stage))
    for out in dp2:
        peak = out[stage]["peak"]
        for key in ("params", "grads", "optimizer"):
            assert est[key] == pytest.approx(peak[key], rel=0.10), (key, est, peak)


@pytest.mark.parametrize("stage,sp", TP_CASES)
def test_estimate_within_10_percent_of_measured_peak_dp2_tp2(dp2_tp2, stage, sp):
    est = _model_state(estimate_memory(_config(dp=2, tp=2, zero=stage, sp=sp)))
    for out in dp2_tp2:
        assert est == pytest.approx(_model_state(out[stage]["peak"]), rel=0.10)


def test_estimate_single_process_equals_measured(reference):
    measured = reference["state"]
    est = estimate_memory(_config(dp=1, tp=1, zero=0))
    assert set(est) == {"params", "grads", "optimizer", "activations"}  # components that sum to the total
    assert est["params"] == measured["params"] and est["grads"] == measured["grads"]
    assert est["optimizer"] == pytest.approx(measured["optimizer"], rel=0.001)  # + AdamW step counters


def test_estimate_scales_with_layout():
    base, zero1, zero2, zero3 = (estimate_memory(_config(dp=4, tp=1, zero=z)) for z in (0, 1, 2, 3))
    assert zero3["optimizer"] == pytest.approx(base["optimizer"] / 4)
    # at the peak each stage holds less, though more than a quarter (unsharded blocks in flight)
    states = [_model_state(e) for e in (base, zero1, zero2, zero3)]
    assert states == sorted(states, reverse=True) and states[3] > states[0] / 4
    assert zero3["activations"] == base["activations"]
    tp = estimate_memory(_config(dp=1, tp=2, zero=0))
    assert base["params"] / 2 < tp["params"] < base["params"]  # embeddings and norms stay replicated
    sp = estimate_memory(_config(dp=1, tp=2, zero=0, sp=True))
    assert sp["activations"] < tp["activations"] < base["activations"]


def test_measure_counts_tied_weights_once():
    from engine.model.gpt import build_model

    model = build_model(tiny_model_config(), seed=0)
    unique = sum(p.numel() for p in model.parameters())  # parameters() already deduplicates
    assert measure_model_state(model)["params"] == 4 * unique
    assert model.head.weight is model.tok_emb.weight


def test_activation_estimate_within_15_percent_of_saved_tensors():
    """Bytes autograd saves in one forward (parameters excluded) against the no-recompute estimate."""
    from engine.model.gpt import build_model, loss_fn

    cfg = _config(dp=1, tp=1, zero=0)
    model = build_model(cfg.model, seed=0)
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_ptrs:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = _batches()[0][:MICRO]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    assert estimate_memory(cfg)["activations"] == pytest.approx(sum(saved.values()), rel=0.15)


def test_engine_records_zero2_peak_within_10_percent_of_estimate(tmp_path):
    """The train loop's memory records under ZeRO-2 with gradient accumulation: the measured peak
    (ModelStatePeak over the first step) next to the estimate, each within 10%."""
    from engine.config.schema import load_config
    from engine.launch.local import launch
    from profilers.store import RunStore

    cfg = load_config(None, ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=16",
                             "model.vocab=256", "train.steps=1", "batch.global=8", "batch.micro=2",
                             "parallel.dp=2", "parallel.zero=2", "profile.host_interval_s=0",
                             "profile.nvml_interval_s=0", "train.eval_interval=0"])
    result = launch(cfg, home=tmp_path)
    records = {(r.rank, r.name): r.value for r in RunStore.open_home(tmp_path).metrics(result.run_id, kind="memory")}
    for rank in (0, 1):
        for key in ("params", "grads", "optimizer"):
            assert records[(rank, f"{key}(GiB)")] == pytest.approx(records[(rank, f"estimate_{key}(GiB)")],
                                                                  rel=0.10), (rank, key)


def test_model_state_peak_start_stop_spans_a_backward_and_removes_its_hooks():
    """What Trainer.train_step does on the first profiled step (start before the step's clocks,
    stop after the optimizer): params and grads at their peak, no hook left behind."""
    from engine.train.memory import ModelStatePeak

    model = torch.nn.Linear(4, 4)  # 16 + 4 fp32 parameters: 80 bytes, and 80 of gradients
    peak = ModelStatePeak([model]).start()
    model(torch.ones(2, 4)).sum().backward()
    assert peak.stop() == {"params": 80.0, "grads": 80.0}
    model.zero_grad(set_to_none=True)
    model(torch.ones(2, 4)).sum().backward()  # hooks removed: nothing samples any more
    assert peak.peak == {"params": 80.0, "grads": 80.0} and not model._forward_pre_hooks


def test_the_engines_adamw_is_fused_on_cpu_and_steps_as_the_foreach_one():
    """One AdamW kernel per step where torch has it (CPU, CUDA): the foreach default took 2.8-6.3x as
    long per step on this host (bench/optimizer.py). Same weights as the foreach AdamW after 3 steps with
    weight decay (decayed matrices, undecayed norms/biases)."""
    from engine.model.gpt import GPT
    from engine.parallel.zero import build_optimizer, param_groups

    torch.manual_seed(0)
    fused_model = GPT(tiny_model_config())
    plain_model = GPT(tiny_model_config())
    plain_model.load_state_dict(fused_model.state_dict())
    fused = build_optimizer(fused_model, stage=0, lr=1e-2, weight_decay=0.1)
    plain = torch.optim.AdamW(param_groups(plain_model.parameters(), 0.1), lr=1e-2, betas=(0.9, 0.95),
                              foreach=True)
    assert fused.defaults["fused"] is True
    for _ in range(3):
        for model, opt in ((fused_model, fused), (plain_model, plain)):
            for p in model.parameters():
                p.grad = torch.sin(p.detach() * 7.0)  # the same gradient for both
            opt.step()
    for a, b in zip(fused_model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
