"""ParallelDims: the validated (pp, dp, cp, tp) layout of a run, and the device mesh it builds; the
world-size formula and the divisors a degree may take."""
from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import ConfigError

MESH_AXES = ("pp", "dp", "tp")
CP_MESH_AXES = ("pp", "dp", "cp", "tp")  # with context parallelism (torchtitan's order: cp inside dp, outside tp)


def divisors(n: int) -> list[int]:
    """The positive divisors of n in increasing order (O(sqrt n)); [] for n < 1."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0] if n >= 1 else []
    return sorted(set(small + [n // d for d in small]))


def divisor_hint(n: int) -> str:
    """The hint an error ends with, `; try 1, 2, 4, 8` (the divisors of n; the first 7 and the last of many),
    or "" when n has none to offer."""
    ds = [str(d) for d in divisors(n)] if 0 < n <= 100000 else []
    if len(ds) > 8:
        ds = ds[:7] + ["…", ds[-1]]
    return f"; try {', '.join(ds)}" if ds else ""


def world_size(*, dp: int, tp: int, pp: int, cp: int = 1) -> int:
    """The ranks a layout runs on: dp * tp * pp * cp (the one world-size formula; numpy arrays work too)."""
    return dp * tp * pp * cp


def world_product(cp: int = 1) -> str:
    """The world size as messages name it: ``dp*tp*pp``, times ``cp`` only when cp > 1 (as
    `ParallelDims` prints its factors and `describe()` lists cp)."""
    return "dp*tp*pp*cp" if cp > 1 else "dp*tp*pp"


@dataclass(frozen=True, slots=True)
class ParallelDims:
    """Parallel degrees checked against the world size on construction (torchtitan ParallelDims)."""

    dp: int
    tp: int
    pp: int
    world_size: int
    cp: int = 1  # context-parallel degree (engine/parallel/context.py)
    order: tuple[int, ...] | None = None  # global rank at each mesh position (engine/config/placement.py); None: rank order

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name}", getattr(self, name), "must be >= 1")
        product = world_size(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp)
        if product != self.world_size:
            raise ConfigError(
                "parallel", f"dp({self.dp}) * tp({self.tp}) * pp({self.pp})" + (f" * cp({self.cp})" if self.cp > 1 else "") + f" = {product}",
                f"must equal world_size({self.world_size})")

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes, outermost first: (pp, dp, tp), or (pp, dp, cp, tp) with context parallelism."""
        return CP_MESH_AXES if self.cp > 1 else MESH_AXES

    def rank_grid(self):
        """The global rank at every mesh coordinate: an int tensor shaped like `axes` (row-major, tp
        fastest-varying, kept within a node; then cp), the placement order laid onto it. THE rank
        formula of the engine: the DeviceMesh, `coords` and every group built outside the mesh
        (expert groups, placement's link groups) read it from here."""
        import torch

        flat = list(self.order) if self.order is not None else list(range(self.world_size))
        return torch.tensor(flat, dtype=torch.int).reshape([getattr(self, axis) for axis in self.axes])

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh axis (cp only when cp > 1, like `describe()`)."""
        where = (self.rank_grid() == rank).nonzero()
        if len(where) != 1:
            raise ValueError(f"rank {rank} is not on the mesh of {self.describe()}")
        return dict(zip(self.axes, where[0].tolist()))

    def axis_groups(self, axis: str) -> list[list[int]]:
        """The global ranks of every group along `axis` (one per coordinate of the other axes, in
        row-major order), as the DeviceMesh of `build_mesh` groups them."""
        return groups_along(self.rank_grid(), self.axes, axis)

    def build_mesh(self, device_type: str):
        """A DeviceMesh of shape (pp, dp, tp), or (pp, dp, cp, tp) with context parallelism, with
        named axes, laid out by `rank_grid` (a placement order puts global ranks on it; cp == 1
        only, validate() says so); with cp > 1 also the flattened "dp_cp" axis gradients are
        averaged over."""
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh(device_type, self.rank_grid(), mesh_dim_names=self.axes)
        if self.cp > 1:
            mesh["dp", "cp"]._flatten("dp_cp")  # one group for the gradient average over dp x cp
        return mesh

    def describe(self) -> dict[str, int]:
        out = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "world_size": self.world_size}
        if self.cp > 1:
            out["cp"] = self.cp
        return out


def groups_along(grid, axes: tuple[str, ...], axis: str) -> list[list[int]]:
    """The rank lists along `axis` of a rank grid (a tensor shaped like `axes`, e.g. a DeviceMesh's
    `.mesh`): one list per coordinate of the other axes, row-major."""
    i = axes.index(axis)
    return grid.movedim(i, -1).reshape(-1, grid.shape[i]).tolist()


def mesh_axis_groups(mesh, axis: str) -> list[list[int]]:
    """The global ranks of every group along `axis` of a DeviceMesh: what its sub-meshes hold."""
    return groups_along(mesh.mesh, tuple(mesh.mesh_dim_names), axis)
