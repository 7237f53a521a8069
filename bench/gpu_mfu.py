"""MFU of a ~1B-parameter GPT on one GPU (seq 2048, bf16 autocast, flash SDPA), and the engine's cost.

    python bench/gpu_mfu.py [--compile] [--rounds 5] [--steps 4] [--quick] [--cpu-dry-run]
                            [--hf CONFIG_JSON [--seq 2048] [--micro M] [--global-batch G]] [--set KEY=VALUE ...]

One process, one GPU, one model and optimizer, three ways to step it, interleaved in rounds:
the engine's `Trainer.train_step` with profilers on, the same with profilers off, and a minimal
hand-written loop (autocast, accumulation, clip, AdamW step) on the same module and optimizer.
Every step is timed independently: synchronise, perf_counter, step, synchronise. Prints the
median step times, MFU against the device's dense bf16 peak (engine.device; n/a when unknown),
the ratios engine/minimal and profilers on/off, the StepTimer breakdown against that wall time,
and NVML's readings while the engine stepped. `--compile` compiles the module (torch.compile)
for all three. `--quick` is a small GPT for the test suite.
`--hf` steps a Hugging Face causal LM built from its config.json (`model.hf`, random weights) instead of
the GPT, at `--seq`, `--micro` and `--global-batch` (a plan's pick: `workbench plan --gpus 1`). Without CUDA it exits 2 unless
`--cpu-dry-run`, which checks this script on a small CPU model and measures nothing about GPUs.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from gpu_check import no_cuda_message, versions  # noqa: E402

COMMON = ["data.source=synthetic", "train.lr=0.0003", "train.warmup_steps=0", "train.schedule=constant",
          "train.grad_clip=1.0", "precision=bf16", "profile.host_interval_s=0", "profile.nvml_interval_s=0"]
BATCH = ["batch.global=8", "batch.micro=4"]
# ~1.1 B parameters: 12 * 20 * 2048^2 in the blocks + 2 * 50304 * 2048 embeddings/head
GPT_1B = ["model.layers=20", "model.d_model=2048", "model.heads=16", "model.seq_len=2048", "model.vocab=50304",
          *BATCH]
QUICK = ["model.layers=4", "model.d_model=512", "model.heads=8", "model.seq_len=512", "model.vocab=8192", *BATCH]
CPU_PRECISION = "precision=fp32"  # what --cpu-dry-run trains in, with a preset or --hf
DRY = ["model.layers=2", "model.d_model=64", "model.heads=4", "model.seq_len=64", "model.vocab=256",
       "batch.global=4", "batch.micro=2", CPU_PRECISION]


def model_args(args: argparse.Namespace) -> list[str]:
    """The model and batch keys of the run: the DRY / QUICK / GPT_1B presets or `--hf`, then the batch flags."""
    if args.hf:
        size = [f"model.hf={args.hf}", f"model.seq_len={args.seq}", *BATCH]
        size += [CPU_PRECISION] if args.cpu_dry_run else []
    else:
        size = DRY if args.cpu_dry_run else QUICK if args.quick else GPT_1B
    batch = [f"batch.global={args.global_batch}"] if args.global_batch else []
    return size + batch + ([f"batch.micro={args.micro}"] if args.micro else [])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall(device: torch.device, fn: Callable[[], object]) -> float:
    """Seconds of one step measured independently of the StepTimer: synchronise on both sides."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def minimal_step(trainer, step: int) -> None:
    """The hand-written loop on the trainer's own module and optimizer (nanoGPT's train.py)."""
    from engine.model.gpt import loss_fn

    c, par = trainer.cfg, trainer.par
    x, y = trainer._local_batch(step)
    accum = c.grad_accum
    for i in range(accum):
        xs, ys = x[i * c.batch.micro:(i + 1) * c.batch.micro], y[i * c.batch.micro:(i + 1) * c.batch.micro]
        with torch.autocast(trainer.device.type, dtype=torch.bfloat16, enabled=c.precision == "bf16"):
            loss = loss_fn(par.forward(xs), ys) / accum
        loss.backward()
    torch.nn.utils.clip_grad_norm_(par.modules[0].parameters(), c.train.grad_clip)
    par.optimizer.step()
    par.optimizer.zero_grad(set_to_none=True)


def _attention_backend(device: torch.device) -> contextlib.AbstractContextManager:
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])  # flash or an error: never a silent fallback


def measure(trainer, device: torch.device, rounds: int, steps: int) -> dict[str, list]:
    """Interleaved rounds of (engine profilers on, engine profilers off, minimal) steps."""
    from engine.config.schema import replace

    out: dict[str, list] = {"on": [], "off": [], "minimal": [], "breakdown": []}
    step = 0
    on_cfg, off_cfg = trainer.cfg, replace(trainer.cfg, {"profile.enabled": False})
    for r in range(rounds + 1):  # round 0 warms up (allocator, autotuning, compilation)
        for mode in ("on", "off", "minimal"):
            trainer.cfg = on_cfg if mode == "on" else off_cfg
            trainer.timer.enabled = mode == "on"
            for _ in range(steps):
                if mode == "minimal":
                    seconds = wall(device, lambda: minimal_step(trainer, step))
                else:
                    metrics = []
                    seconds = wall(device, lambda: metrics.append(trainer.train_step(step)))
                    if mode == "on" and r:
                        out["breakdown"].append((seconds, metrics[0].step_time_s, metrics[0].breakdown))
                if r:
                    out[mode].append(seconds)
                step += 1
    trainer.cfg = on_cfg
    return out


def nvml_readings(device: torch.device) -> Callable[[], dict[str, float]]:
    """Start NVML sampling of this GPU; the returned function stops it and gives the medians."""
    from profilers.nvml import NvmlSampler

    samples: dict[str, list[float]] = {}
    index = device.index or 0

    def emit(kind: str, name: str, value: float) -> None:
        if name.startswith(f"gpu{index}/"):
            samples.setdefault(name.split("/", 1)[1], []).append(value)

    sampler = NvmlSampler(interval=0.5, emit=emit)
    sampler.start()

    def stop() -> dict[str, float]:
        sampler.stop()
        return {k: statistics.median(v) for k, v in samples.items()}

    return stop


def report(trainer, device: torch.device, times: dict[str, list], nvml: dict[str, float], compiled: bool) -> str:
    """The printed result."""
    from engine.device import peak_flops

    med = {k: statistics.median(times[k]) for k in ("on", "off", "minimal")}
    peak = peak_flops(device)
    params = sum(p.numel() for p in trainer.par.modules[0].parameters())
    c = trainer.cfg.model
    kind = f"{trainer.par.modules[0].hf_config.model_type} (Hugging Face)" if c.hf else "GPT"
    lines = [versions(device),
             f"{kind} {params / 1e6:,.1f} M parameters, {c.layers} layers, d_model {c.d_model}, seq {c.seq_len}, "
             f"{trainer.cfg.precision}, {'flash SDPA' if device.type == 'cuda' else 'SDPA (cpu)'}, "
             f"torch.compile {'on' if compiled else 'off'}, "
             f"micro-batch {trainer.cfg.batch.micro}, {trainer.tokens_per_step} tokens/step",
             f"{'mode':<24}{'median step (ms)':>18}{'tokens/s':>12}{'MFU':>8}"]
    for key, label in (("on", "engine, profilers on"), ("off", "engine, profilers off"), ("minimal", "minimal loop")):
        mfu = f"{trainer.flops_per_step / med[key] / peak:.1%}" if peak else "n/a"
        lines.append(f"{label:<24}{med[key] * 1e3:>18.1f}{trainer.tokens_per_step / med[key]:>12.0f}{mfu:>8}")
    lines.append(f"engine / minimal loop (profilers off): {med['off'] / med['minimal']:.3f}  (goal <= 1.03)")
    lines.append(f"profilers on / off: {med['on'] / med['off']:.3f}  (goal <= 1.03)")
    gaps = [abs(timed - w) / w for w, timed, _ in times["breakdown"]]
    named = [sum(v for k, v in b.items() if k != "other") / w for w, _, b in times["breakdown"]]
    lines.append(f"breakdown total vs independent wall: median |diff| {statistics.median(gaps):.1%} (goal <= 3%); "
                 f"named phases cover {statistics.median(named):.1%} of wall")
    phases = {k: statistics.median(b[k] for _, _, b in times["breakdown"]) * 1e3 for k in times["breakdown"][0][2]}
    lines.append("breakdown (ms, median): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    lines.append("NVML while stepping (median): " + (", ".join(f"{k} {v:.0f}" for k, v in sorted(nvml.items()))
                                                     or "n/a (no NVML)"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu_mfu.py", description=__doc__.splitlines()[0])
    ap.add_argument("--compile", action="store_true", help="torch.compile the module")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="steps per mode per round")
    ap.add_argument("--quick", action="store_true", help="a small GPT (the gpu-marked test)")
    ap.add_argument("--cpu-dry-run", action="store_true", help="check this script on CPU")
    ap.add_argument("--hf", metavar="CONFIG_JSON", help="a Hugging Face config.json (or folder) instead of the GPT")
    ap.add_argument("--seq", type=int, default=2048, help="sequence length with --hf")
    ap.add_argument("--micro", type=int, help="micro-batch (sequences)")
    ap.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override after the preset's (e.g. train.activation_checkpointing=true)")
    args = ap.parse_args(argv)
    for name in ("rounds", "steps", "seq", "micro", "global_batch"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            print(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1", file=sys.stderr)
            return 2
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print(no_cuda_message("bench/gpu_mfu.py"), file=sys.stderr)
        return 2
    from engine.config.schema import load_config
    from engine.device import use_default_cuda_allocator
    from engine.train.trainer import Trainer

    use_default_cuda_allocator()  # as `launch` gives its ranks, before CUDA allocates
    device = torch.device("cpu") if args.cpu_dry_run else torch.device("cuda", 0)
    trainer = Trainer(load_config(None, COMMON + model_args(args) + ["train.steps=1000000", *args.set]), device=device)
    if args.compile:
        trainer.par.forward = torch.compile(trainer.par.forward)
    stop = nvml_readings(device) if device.type == "cuda" else (lambda: {})
    with _attention_backend(device):
        times = measure(trainer, device, args.rounds, args.steps)
    print(report(trainer, device, times, stop(), args.compile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
