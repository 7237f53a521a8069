"""Analytical performance model of one training iteration of a transformer model (pure functions).

`simulate(model, cluster, par)` validates and prices one configuration; `evaluate_arrays` prices
many at once (numpy arrays of parallel settings, used by `tuning.search`). Both run the same
arithmetic (`tuning.sim.core`, which composes one module per technique), so the scalar and
vectorised answers agree by construction. `from_run_config` maps an engine run config (the
built-in GPT or a Hugging Face `model.hf` config) onto the simulator's inputs.

Sources (docs/simulator.md gives the equations):
- FLOPs per layer and per iteration: Narayanan et al. 2021, sec. 5.1 (formulas.md).
- Pipeline bubble (p-1)/m and (p-1)/(v m): same paper, sec. 2.2.
- Tensor-parallel all-reduces per layer: Shoeybi et al. 2019; sequence parallel: Korthikanti
  et al. 2022.
- Model-state memory by ZeRO stage: Rajbhandari et al. 2020; activations: Korthikanti et al.
  2022, eqs. 1-3 and sec. 4.2.3 (interleaved first stage).
- Collective times: alpha-beta model with nccl-tests bus factors.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from engine.config.validate import VIRTUAL_SCHEDULES
from engine.config.validate import divisors as _divisors
from tuning.sim import context as sim_context, moe as sim_moe
from tuning.sim.hardware import ClusterSpec
from tuning.sim.compute import NONGEMM_BWD_FACTOR
from tuning.sim.core import OPTIMIZER_BYTES_PER_PARAM, evaluate_arrays
from tuning.sim.framework import FRAMEWORK_NAMES
from tuning.sim.memory import CATEGORIES, dominant, tracker_categories
from tuning.sim.memory import TERMS as MEMORY_TERMS
from tuning.sim.spec import RECOMPUTE, SCHEDULES, ModelSpec, ParallelSpec, SimResult, columns, format_count

_arrays = columns  # the name published.py and sim/network.py have used

__all__ = [
    "NONGEMM_BWD_FACTOR", "OPTIMIZER_BYTES_PER_PARAM", "RECOMPUTE", "SCHEDULES", "ModelSpec", "ParallelSpec",
    "SimResult", "columns", "evaluate_arrays", "format_count", "from_run_config", "model_shape", "simulate",
    "validate_parallel",
]


# ---------------------------------------------------------------- validation

def _choices(values: list[int]) -> str:
    shown = [str(v) for v in values[:8]]
    return ", ".join(shown[:-1]) + f" or {shown[-1]}" if len(shown) > 1 else shown[0]


def validate_parallel(
    model: ModelSpec, cluster: ClusterSpec, par: ParallelSpec, *, gpus: int | None = None
) -> list[str]:
    """Every reason `par` cannot run `model` on `cluster` (empty when valid)."""
    reasons = [f"{k}={v} must be >= 1" for k, v in
               (("parallel.dp", par.dp), ("parallel.tp", par.tp), ("parallel.pp", par.pp),
                ("parallel.virtual", par.virtual), ("batch.micro", par.micro),
                ("batch.global", par.global_batch)) if v < 1]
    if reasons:
        return reasons
    if gpus is not None and par.gpus != gpus:
        cp = f" * cp({par.cp})" if par.cp != 1 else ""
        reasons.append(f"dp({par.dp}) * tp({par.tp}) * pp({par.pp}){cp} = {par.gpus} != gpus({gpus})")
    if cluster.total_gpus is not None and par.gpus > cluster.total_gpus:
        reasons.append(f"{par.gpus} GPUs asked but cluster {cluster.name} has {cluster.total_gpus}")
    if model.heads % par.tp:
        reasons.append(f"parallel.tp={par.tp} must divide model.heads={model.heads}; "
                       f"try {_choices(_divisors(model.heads))}")
    if model.kv_heads and model.kv % par.tp:
        reasons.append(f"parallel.tp={par.tp} must divide the key/value heads ({model.kv}; grouped-query "
                       f"attention); try {_choices(_divisors(model.kv))}")
    if model.heads % model.kv:
        reasons.append(f"model key/value heads={model.kv} must divide model.heads={model.heads}")
    if not model.head_dim and model.hidden % model.heads:
        reasons.append(f"model.heads={model.heads} must divide model.d_model={model.hidden}")
    chunks = par.pp * par.virtual
    split = model.layers + (2 if par.account_for_embedding_and_loss and par.pp > 1 else 0)  # + embedding, loss
    if split % chunks:
        reasons.append(f"model.layers={model.layers}{' + 2' if split != model.layers else ''} must be divisible by "
                       f"parallel.pp * parallel.virtual = {par.pp} * {par.virtual} = {chunks}")
    if par.global_batch % (par.dp * par.micro):
        reasons.append(f"batch.global={par.global_batch} must be divisible by parallel.dp * "
                       f"batch.micro = {par.dp} * {par.micro} = {par.dp * par.micro}")
    elif par.schedule in ("interleaved", "modular", "zero_bubble") and (par.global_batch // (par.dp * par.micro)) % par.pp:
        reasons.append(f"{par.schedule} schedule needs the micro-batch count "
                       f"{par.global_batch // (par.dp * par.micro)} divisible by parallel.pp={par.pp}")
    elif par.schedule == "dualpipev" and par.global_batch // (par.dp * par.micro) < 2 * par.pp:
        reasons.append(f"dualpipev needs at least 2 * parallel.pp = {2 * par.pp} micro-batches")
    if par.schedule in ("zbv", "dualpipev") and model.layers % (2 * par.pp):
        reasons.append(f"{par.schedule} needs model.layers={model.layers} divisible by 2 * parallel.pp = {2 * par.pp}")
    if par.schedule not in ("1f1b", "gpipe", "interleaved") and par.pp == 1:
        reasons.append(f"parallel.schedule={par.schedule!r} needs parallel.pp > 1")
    if par.schedule == "skip" and par.pp < 3:
        reasons.append("parallel.schedule='skip' needs parallel.pp >= 3")
    reasons += _validate_knobs(model, par)
    return reasons + sim_moe.validate(model, par) + sim_context.validate(model, par)


def _validate_knobs(model: ModelSpec, par: ParallelSpec) -> list[str]:
    reasons = []
    if par.zero not in (0, 1, 2, 3):
        reasons.append(f"parallel.zero={par.zero} must be 0, 1, 2 or 3")
    if par.recompute not in RECOMPUTE:
        reasons.append(f"recompute={par.recompute!r} must be one of {RECOMPUTE}")
    if par.schedule not in SCHEDULES:
        reasons.append(f"parallel.schedule={par.schedule!r} must be one of {SCHEDULES}")
    if par.virtual > 1 and par.schedule not in VIRTUAL_SCHEDULES:
        reasons.append(f"parallel.virtual={par.virtual} needs parallel.schedule in {VIRTUAL_SCHEDULES}")
    if par.virtual > 1 and par.pp == 1:
        reasons.append(f"parallel.virtual={par.virtual} needs parallel.pp > 1")
    if par.sequence_parallel and model.seq % par.tp:
        reasons.append(f"sequence parallel needs parallel.tp={par.tp} to divide model.seq_len={model.seq}")
    if not par.compression_ratio > 0.0:  # < 1: an all_gather compressor at large dp sends more than dense
        reasons.append(f"compression_ratio={par.compression_ratio} must be > 0")
    if par.dtype_bytes not in (1, 2, 4):
        reasons.append(f"dtype_bytes={par.dtype_bytes} must be 1, 2 or 4")
    if par.framework not in FRAMEWORK_NAMES:
        reasons.append(f"framework={par.framework!r} must be one of {', '.join(FRAMEWORK_NAMES)}")
    if par.attention_unpad and not par.flash_attention:
        reasons.append("parallel.attention_unpad=True needs parallel.flash_attention=True (it wraps the fused kernel)")
    return reasons


_BREAKDOWN = ("compute", "tp_comm", "pp_comm", "bubble", "dp_comm_exposed", "optimizer", "straggler")
_MEMORY = CATEGORIES  # params, grads, optimizer, activations, temp (torch MemTracker's categories)


def simulate(model: ModelSpec, cluster: ClusterSpec, par: ParallelSpec, *,
             gpus: int | None = None, frameworks: Any = None) -> SimResult:
    """Simulate one iteration of `par`; raises ValueError listing every reason it is invalid. `frameworks`
    replaces the flavour presets (a fit's terms: `tuning.sim.framework.with_terms`)."""
    reasons = validate_parallel(model, cluster, par, gpus=gpus)
    if reasons:
        raise ValueError("invalid parallel config: " + "; ".join(reasons))
    out = evaluate_arrays(model, cluster, par.gpus, columns(par), frameworks=frameworks)
    r = {k: np.asarray(v).item() for k, v in out.items()}
    result = SimResult(
        iteration_time_s=r["iteration_time_s"],
        breakdown={k: r[f"{k}_s"] for k in _BREAKDOWN},
        tokens_per_s=r["tokens_per_s"], tflops_per_gpu=r["tflops_per_gpu"], mfu=r["mfu"],
        memory_per_gpu_gb=r["memory_per_gpu_gb"],
        memory_breakdown_gb={k: r[f"mem_{k}_gb"] for k in _MEMORY},
        fits=bool(r["fits"]), flops_per_iteration=r["flops_per_iteration"],
        model_flops_per_iteration=r["model_flops_per_iteration"],
        num_microbatches=int(r["num_microbatches"]), bubble_fraction=r["bubble_fraction"],
        dp_comm_total_s=r["dp_comm_total_s"],
        extra={"params_per_gpu": r["params_per_gpu"], "params_total": model.params,
               **_memory_extra(r, par)},
    )
    if model.experts:  # issue 18: the MoE all_to_all as its own entry, active vs total parameters
        result.breakdown["all_to_all"] = r["all_to_all_s"]
        result.extra.update(params_active=model.active_params, expert_params_per_gpu=r["expert_params_per_gpu"])
    if par.cp > 1:  # issue 19: context-parallel communication (exposed)
        result.breakdown["cp_comm"] = r["cp_comm_s"]
    return result


def _memory_extra(r: dict[str, Any], par: ParallelSpec) -> dict[str, Any]:
    """The memory model's per-term breakdown (GB), its largest term, the pipeline rank it prices and its
    tensors in the categories torch's trackers report (FSDPMemTracker's where the layout is FSDP2-style
    sharding: the engine or FSDP at ZeRO-2/3; MemTracker's otherwise), for comparing a dry run."""
    terms = {name: r[f"mem_{name}_gb"] for names in MEMORY_TERMS.values() for name in names}
    fsdp = par.framework in ("engine", "fsdp") and par.zero >= 2
    return {"memory_terms_gb": terms, "memory_dominant": dominant(terms), "memory_stage": int(r["memory_stage"]),
            "memory_tracker": "FSDPMemTracker" if fsdp else "MemTracker",
            "memory_tracker_gb": tracker_categories(terms, fsdp)}


# ---------------------------------------------------------------- run config mapping

_PRECISION_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "fp16": 2, "float16": 2, "bfloat16": 2, "fp8": 1}


def compression_wire_bytes(cfg: dict[str, Any]) -> tuple[float, float]:
    """(wire, dense) bytes one dp rank sends per step for the gradients of the run config `cfg`:
    the engine's own accounting (engine.comm.compress.step_wire_bytes: the same collective,
    all_gather or all_reduce, and bytes as its hooks send) over the engine GPT's parameters
    in DDP's buckets. Top-k and int8 are all_gathers, so their bytes grow with dp - 1."""
    import torch

    from engine.comm.compress import step_wire_bytes
    from engine.config.schema import ModelConfig
    from engine.model.gpt import GPT

    mdl, comm = cfg.get("model", {}), cfg.get("comm", {})
    keys = ("layers", "d_model", "heads", "seq_len", "vocab", "mlp_ratio")
    with torch.device("meta"):  # shapes only, no memory
        model = GPT(ModelConfig(**{k: mdl[k] for k in keys if k in mdl}))
    shapes = [tuple(p.shape) for p in model.parameters()]  # parameters(): the tied weight once
    return step_wire_bytes(str(comm.get("compressor", "none")), shapes, int(cfg.get("parallel", {}).get("dp", 1)),
                           density=float(comm.get("density", 0.01)), rank=int(comm.get("rank", 4)),
                           bucket_cap_mb=float(cfg.get("ddp", {}).get("bucket_cap_mb", 25.0)))


def _compression_ratio(cfg: dict[str, Any]) -> float:
    """Dense / wire bytes of the gradient collective at the config's dp (below 1 when an
    all_gather compressor sends more than a dense all_reduce would)."""
    if cfg.get("comm", {}).get("compressor", "none") == "none" or int(cfg.get("parallel", {}).get("dp", 1)) < 2:
        return 1.0
    wire, dense = compression_wire_bytes(cfg)
    return dense / wire if wire > 0 else 1.0


def from_run_config(cfg: dict[str, Any]) -> tuple[ModelSpec, ParallelSpec]:
    """Map a plain nested run-config dict (engine/config/schema.py key names) to the simulator's inputs.

    Reads model.{layers,d_model,heads,seq_len,vocab,mlp_ratio} (the engine's GPT: no biases on its
    linear layers, `engine.model.shapes.from_gpt`) or model.hf (a Hugging Face config path or mapping,
    `engine.model.shapes.from_hf_config`, at model.seq_len tokens), parallel.{dp,tp,pp,zero,virtual,schedule,
    sequence_parallel,reshard_after_forward}, batch.{global,micro}, train.activation_checkpointing, precision,
    comm.{compressor,density,rank}, co2.enabled, ddp.bucket_cap_mb; missing keys take the
    engine's defaults. Issue 18: model.{experts,moe_every,top_k,capacity_factor}, parallel.ep,
    comm.{moe_hierarchical,moe_compression}; issue 19: parallel.{cp,cp_impl,adaptive_sp} and
    data.{lengths,length_mean,length_sigma,length_max} (the long-tail attention density).
    """
    mdl, par, batch = cfg.get("model", {}), cfg.get("parallel", {}), cfg.get("batch", {})
    train, comm, ddp = cfg.get("train", {}), cfg.get("comm", {}), cfg.get("ddp", {})
    model = _run_model(mdl)
    spec = ParallelSpec(
        dp=int(par.get("dp", 1)), tp=int(par.get("tp", 1)), pp=int(par.get("pp", 1)),
        virtual=int(par.get("virtual", 1)), zero=int(par.get("zero", 0)),
        schedule=str(par.get("schedule", "1f1b")),
        sequence_parallel=bool(par.get("sequence_parallel", False)),
        micro=int(batch.get("micro", 4)), global_batch=int(batch.get("global", 8)),
        recompute=bool(train.get("activation_checkpointing", False)),
        dtype_bytes=_PRECISION_BYTES.get(str(cfg.get("precision", "fp32")), 4),
        compression_ratio=_compression_ratio(cfg),
        co2=bool(cfg.get("co2", {}).get("enabled", False)),
        bucket_mb=float(ddp.get("bucket_cap_mb", 25.0)),
        zero1_allreduce=True,  # the engine's ZeRO-1 is ZeroRedundancyOptimizer behind DDP
        zero2_fsdp=True,  # the engine's ZeRO-2 is FSDP2 per block with reshard_after_forward=False
        flash_attention=True,  # the engine's attention is scaled_dot_product_attention (fused, no s x s scores)
        reshard_after_forward=bool(par.get("reshard_after_forward", True)),
        framework="engine",  # host costs live in the calibrated profile
    )
    spec.ep, spec.cp, spec.cp_impl = int(par.get("ep", 1)), int(par.get("cp", 1)), str(par.get("cp_impl", "ulysses"))
    spec.adaptive_sp = bool(par.get("adaptive_sp", False))
    spec.moe_hierarchical = bool(comm.get("moe_hierarchical", False))
    spec.moe_a2a_ratio = sim_moe.LSH_A2A_RATIO if comm.get("moe_compression", "none") == "lsh" else 1.0
    spec.moe_padded = False  # the engine dispatches with variable splits, dropping beyond capacity
    spec.attn_density = sim_context.density_from_config(cfg.get("data", {}), model.seq)
    return model, spec


def _run_model(mdl: dict[str, Any]) -> ModelSpec:
    """The run config's model: a Hugging Face config (`model.hf`) or the engine's GPT (`model.*`)."""
    seq = int(mdl.get("seq_len", 64))
    if mdl.get("hf"):
        return ModelSpec.from_hf(mdl["hf"], seq=seq)
    from engine.model.shapes import from_gpt

    shape = from_gpt(layers=int(mdl.get("layers", 2)), d_model=int(mdl.get("d_model", 64)), heads=int(mdl.get("heads", 4)),
                     seq_len=seq, vocab=int(mdl.get("vocab", 256)), mlp_ratio=int(mdl.get("mlp_ratio", 4)),
                     experts=int(mdl.get("experts", 0)), top_k=int(mdl.get("top_k", 2)),
                     moe_every=int(mdl.get("moe_every", 1)))
    return ModelSpec.from_shape(shape, seq=seq, capacity_factor=float(mdl.get("capacity_factor", 1.25)))


def model_shape(cfg: dict[str, Any]) -> dict[str, Any]:
    """The run config's model as the simulator prices it (engine/model/shapes.py's fields, the sequence length and
    the parameter counts): what an export carries so the shape travels with the layout."""
    import dataclasses

    model = _run_model(cfg.get("model", {}))
    return {**dataclasses.asdict(model.shape), "seq": model.seq, "params": model.params,
            "active_params": model.active_params}
