"""Each fact defined once (issue 14): the copies that drifted are now imports of one definition."""
from __future__ import annotations

import pytest


def test_names_and_helpers_are_one_object():
    from engine.config import validate
    from engine.comm import compress, link
    from engine.parallel import pipeline
    from profilers import bandwidth
    from tuning import space
    from tuning.sim import simulator

    assert compress.COMPRESSORS is validate.COMPRESSORS and tuple(compress.HOOKS) == validate.COMPRESSORS
    assert pipeline.SCHEDULES is validate.SCHEDULES
    assert link.bus_factor is bandwidth.bus_factor  # profilers owns it: engine imports profilers
    assert space._divisors is validate.divisors and simulator._divisors is validate.divisors


@pytest.mark.parametrize("n", [1, 2, 12, 36, 97, 1024])
def test_divisors(n):
    assert validate_divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


def validate_divisors(n):
    from engine.config.validate import divisors

    return divisors(n)


def test_memory_estimate_uses_the_pipeline_split():
    """Interleaved: pp rank r holds chunks r, r + pp, ... of `layer_split` (the old copy read
    one entry per rank and missed the rank's second chunk)."""
    from engine.config.schema import load_config
    from engine.train.memory import _stage_layers

    cfg = load_config(None, ["model.layers=6", "parallel.pp=2", "parallel.schedule=interleaved",
                             "parallel.virtual=2", "parallel.layer_split=[1,2,1,2]", "batch.global=8",
                             "batch.micro=2"])
    assert _stage_layers(cfg) == [2, 4]


def test_one_rank_formula_the_meshs():
    """Which rank sits at which mesh coordinate is ParallelDims.rank_grid alone (STYLE habit 17):
    coords, the groups of every axis, placement's groups and the expert groups all read it."""
    from engine.mesh import ParallelDims
    from engine.parallel.expert import expert_group_ranks
    from engine.config.placement import mesh_groups

    order = (0, 4, 1, 5, 2, 6, 3, 7)  # a placement that moves every rank but 0 and 7
    dims = ParallelDims(2, 2, 2, 8, order=order)
    grid = dims.rank_grid()
    for rank in range(8):
        c = dims.coords(rank)
        assert int(grid[c["pp"], c["dp"], c["tp"]]) == rank
    assert mesh_groups(order, pp=2, dp=2, tp=2) == {axis: dims.axis_groups(axis) for axis in ("pp", "dp", "tp")}
    assert dims.axis_groups("tp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert expert_group_ranks(dims.axis_groups("dp"), ep=2)[0] == [[0, 1], [4, 5], [2, 3], [6, 7]]
