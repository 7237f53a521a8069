"""What every `workbench` command shares: the consoles, the one-line refusal (`fail`), option checks
and JSON output. The commands (workbench/cli.py and its cli_* modules) import it; it imports none of them."""
from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

console = Console()
err = Console(stderr=True)


def fail(message: str, code: int = 2) -> None:
    # one line however narrow the terminal (soft_wrap: rich inserts no newlines); the message is not markup
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, markup=True, soft_wrap=True)
    raise typer.Exit(code)


def check_number(flag: str, value: float | None, minimum: float, *, exclusive: bool = False,
                 maximum: float | None = None) -> None:
    """Exit 2 with `--flag=value: must be >= minimum` when a numeric option is out of range
    (None passes: the option was left unset)."""
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        fail(f"{flag}={value}: must be a finite number")
    if value < minimum or (exclusive and value == minimum):
        fail(f"{flag}={value}: must be {'>' if exclusive else '>='} {minimum:g}")
    if maximum is not None and value > maximum:
        fail(f"{flag}={value}: must be <= {maximum:g}")


def check_writable_folder(flag: str, folder: Path | None) -> None:
    """Exit 2 with `flag=folder: why; ...` when `folder` cannot be made or written, before any work
    (None passes: no folder was asked for)."""
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        fail(f"{flag}={str(folder)!r}: {exc.strerror or exc}; must be a folder you can write: choose another {flag}")


def print_json(obj: Any) -> None:
    """`obj` as indented JSON on stdout (values JSON lacks as their str)."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def check_launcher(launcher: str, dry_run: bool, *, multi_node: bool = False) -> None:
    """--launcher is local or slurm; --dry-run and slurm go together; Slurm sizes its own nodes."""
    from engine.config.validate import LAUNCHERS

    if launcher not in LAUNCHERS:
        fail(f"--launcher={launcher!r}: must be one of {', '.join(LAUNCHERS)}")
    if dry_run and launcher != "slurm":
        fail("--dry-run: shows a Slurm job; add --launcher slurm")
    if multi_node and launcher == "slurm":
        fail("--nnodes/--rdzv-endpoint: Slurm starts every node itself; set cluster.nodes (--set cluster.nodes=2)")
    if launcher == "slurm" and not dry_run:
        check_sbatch()


def check_sbatch() -> None:
    """One line, before any run or study is registered, when Slurm's sbatch is missing."""
    from engine.launch.slurm import SlurmError, require_sbatch

    try:
        require_sbatch()
    except SlurmError as exc:
        fail(str(exc))


def stop_on_sigterm() -> None:
    """SIGTERM (a dashboard's stop, scancel of an enclosing job) unwinds like Ctrl-C: jobs are cancelled."""
    import signal

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
