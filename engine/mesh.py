"""ParallelDims: the validated (pp, dp, tp) layout of a run, and the device mesh it builds."""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError

MESH_AXES = ("pp", "dp", "tp")


@dataclass(frozen=True, slots=True)
class ParallelDims:
    """Parallel degrees checked against the world size on construction (torchtitan ParallelDims)."""

    dp: int
    tp: int
    pp: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name}", getattr(self, name), "must be >= 1")
        if self.dp * self.tp * self.pp != self.world_size:
            raise ConfigError(
                "parallel", f"dp({self.dp}) * tp({self.tp}) * pp({self.pp}) = {self.dp * self.tp * self.pp}",
                f"must equal world_size({self.world_size})")

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh axis; tp is the fastest-varying (kept within a node)."""
        return {"pp": rank // (self.dp * self.tp), "dp": (rank // self.tp) % self.dp, "tp": rank % self.tp}

    def build_mesh(self, device_type: str):
        """A DeviceMesh of shape (pp, dp, tp) with named axes (needs an initialised process group)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=MESH_AXES)

    def describe(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "world_size": self.world_size}
