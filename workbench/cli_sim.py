"""`workbench simulate` (one config, or a Frontier-style search) and `workbench calibrate`."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from tuning.sim.spec import KEY_ALIASES, PARALLEL_KEYS
from workbench.cli_common import check_number, console, err, fail, print_json

MODEL_PRESETS = {  # Narayanan et al. 2021 Table 1 shapes (seq 2048, vocab 51200)
    "22b": "layers=48,hidden=6144,heads=64,seq=2048,vocab=51200",
    "175b": "layers=96,hidden=12288,heads=96,seq=2048,vocab=51200",
    "1t": "layers=128,hidden=25600,heads=160,seq=2048,vocab=51200",
}
MODEL_KEYS = ("layers", "hidden", "heads", "seq", "vocab")
MOE_MODEL_KEYS = {"experts": int, "moe_every": int, "top_k": int, "capacity_factor": float}  # optional (issue 18)
# optional shape keys (published.yaml's model columns among them)
SHAPE_KEYS = {"kv_heads": int, "ffn_hidden": int, "gated_mlp": bool, "tied_embeddings": bool, "head_dim": int,
              "biases": bool, "learned_positions": bool, "dropout": bool, "norm_params": int}
_KINDS = {"int": int, "float": float, "bool": bool, "str": str, "str | bool": str}
# --config: every ParallelSpec field (tuning/sim/spec.py), and published.yaml's names for them
CONFIG_KEYS: dict[str, type] = {k: _KINDS[t] for k, t in PARALLEL_KEYS.items()} \
    | {alias: _KINDS[PARALLEL_KEYS[key]] for alias, key in KEY_ALIASES.items()}
MODEL_HINT = (f"name a preset ({', '.join(MODEL_PRESETS)}), a Hugging Face config.json path, or "
              f"layers=..,hidden=..,heads=..,seq=..,vocab=..")


def parse_pairs(text: str, allowed: dict[str, type], where: str, hint: str = "") -> dict[str, Any]:
    """'a=1,b=2' -> {'a': 1, 'b': 2}; errors name the option, the key and the rule (and `hint`)."""
    out: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in item:
            raise typer.BadParameter(f"{where}: '{item}' must look like key=value" + (f"; or {hint}" if hint else ""))
        key, raw = (s.strip() for s in item.split("=", 1))
        if key not in allowed:
            raise typer.BadParameter(f"{where}: unknown key '{key}'; known: {', '.join(allowed)}")
        kind = allowed[key]
        try:
            out[key] = raw.lower() in ("1", "true", "yes") if kind is bool else kind(raw)
        except ValueError:
            raise typer.BadParameter(f"{where}: {key}={raw!r} must be {kind.__name__}") from None
    return out


def _hf_model(text: str, seq: Optional[int]):
    """A Hugging Face config.json (or a folder holding one) as the simulator's model."""
    from engine.errors import ConfigError
    from tuning.sim.simulator import ModelSpec

    try:
        return ModelSpec.from_hf(text, seq=seq)
    except ConfigError as exc:
        raise typer.BadParameter(f"--model: {exc}") from None


def _model(text: str, seq: Optional[int] = None):
    """--model: a preset, a config.json path, or key=value pairs (with --seq overriding the length)."""
    from tuning.sim.simulator import ModelSpec

    if text.lower() not in MODEL_PRESETS and (text.endswith(".json") or Path(text).is_dir()):
        return _hf_model(text, seq)
    if text.lower() not in MODEL_PRESETS and "=" not in text:  # a name: say which names there are
        raise typer.BadParameter(f"--model: '{text}' is not a preset; presets: {', '.join(MODEL_PRESETS)}; "
                                 "or a Hugging Face config.json path, or layers=..,hidden=..,heads=..,seq=..,vocab=..")
    spec = parse_pairs(MODEL_PRESETS.get(text.lower(), text), {k: int for k in MODEL_KEYS} | MOE_MODEL_KEYS | SHAPE_KEYS,
                       "--model", MODEL_HINT)
    if seq is not None:
        spec["seq"] = seq
    missing = [k for k in MODEL_KEYS if k not in spec]
    if missing:
        raise typer.BadParameter(f"--model: missing {', '.join(missing)}; {MODEL_HINT}")
    for key, value in spec.items():
        if isinstance(value, bool):
            continue
        if value < 1 and key not in ("experts", "capacity_factor", "kv_heads", "ffn_hidden"):
            fail(f"--model: {key}={value} must be >= 1")
        if value < 0:
            fail(f"--model: {key}={value} must be >= 0")
    return ModelSpec(**spec)


def _check_config(pairs: dict[str, Any]) -> dict[str, Any]:
    """--config degrees and batch sizes are >= 1, zero is 0-3, the compression ratio in (0, 1]."""
    for key in ("tp", "pp", "dp", "micro", "global_batch", "virtual", "ep", "cp"):
        if key in pairs and pairs[key] < 1:
            fail(f"--config: {key}={pairs[key]} must be >= 1")
    if not 0 <= pairs.get("zero", 0) <= 3:
        fail(f"--config: zero={pairs['zero']} must be 0, 1, 2 or 3")
    if not 0 < pairs.get("compression_ratio", 1.0) <= 1:
        fail(f"--config: compression_ratio={pairs['compression_ratio']} must be in (0, 1]")
    return pairs


# --search tables: these columns first, with short headers (units in the header)
SEARCH_COLUMNS = {"tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "ep": "ep", "virtual": "v", "micro": "micro", "zero": "zero",
                  "recompute": "recompute", "iteration_time_s": "iter (s)", "tokens_per_s": "tokens/s",
                  "tflops_per_gpu": "TFLOP/s/GPU*", "mfu": "MFU", "memory_per_gpu_gb": "mem/GPU (GB)",
                  "fits": "fits"}
# a layout's other keys: shown beside the key columns where they tell the listed rows apart
LAYOUT_KEYS = ("sequence_parallel", "schedule", "cp_impl", "global_batch", "tp_spans_nodes")
FLOPS_NOTE = ("* TFLOP/s/GPU counts the FLOPs executed, recomputation included (Megatron-LM's convention); "
              "MFU counts the model's FLOPs only (PaLM's), so the two differ where a layout recomputes")


def print_frame(title: str, df, *, wide: bool, first: tuple[str, ...] = ()) -> None:
    """A DataFrame as a table that fits the terminal: key columns first, people's numbers."""
    from workbench.fmt import num, pct
    from workbench.report import fit_table

    keys = [c for c in first if c in df.columns] + [c for c in SEARCH_COLUMNS if c in df.columns and c not in first]
    telling = [c for c in LAYOUT_KEYS if c in df.columns and c not in keys and df[c].astype(str).nunique() > 1]
    at = keys.index("recompute") + 1 if "recompute" in keys else len(keys)
    order = keys[:at] + telling + keys[at:]  # rows that differ only there would look like duplicates
    order += [c for c in df.columns if c not in order]
    header = [SEARCH_COLUMNS.get(c, c) for c in order]
    rows = [[pct(r[c]) if c == "mfu" else num(r[c].item() if hasattr(r[c], "item") else r[c]) for c in order]
            for _, r in df.iterrows()]
    fit_table(title, header, rows, console, wide=wide)
    if "tflops_per_gpu" in order:
        console.print(FLOPS_NOTE, highlight=False)  # wrapped to the terminal


def simulate(cluster: str = typer.Option("dgx-a100-80gb", help="Preset (dgx-a100-80gb, dgx-h100, frontier) or profile file"),
             gpus: Optional[int] = typer.Option(None, help="Total GPUs (required unless --validate)"),
             model: Optional[str] = typer.Option(None, help="22b|175b|1t, a Hugging Face config.json path, or layers=..,hidden=..,heads=..,seq=..,vocab=..[,kv_heads=..,ffn_hidden=..,gated_mlp=..,experts=..,top_k=..,moe_every=..,capacity_factor=..] (required unless --validate)"),
             seq: Optional[int] = typer.Option(None, help="Sequence length (default: the preset's, or a config.json's max_position_embeddings up to 8192)"),
             config: Optional[str] = typer.Option(None, help="tp=..,pp=..,dp=..,micro=..,global_batch=..[,zero=..,recompute=none|selective|full,virtual=..,ep=..,cp=..,cp_impl=ulysses|ring,flash_attention=..,attention=fa2|cudnn|triton,tp_comm_overlap=..,fp8=true (Transformer Engine FP8 GEMMs, H100),...]: any ParallelSpec field (docs/cli.md), on the framework's defaults"),
             framework: Optional[str] = typer.Option(None, help="The framework flavour priced (megatron-core, megatron, deepspeed, fsdp, engine): its release's defaults under --config (default: megatron, Megatron-LM 2021)"),
             search: bool = typer.Option(False, help="Enumerate every valid config instead of one"),
             global_batch: int = typer.Option(1536, help="Global batch for --search"),
             top: int = typer.Option(10, help="Best configs shown by --search"),
             optuna_trials: int = typer.Option(0, help="Also run Optuna over the simulator"),
             report: Optional[Path] = typer.Option(None, help="Write an HTML report (tables + plotly figures)"),
             wide: bool = typer.Option(False, "--wide", help="Every column, however wide the terminal"),
             as_json: bool = typer.Option(False, "--json"),
             validate: bool = typer.Option(False, "--validate", help="Compare the simulator with published measurements (calibration vs held-out rows)")) -> None:
    """Predict iteration time, throughput and memory on a cluster we do not have."""
    if validate:
        _validate(as_json)
        return
    if gpus is None or model is None:
        fail("--gpus and --model are required unless --validate is given")
    from tuning.sim.framework import flavour_line
    from tuning.sim.hardware import load_cluster
    from tuning.sim.simulator import simulate as sim
    from tuning.sim.spec import parallel_spec

    check_number("--gpus", gpus, 1)
    check_number("--seq", seq, 1)
    check_number("--global-batch", global_batch, 1)
    check_number("--top", top, 1)
    check_number("--optuna-trials", optuna_trials, 0)

    try:
        spec = load_cluster(cluster)
    except (KeyError, ValueError, FileNotFoundError) as exc:
        fail(f"--cluster={cluster!r}: {exc}")
    try:  # a malformed --model / --config: one line, like every other option
        mdl = _model(model, seq)
        pairs = _check_config(parse_pairs(config, CONFIG_KEYS, "--config")) if config else {}
    except typer.BadParameter as exc:
        fail(exc.message)
    if search:
        _search(mdl, spec, gpus, global_batch, top, optuna_trials, report, as_json, wide)
        return
    if not config:
        fail("--config is required unless --search is given")
    if framework is not None:
        if pairs.get("framework", framework) != framework:
            fail(f"--framework={framework!r} and --config framework={pairs['framework']!r} disagree: name one")
        pairs["framework"] = framework
    try:
        par = parallel_spec(**pairs)
        result = sim(mdl, spec, par, gpus=gpus)
    except ValueError as exc:
        fail(str(exc))
    out = result.to_dict()
    out.update({"model_params": mdl.params, "model_params_active": mdl.active_params, "model": _shape_text(mdl),
                "cluster": spec.name, "gpus": gpus, "framework": par.framework,
                "flavour": flavour_line(par.framework, flash_attention=par.flash_attention,
                                        attention_kernel=par.attention_kernel)})
    out.update(_interval(result.iteration_time_s, mdl, spec, par))
    if as_json:
        print_json(out)
        return
    _print_one(out, mdl, spec, gpus)


def _shape_text(mdl) -> str:
    """One line of the model's shape: family, layers, width, heads (grouped-query), MLP, vocabulary."""
    kv = f" ({mdl.kv} kv)" if mdl.kv != mdl.heads else ""
    mlp = f"SwiGLU {mdl.ffn}" if mdl.gated_mlp else f"MLP {mdl.ffn}"
    moe = f", {mdl.experts} experts top-{mdl.top_k}" if mdl.experts else ""
    tied = "tied" if mdl.tied_embeddings else "untied"
    return (f"{mdl.family}: {mdl.layers} layers, hidden {mdl.hidden}, {mdl.heads} heads{kv}, {mlp}{moe}, "
            f"vocab {mdl.vocab} ({tied}), seq {mdl.seq}")


def _print_one(out: dict[str, Any], mdl, spec, gpus: int) -> None:
    from tuning.sim.simulator import format_count
    from workbench.fmt import num, pct

    active = f" ({format_count(mdl.active_params)} active)" if mdl.experts else ""
    console.print(f"model {out['model']}; {mdl.params:,} parameters{active}", markup=False, highlight=False,
                  soft_wrap=True)
    console.print(out["flavour"], markup=False, highlight=False, soft_wrap=True)
    t = Table(title=f"{format_count(mdl.params)} params{active} on {gpus} GPUs ({spec.name}, {out['framework']})")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for key in ("iteration_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "memory_per_gpu_gb", "fits"):
        t.add_row(key, pct(out[key]) if key == "mfu" else num(out[key]))
    for key, value in out["memory_breakdown_gb"].items():
        t.add_row(f"  memory {key} (GB)", num(value))
    for key, value in out["breakdown"].items():
        t.add_row(f"  {key} (s)", num(value))
    dom = out["domain"]
    t.add_row("domain of validity", dom["status"] + ("" if dom["inside"] else f" (distance {dom['distance']:g})"))
    for reason in dom["reasons"]:
        t.add_row("  why", reason)
    t.add_row("measured time likely in (s)", f"{num(out['interval_s'][0])} .. {num(out['interval_s'][1])}")
    t.add_row("  from residuals of", out["interval_basis"])
    t.add_row("  nearest validated rows", "; ".join(f"{n['id']} ({n['error_pct']:+.1f}%)" for n in dom["nearest"]))
    console.print(t)


def _interval(time_s: float, mdl, spec, par) -> dict[str, Any]:
    """Strategy class, domain of validity and measured-time interval (tuning/sim/domain.py)."""
    from tuning.sim.domain import prediction

    return prediction(time_s, hardware=spec.name, framework=par.framework, tp=par.tp, pp=par.pp, virtual=par.virtual,
                      zero=par.zero, gpus=par.gpus, micro=par.micro, params=float(mdl.params), seq=mdl.seq)


def _search(mdl, spec, gpus: int, global_batch: int, top: int, optuna_trials: int, report: Optional[Path],
            as_json: bool, wide: bool = False) -> None:
    import contextlib
    import time

    from tuning.search import (add_uncertainty, best_configs, enumerate_configs, flip_parameter, optuna_search, row_to_spec,
                               sensitivities)

    start = time.perf_counter()
    busy = contextlib.nullcontext() if as_json else err.status(f"pricing every config on {gpus:,} GPUs ...")
    with busy:
        df = enumerate_configs(mdl, spec, gpus, global_batch)
    seconds = time.perf_counter() - start
    add_uncertainty(df, hardware=spec.name, params=float(mdl.params))  # class, interval, extrapolated, overlaps_best
    best = best_configs(df, top)
    sens = sensitivities(df)
    out: dict[str, Any] = {"configs": len(df), "fit": int(df.fits.sum()), "seconds": seconds,
                           "extrapolated": int(df["extrapolated"].sum()),
                           "best": best.to_dict(orient="records"),
                           "sensitivities": {k: v.to_dict(orient="records") for k, v in sens.items()},
                           "overlapping_best": int(df["overlaps_best"].sum()),
                           "flip": flip_parameter(mdl, spec, gpus, global_batch)}
    if optuna_trials:
        busy = contextlib.nullcontext() if as_json else err.status(f"Optuna: {optuna_trials} trials over the simulator ...")
        with busy:
            study = optuna_search(mdl, spec, gpus, global_batch=global_batch, n_trials=optuna_trials, seed=0)
        out["optuna_best"] = {"value": study.best_value, "params": study.best_params}
    if report:
        from workbench.sim_report import write_report

        top = _interval(float(best.iloc[0]["iteration_time_s"]), mdl, spec, row_to_spec(best.iloc[0])) if len(best) else {}
        write_report(report, df, best, sens, title=f"{mdl.params / 1e9:.0f}B on {gpus} GPUs ({spec.name})",
                     domain=top.get("domain"), interval_s=top.get("interval_s"))
    if as_json:
        print_json(out)
        return
    console.print(f"{len(df):,} valid configs ({out['fit']:,} fit in memory) in {seconds:.2f} s; "
                  f"{out['extrapolated']:,} lie outside the validated domain (column extrapolated: their "
                  f"intervals are widened, tuning/sim/domain.py)")
    print_frame(f"best {len(best)} configs", best, wide=wide)
    for name, table in sens.items():
        print_frame(f"sensitivity: {name}", table, wide=wide, first=tuple(table.columns[:2]))
    if "optuna_best" in out:
        from workbench.fmt import num

        best_params = ", ".join(f"{k}={v}" for k, v in out["optuna_best"]["params"].items())
        console.print(f"\nOptuna over the simulator: {num(out['optuna_best']['value'])} tokens/s with {best_params}")
    flip = out["flip"]
    console.print(f"\n{out['overlapping_best']:,} fitting configs have a measured-time interval overlapping the best "
                  f"one's (overlaps_best); " + (f"the top choice flips when {flip['knob']} is scaled by "
                  f"{flip['factor']:.3g} (to {flip['new_best']})" if flip["knob"] else
                  "no single x4 change of bandwidth, peak or memory flips the top choice"),
                  markup=False, highlight=False)


def _validate(as_json: bool) -> None:
    """`simulate --validate`: per source, leave-one-source-out and leave-one-family-out errors beside the
    flat-MFU baseline; per family, leave-one-family-out; the fitted terms; ranking per table; every row; memory
    facts; sources."""
    from tuning.sim.published import memory_facts, sources, summarize, unvalidated, validation_table
    from tuning.sim.fit import FITTED_TERMS, fitted_rows
    from tuning.sim.memory_facts import walk
    from tuning.sim.validation import lofo_by_family, loso, loso_by_source, memory_check, per_source, ranking

    table, srcs, out_of_source = validation_table(), sources(), loso()
    by_source, by_family = loso_by_source(table, out_of_source, srcs), lofo_by_family(table, out_of_source, srcs)
    # every figure below is out of sample: each row priced with the terms fitted without its source
    loso_table = table.drop(columns=["simulated", "error_pct"]).merge(
        out_of_source[["id", "family", "loso", "loso_error_pct", "lofo_error_pct", "in_sample_error_pct",
                       "baseline_error_pct"]], on="id")
    loso_table = loso_table.assign(simulated=loso_table["loso"], error_pct=loso_table["loso_error_pct"], fitted=False)
    tables, cited = ranking(loso_table, srcs), per_source(loso_table, srcs)
    summary, missing, memory = summarize(loso_table), unvalidated(loso_table), memory_check(memory_facts())
    facts = walk(leave_one_source_out=True)
    memory_loso = {"facts": len(facts), "agree": int(facts["agrees"].sum()),
                   "disagree": facts.loc[~facts["agrees"], ["id", "outcome", "predicted_gb", "usable_gb"]].to_dict(
                       orient="records")}
    pooled = float(out_of_source["in_sample_error_pct"].abs().median())
    if as_json:
        print_json({"loso": by_source.to_dict(orient="records"), "lofo": by_family.to_dict(orient="records"),
                    "fitted_terms": list(FITTED_TERMS),
                     "fitted_term_count": len(FITTED_TERMS), "in_sample_pooled_median_abs_error_pct": pooled,
                     "tables": tables.to_dict(orient="records"), "sources": srcs,
                     "cited_tables": cited.to_dict(orient="records"), "rows": loso_table.to_dict(orient="records"),
                     "summary": {k: v.to_dict(orient="records") for k, v in summary.items()},
                     "memory": memory.to_dict(orient="records"), "memory_facts_loso": memory_loso,
                     "fitted_rows": fitted_rows(),
                     "unvalidated": missing})
        return

    def show(text: str) -> None:  # plain text, one line per row, at any terminal width
        console.print(text, markup=False, highlight=False, soft_wrap=True)

    show("Leave-one-source-out, per source: each source's rows priced with every term fitted without any row of "
         "that source; baseline = FLOPs / (GPUs x peak x 0.5); |error| in %; spearman / top1_regret on tables of "
         ">= 8 layouts of one model on one cluster (the worst such table)")
    show(by_source.round(3).to_string(index=False))
    show("\nLeave-one-family-out, per family (tables of one campaign, repository or report, left out together: "
         "tuning.sim.validation.FAMILIES); baseline, spearman / top1_regret as above")
    show(by_family.round(3).to_string(index=False))
    show(f"\nFitted terms: {len(FITTED_TERMS)} (per framework, on end-to-end rows, and DeepSpeed's allocator_reserve "
         f"on nvidia-smi readings of runs that ran; every kernel rate is a cited hardware fact, "
         f"tuning/data/kernels.yaml): {', '.join(FITTED_TERMS)}")
    show(f"In-sample (terms fitted on every source), pooled median |error| over {len(out_of_source)} rows: {pooled:.1f}%")
    show("\nRanking per table, leave-one-source-out (one model, one sequence length, one cluster; targets on search "
         "tables of >= 8 rows: rho >= 0.8, regret <= 5%)")
    show(tables.drop(columns=["source", "calibration_rows"]).round(3).to_string(index=False))
    show("\nCited tables: rows in the source, priced, excluded (reasons under Sources)")
    show(cited.drop(columns=["calibration"]).round(1).to_string(index=False))
    shown = ["id", "hardware", "framework", "class", "recompute", "layout", "metric", "published", "simulated",
             "loso_error_pct", "lofo_error_pct", "in_sample_error_pct", "baseline_error_pct"]
    show(f"\nRows: {len(loso_table)} (simulated = leave-one-source-out)")
    show(loso_table[shown].round({"simulated": 1, "loso_error_pct": 1, "lofo_error_pct": 1, "in_sample_error_pct": 1,
                                  "baseline_error_pct": 1}).to_string(index=False))
    for name, df in summary.items():
        show(f"\nLeave-one-source-out |error| by {name} (%)")
        show(df.round(1).to_string(index=False))
    agree = int(memory["agrees"].sum())
    show(f"\nMemory facts: {agree} of {len(memory)} agree (trained layouts fit, out-of-memory ones do not); "
         f"predicted / published peak, median {memory['ratio'].median():.2f}")
    show(f"Every memory fact (tuning/sim/memory_facts.py walk, leave-one-source-out): {memory_loso['agree']} of "
         f"{memory_loso['facts']} agree; not: "
         + "; ".join(f"{d['id']} ({d['outcome']}, predicted {d['predicted_gb']:.1f} of {d['usable_gb']:.1f} GB)"
                     for d in memory_loso["disagree"]))
    show("\nNo published row (predictions there are marked extrapolated): "
         + "; ".join(f"{k}: {', '.join(v)}" for k, v in missing.items() if v))
    show("\nSources")
    for key, src in srcs.items():
        show(f"- {key}: {src['paper']}; {src['table']}; where: {src['where']}; hardware: {src['hardware']}; "
             f"framework: {src['framework']}; {src['rows_in_source']} rows in the source")
        for e in src.get("excluded") or []:
            show(f"    excluded {e['count']} ({e['rows']}): {e['reason']}")


def _check_against_run(spec, world: int, step, host) -> dict:
    from tuning.calibrate.calibration import CHECK_STEPS, check_calibration

    step(f"check run ({world} ranks, {CHECK_STEPS} steps; up to 3 when the first is off)")
    return check_calibration(spec, world, host=host)


def _check_line(verdict: dict) -> str:
    """What each number of the check is: the profile's prediction at the speed the host had while it was
    measured, the host's speed now relative to that, the time expected now, the time measured."""
    runs = verdict.get("runs") or [{"speed": 1.0, **verdict}]
    speed = statistics.median(r["speed"] for r in runs)
    each = ", ".join(f"{r['error_pct']:+.1f}% at speed {r['speed']:.2f}x" for r in runs)
    return (f"check run ({verdict['config']}): the profile predicts {verdict['predicted_s']:.4f} s per step at the "
            f"host's speed while calibrating; the host runs at {speed:.2f}x that speed now, so "
            f"{verdict['predicted_s'] / speed:.4f} s is expected; measured {verdict['measured_s']:.4f} s: error "
            f"{verdict['error_pct']:+.1f}% (threshold {verdict['threshold_pct']:.0f}%, load1 {verdict['load1']:.1f}"
            + (f"; median of {len(runs)} runs: {each}" if len(runs) > 1 else "") + ")")


def _calibrate_gpu(output: Optional[Path], as_json: bool) -> None:
    """`calibrate --gpu`: measure, write the kernel profile and its cluster profile, print the comparison."""
    import contextlib

    from profilers.store import default_home
    from tuning.calibrate.gpu import measure_gpu, save_profile, summary

    busy = contextlib.nullcontext() if as_json else err.status("measuring this GPU ...")
    with busy:
        try:
            profile = measure_gpu(progress=lambda name: None if as_json else busy.update(f"measuring {name}"))
        except RuntimeError as exc:
            fail(str(exc), code=2)
    slug = "".join(c if c.isalnum() else "-" for c in profile["device"].lower()).strip("-")
    path, cluster = save_profile(profile, output or default_home() / "hardware" / f"gpu-{slug}.yaml")
    if as_json:
        print_json({"profile": str(path), "cluster": str(cluster) if cluster else None, **profile})
        return
    for line in summary(profile):
        console.print(line, soft_wrap=True, markup=False, highlight=False)
    console.print(f"kernel profile written to {path}" + (f"; cluster profile {cluster}" if cluster else ""))
    if cluster:
        console.print(f"use it: workbench simulate --cluster {cluster} ...")


def _say_load(*, check: bool, force: bool, as_json: bool) -> None:
    """One line before calibrate measures anything: what it will do at this host's load. With the check run
    on and no --force, refuse (exit 2) at the load its check refusal names, before minutes of measuring."""
    from tuning.calibrate.share import check_load_limit, host_load

    load1, cpus = host_load()
    limit = check_load_limit(cpus)
    then = ("saving without a check run (--no-check)" if not check else "then a check run, saving whatever it "
            "says (--force)" if force else "then a check run before saving")
    if load1 < limit:
        if not as_json:
            err.print(f"load1 {load1:.1f} on {cpus} cpus (below {limit:g}): measuring this machine (minutes), {then}",
                      highlight=False, markup=False, soft_wrap=True)
        return
    if check and not force:
        fail(f"load1={load1:.1f}: must be below {limit:g} (one task per cpu, {cpus} cpus) for calibrate's check run "
             f"to judge the profile; rerun when it is, or measure this busy host anyway with --no-check (or --force: "
             f"save whatever the check says)")
    err.print(f"warning: load1 {load1:.1f} on {cpus} cpus (not below {limit:g}): the profile will price this busy "
              f"host, not a quiet one; measuring anyway (minutes), {then}", highlight=False, markup=False, soft_wrap=True)


def calibrate(world: int = typer.Option(2, help="Ranks the profile is for (one 'GPU' per rank)"),
              output: Optional[Path] = typer.Option(None, "-o", "--output",
                                                    help="Profile file (default: <home>/hardware/cpu-local-WORLD.yaml)"),
              as_json: bool = typer.Option(False, "--json"),
              check: bool = typer.Option(True, "--check/--no-check",
                                         help="Check the profile against a short real run before saving it"),
              force: bool = typer.Option(False, "--force", help="Save even when the check run is off by more "
                                                                "than the threshold"),
              gpu: bool = typer.Option(False, "--gpu", help="Measure this CUDA GPU's GEMM, fused-attention and "
                                                            "HBM rates instead (under a minute on an H100) into a "
                                                            "kernel profile, compared with the hardware-fact prior; "
                                                            "--world, --check and --force do not apply")) -> None:
    """Measure this machine (GEMM rates at the engine's shapes, memory-bound ops, AdamW,
    framework overhead, gloo all-reduce alpha-beta) into a hardware profile for the simulator,
    then check it against a short real run (refused above 25% error unless --force)."""
    from profilers.store import default_home
    from tuning.calibrate.calibration import calibrate_local, measure_host
    from tuning.calibrate.share import check_load_limit, host_load
    from tuning.sim.hardware import cluster_to_dict, save_cluster

    if gpu:
        _calibrate_gpu(output, as_json)
        return
    check_number("--world", world, 1)
    _say_load(check=check, force=force, as_json=as_json)
    import contextlib

    import time

    done: list[str] = []
    started = [time.perf_counter()] * 2  # the calibration's start, the current step's start
    busy = contextlib.nullcontext() if as_json else err.status("measuring this machine ...")

    def step(name: str | None) -> None:  # a line per finished step (minutes each on a busy host), then the next
        now = time.perf_counter()
        if done and not as_json:
            err.print(f"  {done[-1]}: done in {now - started[1]:.0f} s ({now - started[0]:.0f} s in all)",
                      highlight=False)
        started[1] = now
        if name is None:
            return
        if not as_json:
            steps = (11 if world > 1 else 6) + int(check)  # tuning/calibrate/calibration.py's progress() calls, and the check
            busy.update(f"measuring {len(done) + 1} of about {steps}: {name}")
        done.append(name.split(" (")[0])

    with busy:
        host = measure_host(step)
        spec = calibrate_local(world, host=host, progress=step)
        verdict = _check_against_run(spec, world, step, host) if check else None
        step(None)
    if verdict is not None and not as_json:
        console.print(_check_line(verdict), soft_wrap=True, markup=False, highlight=False)
    if verdict is not None and not verdict["ok"] and not force:
        cpus = host_load()[1]
        fail(f"calibration not saved: the check run was off by {verdict['error_pct']:+.1f}% (> "
             f"{verdict['threshold_pct']:.0f}%) over {len(verdict.get('runs') or [1])} run(s), each at the host's speed "
             f"of that moment (load1 {verdict['load1']:.1f} on {cpus} cpus). The profile does not price this "
             f"machine's runs as they run now: rerun when load1 is below {check_load_limit(cpus):g}, save anyway with "
             f"--force, or skip "
             f"the check with --no-check", code=1)
    path = save_cluster(spec, output or default_home() / "hardware" / f"cpu-local-{world}.yaml")
    if as_json:
        print_json({"profile": str(path), **cluster_to_dict(spec), "check": verdict})
        return
    console.print(f"GEMM peak {spec.peak_flops / 1e9:.1f} GFLOP/s per rank; all-reduce alpha "
                  f"{spec.intra_latency_s * 1e6:.0f} us, busbw {spec.intra_bw_gb_s:.2f} GB/s; written to {path}")
    console.print(f"use it: workbench simulate --cluster {path} ...")
