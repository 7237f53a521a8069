"""Engine DP step time vs a minimal hand-written torch DDP loop: same model, world, batch.

Both run in the same rank processes, interleaved in rounds (engine block, then minimal block),
and the ratio of medians is printed. The engine runs as users run it: profilers and telemetry on.

    python bench/ddp_overhead.py [--world 2] [--rounds 6] [--steps 4]
"""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import interleaved_main, timed  # noqa: E402

import torch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from engine.config.schema import load_config  # noqa: E402
from engine.data.corpus import build_splits, local_batch  # noqa: E402
from engine.model.gpt import build_model, loss_fn  # noqa: E402

# the small GPT of shared/reference/platform.md
OVERRIDES = ["model.layers=4", "model.d_model=256", "model.heads=4", "model.seq_len=128", "model.vocab=256",
             "batch.micro=8", "train.lr=0.001", "train.warmup_steps=0", "profile.nvml_interval_s=0"]


def minimal_step(model, opt, x, y, micro: int) -> float:
    """The hand-written loop: accumulate with no_sync, clip, step (what nanoGPT's train.py does)."""
    accum = x.shape[0] // micro
    total = 0.0
    for i in range(accum):
        xs, ys = x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro]
        ctx = model.no_sync() if i < accum - 1 else torch.enable_grad()
        with ctx:
            loss = loss_fn(model(xs), ys) / accum
            loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def measure(rank: int, world: int, args) -> dict:
    """Interleaved blocks: engine steps, then hand-written steps, `rounds` times (round 0 warms up)."""
    from engine.train.trainer import Trainer
    from profilers.telemetry import TelemetryClient

    cfg = load_config(None, OVERRIDES + [f"parallel.dp={world}", f"batch.global={args.global_batch}",
                                         f"train.steps={10**6}"])
    client = TelemetryClient(None, "bench", rank, store_path=Path(args.tmp) / "runs.db")
    engine = Trainer(cfg, device=torch.device("cpu"), emit=client.emit, flush=client.flush)
    model = DistributedDataParallel(build_model(cfg.model, seed=0), bucket_cap_mb=cfg.ddp.bucket_cap_mb,
                                    gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2))
    splits = build_splits(cfg.data, cfg.model, seed=0)
    eng_times, min_times, step = [], [], 0
    for rnd in range(args.rounds + 1):
        for _ in range(args.steps):
            t = timed(lambda: engine._record(engine.train_step(step)) or engine.flush())
            eng_times += [t] if rnd else []
            step += 1
        for _ in range(args.steps):
            x, y = local_batch(splits.train, global_batch=cfg.batch.global_, dp=world, dp_rank=rank, seed=0, step=step)
            t = timed(lambda: minimal_step(model, opt, x, y, cfg.batch.micro))
            min_times += [t] if rnd else []
            step += 1
    client.close()
    return {"engine": statistics.median(eng_times), "minimal": statistics.median(min_times), "n": len(eng_times)}


def main() -> None:
    args, r = interleaved_main(measure)
    print(f"world={args.world} global_batch={args.global_batch} steps measured per side={r['n']} "
          f"(interleaved rounds of {args.steps}, medians; load avg {os.getloadavg()[0]:.1f})")
    print(f"engine DP step (telemetry on): {r['engine'] * 1000:8.1f} ms")
    print(f"minimal DDP step:              {r['minimal'] * 1000:8.1f} ms")
    print(f"ratio engine/minimal: {r['engine'] / r['minimal']:.3f}  (target <= 1.03)")


if __name__ == "__main__":
    main()
