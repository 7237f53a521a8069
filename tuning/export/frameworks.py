"""Exports for torchtitan (a job config TOML) and Hugging Face accelerate (a config YAML with FSDP2 and
a ParallelismConfig), each with the knobs it cannot map listed beside it.

Checked by the tools themselves (tests/test_export_frameworks.py): torchtitan's `ConfigManager`
parses the TOML into its `JobConfig`; accelerate's `load_config_from_file` and its launcher's own
checks read the YAML, and `ParallelismConfig` / `FullyShardedDataParallelPlugin` build from the
environment its launcher prepares.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from engine.config.schema import RunConfig
from tuning.export.common import engine_only, rope_of, tokenizer_folder

# engine schedule -> torch.distributed.pipelining class name, which torchtitan takes verbatim
TITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "looped_bfs": "LoopedBFS",
                   "zero_bubble": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}
# Hugging Face model_type -> torchtitan model.name (torchtitan builds the shape from model.flavor)
TITAN_MODELS = {"llama": "llama3", "qwen3": "qwen3"}


def _num(x: float) -> float:
    return float(f"{x:.12g}")


def _hf(cfg: RunConfig) -> tuple[str | None, str | None]:
    """(model_type, folder of config.json) of model.hf, or (None, None) for the built-in GPT."""
    spec = getattr(cfg.model, "hf", None)
    if spec is None:
        return None, None
    if isinstance(spec, dict):
        return spec.get("model_type"), None
    from engine.model.shapes import read_hf_config

    path = Path(os.path.abspath(spec))  # the target runs elsewhere: absolute, as given (no symlinks resolved)
    return read_hf_config(path).get("model_type"), str(path if path.is_dir() else path.parent)


def _data_unmapped(cfg: RunConfig, target: str) -> list[str]:
    """What of the run's data the target cannot read as the run reads it (accelerate's script reads token
    files, Megatron datasets and local Hugging Face files itself, in the run's order)."""
    d = cfg.data
    out = []
    if target == "accelerate" and d.source not in ("tokens", "megatron", "hf"):
        out.append(f"data.source={d.source} (the workbench's own data: the script reads it through the workbench's "
                   "engine.data.corpus, installed beside it)")
    elif target == "torchtitan" and d.source != "hf":
        out.append(f"data.source={d.source} (torchtitan reads Hugging Face datasets; convert {d.path or 'the data'} "
                   "or register a dataset)")
    elif target == "torchtitan" and d.text_field != "text":
        out.append(f"data.text_field={d.text_field} (torchtitan's c4_test loader reads the field 'text'; register a "
                   "dataset for yours)")
    elif target == "torchtitan":
        out.append(f"data.source=hf ({d.path}): read by torchtitan's c4_test loader, which tokenizes and packs the "
                   "documents in its own way (BOS/EOS from the tokenizer, rows cut across documents)")
    if d.pack and target != "torchtitan":
        out.append(f"data.pack (document masks: set the model's attention mask type in {target})")
    return out


# ---------------------------------------------------------------- torchtitan

def to_torchtitan(cfg: RunConfig, knobs: dict[str, Any] | None = None) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """A torchtitan JobConfig as nested sections, and the knobs it does not carry; `knobs`: what a plan priced the
    layout with (tuning/plan.py plan_knobs: selective activation checkpointing, FP8 through torchao's float8)."""
    m, p, t, b = cfg.model, cfg.parallel, cfg.train, cfg.batch
    shard = titan_shards(cfg)
    unmapped: list[str] = []
    model, note = _titan_model(cfg)
    unmapped += note
    parallelism: dict[str, Any] = {
        "data_parallel_replicate_degree": 1 if shard else p.dp, "data_parallel_shard_degree": p.dp if shard else 1,
        "fsdp_reshard_after_forward": "always" if p.zero == 3 and p.reshard_after_forward else "never",
        "tensor_parallel_degree": p.tp, "pipeline_parallel_degree": p.pp, "context_parallel_degree": p.cp,
        "expert_parallel_degree": p.ep}
    # one pipeline step takes the dp rank's whole batch in micro-batches; without pp torchtitan
    # accumulates global / (local * dp) local batches
    local = b.global_ // p.dp if p.pp > 1 else b.micro
    training = {"local_batch_size": local, "global_batch_size": b.global_, "seq_len": m.seq_len,
                "steps": t.steps, "max_norm": _num(t.grad_clip),
                "mixed_precision_param": "bfloat16" if cfg.precision == "bf16" else "float32"}
    training.update(_titan_data(cfg))
    unmapped += _titan_parallel(cfg, parallelism)
    if shard and p.zero < 2:
        unmapped.append(f"parallel.zero={p.zero}: torchtitan's data parallel {_WHY_SHARD[p.zero]}; exported as FSDP "
                        f"over dp={p.dp} without resharding after forward (ZeRO-2: gradients and optimizer state "
                        "sharded, parameters gathered)")
    decay = {"cosine": ("cosine", None), "linear": ("linear", None), "constant": ("linear", 0.0)}[t.schedule]
    lr_scheduler: dict[str, Any] = {"warmup_steps": t.warmup_steps, "decay_type": decay[0],
                                    "min_lr_factor": _num(t.min_lr_ratio)}
    if decay[1] is not None:
        lr_scheduler["decay_ratio"] = decay[1]
    job = {"description": cfg.name, "dump_folder": f"./outputs/{cfg.name}"}
    out: dict[str, dict[str, Any]] = {
        "job": job, "model": model,
        "optimizer": {"name": "AdamW", "lr": _num(t.lr), "beta1": _num(t.beta1), "beta2": _num(t.beta2),
                      "weight_decay": _num(t.weight_decay)},
        "lr_scheduler": lr_scheduler, "training": training, "parallelism": parallelism,
        "activation_checkpoint": {"mode": "full" if t.activation_checkpointing else
                                  "selective" if (knobs or {}).get("recompute") == "selective" else "none"},
        "checkpoint": _titan_weights(cfg),
        "comm": {"train_timeout_seconds": int(t.timeout_s)},
        "debug": {"seed": t.seed},
    }
    if (knobs or {}).get("precision") == "fp8":  # torchao's float8 linear layers, their FSDP gathers in float8
        out["model"]["converters"] = ["quantize.linear.float8"]
        out["quantize.linear.float8"] = {"enable_fsdp_float8_all_gather": True,
                                         "precompute_float8_dynamic_scale_for_fsdp": True}
    if m.dropout > 0:
        unmapped.append(f"model.dropout={m.dropout} (torchtitan's models have no dropout)")
    return out, unmapped + _data_unmapped(cfg, "torchtitan") + engine_only(cfg, "torchtitan")


_WHY_SHARD = {0: "is FSDP wherever it runs in bf16 or beside tp / cp / pp (its DDP keeps fp32 replicas and runs "
                  "alone)", 1: "has no optimizer-only sharding"}


def titan_shards(cfg: RunConfig) -> bool:
    """Whether torchtitan runs the data parallel ranks as FSDP (shard degree dp): always but for plain fp32 data
    parallel, which its DDP runs as is. Its DDP keeps fp32 replicas (mixed precision acts under FSDP only) and
    does not compose with tp, cp or pp, so ZeRO-0/1 there is FSDP without resharding after forward."""
    p = cfg.parallel
    return p.zero >= 1 or cfg.precision == "bf16" or p.tp * p.cp * p.pp > 1


def _titan_data(cfg: RunConfig) -> dict[str, Any]:
    """training.dataset / dataset_path: a local Hugging Face dataset folder through torchtitan's c4_test loader
    (`load_dataset(path, split="train")`, its 'text' field)."""
    d = cfg.data
    if d.source != "hf" or not d.path or d.text_field != "text":
        return {}
    path = Path(os.path.abspath(d.path))
    return {"dataset": "c4_test", "dataset_path": str(path if path.is_dir() or not path.suffix else path.parent)}


def _titan_weights(cfg: RunConfig) -> dict[str, Any]:
    """The checkpoint section: model.hf_weights loaded as the initial weights through the model's Hugging Face
    state-dict adapter."""
    t = cfg.train
    out: dict[str, Any] = {"enable": t.checkpoint_interval > 0 or bool(cfg.model.hf_weights),
                           "interval": max(1, t.checkpoint_interval or t.steps)}
    if cfg.model.hf_weights:
        out.update(initial_load_path=os.path.abspath(cfg.model.hf_weights), initial_load_in_hf=True,
                   initial_load_model_only=True)
    return out


def _titan_model(cfg: RunConfig) -> tuple[dict[str, Any], list[str]]:
    """torchtitan's model.name / flavor of exactly the run's model, its tokenizer folder and initial
    weights; ValueError (one line) when no registered flavor has the model's shape."""
    name, flavor = titan_flavor(cfg)
    model: dict[str, Any] = {"name": name, "flavor": flavor}
    _, assets = _hf(cfg)
    tok = tokenizer_folder(cfg)
    if tok or assets:
        model["hf_assets_path"] = tok or assets
    if tok:
        return model, []
    where = f"{assets}, which holds none" if assets else "its default ./tests/assets/tokenizer, a test tokenizer"
    return model, [f"tokenizer: needed, and none given: torchtitan loads tokenizer.json from model.hf_assets_path "
                   f"({where}); set data.tokenizer to your tokenizer's folder (plan: --set data.tokenizer=FOLDER)"]


def titan_flavor(cfg: RunConfig) -> tuple[str, str]:
    """(model.name, flavor) of the torchtitan flavor whose model is the run's: same layers, widths, heads,
    vocabulary, tying, rope, norm epsilon, q/k norm and attention mask, judged on torchtitan's own model
    built on the meta device. Never a nearby flavor: ValueError naming the fields that differ."""
    from engine.model.shapes import read_hf_config

    model_type, _ = _hf(cfg)
    if model_type not in TITAN_MODELS:
        what = f"model_type={model_type}" if model_type else "the workbench GPT (GELU MLP, learned positions)"
        raise ValueError(f"torchtitan: {what} has no torchtitan model (llama and qwen3 configs map to its llama3 "
                         "and qwen3); export to another format")
    from torchtitan.protocols.train_spec import get_train_spec

    name = TITAN_MODELS[model_type]
    spec = get_train_spec(name)
    want = _hf_fields(read_hf_config(cfg.model.hf), block_causal=cfg.data.pack)
    nearest: tuple[int, str, dict[str, tuple[Any, Any]]] | None = None
    for flavor, args in spec.model_args.items():
        have = _titan_fields(name, args, spec.model_cls, want)
        diff = {k: (want[k], v) for k, v in have.items() if v != want[k]}
        if not diff:
            return name, flavor
        if nearest is None or len(diff) < nearest[0]:
            nearest = (len(diff), flavor, diff)
    _, flavor, diff = nearest
    shown = ", ".join(f"{k} {w} (flavor: {h})" for k, (w, h) in diff.items())
    raise ValueError(f"torchtitan: no {name} flavor has this model's shape; the nearest, {flavor}, differs in "
                     f"{shown}; register a flavor in torchtitan.models.{name} or export to another format")


def _hf_fields(data: dict[str, Any], *, block_causal: bool) -> dict[str, Any]:
    """The fields a torchtitan flavor must equal, read from a config.json."""
    from engine.model.shapes import from_hf_config
    shape, rope = from_hf_config(data), rope_of(data)
    scaling = None
    if rope["rope_type"] == "llama3":
        scaling = tuple(float(rope.get(k, d)) for k, d in (("factor", 8.0), ("low_freq_factor", 1.0),
                                                             ("high_freq_factor", 4.0),
                                                             ("original_max_position_embeddings", 8192)))
    return {"layers": shape.layers, "hidden": shape.hidden, "heads": shape.heads, "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim, "ffn_hidden": shape.ffn_hidden, "vocab": shape.vocab,
            "tied": shape.tied_embeddings, "params": shape.params, "rope_theta": float(rope["rope_theta"]),
            "rope_scaling": scaling, "norm_eps": float(data.get("rms_norm_eps", 1e-6)),
            "mask": "block_causal" if block_causal else "causal"}


def _titan_fields(name: str, args: Any, model_cls: Any, want: dict[str, Any]) -> dict[str, Any]:
    """The same fields of one torchtitan flavor; widths, tying and parameters from its model on the meta
    device (built only when layers, width and heads already agree)."""
    import torch

    kv = getattr(args, "n_kv_heads", None) or args.n_heads
    out: dict[str, Any] = {"layers": args.n_layers, "hidden": args.dim, "heads": args.n_heads, "kv_heads": kv,
                           "rope_theta": float(args.rope_theta), "norm_eps": float(args.norm_eps),
                           "mask": getattr(args, "attn_mask_type", "causal"), "rope_scaling": None}
    scaling = getattr(args, "rope_scaling_args", None)
    if name == "llama3" and scaling is not None:  # torchtitan's llama3 always applies llama3 rope scaling
        out["rope_scaling"] = (float(scaling.scaling_factor), float(scaling.low_freq_factor),
                               float(scaling.high_freq_factor), float(scaling.original_max_position_embeddings))
    if any(out[k] != want[k] for k in ("layers", "hidden", "heads", "kv_heads")):
        return out
    with torch.device("meta"):
        model = model_cls(args)
    layer = next(iter(model.layers.values()))
    out.update(ffn_hidden=layer.feed_forward.w1.weight.shape[0], vocab=model.tok_embeddings.weight.shape[0],
               head_dim=layer.attention.wq.weight.shape[0] // args.n_heads,
               tied=model.output.weight is model.tok_embeddings.weight,
               params=sum(p.numel() for p in model.parameters()))
    return out


def _titan_parallel(cfg: RunConfig, parallelism: dict[str, Any]) -> list[str]:
    """Pipeline schedule, stage split and CP flavour; what does not map."""
    p, m = cfg.parallel, cfg.model
    out = []
    if p.pp > 1:
        if p.schedule in TITAN_SCHEDULES:
            parallelism["pipeline_parallel_schedule"] = TITAN_SCHEDULES[p.schedule]
        else:
            out.append(f"parallel.schedule={p.schedule} (not a torch.distributed.pipelining schedule; "
                       "torchtitan runs its default 1F1B)")
        parallelism["pipeline_parallel_microbatch_size"] = cfg.batch.micro
        # the engine splits transformer blocks evenly; torchtitan counts the embedding and the head as
        # layers unless told the first and last stages hold none fewer
        parallelism.update(pipeline_parallel_layers_per_stage=m.layers // (p.pp * p.virtual),
                           pipeline_parallel_first_stage_less_layers=0, pipeline_parallel_last_stage_less_layers=0)
        if p.layer_split is not None:
            out.append(f"parallel.layer_split={p.layer_split} (torchtitan splits evenly, or by "
                       "module_fqns_per_model_part)")
        if p.schedule == "skip":
            out.append(f"parallel.skip_ratio={p.skip_ratio} (SkipPipe is the workbench's)")
    if p.cp > 1:
        parallelism["context_parallel_rotate_method"] = "alltoall" if p.cp_impl == "ulysses" else "allgather"
        if p.cp_impl == "ulysses":
            out.append("parallel.cp_impl=ulysses (torchtitan's context parallel is ring attention; its "
                       "rotate method alltoall is set)")
    if p.tp > 1 and not p.sequence_parallel:
        out.append("parallel.sequence_parallel=false (torchtitan's tensor parallel always shards the norms)")
    return out


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string escapes like JSON
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {v!r}")


def to_toml(sections: dict[str, dict[str, Any]], notes: list[str] = ()) -> str:
    """Sections of scalars and lists as TOML (the standard library reads TOML, it does not write it)."""
    lines = [f"# not mapped: {n}" for n in notes]
    for name, values in sections.items():
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
    return "\n".join(lines).lstrip("\n") + "\n"


def torchtitan_toml(cfg: RunConfig) -> str:
    """The TOML that `torchtitan.train --job.config_file` takes, unmapped knobs as comments."""
    sections, notes = to_torchtitan(cfg)
    return to_toml(sections, notes)


# ---------------------------------------------------------------- accelerate

def gpu_target(cfg: RunConfig) -> bool:
    """Whether the run's ranks are GPUs: cluster.gpus_per_node set (a plan's, or a Slurm job's), or backend nccl."""
    return cfg.cluster.gpus_per_node > 0 or cfg.backend == "nccl"


def to_accelerate(cfg: RunConfig) -> tuple[dict[str, Any], list[str]]:
    """An accelerate config (what `accelerate config` writes) and the knobs it does not carry.

    On GPUs, ZeRO-2/3, tp and cp run on FSDP2 with a ParallelismConfig, plain data parallel is MULTI_GPU (DDP).
    On CPU ranks accelerate runs DDP only (its AcceleratorState turns FSDP on for accelerator devices): the
    launch is MULTI_GPU's (torchrun, one process per rank) and the script asks for the CPU (`cpu=True`).
    """
    p, b = cfg.parallel, cfg.batch
    if p.pp > 1:  # its ParallelismConfig would hold world / pp ranks: the launch refuses it
        raise ValueError(f"accelerate: pp={p.pp}: accelerate has no pipeline parallelism of its own (only through its "
                         "DeepSpeed or Megatron-LM plugins); export megatron or deepspeed, or pick a layout with pp=1")
    gpu = gpu_target(cfg)
    fsdp = gpu and (p.zero >= 2 or p.tp > 1 or p.cp > 1)
    model_type, _ = _hf(cfg)
    nodes = max(1, cfg.cluster.nodes)
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE", "debug": False,
        "distributed_type": "FSDP" if fsdp else ("MULTI_GPU" if cfg.world_size > 1 else "NO"),
        "mixed_precision": "bf16" if cfg.precision == "bf16" else "no", "use_cpu": False,
        "num_machines": nodes, "num_processes": cfg.world_size, "machine_rank": 0,
        "main_training_function": "main", "rdzv_backend": "static" if nodes == 1 else "c10d", "same_network": True,
        "gpu_ids": "all"}
    if fsdp:
        out.update(_accelerate_fsdp(cfg, model_type))
    unmapped = [f"batch.micro={b.micro}, batch.global={b.global_}: accelerate's config has no batch sizes; "
                f"the script takes {b.micro} rows per forward and Accelerator(gradient_accumulation_steps="
                f"{cfg.grad_accum})"]
    if nodes > 1:
        unmapped.append(f"cluster.nodes={nodes}: on each node set machine_rank (0..{nodes - 1}) and main_process_ip "
                        "(node 0's address) in this file, or pass --machine_rank / --main_process_ip")
    if not gpu and (p.zero >= 2 or p.tp > 1 or p.cp > 1):
        unmapped.append(f"parallel.zero={p.zero}, tp={p.tp}, cp={p.cp} on CPU ranks: accelerate shards (FSDP) and "
                        "splits (tp, cp) on accelerator devices only; exported as DDP over all ranks")
    elif p.zero == 1:
        unmapped.append("parallel.zero=1 (optimizer-state sharding needs accelerate's DeepSpeed plugin; "
                        + ("exported as FSDP2 without resharding, ZeRO-2)" if fsdp else "exported as DDP)"))
    elif p.zero == 0 and fsdp and p.dp > 1:
        unmapped.append(f"parallel.zero=0 with tp/cp (accelerate composes them with FSDP only: dp={p.dp} exported "
                        "as dp_shard_size, without resharding after forward, ZeRO-2)")
    unmapped += _accelerate_unmapped(cfg, fsdp)
    return out, unmapped + _data_unmapped(cfg, "accelerate") + engine_only(cfg, "accelerate")


def _accelerate_fsdp(cfg: RunConfig, model_type: str | None) -> dict[str, Any]:
    """The FSDP2 plugin and ParallelismConfig sections (accelerate composes tp / cp with sharded dp only)."""
    p = cfg.parallel
    out: dict[str, Any] = {"fsdp_config": {
        "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": _decoder_layer(model_type),
        "fsdp_reshard_after_forward": p.zero == 3 and p.reshard_after_forward,
        "fsdp_activation_checkpointing": cfg.train.activation_checkpointing,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_offload_params": False,
        "fsdp_cpu_ram_efficient_loading": False}}
    shard = p.dp > 1
    out["parallelism_config"] = {
        "parallelism_config_dp_replicate_size": 1 if shard else p.dp,
        "parallelism_config_dp_shard_size": p.dp if shard else 1,
        "parallelism_config_tp_size": p.tp, "parallelism_config_cp_size": p.cp}
    if p.cp > 1:
        out["parallelism_config"]["parallelism_config_cp_backend"] = "torch"
    return out


def _accelerate_unmapped(cfg: RunConfig, fsdp: bool) -> list[str]:
    p, out = cfg.parallel, []
    if cfg.model.hf is None:
        out.append("model: the workbench GPT (engine/model/gpt.py) is not a Hugging Face model; the script trains "
                   "model.hf configs only")
    if p.ep > 1:
        out.append(f"parallel.ep={p.ep} (no expert parallelism in accelerate's ParallelismConfig)")
    if fsdp and p.cp > 1 and p.cp_impl == "ulysses":
        out.append("parallel.cp_impl=ulysses (accelerate's cp_backend torch is ring attention; Ulysses "
                   "is its sp_backend deepspeed)")
    if fsdp and p.tp > 1 and not p.sequence_parallel:
        out.append("parallel.sequence_parallel=false (accelerate's tp plan decides the norms' sharding)")
    if cfg.train.activation_checkpointing and not fsdp:
        out.append("train.activation_checkpointing: accelerate turns it on through FSDP only; call "
                   "model.gradient_checkpointing_enable() in the script")
    if cfg.train.checkpoint_interval:
        out.append("train.checkpoint_interval: add accelerator.save_state(DIR) to the script's loop")
    return out


def _decoder_layer(model_type: str | None) -> str:
    """The class FSDP wraps one of per layer: transformers' own `_no_split_modules` of the family's
    causal LM (LlamaDecoderLayer, Qwen3MoeDecoderLayer, ...); the workbench GPT's is Block."""
    if model_type is None:
        return "Block"
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])._no_split_modules[0]


def accelerate_yaml(cfg: RunConfig, preface: list[str] = ()) -> str:
    """The accelerate config file (`accelerate launch --config_file`), `preface` and unmapped knobs as comments
    (ValueError, one line: a layout accelerate does not run)."""
    import yaml

    config, notes = to_accelerate(cfg)
    return "".join(f"# {line}\n" for line in preface) + "".join(f"# not mapped: {n}\n" for n in notes) + \
        yaml.safe_dump(config, sort_keys=False)


def accelerate_settings(cfg: RunConfig) -> dict[str, Any]:
    """What the training script trains (tuning/export/accelerate_train.py's SETTINGS): model, data, batch, schedule."""
    m, d, t, b = cfg.model, cfg.data, cfg.train, cfg.batch
    where = lambda p: os.path.abspath(p) if isinstance(p, str) else p  # noqa: E731  (the script runs elsewhere)
    data = {"source": d.source, "path": where(d.path), "dtype": d.dtype, "tokenizer": where(d.tokenizer),
            "text_field": d.text_field, "eos_id": d.eos_id, "val_fraction": d.val_fraction}
    return {"model_hf": where(m.hf), "hf_weights": where(m.hf_weights), "seq_len": m.seq_len, "vocab": m.vocab, "data": data,
            "global_batch": b.global_, "micro": b.micro, "accum": cfg.grad_accum, "steps": t.steps, "lr": t.lr,
            "warmup_steps": t.warmup_steps, "schedule": t.schedule, "min_lr_ratio": t.min_lr_ratio,
            "weight_decay": t.weight_decay, "beta1": t.beta1, "beta2": t.beta2, "grad_clip": t.grad_clip,
            "seed": t.seed}


def accelerate_script(cfg: RunConfig) -> str:
    """The training script the accelerate config launches: tuning/export/accelerate_train.py with the run's SETTINGS."""
    import pprint

    from tuning.export import accelerate_train

    source = Path(accelerate_train.__file__).read_text()
    body = pprint.pformat(accelerate_settings(cfg), width=110, sort_dicts=False)
    return source.replace("SETTINGS: dict = {}  # the export fills this in", f"SETTINGS: dict = {body}", 1)


def write_accelerate_bundle(cfg: RunConfig, config_path: Path, preface: list[str] = ()) -> str:
    """Write the accelerate config (`preface` as comments at its top) and, beside it, its training script
    (`<stem>_train.py`); return the launch line (run from the config's folder)."""
    text = accelerate_yaml(cfg, preface)
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(text)
    script = config_path.with_name(f"{config_path.stem}_train.py")
    script.write_text(accelerate_script(cfg))
    return f"accelerate launch --config_file {config_path.name} {script.name}"
