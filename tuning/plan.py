"""A plan for the real job: the layouts of a model on a cluster at a GPU count, sequence length and global batch,
ranked by the simulator (time interval and memory), restricted to what the target framework runs, and each
exportable as that framework's launch (tuning/export*.py).

`make_plan(...)` ranks; `plan_config(plan, pick)` is the run config of one ranked layout (the real model, the
real world size, the cluster's nodes); `export_plan(plan, pick, fmt)` its export. A tuner study of a stand-in
(a smaller model or fewer ranks) calibrates the ranking with its measured / predicted factor per strategy
class (tuning/warmstart.py `refit_correction`), and `stand_in_line` says when a study's trial is a stand-in.
`dry_run_top(plan, k)` dry-runs the top layouts (engine/train/dryrun.py: the real program at the real world size, one
step on torch's fake backend) and judges each against the cluster's device memory.
"""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from engine.config.schema import RunConfig, apply_overrides, from_dict
from engine.errors import ConfigError
from tuning.sim.hardware import ClusterSpec
from tuning.sim.simulator import ModelSpec

TARGETS = ("yaml", "megatron", "deepspeed", "torchtitan", "accelerate")
# the simulator's flavours (tuning/sim/framework.py) each target can be priced as, its current release first (the
# default): Megatron-LM is megatron-core as NVIDIA's recipes run it ("megatron": as of 2021); the workbench's own
# target is the engine, which keeps what the "engine" flavour prices (fp32 parameters under autocast, FSDP2's
# replicate copy beside tp), as its dry run measures ("fsdp": priced as torchtitan would hold the same layout)
TARGET_FRAMEWORKS = {"yaml": ("engine", "fsdp"), "megatron": ("megatron-core", "megatron"),
                     "deepspeed": ("deepspeed",), "torchtitan": ("fsdp",), "accelerate": ("fsdp",)}
# what each target runs (the search never ranks a layout its export would have to change)
TARGET_AXES: dict[str, dict[str, list[Any]]] = {
    "yaml": {},
    "megatron": {"zero": [0, 1], "cp_impl": ["ring"]},
    "deepspeed": {"tp": [1], "cp": [1], "virtual": [1]},
    "torchtitan": {"zero": [0, 2, 3], "cp_impl": ["ring"]},
    "accelerate": {"pp": [1], "ep": [1], "zero": [0, 2, 3], "cp_impl": ["ring"], "virtual": [1]},
}
# activation recomputation each target has: Megatron-LM --recompute-granularity selective|full, torchtitan
# activation_checkpoint.mode selective|full; DeepSpeed, accelerate and the engine checkpoint whole blocks
TARGET_RECOMPUTE = {"yaml": ["none", "full"], "megatron": ["none", "selective", "full"],
                    "deepspeed": ["none", "full"], "torchtitan": ["none", "selective", "full"],
                    "accelerate": ["none", "full"]}
# targets whose current release trains the linear layers in FP8 on GPUs with an FP8 rate (tuning/sim/kernels.py):
# Megatron-LM through Transformer Engine (--fp8-format hybrid), torchtitan through torchao's float8 converter
FP8_TARGETS = ("megatron", "torchtitan")
# the knobs a layout is priced with beside its degrees (plan_knobs: what its export sets)
KNOB_COLUMNS = ["framework", "attention", "tp_comm_overlap", "precision"]
SHOWN = ["tp", "pp", "dp", "cp", "cp_impl", "ep", "virtual", "micro", "zero", "recompute", "sequence_parallel",
         "schedule", "iteration_time_s", "time_lo_s", "time_hi_s", "tokens_per_s", "mfu", "memory_per_gpu_gb",
         *KNOB_COLUMNS]
# the largest micro-batch searched (MosaicML's small models run 96-104 sequences at seq 512)
MAX_MICRO = 256
# a published layout is this plan's layout where these agree (cp_impl only matters at cp > 1)
LAYOUT_MATCH = ("tp", "pp", "dp", "cp", "ep", "virtual", "micro", "zero", "recompute", "sequence_parallel")


@dataclass(slots=True)
class Plan:
    """The ranked layouts of one job (best first) and what they were ranked for."""

    model: ModelSpec
    model_source: str | dict[str, Any] | None  # a config.json path or mapping (None: a GPT shape)
    cluster: ClusterSpec
    gpus: int
    global_batch: int
    target: str
    table: pd.DataFrame  # SHOWN columns (+ correction_factor, corrected_time_s with a study), best first
    base: dict[str, Any] = field(default_factory=dict)  # the user's run config: data, tokenizer, steps, lr
    calibration: dict[str, Any] | None = None  # the stand-in study whose factors ranked the layouts
    framework: str = ""  # the flavour priced (TARGET_FRAMEWORKS)
    knobs: dict[str, Any] = field(default_factory=dict)  # the flavour's knobs every layout is priced with
    # the published layouts of this job (tuning/data/published.yaml): each with its rank and price in this plan
    published: list[dict[str, Any]] = field(default_factory=list)

    @property
    def flavour(self) -> str:
        """One line naming the flavour and attention kernel the plan prices."""
        from tuning.sim.framework import flavour_line

        return flavour_line(self.framework, flash_attention=bool(self.knobs.get("flash_attention")),
                            attention_kernel=str(self.knobs.get("attention_kernel", "")))


def _axes(model: ModelSpec, target: str, global_batch: int) -> dict[str, list[Any]]:
    """The search axes of a target: its recomputation modes, micro-batches up to MAX_MICRO and, for Megatron-LM,
    virtual stages up to one layer per chunk (its recipes interleave 5 and 8); the target's own restrictions
    (TARGET_AXES)."""
    virtual = [v for v in range(1, model.layers + 1) if model.layers % v == 0] if target == "megatron" else [1, 2, 4]
    micro = [m for m in range(1, min(global_batch, MAX_MICRO) + 1) if global_batch % m == 0]
    axes = {"recompute": TARGET_RECOMPUTE[target], "schedule": ["1f1b"], "virtual": virtual, "micro": micro}
    return axes | TARGET_AXES[target]


def whole_nodes_rule(gpus: int, cluster: ClusterSpec) -> str | None:
    """Why `gpus` GPUs cannot be a job on `cluster` (one node, or whole nodes: the search finds no layout else),
    or None."""
    per_node = cluster.gpus_per_node
    if gpus > per_node and gpus % per_node:
        return (f"must fit in one node or fill whole nodes of {cluster.name} (a multiple of its {per_node} GPUs "
                "per node)")
    return None


def data_parallel_sizes(model: ModelSpec, gpus: int, global_batch: int, target: str) -> list[int]:
    """The data-parallel sizes the search can give `model` on `gpus` GPUs: GPUs / (tp x pp x cp)."""
    from tuning.search import candidate_axes

    axes = candidate_axes(model, gpus, global_batch) | TARGET_AXES[target]
    splits = {tp * pp * cp for tp in axes["tp"] for pp in axes["pp"] for cp in axes["cp"]}
    return sorted(gpus // split for split in splits if gpus % split == 0)


def global_batch_rule(model: ModelSpec, gpus: int, global_batch: int,
                      target: str) -> tuple[str | None, str | None]:
    """(why no layout can take `global_batch` sequences: no data-parallel size divides it, or None; a note when it
    leaves little data parallelism, or None). `workbench plan` and the Plan page say both the same."""
    sizes = data_parallel_sizes(model, gpus, global_batch, target)
    usable = [dp for dp in sizes if global_batch % dp == 0]
    if not usable:
        return (f"must be a multiple of a data-parallel size this model can have on {gpus} GPUs "
                f"({', '.join(map(str, sizes))}; dp = GPUs / (tp x pp x cp)); change it or the GPUs"), None
    if global_batch < gpus:
        return None, (f"on {gpus} GPUs: the data-parallel size divides it, so every layout "
                      f"has dp <= {max(usable)} and splits the model over the other GPUs")
    return None, None


def target_framework(target: str, framework: str | None = None) -> str:
    """The flavour a target is priced as: its current release, or `framework` where the target runs it
    (ValueError: a target or a flavour it does not run)."""
    if target not in TARGETS:
        raise ValueError(f"target={target!r} must be one of {', '.join(TARGETS)}")
    choices = TARGET_FRAMEWORKS[target]
    if framework is not None and framework not in choices:
        raise ValueError(f"framework={framework!r}: target {target} is priced as {' or '.join(choices)}")
    return framework or choices[0]


def _runs(df: pd.DataFrame, model: ModelSpec, target: str) -> pd.DataFrame:
    """Rows the target runs as ranked: tp divides the key/value heads; torchtitan shards the norms whenever tp
    does (sequence parallel), accelerate's tp plan decides them; DeepSpeed pipelines with ZeRO-0/1 only."""
    keep = (model.kv % df["tp"] == 0)
    if target in ("torchtitan", "accelerate"):
        keep &= df["sequence_parallel"] == (df["tp"] > 1)
    if target == "deepspeed":
        keep &= (df["pp"] == 1) | (df["zero"] <= 1)
    return df[keep]


def make_plan(model: ModelSpec, cluster: ClusterSpec, *, gpus: int, global_batch: int, target: str = "megatron",
              framework: str | None = None, precision: str | None = None,
              model_source: str | dict[str, Any] | None = None, base: dict[str, Any] | None = None,
              study: Any = None, top: int = 5) -> Plan:
    """The `top` fastest layouts that fit in memory, with the simulator's measured-time interval, priced as the
    target's current release runs them (or as `framework`, a flavour the target runs), in bf16 and FP8 where it
    trains in FP8 (or `precision`); ranked by the time a
    stand-in `study` corrects them to when one is given (ValueError: a target or a job nothing fits). The
    published layouts of the same job are located in the ranking (`Plan.published`)."""
    from tuning.search import add_uncertainty
    from tuning.sim.framework import FLAVOUR_DEFAULTS

    framework = target_framework(target, framework)
    knobs = dict(FLAVOUR_DEFAULTS[framework])
    priced = price_layouts(model, cluster, gpus=gpus, global_batch=global_batch, target=target, framework=framework,
                           precision=precision)
    df = priced[priced["fits"]].copy()
    if df.empty:
        raise ValueError(f"no layout of this model fits in {cluster.memory_gb:g} GB per GPU on {gpus} GPUs "
                         f"({cluster.name}) at global batch {global_batch} for {target}; add GPUs or shorten seq")
    add_uncertainty(df, hardware=cluster.name, framework=framework, params=float(model.params))
    rank_by = "iteration_time_s"
    calibration = None
    if study is not None:
        calibration = _calibrate(df, study)
        rank_by = "corrected_time_s"
    shown = SHOWN + (["correction_factor", "corrected_time_s"] if study is not None else [])
    ranked = df.sort_values(rank_by, kind="stable").reset_index(drop=True)[shown]
    plan = Plan(model=model, model_source=model_source, cluster=cluster, gpus=gpus, global_batch=global_batch,
                target=target, table=ranked, base=dict(base or {}), calibration=calibration, framework=framework,
                knobs=knobs)
    plan.published = published_layouts(priced, model=model, cluster=cluster, gpus=gpus, global_batch=global_batch,
                                       framework=framework)
    plan.table = _engine_runs(plan, top) if target == "yaml" else ranked.head(top)
    return plan


def price_layouts(model: ModelSpec, cluster: ClusterSpec, *, gpus: int, global_batch: int, target: str,
                  framework: str | None = None, precision: str | None = None) -> pd.DataFrame:
    """Every layout the target runs (its axes and rules), priced as its flavour runs it, with KNOB_COLUMNS; fitting
    or not, unranked. `precision` ("bf16" or "fp8") keeps one; by default FP8 beside bf16 where the target trains
    in FP8 on this GPU (FP8_TARGETS; ValueError: fp8 where it does not)."""
    from tuning.search import enumerate_configs
    from tuning.sim.framework import FLAVOUR_DEFAULTS, framework_code

    framework = target_framework(target, framework)
    knobs = dict(FLAVOUR_DEFAULTS[framework])
    fp8 = [False, True] if target in FP8_TARGETS and cluster.fp8_peak_flops > 0 else [False]
    if precision not in (None, "bf16", "fp8"):
        raise ValueError(f"precision={precision!r} must be bf16 or fp8")
    if precision == "fp8" and fp8 == [False]:
        why = "no FP8 rate for its GPU" if target in FP8_TARGETS else f"FP8 targets: {', '.join(FP8_TARGETS)}"
        raise ValueError(f"precision='fp8': {target} does not train in FP8 on {cluster.name} ({why})")
    fp8 = [on for on in fp8 if precision is None or on == (precision == "fp8")]
    frames = [_with_knobs(_runs(enumerate_configs(model, cluster, gpus, global_batch,
                                                  axes=_axes(model, target, global_batch),
                                                  knobs={**knobs, "framework": framework_code(framework),
                                                         "fp8": on}), model, target),
                          target, framework, knobs | {"fp8": on})
              for on in fp8]
    return pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]


def _with_knobs(df: pd.DataFrame, target: str, framework: str, knobs: dict[str, Any]) -> pd.DataFrame:
    """The KNOB_COLUMNS of each row: the flavour, its attention kernel, whether its tp collectives run under the
    GEMMs (tp_comm_overlap needs sequence parallelism, tuning/sim/tensor.py) and the precision."""
    from tuning.sim.framework import FRAMEWORKS

    attention = (knobs.get("attention_kernel") or FRAMEWORKS[framework].attention_kernel) \
        if knobs.get("flash_attention") else "unfused"
    df = df.copy()
    if "cp_impl" in TARGET_AXES[target]:  # moot at cp = 1: the one the target runs, not the search's code 0
        df.loc[df["cp"] == 1, "cp_impl"] = TARGET_AXES[target]["cp_impl"][0]
    df["framework"] = framework
    df["attention"] = attention
    df["tp_comm_overlap"] = bool(knobs.get("tp_comm_overlap")) & df["sequence_parallel"] & (df["tp"] > 1)
    df["precision"] = "fp8" if knobs.get("fp8") else "bf16"
    return df


def published_layouts(priced: pd.DataFrame, *, model: ModelSpec, cluster: ClusterSpec, gpus: int,
                      global_batch: int, framework: str) -> list[dict[str, Any]]:
    """The published rows of this job (same model, GPUs, global batch, sequence, cluster and flavour) located in
    `price_layouts`' table at their precision: each layout with its rank among the fitting layouts by price (None: priced as not
    fitting, or not in the search), its price, and the published measurement beside the same metric predicted."""
    from tuning.sim.published import DATA, calibration_rows, held_out_rows, metric_of

    times = np.sort(priced.loc[priced["fits"], "iteration_time_s"].to_numpy())
    job = (cluster.name, gpus, global_batch, model.seq, framework)
    shape = (model.params, (model.layers, model.hidden, model.heads, model.kv, model.experts))
    out = []
    for row in calibration_rows(DATA) + held_out_rows(DATA):
        if row.value is None or (row.cluster, row.gpus, row.global_batch, row.seq, row.framework) != job:
            continue  # before the model: counting its parameters was most of a plan's search of these rows
        m = row.model()
        if (m.params, (m.layers, m.hidden, m.heads, m.kv, m.experts)) != shape:
            continue
        match = _locate(priced[priced["precision"] == ("fp8" if row.fp8 else "bf16")], row)
        found = match is not None
        out.append({"id": row.id, "source": row.source, "layout": {k: getattr(row, k) for k in LAYOUT_MATCH},
                    "metric": row.metric, "measured": row.value, "in_search": found,
                    "fits": found and bool(match["fits"]),
                    "rank": 1 + int(np.searchsorted(times, match["iteration_time_s"] - 1e-12))
                    if found and match["fits"] else None,
                    "predicted": float(metric_of(row.metric, match.to_dict(), row.gpus, cluster.peak_flops))
                    if found else None,
                    **{k: float(match[k]) if found else None
                       for k in ("iteration_time_s", "tokens_per_s", "memory_per_gpu_gb")}})
    return out


def _locate(priced: pd.DataFrame, row: Any) -> pd.Series | None:
    """The priced layout that is the published row's (its degrees, micro-batch, ZeRO, recompute), or None."""
    keep = pd.Series(True, index=priced.index)
    for key in LAYOUT_MATCH:
        keep &= priced[key].astype(str) == str(getattr(row, key))
    if row.cp > 1:
        keep &= priced["cp_impl"].astype(str) == row.cp_impl
    hits = priced[keep]
    return None if hits.empty else hits.sort_values("iteration_time_s").iloc[0]


def _engine_runs(plan: Plan, top: int) -> pd.DataFrame:
    """The best `top` rows whose run config the engine's validate() accepts: the workbench's own target runs on
    the engine, which refuses layouts the simulator prices (context parallelism with ZeRO or pp)."""
    from engine.config.validate import validate

    keep: list[int] = []
    first_error: ConfigError | None = None
    for pick in range(1, len(plan.table) + 1):
        try:
            validate(plan_config(plan, pick))
        except ConfigError as exc:
            first_error = first_error or exc
            continue
        keep.append(pick - 1)
        if len(keep) == top:
            break
    if not keep:
        raise ValueError(f"no layout the simulator ranks is one the engine runs (the first: {first_error})")
    return plan.table.iloc[keep].reset_index(drop=True)


def _calibrate(df: pd.DataFrame, study: Any) -> dict[str, Any]:
    """Correct each row's time by the study's measured / predicted factor of its strategy class (in place), and
    describe the stand-in it was learnt on."""
    from tuning.sim.published import strategy_class
    from tuning.warmstart import refit_correction

    correction = refit_correction(study)
    classes = strategy_class(df["tp"].to_numpy(), df["pp"].to_numpy(), df["virtual"].to_numpy(), df["zero"].to_numpy())
    df["correction_factor"] = [correction.factor(str(c), "none") for c in classes]
    df["corrected_time_s"] = df["iteration_time_s"] / df["correction_factor"]
    trials = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("predicted_tokens_per_s")
              and t.state.name == "COMPLETE"]
    return {"study": study.study_name, "trials": len(trials), "overall": correction.overall,
            "classes": dict(correction.classes)}


def plan_config(plan: Plan, pick: int = 1) -> RunConfig:
    """The run config of ranked layout `pick` (1 = best): the real model at the real world size, the
    cluster's nodes of GPUs, bf16, on the user's base config (data, tokenizer, weights, steps, lr)."""
    row = _ranked_row(plan, pick)
    per_node = min(plan.cluster.gpus_per_node, plan.gpus)
    model: dict[str, Any] = {"seq_len": plan.model.seq}
    if plan.model_source is not None:
        model["hf"] = plan.model_source
    else:
        m = plan.model
        model.update(layers=m.layers, d_model=m.hidden, heads=m.heads, vocab=m.vocab,
                     mlp_ratio=max(1, m.ffn // m.hidden))
    schedule = str(row["schedule"])
    layout = {"model": model, "precision": "bf16", "batch": {"global": plan.global_batch, "micro": int(row["micro"])},
              "parallel": {"dp": int(row["dp"]), "tp": int(row["tp"]), "pp": int(row["pp"]), "cp": int(row["cp"]),
                           "cp_impl": str(row["cp_impl"]), "ep": int(row["ep"]),
                           "zero": int(row["zero"]), "virtual": int(row["virtual"]),
                           "sequence_parallel": bool(row["sequence_parallel"]),
                           "schedule": "interleaved" if schedule == "1f1b" and int(row["virtual"]) > 1 else schedule},
              "train": {"activation_checkpointing": str(row["recompute"]) == "full"},
              "cluster": {"nodes": plan.gpus // per_node, "gpus_per_node": per_node}}
    data = _merge(json.loads(json.dumps(plan.base)), layout)
    data.setdefault("name", f"plan-{plan.target}-{pick}")
    return from_dict(data)


def _ranked_row(plan: Plan, pick: int) -> pd.Series:
    """Ranked layout `pick` (1 = best) of the plan's table (ValueError: no such pick)."""
    if not 1 <= pick <= len(plan.table):
        raise ValueError(f"pick={pick} must be 1..{len(plan.table)} (the ranked layouts)")
    return plan.table.iloc[pick - 1]


def _merge(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict) and key != "hf":
            _merge(into[key], value)
        else:
            into[key] = value
    return into


def base_config(path: str | Path | None, overrides: list[str]) -> dict[str, Any]:
    """The user's run config as a dict (a YAML file and key=value overrides), not validated: it holds the real
    model's data, tokenizer, weights, steps and lr, which no CPU run here trains."""
    from engine.config.schema import load_yaml

    return apply_overrides(load_yaml(path) if path else {}, overrides)


def plan_knobs(plan: Plan, pick: int = 1) -> dict[str, Any]:
    """What layout `pick` was priced with beyond its run config, for its export: the flavour, the attention
    kernel, tp communication under the GEMMs, the recompute mode (the engine's config has no selective), the
    precision, and the flavour's own settings (megatron-core: the fused loss, the distributed optimizer's
    gathers overlapped)."""
    from tuning.sim.framework import FRAMEWORKS

    row, fw = _ranked_row(plan, pick), FRAMEWORKS[plan.framework]
    return {"framework": plan.framework, "attention": str(row["attention"]),
            "tp_comm_overlap": bool(row["tp_comm_overlap"]), "recompute": str(row["recompute"]),
            "precision": str(row["precision"]), "fused_loss": fw.fused_kernels,
            "overlap_param_gather": fw.overlap_param_gather and int(row["zero"]) >= 1}


def export_plan(plan: Plan, pick: int = 1, fmt: str | None = None) -> tuple[str, list[str]]:
    """Ranked layout `pick` exported as `fmt` (default: the plan's target), and what the export does not carry
    (ValueError, one line, where the target cannot take the model: a torchtitan shape with no flavor)."""
    from tuning.export.trial import to_deepspeed, to_yaml
    from tuning.export.frameworks import accelerate_yaml, to_accelerate, to_torchtitan, to_toml
    from tuning.export.megatron import megatron_args, megatron_script

    cfg = plan_config(plan, pick)
    fmt = fmt or plan.target
    if fmt == "yaml":
        return to_yaml(cfg), []
    if fmt == "megatron":
        knobs = plan_knobs(plan, pick) if plan.target == "megatron" else None
        return megatron_script(cfg, knobs), megatron_args(cfg, knobs)[1]
    if fmt == "deepspeed":
        ds, notes = to_deepspeed(cfg)
        return json.dumps(ds, indent=2) + "\n", notes
    if fmt == "torchtitan":
        sections, notes = to_torchtitan(cfg, plan_knobs(plan, pick) if plan.target == "torchtitan" else None)
        return to_toml(sections, notes), notes
    if fmt == "accelerate":
        return accelerate_yaml(cfg), to_accelerate(cfg)[1]
    raise ValueError(f"format={fmt!r} must be one of {', '.join(TARGETS)}")


@dataclass(frozen=True, slots=True)
class Export:
    """One export of a ranked layout as its user gets it: `text` (headed, except JSON, by a comment per value it
    carries that the user did not give), `notes` (what the target does not take) and `defaults` (those values,
    one line each: the workbench's, not the user's)."""

    text: str
    notes: list[str]
    defaults: list[str]


def export_for_user(plan: Plan, pick: int, fmt: str) -> Export:
    """Ranked layout `pick` exported as `fmt`, with the workbench defaults it carries named (the plan's base config
    is what the user gave); ValueError in one line starting "`fmt`: " where the target refuses the layout or the
    model. `workbench plan --export` and the Plan page's downloads are this one export."""
    from tuning.export.common import defaults_carried
    from tuning.export.trial import engine_refusal

    cfg = plan_config(plan, pick)
    try:
        refusal = engine_refusal(cfg) if fmt == "yaml" else None
        if refusal:
            raise ValueError(refusal)
        text, notes = export_plan(plan, pick, fmt)
    except ValueError as exc:  # a target that cannot take the layout (deepspeed: tp/cp) or the model (torchtitan)
        raise ValueError(str(exc) if str(exc).startswith(f"{fmt}:") else f"{fmt}: {exc}") from None
    defaults = defaults_carried(cfg, plan.base, fmt)
    preface = "" if fmt == "deepspeed" else "".join(f"# {d}\n" for d in defaults)  # JSON has no comments
    return Export(text=preface + text, notes=notes, defaults=defaults)


@dataclass(slots=True)
class DryRunCheck:
    """One ranked layout's dry run: the peak of each rank role (one per pipeline stage) beside the
    simulator's memory per GPU, judged against the device memory (`refusal`: why it does not fit)."""

    pick: int
    judged_by: str  # "dry run"; "estimate" (engine/train/memory.py): the dry run cannot play it; "none": the engine cannot
    peaks: list[tuple[str, float]]  # (role, bytes at its peak): "pp 0", ... (dry run); "rank" (the estimate's)
    largest: str  # the category holding the most bytes at the busiest role's peak
    simulator_bytes: float  # the simulator's memory per GPU (the most loaded stage)
    limit_bytes: float
    refusal: str | None  # one line when the busiest role does not fit, else None
    note: str | None = None  # why the dry run could not play the layout
    seconds: float = 0.0
    runtime_bytes: float = 0.0  # judged beside the peaks: what a rank holds beyond its tensors (`runtime_bytes`)

    @property
    def fits(self) -> bool | None:
        """Whether the busiest role fits; None when the layout was not judged."""
        return None if self.judged_by == "none" else self.refusal is None

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__} | {"fits": self.fits}


def dry_run_top(plan: Plan, k: int = 1, *, device_memory_gib: float | None = None,
                run: Callable[[RunConfig], Any] | None = None,
                progress: Callable[[int, RunConfig], None] | None = None,
                picks: list[int] | None = None) -> list[DryRunCheck]:
    """Dry-run the top `k` layouts (`run`: engine.train.dryrun.DryRunProcess, one process for them all) and judge
    each against the cluster's device memory (or `device_memory_gib`). A layout the dry run cannot play (DDP,
    FlexSP) is judged by the analytic estimate, as the launcher's pre-flight does. `progress(pick, cfg)` is called
    before each dry run (an 8B one takes minutes). `picks`: these ranked layouts instead of the top `k`."""
    from engine.train.dryrun import GIB, DryRunProcess

    if device_memory_gib is not None:
        limit, name = device_memory_gib * GIB, "device memory (--device-memory)"
    else:
        limit, name = plan.cluster.memory_gb * 1e9, f"of device memory per GPU of {plan.cluster.name}"
    with DryRunProcess() if run is None else contextlib.nullcontext(run) as run_one:
        return [_checked(plan, pick, run_one, limit, name, progress)
                for pick in picks or range(1, min(k, len(plan.table)) + 1)]


def _checked(plan: Plan, pick: int, run: Callable[[RunConfig], Any], limit: float, name: str,
             progress: Callable[[int, RunConfig], None] | None) -> DryRunCheck:
    """Layout `pick` dry-run by `run` and judged against `limit` bytes (`dry_run_top`)."""
    from engine.config.validate import validate
    from engine.train.dryrun import check_playable
    from tuning.sim.dryrun import tensor_budget

    cfg = plan_config(plan, pick)
    sim = float(plan.table.iloc[pick - 1]["memory_per_gpu_gb"]) * 1e9
    runtime = runtime_bytes(plan, pick)
    judged = dict(pick=pick, simulator_bytes=sim, limit_bytes=limit, runtime_bytes=runtime)
    budget = tensor_budget(limit, name, runtime)  # what the dry run's tensors are judged against
    try:
        validate(cfg)
    except ConfigError as exc:  # the target framework runs it, the engine does not: nothing to play or estimate
        return DryRunCheck(judged_by="none", peaks=[], largest="", refusal=None,
                           note=f"the engine does not run this layout: {str(exc).splitlines()[0]}", **judged)
    start = time.perf_counter()
    try:
        check_playable(cfg)
        if progress is not None:
            progress(pick, cfg)
        dry = run(cfg)
    except (ConfigError, RuntimeError) as exc:  # the launcher's pre-flight falls back the same way
        note = str(exc) if isinstance(exc, ConfigError) else f"the dry run failed: {str(exc).splitlines()[-1]}"
        return _judged_for_target(plan, _estimated(cfg, budget, judged, note=note))
    check = _dry_checked(dry, cfg, budget, judged, time.perf_counter() - start)
    check.note = played_note(plan, pick)
    return _judged_for_target(plan, check)


def runtime_bytes(plan: Plan, pick: int) -> float:
    """What the simulator prices a rank of layout `pick` holding beyond its tensors (`tuning.sim.dryrun.runtime_bytes`)."""
    from tuning.sim.dryrun import runtime_bytes as priced

    return priced(_ranked_row(plan, pick), plan.cluster)


def _judged_for_target(plan: Plan, check: DryRunCheck) -> DryRunCheck:
    """Another target's layout fits or not by what that target holds, the simulator's pricing of its flavour (the
    plan ranks only layouts it fits); the engine's dry run of it stays beside as the check of the simulator's
    memory per category. The engine keeps fp32 weights and gradients where Megatron-core keeps bf16 weights and a
    sharded fp32 copy, so its program not fitting says nothing of the target's."""
    if plan.target == "yaml" or check.refusal is None or check.simulator_bytes > check.limit_bytes:
        return check
    check.note = (f"{check.note}; the engine's own program of it would not fit ({check.refusal}): "
                  f"{plan.target} is judged by the simulator's {plan.framework} memory, "
                  f"{check.simulator_bytes / 1e9:.1f} GB of {check.limit_bytes / 1e9:.1f}")
    check.refusal = None
    return check


def played_note(plan: Plan, pick: int) -> str | None:
    """One line on what the dry run of another target's layout plays (None for the engine's own target): the
    engine's program at the layout's degrees (Megatron's distributed optimizer is ZeRO-1 over dp x cp there);
    the target's kernels and overlaps the engine has not got change the step's time, not what a rank holds."""
    if plan.target == "yaml":
        return None
    knobs = plan_knobs(plan, pick)
    timing = [what for what, on in (("tp-comm overlap", knobs["tp_comm_overlap"]),
                                    (f"{knobs['attention']} attention", knobs["attention"] not in ("", "none")),
                                    ("the fused loss", knobs["fused_loss"]),
                                    ("overlapped parameter gathers", knobs["overlap_param_gather"])) if on]
    zero = int(_ranked_row(plan, pick)["zero"])
    optimizer = " (the distributed optimizer as ZeRO-1 over dp x cp)" if plan.target == "megatron" and zero == 1 else ""
    left = f"; {', '.join(timing)} only change time, not played" if timing else ""
    # the engine trains under bf16 autocast; an FP8 pick's GEMMs are played in bf16 (its cached FP8 weights are not)
    precision = "bf16 autocast (FP8 played as bf16)" if knobs["precision"] == "fp8" else f"{knobs['precision']} autocast"
    return f"played as the engine runs it{optimizer}, fp32 weights under {precision}{left}"


def _dry_checked(dry: Any, cfg: RunConfig, budget: tuple[float, str], judged: dict[str, Any],
                 seconds: float) -> DryRunCheck:
    from engine.train.dryrun import fits_error

    busiest = dry.peak_role()
    error = fits_error(dry, limit_bytes=budget[0], limit_name=budget[1], cfg=cfg)
    return DryRunCheck(judged_by="dry run", peaks=[(f"pp {r.coords.get('pp', 0)}", r.peak) for r in dry.roles],
                       largest=max(busiest.grouped().items(), key=lambda kv: kv[1])[0],
                       refusal=str(error) if error else None, seconds=seconds, **judged)


def _estimated(cfg: RunConfig, budget: tuple[float, str], judged: dict[str, Any], note: str) -> DryRunCheck:
    from engine.train.memory import estimate_memory, memory_error

    est = estimate_memory(cfg)
    error = memory_error(cfg, limit_bytes=budget[0], ranks_sharing=1, limit_name=budget[1])
    return DryRunCheck(judged_by="estimate", peaks=[("rank", sum(est.values()))],
                       largest=max(est.items(), key=lambda kv: kv[1])[0], refusal=str(error) if error else None,
                       note=note, **judged)


def stand_in_line(cfg: RunConfig, study: str = "STUDY", *, target_params: int | None = None,
                  target_gpus: int | None = None) -> str | None:
    """One line when a tuned trial ran a stand-in: a smaller model than the target, fewer ranks than its GPUs,
    or CPU ranks (no target given); None when it is the real job."""
    from engine.model.shapes import from_gpt, from_hf_config

    m = cfg.model
    shape = from_hf_config(m.hf) if m.hf is not None else from_gpt(layers=m.layers, d_model=m.d_model, heads=m.heads,
                                                                   seq_len=m.seq_len, vocab=m.vocab,
                                                                   mlp_ratio=m.mlp_ratio)
    on_cpu = cfg.cluster.gpus_per_node == 0 and cfg.backend != "nccl"
    smaller = target_params is not None and shape.params < target_params
    fewer = target_gpus is not None and cfg.world_size < target_gpus
    if not (smaller or fewer or (on_cpu and target_params is None and target_gpus is None)):
        return None
    from tuning.sim.simulator import format_count

    ranks = f"{cfg.world_size} {'CPU ' if on_cpu else ''}rank{'s' if cfg.world_size > 1 else ''}"
    return (f"this trial ran a stand-in ({format_count(shape.params)} parameters on {ranks}); for the real model: "
            f"workbench plan --model CONFIG.json --cluster CLUSTER --gpus N --study {study} --export FORMAT "
            "(its trials calibrate the ranking)")
