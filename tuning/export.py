"""Export a trial's config: YAML that `workbench run` runs as is, the torchrun command line, a JSON
report, Megatron-LM arguments and a DeepSpeed config (with the knobs that do not map listed)."""
from __future__ import annotations

import json
import shlex
from typing import Any

import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState

from engine.config import RunConfig, from_dict

FORMATS = ("yaml", "torchrun", "json", "megatron", "deepspeed")


def pick_trial(study: optuna.Study, trial_number: int | None = None) -> FrozenTrial:
    """A chosen trial, else the re-measured winner, else the best (first of the Pareto front)."""
    trials = study.get_trials(deepcopy=False)
    if trial_number is None:
        trial_number = study.user_attrs.get("confirmed_best")
    if trial_number is not None:
        match = [t for t in trials if t.number == trial_number]
        if not match:
            raise ValueError(f"trial={trial_number}: no such trial in study {study.study_name!r}")
        if "config" not in match[0].user_attrs:
            raise ValueError(f"trial={trial_number}: has no config (state {match[0].state.name})")
        return match[0]
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    if not done:
        raise ValueError(f"study {study.study_name!r} has no completed trial to export")
    if len(study.directions) == 1:
        return study.best_trial
    return sorted(study.best_trials, key=lambda t: -t.values[0])[0]


def to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def to_torchrun(cfg: RunConfig, config_path: str = "best.yaml") -> str:
    p = cfg.parallel
    return shlex.join(["torchrun", f"--nproc-per-node={cfg.world_size}", "--standalone", "-m", "engine.worker",
                       "--config", config_path]) + f"  # dp={p.dp} tp={p.tp} pp={p.pp}"


def to_megatron(cfg: RunConfig) -> tuple[list[str], list[str]]:
    """Megatron-LM pretrain_gpt.py arguments, and the knobs that have no Megatron equivalent."""
    m, p, t, b = cfg.model, cfg.parallel, cfg.train, cfg.batch
    args = [f"--num-layers {m.layers}", f"--hidden-size {m.d_model}", f"--num-attention-heads {m.heads}",
            f"--seq-length {m.seq_len}", f"--max-position-embeddings {m.seq_len}",
            f"--ffn-hidden-size {m.mlp_ratio * m.d_model}", f"--tensor-model-parallel-size {p.tp}",
            f"--pipeline-model-parallel-size {p.pp}", f"--micro-batch-size {b.micro}",
            f"--global-batch-size {b.global_}", f"--train-iters {t.steps}", f"--lr {t.lr}",
            f"--min-lr {t.lr * t.min_lr_ratio}", f"--lr-warmup-iters {t.warmup_steps}",
            f"--lr-decay-style {t.schedule}", f"--weight-decay {t.weight_decay}", f"--adam-beta1 {t.beta1}",
            f"--adam-beta2 {t.beta2}", f"--clip-grad {t.grad_clip}", f"--seed {t.seed}",
            f"--attention-dropout {m.dropout}", f"--hidden-dropout {m.dropout}"]
    if p.sequence_parallel:
        args.append("--sequence-parallel")
    if p.virtual > 1:
        args.append(f"--num-layers-per-virtual-pipeline-stage {m.layers // (p.pp * p.virtual)}")
    if t.activation_checkpointing:
        args.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    if cfg.precision == "bf16":
        args.append("--bf16")
    if p.zero >= 1:
        args.append("--use-distributed-optimizer")  # Megatron's ZeRO-1 equivalent
    if t.eval_interval:
        args.append(f"--eval-interval {t.eval_interval}")
    unmapped = []
    if p.zero >= 2:
        unmapped.append(f"parallel.zero={p.zero} (Megatron shards optimizer state only: ZeRO-1)")
    if p.schedule == "gpipe":
        unmapped.append("parallel.schedule=gpipe (Megatron runs 1F1B)")
    unmapped += _comm_unmapped(cfg, "Megatron-LM")
    return args, unmapped


def _comm_unmapped(cfg: RunConfig, target: str) -> list[str]:
    out = []
    if cfg.comm.compressor != "none":
        out.append(f"comm.compressor={cfg.comm.compressor} (no gradient compression hook in {target})")
    if cfg.co2.enabled:
        out.append(f"co2.enabled (no CO2 local-update overlap in {target})")
    if cfg.link.gbps > 0:
        out.append("link.* (an emulated link only exists in the workbench)")
    return out


def to_deepspeed(cfg: RunConfig) -> tuple[dict[str, Any], list[str]]:
    """A DeepSpeed config dict, and the knobs that do not map."""
    p, t, b = cfg.parallel, cfg.train, cfg.batch
    ds: dict[str, Any] = {
        "train_batch_size": b.global_, "train_micro_batch_size_per_gpu": b.micro,
        "gradient_accumulation_steps": cfg.grad_accum, "gradient_clipping": t.grad_clip,
        "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "betas": [t.beta1, t.beta2],
                                                  "weight_decay": t.weight_decay}},
        "scheduler": {"type": "WarmupCosineLR" if t.schedule == "cosine" else "WarmupLR",
                      "params": {"warmup_num_steps": t.warmup_steps, "total_num_steps": t.steps}},
        "zero_optimization": {"stage": p.zero, "reduce_bucket_size": int(cfg.ddp.bucket_cap_mb * 2**20)},
        "bf16": {"enabled": cfg.precision == "bf16"},
        "activation_checkpointing": {"partition_activations": t.activation_checkpointing},
    }
    if p.zero == 3:
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0 if p.reshard_after_forward else int(1e9)
    if p.pp > 1:
        ds["pipeline"] = {"stages": p.pp, "partition": "uniform"}
    unmapped = []
    if p.tp > 1:
        unmapped.append(f"parallel.tp={p.tp} (DeepSpeed needs Megatron-DeepSpeed or AutoTP for tensor parallel)")
    if p.schedule != "1f1b" and p.pp > 1:
        unmapped.append(f"parallel.schedule={p.schedule} (DeepSpeed pipelines run 1F1B)")
    if cfg.comm.compressor in ("fp16", "bf16"):
        ds["communication_data_type"] = cfg.comm.compressor
    elif cfg.comm.compressor != "none":
        unmapped.append(f"comm.compressor={cfg.comm.compressor} (no DDP comm hook in DeepSpeed)")
    unmapped += [u for u in _comm_unmapped(cfg, "DeepSpeed") if not u.startswith("comm.")]
    return ds, unmapped


def report(study: optuna.Study, trial: FrozenTrial, cfg: RunConfig) -> dict[str, Any]:
    from profilers.host import software_versions
    from profilers.host import host_info

    counts: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
    return {"study": study.study_name, "trial": trial.number, "values": trial.values, "params": trial.params,
            "metrics": {k: v for k, v in trial.user_attrs.items() if k != "config"},
            "config": cfg.to_dict(), "trial_counts": counts, "search_space": study.user_attrs.get("space"),
            "remeasured": study.user_attrs.get("remeasured"), "hardware": host_info(),
            "software": software_versions()}


def export_trial(study: optuna.Study, trial_number: int | None = None, fmt: str = "yaml") -> str:
    """The chosen trial's config in one of FORMATS, as text."""
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} must be one of {', '.join(FORMATS)}")
    trial = pick_trial(study, trial_number)
    cfg = from_dict(trial.user_attrs["config"])
    if fmt == "yaml":
        return to_yaml(cfg)
    if fmt == "torchrun":
        return to_torchrun(cfg) + "\n"
    if fmt == "json":
        return json.dumps(report(study, trial, cfg), indent=2, default=str) + "\n"
    if fmt == "megatron":
        args, unmapped = to_megatron(cfg)
        note = "".join(f"# not mapped: {u}\n" for u in unmapped)
        return note + "python pretrain_gpt.py \\\n  " + " \\\n  ".join(args) + "\n"
    ds, unmapped = to_deepspeed(cfg)
    if unmapped:
        ds["_not_mapped"] = unmapped
    return json.dumps(ds, indent=2) + "\n"


def export_pareto(study: optuna.Study, fmt: str = "yaml") -> dict[int, str]:
    """Every trial of the Pareto front, exported."""
    return {t.number: export_trial(study, t.number, fmt) for t in study.best_trials}
