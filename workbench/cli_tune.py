"""`workbench tune`, `studies` and `export`: Optuna studies over real runs, from the shell."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from engine.errors import ConfigError
from workbench.cli_common import (check_launcher, check_number, check_sbatch, console, err, fail, print_json,
                                  stop_on_sigterm)


def _base_config(base: Optional[Path], overrides: list[str]):
    """The space's base config with --set applied: a template, not validated on its own (a search space
    sets its layout; each trial's config is validated), so a base layout the model cannot take (tp=2 on
    3 key/value heads) does not stop the study when the space's points are valid."""
    from engine.config.schema import load_config

    return load_config(base, overrides, check=False)


def _origin(field: str, base: Optional[Path], overrides: list[str], sp) -> str:
    """Where the value of a refused config key came from: --set, the space, or the base config."""
    if any(o.split("=", 1)[0].strip() == field for o in overrides):
        return "--set"
    if field in sp.fixed:
        return "the space's fixed:"
    if any(p.key == field or (p.key == "parallel.layout" and field.startswith("parallel.")) for p in sp.params):
        return f"the space's params ({field})"
    return f"the base config {base}" if base else "the defaults"


def _space_watcher(path: Path, objective) -> Any:
    """Re-read the space between trials when its file changed ("tune live" from the dashboard)."""
    from tuning.space import SearchSpace

    state = {"mtime": path.stat().st_mtime}

    def reload() -> None:
        mtime = path.stat().st_mtime
        if mtime != state["mtime"]:
            state["mtime"] = mtime
            try:
                new = SearchSpace.from_yaml(path)
                new.check_against(objective.base)
                objective.space = new
                console.print(f"search space reloaded from {path}")
            except ConfigError as exc:
                console.print(f"[yellow]space edit ignored:[/] {exc}")

    return reload


def _wait_while_paused(study) -> None:
    while study.user_attrs.get("paused", False):  # read from the storage each time
        time.sleep(1.0)


def tune(space: Path = typer.Argument(..., help="Search space YAML"),
         trials: Optional[int] = typer.Option(None, "--trials",
                                              help="Trials this command adds to the study (split over --jobs); default 10"),
         total_trials: Optional[int] = typer.Option(None, "--total-trials",
                                                    help="Run until the study holds this many trials in total"),
         base: Optional[Path] = typer.Option(None, help="Base run config YAML the space modifies (default: the "
                                              "space's base:, else the defaults)"),
         set_: list[str] = typer.Option([], "--set", help="Override a base config key"),
         storage: Optional[str] = typer.Option(None, help="Optuna storage URL (default: SQLite in the home)"),
         study: Optional[str] = typer.Option(None, help="Study name (same name on every worker)"),
         timeout: Optional[float] = typer.Option(None, help="Stop starting trials after this many seconds"),
         jobs: int = typer.Option(1, help="Worker processes on this machine"),
         sampler: str = typer.Option("tpe", help="tpe | cmaes | random | grid"),
         seed: Optional[int] = typer.Option(None, help="Sampler seed (reproducible studies)"),
         pruner: str = typer.Option("median", help="median | hyperband | none"),
         objective: str = typer.Option("throughput", help="throughput | throughput+val_loss"),
         warmup: int = typer.Option(1, help="Steps skipped before measuring"),
         memory_limit_gb: Optional[float] = typer.Option(None, help="Per-rank memory limit (estimated)"),
         trial_timeout: float = typer.Option(600.0, help="A trial running longer fails as 'timeout'"),
         remeasure: int = typer.Option(0, help="Re-run the best K configs before naming the winner"),
         live: bool = typer.Option(False, help="Tune live knobs inside one run, a segment per trial"),
         segment_steps: int = typer.Option(5, help="Steps per live segment"),
         simulate_warm_start: int = typer.Option(0, "--warm-start", help="Enqueue the simulator's top K configs"),
         as_json: bool = typer.Option(False, "--json", help="Print one JSON object at the end"),
         launcher: Optional[str] = typer.Option(None, help="local | slurm: how trials start (a Slurm job each, "
                                                "sized by the config's cluster: section); kept in the study so "
                                                "every worker agrees; default: the study's, else local"),
         workers: int = typer.Option(0, help="With --launcher slurm: submit K tuner worker jobs sharing the "
                                     "study (use a PostgreSQL --storage); 0 runs the trials from here"),
         dry_run: bool = typer.Option(False, "--dry-run", help="With --launcher slurm: print the first trial's "
                                      "batch script and srun line, submit nothing")) -> None:
    """Search the engine's knobs with real runs (Optuna)."""
    from tuning.objective import Objective
    from tuning.space import SearchSpace
    from tuning.study import SAMPLERS, check_study_name, enqueue_grid, load_study, remeasure_best, summarize

    if sampler not in SAMPLERS:
        fail(f"--sampler={sampler!r}: must be one of {', '.join(SAMPLERS)}")
    _check_tune_numbers(trials=trials, total_trials=total_trials, jobs=jobs, timeout=timeout, warmup=warmup,
                        memory_limit_gb=memory_limit_gb, trial_timeout=trial_timeout, remeasure=remeasure,
                        segment_steps=segment_steps, warm_start=simulate_warm_start)
    _check_slurm_flags(launcher, workers, dry_run, live=live, jobs=jobs)
    name = study or f"study-{space.stem}"
    try:
        check_study_name(name, "--study" if study else f"--study (not given: from {space.name})")
        sp = SearchSpace.from_yaml(space)
        base = base or (Path(sp.base) if sp.base else None)  # --base wins over the space's base:
        cfg = _base_config(base, set_)
        for note in sp.narrow_layouts(cfg):
            console.print(note, highlight=False, soft_wrap=True)
        sp.check_against(cfg)
    except ConfigError as exc:
        first = getattr(exc, "breaks", None)
        fail(str(exc) + (f" (that value comes from {_origin(first.field, base, set_, sp)})" if first else ""))
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # "A new study created ..." is not news
    if dry_run:  # before any study exists: nothing is written or submitted
        from workbench.cli_slurm import tune_dry_run

        tune_dry_run(cfg, sp, objective=objective, warmup=warmup, sampler=sampler, seed=seed, workers=workers,
                     trials=trials or total_trials or 10, argv=sys.argv[1:])
        return
    st = _storage_call(load_study, name, storage, sampler=sampler, seed=seed, objective=objective, pruner=pruner,
                       warmup_steps=warmup)
    launcher = _study_launcher(st, launcher)
    draws = None
    trials = _trials_to_run(st, trials, total_trials, as_json)
    st.set_user_attr("space", sp.raw)
    if sampler == "grid":
        enqueue_grid(st, sp)
    if simulate_warm_start:
        from tuning.warmstart import enqueue_simulated

        try:
            enqueue_simulated(st, sp, cfg, top=simulate_warm_start)
        except ConfigError as exc:
            fail(str(exc))
    if workers:  # the trials run in K worker jobs; this command submits them and waits
        from workbench.cli_slurm import submit_workers, wait_for_workers

        ids = submit_workers(cfg, sys.argv[1:], workers=workers, trials=trials, seed=seed, storage=storage,
                             quiet=as_json)
        wait_for_workers(ids, as_json)
    elif live:
        from tuning.live import LiveTuner

        try:
            result = LiveTuner(st, sp, cfg, segments=trials, segment_steps=segment_steps,
                               objective=objective).run()
        except ConfigError as exc:
            fail(str(exc))
        console.print(f"live run {result.run_id}: {result.status}") if not as_json else None
    else:
        from tuning.warmstart import local_profile

        obj = Objective(cfg, sp, objective=objective, warmup_steps=warmup, memory_limit_gb=memory_limit_gb,
                        trial_timeout_s=trial_timeout, cluster=local_profile(sp.world_size or cfg.world_size),
                        launcher=launcher)
        if launcher == "slurm":  # a cancelled worker job (SIGTERM) cancels its trial's job on the way out
            stop_on_sigterm()
        children = _spawn_jobs(sys.argv, trials, jobs)
        mine = trials // jobs + (1 if trials % jobs else 0)
        draws = _run_with_display(st, obj, mine, timeout, space, as_json)
        for child in children:
            child.wait()
        if remeasure:
            remeasure_best(st, obj, remeasure)
    summary = summarize(st, storage or "default sqlite")
    trend = _prediction_trend(st)
    if as_json:
        print_json({**summary.to_dict(), **trend})
    else:
        _print_study_table(st, summary, storage)
        _print_prediction_trend(trend)
        if draws is not None:
            _print_draws(draws, mine)
    if not summary.counts.get("COMPLETE"):
        fail(f"study={st.study_name!r}: no trial completed ({_counts(summary.counts)}); each trial's reason "
             f"is in the study table (workbench tune ... without --json) and on the dashboard", code=1)


def _check_slurm_flags(launcher: Optional[str], workers: int, dry_run: bool, *, live: bool, jobs: int) -> None:
    """--launcher, --workers and --dry-run: in range and in agreement, before a study or a job exists."""
    check_launcher(launcher or "local", dry_run)
    check_number("--workers", workers, 0)
    if workers and launcher != "slurm":
        fail(f"--workers={workers}: submits tuner jobs to Slurm; add --launcher slurm (on this machine: --jobs)")
    if launcher == "slurm" and (live or jobs > 1):
        fail("--launcher slurm: " + ("--live tunes one local run" if live else
                                     f"--jobs={jobs} starts local workers; use --workers {jobs}"))


def _study_launcher(st, asked: Optional[str]) -> str:
    from tuning.study import study_launcher

    try:
        launcher = study_launcher(st, asked)
    except ValueError as exc:
        fail(str(exc))
    if launcher == "slurm":  # a worker following the study's launcher: before its first trial
        check_sbatch()
    return launcher
def _prediction_trend(st) -> dict[str, Any]:
    """Simulator vs measured per trial and the error trend, for studies that recorded predictions."""
    from tuning.warmstart import prediction_trend, trend_summary

    trend = prediction_trend(st)
    if trend.empty:
        return {}
    return {"prediction_trend": json.loads(trend.to_json(orient="records")), "prediction_summary": trend_summary(trend)}


def _print_prediction_trend(trend: dict[str, Any]) -> None:
    if not trend:
        return
    t = Table(title="simulator vs measured step time (corrected with the trials finished before each)")
    for col in ("trial", "class, compressor", "measured s", "predicted s", "corrected s", "error", "corrected error",
                "factor (level)"):
        t.add_column(col, justify="right")
    for r in trend["prediction_trend"]:
        secs = [("-" if r[k] is None else f"{r[k]:.4f}") for k in ("measured_step_s", "predicted_step_s", "corrected_step_s")]
        cls = f"{r['strategy_class']} {r.get('compressor') or ''}".strip()
        t.add_row(str(r["trial"]), cls, *secs, f"{r['error_pct']:+.1f}%", f"{r['corrected_error_pct']:+.1f}%",
                  f"{r['correction_factor']:.3f} ({r.get('correction_level') or '-'})")
    console.print(t)
    s = trend["prediction_summary"]
    console.print(f"median |corrected error|: trials {s['first_trials']} {s['first_median_abs_error_pct']:.1f}%, "
                  f"trials {s['last_trials']} {s['last_median_abs_error_pct']:.1f}% (raw, all trials: "
                  f"{s['raw_median_abs_error_pct']:.1f}%)")


def _check_tune_numbers(**flags: Optional[float]) -> None:
    """Every numeric option of `tune` in range, before a study or a process starts."""
    minimum = {"trials": 1, "total_trials": 1, "jobs": 1, "warmup": 0, "remeasure": 0, "segment_steps": 1,
               "warm_start": 0}
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if name in minimum:
            check_number(flag, value, minimum[name])
        else:  # timeout, trial_timeout, memory_limit_gb: seconds or GB, > 0
            check_number(flag, value, 0, exclusive=True)
    if flags["trials"] is not None and flags["total_trials"] is not None:
        fail(f"--trials={flags['trials']} and --total-trials={flags['total_trials']}: give one of them")


def _trials_to_run(st, trials: Optional[int], total_trials: Optional[int], quiet: bool) -> int:
    """This command's trial count; says which rule applies when the study already has trials."""
    from tuning.objective import SKIPPED_ATTR

    existing = sum(not t.user_attrs.get(SKIPPED_ATTR) for t in st.get_trials(deepcopy=False))  # trials that ran
    quiet = quiet or os.environ.get("WORKBENCH_TUNE_JOB") == "1"  # a --jobs child: its parent said it
    say = (lambda _: None) if quiet else (lambda text: err.print(text, highlight=False, markup=False, soft_wrap=True))
    if total_trials is not None:
        n = max(0, total_trials - existing)
        say(f"study {st.study_name} has {existing} trials; --total-trials {total_trials}: running {n} more")
        return n
    n = 10 if trials is None else trials
    if existing:
        say(f"study {st.study_name} has {existing} trials; --trials {n} adds {n} more ({existing + n} in total; "
            f"--total-trials N stops at N in total)")
    return n


def _storage_call(fn, *args, **kwargs):
    """Call `fn`; a storage URL that cannot be used ends the command with its one-line reason (exit 2)."""
    from tuning.study import StorageError

    try:
        return fn(*args, **kwargs)
    except StorageError as exc:
        fail(str(exc))


def _spawn_jobs(argv: list[str], trials: int, jobs: int) -> list[subprocess.Popen]:
    """Extra workers on this machine: the same command with --jobs 1 and their share of trials."""
    if jobs == 1:
        return []
    shares = [trials // jobs + (1 if i < trials % jobs else 0) for i in range(jobs)][1:]
    args = list(argv[1:])
    for flag in ("--jobs", "--trials", "--total-trials"):
        while flag in args:
            i = args.index(flag)
            del args[i:i + 2]
    return [subprocess.Popen([sys.executable, "-m", "workbench.cli", *args, "--jobs", "1", "--trials", str(n)],
                             stdout=subprocess.DEVNULL, env={**os.environ, "WORKBENCH_TUNE_JOB": "1"})
            for n in shares if n > 0]


def _print_draws(draws, asked: int) -> None:
    """This worker's trials and the draws it skipped without running them."""
    from tuning.study import MAX_SKIPS_IN_A_ROW

    console.print(f"ran {draws.ran} trials; skipped {draws.invalid} invalid draws and {draws.repeats} repeats of "
                  "an earlier trial's config (not run, not counted in --trials)", highlight=False)
    if draws.gave_up:
        console.print(f"[yellow]stopped after {draws.ran} of {asked} trials:[/] {MAX_SKIPS_IN_A_ROW} draws in a row "
                      "were invalid or repeats; the space holds few valid configs not yet run", highlight=False)


def _run_with_display(st, obj, n: int, timeout: Optional[float], space: Path, quiet: bool):
    from rich.live import Live

    from tuning.study import run_trials

    state: dict[str, Any] = {"done": 0, "current": "-", "best": None, "PRUNED": 0, "FAIL": 0}

    def render() -> Table:
        t = Table(title=f"study {st.study_name}")
        for col in ("trial", "current trial", "best tokens/s", "pruned", "failed"):
            t.add_column(col, min_width=len(col), overflow="fold")  # a long trial wraps; headers stay whole
        best = "-" if state["best"] is None else f"{state['best']:,.0f}"
        t.add_row(f"{state['done']}/{n}", str(state["current"]), best, str(state["PRUNED"]), str(state["FAIL"]))
        return t

    def on_event(kind: str, data: dict[str, Any]) -> None:
        if kind == "trial_skipped":
            state["skipped"] = state.get("skipped", 0) + 1
        elif kind == "trial_start":
            state["current"] = f"#{data['number']} " + ", ".join(f"{k}={v}" for k, v in data["params"].items())
        else:
            state["done"] += 1
            if data["state"] in ("PRUNED", "FAIL"):
                state[data["state"]] += 1
            elif data["values"]:
                state["best"] = max(state["best"] or 0, data["values"][0])
            state["current"] = f"#{data['number']} {data['state']}" + (f" ({data['reason']})" if data["reason"] else "")
        if live is not None:
            live.update(render())

    live = None if quiet else Live(render(), console=console, refresh_per_second=4)
    reload = _space_watcher(space, obj)

    def before() -> None:
        _wait_while_paused(st)
        reload()

    if live is None:
        return run_trials(st, obj, n, timeout_s=timeout, on_event=on_event, before_trial=before)
    with live:
        draws = run_trials(st, obj, n, timeout_s=timeout, on_event=on_event, before_trial=before)
    if not console.is_terminal:  # piped, Live leaves its last frame without a line end
        console.line()
    return draws


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {state.lower()}" for state, n in counts.items()) or "no trials"


def export_command(study: str, storage: Optional[str]) -> str:
    """The export command for a study: with its --storage when not the default (password hidden)."""
    import shlex

    if not storage:
        return f"workbench export {shlex.quote(study)}"
    from tuning.study import _shown

    return f"workbench export {shlex.quote(study)} --storage {shlex.quote(_shown(storage))}"


def _print_study_table(st, summary, storage: Optional[str] = None) -> None:
    from tuning.objective import SKIPPED_ATTR
    from workbench.fmt import nums

    skipped = f"; {summary.skipped} draws skipped unrun" if summary.skipped else ""
    t = Table(title=f"study {st.study_name}: {_counts(summary.counts)}{skipped}")
    for col in ("trial", "state", "tokens/s" if len(st.directions) == 1 else "values", "params", "reason"):
        t.add_column(col, min_width=len(col), overflow="fold")
    for tr in st.get_trials(deepcopy=False):
        if tr.user_attrs.get(SKIPPED_ATTR):
            continue
        params = ", ".join(f"{k}={v}" for k, v in tr.params.items())
        t.add_row(str(tr.number), tr.state.name, nums(tr.values), params, str(tr.user_attrs.get("reason", "")))
    console.print(t)
    if summary.best_trial is not None:
        from workbench.fmt import num

        console.print(f"best: trial {summary.best_trial} = {num(summary.best_value)} tokens/s; "
                      f"export with `{export_command(st.study_name, storage)}`", highlight=False)


def studies(storage: Optional[str] = typer.Option(None, help="Optuna storage URL"),
            as_json: bool = typer.Option(False, "--json")) -> None:
    """List the studies in a storage."""
    from tuning.study import list_studies
    from workbench.fmt import nums

    rows = _storage_call(list_studies, storage)
    if as_json:
        print_json(rows)
        return
    if not rows:
        console.print("No studies yet: try `workbench tune examples/space.yaml --base examples/tiny.yaml --trials 4`.")
        return
    t = Table(title="studies")
    for col in ("study", "trials", "complete", "pruned", "failed", "best"):
        t.add_column(col, min_width=len(col), justify="left" if col == "study" else "right")
    for r in rows:
        s = r["states"]
        t.add_row(r["name"], str(r["n_trials"]), str(s["COMPLETE"]), str(s["PRUNED"]), str(s["FAIL"]),
                  nums(r["best_values"]))
    console.print(t)


def _write_bundle(fmt: str, cfg, output: Path, trial: Optional[int]) -> None:
    """torchrun: a folder (config.yaml, launch.sh, README.md); accelerate: the config file and its training
    script beside it. Prints what was written and the line that runs it."""
    from tuning.export.trial import write_torchrun_bundle
    from tuning.export.frameworks import write_accelerate_bundle

    if fmt == "torchrun":
        folder = output / f"trial-{trial}" if trial is not None else output
        command = write_torchrun_bundle(cfg, folder)
        console.print(f"wrote {folder}/config.yaml, launch.sh, README.md; run:", highlight=False)
    else:
        path = output.with_name(f"{output.stem}-trial-{trial}{output.suffix}") if trial is not None else output
        command = write_accelerate_bundle(cfg, path)
        console.print(f"wrote {path} and its training script {path.stem}_train.py; run from {path.parent}:",
                      highlight=False)
    sys.stdout.write(command + "\n")


def export(study: str = typer.Argument(..., help="Study name"),
           fmt: str = typer.Option("yaml", "--format", help="yaml | torchrun | json | megatron | deepspeed | torchtitan | accelerate"),
           trial: Optional[int] = typer.Option(None, help="Trial number (default: the best)"),
           pareto: bool = typer.Option(False, help="Every trial of the Pareto front"),
           storage: Optional[str] = typer.Option(None, help="Optuna storage URL"),
           output: Optional[Path] = typer.Option(None, "-o", "--output",
                                                 help="Write here instead of stdout (torchrun: a folder with "
                                                      "config.yaml, launch.sh and README.md; accelerate: the "
                                                      "config and its training script beside it)")) -> None:
    """Export a study's best config (or a chosen trial, or the Pareto front). Knobs that do not map to the
    target are listed on stderr, beside the export."""
    import optuna

    from tuning.export.trial import FORMATS, export_notes, export_trial, trial_config
    from tuning.study import make_storage

    if fmt not in FORMATS:
        fail(f"--format={fmt!r}: must be one of {', '.join(FORMATS)}")
    try:
        st = optuna.load_study(study_name=study, storage=_storage_call(make_storage, storage))
    except KeyError:
        fail(f"study={study!r}: no such study; see `workbench studies`")
    try:
        numbers = [t.number for t in st.best_trials] if pareto else [trial]
        if fmt in ("torchrun", "accelerate") and output is not None:
            for n in numbers:
                _write_bundle(fmt, trial_config(st, n), output, n if pareto else None)
            for note in sorted({note for n in numbers for note in export_notes(st, n, fmt)}):
                typer.echo(f"not mapped: {note}", err=True)
            _say_stand_in(st, numbers)
            return
        bodies = {n: export_trial(st, n, fmt) for n in numbers}
        notes = sorted({note for n in numbers for note in export_notes(st, n, fmt)})
    except ValueError as exc:
        fail(str(exc))
    text = "".join(f"# trial {n}\n{body}\n" for n, body in bodies.items()) if pareto else bodies[trial]
    if output:
        output.write_text(text)
        console.print(f"wrote {output}")
    else:
        sys.stdout.write(text)
    for note in notes if fmt != "megatron" else []:  # megatron's are comments in the script already
        typer.echo(f"not mapped: {note}", err=True)
    _say_stand_in(st, numbers)


def _say_stand_in(st, numbers: list[Optional[int]]) -> None:
    """One line on stderr when the exported trial ran a stand-in of the real job (tuning/plan.py)."""
    from tuning.export.trial import trial_config
    from tuning.plan import stand_in_line

    line = stand_in_line(trial_config(st, numbers[0]), st.study_name)
    if line:
        typer.echo(line, err=True)
