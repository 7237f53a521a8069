"""`workbench dryrun`: one step of the real program at the real world size on this CPU (engine/train/dryrun.py),
per rank role: memory by category and collective bytes per mesh axis, beside the simulator's figures."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from workbench.cli_common import check_number, console, err, fail, print_json

DEVICE_MEMORY_HELP = ("Device memory per rank in GiB: refuse (exit 2) when the busiest rank's peak, beside the CUDA "
                      "context and NCCL buffers --cluster prices for its layout, is above it")


def dryrun(config: Path = typer.Argument(..., help="YAML run config"),
           world: Optional[int] = typer.Option(None, help="World size; dp takes what tp*pp*cp leave (default: the config's)"),
           set_: list[str] = typer.Option([], "--set", help="Override a key, e.g. --set parallel.tp=8"),
           rank: list[int] = typer.Option([], "--rank", help="Dry-run this global rank (repeatable; default: one per pp stage)"),
           cluster: str = typer.Option("dgx-h100", help="Simulator cluster preset or profile for its figures and the "
                                                          "runtime judged beside --device-memory"),
           device_memory: Optional[float] = typer.Option(None, "--device-memory", help=DEVICE_MEMORY_HELP),
           as_json: bool = typer.Option(False, "--json", help="Print one JSON object")) -> None:
    """Dry-run one training step at the real world size: the real model and parallelize() on torch's fake
    backend under FakeTensorMode; memory per category and collective bytes per axis beside the simulator's."""
    from engine.config.schema import apply_overrides, from_dict, load_yaml
    from engine.train.dryrun import GIB, at_world, dry_run, fits_error
    from engine.errors import ConfigError
    from tuning.sim.hardware import load_cluster
    from tuning.sim.dryrun import runtime_bytes, side_by_side, tensor_budget

    check_number("--world", world, 1)
    check_number("--device-memory", device_memory, 0, exclusive=True)
    try:
        spec = load_cluster(cluster)
    except ValueError as exc:
        fail(f"--cluster={cluster!r}: {exc}")
    try:
        cfg = from_dict(apply_overrides(load_yaml(config), set_))
        cfg = at_world(_cluster_at_world(cfg, world, set_), world)  # validated at its world
        bad = [r for r in rank if not 0 <= r < cfg.world_size]
        if bad:
            fail(f"--rank={bad[0]}: must be in 0..{cfg.world_size - 1} (world size {cfg.world_size})")
        result = dry_run(cfg, ranks=rank or None)
        report = side_by_side(result, cfg.to_dict(), spec)
        runtime = runtime_bytes(dataclasses.asdict(cfg.parallel), spec)
        if device_memory is not None:  # the tensors' peak beside what the rank holds outside them, as plan judges
            limit, name = tensor_budget(device_memory * GIB, "device memory (--device-memory)", runtime)
            error = fits_error(result, limit_bytes=limit, limit_name=name, cfg=cfg)
        else:
            error = None
    except ConfigError as exc:
        fail(str(exc))
    if as_json:
        print_json({**report, "runtime_bytes": runtime, "fits": error is None, "refusal": str(error) if error else None})
    else:
        _print_report(cfg, report)
    if error is not None:
        fail(str(error))


def _cluster_at_world(cfg, world: Optional[int], overrides: list[str]):
    """`cfg` with its Slurm job (cluster.nodes x cluster.gpus_per_node) rescaled to --world ranks, said in one
    line; left as given without --world, for CPU ranks (gpus_per_node 0) or where --set names cluster.nodes."""
    from dataclasses import replace

    c = cfg.cluster
    named = any(o.split("=", 1)[0].strip() == "cluster.nodes" for o in overrides)
    if world is None or named or c.gpus_per_node < 1 or c.nodes * c.gpus_per_node == world:
        return cfg
    if world > c.gpus_per_node and world % c.gpus_per_node:
        fail(f"--world={world}: must fit in one node or fill whole nodes of the config's Slurm job (a multiple of "
             f"cluster.gpus_per_node={c.gpus_per_node}); or --set cluster.gpus_per_node=N")
    nodes, per_node = max(world // c.gpus_per_node, 1), min(world, c.gpus_per_node)
    err.print(f"--world {world}: the Slurm job (cluster:) rescaled from {c.nodes} x {c.gpus_per_node} to {nodes} "
              f"x {per_node} GPUs", highlight=False, markup=False, soft_wrap=True)
    return replace(cfg, cluster=replace(c, nodes=nodes, gpus_per_node=per_node))


def _print_report(cfg, report: dict[str, Any]) -> None:
    from workbench.fmt import gib, num

    layout = ", ".join(f"{k} {v}" for k, v in report["layout"].items() if k != "world_size")
    console.print(f"dry run of {cfg.name} at world {report['world']} ({layout}): one training step on torch's "
                  f"fake backend under FakeTensorMode; simulator: {report['simulator']['cluster']}", highlight=False)
    for role in report["roles"]:
        where = ", ".join(f"{k} {v}" for k, v in role["coords"].items())
        mem = Table(title=f"rank {role['rank']} ({where}): peak {gib(role['peak'])} GiB "
                          f"({role['tracker']}, {role['seconds']:.0f} s)")
        for col in ("memory at the peak", "dry run (GiB)", "simulator (GiB)"):
            mem.add_column(col, justify="left" if col.startswith("memory") else "right")
        for row in role["memory"]:
            mem.add_row(row["category"], gib(row["dry_run"]), gib(row["simulator"]))
            for part, value in row["parts"].items():
                mem.add_row(f"  {part}", gib(value), "")
        mem.add_row("total", gib(role["peak"]), gib(role["simulator_total"]))
        console.print(mem)
        comm = Table(title="collectives of the step (GB = 1e9 bytes, nccl-tests sizes; recv: a peer's send)")
        for col in ("axis", "op", "calls", "dry run (GB)", "simulator (GB)"):
            comm.add_column(col, justify="left" if col in ("axis", "op") else "right")
        for row in role["comm"]:
            for op, agg in row["ops"].items():
                comm.add_row(row["axis"], op, num(agg["count"]), num(agg["bytes"] / 1e9), "")
            comm.add_row(row["axis"], "sent or reduced", "", num(row["dry_run"] / 1e9),
                         num(row["simulator"] / 1e9) if row["simulator"] is not None else "n/a")
        console.print(comm)
