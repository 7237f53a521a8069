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

PLACEMENTS = ("naive", "holmes")  # rank order | pp across link groups, dp/tp inside


def rank_order(world: int, *, placement: str = "naive", groups: Sequence[Sequence[int]] | None = None,
               pp: int = 1, tp: int = 1) -> list[int]:
    """The global rank at each mesh position (position = pp * dp * tp index, tp fastest).

    `groups` are the ranks of each link group, in order; `naive` ignores them. Holmes takes the
    ranks group by group, then deals each stage's ranks out in rank order (`in_rank_order`).
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"parallel.placement={placement!r} must be one of {', '.join(PLACEMENTS)}")
    if placement == "naive" or not groups:
        return list(range(world))
    order = [r for group in groups for r in group]
    if sorted(order) != list(range(world)):
        raise ValueError(f"link.groups ranks {order} must list each rank 0..{world - 1} once")
    return in_rank_order(order, pp=pp, tp=tp)


def in_rank_order(order: Sequence[int], *, pp: int, tp: int) -> list[int]:
    """`order` with each stage's ranks dealt out in rank order: inside each stage's block of
    dp * tp positions every tp group is sorted and the tp groups are ordered by their first rank.

    Each stage keeps its set of ranks and each tp group its set, so no group leaves its link group.
    Why: torch numbers the ranks of a process group in sorted order (`new_group` sorts them) and a
    pipeline runs stage i on the rank numbered i in its pp group, so every pipeline's ranks must
    increase stage by stage; dealing each stage out in order makes them increase wherever the
    stages' rank sets allow (`pipeline_out_of_order` names a pipeline where they cannot).
    """
    block = len(order) // pp
    out: list[int] = []
    for s in range(pp):
        stage = order[s * block:(s + 1) * block]
        tp_groups = [sorted(stage[i:i + tp]) for i in range(0, block, tp)]
        out += [r for group in sorted(tp_groups) for r in group]
    return out


def pipeline_out_of_order(order: Sequence[int], *, pp: int, dp: int, tp: int) -> list[int] | None:
    """The first pipeline (its ranks in stage order) whose ranks do not increase, or None."""
    if pp < 2:
        return None
    for chain in mesh_groups(order, pp=pp, dp=dp, tp=tp)["pp"]:
        if any(a > b for a, b in zip(chain, chain[1:])):
            return chain
    return None


def mesh_groups(order: Sequence[int], *, pp: int, dp: int, tp: int) -> dict[str, list[list[int]]]:
    """The rank sets of every pp, dp and tp group of a mesh laid out by `order`, as the mesh
    groups them (`ParallelDims.axis_groups`: the engine's one rank formula).

    A pp group is one pipeline (its ranks in stage order), a dp group the replicas of one
    (stage, tp shard), a tp group the shards of one (stage, replica).
    """
    from engine.mesh import ParallelDims

    dims = ParallelDims(dp, tp, pp, len(order), order=tuple(order))
    return {axis: dims.axis_groups(axis) for axis in ("pp", "dp", "tp")}
