"""`workbench plan`: the layouts of the real model on the real cluster, ranked by the simulator for a target
framework, the dry run of the top ones (engine/train/dryrun.py) and the export of any of them (tuning/plan.py)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from workbench.cli_common import check_number, check_writable_folder, console, err, fail, print_json

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


def _check_whole_nodes(gpus: int, cluster) -> None:
    """--gpus fills whole nodes of the cluster, or fits in one."""
    from tuning.plan import whole_nodes_rule

    rule = whole_nodes_rule(gpus, cluster)
    if rule:
        fail(f"--gpus={gpus}: {rule}")


def _check_global_batch(mdl, gpus: int, global_batch: int, target: str) -> None:
    """Refuse a global batch no data-parallel size divides; say when it leaves little data parallelism."""
    from tuning.plan import global_batch_rule

    refusal, note = global_batch_rule(mdl, gpus, global_batch, target)
    if refusal:
        fail(f"--global-batch={global_batch}: {refusal.replace('the GPUs', '--gpus')}")
    if note:
        err.print(f"note: --global-batch={global_batch} {note}", highlight=False, markup=False, soft_wrap=True)


def plan(model: str = typer.Option(..., help="A Hugging Face config.json (or its folder), a preset (22b, 175b, 1t) "
                                              "or layers=..,hidden=..,heads=..,seq=..,vocab=.."),
         gpus: int = typer.Option(..., help="GPUs of the real job"),
         cluster: str = typer.Option("dgx-h100", help="Preset (dgx-a100-80gb, dgx-h100, ...) or a profile file"),
         seq: Optional[int] = typer.Option(None, help="Sequence length (default: config.json's, up to 8192)"),
         global_batch: int = typer.Option(512, help="Sequences per optimizer step"),
         target: str = typer.Option("megatron", help="Framework the layouts must run in: yaml (the workbench) | "
                                                      "megatron | deepspeed | torchtitan | accelerate"),
         framework: Optional[str] = typer.Option(None, help="The flavour the target is priced as (default: its "
                                                 "current release: megatron -> megatron-core, torchtitan and "
                                                 "accelerate -> fsdp, yaml -> engine; megatron also takes "
                                                 "megatron, Megatron-LM 2021)"),
         precision: Optional[str] = typer.Option(None, help="bf16 or fp8 only (default: both where the target "
                                                 "trains in FP8 on the cluster's GPU: megatron, torchtitan on H100)"),
         top: int = typer.Option(5, help="Layouts shown"),
         base: Optional[Path] = typer.Option(None, help="Your run config (data, tokenizer, weights, steps, lr)"),
         set_: Optional[list[str]] = typer.Option(None, "--set", help="key=value on the base config, repeatable"),
         study: Optional[str] = typer.Option(None, help="A tuner study of a stand-in: its measured/predicted "
                                                        "factors calibrate the ranking"),
         storage: Optional[str] = typer.Option(None, help="The study's Optuna storage URL"),
         export: Optional[list[str]] = typer.Option(None, "--export", help="Export the picked layout: a format "
                                                    "(yaml, megatron, deepspeed, torchtitan, accelerate) or all"),
         pick: int = typer.Option(1, help="Which ranked layout to export (1 = best)"),
         dry_run: Optional[int] = typer.Option(None, "--dry-run", help="Dry-run the top K layouts (`workbench "
                                               "dryrun`: minutes for an 8B model) and mark those that do not fit "
                                               "the GPU memory (default: with --export, the picked layout is "
                                               "dry-run before it is written; 0: not checked)"),
         device_memory: Optional[float] = typer.Option(None, "--device-memory", help="GiB per GPU the dry runs "
                                                       "are judged against (default: the cluster's)"),
         output: Optional[Path] = typer.Option(None, "-o", "--output", help="Folder for the exports (and the "
                                               "top layouts' run configs, for `workbench dryrun`)"),
         wide: bool = typer.Option(False, "--wide", help="Every column of the table, however wide the terminal"),
         as_json: bool = typer.Option(False, "--json")) -> None:
    """Rank the layouts of the real model on the real cluster for a target framework (simulator: time
    interval, memory), dry-run the top ones (--dry-run K), and export one of them."""
    from engine.errors import ConfigError
    from tuning.sim.hardware import load_cluster
    from tuning.plan import base_config, make_plan
    from workbench.cli_sim import _model

    for flag, value, least in (("--gpus", gpus, 1), ("--global-batch", global_batch, 1), ("--top", top, 1),
                               ("--dry-run", dry_run, 0), ("--seq", seq, 1)):
        check_number(flag, value, least)
    check_number("--device-memory", device_memory, 0, exclusive=True)
    formats = _formats(target, export, output)
    try:
        spec = load_cluster(cluster)
    except (KeyError, ValueError, FileNotFoundError) as exc:
        fail(f"--cluster={cluster!r}: {exc}")
    _check_whole_nodes(gpus, spec)
    try:
        mdl = _model(model, seq)
    except typer.BadParameter as exc:
        fail(exc.message)
    _check_global_batch(mdl, gpus, global_batch, target)
    check_writable_folder("-o", output)
    try:
        the_base = base_config(base, set_ or [])
        result = make_plan(mdl, spec, gpus=gpus, global_batch=global_batch, target=target, framework=framework,
                           precision=precision, top=top,
                           model_source=_model_source(model), base=the_base, study=_study(study, storage))
        checks = _dry_runs(result, dry_run, device_memory, [pick] if formats and dry_run is None else None)
    except (ValueError, ConfigError) as exc:
        fail(str(exc))
    _show(result, as_json, checks, wide)
    if output is not None:
        _write_configs(result, output)
    unfit = [c.refusal for c in checks if c.pick == pick and c.fits is False]
    if formats and unfit:
        fail(f"--pick={pick}: layout {pick} does not fit: {unfit[0]}; export another --pick")
    if formats and not any(c.pick == pick for c in checks):
        err.print(f"layout {pick} exported unchecked: its memory is the simulator's alone (--dry-run 0 or a top K "
                  "without it); drop --dry-run to dry-run it first", highlight=False, markup=False, soft_wrap=True)
    refused = [fmt for fmt in formats if not _export(result, pick, fmt, output)]
    # `--export all` asks each target for what it can take (a refusal is one line); a format named, or the
    # plan's own target, that refuses is the user's request not met
    if refused and ("all" not in (export or []) or target in refused):
        raise typer.Exit(2)


def _formats(target: str, export: Optional[list[str]], output: Optional[Path]) -> list[str]:
    """The export formats asked for (`all`: every target), after checking --target and --export."""
    from tuning.plan import TARGETS

    if target not in TARGETS:
        fail(f"--target={target!r}: must be one of {', '.join(TARGETS)}")
    formats = list(TARGETS) if export and "all" in export else list(export or [])
    bad = [f for f in formats if f not in TARGETS]
    if bad:
        fail(f"--export={bad[0]!r}: must be one of {', '.join(TARGETS)} or all")
    if len(formats) > 1 and output is None:
        fail("--export of several formats needs -o FOLDER")
    return formats


def _dry_runs(result, k: Optional[int], device_memory: Optional[float], picks: Optional[list[int]] = None) -> list:
    """The top `k` layouts (or `picks`) dry-run and judged (tuning/plan.py `dry_run_top`), saying which runs now."""
    from tuning.plan import dry_run_top

    def progress(i: int, cfg) -> None:
        err.print(f"dry-running layout {i} at world {cfg.world_size} (one step of the real program on fake ranks)",
                  highlight=False, markup=False, soft_wrap=True)

    if not (k or picks):
        return []
    return dry_run_top(result, k or 0, device_memory_gib=device_memory, progress=progress, picks=picks)


def _show(result, as_json: bool, checks: list, wide: bool = False) -> None:
    from workbench.cli_sim import _shape_text, print_frame

    if as_json:
        print_json({"model": _shape_text(result.model), "params": result.model.params, "cluster": result.cluster.name,
                     "gpus": result.gpus, "target": result.target, "framework": result.framework,
                     "flavour": result.flavour, "calibration": result.calibration,
                     "layouts": result.table.to_dict(orient="records"), "published": result.published,
                     "dry_runs": [c.to_dict() for c in checks]})
        return
    console.print(f"model {_shape_text(result.model)}; {result.model.params:,} parameters", markup=False,
                  highlight=False, soft_wrap=True)
    console.print(f"priced as {result.flavour}", markup=False, highlight=False, soft_wrap=True)
    title = f"{result.target} layouts on {result.gpus} GPUs of {result.cluster.name}, best first (simulated)"
    table = result.table.copy()
    table.insert(0, "pick", range(1, len(table) + 1))
    print_frame(title, table, wide=wide, first=("pick",))
    cal = result.calibration
    if cal:
        console.print(f"ranked by the time corrected with study {cal['study']}'s measured/predicted factors per "
                      f"strategy class ({cal['trials']} trials of a stand-in on its own host; they carry the "
                      f"engine's mispricing there, an assumption for {result.cluster.name})", markup=False,
                      highlight=False, soft_wrap=True)
    for pub in result.published:
        console.print(_published_line(pub), markup=False, highlight=False, soft_wrap=True)
    if checks:
        _show_dry_runs(result, checks)


def _published_line(pub: dict) -> str:
    """Where a published layout of this job ranks, its price and its measurement."""
    from workbench.fmt import num

    lay = pub["layout"]
    name = " ".join(f"{k} {lay[k]}" for k in ("tp", "pp", "dp", "cp", "ep", "virtual", "micro", "zero")
                    if k in ("tp", "pp", "dp", "micro") or lay[k] not in (0, 1)) + f", recompute {lay['recompute']}"
    if not pub["in_search"]:
        return f"published layout {pub['id']} ({name}): not a layout this target runs"
    where = f"ranked {pub['rank']}" if pub["rank"] else f"priced as not fitting ({pub['memory_per_gpu_gb']:.1f} GB)"
    error = 100 * (pub["predicted"] - pub["measured"]) / pub["measured"]
    return (f"published layout {pub['id']} ({name}): {where}; {pub['metric']} measured {num(pub['measured'])}, "
            f"priced {num(pub['predicted'])} ({error:+.1f}%)")


def _show_dry_runs(result, checks: list) -> None:
    """Each dry-run layout's peak per rank role beside the simulator's memory, and why any does not fit."""
    from workbench.fmt import gib
    from workbench.report import fit_table

    verdict = {True: "yes", False: "NO", None: "n/a"}
    rows = [[str(c.pick), verdict[c.fits], c.judged_by, ", ".join(f"{role} {gib(b)}" for role, b in c.peaks) or "n/a",
             gib(c.runtime_bytes), gib(c.simulator_bytes), c.largest or "n/a"] for c in checks]
    fit_table(f"dry runs at world {result.gpus}: peak per rank role plus the runtime beside it (CUDA context, NCCL "
              f"buffers: priced) against {gib(checks[0].limit_bytes)} GiB per GPU",
              ["pick", "fits", "judged by", "peak per role (GiB)", "runtime (GiB)", "simulator (GiB)", "largest"],
              rows, console)
    for c in checks:
        if c.note:
            how = {"none": "not judged", "estimate": "judged by the analytic estimate (engine/train/memory.py)"}.get(
                c.judged_by, "dry-run")
            console.print(f"layout {c.pick} {how}: {c.note}", markup=False, highlight=False, soft_wrap=True)
        if c.fits is False:
            console.print(f"layout {c.pick} does not fit: {c.refusal}", markup=False, highlight=False, soft_wrap=True)


def _write_configs(result, output: Path) -> None:
    """The top layouts' run configs (the real model at the real world size), and their dry-run lines."""
    from tuning.export.trial import to_yaml
    from tuning.plan import plan_config

    output.mkdir(parents=True, exist_ok=True)
    for i in range(1, min(3, len(result.table)) + 1):
        path = output / f"plan-{i}.yaml"
        path.write_text(to_yaml(plan_config(result, i)))
        # issue 50 item 2 (`workbench dryrun`, built beside this): the real program on fake ranks
        err.print(f"dry run of layout {i}: workbench dryrun {path} --world {result.gpus}", highlight=False,
                  markup=False, soft_wrap=True)


def _export(result, pick: int, fmt: str, output: Optional[Path]) -> bool:
    """Write (or print) one export and its notes, and name each value it carries that the user did not give (the
    workbench's defaults); False where the target refused the layout or the model (said in one line)."""
    from tuning.export.frameworks import write_accelerate_bundle
    from tuning.plan import export_for_user, plan_config

    try:
        export = export_for_user(result, pick, fmt)
    except ValueError as exc:
        err.print(str(exc), highlight=False, markup=False, soft_wrap=True)
        return False
    if output is None:
        sys.stdout.write(export.text)
    elif fmt == "accelerate":
        line = write_accelerate_bundle(plan_config(result, pick), output / EXPORT_FILES[fmt], export.defaults)
        console.print(f"{fmt}: wrote {output / EXPORT_FILES[fmt]} and its script; run from {output}: {line}",
                      highlight=False, soft_wrap=True)
    else:
        (output / EXPORT_FILES[fmt]).write_text(export.text)
        console.print(f"{fmt}: wrote {output / EXPORT_FILES[fmt]}", highlight=False, soft_wrap=True)
    for note in export.notes if fmt != "megatron" else []:  # megatron's are comments in the script
        typer.echo(f"{fmt}: not mapped: {note}", err=True)
    for line in export.defaults:
        typer.echo(f"{fmt}: {line}", err=True)
    return True
