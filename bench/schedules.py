"""Every pipeline schedule at pp=4: step time, measured vs simulated bubble, peak activations;
SkipPipe's step-time ratio to 1f1b; optionally the full model's validation loss after N steps of
SkipPipe and of 1f1b at equal tokens (held-out split, every stage evaluated).

Each schedule is a real `launch()` of the same tiny GPT (8 layers) at pp=4, 8 micro-batches, for
`--steps` steps; the columns are medians over steps 3+ (12 by default, 4 before 2026-11-24: on this
2-core host one step's scheduling noise moves a 4-step median by a point or two), and each "diff
pts" column is the median over those steps of the step's own measured minus predicted bubble, in
points (each step is priced from its own recorded costs; the difference of the two columns'
medians, used before, can set one step's measured against another's prediction). The
measured bubble of a rank is 1 - (its executed compute actions' time) / (its step time), from the
actions the engine recorded; the simulated one walks the schedule's own action list
(tuning/sim/schedule.py) with the prices `calibrate` (tuning/calibrate/schedule.py) reads off the same step: each action the
mean of its (stage, kind), each rank's host work before each kind of action (run while the
action's inputs are in flight), the p2p delay (counted from where torch's lowered list posts the
input's send: an OVERLAP_F_B sends after both halves, to the start of the action it gated), the
head and tail of each rank's step and when each rank entered it. "sim" gives every rank a
core of its own; "sim shared" adds processor sharing of os.cpu_count() cores among the ranks doing
CPU work (Costs.cores), the column to compare with when ranks > cores; "sim drawn" is the mean of
20 walks with every action's work and every input's delay drawn from the step's recorded ones and
the host work between actions at its (rank, kind)'s mean (own cores; `predicted_bubble`, what
`show` and the Run page use): the step is a max over paths, so spread in the costs adds waits a
walk at mean costs misses. Peak activations: the
most (stage, micro-batch) forwards a rank held before their backward, times one stage's
activation bytes (fp32, Korthikanti et al. 2022 eq. 1 without the 2-byte factor: 34 s b h +
5 a s^2 b per layer, times 2 for fp32) is "counted"; "measured" is the most bytes autograd held
at once on a rank (saved-tensor hooks on each stage forward, weights excluded, freed at the
micro-batch's B or W; engine/parallel/pipeline.py), not recorded under SkipPipe.

SkipPipe's ratio to 1f1b: two engine Trainers, 1f1b and skip (same model, same seed, profilers on),
in the same four rank processes, stepping alternately (1f1b-skip, then skip-1f1b, `--ratio-pairs`
times after 3 warm-up pairs); each step's time is its slowest rank's, and the ratio is the median of
the pairs' skip / 1f1b. Separate runs of each schedule drifted apart with the host's speed (one pair
of 6-step runs read 0.54 to 1.02, medians of three 12-step pairs 0.57 to 0.83); steps seconds apart in
one world do not.

    python bench/schedules.py [--steps 14] [--loss-steps 150] [--ratio-pairs 60] [--save DIR]
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import run_world, timed  # noqa: E402

from engine.config.schema import load_config  # noqa: E402
from engine.launch.local import launch  # noqa: E402
from profilers.store import RunStore  # noqa: E402
from tuning.calibrate.schedule import executed_steps, measured_bubble, predicted_bubble  # noqa: E402
from tuning.sim.schedule import peak_in_flight  # noqa: E402

LAYERS, D, HEADS, SEQ, GLOBAL, MICRO, PP = 8, 64, 4, 32, 16, 2, 4
MODEL = [f"model.layers={LAYERS}", f"model.d_model={D}", f"model.heads={HEADS}", f"model.seq_len={SEQ}",
         f"batch.global={GLOBAL}", f"batch.micro={MICRO}", f"parallel.pp={PP}", "profile.host_interval_s=0",
         "profile.nvml_interval_s=0", "train.warmup_steps=0", "model.dropout=0.0"]
SCHEDULES = {
    "gpipe": [], "1f1b": [], "interleaved": ["parallel.virtual=2"], "looped_bfs": ["parallel.virtual=2"],
    "modular": [], "zero_bubble": ["parallel.virtual=2"], "zbv": [], "dualpipev": [],
    "skip": ["parallel.skip_ratio=0.33"],
}


def _run(name: str, steps: int, home: Path, extra: list[str] | None = None) -> tuple[str, RunStore]:
    overrides = MODEL + [f"parallel.schedule={name}"] + SCHEDULES[name] + (extra or [])
    cfg = load_config(None, overrides + [f"train.steps={steps}", f"name=sched-{name}"])
    result = launch(cfg, home=home)
    return result.run_id, RunStore.open_home(home)


def measure(name: str, steps: int, home: Path, save: Path | None = None, prior: dict | None = None) -> dict:
    """One run of `name`: the medians of the module docstring. With `prior` (an earlier run's
    executed steps), also "diff oos": each late step's measured bubble minus the drawn walk priced
    from the earlier run's step at the same position (calibrate on one run, predict the next)."""
    run_id, store = _run(name, steps, home)
    frame = store.step_frame(run_id)
    step_col = next(c for c in frame.columns if c.startswith("step_time"))
    executed = executed_steps(store.metrics(run_id, kind="schedule") + store.metrics(run_id, kind="skip_path"))
    late = sorted(executed)[2:] or sorted(executed)  # the first steps include shape inference
    virtual = 2 if SCHEDULES[name] == ["parallel.virtual=2"] else 1
    if save:
        save.mkdir(parents=True, exist_ok=True)
        (save / f"{name}.pkl").write_bytes(pickle.dumps(executed))
    measured, simulated, shared, drawn, peaks, held, oos = [], [], [], [], [], [], []
    prior_late = sorted(prior)[2:] if prior else []
    for i, step in enumerate(late):
        ranks = executed[step]
        measured.append(statistics.fmean(measured_bubble(ranks).values()))
        if i < len(prior_late):
            oos.append(measured[-1] - statistics.fmean(predicted_bubble(
                ranks, schedule=name, pp=PP, n_microbatches=GLOBAL // MICRO, virtual=virtual, layers=LAYERS,
                draws=20, priced_from=prior[prior_late[i]]).values()))
        for out, cores, draws in ((simulated, None, 0), (shared, os.cpu_count(), 0), (drawn, None, 20)):
            out.append(statistics.fmean(predicted_bubble(ranks, schedule=name, pp=PP, n_microbatches=GLOBAL // MICRO,
                                                         virtual=virtual, layers=LAYERS, cores=cores,
                                                         draws=draws).values()))
        peaks.append(max(peak_in_flight(row["actions"]) for row in ranks.values()))
        held.append(max(row.get("peak_act_bytes", 0.0) for row in ranks.values()))
    layers_per_stage = LAYERS // (PP * (2 if name in ("interleaved", "looped_bfs", "zero_bubble", "zbv", "dualpipev",
                                                      "modular") else 1))
    stage_bytes = 2 * (34 * SEQ * MICRO * D + 5 * HEADS * SEQ * SEQ * MICRO) * layers_per_stage

    def diff(predicted: list[float]) -> float:  # median over steps of the step's own measured - predicted
        return statistics.median(m - p for m, p in zip(measured, predicted))

    return {"step_s": statistics.median(frame[step_col].iloc[2:] if len(frame) > 2 else frame[step_col]),
            "measured": statistics.median(measured), "simulated": statistics.median(simulated),
            "shared": statistics.median(shared), "drawn": statistics.median(drawn), "load": os.getloadavg()[0],
            "diff_sim": diff(simulated), "diff_shared": diff(shared), "diff_drawn": diff(drawn),
            "peak_mb": max(peaks), "peak_mib": max(peaks) * stage_bytes / 2**20, "held_mib": max(held) / 2**20,
            "diff_oos": statistics.median(oos) if oos else float("nan"), "executed": executed}


def alternated_ratios(rank: int, world: int, pairs: int, warmup: int = 3) -> list[float]:
    """Per pair of adjacent steps, skip's step time over 1f1b's (see the module docstring)."""
    import torch
    import torch.distributed as dist

    from engine.train.trainer import Trainer

    trainers = {}
    for name in ("1f1b", "skip"):
        cfg = load_config(None, MODEL + [f"parallel.schedule={name}", f"train.steps={warmup + pairs}"] + SCHEDULES[name])
        trainers[name] = Trainer(cfg, device=torch.device("cpu"))
        trainers[name].collectives.disable()  # one collective profiler patches torch.distributed at a time
    times: dict[str, list[float]] = {"1f1b": [], "skip": []}
    for i in range(warmup + pairs):
        for name in ("1f1b", "skip") if i % 2 == 0 else ("skip", "1f1b"):
            trainer = trainers[name]
            trainer.collectives.enable()
            times[name].append(timed(lambda: trainer.train_step(i)))
            trainer.collectives.disable()
    slowest = torch.tensor(times["1f1b"] + times["skip"], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    full, skip = slowest.tolist()[warmup:warmup + pairs], slowest.tolist()[2 * warmup + pairs:]
    return [s / f for f, s in zip(full, skip)]


EVALS = 3  # validation points per loss run


def loss_after(name: str, steps: int, home: Path) -> dict:
    """Train `name` for `steps` steps (equal tokens: the same global batch and steps for every schedule)
    and evaluate the FULL model on the held-out split (the last val_fraction of the corpus, 16
    batches) every steps / EVALS steps; SkipPipe's evaluate runs every stage (no path skipped).
    Returns the validation losses by step and the training loss (mean of the last 10 steps: under
    SkipPipe the skipped paths' own loss, not the full model's)."""
    run_id, store = _run(name, steps, home, ["train.lr=0.003", f"train.eval_interval={max(1, steps // EVALS)}",
                                             "train.eval_batches=16"])
    frame = store.step_frame(run_id)
    loss_col = next(c for c in frame.columns if c.startswith("loss"))
    val = {rec.step + 1: rec.value for rec in store.metrics(run_id, kind="eval", name="val_loss")}
    return {"val": val, "train": float(frame[loss_col].tail(10).mean())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=14, help="steps of each schedule's run (medians of steps 3+)")
    ap.add_argument("--loss-steps", type=int, default=0, help="also train 1f1b and skip this long (0: skip it)")
    ap.add_argument("--only", nargs="*", default=list(SCHEDULES))
    ap.add_argument("--save", type=Path, default=None, help="also pickle each schedule's executed steps here")
    ap.add_argument("--ratio-pairs", type=int, default=60, help="alternated 1f1b / skip step pairs for SkipPipe's ratio")
    ap.add_argument("--out-of-sample", action="store_true",
                    help="run each schedule twice back to back; price the second run from the first's costs")
    args = ap.parse_args()
    rows = {}
    ratios: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            prior = measure(name, args.steps, Path(tmp))["executed"] if args.out_of_sample else None
            rows[name] = measure(name, args.steps, Path(tmp), args.save, prior=prior)
            print(name, {k: v for k, v in rows[name].items() if k != "executed"}, flush=True)
        if "skip" in rows and "1f1b" in rows and args.ratio_pairs:
            ratios = run_world(alternated_ratios, PP, args.ratio_pairs)
        losses = {n: loss_after(n, args.loss_steps, Path(tmp)) for n in ("1f1b", "skip")} if args.loss_steps else {}
    print(f"pp={PP}, layers={LAYERS}, d={D}, seq={SEQ}, {GLOBAL // MICRO} micro-batches, {args.steps} steps each "
          f"(median of steps 3+; load avg {os.getloadavg()[0]:.1f} on a shared 2-core machine)")
    print(f"{'schedule':12s} {'step s':>7s} {'load':>5s} {'measured':>9s} {'sim':>6s} {'diff pts':>8s} "
          f"{'sim shared':>10s} {'diff pts':>8s} {'sim drawn':>9s} {'diff pts':>8s} "
          f"{'peak act (mb-stages)':>21s} {'counted MiB':>11s} {'measured MiB':>12s} {'oos diff':>8s}")
    for name, r in rows.items():
        print(f"{name:12s} {r['step_s']:7.3f} {r['load']:5.1f} {r['measured']:9.3f} {r['simulated']:6.3f} "
              f"{100 * r['diff_sim']:8.1f} {r['shared']:10.3f} "
              f"{100 * r['diff_shared']:8.1f} {r['drawn']:9.3f} {100 * r['diff_drawn']:8.1f} "
              f"{r['peak_mb']:21d} {r['peak_mib']:11.2f} {r['held_mib'] or float('nan'):12.2f} "
              f"{100 * r['diff_oos']:8.1f}")
    if ratios:
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(f"SkipPipe (skip_ratio 0.33) step time / 1f1b over {len(ratios)} alternated step pairs in one world: "
              f"median {statistics.median(ratios):.3f} (quartiles {q1:.3f}-{q3:.3f})  (goal <= 0.8)")
    if losses:
        full, skip = losses["1f1b"], losses["skip"]
        print(f"full model's validation loss at equal tokens ({GLOBAL * SEQ} tokens a step; held-out split):")
        for step in sorted(full["val"]):
            a, b = full["val"][step], skip["val"].get(step, float("nan"))
            print(f"  after {step:4d} steps: 1f1b {a:.4f}, skip {b:.4f}, skip/1f1b - 1 = {100 * (b / a - 1):+.2f}%")
        print(f"  (goal within 5%); training loss, last 10 of {args.loss_steps} steps: 1f1b {full['train']:.4f}, "
              f"skip {skip['train']:.4f} (skip's is its skipped paths', not the full model's)")


if __name__ == "__main__":
    main()
