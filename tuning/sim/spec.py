"""The simulator's inputs and result: a model shape, a parallel configuration, a priced iteration.

`ModelSpec` is the simulator's view of `engine.model.shapes.ModelShape` (the one source of a model's
shape and counts): parameters and FLOPs per token come from the shape, so a GPT, a Llama-style
model with grouped-query attention and SwiGLU, or a Mixtral-style MoE are priced from the same
numbers the engine and the memory estimate use. `ParallelSpec` names follow the run config's
`parallel.*` and `batch.*` keys. `columns(par)` turns one configuration into the 0-d arrays the
vectorised core (`tuning.sim.core.evaluate_arrays`) takes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.mesh import world_size
from engine.model.shapes import ModelShape, from_hf_config, moe_layer_indices

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "gpipe", "interleaved", "looped_bfs", "modular", "zero_bubble", "zbv", "dualpipev", "skip")
CP_IMPLS = ("ulysses", "ring")  # codes 0, 1 in evaluate_arrays' columns
# fused-attention kernel a row calls: "" the framework's own (tuning/sim/framework.py), or one with measured
# rates in tuning/data/kernels.yaml (NeMo picks with NVTE_FUSED_ATTN / NVTE_FLASH_ATTN; llm-foundry with attn_impl:
# "triton" is Tri Dao's Triton FlashAttention); codes 0, 1, 2, 3
ATTENTION_KERNELS = ("", "fa2", "cudnn", "triton")


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelSpec:
    """A decoder-only model; names follow the run config's `model.*` keys (hidden = model.d_model).

    The defaults describe Megatron-LM's GPT (LayerNorm, GELU MLP of 4h, biases on every linear
    layer, learned positions, tied head), whose counts are Narayanan et al. 2021's
    12 l h^2 + 13 l h + V h + s h. `from_shape` / `from_hf` read a Hugging Face model instead.
    """

    layers: int  # transformer blocks (model.layers)
    hidden: int  # hidden size h (model.d_model)
    heads: int  # query heads a (model.heads)
    seq: int  # sequence length s (model.seq_len)
    vocab: int  # vocabulary size V (model.vocab)
    experts: int = 0  # routed experts per MoE block, 0 = dense (model.experts; tuning/sim/moe.py)
    moe_every: int = 1  # every moe_every-th block is MoE (model.moe_every)
    top_k: int = 2  # experts per token (model.top_k)
    capacity_factor: float = 1.25  # expert capacity / mean share, 0 = unlimited (model.capacity_factor)
    kv_heads: int = 0  # key/value heads (grouped-query attention when < heads); 0 = heads
    head_dim: int = 0  # per-head width; 0 = hidden / heads
    ffn_hidden: int = 0  # MLP width of a dense block; 0 = 4 hidden
    gated_mlp: bool = False  # SwiGLU (gate, up, down) instead of a GELU MLP (up, down)
    tied_embeddings: bool = True  # the head shares the embedding matrix
    learned_positions: bool = True  # a learned position table (GPT); False for RoPE (no parameters)
    biases: bool = True  # biases on the linear layers (Megatron-LM GPT: yes; the engine's GPT and Llama: no)
    norm_params: int = 2  # parameters per hidden unit of a norm: 2 LayerNorm, 1 RMSNorm
    dropout: bool = True  # dropout after attention and MLP and on the scores (Megatron-LM GPT; MPT, Llama: none)
    moe_ffn_hidden: int = 0  # width of one routed expert; 0 = ffn_hidden
    shared_ffn_hidden: int = 0  # width of an always-active shared expert (qwen2_moe); 0 = none
    family: str = "gpt"  # "gpt" or a Hugging Face model_type
    # per-layer biases where they differ from `biases` (None = `biases`): Qwen2's q/k/v only, ...
    qkv_bias: bool | None = None  # biases on q, k and v
    o_bias: bool | None = None  # bias on the attention output projection
    mlp_bias: bool | None = None  # biases on the MLP's matrices
    qk_norm: bool = False  # a norm of head width on q and on k (Qwen3)

    # ------------------------------------------------------------ derived widths
    @property
    def kv(self) -> int:
        """Key/value heads."""
        return self.kv_heads or self.heads

    @property
    def hd(self) -> int:
        """Width of one head."""
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of the attention output): heads x head width."""
        return self.heads * self.hd

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values): key/value heads x head width."""
        return self.kv * self.hd

    @property
    def ffn(self) -> int:
        """MLP width of a dense block."""
        return self.ffn_hidden or 4 * self.hidden

    @property
    def expert_ffn(self) -> int:
        """MLP width of one routed expert."""
        return self.moe_ffn_hidden or self.ffn

    @property
    def mlp_mats(self) -> int:
        """Weight matrices of an MLP: 3 for SwiGLU, 2 for GELU."""
        return 3 if self.gated_mlp else 2

    # ------------------------------------------------------------ counts (engine/model/shapes.py)
    @property
    def shape(self) -> ModelShape:
        """The same model as an `engine.model.shapes.ModelShape` (the one source of counts)."""
        moe = moe_layer_indices(self.layers, experts=self.experts, moe_every=self.moe_every)
        return ModelShape(
            family=self.family, layers=self.layers, hidden=self.hidden, heads=self.heads, kv_heads=self.kv,
            head_dim=self.hd, ffn_hidden=self.ffn, gated_mlp=self.gated_mlp, vocab=self.vocab,
            tied_embeddings=self.tied_embeddings, learned_positions=self.seq if self.learned_positions else 0,
            norm_params=self.norm_params, qkv_bias=self._bias(self.qkv_bias), o_bias=self._bias(self.o_bias),
            mlp_bias=self._bias(self.mlp_bias), qk_norm=self.qk_norm, experts=self.experts, top_k=min(self.top_k, self.experts) if self.experts else 0,
            moe_ffn_hidden=self.expert_ffn, shared_ffn_hidden=self.shared_ffn_hidden, moe_layers=moe)

    def _bias(self, flag: bool | None) -> bool:
        return self.biases if flag is None else flag

    @property
    def params(self) -> int:
        """Every parameter (each expert once, a tied head once), from `engine.model.shapes`."""
        return self.shape.params

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (top_k experts per MoE block)."""
        return self.shape.active_params

    @property
    def dense_layer_params(self) -> int:
        """Parameters of one dense block (attention, MLP, norms, biases)."""
        return self.shape.dense_layer_params

    @property
    def layer_matmul_params(self) -> int:
        """Weights a token multiplies by in one dense block: q, k, v, o and the MLP matrices (engine/model/shapes.py)."""
        return self.shape.layer_matmul_params

    @property
    def param_tensors_per_layer(self) -> int:
        """Parameter tensors of one dense block (what a per-parameter ZeRO-3 gathers one by one):
        q/k/v (fused in Megatron), o, the MLP matrices, two norms, and their biases."""
        weights = 2 + self.mlp_mats + 2  # qkv, o, mlp matrices, 2 norm weights
        biases = self._bias(self.qkv_bias) + self._bias(self.o_bias) + self.mlp_mats * self._bias(self.mlp_bias)
        return weights + biases + (2 if self.norm_params == 2 else 0) + (2 if self.qk_norm else 0)

    # ------------------------------------------------------------ readers
    @classmethod
    def from_shape(cls, shape: ModelShape, *, seq: int, capacity_factor: float = 1.25) -> ModelSpec:
        """The simulator's model for a `ModelShape` (a Hugging Face config, the engine's GPT) at `seq`."""
        moe_every = _moe_every(shape)
        return cls(layers=shape.layers, hidden=shape.hidden, heads=shape.heads, seq=seq, vocab=shape.vocab,
                   experts=shape.experts, moe_every=moe_every, top_k=shape.top_k or 2,
                   capacity_factor=capacity_factor, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                   ffn_hidden=shape.ffn_hidden, gated_mlp=shape.gated_mlp, tied_embeddings=shape.tied_embeddings,
                   learned_positions=shape.learned_positions > 0,
                   biases=shape.qkv_bias and shape.o_bias and shape.mlp_bias, qkv_bias=shape.qkv_bias,
                   o_bias=shape.o_bias, mlp_bias=shape.mlp_bias, qk_norm=shape.qk_norm, norm_params=shape.norm_params,
                   moe_ffn_hidden=shape.moe_ffn_hidden, shared_ffn_hidden=shape.shared_ffn_hidden,
                   family=shape.family, dropout=shape.family == "gpt")

    @classmethod
    def from_hf(cls, source: str | Path | dict[str, Any], *, seq: int | None = None) -> ModelSpec:
        """A Hugging Face `config.json` (path or mapping) at `seq` tokens (default: the config's
        `max_position_embeddings`, at most 8192)."""
        shape = from_hf_config(source)
        data = source if isinstance(source, dict) else None
        if seq is None:
            if data is None:
                from engine.model.shapes import read_hf_config

                data = read_hf_config(source)
            seq = min(int(data.get("max_position_embeddings") or 4096), 8192)
        return cls.from_shape(shape, seq=seq)


def _moe_every(shape: ModelShape) -> int:
    """The stride of a regular MoE layer pattern (every k-th block, 1-based); 1 for a dense model."""
    from engine.errors import ConfigError

    if not shape.experts:
        return 1
    moe = shape.moe_layers
    for k in range(1, shape.layers + 1):
        if tuple(range(k - 1, shape.layers, k)) == tuple(moe):
            return k
    raise ConfigError("model.hf", f"MoE layers {list(moe)}",
                      "the simulator prices every k-th block as MoE; this pattern is irregular")


def format_count(n: float) -> str:
    """A parameter count in the unit that fits: 3.3M, 1.7B, 1.0T (3 significant digits below 10)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.1f}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return f"{n:.0f}"


@dataclass(kw_only=True, slots=True)
class ParallelSpec:
    """One parallel configuration; names follow `parallel.*` and `batch.*` of the run config."""

    dp: int = 1  # data-parallel degree
    tp: int = 1  # tensor-parallel degree
    pp: int = 1  # pipeline-parallel degree
    virtual: int = 1  # model chunks per pipeline rank (>1 means the interleaved schedule)
    micro: int = 1  # micro-batch size, samples (batch.micro)
    global_batch: int = 1  # samples per optimizer step (batch.global)
    zero: int = 0  # ZeRO stage 0-3
    recompute: str | bool = "none"  # activation recomputation: none | selective | full (bool ok)
    sequence_parallel: bool = False  # shard norms/dropout activations over tp
    compression_ratio: float = 1.0  # dense all_reduce / wire bytes of the gradient collective at this dp
    co2: bool = False  # CO2: the gradient all-reduce is asynchronous and fully hidden
    schedule: str = "1f1b"  # 1f1b | gpipe | interleaved | ... (SCHEDULES)
    dtype_bytes: int = 2  # bytes per parameter, gradient and activation (2 = bf16/fp16)
    overlap_dp: bool = True  # overlap gradient collectives with backward (DDP buckets)
    # Megatron-core --tp-comm-overlap (Transformer Engine userbuffers): each tensor-parallel all-gather /
    # reduce-scatter runs in chunks under the GEMM it feeds or follows (needs sequence_parallel)
    tp_comm_overlap: bool = False
    bucket_mb: float = 25.0  # gradient bucket size, MB (the last bucket is never hidden)
    zero1_allreduce: bool = False  # ZeRO-1 as torch's ZeroRedundancyOptimizer: all-reduce, then broadcast shards
    zero2_fsdp: bool = False  # ZeRO-2 as FSDP2 with reshard_after_forward=False: per-block gather in forward, RS in backward
    flash_attention: bool = False  # fused attention: no s x s scores in memory; causal blocks skipped; Q K^T recomputed
    attention_kernel: str = ""  # which fused kernel (ATTENTION_KERNELS); "" = the framework's
    reshard_after_forward: bool = True  # ZeRO-3: free gathered blocks after forward (False: no backward gather)
    framework: str = "megatron"  # the training framework's flavour (tuning/sim/framework.py FRAMEWORKS)
    # issue 18, MoE (tuning/sim/moe.py)
    ep: int = 1  # expert-parallel degree, carved from dp (divides dp and model.experts)
    moe_hierarchical: bool = False  # all_to_all inside the node first, then across nodes
    moe_a2a_ratio: float = 1.0  # dense / wire bytes of the MoE all_to_all (LSH-MoE compression)
    moe_padded: bool = True  # capacity-padded expert buffers (GShard, DeepSpeed); False: variable splits (the engine)
    moe_imbalance: float = 1.0  # routed tokens of the busiest expert rank / the mean
    # issue 19, context parallelism (tuning/sim/context.py)
    cp: int = 1  # context-parallel degree: each sequence over cp ranks (world = dp tp pp cp)
    cp_impl: str = "ulysses"  # ulysses (all-to-all) | ring (K/V blocks, overlapped)
    attn_density: float = 1.0  # computed share of the s x s attention (packed long-tail batches)
    adaptive_sp: bool = False  # FlexSP per-step groups (engine); priced as the static cp (not modelled)
    skip_ratio: float = 0.0  # schedule=skip: fraction of middle stages a micro-batch skips (SkipPipe)
    # the embedding and the loss each take a layer's place in the pipeline split: the first and the last
    # stage hold one layer fewer (Megatron-core --account-for-{embedding,loss}-in-pipeline-split; Llama 3)
    account_for_embedding_and_loss: bool = False
    # gradients accumulated in an fp32 buffer: -1 the framework's default (Megatron-LM: yes with bf16,
    # --accumulate-allreduce-grads-in-fp32; DeepSpeed fp16: no; FSDP under torch's pipelining: unsharded
    # until the last micro-batch), 0 no (NeMo's grad_reduce_in_fp32=False; FSDP reduce-scattering every
    # micro-batch), 1 yes (DeepSpeed's BF16_Optimizer: an fp32 buffer beside the 16-bit grads); tuning/sim/memory.py
    grad_accum_fp32: int = -1
    # a gated MLP's activation function fused (-1 the framework's default: Megatron-core's bias-SwiGLU keeps
    # fc1's output and fc2's input, 6 f/h; eager PyTorch also keeps silu(gate) and up apart, 8 f/h), 0 no, 1 yes
    fused_swiglu: int = -1
    # the tensor a pipeline stage receives is freed once its forward has run (Llama 3, sec. 3.3.2: "we
    # proactively deallocate tensors that will not be used for future computation, including the input and
    # output tensors of each pipeline stage"): the chunk's first layer keeps no copy of it (its norm saves
    # its output instead, as Apex's memory_efficient norms do); without full recomputation, which needs it
    free_stage_input: bool = False
    # NeMo 24.x's optim.name=distributed_fused_adam (Apex DistributedFusedAdam through NeMo's
    # MegatronDistributedFusedAdam): its optim.dtype in bytes, 4 fp32 (NeMo's default) or 2 bf16; 0 = the
    # framework's own optimizer. The gradient buffer is in optim.grad_sync_dtype (default: optim.dtype; 0 in
    # grad_accum_fp32 = bf16); tuning/sim/memory.py
    dist_adam: int = 0
    # bytes per element the gradients are reduced in, where the framework's mixed precision says (FSDP's
    # MixedPrecision reduce_dtype: Composer >= 0.16.4's DEFAULT reduces in fp32, 4); 0 = the row's dtype
    reduce_bytes: int = 0
    # micro-batches whose output-layer weight gradient the last pipeline stage defers to the flush, keeping
    # each one's logit gradient and input (Megatron-core defer_embedding_wgrad_compute with its
    # wgrad_deferral_limit); 0 = not deferred
    defer_embedding_wgrad: int = 0
    # fused attention through FlashAttention's varlen kernel behind flash-attn's bert_padding, as
    # llm-foundry's flash_attn_fn runs it: q, k and v gathered by unpad_input, the output scattered back by
    # pad_input, and the reverse in backward; their bytes priced as memory-bound (tuning/sim/compute.py)
    attention_unpad: bool = False
    # the loss as Megatron's vocab_parallel_cross_entropy runs without --cross-entropy-loss-fusion (Megatron-LM's
    # default): 52 bytes a logit against the fused 24 (tuning/sim/compute.py UNFUSED_LOSS_BYTES_PER_LOGIT)
    unfused_loss: bool = False
    # Transformer Engine FP8 (delayed or current scaling): the transformer blocks' linear-layer GEMMs (fprop, dgrad,
    # wgrad) at the GPU's FP8 rate, their inputs and output gradients cast by memory-bound kernels, FP8 weight copies
    # held (tuning/sim/compute.py, sim/memory.py); attention, norms, the output layer and the loss stay 16-bit;
    # refused on a GPU without an FP8 rate (tuning/data/kernels.yaml)
    fp8: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.recompute, bool):
            self.recompute = "full" if self.recompute else "none"
        if self.virtual > 1 and self.schedule == "1f1b":
            self.schedule = "interleaved"

    @property
    def gpus(self) -> int:
        """dp * tp * pp * cp."""
        return world_size(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp)


# published.yaml's name for a key (the rows say `attention`, the spec `attention_kernel`)
KEY_ALIASES = {"attention": "attention_kernel"}


def parallel_spec(**keys: Any) -> ParallelSpec:
    """A ParallelSpec from named keys (ParallelSpec's fields, or their KEY_ALIASES) on the flavour's defaults
    (tuning/sim/framework.py FLAVOUR_DEFAULTS): what `framework` runs unless a key says otherwise. The one
    constructor of published rows, `simulate --config` and the plan's knobs (ValueError: an unknown key)."""
    from tuning.sim.framework import FLAVOUR_DEFAULTS, framework_code

    keys = {KEY_ALIASES.get(k, k): v for k, v in keys.items()}
    unknown = sorted(set(keys) - set(PARALLEL_KEYS))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}: the keys are {', '.join(sorted(PARALLEL_KEYS))}")
    framework = str(keys.get("framework", ParallelSpec.__dataclass_fields__["framework"].default))
    framework_code(framework)  # ValueError naming the flavours
    return ParallelSpec(**(dict(FLAVOUR_DEFAULTS[framework]) | keys))


@dataclass(kw_only=True, slots=True)
class SimResult:
    """Simulated iteration; times in s, memory in GB (1e9 bytes), rates per GPU."""

    iteration_time_s: float
    breakdown: dict[str, float]  # compute, tp_comm, pp_comm, bubble, dp_comm_exposed, optimizer, straggler (s)
    tokens_per_s: float
    tflops_per_gpu: float  # executed FLOPs (recomputation included, as Megatron reports) / s / GPU
    mfu: float  # model FLOPs (no recomputation) / (time * gpus * peak)
    memory_per_gpu_gb: float  # the most loaded pipeline stage
    memory_breakdown_gb: dict[str, float]  # params, grads, optimizer, activations, temp (tuning/sim/memory.py)
    fits: bool  # memory_per_gpu_gb <= usable device memory
    flops_per_iteration: float  # executed FLOPs of one iteration, all GPUs
    model_flops_per_iteration: float  # without recomputation
    num_microbatches: int  # per pipeline (gradient accumulation steps)
    bubble_fraction: float  # bubble time / ideal pipeline time
    dp_comm_total_s: float  # data-parallel traffic time before overlap
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (used by `workbench simulate --json`)."""
        return {name: getattr(self, name) for name in self.__slots__}


PARALLEL_KEYS = {f.name: f.type for f in dataclasses.fields(ParallelSpec)}  # name -> annotation (a string)


def columns(par: ParallelSpec) -> dict[str, np.ndarray]:
    """One configuration as the 0-d arrays `evaluate_arrays` takes (categorical fields as codes)."""
    from tuning.sim.framework import framework_code

    plain = {f.name: getattr(par, f.name) for f in dataclasses.fields(par)}
    out = {k: np.asarray(v) for k, v in plain.items()
           if k not in ("recompute", "schedule", "cp_impl", "framework", "adaptive_sp", "attention_kernel")}
    for key in ("compression_ratio", "bucket_mb", "moe_a2a_ratio", "moe_imbalance", "attn_density", "skip_ratio"):
        out[key] = np.asarray(float(plain[key]))
    out["recompute"] = np.asarray(RECOMPUTE.index(str(par.recompute)))
    out["schedule"] = np.asarray(SCHEDULES.index(par.schedule))
    out["cp_impl"] = np.asarray(CP_IMPLS.index(par.cp_impl) if par.cp_impl in CP_IMPLS else -1)
    out["framework"] = np.asarray(framework_code(par.framework))
    if par.attention_kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention_kernel={par.attention_kernel!r} must be one of {ATTENTION_KERNELS}")
    out["attention_kernel"] = np.asarray(ATTENTION_KERNELS.index(par.attention_kernel))
    return out


def engine_rows(c: dict[str, np.ndarray]) -> np.ndarray:
    """Which rows price the workbench engine (`framework="engine"`): fp32 parameters, bf16 by autocast over
    them, or by FSDP2's mixed precision (`fsdp_bf16_rows`) (tuning/sim/zero.py, sim/tensor.py, sim/pipeline.py,
    sim/memory.py); False for a column set without a framework (the search's default flavour)."""
    from tuning.sim.framework import FRAMEWORK_NAMES

    return np.asarray(c.get("framework", -1)) == FRAMEWORK_NAMES.index("engine")


def fsdp_bf16_rows(c: dict[str, np.ndarray]) -> np.ndarray:
    """The engine's rows whose FSDP2 runs `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`
    (engine/parallel/parallelize.py fsdp_mp_policy: precision bf16 at ZeRO-2/3, applied where the ZeRO group has
    more than one rank and CO2 is off): FSDP2 gathers bf16 copies of the fp32 shards and the layers compute
    on them (bf16 hidden states, no autocast cache), gradients are reduced and accumulated in fp32."""
    return (engine_rows(c) & (np.asarray(c["dtype_bytes"]) == 2) & (np.asarray(c["zero"]) >= 2)
            & (np.asarray(c.get("dp", 1)) > 1) & ~np.asarray(c.get("co2", False), dtype=bool))


def comm_bytes(c: dict[str, np.ndarray], engine: Any = None) -> np.ndarray:
    """Bytes per element of the gradient collectives: the row's dtype, but 4 for the engine (fp32
    parameters: DDP all-reduces fp32 gradients; FSDP2 reduce-scatters fp32, also under its mixed precision,
    whose reduce dtype is fp32)."""
    return np.where(engine_rows(c) if engine is None else engine, 4, c["dtype_bytes"])


def reduce_bytes(c: dict[str, np.ndarray], engine: Any = None) -> np.ndarray:
    """Bytes per element of the gradient reduction: the row's `reduce_bytes` where it names one (FSDP's
    MixedPrecision reduce_dtype), else `comm_bytes`."""
    own, default = np.asarray(c.get("reduce_bytes", 0)), comm_bytes(c, engine)
    return np.where(own > 0, own, default) if np.any(own > 0) else default


def weight_bytes(c: dict[str, np.ndarray], engine: Any = None) -> np.ndarray:
    """Bytes per element of the weights the layers compute with, which is also what their hidden states and
    input gradients take: the row's dtype; for the engine 4 (autocast over fp32 parameters keeps an fp32
    residual stream; FSDP2 without a policy gathers fp32), but 2 where FSDP2 gathers bf16 copies
    (`fsdp_bf16_rows`): its all-gathers, its gathered copies, tp's backward all-reduces, pp's sends."""
    return np.where(fsdp_bf16_rows(c), 2, comm_bytes(c, engine))
