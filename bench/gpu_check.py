"""GPU acceptance: every feature path of the engine on one CUDA GPU, printed as a table.

    python bench/gpu_check.py [--steps 3] [--cpu-dry-run]

1. One rank on NCCL (CUDA tensors): the engine's train loop (fp32, bf16 autocast, a live knob
   change, a torch.profiler trace window) and, on a 1-rank DDP/FSDP2 model, each comm hook
   (none, fp16, bf16, int8, topk, randk, powersgd), L-GreCo, CO2 and ZeRO 1/2/3. At world 1
   the engine itself installs no DDP, so these paths are wired here from the engine's parts.
2. Two ranks on the one GPU through gloo with CUDA tensors (NCCL refuses two ranks on one
   device): dp2, tp2, pp2, ZeRO-1 and ZeRO-3 at dp2, cp2 (ulysses, ring), through the engine, each compared with one
   process on the same GPU (max |loss difference| over the steps, fp32, bar 1e-4), and dp2 in
   bf16. A path gloo cannot carry for CUDA tensors shows FAIL with gloo's own message.

Without CUDA it exits 2 with a message. `--cpu-dry-run` runs the same table on CPU + gloo to
check this script itself; it measures nothing about GPUs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from profilers.rendezvous import hosted_store  # noqa: E402

TINY = ["model.layers=4", "model.d_model=64", "model.heads=4", "model.seq_len=32", "model.vocab=256",
        "train.lr=0.003", "train.warmup_steps=0", "batch.global=8", "batch.micro=2", "train.grad_clip=1.0",
        "profile.host_interval_s=0", "profile.nvml_interval_s=0"]
LAYOUTS = {"dp2": ["parallel.dp=2"], "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"],
           "zero1-dp2": ["parallel.dp=2", "parallel.zero=1"], "zero3-dp2": ["parallel.dp=2", "parallel.zero=3"],
           "cp2 ulysses": ["parallel.cp=2", "parallel.cp_impl=ulysses"], "cp2 ring": ["parallel.cp=2", "parallel.cp_impl=ring"]}
DP2_BF16 = "dp2 bf16 autocast"  # the two-rank row without a parity bar: it runs in bf16, the reference in fp32
PARITY_BAR = 1e-4
Row = tuple[str, str, str, str]  # (path, where, status, detail)


def no_cuda_message(script: str) -> str:
    """The one line a GPU script prints on a machine without CUDA."""
    return (f"{script} needs a CUDA GPU: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); nothing was measured")


def versions(device: torch.device) -> str:
    """Device, torch, CUDA and NCCL versions for the table's header."""
    if device.type != "cuda":
        return f"device cpu (dry run), torch {torch.__version__}"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "n/a"
    return (f"device {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"NCCL {nccl}")


# ------------------------------------------------------------------ one checked path
def check(rows: list[Row], path: str, where: str, fn: Callable[[], str]) -> None:
    """Run one path; its row says ok with a detail, or FAIL with the error's last line."""
    try:
        rows.append((path, where, "ok", fn()))
    except Exception as exc:  # noqa: BLE001 - one failing path must not hide the others
        traceback.print_exc(file=sys.stderr)
        rows.append((path, where, "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"))


def engine_losses(overrides: list[str], device: torch.device, steps: int, **kw) -> list[float]:
    """Losses of `steps` engine steps of the tiny GPT (inside or outside a process group)."""
    from engine.config.schema import load_config
    from engine.train.trainer import Trainer

    cfg = load_config(None, TINY + [f"train.steps={steps}"] + overrides)
    trainer = Trainer(cfg, device=device, run_dir=kw.pop("run_dir", None))
    losses = [m.loss for m in trainer.run(**kw)]
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"non-finite loss {losses}")
    return losses


def _tiny_model(device: torch.device):
    from engine.config.schema import load_config
    from engine.model.gpt import build_model

    cfg = load_config(None, TINY)
    return build_model(cfg.model, seed=0).to(device), cfg


def _train(model, optimizer, device: torch.device, steps: int, after_step: Callable[[int], None] = lambda s: None
           ) -> str:
    from engine.model.gpt import loss_fn

    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        batch = torch.randint(0, 256, (4, 33), generator=g).to(device)
        loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        after_step(step)
        losses.append(loss.item())
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"non-finite loss {losses}")
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"


# ------------------------------------------------------------------ section 1: one rank
def _hooked(device: torch.device, steps: int, compressor: str) -> str:
    from torch.nn.parallel import DistributedDataParallel

    from engine.comm.compress import make_comm_hook

    model, _ = _tiny_model(device)
    ddp = DistributedDataParallel(model)
    state, hook = make_comm_hook(compressor, density=0.1, rank=2, powersgd_start_iter=2)
    ddp.register_comm_hook(state, hook)
    return _train(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3), device, steps)


def _lgreco(device: torch.device, steps: int) -> str:
    from torch.nn.parallel import DistributedDataParallel

    from engine.comm.adaptive import apply_adaptive

    model, _ = _tiny_model(device)
    ddp = DistributedDataParallel(model)
    state = apply_adaptive(ddp, interval=1, default_level=0.01)
    out = _train(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3), device, steps)
    return f"{out}, {state.solves} solves"


def _co2(device: torch.device, steps: int) -> str:
    from engine.comm.co2 import CO2

    model, _ = _tiny_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    co2 = CO2(model, opt, tau=2)
    out = _train(model, opt, device, steps, after_step=co2.after_inner_step)
    co2.flush()
    return f"{out}, {co2.rounds} outer rounds"


def _zero(device: torch.device, steps: int, stage: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from engine.parallel.zero import apply_zero, build_optimizer

    model, _ = _tiny_model(device)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp",))
    wrapped = apply_zero(model, mesh["dp"], stage=stage)
    opt = build_optimizer(wrapped, stage=stage, lr=1e-3, process_group=mesh["dp"].get_group())
    return _train(wrapped, opt, device, steps)


def _live_knob(device: torch.device, steps: int, folder: Path) -> str:
    from engine.train.live import KnobChannel

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "knobs-0.json").write_text(json.dumps({"knobs": {}}))
    # a knob that acts on one rank (comm.* knobs need dp > 1: engine.train.live refuses them here)
    (folder / "knobs-1.json").write_text(json.dumps({"knobs": {"batch.micro": 1}}))
    losses = engine_losses(["live.every=2"], device, max(steps, 3), run_dir=folder,
                           on_boundary=KnobChannel(folder, 2, 30.0))
    return f"{len(losses)} steps, knobs changed at step 2"


def _trace(device: torch.device, steps: int, folder: Path) -> str:
    engine_losses(["profile.trace_steps=[1,2]"], device, max(steps, 3), run_dir=folder)
    traces = list((folder / "traces").glob("*.json"))
    if not traces:
        raise RuntimeError("no trace exported")
    kernels = sum(1 for e in json.loads(traces[0].read_text()).get("traceEvents", []) if e.get("cat") == "kernel")
    return f"{traces[0].name}, {kernels} GPU kernel events"


def one_rank(rank: int, world: int, device: torch.device, steps: int, tmp: str) -> list[Row]:
    """Section 1, inside a 1-rank process group on the device's backend."""
    from engine.comm.compress import COMPRESSORS

    where = "1 rank nccl" if device.type == "cuda" else "1 rank gloo (cpu)"
    rows: list[Row] = []
    check(rows, "engine fp32", where, lambda: f"losses {engine_losses([], device, steps)[-1]:.4f}")
    check(rows, "engine bf16 autocast", where, lambda: f"losses {engine_losses(['precision=bf16'], device, steps)[-1]:.4f}")
    check(rows, "engine live knob change", where, lambda: _live_knob(device, steps, Path(tmp) / "live"))
    check(rows, "engine trace window", where, lambda: _trace(device, steps, Path(tmp) / "trace"))
    for name in COMPRESSORS:
        check(rows, f"DDP hook {name}", where, lambda name=name: _hooked(device, steps + 2, name))
    check(rows, "L-GreCo (adaptive topk)", where, lambda: _lgreco(device, steps))
    check(rows, "CO2", where, lambda: _co2(device, max(steps, 4)))
    for stage in (1, 2, 3):
        check(rows, f"ZeRO-{stage}", where, lambda stage=stage: _zero(device, steps, stage))
    return rows


# ------------------------------------------------------------------ section 2: two ranks, one GPU
def two_ranks_where(device_type: str) -> str:
    return "2 ranks gloo, cuda tensors" if device_type == "cuda" else "2 ranks gloo (cpu)"


def two_ranks(rank: int, world: int, device: torch.device, steps: int, refs: dict[str, list[float]],
              names: list[str]) -> list[Row]:
    """Section 2: two ranks on one device through gloo, parity with one process for each of the
    `names` (LAYOUTS keys, or DP2_BF16)."""
    where = two_ranks_where(device.type)
    rows: list[Row] = []

    def parity(name: str) -> str:
        got = engine_losses(LAYOUTS[name], device, steps)
        diff = max(abs(a - b) for a, b in zip(got, refs["fp32"]))
        if diff > PARITY_BAR:
            raise AssertionError(f"max |loss - 1 rank| = {diff:.2e} > {PARITY_BAR:g}")
        return f"max |loss - 1 rank| = {diff:.1e}"

    for name in names:
        if name == DP2_BF16:
            check(rows, name, where,
                  lambda: f"loss {engine_losses(['parallel.dp=2', 'precision=bf16'], device, steps)[-1]:.4f}")
        else:
            check(rows, name, where, lambda name=name: parity(name))
    return rows


# ------------------------------------------------------------------ processes and the table
def _rank_main(rank: int, world: int, store_env: dict[str, str], backend: str, device_type: str, section: str,
               args: tuple, out: str) -> None:
    os.environ.update(store_env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from engine.device import init_distributed

    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # both ranks on the one GPU
    init_distributed(backend, rank=rank, world_size=world, timeout_s=300, device=device)
    fn = one_rank if section == "one" else two_ranks
    rows = fn(rank, world, device, *args)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # ranks sometimes abort at interpreter exit (shared/reference/platform.md)


def run_section(world: int, backend: str, device_type: str, section: str, *args) -> list[Row]:
    """Rank 0's rows of `section` on `world` spawned ranks."""
    with tempfile.TemporaryDirectory() as tmp, hosted_store(world, timeout_s=600) as store_env:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(_rank_main, args=(world, store_env, backend, device_type, section, args, out),
                           nprocs=world, start_method="spawn")
        return [tuple(r) for r in json.loads(Path(out).read_text())]


def format_table(rows: list[Row], header: str) -> str:
    """The rows as a fixed-width table under a header line."""
    widths = [max(len(r[i]) for r in rows + [("path", "where", "status", "detail")]) for i in range(4)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([header, line(("path", "where", "status", "detail")), line(tuple("-" * w for w in widths))]
                     + [line(r) for r in rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu_check.py", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cpu-dry-run", action="store_true", help="check this script on CPU + gloo")
    args = ap.parse_args(argv)
    if args.steps < 1:
        print(f"--steps={args.steps}: must be >= 1", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print(no_cuda_message("bench/gpu_check.py"), file=sys.stderr)
        return 2
    device_type = "cpu" if args.cpu_dry_run else "cuda"
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    refs = {"fp32": engine_losses([], device, args.steps)}  # one process, no process group
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_section(1, "nccl" if device_type == "cuda" else "gloo", device_type, "one", args.steps, tmp)
    for name in [*LAYOUTS, DP2_BF16]:  # a pair of processes each: a crash fails one row
        try:
            rows += run_section(2, "gloo", device_type, "two", args.steps, refs, [name])
        except Exception as exc:  # a rank died (a signal, not a Python error): gloo's own crash
            rows.append((name, two_ranks_where(device_type), "FAIL", f"{type(exc).__name__}: {exc}"[:200]))
    print(format_table(rows, versions(device)))
    failed = [r for r in rows if r[2] != "ok"]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} paths ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
