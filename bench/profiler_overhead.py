"""Step time with every profiler on versus all off: same ranks, same model, interleaved blocks.

"On" is what `workbench run` does: step-time breakdown, collective profiler with the DDP
bucket hook, memory per step, host sampler thread, telemetry batched to a store and flushed
at each step end. "Off" is the same engine with `profile.enabled=false` and no telemetry.

    python bench/profiler_overhead.py [--world 2] [--rounds 6] [--steps 4] [--tp 2]

With ``--tp 2`` the ranks run tensor parallel (dp = world / tp): the recorded collectives are
then DTensor's functional ones (profilers/functional.py).
"""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import interleaved_main, timed  # noqa: E402

import torch  # noqa: E402

from engine.config.schema import load_config  # noqa: E402

# the small GPT of shared/reference/platform.md
OVERRIDES = ["model.layers=4", "model.d_model=256", "model.heads=4", "model.seq_len=128", "batch.micro=8",
             "train.warmup_steps=0", "profile.nvml_interval_s=1.0", "profile.host_interval_s=1.0",
             f"train.steps={10**6}"]


def measure(rank: int, world: int, args) -> dict:
    from engine.train.trainer import Trainer
    from profilers.host import HostSampler
    from profilers.nvml import NvmlSampler
    from profilers.telemetry import TelemetryClient

    tp = getattr(args, "tp", 1)
    common = OVERRIDES + [f"parallel.dp={world // tp}", f"parallel.tp={tp}", f"batch.global={args.global_batch}"]
    client = TelemetryClient(None, "bench", rank, store_path=Path(args.tmp) / "runs.db")
    on = Trainer(load_config(None, common), device=torch.device("cpu"), emit=client.emit, flush=client.flush)
    off = Trainer(load_config(None, common + ["profile.enabled=false"]), device=torch.device("cpu"))
    samplers = [HostSampler(interval=1.0, emit=client.record), NvmlSampler(interval=1.0, emit=client.record)]
    on_times, off_times, step = [], [], 0
    for rnd in range(args.rounds + 1):  # round 0 warms both up
        on.collectives.enable()
        for s in samplers:
            s.start()
        for _ in range(args.steps):
            t = timed(lambda: on._record(on.train_step(step)) or on.flush())
            on_times += [t] if rnd else []
            step += 1
        for s in samplers:
            s.stop()
        on.collectives.disable()
        for _ in range(args.steps):
            t = timed(lambda: off.train_step(step))
            off_times += [t] if rnd else []
            step += 1
    client.close()
    return {"on": statistics.median(on_times), "off": statistics.median(off_times), "n": len(on_times)}


def main() -> None:
    args, r = interleaved_main(measure)
    print(f"world={args.world} tp={args.tp}, {r['n']} steps per side, interleaved rounds of {args.steps} "
          f"(medians; load avg {os.getloadavg()[0]:.1f})")
    print(f"profilers on:  {r['on'] * 1000:8.1f} ms/step")
    print(f"profilers off: {r['off'] * 1000:8.1f} ms/step")
    print(f"overhead: {(r['on'] / r['off'] - 1) * 100:+.2f}%  (target <= 3%)")


if __name__ == "__main__":
    main()
