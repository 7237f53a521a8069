"""Memory per GPU in the simulator: what the framework keeps on each pipeline stage, by term, and the
most loaded stage (a pure, vectorised function of the model, the cluster and the layout columns).

Terms, grouped in the categories torch's trackers use (torch.distributed._tools MemTracker:
Parameter, Gradient, Optstate, Activation, Temp; FSDPMemTracker also splits sharded / unsharded
parameters and gradients), so a dry run of the engine can be compared category by category:

| category | term | what |
|---|---|---|
| params | `params_weights` | the trained weights (sharded over dp x cp at ZeRO-3, and at ZeRO-2 in FSDP) |
| params | `params_gathered` | unsharded 16-bit copies: two units at ZeRO-3 (current + prefetched), every block from forward to backward at FSDP ZeRO-2 / ZeRO-3 without resharding; the engine's in its weights' dtype (`tuning.sim.spec.weight_bytes`), and its whole model under FSDP2's `replicate` (tp with ZeRO-0/1, `replicated_rows`) |
| params | `params_fp8` | Transformer Engine's FP8 copies of the blocks' linear weights (`fp8`): the FP8 weight and its FP8 transpose, kept for the step where Megatron-core caches them (is_first_microbatch), else the transpose each layer in flight saves for its dgrad; and each GEMM's amax history |
| grads | `grads_main` | the gradient buffer (Megatron: fp32 main grads) |
| grads | `grads_partition` | DeepSpeed ZeRO-1/2's fp32 gradient of its own optimizer shard; Apex DistributedFusedAdam's reduced shard where it outgrows the activations it replaces |
| grads | `grads_gathered` | one unit's unsharded gradients before its reduce-scatter |
| optimizer | `optimizer` | fp32 master weights (where the framework keeps them apart) + Adam moments |
| activations | `act_layers` | the stored activations of the micro-batches in flight on the stage |
| activations | `act_logits` | the 16-bit logits and fp32 softmax the loss keeps for its backward (last stage) |
| activations | `act_recompute` | one layer's full set replayed in backward under full recomputation (on the last rank only what it exceeds one micro-batch's logits by: the loss's backward frees them first) |
| activations | `act_autocast` | the engine: autocast's bf16 copies of the stage's gathered weights, cached until its forward ends (none under FSDP2's mixed precision: its weights are bf16) |
| activations | `act_stage_io` | the engine under FSDP2's mixed precision and pipelining: each in-flight micro-batch's received input and its output (the logits on the last stage) that torch's schedule keeps until its backward |
| activations | `act_wgrad_deferred` | the last stage's output-layer inputs and logit gradients kept for the flush (`defer_embedding_wgrad`) |
| temp | `temp_buckets` | DeepSpeed ZeRO-1/2's gradient reduce bucket |
| temp | `temp_gather` | the engine's FSDP2 all-gather output buffer: one unit, in its weights' dtype |
| temp | `temp_loss` | the engine's loss: the fp32 copy of the logits and their gradient (8 bytes a logit) |
| temp | `temp_backward` | the engine under FSDP2's mixed precision, in the backward: the last stage's root gradients (head, final norm) in bf16 and one block's MLP gradients |
| temp | `temp_reduce` | the engine under FSDP2's mixed precision: one block's fp32 reduce-scatter input, just after its backward |
| temp | `temp_grad_accum` | the engine under FSDP2's mixed precision and pipelining: the stage's fp32 accumulated unsharded gradients (FSDP2 keeps them apart from `.grad`, so trackers see them as Temp) |
| runtime | `cuda_context` | the CUDA context and the kernels loaded (measured per GPU and software generation) |
| runtime | `nccl_buffers` | NCCL's FIFOs: communicators x channels x 2 connections x the default buffers |
| runtime | `allocator_reserve` | what the framework's processes hold beyond these tensors, as its fitted share of them (`Framework.allocator_reserve`: the caching allocator's cached and fragmented blocks, fitted on nvidia-smi readings) |

The `runtime` category is what a process holds beyond its tensors: torch's trackers do not see it, nvidia-smi
does. `fits` compares everything with the device's memory (`ClusterSpec.memory_gb`). The caching allocator's
reserve is a term only where a framework's own readings measure it (`allocator_reserve`, fitted per flavour on
its nvidia-smi readings of runs that ran; 0 elsewhere). Before the allocator raises an out-of-memory error it
frees its wholly free cached segments and retries (c10/cuda/CUDACachingAllocator.cpp, release_cached_blocks),
but not the free blocks inside segments still in use: fragmentation ends runs with memory to spare (ZeRO,
Rajbhandari et al. 2020 sec. 3.2: "out of memory issue with over 30% of memory still available"; GMLake, Guo
et al. 2024: 15% of the reserved memory on average, up to 33%, on A100-80GB LLM training). docs/simulator.md
compares the readings with the model.

Sources:
- Model states by framework: Rajbhandari et al. 2020 (ZeRO, sec. 3: 2 + 2 + K=12 bytes per parameter,
  stage 1/2/3 sharding); Megatron-LM's distributed optimizer (docs/source/api-guide/dist_optimizer.md:
  bf16 weights with fp32 main grads keep 18 bytes per parameter, 6 + 12/d with the distributed
  optimizer); DeepSpeed stage_1_and_2.py (fp32 gradient of the partition, reduce_bucket_size 5e8);
  PyTorch FSDP mixed precision (fp32 sharded flat parameters and gradients, 16-bit unsharded copies).
- NeMo 24.x's distributed_fused_adam (`dist_adam`, NeMo 24.05/24.09: MegatronBaseModel.setup_optimization,
  MegatronGPTModel.configure_optimizers; Apex DistributedFusedAdam at apex@810ffae): states in optim.dtype, no
  master copy where it is the model's dtype, the fp32 master's 16 low bits beside bf16 weights, the gradient
  buffer in grad_sync_dtype (default: optim.dtype), an fp32 gradient for the word embedding.
- Activations per layer: Korthikanti et al. 2022, eqs. 1-3 and sec. 4.2.3 (`tuning.sim.compute`), with
  Megatron-core's fused SwiGLU keeping the fc1 output and the fc2 input (6 f/h) instead of eager's four
  tensors (8 f/h).
- In flight on pipeline rank r of p: 1F1B min(p - r, m) micro-batches (Narayanan et al. 2021, sec. 2.2);
  GPipe (and looped BFS) all m; interleaved min(2 (p - 1 - r) + (v - 1) p + 1, v m) chunk forwards of
  L_r / v layers each (Megatron-core's interleaved warm-up; on rank 0 this is Korthikanti et al.'s
  L/p * p (1 + (p - 1)/(p v))); zero-bubble and V schedules as 1F1B (Qi et al. 2023: ZB-H1 and ZB-V
  keep 1F1B's peak).
- Runtime: CUDA context per preset (`ClusterSpec.cuda_context_gb`); NCCL's buffers per connection are its
  defaults, Simple 4 MiB + LL128 4.6875 MiB + LL 0.5 MiB (NVIDIA/nccl src/init.cc DEFAULT_BUFFSIZE,
  DEFAULT_LL128_BUFFSIZE, DEFAULT_LL_BUFFSIZE), 10 MiB in 2 MiB pages, per channel two connections (a ring
  receives from one peer and sends to one: "Ring uses a limited amount of memory as it only has 2 connections
  regardless of the scale", NVIDIA/nccl#864), one communicator per group a rank talks in (tp, the ZeRO / data-
  parallel group, cp, ep) and one per pipeline neighbour (ProcessGroupNCCL keys a send/recv communicator by
  the pair of ranks).
- Embedding on the first stage, the output layer (or the tied embedding's copy) on the last; with
  `account_for_embedding_and_loss` each of them takes a layer's place in the split (Megatron-core's
  --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split; Llama 3's "one
  layer fewer on the first and the last stage").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tuning.sim.fp8 import fp8_weight_copies
from tuning.sim.hardware import GB, ClusterSpec
from tuning.sim.framework import FRAMEWORK_NAMES, per_row
from tuning.sim.spec import SCHEDULES, ModelSpec, engine_rows, fsdp_bf16_rows, reduce_bytes, weight_bytes
from tuning.sim.zero import engine_zero1_optimizer

CATEGORIES = ("params", "grads", "optimizer", "activations", "temp", "runtime")
TENSORS = CATEGORIES[:-1]  # what torch's trackers count (allocated bytes)
TERMS = {
    "params": ("params_weights", "params_gathered", "params_fp8"),
    "grads": ("grads_main", "grads_partition", "grads_gathered"),
    "optimizer": ("optimizer",),
    "activations": ("act_layers", "act_logits", "act_recompute", "act_wgrad_deferred", "act_autocast", "act_stage_io"),
    "temp": ("temp_buckets", "temp_gather", "temp_loss", "temp_backward", "temp_reduce", "temp_grad_accum"),
    "runtime": ("cuda_context", "nccl_buffers", "allocator_reserve"),
}
NCCL_CONNECTION_BYTES = 10 * 2**20  # Simple 4 MiB + LL128 4.6875 MiB + LL 0.5 MiB, in 2 MiB pages
NCCL_CONNECTIONS_PER_CHANNEL = 2
# The categories as torch.distributed._tools name them (MemTracker's _MemRefType; FSDPMemTracker's
# _FSDPRefType for FSDP2, the engine's ZeRO-2/3), each the sum of these terms, for comparing a dry run
MEMTRACKER = {"Parameter": ("params_weights", "params_gathered", "params_fp8"),
              "Gradient": ("grads_main", "grads_partition", "grads_gathered"), "Optstate": ("optimizer",),
              "Activation": TERMS["activations"], "Temp": TERMS["temp"]}
FSDP_MEMTRACKER = {"Sharded Param": ("params_weights",), "Unsharded Param": ("params_gathered", "params_fp8"),
                   "Sharded Grad": ("grads_main", "grads_partition"), "Unsharded Grad": ("grads_gathered",),
                   "OptState": ("optimizer",),
                   "Activation": TERMS["activations"], "Temp": TERMS["temp"]}
LOGIT_BYTES_KEPT = 4.0  # + the 16-bit logits: the loss keeps an fp32 softmax per logit for its backward


@dataclass(frozen=True, kw_only=True, slots=True)
class Keeps:
    """Bytes per parameter one framework keeps in 16-bit mixed precision (fp32 training: 4 + 4 + 8)."""

    weight: float  # the trained weights
    grad: float  # the gradient buffer
    optimizer: float  # optimizer states (fp32 master where apart from the weights, Adam's two moments)
    grad_partition: float = 0.0  # fp32 gradient of the rank's optimizer shard (DeepSpeed ZeRO-1/2)
    bucket_elems: float = 0.0  # gradient reduce bucket, elements (DeepSpeed reduce_bucket_size)
    fsdp: bool = False  # ZeRO-2/3 as FSDP: fp32 weights sharded, 16-bit unsharded copies gathered
    swiglu_bytes: float = 8.0  # bytes per f/h x sbh a gated MLP keeps (eager: gate, up, silu(gate), product)


KEEPS: dict[str, Keeps] = {
    # Megatron-LM: bf16 weights, fp32 main grads, fp32 master + Adam (distributed optimizer at ZeRO-1);
    # fused bias-SwiGLU keeps fc1's output (2f) and fc2's input (f)
    "megatron": Keeps(weight=2, grad=4, optimizer=12, swiglu_bytes=6.0),
    # DeepSpeed ZeRO (Rajbhandari et al. 2020: 2 + 2 + 12) + the fp32 partition gradient and reduce bucket
    "deepspeed": Keeps(weight=2, grad=2, optimizer=12, grad_partition=4, bucket_elems=5e8),
    # PyTorch FSDP mixed precision: fp32 flat parameters and gradients are the master; Adam's moments
    "fsdp": Keeps(weight=4, grad=4, optimizer=8, fsdp=True),
    # the engine: fp32 parameters under autocast (DDP, ZeroRedundancyOptimizer, FSDP2)
    "engine": Keeps(weight=4, grad=4, optimizer=8, fsdp=True),
}
KEEPS["megatron-core"] = KEEPS["megatron"]  # the same distributed optimizer and buffers (tuning/sim/framework.py)
FP32 = Keeps(weight=4, grad=4, optimizer=8)
_FIELDS = ("weight", "grad", "optimizer", "grad_partition", "bucket_elems", "fsdp", "swiglu_bytes")
_TABLE = {f: np.asarray([float(getattr(KEEPS[n], f)) for n in FRAMEWORK_NAMES]) for f in _FIELDS}


def keeps(c: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each row's `Keeps` fields as arrays (fp32 rows: 4 + 4 + 8 bytes, nothing apart)."""
    fw = np.asarray(c.get("framework", 0))
    fp32 = np.asarray(c["dtype_bytes"]) == 4
    out = {f: _TABLE[f][fw] for f in _FIELDS}
    accum = np.asarray(c.get("grad_accum_fp32", -1))  # -1: the framework's default
    megatron = (fw == FRAMEWORK_NAMES.index("megatron")) | (fw == FRAMEWORK_NAMES.index("megatron-core"))
    deepspeed = fw == FRAMEWORK_NAMES.index("deepspeed")
    out["grad"] = np.where(megatron & (accum == 0), 2.0, np.where(deepspeed & (accum == 1), 6.0, out["grad"]))
    # FSDP under torch's pipelining syncs gradients only in the last micro-batch's backward: until then
    # each block keeps its unsharded gradient, accumulated in the reduce dtype (fp32), and its gathered
    # weights (torch/distributed/pipelining/stage.py backward_maybe_with_nosync: set_requires_gradient_sync
    # and set_reshard_after_backward False; FSDPParam.to_accumulated_grad_if_needed)
    out["accumulate_unsharded"] = (out["fsdp"] > 0) & (np.asarray(c.get("pp", 1)) > 1) & (accum != 0)
    dist = np.asarray(c.get("dist_adam", 0))
    if np.any(dist > 0):
        out.update(_apex_keeps(dist, accum, np.asarray(c["dtype_bytes"]), out))
    fused = np.asarray(c.get("fused_swiglu", -1))
    out["swiglu_bytes"] = np.where(fused == 1, 6.0, np.where(fused == 0, 8.0, out["swiglu_bytes"]))
    for f in ("weight", "grad", "optimizer", "grad_partition"):
        out[f] = np.where(fp32, float(getattr(FP32, f)), out[f])
    out["engine"] = engine_rows(c)
    if np.any(out["engine"]):  # zero_grad(set_to_none): at the forward peak only an accumulated gradient exists
        later = (np.asarray(c.get("num_mb", 1)) > 1) & ~out["accumulate_unsharded"]
        out["grad"] = np.where(out["engine"] & ~later, 0.0, out["grad"])
    return out


def _apex_keeps(dist: np.ndarray, accum: np.ndarray, db: np.ndarray, out: dict[str, Any]) -> dict[str, Any]:
    """NeMo 24.x's distributed_fused_adam (`dist` = optim.dtype bytes, 0 elsewhere). NeMo's
    MegatronBaseModel.setup_optimization: optimizer states in optim.dtype; no master copy when it equals the
    model's dtype (store_params False), bf16 weights with fp32 states keep the 16 low bits of the fp32
    master (store_param_remainders, int16). Apex DistributedFusedAdam: exp_avg and exp_avg_sq in that dtype,
    sharded over the data-parallel group; the contiguous gradient buffer in grad_sync_dtype, which defaults
    to the dtype (grad_accum_fp32 0 / 1: bf16 / fp32); the shard reduced into it is `apex_shard`."""
    apex = dist > 0
    grad = np.where(accum == 0, 2.0, np.where(accum == 1, 4.0, dist))
    master = np.where(dist == db, 0.0, np.where((dist == 4) & (db == 2), 2.0, dist))
    return {"grad": np.where(apex, grad, out["grad"]),
            "optimizer": np.where(apex, 2.0 * dist + master, out["optimizer"]),
            "apex_shard": np.where(apex, grad, 0.0)}


def _stage_layers(m: ModelSpec, c: dict[str, np.ndarray], r: Any) -> Any:
    """Transformer layers on pipeline rank r: L/p, one fewer on the first and the last rank when the
    embedding and the loss take a layer's place each."""
    p = c["pp"]
    flag = c.get("account_for_embedding_and_loss", False)
    if not np.any(flag):
        return m.layers / p
    account = np.asarray(flag) & (p > 1)
    slots = (m.layers + 2.0 * account) / p
    return np.where(account & ((r == 0) | (r == p - 1)), slots - 1.0, slots)


def in_flight_layers(m: ModelSpec, c: dict[str, np.ndarray], r: Any) -> np.ndarray:
    """Layer x micro-batch activation sets pipeline rank r holds at its peak (see the module docstring)."""
    p, v, nmb, sched = c["pp"], c["virtual"], c["num_mb"], c["schedule"]
    all_m = ((sched == SCHEDULES.index("gpipe")) | (sched == SCHEDULES.index("looped_bfs"))) & (p > 1)
    held = np.minimum(p - r, nmb)  # 1F1B (and one micro-batch without a pipeline)
    if np.any(v > 1):
        held = np.where(v > 1, np.minimum(2 * (p - 1 - r) + (v - 1) * p + 1, v * nmb) / v, held)
    return _stage_layers(m, c, r) * np.where(all_m, nmb, held)


def _state_rates(c: dict[str, np.ndarray], k: dict[str, np.ndarray], group: Any, unit: Any,
                 root: Any = 0.0) -> dict[str, Any]:
    """Each model-state term as (bytes per parameter, fixed bytes): every term is linear in the stage's
    parameters but the reduce bucket (min(bucket, psi)). The engine's FSDP2 gathers its weights' dtype
    (`tuning.sim.spec.weight_bytes`: fp32, or bf16 under its mixed precision) and holds its root
    unit (`root` bytes: embedding, head, final norm) gathered from forward to backward (FSDP2 does not
    reshard the root after forward) beside the current block; others hold the current and the prefetched."""
    z, db = c["zero"], c["dtype_bytes"]
    reshard = np.asarray(c.get("reshard_after_forward", True))
    accumulate = k.get("accumulate_unsharded", False)
    shard_w = (z >= 3) | ((k["fsdp"] > 0) & (z >= 2))
    sharded = shard_w & (group > 1)
    # every block's 16-bit copy from forward to backward (ZeRO-2 as FSDP, no resharding, pipelined FSDP)
    held_all = sharded & ((z == 2) | ~reshard | accumulate)
    by_opt = np.where(z >= 1, group, 1)
    engine = k.get("engine", False)
    return {
        "params_weights": (k["weight"] / np.where(shard_w, group, 1), 0.0),
        "params_gathered": (np.where(held_all | replicated_rows(c, engine, group), weight_bytes(c, engine), 0.0),
                            np.where(sharded & ~held_all, np.where(engine, unit + root, 2.0 * unit), 0.0)),
        "grads_main": (k["grad"] / np.where(z >= 2, group, 1), 0.0),
        "grads_partition": (k["grad_partition"] / by_opt, 0.0),
        # one unit's unsharded gradient before its reduce-scatter (none at the engine's forward peak); FSDP2's
        # fp32 accumulation under its mixed precision is not a `.grad` (`temp_grad_accum`)
        "grads_gathered": (np.where(accumulate & sharded & ~fsdp_bf16_rows(c), 4.0, 0.0),
                           np.where(sharded & ~accumulate & ~np.asarray(engine), unit, 0.0)),
        "optimizer": (k["optimizer"] / by_opt, 0.0),
    }


def replicated_rows(c: dict[str, np.ndarray], engine: Any, group: Any) -> Any:
    """The engine's rows whose data parallelism is FSDP2's `replicate` (engine/parallel/data.py: DDP refuses tp's
    DTensor parameters; ZeRO-0/1 with tp > 1, no pipeline, no CO2): it unshards every parameter into a copy of
    its own (FSDP2's world-size-1 all-gather copies; fp32, no mixed-precision policy) from the forward to the end
    of the backward, so the step's peak holds the weights twice (Llama-3.1-8B at tp 4: 2 x 11.2 GB)."""
    return (np.asarray(engine, dtype=bool) & (np.asarray(c["zero"]) < 2) & (np.asarray(c["tp"]) > 1)
            & (np.asarray(c["pp"]) == 1) & (np.asarray(group) > 1) & ~np.asarray(c.get("co2", False), dtype=bool))


def state_terms(psi: Any, c: dict[str, np.ndarray], k: dict[str, np.ndarray], group: Any, unit: Any = 0.0
                ) -> dict[str, Any]:
    """Model-state terms of `psi` parameters per GPU whose ZeRO group is `group` ranks (dense: dp x cp;
    experts: dp x cp / ep); `unit` is the bytes of one gathered unit (a block, or DeepSpeed's largest
    tensor) that ZeRO-3 holds twice (current and prefetched) and whose gradient it holds once."""
    out = {name: psi * rate + fixed for name, (rate, fixed) in _state_rates(c, k, group, unit).items()}
    out["temp_buckets"] = _bucket(psi, c, k)
    return out


def _bucket(psi: Any, c: dict[str, np.ndarray], k: dict[str, np.ndarray]) -> Any:
    if not np.any(k["bucket_elems"]):
        return 0.0
    z = c["zero"]
    return np.where((z == 1) | (z == 2), np.minimum(k["bucket_elems"], psi) * c["dtype_bytes"], 0.0)


def _unit(m: ModelSpec, c: dict[str, np.ndarray]) -> np.ndarray:
    """Bytes of one ZeRO-3 gather: a block (FSDP's flat buffer) or the largest tensor (DeepSpeed stage 3)."""
    from tuning.sim.framework import per_row

    largest = max(m.hidden * (m.q_dim + 2 * m.kv_dim), m.hidden * m.ffn * (2 if m.gated_mlp else 1))
    per_param = per_row(c.get("framework", np.asarray(0)), "zero3_per_parameter") > 0
    norms = np.where(engine_rows(c), 2 * m.norm_params * m.hidden * (1 - 1 / c["tp"]), 0.0)  # replicated (engine)
    return (np.where(per_param, largest, m.dense_layer_params) / c["tp"] + norms) * weight_bytes(c)


def _rank(m: ModelSpec, c: dict[str, np.ndarray], r: Any, per_layer: Any) -> tuple[Any, Any, Any]:
    """(parameters, layer x micro-batch activation sets in flight, is-last) of pipeline rank r."""
    p, t = c["pp"], _table_tp(c)
    table = m.vocab * m.hidden / t
    head = np.where(p == 1, 0.0 if m.tied_embeddings else table, table)  # the output layer, or the tied copy
    positions = m.seq * m.hidden if m.learned_positions else 0.0
    last = r == p - 1
    psi = (per_layer * _stage_layers(m, c, r) + np.where(r == 0, table + positions, 0.0)
           + np.where(last, head + m.norm_params * m.hidden, 0.0))
    return psi, in_flight_layers(m, c, r), last


def _activations(m: ModelSpec, c: dict[str, np.ndarray], act: dict[str, np.ndarray],
                 k: dict[str, np.ndarray]) -> tuple[Any, Any, Any, Any]:
    """(bytes per stored layer x micro-batch, the last rank's logits, the recomputed layer, what it adds on the
    last rank: what it exceeds one micro-batch's logits by, freed by the loss's backward before the first
    checkpoint replays its forward: Megatron's CheckpointFunction.backward, torch.utils.checkpoint)."""
    t, p = c["tp"], c["pp"]
    stored = act["stored"]
    if m.gated_mlp:  # the framework's SwiGLU (activation_bytes counts eager's 8 f/h inside the tp region)
        sbh = m.seq * c["micro"] * m.hidden * c["dtype_bytes"] / 2.0
        stored = stored - np.where(c["recompute"] == 2, 0.0, (8.0 - k["swiglu_bytes"]) * m.ffn / m.hidden * sbh / t)
    if np.any(c.get("free_stage_input", False)):  # the chunk's input, spread over its layers (Llama 3)
        slots = (m.layers + 2.0 * np.asarray(c.get("account_for_embedding_and_loss", False))) / p
        received = m.seq * c["micro"] * m.hidden * c["dtype_bytes"] / np.where(c["sequence_parallel"], t, 1)
        freed = np.asarray(c["free_stage_input"]) & (p > 1) & (c["recompute"] != 2)
        stored = stored - np.where(freed, received * c["virtual"] / slots, 0.0)
    all_m = (c["schedule"] == SCHEDULES.index("gpipe")) | (c["schedule"] == SCHEDULES.index("looped_bfs"))
    one = (c["dtype_bytes"] + LOGIT_BYTES_KEPT) * c["micro"] * m.seq * m.vocab / t
    logits = one * np.where(all_m & (p > 1), c["num_mb"], 1)  # GPipe keeps every micro-batch's until backward
    recompute = np.where(c["recompute"] == 2, act["full"], 0.0)
    if np.any(k["engine"]):
        layer, kept, loss = _engine_activations(m, c)
        engine = k["engine"]
        stored = np.where(engine, np.where(c["recompute"] == 2, kept, layer), stored)
        logits, one = np.where(engine, loss, logits), np.where(engine, loss, one)
        recompute = np.where(engine & (c["recompute"] == 2), layer, recompute)
    return stored, logits, recompute, np.maximum(recompute - one, 0.0)


def _engine_activations(m: ModelSpec, c: dict[str, np.ndarray]) -> tuple[Any, Any, Any]:
    """The engine's (bytes a layer keeps per micro-batch, its checkpointed input under activation
    checkpointing, the last stage's loss and final norm), counted tensor by tensor from what transformers'
    Llama-family decoder layer saves for backward under autocast over fp32 parameters (torch's CPU and CUDA
    autocast: matmuls and SDPA in bf16, the rest in the fp32 of their inputs), per token:
    - fp32 residual stream and norms (RMSNorm computes in fp32): each norm keeps its input and its normalized
      output, 4 h each (+ 4 bytes of rsqrt), two norms: 16 h + 8;
    - each projection keeps its own bf16 cast of its input (autocast casts per call): q, k, v and the MLP's
      input matrices (gate, up), 2 h each: 2 h (3 + mlp_mats - 1), of the whole sequence also under sequence
      parallelism (their input is the all-gathered norm output);
    - inside tp: SDPA keeps bf16 q (after the fp32 rotary: cast again), k, v, its output and an fp32
      log-sum-exp per head; the output projection its contiguous input: 6 q + 4 kv + 4 heads; the MLP keeps
      gate, silu(gate), up and their product (SwiGLU, 8 f) or the GELU's input and output (4 f);
    - the loss: fp32 log-softmax of the logits (4 V; the head is replicated over tp in the engine) and the
      final norm (10 h: input, normalized, bf16 cast for the head).
    Under FSDP2's mixed precision (`tuning.sim.spec.fsdp_bf16_rows`) the weights are bf16 and FSDP2 casts each
    block's input to bf16: a norm keeps its fp32 upcast input (4 h), its bf16 normalized output (2 h) and the
    bf16 product with its weight (2 h), which the projections after it keep without a cast of their own: 16 h + 8
    outside tp, the final norm 8 h; the checkpointed input is bf16. Inside tp nothing changes (SDPA's rotary q is
    bf16 already). Checked against dry runs of the engine (tests/test_sim_vs_dryrun.py)."""
    t, sp = c["tp"], c["sequence_parallel"]
    tokens = m.seq * c["micro"]
    mixed = fsdp_bf16_rows(c)
    casts = np.where(mixed, 0.0, 2 * (3 + m.mlp_mats - 1)) * m.hidden  # the projections' inputs: never sp-split
    inside = 6 * m.q_dim + 4 * m.kv_dim + (4 * m.mlp_mats - 4) * m.ffn + 4 * m.heads
    layer = tokens * (16 * m.hidden / np.where(sp, t, 1) + casts + inside / t + 8)
    kept = tokens * weight_bytes(c) * m.hidden / np.where(sp, t, 1)
    loss = tokens * (4 * m.vocab + np.where(mixed, 8, 10) * m.hidden)
    return layer, kept, loss


def memory(m: ModelSpec, cl: ClusterSpec, c: dict[str, np.ndarray], psi: np.ndarray,
           act: dict[str, np.ndarray], frameworks: Any = None) -> dict[str, np.ndarray]:
    """Bytes per GPU on the most loaded pipeline rank (the first, the last, or with the embedding and
    loss in the split the second, which then holds a full rank of layers and more in flight): every term of
    TERMS, the CATEGORIES, total, `stage` (the rank) and whether it fits. `psi` is the parameters
    of the most loaded stage as `tuning.sim.compute.stage_params` counts them (MoE: with its dense
    changes, `tuning.sim.moe`); `c["dp"]` the ZeRO group (dp x cp)."""
    p = c["pp"]
    k = keeps(c)
    per_layer = psi / (m.layers / p) - _embedding_share(m, c)  # one block (MoE: with its changes, averaged)
    rates = _state_rates(c, k, c["dp"], _unit(m, c), _root(m, c))
    activations = _activations(m, c, act, k)
    stored = activations[0]
    ranks = [np.zeros_like(p), p - 1]
    if np.any(c.get("account_for_embedding_and_loss", False)):  # else rank 0 holds rank 1's layers and more in flight
        ranks.append(np.minimum(1, p - 1))
    mixed = fsdp_bf16_rows(c) if np.any(k["engine"]) else False

    def terms_at(r: Any, rank: tuple[Any, Any, Any]) -> dict[str, Any]:
        terms = _rank_terms(m, c, k, r, rank, rates, activations)
        if np.any(mixed):
            peak = _fsdp_bf16_peak(m, c, k, r, rank, rates, terms, stored)
            terms = {name: np.where(mixed, peak[name], value) for name, value in terms.items()}
        return terms

    seen = []
    for r in ranks:  # the rank with the largest total (its parameters, activations in flight, logits)
        rank = _rank(m, c, r, per_layer)
        terms = terms_at(r, rank)
        total = total_of(terms.values())
        if seen:
            more = total > best_total
            best_total, best_r = np.where(more, total, best_total), np.where(more, r, best_r)
            best_rank = tuple(np.where(more, new, old) for new, old in zip(rank, best_rank))
        else:
            best_total, best_r, best_rank = total, r, rank
        seen.append((r, terms))
    # the winning rank's terms: one more pass at each row's rank costs less than choosing term by term
    terms = next((t for r, t in seen if np.array_equal(r, best_r)), None) or terms_at(best_r, best_rank)
    return finish({**terms, "stage": best_r, **runtime(c, cl)}, cl, reserve_share(c, frameworks))


def _rank_terms(m: ModelSpec, c: dict[str, np.ndarray], k: dict[str, np.ndarray], r: Any, rank: tuple[Any, Any, Any],
                rates: dict[str, Any], activations: tuple[Any, Any, Any, Any]) -> dict[str, Any]:
    """Every tensor term of TERMS on pipeline rank r (`rank`: its `_rank`) at the end of its forward: its
    parameters' states, the activation sets it holds in flight and the last rank's logits."""
    stored, logits, recompute, recompute_last = activations
    s_psi, held, last = rank
    acts = held * stored + np.where(last, logits, 0.0)
    nemo = np.any(c.get("dist_adam", 0)) or np.any(c.get("defer_embedding_wgrad", 0))
    fp32_embedding, apex_shard, deferred = _nemo_terms(m, c, k, r, s_psi, acts) if nemo else (0.0, 0.0, 0.0)
    autocast, gather, loss = _engine_terms(m, c, k, r) if np.any(k["engine"]) else (0.0, 0.0, 0.0)
    out = {name: s_psi * rate + f if _held(f) else s_psi * rate for name, (rate, f) in rates.items()}
    out["grads_main"] = out["grads_main"] + fp32_embedding
    out["grads_partition"] = out["grads_partition"] + apex_shard
    # a term no row holds stays the scalar 0.0 (broadcast where used): a search does not pay a pass for it
    out["params_fp8"] = fp8_weight_copies(m, c, _stage_layers(m, c, r), held) if np.any(c.get("fp8", False)) else 0.0
    out.update(optimizer=engine_zero1_optimizer(m, c, k, s_psi, out["optimizer"]), temp_buckets=_bucket(s_psi, c, k),
               temp_gather=gather, temp_loss=loss, act_autocast=autocast, act_layers=held * stored,
               act_wgrad_deferred=deferred, act_logits=np.where(last, logits, 0.0),
               act_recompute=np.where(last, recompute_last, recompute), act_stage_io=0.0,
               temp_backward=0.0, temp_reduce=0.0, temp_grad_accum=0.0)
    return out


def _fsdp_bf16_peak(m: ModelSpec, c: dict[str, np.ndarray], k: dict[str, np.ndarray], r: Any, rank: tuple[Any, Any, Any],
                    rates: dict[str, Any], forward: dict[str, Any], stored: Any) -> dict[str, Any]:
    """Rank r's terms at its peak under FSDP2's mixed precision (`tuning.sim.spec.fsdp_bf16_rows`), given its
    terms at the end of the forward (`forward`). Without an autocast cache and with bf16 blocks the forward's
    end no longer holds the most: the fp32 gradients, reduce-scatter inputs and accumulations of the backward
    do. The largest of three moments of a backward, each on the micro-batch's sets the rank holds:
    - the loss's backward (last rank): the forward's activations and the loss's fp32 temporaries; the blocks
      and the root resharded after forward (ZeRO-3) are not gathered, no layer is recomputed yet;
    - the last block's backward: its sets and the gathered root and block (FSDP2 re-gathers them), the
      loss's freed; the last rank's root gradients in bf16 (head and final norm: FSDP2 reduces the root
      when the whole backward ends) and the block's MLP gradients (its weights' in bf16, and per token the
      gradients of its 2 mlp_mats - 2 f-wide tensors and of its output, bf16);
    - just after that block's reduce-scatter: one layer's sets fewer, its fp32 reduce-scatter input, and its
      gradient shard (fp32) where no gradient exists yet (one micro-batch: zero_grad set them to None).
    Under torch's pipelining (`accumulate_unsharded`) FSDP2 accumulates every micro-batch's unsharded gradients
    in fp32 apart from `.grad` (FSDPParam.to_accumulated_grad_if_needed; `temp_grad_accum`, 4 bytes a
    parameter of the stage) from the second backward on, when the rank holds min(in flight, micro-batches - 1)
    micro-batches; each micro-batch in flight keeps the stage's received input and its output (the schedule's
    forward cache: bf16 hidden states, the logits on the last stage); the reduce-scatter input replaces the
    accumulated gradient it reduces; the whole stage counts as gathered (`_state_rates`), which the last rank
    at ZeRO-3 overstates: its forwards reshard between its backwards, so its backward holds the root and the
    blocks it has reached, its loss none (a 2-stage dry run: the root and one block, 0.79 of the 1.08 MB priced;
    Llama-3.1-8B pp4 peaks at its last stage's loss: none of the 4.2 GiB priced, docs/dryrun.md). Checked
    against dry runs of the engine (tests/test_sim_vs_dryrun.py)."""
    s_psi, held, last = rank
    layers, nmb, t = _stage_layers(m, c, r), c["num_mb"], c["tp"]
    tokens, wb, reduced_bytes = m.seq * c["micro"], weight_bytes(c), reduce_bytes(c)  # bf16 weights, fp32 reduce
    block = _unit(m, c) / wb  # a block's parameters (with tp's replicated norms)
    pipelined = np.asarray(k["accumulate_unsharded"]) & (c["pp"] > 1)
    io = np.where(pipelined, tokens * wb * (np.where(r > 0, m.hidden, 0.0) + np.where(last, m.vocab, m.hidden)), 0.0)
    root_grads = np.where(last, wb * (m.vocab * m.hidden + m.norm_params * m.hidden), 0.0)
    mlp_grads = wb * (m.mlp_mats * m.hidden * m.ffn / t + tokens * ((2 * m.mlp_mats - 2) * m.ffn / t + m.hidden))
    current_block = rates["params_gathered"][1]  # the block and root gathered for it (0 where all stay gathered)
    none = np.zeros_like(np.asarray(s_psi, dtype=float))
    best = None
    for later in (False, True):  # the first backward; a later one, with the accumulated gradients
        mb = held / layers if not later else np.minimum(held / layers, nmb - 1)
        base = {**forward, "act_autocast": none, "act_logits": none, "temp_loss": none,
                "act_layers": mb * layers * stored, "act_stage_io": mb * io,
                "temp_grad_accum": np.where(later & pipelined & (nmb > 1), reduced_bytes * s_psi, 0.0)}
        loss = {**base, "act_logits": forward["act_logits"], "temp_loss": forward["temp_loss"], "act_recompute": none,
                "params_gathered": forward["params_gathered"] - current_block, "temp_gather": none}
        block_bwd = {**base, "temp_backward": root_grads + mlp_grads}
        reduced = {**block_bwd, "act_layers": block_bwd["act_layers"] - stored,
                   "temp_reduce": np.where(pipelined, 0.0, reduced_bytes * block),
                   "grads_main": np.where(forward["grads_main"] > 0, forward["grads_main"],
                                          reduced_bytes * block / c["dp"])}
        for moment, valid in ((loss, last), (block_bwd, mb > 0), (reduced, mb > 0)):
            total = np.where(valid, sum(moment.values()), -np.inf)
            if best is None:
                best = (total, moment)
            else:
                more = total > best[0]
                best = (np.where(more, total, best[0]), {n: np.where(more, v, best[1][n]) for n, v in moment.items()})
    return best[1]


def _root(m: ModelSpec, c: dict[str, np.ndarray]) -> Any:
    """Bytes of the engine's FSDP2 root unit without pipelining (the embedding, the untied head, the final norm,
    in its weights' dtype, replicated over tp) gathered beside the current block; 0 elsewhere."""
    if not np.any(engine_rows(c)):
        return 0.0
    return weight_bytes(c) * (m.vocab * m.hidden * (1 if m.tied_embeddings else 2) + m.norm_params * m.hidden)


def _engine_terms(m: ModelSpec, c: dict[str, np.ndarray], k: dict[str, np.ndarray], r: Any) -> tuple[Any, Any, Any]:
    """The engine's (autocast's weight cache, FSDP2's all-gather buffer, the loss's temporaries) on rank r:
    autocast caches the bf16 cast of every leaf weight it multiplies by until the forward's autocast region
    ends (torch autocast's cast cache), so the stage's matmul weights (and a replicated head) at 2 bytes (none
    under FSDP2's mixed precision, whose weights are bf16 already); FSDP2 gathers one unit into its own output
    buffer (in its weights' dtype); the loss makes an fp32 copy of the logits and their gradient (8 bytes a
    logit)."""
    engine, p = k["engine"], c["pp"]
    cached = engine & ~fsdp_bf16_rows(c)
    last = r == p - 1
    weights = _stage_layers(m, c, r) * m.layer_matmul_params / c["tp"] + np.where(last, m.vocab * m.hidden, 0.0)
    shard = (c["zero"] >= 2) & (c["dp"] > 1)
    tokens = m.seq * c["micro"]
    return (np.where(cached, 2.0 * weights, 0.0), np.where(engine & shard, _unit(m, c), 0.0),
            np.where(engine & last, 8.0 * tokens * m.vocab, 0.0))


def _nemo_terms(m: ModelSpec, c: dict[str, np.ndarray], k: dict[str, np.ndarray], r: Any, s_psi: Any,
                acts: Any) -> tuple[Any, Any, Any]:
    """What NeMo 24.x keeps beyond Megatron-core's terms on pipeline rank r: (the word embedding's fp32
    gradient, Apex's reduced gradient shard above the activations, the deferred output-layer wgrad inputs).

    - NeMo's MegatronGPTModel.configure_optimizers (with_fp32_embedding_grads, default True) gives the word
      embedding (first stage; the last too when tied and pipelined) an fp32 gradient bucket.
    - Apex's zero_grad drops every reduced shard (`_grads_buckets.clear()`) and the shards are made by the
      reduce-scatters of each bucket's last backward, which free that backward's activations as they go:
      the peak holds the larger of the two, so only what the shards exceed the activations by is added.
    - Megatron-core's output layer with defer_embedding_wgrad_compute keeps, per micro-batch up to the
      wgrad_deferral_limit, its input (s b h, / t with sequence parallelism) and the logit gradient
      (s b V / t) until NeMo drains them after the schedule (MegatronGPTModel.training_step); the last
      stage holds them beside its in-flight activations."""
    p, t, db = c["pp"], c["tp"], c["dtype_bytes"]
    apex = np.asarray(c.get("dist_adam", 0)) > 0
    first, last = r == 0, r == p - 1
    table = m.vocab * m.hidden / t
    tied = m.tied_embeddings & (p > 1) & last
    fp32_embedding = np.where(apex & (first | tied), table * np.maximum(4.0 - k["grad"], 0.0), 0.0)
    n = np.minimum(np.asarray(c.get("defer_embedding_wgrad", 0)), c.get("num_mb", 1))
    kept = m.seq * c["micro"] * db * (m.vocab / t + m.hidden / np.where(c["sequence_parallel"], t, 1))
    deferred = np.where(last & (p > 1), n * kept, 0.0)
    shard = s_psi * k.get("apex_shard", 0.0) / c["dp"]
    return fp32_embedding, np.maximum(shard - acts - deferred, 0.0), deferred


def communicators(c: dict[str, np.ndarray]) -> np.ndarray:
    """NCCL communicators a rank holds buffers in: one per group it talks in (tp, the ZeRO / data-parallel
    group `c["dp"]`, cp, ep) and one per pipeline neighbour."""
    one = lambda key: (np.asarray(c.get(key, 1)) > 1).astype(float)  # noqa: E731
    return one("tp") + one("dp") + one("cp") + one("ep") + 2.0 * one("pp")


def runtime(c: dict[str, np.ndarray], cl: ClusterSpec) -> dict[str, Any]:
    """The `runtime` terms: the CUDA context and NCCL's buffers (0 where the cluster does not model them)."""
    nccl = communicators(c) * cl.nccl_channels * NCCL_CONNECTIONS_PER_CHANNEL * NCCL_CONNECTION_BYTES
    return {"cuda_context": cl.cuda_context_gb * GB + np.zeros_like(nccl), "nccl_buffers": nccl}


def tracker_categories(terms: dict[str, float], fsdp: bool) -> dict[str, float]:
    """One configuration's tensor terms in torch's tracker categories (FSDPMemTracker's for FSDP2, else MemTracker's)."""
    table = FSDP_MEMTRACKER if fsdp else MEMTRACKER
    return {name: float(sum(terms.get(t, 0.0) for t in names)) for name, names in table.items()}


def _embedding_share(m: ModelSpec, c: dict[str, np.ndarray]) -> np.ndarray:
    """What `compute.stage_params` adds to a stage's blocks (embedding, head, positions, final norm) per layer."""
    p, t = c["pp"], _table_tp(c)
    table = m.vocab * m.hidden / t * np.where((p == 1) & (not m.tied_embeddings), 2.0, 1.0)
    positions = m.seq * m.hidden if m.learned_positions else 0.0
    return (table + positions + m.norm_params * m.hidden) / (m.layers / p)


def _table_tp(c: dict[str, np.ndarray]) -> Any:
    """The tp degree the embedding and head are split over: 1 for the engine, which keeps them replicated."""
    return np.where(engine_rows(c), 1, c["tp"]) if "framework" in c else c["tp"]


# The reserve is fitted on ZeRO-1 readings (BigScience's): it applies up to ZeRO-2, whose states are allocated
# once as flat buffers as ZeRO-1's are. ZeRO-3 gathers and frees parameters layer by layer, an allocation pattern
# no reading here measured, and keeps none (one ZeRO-3 run that ran, Narayanan et al. 2021 Table 2's 530B on 640
# GPUs, is priced at 82.3 of 85.9 GB: DeepSpeed's reserve would refuse it)
RESERVE_MAX_ZERO = 2


def reserve_share(c: dict[str, np.ndarray], frameworks: Any = None) -> Any:
    """Each row's framework's `allocator_reserve` up to ZeRO-2 (RESERVE_MAX_ZERO), else 0 (a scalar 0.0 where
    no row has one: no pass in a search)."""
    share = per_row(c.get("framework", np.asarray(0)), "allocator_reserve", frameworks)
    share = np.where(np.asarray(c["zero"]) <= RESERVE_MAX_ZERO, share, 0.0)
    return share if np.any(share) else 0.0


def finish(terms: dict[str, Any], cl: ClusterSpec, reserve: Any = 0.0) -> dict[str, Any]:
    """The categories and total of `terms` (after a caller added to them, e.g. MoE expert states), the
    allocator's reserve as `reserve` (a share) of the tensors, and whether the total fits the cluster's
    usable memory."""
    out = dict(terms)
    for category in TENSORS:
        out[category] = total_of(out[name] for name in TERMS[category])
    out["allocator_reserve"] = reserve * total_of(out[c] for c in TENSORS) if _held(reserve) else 0.0
    out["runtime"] = total_of(out[name] for name in TERMS["runtime"])
    out["total"] = total_of(out[category] for category in CATEGORIES)
    out["fits"] = out["total"] <= cl.memory_gb * cl.usable_memory_fraction * GB
    return out


def _held(value: Any) -> bool:
    """Whether some row holds the term: an array, or a scalar other than 0 (a term no row holds stays 0.0)."""
    return bool(np.ndim(value)) or bool(value)


def total_of(values: Any) -> Any:
    """The sum of `values` in order, skipping scalar zeros (a term no row holds costs no pass over the
    rows) and adding into one array of its own once it has one (a search's sums allocate once)."""
    total, owned = 0.0, False
    for value in values:
        if not _held(value):
            continue
        if owned and np.shape(value) == total.shape and np.asarray(value).dtype == total.dtype:
            np.add(total, value, out=total)
        else:
            total = total + value
            owned = isinstance(total, np.ndarray) and total.ndim > 0 and total.dtype == np.float64
    return total


def dominant(terms: dict[str, float]) -> str:
    """The largest term of one configuration's breakdown (scalars)."""
    names = [name for names in TERMS.values() for name in names]
    return max(names, key=lambda name: float(terms.get(name, 0.0)))
