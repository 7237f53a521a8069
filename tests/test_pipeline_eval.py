"""Evaluation under every V schedule (issue 52 item 1): zbv and dualpipev evaluate at pp2 and pp4.

torch's `eval()` runs a schedule's training order with its backwards as no-ops; under zbv and
dualpipev a backward hands its input gradient to the stage beside it on the same rank, which then
failed at the first evaluation ("can't steal_bwd_input if this stage doesn't have backward").
The engine's Trainer on pp ranks must give the one-process Trainer's training and validation
losses (engine/parallel/pipeline.py `forward_only`).
"""
from __future__ import annotations

import pytest

from tools.matrix import compat
from parallel_harness import run_ranks

SCHEDULES = ("zbv", "dualpipev")
TOL = 1e-4  # the matrix's parity tolerance (tools/matrix/compat.py PARITY_TOL)


def _flat(**knobs) -> dict:
    # 8 layers: pp4 x 2 chunks per rank; evaluation after steps 2 and 4
    return {**compat.BASE, "model.layers": 8, "train.eval_interval": 2, **knobs}


def _losses(flat: dict) -> list[tuple[float, float | None]]:
    import torch

    from engine.config.schema import from_dict
    from engine.train.trainer import Trainer
    from engine.config.validate import validate

    torch.set_num_threads(1)
    trainer = Trainer(validate(from_dict(compat.nested(flat))), device=torch.device("cpu"))
    return [(m.loss, m.val_loss) for m in trainer.run()]


def _ranks(rank: int, world: int) -> dict[str, list[tuple[float, float | None]]]:
    return {s: _losses(_flat(**{"parallel.pp": world, "parallel.schedule": s})) for s in SCHEDULES}


@pytest.mark.slow
@pytest.mark.parametrize("pp", [2, 4])
def test_v_schedules_evaluate_like_one_process(pp: int) -> None:
    reference = _losses(_flat())
    assert sum(v is not None for _, v in reference) == 2
    got = run_ranks(pp, _ranks, timeout=180)[0]
    for schedule in SCHEDULES:
        for (loss, val), (ref_loss, ref_val) in zip(got[schedule], reference, strict=True):
            assert abs(loss - ref_loss) <= TOL, (schedule, pp, got[schedule], reference)
            assert (val is None) == (ref_val is None), (schedule, pp, got[schedule], reference)
            assert val is None or abs(val - ref_val) <= TOL, (schedule, pp, got[schedule], reference)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_v_schedules_layer_refusal_names_its_two_chunks_per_rank(schedule: str) -> None:
    line = compat.refusal({**compat.BASE, "parallel.pp": 2, "parallel.schedule": schedule, "model.layers": 2})
    assert line.startswith("model.layers=2: must be divisible by pp*virtual = 2*2 = 4"), line
