"""How fast TPE finds a near-best config, and what pruning saves, on a real small space here.

1. Exhaustive: every config of the space is run for real (the grid), giving the best tokens/s.
2. TPE over those measurements for 3 seeds (a tabular benchmark, as NAS-Bench does: the same
   measured value answers every visit, so seeds differ only by the sampler): trials until a
   config within 5% of the exhaustive best, as a share of the grid (target <= 30%).
3. One real TPE study (seed 0) with a 30% budget, as a check that real runs agree.
4. Pruning: the same real study with the median pruner versus none; total tuning wall time.

    python bench/tuner_efficiency.py [--steps 8]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import optuna  # noqa: E402

from engine.config.schema import load_config  # noqa: E402
from tuning.objective import Objective  # noqa: E402
from tuning.space import SearchSpace  # noqa: E402
from tuning.study import load_study, run_trials  # noqa: E402

BASE = ["model.layers=4", "model.d_model=128", "model.heads=4", "model.seq_len=64", "batch.global=16",
        "profile.host_interval_s=0", "profile.nvml_interval_s=0", "train.warmup_steps=0", "train.eval_interval=0"]
SPACE = {"world_size": 2, "params": {"parallel.layout": {"layouts": ["dp", "tp", "pp"]},
                                     "batch.micro": {"choices": [1, 2, 4, 8]},
                                     "ddp.bucket_cap_mb": {"choices": [1, 25]}}}


def key(params: dict) -> tuple:
    return tuple(sorted(params.items()))


def exhaustive(space: SearchSpace, base, home: Path) -> dict[tuple, float]:
    study = load_study("grid", f"sqlite:///{home}/studies.db", sampler="grid", pruner="none")
    for params in space.grid():
        study.enqueue_trial(params)
    run_trials(study, Objective(base, space, home=home, warmup_steps=2), len(space.grid()))
    trials = study.get_trials()  # invalid points and repeats are skipped (unrun): invalid ones measure 0
    table = {key(t.params): 0.0 for t in trials if t.user_attrs.get("skipped")}
    table.update({key(t.params): (t.values[0] if t.values else 0.0) for t in trials if not t.user_attrs.get("skipped")})
    return table


def tpe_on_table(table: dict[tuple, float], space: SearchSpace, seed: int, target: float) -> int:
    """Trials TPE needs, over the measured table, to hit a value >= target."""
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    for n in range(1, len(table) + 1):
        trial = study.ask()
        value = table.get(key(space.suggest(trial)), 0.0)  # invalid combos measured 0 (pruned)
        study.tell(trial, value)
        if value >= target:
            return n
    return len(table)


def real_study(space, base, home: Path, name: str, pruner: str, trials: int, seed: int) -> tuple[float, float]:
    study = load_study(name, f"sqlite:///{home}/studies.db", sampler="tpe", seed=seed, pruner=pruner, warmup_steps=2)
    start = time.perf_counter()
    run_trials(study, Objective(base, space, home=home, warmup_steps=2), trials)
    done = [t.values[0] for t in study.get_trials() if t.values]
    return time.perf_counter() - start, max(done) if done else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    base = load_config(None, BASE + [f"train.steps={args.steps}"])
    space = SearchSpace.from_dict(SPACE)
    grid = len(space.grid())
    budget = math.ceil(0.3 * grid)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        table = exhaustive(space, base, home)
        best = max(table.values())
        target = 0.95 * best
        print(f"grid: {grid} configs run for real; best {best:,.0f} tokens/s; within 5%: >= {target:,.0f} "
              f"(load avg {os.getloadavg()[0]:.1f})")
        needed = [tpe_on_table(table, space, seed, target) for seed in (0, 1, 2)]
        print("TPE trials to reach within 5% of the best, seeds 0,1,2: "
              + ", ".join(f"{n} ({n / grid:.0%} of the grid)" for n in needed) + "  (target <= 30%)")
        _, real_best = real_study(space, base, home, "real-tpe", "none", budget, 0)
        print(f"real TPE study, {budget} trials ({budget / grid:.0%}): best {real_best:,.0f} tokens/s = "
              f"{real_best / best:.1%} of the exhaustive best")
        t_none, _ = real_study(space, base, home, "no-pruner", "none", grid // 2, 1)
        t_median, _ = real_study(space, base, home, "median-pruner", "median", grid // 2, 1)
        print(f"pruning: {grid // 2} trials take {t_none:.0f} s without a pruner and {t_median:.0f} s with the "
              f"median pruner: ratio {t_median / t_none:.2f}")


if __name__ == "__main__":
    main()
