"""Where a checkpointed layer's time goes at small micro-batches: host or device (issue 63, recompute).

    python bench/gpu_checkpoint.py [--micro 1,4] [--accumulate 1] [--repeats 5] [--cpu-dry-run]

The engine's GPT-1B (bench/gpu_mfu.py's: 20 layers, d_model 2048, seq 2048, bf16 autocast, flash SDPA), one
forward and backward of one micro-batch, under four ways to run its blocks: no checkpoint, the engine's
(torch.utils.checkpoint, non-reentrant, RNG state preserved), the same without preserving the RNG state, and the
reentrant form. For each: the step's wall time (synchronised), and the host time of the forward call alone (from
the call to its return, without a synchronisation: the time the Python side takes to enqueue the forward's
kernels; where it is at or above the forward's device time, the forward is host-bound). `--accumulate N` runs N
micro-batches a step into the same gradients (as the engine accumulates them) and reports per micro-batch.
Medians of `--repeats`.
`--cpu-dry-run` checks this script on a tiny CPU model and measures nothing about GPUs.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from gpu_check import no_cuda_message, versions  # noqa: E402

import engine.model.gpt as gpt  # noqa: E402
from engine.config.schema import ModelConfig  # noqa: E402

CHECKPOINTS = {
    "none": None,
    "engine (non-reentrant, RNG preserved)": functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False),
    "non-reentrant, RNG not preserved": functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False,
                                                          preserve_rng_state=False),
    "reentrant, RNG preserved": functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(model: gpt.GPT, tokens: torch.Tensor, device: torch.device, accumulate: int) -> tuple[float, float]:
    """(wall s of forward + backward, host s of the forward call) per micro-batch of a step of `accumulate`."""
    _sync(device)
    t0, host = time.perf_counter(), 0.0
    for _ in range(accumulate):
        t1 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(tokens[:, :-1])
            host += time.perf_counter() - t1
            loss = gpt.loss_fn(logits, tokens[:, 1:])
        (loss / accumulate).backward()
    _sync(device)
    model.zero_grad(set_to_none=True)
    return (time.perf_counter() - t0) / accumulate, host / accumulate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro", default="1,4", help="micro-batch sizes, comma-separated")
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches a step")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cpu-dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.cpu_dry_run:
        device, shape = torch.device("cpu"), dict(layers=2, d_model=64, heads=4, seq_len=64, vocab=256)
    elif not torch.cuda.is_available():
        print(no_cuda_message("bench/gpu_checkpoint.py"), file=sys.stderr)
        return 2
    else:
        device, shape = torch.device("cuda"), dict(layers=20, d_model=2048, heads=16, seq_len=2048, vocab=50304)
    cfg = ModelConfig(**shape)
    model = gpt.build_model(cfg, seed=0, device=device)
    print(f"{versions(device)}; {shape}; {args.accumulate} micro-batch(es) a step; median of {args.repeats}")
    print(f"{'micro':>5} {'checkpoint':40} {'step (ms)':>10} {'fwd host (ms)':>14}")
    for micro in (int(m) for m in args.micro.split(",")):
        tokens = torch.randint(0, cfg.vocab, (micro, cfg.seq_len + 1), device=device)
        for name, fn in CHECKPOINTS.items():
            gpt.checkpoint = fn or torch.utils.checkpoint.checkpoint
            for block in model.layers.values():
                block.checkpointed = fn is not None
            time_step(model, tokens, device, args.accumulate)  # warm-up
            runs = [time_step(model, tokens, device, args.accumulate) for _ in range(args.repeats)]
            wall, host = (statistics.median(r[i] for r in runs) * 1e3 for i in (0, 1))
            print(f"{micro:>5} {name:40} {wall:10.1f} {host:14.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
