"""Placement: which global rank sits at each position of the (pp, dp, tp) mesh.

- `naive`: rank order (pp outermost, tp innermost), blind to the network.
- `holmes`: Holmes' cross-cluster pipeline parallelism (Li et al. 2023): the ranks are taken group
  by group (in `link.groups` order), so each pipeline stage's dp x tp ranks sit inside one group of
  equal NICs and only the pipeline's point-to-point traffic crosses the slow inter-group link.
  With groups of dp * tp ranks (or a multiple) every dp and tp group stays inside one; tp groups
  stay inside one whenever a group's size is a multiple of tp (validate() requires it); dp
  crosses groups only when a stage needs more ranks than a group has.

Pure functions: the order is data (`rank_order`); `engine.mesh.ParallelDims` lays it onto the mesh
(the one rank formula) and answers which ranks form each group.
"""
from __future__ import annotations

from collections.abc import Sequence

from engine.validate import PLACEMENTS


def rank_order(world: int, *, placement: str = "naive",
               groups: Sequence[Sequence[int]] | None = None) -> list[int]:
    """The global rank at each mesh position (position = pp * dp * tp index, tp fastest).

    `groups` are the ranks of each link group, in order; `naive` ignores them.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"parallel.placement={placement!r} must be one of {', '.join(PLACEMENTS)}")
    if placement == "naive" or not groups:
        return list(range(world))
    order = [r for group in groups for r in group]
    if sorted(order) != list(range(world)):
        raise ValueError(f"link.groups ranks {order} must list each rank 0..{world - 1} once")
    return order


def mesh_groups(order: Sequence[int], *, pp: int, dp: int, tp: int) -> dict[str, list[list[int]]]:
    """The rank sets of every pp, dp and tp group of a mesh laid out by `order`, as the mesh
    groups them (`ParallelDims.axis_groups`: the engine's one rank formula).

    A pp group is one pipeline (its ranks in stage order), a dp group the replicas of one
    (stage, tp shard), a tp group the shards of one (stage, replica).
    """
    from engine.mesh import ParallelDims

    dims = ParallelDims(dp, tp, pp, len(order), order=tuple(order))
    return {axis: dims.axis_groups(axis) for axis in ("pp", "dp", "tp")}
