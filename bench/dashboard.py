"""Dashboard render time: the Run page over a run of 100,000 telemetry records (goal < 1 s) and the
Tune page over a study of 5,000 trials (goal < 2 s), timed with Streamlit's AppTest (the page
script from start to finish, figures serialised), median of a few repeats.

    .venv/bin/python bench/dashboard.py [--records 100000] [--trials 5000] [--repeats 3]

The data are synthetic but shaped like real telemetry (docs/architecture.md record format) and
written through the real RunStore and Optuna storage. The builders are also the fixtures of
tests/test_app.py.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from profilers.records import Record  # noqa: E402
from profilers.store import PHASES, RunStore  # noqa: E402

HOST_NAMES = ("cpu(%)", "rss(GiB)", "sys_mem_used(GiB)", "net_rx(B/s)", "net_tx(B/s)")


def _step_records(run_id: str, rank: int, step: int, t: float, rng: random.Random) -> list[Record]:
    loss = 5.5 * math.exp(-step / 400) + 1.5 + rng.gauss(0, 0.02)
    phases = {"data": 0.002, "forward": 0.03, "backward": 0.06, "optimizer": 0.01,
              "comm_exposed": 0.015 * (1 + 0.2 * rank), "bubble": 0.0, "other": 0.003}
    total = sum(phases.values())
    size = 2 ** (12 + step % 12)
    out = [Record(run_id, rank, step, "step", "loss", loss, t),
           Record(run_id, rank, step, "step", "step_time(s)", total, t),
           Record(run_id, rank, step, "step", "tokens_per_s", 4096 / total, t),
           Record(run_id, rank, step, "step", "mfu", 0.004 + rng.random() * 1e-3, t),
           Record(run_id, rank, step, "step", "lr", 3e-3, t)]
    out += [Record(run_id, rank, step, "breakdown", f"{p}(s)", v * (1 + rng.gauss(0, 0.05)), t)
            for p, v in phases.items()]
    busbw = 2.0 * size / (size + 2 ** 16)
    out += [Record(run_id, rank, step, "comm", "all_reduce/bytes", 4.0 * size, t),
            Record(run_id, rank, step, "comm", "all_reduce/count", 4.0, t),
            Record(run_id, rank, step, "comm", "all_reduce/time(s)", 4 * size / (busbw * 1e9), t),
            Record(run_id, rank, step, "comm", "all_reduce/busbw(GB/s)", busbw, t)]
    return out


def write_run(store: RunStore, run_id: str, *, steps: int, ranks: int = 2, status: str = "completed",
              emulated: bool = False, seed: int = 0) -> int:
    """A synthetic run (step, breakdown, comm, memory, host, eval records); returns the record count."""
    rng = random.Random(seed)
    dp = ranks
    store.create_run(run_id, name=run_id.split("-")[0], world_size=ranks, emulated=emulated,
                     config={"name": run_id, "model": {"layers": 2, "d_model": 32}, "parallel": {"dp": dp}},
                     layout={"dp": dp, "tp": 1, "pp": 1})
    t0, written, batch = time.time() - steps * 0.13, 0, []
    for step in range(steps):
        t = t0 + step * 0.13
        for rank in range(ranks):
            batch += _step_records(run_id, rank, step, t, rng)
            if step % 50 == 0:
                batch.append(Record(run_id, rank, step, "memory", "rss(GiB)", 0.5 + 0.01 * rank, t))
                batch.append(Record(run_id, rank, step, "memory", "params(GiB)", 0.01, t))
        if step % 10 == 9:
            batch.append(Record(run_id, 0, step, "eval", "val_loss", 2.0 + 3 * math.exp(-step / 400), t))
        batch += [Record(run_id, 0, -1, "host", n, rng.random() * 100, t) for n in HOST_NAMES]
        if len(batch) > 5000:
            written += store.write(batch)
            batch = []
    written += store.write(batch)
    if status != "running":
        store.finish_run(run_id, status, error="rank 1 failed: synthetic error" if status == "failed" else None,
                         error_rank=1 if status == "failed" else None)
    return written


def steps_for(records: int, ranks: int) -> int:
    """Steps that make ``write_run`` write about ``records`` records."""
    per_step = ranks * (5 + len(PHASES) + 4) + len(HOST_NAMES) + 0.1 + ranks * 2 / 50
    return int(records / per_step)


def write_study(home: Path, name: str, *, trials: int, run_ids: list[str] | None = None,
                multi: bool = False, seed: int = 0) -> Any:
    """An Optuna study on the home's storage with complete, pruned and failed trials."""
    import optuna
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    from tuning.study import default_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rng = random.Random(seed)
    study = optuna.create_study(study_name=name, storage=default_storage(home),
                                directions=["maximize", "minimize"] if multi else ["maximize"])
    dists = {"batch.micro": CategoricalDistribution([2, 4, 8]),
             "comm.compressor": CategoricalDistribution(["none", "fp16", "topk"]),
             "train.lr": FloatDistribution(1e-4, 1e-2, log=True)}
    made = []
    for i in range(trials):
        params = {"batch.micro": rng.choice([2, 4, 8]), "comm.compressor": rng.choice(["none", "fp16", "topk"]),
                  "train.lr": 10 ** rng.uniform(-4, -2)}
        attrs: dict[str, Any] = {"run_id": run_ids[i % len(run_ids)] if run_ids else f"none-t{i}",
                                 "config": {"name": name, "model": {"layers": 2, "d_model": 32, "heads": 2},
                                            "parallel": {"dp": 2}, "batch": {"global": 8, "micro": params["batch.micro"]},
                                            "comm": {"compressor": params["comm.compressor"]},
                                            "train": {"lr": params["train.lr"]}}}
        state = optuna.trial.TrialState.COMPLETE
        if i % 7 == 3:
            state, attrs["reason"] = optuna.trial.TrialState.PRUNED, "pruned at step 3"
        elif i % 11 == 5:
            state, attrs["reason"] = optuna.trial.TrialState.FAIL, "crash (rank 1): synthetic"
        tps = 1000 * params["batch.micro"] * (1.5 if params["comm.compressor"] == "fp16" else 1.0) + rng.gauss(0, 50)
        values = None
        if state == optuna.trial.TrialState.COMPLETE:
            values = [tps, 2.0 + abs(math.log10(params["train.lr"]) + 2.5)] if multi else [tps]
            attrs.update(tokens_per_s=tps, compute_s=0.09, comm_exposed_s=0.02, bubble_s=0.0)
        made.append(optuna.trial.create_trial(params=params, distributions=dists, values=values,
                                              state=state, user_attrs=attrs))
    study.add_trials(made)
    return study


def time_page(page: str, *, repeats: int) -> list[float]:
    """Seconds of ``repeats`` cold renders (caches cleared) of one page with AppTest."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    out = []
    for _ in range(repeats):
        st.cache_data.clear()
        at = AppTest.from_file(str(REPO / "app.py"), default_timeout=120)
        at.switch_page(f"workbench/app_pages/{page}.py")
        start = time.perf_counter()
        at.run()
        out.append(time.perf_counter() - start)
        if at.exception:
            raise RuntimeError(f"{page} raised: {at.exception[0].value}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--trials", type=int, default=5_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp:
        home = Path(tmp)
        os.environ["WORKBENCH_HOME"] = str(home)
        store = RunStore.open_home(home)
        n = write_run(store, "big-0001", steps=steps_for(args.records, 4), ranks=4)
        write_study(home, "big-study", trials=args.trials)
        time_page("run", repeats=1)  # warm imports (streamlit, plotly, pandas) out of the figure
        run_s = time_page("run", repeats=args.repeats)
        tune_s = time_page("tune", repeats=args.repeats)
    run_med, tune_med = statistics.median(run_s), statistics.median(tune_s)
    print(f"Run page, {n:,} telemetry records: median {run_med:.3f} s over {len(run_s)} cold renders "
          f"{[round(s, 3) for s in run_s]} (goal < 1 s: {'ok' if run_med < 1 else 'MISSED'})")
    print(f"Tune page, {args.trials:,} trials: median {tune_med:.3f} s over {len(tune_s)} cold renders "
          f"{[round(s, 3) for s in tune_s]} (goal < 2 s: {'ok' if tune_med < 2 else 'MISSED'})")


if __name__ == "__main__":
    main()
