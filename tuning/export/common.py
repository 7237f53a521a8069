"""What the framework exports share (tuning/export/frameworks.py: torchtitan, accelerate;
tuning/export/megatron.py: Megatron-LM): the knobs only this engine has, the run's Hugging Face
tokenizer folder, and a config.json's RoPE parameters. Each export imports it; it imports neither."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from engine.config.schema import RunConfig


def comm_unmapped(cfg: RunConfig, target: str) -> list[str]:
    """The communication knobs only this engine has: gradient compression, CO2, emulated links."""
    out = []
    if cfg.comm.compressor != "none":
        out.append(f"comm.compressor={cfg.comm.compressor} (no gradient compression hook in {target})")
    if cfg.co2.enabled:
        out.append(f"co2.enabled (no CO2 local-update overlap in {target})")
    if cfg.link.gbps > 0 or cfg.link.groups:
        out.append("link.* (an emulated link only exists in the workbench)")
    return out


def engine_only(cfg: RunConfig, target: str) -> list[str]:
    """Knobs that exist only in this engine (compression, CO2, emulated links, FlexSP, Holmes, live tuning)."""
    p, out = cfg.parallel, comm_unmapped(cfg, target)
    if p.adaptive_sp:
        out.append(f"parallel.adaptive_sp (FlexSP's per-step sequence groups have no {target} equivalent)")
    if p.placement != "naive":
        out.append(f"parallel.placement={p.placement} ({target} places ranks in mesh order)")
    if cfg.live.every:
        out.append("live.every (live in-job tuning is the workbench's)")
    if cfg.comm.moe_compression != "none" or cfg.comm.moe_hierarchical:
        out.append(f"comm.moe_* (MoE all_to_all variants of the workbench, not {target}'s)")
    return out


def rope_of(data: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and scaling of a config.json in either form (transformers 5's rope_parameters, or the
    hub's rope_theta + rope_scaling)."""
    rope = dict(data.get("rope_parameters") or data.get("rope_scaling") or {})
    rope.setdefault("rope_theta", data.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return rope


def tokenizer_folder(cfg: RunConfig) -> str | None:
    """The Hugging Face tokenizer (a folder or a tokenizer.json's folder): data.tokenizer, else the folder
    of model.hf when it holds one."""
    if cfg.data.tokenizer:  # absolute: the target runs elsewhere
        tok = Path(os.path.abspath(cfg.data.tokenizer))
        return str(tok.parent if tok.suffix == ".json" else tok)
    if isinstance(cfg.model.hf, str):
        folder = Path(os.path.abspath(cfg.model.hf))
        folder = folder if folder.is_dir() else folder.parent
        if any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            return str(folder)
    return None


def knob(cfg: RunConfig, name: str, default: Any) -> Any:
    """A knob of the run config wherever its section holds it (the plan's knob columns: moe_dispatcher, ...), else
    `default`: exports read knobs a newer config may carry without requiring them."""
    for section in (cfg, cfg.parallel, cfg.model, cfg.train):
        value = getattr(section, name, None)
        if value is not None:
            return value
    return default


# the job's values each export carries (train.*: steps, schedule, optimizer; deepspeed: its bucket size, no seed;
# torchtitan: its timeout): where the user's base config does not give them, they are the workbench's defaults
JOB_KEYS = ("train.steps", "train.lr", "train.min_lr_ratio", "train.warmup_steps", "train.schedule",
            "train.weight_decay", "train.beta1", "train.beta2", "train.grad_clip", "train.seed")
CARRIED = {"deepspeed": tuple(k for k in JOB_KEYS if k != "train.seed") + ("ddp.bucket_cap_mb",),
           "torchtitan": JOB_KEYS + ("train.timeout_s",)}


def defaults_carried(cfg: RunConfig, given: dict[str, Any], fmt: str) -> list[str]:
    """One line per value export `fmt` carries that `given` (the user's base config) does not set: the workbench's
    default, named so it is not taken for the user's."""
    out = []
    for key in CARRIED.get(fmt, JOB_KEYS):
        section, name = key.split(".")
        if name in (given.get(section) or {}):
            continue
        value = getattr(getattr(cfg, section), name)
        out.append(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}")
    return [f"{kv}: the workbench's default, not yours (set it: --set {kv.split('=')[0]}=VALUE or --base FILE)"
            for kv in out]
