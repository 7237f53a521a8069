"""The `workbench` command line: run, runs, show, commbench, tune, studies, export, simulate, calibrate, dryrun, app.

User errors (bad config, unknown run) exit non-zero with the message and no traceback; a failing
rank's traceback is shown with its rank, since that is the user's own error to read.
"""
from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from engine.errors import ConfigError, JoinTimeout, RankFailure
from engine.quick_exit import exit_code, quick_exit
from workbench.cli_common import check_launcher, check_number, console, err, fail, print_json, stop_on_sigterm

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Profile and tune distributed deep-learning training.")

HOME_HELP = "Workbench home (run store, studies); default $WORKBENCH_HOME or ./.workbench"


RUNS_HELP = ("Shared run store: a postgresql:// URL that launchers on several nodes and the dashboard use "
             "(default $WORKBENCH_RUNS, else runs.db under the home)")


@app.callback()
def _main(home: Optional[Path] = typer.Option(None, "--home", help=HOME_HELP),
          runs: Optional[str] = typer.Option(None, "--runs", help=RUNS_HELP)) -> None:
    if home is not None:
        if home.exists() and not home.is_dir():
            fail(f"--home={home}: is a file; the workbench home is a folder (it is made when missing)")
        os.environ["WORKBENCH_HOME"] = str(home)
    if runs is not None:
        from profilers.store import RUNS_ENV
        from profilers.store_sql import is_url

        if not is_url(runs):
            fail(f"--runs={runs!r}: must be a postgresql:// URL (e.g. postgresql://USER@HOST:5432/DB); "
                 "the SQLite run store is runs.db under --home")
        os.environ[RUNS_ENV] = runs  # the ranks, tuner workers and the dashboard inherit it


def _load(config: Optional[Path], overrides: list[str]):
    from engine.config.schema import load_config

    return load_config(config, overrides)


# ------------------------------------------------------------------ run
@app.command()
def run(config: Optional[Path] = typer.Argument(None, help="YAML run config (defaults when omitted)"),
        set_: list[str] = typer.Option([], "--set", help="Override a key, e.g. --set batch.micro=4"),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object at the end"),
        nnodes: int = typer.Option(1, help="Nodes (multi-node: run the same command on each)"),
        node_rank: int = typer.Option(0, help="This node's rank"),
        rdzv_endpoint: Optional[str] = typer.Option(None, help="host:port of the rendezvous (multi-node)"),
        rdzv_timeout: float = typer.Option(300.0, help="Multi-node: give up when not every node joined the "
                                           "rendezvous within this many seconds"),
        timeout: Optional[float] = typer.Option(None, help="Stop every rank after this many seconds"),
        launcher: str = typer.Option("local", help="local (torchrun on this machine) | slurm (one Slurm job "
                                     "of cluster.nodes nodes; see the config's cluster: section)"),
        dry_run: bool = typer.Option(False, "--dry-run", help="With --launcher slurm: print the batch script "
                                     "and srun line, submit nothing"),
        run_id: Optional[str] = typer.Option(None, "--run-id", help="The run's id; with --nnodes > 1 give every "
                                             "node the same one, so all ranks land in one run"),
        device_memory: Optional[float] = typer.Option(None, "--device-memory", help="GiB per rank's device: dry-run "
                                                      "first and refuse a config that would not fit (GPU runs: "
                                                      "the GPU's, else 80 GB-class)")) -> None:
    """Train one config on dp*tp*pp*cp ranks (experts over ep of them) and record its telemetry."""
    import signal

    from engine.launch.local import launch

    def on_term(signum, frame):  # a stop from the dashboard: end the ranks, mark the run interrupted
        raise KeyboardInterrupt

    check_number("--timeout", timeout, 0, exclusive=True)
    check_number("--rdzv-timeout", rdzv_timeout, 0, exclusive=True)
    if run_id is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", run_id):
        fail(f"--run-id={run_id!r}: must be 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit")
    check_number("--nnodes", nnodes, 1)
    check_number("--device-memory", device_memory, 0, exclusive=True)
    check_number("--node-rank", node_rank, 0, maximum=nnodes - 1)
    check_launcher(launcher, dry_run, multi_node=nnodes > 1 or rdzv_endpoint is not None)
    try:
        cfg = _load(config, set_)
        if launcher == "slurm":
            return _run_on_slurm(cfg, timeout, dry_run, as_json, run_id)
        if cfg.world_size % nnodes:
            from engine.mesh import world_product

            fail(f"--nnodes={nnodes}: must divide the world size {world_product(cfg.parallel.cp)} = {cfg.world_size}")
        from engine.train.memory import check_fits, device_memory_target

        if device_memory_target(cfg, device_memory) is None:  # a device target: launch()'s dry run judges it
            check_fits(cfg, nnodes)
    except ConfigError as exc:
        fail(str(exc))
    signal.signal(signal.SIGTERM, on_term)
    result = None
    try:
        if as_json:
            result = launch(cfg, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, timeout_s=timeout,
                            run_id=run_id, rdzv_timeout_s=rdzv_timeout, device_memory_gib=device_memory)
        else:
            result = _run_with_progress(cfg, nnodes, node_rank, rdzv_endpoint, timeout, run_id=run_id,
                                        rdzv_timeout=rdzv_timeout, device_memory_gib=device_memory)
    except JoinTimeout as exc:  # no rank ran: a setup error, like a bad flag
        fail(str(exc))
    except ConfigError as exc:  # the pre-flight dry run: the config would not fit the device
        fail(str(exc))
    except RankFailure as exc:
        fail(str(exc), code=1)
    except KeyboardInterrupt:
        fail("interrupted: every rank was stopped and the run is marked interrupted in the store", code=130)
    if as_json:
        print_json(_run_json(result))
    else:
        _print_summary(result)


def _run_on_slurm(cfg, timeout: Optional[float], dry_run: bool, as_json: bool, run_id: Optional[str] = None) -> None:
    """`run --launcher slurm`: print the job (--dry-run) or submit it and follow it to its end, as run `run_id`
    (default: the config's name and a random suffix)."""
    from engine.launch.slurm import SlurmError, dry_run as slurm_dry_run

    if dry_run:
        sys.stdout.write(slurm_dry_run(cfg, run_id=run_id))
        return
    stop_on_sigterm()
    try:
        result = _run_with_progress(cfg, 1, 0, None, timeout, launcher="slurm", run_id=run_id) if not as_json else \
            _launch_slurm_quietly(cfg, timeout, run_id)
    except RankFailure as exc:
        fail(str(exc), code=1)
    except SlurmError as exc:
        fail(str(exc), code=1)
    except KeyboardInterrupt:
        fail("interrupted: the run's Slurm job was cancelled and the run is marked interrupted", code=130)
    print_json(_run_json(result)) if as_json else _print_summary(result)


def _launch_slurm_quietly(cfg, timeout: Optional[float], run_id: Optional[str] = None):
    from engine.launch.local import launch

    return launch(cfg, timeout_s=timeout, launcher="slurm", run_id=run_id)


def _run_with_progress(cfg, nnodes: int, node_rank: int, rdzv: Optional[str], timeout: Optional[float],
                       launcher: str = "local", run_id: Optional[str] = None, rdzv_timeout: float = 300.0,
                       device_memory_gib: Optional[float] = None):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from engine.launch.local import launch

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console) as progress:
        waiting = (f"node {node_rank} of {nnodes}: waiting for every node at the rendezvous {rdzv} (gives up "
                   f"after {rdzv_timeout:.0f} s)") if nnodes > 1 else "starting ranks"
        task = progress.add_task(f"{cfg.name} x{cfg.world_size}", total=cfg.train.steps, info=waiting)

        def on_progress(step: dict) -> None:
            info = f"loss {step.get('loss', float('nan')):.4f}  {step.get('tokens_per_s', 0):,.0f} tok/s"
            progress.update(task, completed=step["step"] + 1, info=info)

        def on_job(state) -> None:  # --launcher slurm: the job's phase until the first step lands
            progress.update(task, info=f"Slurm job {state.job_id} {state.state.lower()}")

        if launcher == "slurm":
            return launch(cfg, timeout_s=timeout, on_progress=on_progress, launcher="slurm", on_job=on_job,
                          run_id=run_id)
        return launch(cfg, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv, timeout_s=timeout,
                      on_progress=on_progress, run_id=run_id, rdzv_timeout_s=rdzv_timeout,
                      device_memory_gib=device_memory_gib)


def _run_json(result) -> dict[str, Any]:
    from workbench.report import trace_dir

    s = result.summary
    return {"run_id": result.run_id, "status": result.status, "world_size": result.world_size,
            "final_loss": result.final_loss, "val_loss": s.get("val_loss"),
            "tokens_per_s": s.get("tokens_per_s"), "mfu": s.get("mfu"),
            "wire_bytes": s.get("wire_bytes", 0.0), "dense_bytes": s.get("dense_bytes", 0.0),
            "wall_s": result.wall_s, "traces": s.get("traces", []), "trace_dir": trace_dir(s),
            "steps": [{"step": st["step"], "loss": st.get("loss"), "step_time_s": st.get("step_time_s"),
                       "tokens_per_s": st.get("tokens_per_s")} for st in result.steps]}


def _print_summary(result) -> None:
    from workbench.fmt import num, pct, ratio

    s = result.summary
    t = Table(title=f"run {result.run_id}: {result.status}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [("world size", num(result.world_size)), ("steps", num(s.get("steps"))),
            ("final loss", num(result.final_loss)), ("val loss", num(s.get("val_loss"))),
            ("tokens/s (median, steady)", num(s.get("tokens_per_s"))), ("step time (s)", num(s.get("step_time_s"))),
            ("MFU", pct(s.get("mfu"))), ("wire / dense bytes (ratio)", ratio(s.get("ratio"))),
            ("wall time (s)", num(result.wall_s))]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    console.print(f"details: workbench show {result.run_id}")


# ------------------------------------------------------------------ runs / show
@app.command()
def runs(limit: int = typer.Option(20, help="How many runs, newest first"),
         as_json: bool = typer.Option(False, "--json")) -> None:
    """List recorded runs."""
    from profilers.store import RunStore

    check_number("--limit", limit, 1)
    rows = RunStore.open_home().runs(limit=limit)
    if as_json:
        print_json([{k: r.get(k) for k in ("run_id", "name", "status", "world_size", "layout", "created",
                                             "ended", "error", "summary")} for r in rows])
        return
    if not rows:
        console.print("No runs yet: try `workbench run examples/tiny.yaml`.")
        return
    from workbench.fmt import layout, num

    t = Table(title="runs")
    t.add_column("run", no_wrap=True, min_width=max(len(r["run_id"]) for r in rows))  # ids are never cut
    for col in ("status", "ranks", "layout", "final loss", "tokens/s"):
        t.add_column(col)
    for r in rows:
        summ = r.get("summary") or {}
        lay = r.get("layout") or {}
        t.add_row(r["run_id"], r["status"], str(r["world_size"]),
                  layout(lay, r.get("config")),
                  num(summ.get("final_loss")), num(summ.get("tokens_per_s")))
    console.print(t)


@app.command()
def show(run_id: str = typer.Argument(..., help="Run id (see `workbench runs`)"),
         as_json: bool = typer.Option(False, "--json"),
         wide: bool = typer.Option(False, "--wide", help="Every column, however wide the terminal")) -> None:
    """A run's summary, per-step breakdown per rank, collectives and memory."""
    from workbench.report import run_report

    report = run_report(run_id)
    if report is None:
        fail(f"run_id={run_id!r}: no such run in the store; see `workbench runs`")
    if as_json:
        print_json(report)
        return
    from workbench.report import print_report

    print_report(report, console, wide=wide)


# ------------------------------------------------------------------ commbench
@app.command()
def commbench(world: int = typer.Option(2, help="Ranks"),
              max_mb: float = typer.Option(256.0, help="Largest message in MB"),
              ops: str = typer.Option("all_reduce,all_gather,reduce_scatter,broadcast,all_to_all,sendrecv",
                                      help="Comma-separated collectives"),
              iters: int = typer.Option(5, help="Timed iterations per size"),
              as_json: bool = typer.Option(False, "--json")) -> None:
    """Sweep collective sizes from 1 KB and print bus bandwidth like nccl-tests."""
    from profilers.commbench import SWEEP_OPS, format_busbw_table, spawn_commbench, sweep_sizes

    if world < 2:
        fail(f"--world={world}: needs at least 2 ranks")
    if not (math.isfinite(max_mb) and max_mb * 2**20 >= 1024):
        fail(f"--max-mb={max_mb}: must be >= 1/1024 (1 KB, the sweep's smallest message)")
    check_number("--iters", iters, 1)
    unknown = [op for op in ops.split(",") if op not in SWEEP_OPS]
    if unknown:
        fail(f"--ops={ops!r}: unknown {', '.join(unknown)}; choose from {', '.join(SWEEP_OPS)}")
    _check_commbench_memory(world, max_mb)
    rows = spawn_commbench(world, ops.split(","), sweep_sizes(max_bytes=int(max_mb * 2**20)), iters)
    if as_json:
        print_json(rows)
    else:
        console.print(format_busbw_table(rows), highlight=False, markup=False)


def _check_commbench_memory(world: int, max_mb: float) -> None:
    """The largest message's buffers must fit in this machine's available memory: each rank holds
    its input and, for all_gather, `world` outputs of that size."""
    import psutil

    need = world * (world + 1) * max_mb * 2**20
    have = psutil.virtual_memory().available
    if need > 0.8 * have:
        fail(f"--max-mb={max_mb:.10g}: the sweep's largest message needs about {need / 2**30:,.1f} GiB on this machine "
             f"({world} ranks x {world + 1} buffers of {max_mb:.10g} MB) and {have / 2**30:,.1f} GiB is available; "
             "lower --max-mb")


# ------------------------------------------------------------------ app
@app.command("app")
def app_cmd(host: str = typer.Option("127.0.0.1", help="Listen address (127.0.0.1 unless you mean it)"),
            port: int = typer.Option(8501)) -> None:
    """Start the Streamlit dashboard."""
    import socket
    import subprocess

    check_number("--port", port, 1, maximum=65535)
    with socket.socket() as probe:  # before printing the URL: streamlit would only say so after it
        try:
            probe.bind((host, port))
        except OSError as exc:
            fail(f"--port={port}: {host}:{port} cannot be used ({exc.strerror}; another dashboard?); choose "
                 f"another with --port {port + 1} (make app PORT={port + 1})")
    console.print(f"dashboard on http://{host}:{port}")
    raise typer.Exit(subprocess.call(app_command(host, port)))


def app_command(host: str, port: int) -> list[str]:
    """The streamlit command of `workbench app`: a local tool, so no "Deploy" button, and no file
    watcher (it watches app.py's folder recursively, the workbench home included: see .streamlit/config.toml)."""
    entry = Path(__file__).resolve().parent.parent / "app.py"
    return [sys.executable, "-m", "streamlit", "run", str(entry), "--server.address", host,
            "--server.port", str(port), "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--client.toolbarMode", "minimal", "--server.fileWatcherType", "none"]


@app.command()
def tokenize(src: Path = typer.Argument(..., help="A jsonl / json / parquet / arrow / txt file or folder"),
             tokenizer: Path = typer.Option(..., help="tokenizer.json or a tokenizer folder"),
             output: Path = typer.Option(..., "-o", "--output", help="The token file to write"),
             text_field: str = typer.Option("text", help="The record field holding the text"),
             eos_id: int = typer.Option(-1, help="Id written after each document; -1: none")) -> None:
    """Write a token file (nanoGPT layout) that `data.source=tokens` reads."""
    from engine.config.schema import from_dict
    from engine.data.sources import write_token_file
    from engine.config.validate import check
    from engine.config.validate_files import tokenizer_vocab

    probe = from_dict({"data": {"source": "hf", "path": str(src), "tokenizer": str(tokenizer),
                                "text_field": text_field}, "model": {"vocab": 1 << 32}})
    flags = {"data.path": "SRC", "data.tokenizer": "--tokenizer", "data.text_field": "--text-field"}
    for error in check(probe):  # the same one-line refusals as a run's (missing file, field, format, ...)
        fail(str(error).replace(error.field, flags.get(error.field, error.field), 1))
    vocab = tokenizer_vocab(tokenizer)
    if eos_id < -1 or (vocab is not None and eos_id >= vocab):
        fail(f"--eos-id={eos_id}: must be a token id of the tokenizer (0..{(vocab or 1) - 1}) or -1 (none)")
    n, dtype = write_token_file(str(src), str(tokenizer), str(output), text_field=text_field, eos_id=eos_id)
    console.print(f"wrote {n} tokens ({dtype}) to {output}; run with data.source=tokens data.path={output} "
                  f"data.dtype={dtype}" + (f" data.eos_id={eos_id}" if eos_id >= 0 else ""), highlight=False,
                  soft_wrap=True)


def _register() -> None:
    from workbench import cli_dryrun, cli_plan, cli_sim, cli_tune

    app.command()(cli_tune.tune)
    app.command()(cli_tune.studies)
    app.command()(cli_tune.export)
    app.command()(cli_plan.plan)
    app.command()(cli_sim.simulate)
    app.command()(cli_sim.calibrate)
    app.command()(cli_dryrun.dryrun)


def run_command() -> int:
    """The command in sys.argv, run: its exit status (a ConfigError or StoreError a line on stderr, 2)."""
    import signal

    # Ctrl-C (SIGINT) stops a command even where it was started with SIGINT ignored (a shell's background job)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _register()
    import errno

    from profilers.store import StoreError

    try:
        app()
    except SystemExit as done:  # every command ends here (click's standalone mode)
        return exit_code(done.code)
    except ConfigError as exc:
        err.print(f"error: {exc}", highlight=False, markup=False, soft_wrap=True)
        return 2
    except StoreError as exc:  # full disk, read-only home, a store from a newer workbench; a bad --runs URL
        err.print(f"error: {' '.join(str(exc).split())}", highlight=False, markup=False, soft_wrap=True)
        return 2 if exc.unreachable else 1
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT):
            raise
        err.print(f"error: {exc.filename or ''}: {exc.strerror}; check that the folder exists and is writable, "
                  "or choose another --home / WORKBENCH_HOME", highlight=False, markup=False)
        return 1
    return 0


def main() -> None:
    """The `workbench` command: its work, then an exit that skips the interpreter's teardown (quick_exit)."""
    quick_exit(run_command())


if __name__ == "__main__":
    main()
