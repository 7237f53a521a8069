"""`workbench tune --launcher slurm`: the first trial's job as a dry run, and K tuner worker jobs that
share one study (each a one-CPU job running `workbench tune`, whose trials are jobs of their own)."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from workbench.cli_common import console, err, fail

# options of the submitting command that each worker gets afresh (its share, no re-submission)
_WORKER_FLAGS = ("--workers", "--trials", "--total-trials", "--seed", "--launcher")


def first_trial_config(cfg, space, *, objective: str, warmup: int, sampler: str, seed: int | None, tries: int = 50):
    """The config the study's first trial would run (an in-memory study with the same sampler and seed);
    draws that the engine refuses are skipped, as the study would prune them."""
    import optuna

    from engine.errors import ConfigError
    from tuning.objective import Objective
    from tuning.study import make_sampler

    probe = optuna.create_study(sampler=make_sampler("random" if sampler == "grid" else sampler, seed))
    obj = Objective(cfg, space, objective=objective, warmup_steps=warmup)
    last = None
    for _ in range(tries):
        trial = probe.ask()
        try:
            return obj.config_for(trial), trial.params
        except ConfigError as exc:
            last = exc
            probe.tell(trial, state=optuna.trial.TrialState.PRUNED)
    fail(f"--dry-run: {tries} draws of the space gave no valid config; the last: {last}")


def tune_dry_run(cfg, space, *, objective: str, warmup: int, sampler: str, seed: int | None, workers: int,
                 trials: int, argv: list[str]) -> None:
    """Print the first trial's batch script and srun line (and a worker job's, with --workers)."""
    from engine.launch.slurm import dry_run

    trial_cfg, params = first_trial_config(cfg, space, objective=objective, warmup=warmup, sampler=sampler, seed=seed)
    shown = ", ".join(f"{k}={v}" for k, v in params.items())
    sys.stdout.write(f"# first trial: {shown}\n{dry_run(trial_cfg)}")
    if workers:
        share = trials // workers + (1 if trials % workers else 0)
        script = _worker_script(cfg, argv, index=0, share=share, seed=seed)
        sys.stdout.write(f"\n# worker job 1 of {workers} (each runs its share of trials):\n{script}")


def _worker_argv(argv: list[str], *, share: int, seed: int | None, index: int) -> list[str]:
    """The submitting command's arguments for worker `index`: its share of trials, its own seed (workers
    with one seed would draw the same configs), trials started from the worker itself."""
    args, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in _WORKER_FLAGS:
            i += 2
            continue
        if a.split("=", 1)[0] in _WORKER_FLAGS or a == "--dry-run":
            i += 1
            continue
        args.append(a)
        i += 1
    args += ["--launcher", "slurm", "--workers", "0", "--trials", str(share)]
    return args + (["--seed", str(seed + index)] if seed is not None else [])


def worker_script(argv: list[str], *, job_name: str, output: Path, cluster_opts: list[str], env: dict[str, str],
                  setup: list[str] | None = None) -> str:
    """The batch script of one tuner worker job: one task on one CPU that runs `workbench tune ...`,
    whose trials are jobs of their own."""
    import shlex

    lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", "#SBATCH --nodes=1", "#SBATCH --ntasks=1",
             "#SBATCH --cpus-per-task=1", f"#SBATCH --output={output}"]
    lines += [f"#SBATCH {o}" for o in cluster_opts]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()] + list(setup or [])
    lines.append("exec " + shlex.join([sys.executable, "-m", "workbench.cli", *argv]))
    return "\n".join(lines) + "\n"


def _worker_script(cfg, argv: list[str], *, index: int, share: int, seed: int | None) -> str:
    from profilers.store import default_home

    c = cfg.cluster
    opts = [f"--{k}={getattr(c, k)}" for k in ("partition", "account", "time") if getattr(c, k) is not None]
    opts.append(f"--chdir={Path.cwd()}")
    home = default_home()
    env = {"WORKBENCH_HOME": str(home), "WORKBENCH_TUNE_JOB": "1", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return worker_script(_worker_argv(argv, share=share, seed=seed, index=index),
                         job_name=f"workbench-tuner-{index}", output=home / "slurm" / "tuner-%j.out",
                         cluster_opts=opts, env=env, setup=c.setup)


def submit_workers(cfg, argv: list[str], *, workers: int, trials: int, seed: int | None, storage: str | None,
                   quiet: bool) -> list[str]:
    """sbatch K worker jobs, each with its share of `trials`; returns their job ids."""
    from engine.launch.slurm import SlurmError, submit
    from profilers.store import default_home

    if workers > 1 and not (storage or "").startswith(("postgres", "mysql")):
        err.print(f"warning: {workers} workers share the study through SQLite (--storage unset or sqlite): that "
                  "works only while every worker job lands on one machine; use --storage postgresql://...",
                  highlight=False, markup=False, soft_wrap=True)
    folder = default_home() / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    shares = [trials // workers + (1 if i < trials % workers else 0) for i in range(workers)]
    ids = []
    try:
        for i, share in enumerate(shares):
            if share == 0:
                continue
            script = folder / f"tuner-{os.getpid()}-{i}.sbatch"
            script.write_text(_worker_script(cfg, argv, index=i, share=share, seed=seed))
            ids.append(submit(script))
    except SlurmError as exc:
        _cancel_all(ids)
        fail(str(exc), code=1)
    if not quiet:
        console.print(f"submitted {len(ids)} tuner worker jobs: {', '.join(ids)} (logs: {folder}/tuner-<job>.out)",
                      highlight=False)
    return ids


def _cancel_all(ids: list[str]) -> None:
    from engine.launch.slurm import cancel

    for job_id in ids:
        cancel(job_id)


def wait_for_workers(ids: list[str], quiet: bool) -> dict[str, Any]:
    """Follow the worker jobs to their end (Ctrl-C cancels them all); returns {job id: final state}."""
    from engine.launch.slurm import job_state

    final: dict[str, Any] = {}
    try:
        while len(final) < len(ids):
            for job_id in ids:
                if job_id not in final:
                    state = job_state(job_id)
                    if state.phase == "done" or state.state == "UNKNOWN":
                        final[job_id] = state
            time.sleep(1.0)
    except KeyboardInterrupt:
        _cancel_all(ids)
        fail("interrupted: every tuner worker job was cancelled (their trial jobs with them)", code=130)
    bad = {j: s.state for j, s in final.items() if s.state != "COMPLETED"}
    if bad and not quiet:
        err.print("worker jobs that did not complete: " + ", ".join(f"{j} {s}" for j, s in bad.items()),
                  highlight=False, markup=False)
    return final
