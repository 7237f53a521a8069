"""The training framework as an input of the simulator: what differs between Megatron-LM, DeepSpeed,
PyTorch FSDP and the workbench's own engine at the same layout, and the costs that flip choices.

Two kinds of difference:
- **Structural** (read from the framework's code, not fitted): DeepSpeed ZeRO stage 3 gathers
  parameters tensor by tensor (one collective per parameter, each with its own latency); FSDP
  gathers one flat buffer per wrapped block. Both pipelines send each tensor-parallel rank's 1/t
  slice of an activation (Megatron-LM's scatter/gather, Narayanan et al. 2021 sec. 4.1; DeepSpeed's
  `PipelineEngine` partitions it the same way by default, `pipeline.pipe_partitioned: True` in
  deepspeed/runtime/config.py).
- **Fixed costs** (fitted on every published row of the flavour, `tuning.sim.fit.fit_frameworks`; a
  term no row informs keeps the dataclass default below): host and launch work per layer and
  micro-batch and per micro-batch that GPU kernels do not hide (the Python instruction loop of
  DeepSpeed's pipeline engine, its activation-checkpointing bookkeeping, kernel launches of small
  blocks), the bytes its memory-bound kernels move, and the share of the link's bandwidth that its
  ZeRO collectives achieve. Kernel rates are measured hardware facts (tuning/data/kernels.yaml), not
  fitted to any framework's rows, so Megatron-LM has fixed costs of its own too (`FITTED`).
- **Memory held beyond the tensors** (`allocator_reserve`, fitted on the flavour's nvidia-smi readings of runs
  that ran, `tuning.sim.memory_facts.fit_allocator_reserve`; never on an out-of-memory fact): counted in the fit test,
  so a layout fits only where its tensors and this reserve do.

The engine's CPU profiles carry their host costs in the cluster (`overhead_*` fields measured by
`tuning.calibrate.calibration`), so on a CPU cluster the `engine` flavour adds nothing. On a GPU preset it runs
eager PyTorch as torchtitan and llm-foundry do (the same autograd, unfused norms, activations and dropout, one
kernel launch each), so it takes the `fsdp` flavour's per-layer fixed cost and memory-bound traffic (`EAGER`),
fitted on those published rows only. Out of sample, on the engine's own GPT-1B on one H100 at micro-batch 1-8 and
1-16 micro-batches a step (docs/data/gpu_microbatch_2026-11-28), it prices -11..+6% where the kernels alone
priced -15..-43%, and ranks micro-batch sizes as they ran where the kernels alone priced them alike.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True, slots=True)
class Framework:
    """One framework flavour: structure (read) and fixed costs (fitted on its published rows; the defaults
    here are what a term takes where no row informs it)."""

    name: str
    description: str
    zero3_per_parameter: bool = False  # ZeRO-3 gathers every parameter tensor on its own (DeepSpeed stage 3)
    # FSDP-style ZeRO-2 keeps the gathered parameters across the step's micro-batches: one all-gather
    # per block and step (the engine's `keep_gathered`), not one per block and micro-batch
    zero2_gather_once: bool = False
    # "fitted" below: for the flavours whose tuning.sim.fit.FRAMEWORK_FITS (or RESERVE_FITS) names the field;
    # every other flavour, and a fit where no row informs the field, keeps the default written here
    layer_microbatch_s: float = 0.0  # fitted: fixed s per layer and micro-batch (forward + backward)
    microbatch_s: float = 0.0  # fitted: fixed s per micro-batch on a pipeline stage
    zero3_bw_efficiency: float = 1.0  # fitted: share of the link's bus bandwidth ZeRO-3's collectives reach
    # fitted: share of a hidden block collective's time that the compute under it loses (NCCL kernels
    # take SMs and HBM bandwidth from the GEMMs they overlap)
    overlap_interference: float = 0.0
    dp_bw_efficiency: float = 1.0  # fitted: share of the link's bus bandwidth the ZeRO-0/1/2 gradient and parameter collectives reach
    # fitted: bytes the framework's memory-bound kernels (norms, activations, dropout, residuals,
    # softmax) move per activation byte the model counts: its kernel fusion (Megatron-LM fuses
    # bias-GeLU, bias-dropout-add and the scaled masked softmax; unfused eager ops read and write more)
    elementwise_traffic: float = 1.0
    # structural: the fused-attention kernel it calls on GPUs that have a measured rate for it
    # (tuning/data/kernels.yaml): "fa2" FlashAttention-2, "cudnn" Transformer Engine's cuDNN attention
    attention_kernel: str = "fa2"
    # structural: its blocks are Transformer Engine's fused modules (megatron-core): memory-bound traffic is
    # what those kernels read and write (tuning.sim.compute.fused_block_bytes), not the activation count
    fused_kernels: bool = False
    # structural: the distributed optimizer's parameter all-gather overlaps the next forward
    # (megatron-core --overlap-param-gather, which its recipes set beside --overlap-grad-reduce)
    overlap_param_gather: bool = False
    # structural: the elements of one data-parallel gradient bucket, each bucket reduced by a collective of its own
    # (tuning.sim.zero): 0 = the row's `bucket_mb` where its gradients are reduced under the backward (torch DDP's
    # bucket_cap_mb, 25 MB by default), one collective over the whole buffer where they are not (Megatron-LM's local
    # DDP). DeepSpeed: ZeRO's reduce_bucket_size, 5e8 elements ("Number of elements reduced/allreduced at a time",
    # deepspeed/runtime/zero/config.py); megatron-core's DDP: max(40,000,000, 1,000,000 x dp) elements with
    # --overlap-grad-reduce, one bucket without ("make buckets larger to ensure that chunks used in NCCL ring-reduce
    # implementations are large enough to remain bandwidth-bound rather than latency-bound",
    # NVIDIA/Megatron-LM@293e10419fd1b79c8680a0f4a206fc0a373729b5:
    # megatron/core/distributed/distributed_data_parallel.py)
    bucket_elems: float = 0.0
    bucket_elems_per_dp_rank: float = 0.0  # structural: elements a bucket grows by per dp rank (megatron-core, above)
    # fitted on memory readings, not end-to-end rows: the device memory its processes hold beyond the tensors the
    # memory model counts, as a share of those tensors -- the caching allocator's cached and fragmented blocks
    # (ZeRO, Rajbhandari et al. 2020 sec. 3.2: "out of memory issue with over 30% of memory still available";
    # GMLake, Guo et al. 2024: 15% of reserved memory on average in A100-80GB LLM training) and what the model
    # does not count; the median over the flavour's nvidia-smi readings of runs that ran
    # (tuning.sim.memory_facts.fit_allocator_reserve), 0 where it has none
    allocator_reserve: float = 0.0


# The fitted fields hold tuning.sim.fit.fit_frameworks() on every published row of the flavour
# (FITTED_TERMS; `simulate --validate` refits them without each source in turn).
FITTED = {
    "megatron": dict(layer_microbatch_s=0.002984, elementwise_traffic=2.271),
    "deepspeed": dict(layer_microbatch_s=0.00804, elementwise_traffic=3.99, dp_bw_efficiency=0.3016,
                      zero3_bw_efficiency=0.1056, overlap_interference=0.3714,
                      allocator_reserve=0.1168),
    "fsdp": dict(layer_microbatch_s=0.001029, elementwise_traffic=1.666, zero3_bw_efficiency=0.6202,
                 overlap_interference=0.4784),
    "megatron-core": dict(layer_microbatch_s=0.0001955, elementwise_traffic=2.657, microbatch_s=0.007973),
}
# eager PyTorch's fixed costs on a GPU (the `fsdp` flavour's, fitted on torchtitan's and llm-foundry's rows), which
# the workbench engine pays as they do (module docstring)
EAGER = {k: FITTED["fsdp"][k] for k in ("layer_microbatch_s", "elementwise_traffic")}
FRAMEWORKS: dict[str, Framework] = {f.name: f for f in (
    # Transformer Engine's fused attention calls cuDNN on H100 (A100 has only FlashAttention-2 measured)
    Framework(name="megatron", description="Megatron-LM / NeMo (PTD-P): scatter/gather pipeline sends, fused kernels",
              attention_kernel="cudnn", **FITTED["megatron"]),
    # all its terms fitted jointly on its rows: ZeRO-3's bandwidth share and overlap interference are what its
    # ZeRO-3 rows (Narayanan et al. 2021 Table 2) inform; they keep their defaults in a fit without those rows
    Framework(name="deepspeed", description="Megatron-DeepSpeed with DeepSpeed's PipelineEngine and ZeRO "
              "(stage 3 gathers per parameter)", zero3_per_parameter=True, bucket_elems=5e8, **FITTED["deepspeed"]),
    # Composer (llm-foundry) enters no_sync only for a DDP-wrapped model, so FSDP1's SHARD_GRAD_OP
    # syncs every micro-batch and then frees the unsharded parameters after backward: ZeRO-2 re-gathers
    # in each micro-batch's forward (composer/trainer/dist_strategy.py ddp_sync_context; FSDP1
    # _should_free_in_backward)
    Framework(name="fsdp", description="PyTorch FSDP (MosaicML llm-foundry, torchtitan): one flat gather per block",
              **FITTED["fsdp"]),
    Framework(name="engine", description="the workbench engine: eager PyTorch, as torchtitan runs it; a CPU "
              "profile holds its host costs", zero2_gather_once=True, **EAGER),
    # Megatron-core 0.8+ (2024: Megatron-LM's mcore models, NeMo 2, Megatron-Bridge): Transformer Engine
    # modules with fused norms, rotary, bias-activation and bias-dropout-add; cuDNN fused attention unless a
    # run names another kernel; the distributed optimizer's gathers under the forward. Its terms are fitted on
    # its own (H100) rows only: the 2021 Megatron-LM rows keep the "megatron" flavour.
    Framework(name="megatron-core", description="Megatron-core 2024+ (NeMo, Megatron-Bridge): Transformer Engine "
              "fused kernels, overlapped distributed optimizer", attention_kernel="cudnn", fused_kernels=True,
              overlap_param_gather=True, bucket_elems=4e7, bucket_elems_per_dp_rank=1e6, **FITTED["megatron-core"]),
)}
FRAMEWORK_NAMES = tuple(FRAMEWORKS)

# A flavour is a framework at a version: the knobs (ParallelSpec fields) its release runs unless a row or the user
# names others, as its published rows run it. `spec.parallel_spec` starts from these, so `simulate --config
# framework=NAME` and a plan for a target price what that framework runs by default.
FLAVOUR_DEFAULTS: dict[str, dict[str, object]] = {
    # Megatron-LM as of Narayanan et al. 2021 (PTD-P): materialised softmax attention, no overlap of tp collectives
    "megatron": {},
    # DeepSpeed today: its users' attention is fused (transformers' sdpa/flash_attention_2, Megatron-DeepSpeed's
    # --use-flash-attn-v2); the fitted terms are BigScience's 2022 runs
    "deepspeed": {"flash_attention": True},
    # torchtitan and llm-foundry: scaled_dot_product_attention's flash kernel; FSDP's ZeRO-2 is SHARD_GRAD_OP
    "fsdp": {"flash_attention": True, "zero2_fsdp": True},
    # the workbench engine: scaled_dot_product_attention; ZeRO-2 as FSDP2 without reshard_after_forward
    "engine": {"flash_attention": True, "zero2_fsdp": True},
    # Megatron-core 0.8+ as NVIDIA's recipes run it: Transformer Engine's fused (cuDNN) attention, the tp
    # collectives chunked under their GEMMs where sequence parallelism is on (--tp-comm-overlap), fused loss
    "megatron-core": {"flash_attention": True, "tp_comm_overlap": True},
}


def flavour_line(name: str, *, flash_attention: bool, attention_kernel: str = "") -> str:
    """One line naming the flavour priced and its attention kernel (what `simulate` and `plan` print)."""
    fw = FRAMEWORKS[name]
    kernel = (attention_kernel or fw.attention_kernel) if flash_attention else "unfused (s x s scores)"
    kernels = {"fa2": "FlashAttention-2", "cudnn": "cuDNN fused attention", "triton": "Triton FlashAttention"}
    return f"framework {name} ({fw.description}); attention: {kernels.get(kernel, kernel)}"


def framework_code(name: str) -> int:
    """The column code of a flavour (its index in FRAMEWORK_NAMES); ValueError names the choices."""
    if name not in FRAMEWORKS:
        raise ValueError(f"framework={name!r} must be one of {', '.join(FRAMEWORK_NAMES)}")
    return FRAMEWORK_NAMES.index(name)


def per_row(codes: np.ndarray, field: str, frameworks: dict[str, Framework] | None = None) -> np.ndarray:
    """The value of `field` for each row's framework code (vectorised lookup; a field holding an array,
    as a fit's grid does, broadcasts against the rows)."""
    table = frameworks or FRAMEWORKS
    codes = np.asarray(codes)
    choices = [np.asarray(getattr(table[name], field), dtype=float) for name in FRAMEWORK_NAMES]
    return np.select([codes == i for i in range(len(FRAMEWORK_NAMES))], choices, 0.0)


def with_terms(values: dict[str, float], frameworks: dict[str, Framework] | None = None) -> dict[str, Framework]:
    """The flavours with fitted `values` ("flavour.field": value) in their fields."""
    fws = dict(frameworks or FRAMEWORKS)
    for key, v in values.items():
        name, field = key.split(".")
        fws[name] = dataclasses.replace(fws[name], **{field: v})
    return fws
