"""Export a trial's config: YAML that `workbench run` runs as is, the torchrun command line, a JSON
report, a Megatron-LM launch, a DeepSpeed config, a torchtitan TOML and an accelerate config
(tuning/export/frameworks.py); the knobs that do not map are listed beside them.
Each is checked by the tool it names (tests/test_export*.py): torchrun runs it, Megatron-LM's argument
parser and DeepSpeed's config and scheduler classes accept it."""
from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState

from engine.config.schema import RunConfig, from_dict
from tuning.export.common import comm_unmapped
from tuning.export.megatron import megatron_args, megatron_command, megatron_script  # noqa: F401  (one import path)

FORMATS = ("yaml", "torchrun", "json", "megatron", "deepspeed", "torchtitan", "accelerate")


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


def engine_refusal(cfg: RunConfig) -> str | None:
    """Why the workbench's engine does not run this config (its validate()), in one line, or None."""
    from engine.config.validate import validate
    from engine.errors import ConfigError

    try:
        validate(cfg)
    except ConfigError as exc:
        return f"yaml: the workbench's engine does not run this layout: {str(exc).splitlines()[0]}"
    return None


def _num(x: float) -> str:
    """A number as people write it: 12 significant digits, so 3e-3 * 0.1 prints 0.0003, not float noise."""
    return f"{x:.12g}"


def _clean(x: float) -> float:
    return float(_num(x))


def to_torchrun(cfg: RunConfig, config_path: str = "best.yaml") -> str:
    """The torchrun line that runs `config_path` (a file `torchrun_script` or `write_torchrun_bundle` writes)."""
    p = cfg.parallel
    return shlex.join(["torchrun", f"--nproc-per-node={cfg.world_size}", "--standalone", "-m", "engine.launch.worker",
                       "--config", config_path]) + f"  # dp={p.dp} tp={p.tp} pp={p.pp}"


def torchrun_script(cfg: RunConfig, config_path: str = "best.yaml") -> str:
    """A shell script that writes the config next to where it runs, then starts it with torchrun: it
    runs as printed (`workbench export S --format torchrun | bash`)."""
    return (f"# writes {config_path}, then starts {cfg.world_size} ranks on this machine\n"
            f"cat > {shlex.quote(config_path)} <<'WORKBENCH_EOF'\n{to_yaml(cfg)}WORKBENCH_EOF\n"
            f"{to_torchrun(cfg, config_path)}\n")


_BUNDLE_README = """# {name}: exported by `workbench export --format torchrun -o DIR`

- `config.yaml`: the run config (`workbench run config.yaml` repeats it too).
- `launch.sh`: starts the {world} ranks on this machine with torchrun ({layout}).

One machine:

    {command}

Several machines (N nodes, {world} ranks in all; each node runs {world}/N of them, and the same
--rdzv-id names the run in the store of every node):

    torchrun --nproc-per-node={world}/N --nnodes=N --node-rank=I --rdzv-backend=c10d \\
      --rdzv-endpoint=HOST:PORT --rdzv-id=NAME -m engine.launch.worker --config config.yaml

Rank 0 records the run in the workbench store ($WORKBENCH_HOME, else ./.workbench): `workbench runs`.
"""


def write_torchrun_bundle(cfg: RunConfig, out_dir: Path) -> str:
    """Write config.yaml, launch.sh and README.md into `out_dir`; return the torchrun line to run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = out_dir / "config.yaml"
    config.write_text(to_yaml(cfg))
    command = to_torchrun(cfg, str(config))
    launch = out_dir / "launch.sh"
    launch.write_text('#!/usr/bin/env bash\nset -euo pipefail\ncd "$(dirname "$0")"\n'
                      f'exec {to_torchrun(cfg, "config.yaml")}\n')
    launch.chmod(0o755)
    p = cfg.parallel
    (out_dir / "README.md").write_text(_BUNDLE_README.format(
        name=cfg.name, world=cfg.world_size, layout=f"dp={p.dp} tp={p.tp} pp={p.pp}", command=command))
    return command


_CLAMPED = "DeepSpeed stretches warm-ups under 2 steps to 2, so the decay runs slightly off the run's"


def deepspeed_scheduler(cfg: RunConfig) -> tuple[dict[str, Any] | None, list[str]]:
    """The DeepSpeed "scheduler" section whose lr per step is the run's (`engine.train.trainer.lr_at`), and where
    it cannot be, the difference. DeepSpeed's own schedulers set their start value at construction and
    step after each optimizer step, so its steps 0 and 1 share one lr; torch's schedulers (which
    DeepSpeed builds by name too) take their first step at construction and match exactly."""
    t = cfg.train
    if t.schedule == "constant":
        return _ds_constant(t.lr, t.warmup_steps)
    if t.warmup_steps == 0 and t.schedule == "linear":
        return {"type": "LinearLR", "params": {"start_factor": 1.0, "end_factor": _clean(t.min_lr_ratio),
                                               "total_iters": t.steps}}, []
    if t.warmup_steps == 0:
        return {"type": "CosineAnnealingLR", "params": {"T_max": t.steps,
                                                        "eta_min": _clean(t.lr * t.min_lr_ratio)}}, []
    return _ds_warmup_decay(t.schedule, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)


def _ds_constant(lr: float, w: int) -> tuple[dict[str, Any] | None, list[str]]:
    """A linear ramp over w steps, then lr: WarmupLR starting at the ramp's second value (DeepSpeed repeats
    its start value at step 1), so only step 0 differs."""
    if w <= 1:
        return None, []  # the optimizer's lr throughout
    note = [f"lr: step 0 runs at {_num(2 * lr / w)} (the run's {_num(lr / w)}); every later step matches"]
    if w == 2:
        return None, note
    if w == 3:  # a 1-step ramp; DeepSpeed clamps warm-ups to >= 2, and its log ramp over 2 is exactly 0, 1
        params: dict[str, Any] = {"warmup_num_steps": 2, "warmup_type": "log"}
    else:
        params = {"warmup_num_steps": w - 2, "warmup_type": "linear"}
    params.update(warmup_min_lr=_clean(2 * lr / w), warmup_max_lr=_clean(lr))
    return {"type": "WarmupLR", "params": params}, note


def _ds_warmup_decay(schedule: str, lr: float, w: int, steps: int,
                     min_ratio: float) -> tuple[dict[str, Any], list[str]]:
    """WarmupDecayLR / WarmupCosineLR with a linear warm-up: the decay is the run's, the warm-up is not."""
    if schedule == "linear":  # decays from iteration warmup_num_steps to total_num_steps, applied one step late
        params = {"total_num_steps": steps - 1, "warmup_num_steps": max(1, w - 1),
                  "warmup_min_lr": _clean(lr * min_ratio), "warmup_max_lr": _clean(lr), "warmup_type": "linear"}
        note = (f"lr warm-up: DeepSpeed ramps from the final lr {_num(lr * min_ratio)} (the run from "
                f"{_num(lr / w)}); " + (f"the decay matches from step {w}" if w >= 3 else _CLAMPED))
        return {"type": "WarmupDecayLR", "params": params}, [note]
    params = {"total_num_steps": steps, "warmup_num_steps": w, "warmup_min_ratio": 0.0,
              "cos_min_ratio": _clean(min_ratio), "warmup_type": "linear"}
    note = ("lr warm-up: DeepSpeed's WarmupCosineLR starts at 0 and reaches the peak one step after the run; "
            + (f"the cosine matches from step {w + 1}" if w >= 2 else _CLAMPED))
    return {"type": "WarmupCosineLR", "params": params}, [note]


def deepspeed_refusal(cfg: RunConfig) -> str | None:
    """Why DeepSpeed cannot run this layout as one job, in one line, or None. DeepSpeed's engine has no tensor or
    context parallelism of its own: without a Megatron mpu its config check counts every rank as data parallel
    (train_batch_size == micro * accumulation * world_size); a PipelineModule counts pp * dp ranks and takes ZeRO-0/1."""
    p, b = cfg.parallel, cfg.batch
    if p.tp > 1 or p.cp > 1:
        return (f"deepspeed: tp={p.tp} cp={p.cp}: DeepSpeed has no tensor or context parallelism of its own (its config "
                f"check would count all {cfg.world_size} ranks as data parallel: {b.global_} != {b.micro} * "
                f"{cfg.grad_accum} * {cfg.world_size}); export megatron, or pick a layout with tp=1 and cp=1")
    if p.pp > 1 and p.zero >= 2:
        return (f"deepspeed: pp={p.pp} with parallel.zero={p.zero}: DeepSpeed's pipeline engine takes ZeRO-0/1 only; "
                "pick a layout with zero <= 1 or pp=1")
    return None


def to_deepspeed(cfg: RunConfig) -> tuple[dict[str, Any], list[str]]:
    """A DeepSpeed config dict (nothing but DeepSpeed keys), and the knobs and differences beside it; ValueError (one
    line, `deepspeed_refusal`) for a layout DeepSpeed does not run."""
    refusal = deepspeed_refusal(cfg)
    if refusal:
        raise ValueError(refusal)
    p, t, b = cfg.parallel, cfg.train, cfg.batch
    # our DDP bucket is bytes of gradients; DeepSpeed counts elements of its gradient dtype
    grad_bytes = 2 if cfg.precision == "bf16" else 4
    ds: dict[str, Any] = {
        "train_batch_size": b.global_, "train_micro_batch_size_per_gpu": b.micro,
        "gradient_accumulation_steps": cfg.grad_accum, "gradient_clipping": _clean(t.grad_clip),
        "optimizer": {"type": "AdamW", "params": {"lr": _clean(t.lr), "betas": [_clean(t.beta1), _clean(t.beta2)],
                                                  "weight_decay": _clean(t.weight_decay)}},
        "zero_optimization": {"stage": p.zero,
                              "reduce_bucket_size": int(cfg.ddp.bucket_cap_mb * 2**20) // grad_bytes},
        "bf16": {"enabled": cfg.precision == "bf16"},
    }
    scheduler, unmapped = deepspeed_scheduler(cfg)
    if scheduler is not None:
        ds["scheduler"] = scheduler
    if t.activation_checkpointing:
        # the config tunes DeepSpeed's checkpointing; the model turns it on by wrapping each block in
        # deepspeed.checkpointing.checkpoint (a PipelineModule does it with activation_checkpoint_interval)
        ds["activation_checkpointing"] = {"partition_activations": False, "number_checkpoints": cfg.model.layers,
                                          "contiguous_memory_optimization": False, "cpu_checkpointing": False}
        unmapped.append("train.activation_checkpointing: wrap each block in deepspeed.checkpointing.checkpoint"
                        + (" (pipeline.activation_checkpoint_interval=1 is set)" if p.pp > 1 else ""))
    if p.zero == 3:
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0 if p.reshard_after_forward else int(1e9)
    if p.pp > 1:
        ds["pipeline"] = {"stages": p.pp, "partition": "uniform",
                          "activation_checkpoint_interval": 1 if t.activation_checkpointing else 0}
    if p.schedule != "1f1b" and p.pp > 1:
        unmapped.append(f"parallel.schedule={p.schedule} (DeepSpeed pipelines run 1F1B)")
    if cfg.comm.compressor in ("fp16", "bf16"):
        ds["communication_data_type"] = cfg.comm.compressor
    elif cfg.comm.compressor != "none":
        unmapped.append(f"comm.compressor={cfg.comm.compressor} (no DDP comm hook in DeepSpeed)")
    unmapped += [u for u in comm_unmapped(cfg, "DeepSpeed") if not u.startswith("comm.")]
    return ds, unmapped + [_deepspeed_carries_no_job(cfg)]


def _deepspeed_carries_no_job(cfg: RunConfig) -> str:
    """A DeepSpeed config holds the engine's knobs only: what the training script must bring, in one line."""
    m, d = cfg.model, cfg.data
    model = f"model.hf={m.hf if isinstance(m.hf, str) else m.hf.get('model_type')}" if m.hf else "the workbench GPT"
    parts = [model, f"data.source={d.source}" + (f" ({d.path})" if d.path else "")]
    parts += [f"data.tokenizer={d.tokenizer}"] if d.tokenizer else []
    parts += [f"model.hf_weights={m.hf_weights}"] if m.hf_weights else []
    return (f"{', '.join(parts)}, train.steps={cfg.train.steps}: a DeepSpeed config holds none of them; your script "
            "builds the model, reads the data and runs the steps around deepspeed.initialize (the accelerate "
            "export writes such a script)")


def report(study: optuna.Study, trial: FrozenTrial, cfg: RunConfig) -> dict[str, Any]:
    from profilers.host import software_versions
    from profilers.host import host_info

    from tuning.sim.simulator import model_shape

    counts: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
    return {"study": study.study_name, "trial": trial.number, "values": trial.values, "params": trial.params,
            "metrics": {k: v for k, v in trial.user_attrs.items() if k != "config"},
            "config": cfg.to_dict(), "model_shape": model_shape(cfg.to_dict()), "trial_counts": counts,
            "search_space": study.user_attrs.get("space"),
            "remeasured": study.user_attrs.get("remeasured"), "hardware": host_info(),
            "software": software_versions()}


def trial_config(study: optuna.Study, trial_number: int | None = None) -> RunConfig:
    """The run config of the chosen trial (see `pick_trial`)."""
    return from_dict(pick_trial(study, trial_number).user_attrs["config"])


def export_trial(study: optuna.Study, trial_number: int | None = None, fmt: str = "yaml") -> str:
    """The chosen trial's config in one of FORMATS, as text that runs or loads as is (knobs that do
    not map: `export_notes`; for megatron they are also comments in the script)."""
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} must be one of {', '.join(FORMATS)}")
    trial = pick_trial(study, trial_number)
    cfg = from_dict(trial.user_attrs["config"])
    if fmt == "yaml":
        return to_yaml(cfg)
    if fmt == "torchrun":
        return torchrun_script(cfg)
    if fmt == "json":
        return json.dumps(report(study, trial, cfg), indent=2, default=str) + "\n"
    if fmt == "megatron":
        return megatron_script(cfg)
    if fmt in ("torchtitan", "accelerate"):
        from tuning.export.frameworks import accelerate_yaml, torchtitan_toml

        return torchtitan_toml(cfg) if fmt == "torchtitan" else accelerate_yaml(cfg)
    return json.dumps(to_deepspeed(cfg)[0], indent=2) + "\n"


def export_notes(study: optuna.Study, trial_number: int | None = None, fmt: str = "yaml") -> list[str]:
    """What the export of that format does not carry over (shown beside it, never inside it)."""
    cfg = trial_config(study, trial_number)
    if fmt == "deepspeed":
        return to_deepspeed(cfg)[1]
    if fmt == "megatron":
        return megatron_args(cfg)[1]
    if fmt in ("torchtitan", "accelerate"):
        from tuning.export.frameworks import to_accelerate, to_torchtitan

        return (to_torchtitan if fmt == "torchtitan" else to_accelerate)(cfg)[1]
    return []
