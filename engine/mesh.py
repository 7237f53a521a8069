"""ParallelDims: the validated (pp, dp, cp, tp) layout of a run, and the device mesh it builds."""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError

MESH_AXES = ("pp", "dp", "tp")
CP_MESH_AXES = ("pp", "dp", "cp", "tp")  # with context parallelism (torchtitan's order: cp inside dp, outside tp)


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
    order: tuple[int, ...] | None = None  # global rank at each mesh position (engine/placement.py); None: rank order

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name}", getattr(self, name), "must be >= 1")
        if self.dp * self.tp * self.pp * self.cp != self.world_size:
            product = self.dp * self.tp * self.pp * self.cp
            raise ConfigError(
                "parallel", f"dp({self.dp}) * tp({self.tp}) * pp({self.pp})" + (f" * cp({self.cp})" if self.cp > 1 else "") + f" = {product}",
                f"must equal world_size({self.world_size})")

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh axis; tp is the fastest-varying (kept within a node), then cp."""
        rank = self.order.index(rank) if self.order is not None else rank  # its mesh position
        inner = self.tp * self.cp
        coords = {"pp": rank // (self.dp * inner), "dp": (rank // inner) % self.dp,
                  "cp": (rank // self.tp) % self.cp, "tp": rank % self.tp}
        if self.cp == 1:  # like describe(): cp appears only when it is used
            del coords["cp"]
        return coords

    def build_mesh(self, device_type: str):
        """A DeviceMesh of shape (pp, dp, tp), or (pp, dp, cp, tp) with context parallelism, with
        named axes; with cp > 1 also the flattened "dp_cp" axis gradients are averaged over.
        A placement order (cp == 1 only, validate() says so) lays global ranks onto the mesh."""
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if self.order is not None and list(self.order) != list(range(self.world_size)):
            import torch

            layout = torch.tensor(self.order, dtype=torch.int).reshape(self.pp, self.dp, self.tp)
            return DeviceMesh(device_type, layout, mesh_dim_names=MESH_AXES)
        if self.cp == 1:
            return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=MESH_AXES)
        mesh = init_device_mesh(device_type, (self.pp, self.dp, self.cp, self.tp), mesh_dim_names=CP_MESH_AXES)
        mesh["dp", "cp"]._flatten("dp_cp")  # one group for the gradient average over dp x cp
        return mesh

    def describe(self) -> dict[str, int]:
        out = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "world_size": self.world_size}
        if self.cp > 1:
            out["cp"] = self.cp
        return out
