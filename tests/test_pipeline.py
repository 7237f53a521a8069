"""Pipeline parallelism: loss parity with a single process (fp32, 5 AdamW steps), bubble timing,
schedule/split plans.

Two spawned runs cover everything: world 2 (pp=2 under gpipe, 1f1b, interleaved v=2) and world 4
(dp=2 x pp=2 with DDP-wrapped stages, with `allreduce_grads` and under ZeRO-3; tp=2 x pp=2).
"""
from __future__ import annotations

import statistics

import pytest
import torch

from engine.config.schema import ModelConfig
from engine.model.gpt import build_model, loss_fn
from engine.parallel.pipeline import bubble_fraction, describe_schedule, stage_layers
from parallel_harness import counting_batches, run_ranks, single_process_losses

SEED, STEPS, GLOBAL_BATCH, MICRO, LR, EVAL_AFTER = 0, 5, 8, 2, 1e-2, 1
CFG = ModelConfig(layers=4, d_model=32, heads=4, seq_len=16, vocab=256, dropout=0.0)
TOL = 1e-4


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return counting_batches(steps=STEPS, global_batch=GLOBAL_BATCH, seq_len=CFG.seq_len, vocab=CFG.vocab)


def _reference_losses() -> list[float]:
    """The 5 training losses of one process on the global batch, then the eval loss on batch 0
    taken after step EVAL_AFTER."""
    return single_process_losses(CFG, _batches(), seed=SEED, lr=LR, eval_after=EVAL_AFTER)


def _train(mesh, *, schedule: str, virtual: int = 1, grads: str = "manual", tp: bool = False) -> dict:
    """5 AdamW steps of a pipeline on `mesh` (axes pp, dp, tp); this rank's losses, timings, ends.

    `grads`: how dp replicas agree: "manual" (`allreduce_grads`), "ddp" (stages wrapped in
    DDP) or "zero3" (stages under FSDP2, ZeRO-3).
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from engine.parallel.pipeline import allreduce_grads, build_pipeline
    from engine.parallel.tensor import apply_tensor_parallel
    from engine.parallel.zero import apply_zero

    dp_group, dp, dp_rank = mesh["dp"].get_group(), mesh["dp"].size(), mesh["dp"].get_local_rank()

    def parallelize(chunk: torch.nn.Module) -> torch.nn.Module:
        if tp:
            chunk = apply_tensor_parallel(chunk, mesh["tp"])
        if grads == "zero3":
            return apply_zero(chunk, mesh["dp"], stage=3)
        return DDP(chunk, process_group=dp_group) if grads == "ddp" else chunk

    local_batch = GLOBAL_BATCH // dp
    pipe = build_pipeline(build_model(CFG, seed=SEED), mesh["pp"], schedule=schedule, virtual=virtual,
                          layer_split=None, n_microbatches=local_batch // MICRO, loss_fn=loss_fn,
                          device="cpu", parallelize=parallelize)
    opt = torch.optim.AdamW([p for m in pipe.modules for p in m.parameters()], lr=LR)
    losses, timings, eval_loss = [], [], None
    rows = slice(dp_rank * local_batch, (dp_rank + 1) * local_batch)
    for step, (x, y) in enumerate(_batches()):
        opt.zero_grad()
        loss = pipe.step(x[rows], y[rows])
        if grads == "manual":
            allreduce_grads(pipe.modules, dp_group)
        opt.step()
        losses.append(None if loss is None else loss.item())
        timings.append(pipe.last_timing)
        if step == EVAL_AFTER:  # training goes on after a forward-only pass
            eval_loss = pipe.evaluate(_batches()[0][0][rows], _batches()[0][1][rows])
    losses.append(None if eval_loss is None else eval_loss.item())
    gpt = [m.module if isinstance(m, DDP) else m for m in pipe.modules]
    full = lambda w: (w.full_tensor() if hasattr(w, "full_tensor") else w).detach().clone()  # noqa: E731
    ends = {"tok_emb": full(gpt[0].tok_emb.weight) if pipe.is_first else None,
            "head": full(gpt[-1].head.weight) if pipe.is_last else None}
    dist.barrier()
    return {"losses": losses, "timings": timings, "is_first": pipe.is_first, "is_last": pipe.is_last,
            "ends": ends, "n_modules": len(pipe.modules)}


def _dense_inputs(mesh) -> list[bool]:
    """Whether the schedule received dense micro-batches when the step is given the engine's
    `tokens[:, :-1]` views: older torch's stages (2.11 here) check their strides against dense examples."""
    from engine.parallel.pipeline import build_pipeline

    pipe = build_pipeline(build_model(CFG, seed=SEED), mesh["pp"], schedule="gpipe", virtual=1, layer_split=None,
                          n_microbatches=GLOBAL_BATCH // MICRO, loss_fn=loss_fn, device="cpu")
    seen, step = [], pipe.schedule.step

    def spy(*args, target=None, **kwargs):
        seen.extend(t.is_contiguous() for t in (*args, target) if t is not None)
        return step(*args, target=target, **kwargs)

    pipe.schedule.step = spy
    x, y = _batches()[0]
    tokens = torch.cat([x, y[:, -1:]], dim=1)
    pipe.step(tokens[:, :-1], tokens[:, 1:])
    return seen


def _v_schedule_warmup(mesh) -> str:
    """Older torch's first step (2.11 here) warms up every stage's neighbours by p2p (newer torch uses it
    for other stage classes): a V schedule's neighbours on this rank must not be among them."""
    from torch.distributed.pipelining.schedules import _batch_p2p, _wait_batch_p2p

    from engine.parallel.pipeline import build_pipeline

    pipe = build_pipeline(build_model(CFG, seed=SEED), mesh["pp"], schedule="zbv", virtual=1, layer_split=None,
                          n_microbatches=GLOBAL_BATCH // MICRO, loss_fn=loss_fn, device="cpu")
    ops = [op for stage in pipe.schedule._stages for op in stage._get_init_p2p_neighbors_ops()]
    try:
        _wait_batch_p2p(_batch_p2p(ops))
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _world2(rank: int, world_size: int) -> dict:
    from engine.mesh import ParallelDims

    mesh = ParallelDims(dp=1, tp=1, pp=2, world_size=world_size).build_mesh("cpu")
    out = {name: _train(mesh, schedule=schedule, virtual=virtual)
           for name, schedule, virtual in (("gpipe", "gpipe", 1), ("1f1b", "1f1b", 1),
                                           ("interleaved", "interleaved", 2))}
    out["dense_inputs"] = _dense_inputs(mesh)
    out["v_warmup"] = _v_schedule_warmup(mesh)
    return out


def _world4(rank: int, world_size: int) -> dict:
    from engine.mesh import ParallelDims

    dp_mesh = ParallelDims(dp=2, tp=1, pp=2, world_size=world_size).build_mesh("cpu")
    tp_mesh = ParallelDims(dp=1, tp=2, pp=2, world_size=world_size).build_mesh("cpu")
    return {"dp2_ddp_gpipe": _train(dp_mesh, schedule="gpipe", grads="ddp"),
            "dp2_manual_1f1b": _train(dp_mesh, schedule="1f1b", grads="manual"),
            "dp2_zero3_interleaved": _train(dp_mesh, schedule="interleaved", virtual=2, grads="zero3"),
            "tp2_1f1b": _train(tp_mesh, schedule="1f1b", tp=True)}


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return _reference_losses()


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return run_ranks(2, _world2, timeout=60)


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return run_ranks(4, _world4, timeout=60)


def _pipeline_losses(results: list[dict], layout: str) -> list[float]:
    """Mean over the last-stage ranks (one per dp replica; tp ranks agree) of the step losses."""
    last = [r[layout]["losses"] for r in results if r[layout]["is_last"]]
    return [statistics.fmean(step) for step in zip(*last)]


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == STEPS + 1  # 5 training losses, then the evaluation loss
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", ["gpipe", "1f1b", "interleaved"])
def test_pp2_schedules_match_single_process(world2, reference, layout):
    assert _max_diff(_pipeline_losses(world2, layout), reference) <= TOL
    assert reference[STEPS - 1] < reference[0] - 0.1  # it trains, so parity is not trivially met
    first, last = world2[0][layout], world2[1][layout]
    assert first["is_first"] and not first["is_last"] and last["is_last"] and not last["is_first"]
    assert all(loss is None for loss in first["losses"])
    # tied embedding: the first stage's tok_emb and the last stage's head got the same updates
    torch.testing.assert_close(first["ends"]["tok_emb"], last["ends"]["head"], rtol=0, atol=0)
    assert first["n_modules"] == (2 if layout == "interleaved" else 1)


@pytest.mark.parametrize("layout", ["dp2_ddp_gpipe", "dp2_manual_1f1b", "dp2_zero3_interleaved", "tp2_1f1b"])
def test_world4_layouts_match_single_process(world4, reference, layout):
    assert _max_diff(_pipeline_losses(world4, layout), reference) <= TOL
    assert [r[layout]["is_first"] for r in world4] == [True, True, False, False]
    assert [r[layout]["is_last"] for r in world4] == [False, False, True, True]
    # ranks (0, 2) and (1, 3) form the two pipelines; every copy of the tied weight agrees
    for rank in (0, 1, 3):
        torch.testing.assert_close(world4[rank][layout]["ends"]["tok_emb" if rank < 2 else "head"],
                                   world4[2][layout]["ends"]["head"], rtol=0, atol=0)


def test_pp2_schedule_gets_dense_micro_batches(world2):
    """On torch 2.11 the engine's pp runs failed with "stride mismatch: expected (16, 1) actual (17, 1)"."""
    assert world2[0]["dense_inputs"] == [True] and world2[1]["dense_inputs"] == [True]


def test_pp2_v_schedule_warms_up_without_sending_to_itself(world2):
    """On torch 2.11 zbv and dualpipev failed at their first step: "Pair is not connected"."""
    assert [w["v_warmup"] for w in world2] == ["ok", "ok"]


def test_bubble_measured_on_pp2(world2):
    """Every step of every schedule splits into own compute and idle time. The measured idle
    against (p-1)/m, and the schedules' own compute against each other, are timing claims
    (bench/schedules.py prices each schedule's bubble; bench/timing_claims.py pp2_bubble)."""
    for layout in ("gpipe", "1f1b", "interleaved"):
        for rank_result in world2:
            assert len(rank_result[layout]["timings"]) == STEPS
            for timing in rank_result[layout]["timings"]:
                assert timing["bubble_s"] > 0
                assert timing["compute_s"] > 0
                assert timing["total_s"] == pytest.approx(timing["compute_s"] + timing["bubble_s"])


def test_bubble_fraction_formula():
    assert bubble_fraction("gpipe", 4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction("interleaved", 4, 8, 2) == pytest.approx(3 / 16)
    assert bubble_fraction("1f1b", 1, 8) == 0.0
    with pytest.raises(ValueError, match="must be one of"):
        bubble_fraction("zb", 2, 4)


def test_stage_layers_even_and_explicit():
    assert stage_layers(4, 2) == [[0, 1], [2, 3]]
    assert stage_layers(8, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert stage_layers(5, 2, 1, [3, 2]) == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="not divisible"):
        stage_layers(5, 2)
    with pytest.raises(ValueError, match="summing to"):
        stage_layers(4, 2, 1, [1, 2])


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_describe_schedule_grid(schedule, virtual):
    pp, m = 2, 4
    grid = describe_schedule(schedule, pp, m, virtual)
    rows = grid.strip().splitlines()[1:]
    cells = [row.split(":", 1)[1].split() for row in rows]
    actions = [a for row in cells for a in row]
    # every stage runs every micro-batch forward and backward exactly once
    expected = {f"{s}{kind}{i}" for s in range(pp * virtual) for kind in "FB" for i in range(m)}
    assert sorted(actions) == sorted(expected)
    assert rows[0].split(":", 1)[1].split() == ["0F0"]  # only stage 0 can start
    if schedule == "1f1b":
        # 1F1B: the last stage runs the backward of micro-batch 0 right after its forward
        steps = {a: i for i, row in enumerate(cells) for a in row}
        assert steps["1B0"] == steps["1F0"] + 1


@pytest.mark.parametrize("schedule,pp,m,virtual", [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 6, 1),
                                                   ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2)])
def test_schedule_grid_idle_matches_bubble_fraction(schedule, pp, m, virtual):
    """With unit-time F and B, rank 0's empty cells / busy cells is the analytic bubble fraction."""
    rows = describe_schedule(schedule, pp, m, virtual).strip().splitlines()[1:]
    rank0 = [row.split(":", 1)[1][1:].split(" ", 1)[0] for row in rows]
    busy = sum(1 for cell in rank0 if cell)
    assert busy == 2 * m * virtual
    assert (len(rank0) - busy) / busy == pytest.approx(bubble_fraction(schedule, pp, m, virtual))
