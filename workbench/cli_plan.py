"""`workbench plan`: the layouts of the real model on the real cluster, ranked by the simulator for a target
framework, and the export of any of them (tuning/plan.py)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from workbench.cli import _print_json, check_number, console, err, fail

EXPORT_FILES = {"yaml": "config.yaml", "megatron": "megatron.sh", "deepspeed": "deepspeed.json",
                "torchtitan": "torchtitan.toml", "accelerate": "accelerate.yaml"}


def _model_source(text: str):
    """The config.json a --model names (its path, for the export), else None (a preset or a GPT shape)."""
    p = Path(text)
    if text.endswith(".json") or p.is_dir():
        return str(p / "config.json" if p.is_dir() else p)
    return None


def _study(name: Optional[str], storage: Optional[str]):
    if name is None:
        return None
    import optuna

    from tuning.study import make_storage

    try:
        return optuna.load_study(study_name=name, storage=make_storage(storage))
    except KeyError:
        fail(f"--study={name!r}: no such study; see `workbench studies`")


def plan(model: str = typer.Option(..., help="A Hugging Face config.json (or its folder), a preset (22b, 175b, 1t) "
                                              "or layers=..,hidden=..,heads=..,seq=..,vocab=.."),
         gpus: int = typer.Option(..., help="GPUs of the real job"),
         cluster: str = typer.Option("dgx-h100", help="Preset (dgx-a100-80gb, dgx-h100, ...) or a profile file"),
         seq: Optional[int] = typer.Option(None, help="Sequence length (default: config.json's, up to 8192)"),
         global_batch: int = typer.Option(512, help="Sequences per optimizer step"),
         target: str = typer.Option("megatron", help="Framework the layouts must run in: yaml (the workbench) | "
                                                      "megatron | deepspeed | torchtitan | accelerate"),
         top: int = typer.Option(5, help="Layouts shown"),
         base: Optional[Path] = typer.Option(None, help="Your run config (data, tokenizer, weights, steps, lr)"),
         set_: Optional[list[str]] = typer.Option(None, "--set", help="key=value on the base config, repeatable"),
         study: Optional[str] = typer.Option(None, help="A tuner study of a stand-in: its measured/predicted "
                                                        "factors calibrate the ranking"),
         storage: Optional[str] = typer.Option(None, help="The study's Optuna storage URL"),
         export: Optional[list[str]] = typer.Option(None, "--export", help="Export the picked layout: a format "
                                                    "(yaml, megatron, deepspeed, torchtitan, accelerate) or all"),
         pick: int = typer.Option(1, help="Which ranked layout to export (1 = best)"),
         output: Optional[Path] = typer.Option(None, "-o", "--output", help="Folder for the exports (and the "
                                               "top layouts' run configs, for `workbench dryrun`)"),
         as_json: bool = typer.Option(False, "--json")) -> None:
    """Rank the layouts of the real model on the real cluster for a target framework (simulator: time
    interval, memory), and export one of them."""
    from engine.errors import ConfigError
    from tuning.hardware import load_cluster
    from tuning.plan import TARGETS, base_config, make_plan
    from workbench.cli_sim import _model

    check_number("--gpus", gpus, 1)
    check_number("--global-batch", global_batch, 1)
    check_number("--top", top, 1)
    if target not in TARGETS:
        fail(f"--target={target!r}: must be one of {', '.join(TARGETS)}")
    formats = list(TARGETS) if export and "all" in export else list(export or [])
    bad = [f for f in formats if f not in TARGETS]
    if bad:
        fail(f"--export={bad[0]!r}: must be one of {', '.join(TARGETS)} or all")
    if len(formats) > 1 and output is None:
        fail("--export of several formats needs -o FOLDER")
    try:
        spec = load_cluster(cluster)
    except (KeyError, ValueError, FileNotFoundError) as exc:
        fail(f"--cluster={cluster!r}: {exc}")
    try:
        mdl = _model(model, seq)
    except typer.BadParameter as exc:
        fail(exc.message)
    try:
        the_base = base_config(base, set_ or [])
        result = make_plan(mdl, spec, gpus=gpus, global_batch=global_batch, target=target, top=top,
                           model_source=_model_source(model), base=the_base, study=_study(study, storage))
    except (ValueError, ConfigError) as exc:
        fail(str(exc))
    _show(result, as_json)
    if output is not None:
        _write_configs(result, output)
    refused = [fmt for fmt in formats if not _export(result, pick, fmt, output)]
    if refused:
        raise typer.Exit(2)


def _show(result, as_json: bool) -> None:
    from workbench.cli_sim import _shape_text, print_frame

    if as_json:
        _print_json({"model": _shape_text(result.model), "params": result.model.params, "cluster": result.cluster.name,
                     "gpus": result.gpus, "target": result.target, "calibration": result.calibration,
                     "layouts": result.table.to_dict(orient="records")})
        return
    console.print(f"model {_shape_text(result.model)}; {result.model.params:,} parameters", markup=False,
                  highlight=False, soft_wrap=True)
    title = f"{result.target} layouts on {result.gpus} GPUs of {result.cluster.name}, best first (simulated)"
    table = result.table.copy()
    table.insert(0, "pick", range(1, len(table) + 1))
    print_frame(title, table, wide=False, first=("pick",))
    cal = result.calibration
    if cal:
        console.print(f"ranked by the time corrected with study {cal['study']}'s measured/predicted factors per "
                      f"strategy class ({cal['trials']} trials of a stand-in on its own host; they carry the "
                      f"engine's mispricing there, an assumption for {result.cluster.name})", markup=False,
                      highlight=False, soft_wrap=True)


def _write_configs(result, output: Path) -> None:
    """The top layouts' run configs (the real model at the real world size), and their dry-run lines."""
    from tuning.export import to_yaml
    from tuning.plan import plan_config

    output.mkdir(parents=True, exist_ok=True)
    for i in range(1, min(3, len(result.table)) + 1):
        path = output / f"plan-{i}.yaml"
        path.write_text(to_yaml(plan_config(result, i)))
        # issue 50 item 2 (`workbench dryrun`, built beside this): the real program on fake ranks
        err.print(f"dry run of layout {i}: workbench dryrun {path} --world {result.gpus}", highlight=False,
                  markup=False, soft_wrap=True)


def _export(result, pick: int, fmt: str, output: Optional[Path]) -> bool:
    """Write (or print) one export and its notes; False where the target refused the model (said in one line)."""
    from tuning.export_frameworks import write_accelerate_bundle
    from tuning.plan import export_plan, plan_config

    try:
        text, notes = export_plan(result, pick, fmt)
    except ValueError as exc:  # a target that cannot take the model (torchtitan: no flavor of its shape)
        line = str(exc) if str(exc).startswith(f"{fmt}:") else f"{fmt}: {exc}"
        err.print(line, highlight=False, markup=False, soft_wrap=True)
        return False
    if output is None:
        sys.stdout.write(text)
    elif fmt == "accelerate":
        line = write_accelerate_bundle(plan_config(result, pick), output / EXPORT_FILES[fmt])
        console.print(f"{fmt}: wrote {output / EXPORT_FILES[fmt]} and its script; run from {output}: {line}",
                      highlight=False, soft_wrap=True)
    else:
        (output / EXPORT_FILES[fmt]).write_text(text)
        console.print(f"{fmt}: wrote {output / EXPORT_FILES[fmt]}", highlight=False, soft_wrap=True)
    for note in notes if fmt != "megatron" else []:  # megatron's are comments in the script
        typer.echo(f"{fmt}: not mapped: {note}", err=True)
    return True
