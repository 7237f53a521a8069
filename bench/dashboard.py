"""Dashboard render time: the Run page over a run of 100,000 telemetry records (goal < 0.5 s) and
the Tune page over a study of 5,000 trials (goal < 1 s), timed with Streamlit's AppTest (the page
script from start to finish, figures serialised), median of a few repeats, wall and CPU seconds,
with the load average (the machine is shared: compare CPU seconds when it is busy).

    .venv/bin/python bench/dashboard.py [--records 100000] [--trials 5000] [--repeats 5] [--home DIR]
    .venv/bin/python bench/dashboard.py --home DIR --against OTHER_CHECKOUT [--rounds 2]

--against times the Run page of this tree and of another checkout (e.g. `git archive COMMIT | tar -x -C
/tmp/old`) in turn, each in a fresh process on the same data, round after round, and prints them side by
side with the load average of each: before and after a change, on the same busy machine.

The data are synthetic but shaped like real telemetry (docs/architecture.md record format) and
written through the real RunStore and Optuna storage. The builders are also the fixtures of
tests/test_app.py.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from profilers.records import PHASES, Record  # noqa: E402
from profilers.store import RunStore  # noqa: E402

RUN_GOAL_S = 0.5
TUNE_GOAL_S = 1.0
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


def time_page(page: str, *, repeats: int) -> dict[str, Any]:
    """One AppTest session on ``page``: a first render (imports, AppTest's own set-up, the study
    reader's first full read), then ``repeats`` renders with st.cache_data cleared each time, as a
    browser refresh after the caches expired. Wall and CPU seconds (CPU of the whole process:
    the script thread included; less sensitive than wall to other work on a shared machine)."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=300)
    at.switch_page(f"workbench/app_pages/{page}.py")
    out: dict[str, Any] = {"wall": [], "cpu": []}
    for i in range(repeats + 1):
        st.cache_data.clear()
        wall, cpu = time.perf_counter(), time.process_time()
        at.run()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if at.exception:
            raise RuntimeError(f"{page} raised: {at.exception[0].value}")
        if i == 0:
            out["first_wall"], out["first_cpu"] = wall, cpu
        else:
            out["wall"].append(wall)
            out["cpu"].append(cpu)
    return out


def _line(what: str, t: dict[str, Any], goal: float) -> str:
    wall, cpu = statistics.median(t["wall"]), statistics.median(t["cpu"])
    return (f"{what}: median {wall:.3f} s wall, {cpu:.3f} s CPU over {len(t['wall'])} renders "
            f"(wall {[round(x, 3) for x in t['wall']]}); goal < {goal:g} s: {'ok' if wall < goal else 'MISSED'}"
            f"{' (CPU ok)' if wall >= goal and cpu < goal else ''}; first render of the session "
            f"{t['first_wall']:.2f} s wall, {t['first_cpu']:.2f} s CPU")


def time_checkout(checkout: Path, home: Path, repeats: int) -> dict[str, Any]:
    """`time_page("run")` of another checkout's app (its own bench/dashboard.py), in a fresh process."""
    code = (f"import json, sys; sys.path.insert(0, {str(checkout)!r}); from bench.dashboard import time_page; "
            f"print('RESULT', json.dumps(time_page('run', repeats={repeats})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True, text=True, timeout=1800,
                         env={**os.environ, "WORKBENCH_HOME": str(home), "PYTHONPATH": str(checkout)})
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{checkout}: no timing:\n{out.stderr[-2000:]}")
    return json.loads(line.removeprefix("RESULT "))


def side_by_side(other: Path, home: Path, n: int, repeats: int, rounds: int) -> None:
    """The Run page of this tree and of ``other``, alternately, ``rounds`` times each."""
    for i in range(rounds):
        for label, checkout in (("other", other), ("this tree", REPO)):
            load = os.getloadavg()
            t = time_checkout(checkout, home, repeats)
            print(f"round {i + 1}, {label} ({checkout}), load {load[0]:.2f}: "
                  + _line(f"Run page, {n:,} telemetry records", t, RUN_GOAL_S), flush=True)


def build(home: Path, records: int, trials: int) -> int:
    """Write the run and the study into ``home`` unless a previous call already did."""
    done = home / "bench-data.txt"
    if done.exists():
        return int(done.read_text())
    store = RunStore.open_home(home)
    n = write_run(store, "big-0001", steps=steps_for(records, 4), ranks=4)
    write_study(home, "big-study", trials=trials)
    done.write_text(str(n))
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--trials", type=int, default=5_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--against", type=Path, default=None,
                        help="another checkout whose Run page is timed in turn with this tree's (side by side)")
    parser.add_argument("--rounds", type=int, default=2, help="with --against: rounds of the two")
    parser.add_argument("--home", type=Path, default=None,
                        help="keep the synthetic data here and reuse it next time (writing 5,000 trials "
                             "through Optuna takes minutes on a loaded machine)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp:
        home = args.home or Path(tmp)
        home.mkdir(parents=True, exist_ok=True)
        os.environ["WORKBENCH_HOME"] = str(home)
        n = build(home, args.records, args.trials)
        if args.against is not None:
            side_by_side(args.against.resolve(), home, n, args.repeats, args.rounds)
            return
        load = os.getloadavg()
        run_t = time_page("run", repeats=args.repeats)
        tune_t = time_page("tune", repeats=args.repeats)
        load_after = os.getloadavg()
    print(f"load average (1/5/15 min) {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} before, "
          f"{load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} after, on {os.cpu_count()} CPUs")
    print(_line(f"Run page, {n:,} telemetry records", run_t, RUN_GOAL_S))
    print(_line(f"Tune page, {args.trials:,} trials", tune_t, TUNE_GOAL_S))


if __name__ == "__main__":
    main()
