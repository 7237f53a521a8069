"""Per-rank memory: an analytic estimate from the config, and the model state a rank really holds.

Training keeps fp32 parameters, fp32 gradients and two fp32 AdamW states (also under bf16
autocast, which only casts activations), so the model state is 16 bytes per parameter before
sharding: the mixed-precision ZeRO formulas of Rajbhandari et al. 2020 (2+2+12 Psi) become
4 Psi params + 4 Psi grads + 8 Psi Adam here.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from engine.config.schema import RunConfig
from engine.errors import ConfigError

if TYPE_CHECKING:  # torch loads only where a tensor or a CUDA query needs it: the fit check stays light
    import torch
    from torch import nn

FP32 = 4  # bytes


def _stage_layers(cfg: RunConfig) -> list[int]:
    """Blocks per pipeline rank: the pipeline's own split (rank r holds chunks r, r + pp, ...)."""
    from engine.parallel.stages import stage_layers

    p = cfg.parallel
    # layer_split=auto is decided at start from measured speeds: estimate with the even split
    split = p.layer_split if isinstance(p.layer_split, list) else None
    if split is None and cfg.model.layers % (p.pp * p.virtual):
        from engine.parallel.layer_split import proportional_split

        split = proportional_split(cfg.model.layers, [1.0] * (p.pp * p.virtual))
    chunks = stage_layers(cfg.model.layers, p.pp, p.virtual, split)
    return [sum(len(c) for c in chunks[rank::p.pp]) for rank in range(p.pp)]


def _stage_parts(cfg: RunConfig, stage: int) -> tuple[float, float, int]:
    """(root parameters, parameters of one block, blocks) one rank of pipeline `stage` holds
    before ZeRO sharding (TP divides the block matmuls); the root is what no block holds."""
    m, tp = cfg.model, cfg.parallel.tp
    if m.hf is not None:
        return _hf_stage_parts(cfg, stage)
    h, r = m.d_model, m.mlp_ratio
    block = (4 + 2 * r) * h * h / tp + 4 * h  # q,k,v,o + mlp split over tp; two LayerNorms replicated
    if m.experts > 0:  # MoE blocks: router + this rank's experts/ep, replicated over tp (engine/parallel/expert.py)
        from engine.model.shapes import moe_layer_indices

        moe_layers = len(moe_layer_indices(m.layers, experts=m.experts, moe_every=m.moe_every))
        moe_mlp = h * m.experts + m.experts // max(cfg.parallel.ep, 1) * 2 * r * h * h
        block += moe_layers * (moe_mlp - 2 * r * h * h / tp) / max(m.layers, 1)
    root = 0.0
    last = cfg.parallel.pp - 1
    if stage == 0:
        root += m.vocab * h + m.seq_len * h  # token + position embeddings
    if stage == last:
        root += 2 * h + (m.vocab * h if last > 0 else 0)  # ln_f; the tied head is a second copy when pp > 1
    return root, block, _stage_layers(cfg)[stage]


def _hf_stage_parts(cfg: RunConfig, stage: int) -> tuple[float, float, int]:
    """`_stage_parts` of a Hugging Face model from its config's shape (engine/model/shapes.py): attention and
    dense MLP matrices split over tp, experts over ep (replicated over tp), norms and router replicated."""
    from engine.model.shapes import from_hf_config

    sh, p = from_hf_config(cfg.model.hf), cfg.parallel
    norms = 2 * sh.hidden * sh.norm_params
    per_layer = []
    for i in range(sh.layers):
        if i in sh.moe_layers:
            mlp = sh.router_params + sh.experts // max(p.ep, 1) * sh.mlp_params(sh.moe_ffn_hidden) \
                + sh.shared_expert_params / p.tp
        else:
            mlp = sh.mlp_params(sh.ffn_hidden) / p.tp
        per_layer.append(sh.attention_params / p.tp + mlp + norms)
    block = sum(per_layer) / max(len(per_layer), 1)
    root, last = 0.0, p.pp - 1
    if stage == 0:
        root += sh.vocab * sh.hidden
    if stage == last:
        root += sh.final_norm_params + (sh.vocab * sh.hidden if (not sh.tied_embeddings or last > 0) else 0)
    return root, block, _stage_layers(cfg)[stage]


def _layer_activation_elems(cfg: RunConfig) -> float:
    """Saved activation elements of one block for one micro-batch (fp32, no recomputation).

    Korthikanti et al. 2022 count 34 s b h + 5 a s^2 b bytes per layer at 16 bits. Here, with
    `scaled_dot_product_attention`'s flash kernel (dropout 0; no s^2 scores kept), the tensors
    autograd saves are: ln1 in, ln1 out, q, k, v, attention out, wo in, ln2 in, ln2 out,
    w1 out (r h), gelu out (r h) = (9 + 2 r) s b h elements, plus the log-sum-exp (a s b).
    Under TP the q/k/v/o and MLP tensors split over t; the norm outputs stay whole (the
    column-parallel layers save them replicated); sequence parallelism splits the norm inputs.
    Dropout > 0 takes the math kernel: + 2 a s^2 b scores/probs (fp32) + masks.
    """
    m, p = cfg.model, cfg.parallel
    s, b, h, a, r, t = m.seq_len, cfg.batch.micro, m.d_model, m.heads, m.mlp_ratio, p.tp
    if m.hf is not None:  # SwiGLU: gate, up and their product take the GELU MLP's two r h tensors' place
        from engine.model.shapes import from_hf_config

        sh = from_hf_config(m.hf)
        r = 1.5 * (sh.moe_ffn_hidden * sh.top_k if sh.experts else sh.ffn_hidden) / sh.hidden
    norm_inputs = 2.0 / t if p.sequence_parallel else 2.0
    elems = s * b * h * (norm_inputs + 2.0 + (5 + 2 * r) / t) + a * s * b / t
    if m.dropout > 0:
        elems += (2 * a * s * s * b + (a * s * s * b + 2 * s * b * h) / FP32) / t
    return elems


def _activation_bytes(cfg: RunConfig, stage: int) -> float:
    m, p = cfg.model, cfg.parallel
    s, b, h = m.seq_len, cfg.batch.micro, m.d_model
    if cfg.train.activation_checkpointing:
        # full recomputation keeps each block input (Korthikanti: 2 s b h bytes at 16 bits)
        # plus one block's activations while it is recomputed in backward
        block_in = s * b * h / (p.tp if p.sequence_parallel else 1)
        per_mb = _stage_layers(cfg)[stage] * block_in + _layer_activation_elems(cfg)
    else:
        per_mb = _stage_layers(cfg)[stage] * _layer_activation_elems(cfg)
    if stage == p.pp - 1:
        per_mb += 2 * s * b * h + s * b * m.vocab  # ln_f in, head in, log-softmax out for the loss
    # micro-batches in flight: GPipe keeps all of them, 1F1B at most p - stage (Narayanan et al. 2021)
    # (without pp, gradient accumulation frees each micro-batch's activations in its backward)
    num_micro = max(1, cfg.batch.global_ // (p.dp * cfg.batch.micro))
    if p.pp == 1:
        in_flight = 1
    else:
        in_flight = num_micro if p.schedule == "gpipe" else min(num_micro, p.pp - stage)
    return FP32 * per_mb * in_flight


def estimate_memory(cfg: RunConfig, *, pp_rank: int | None = None) -> dict[str, float]:
    """Analytic peak bytes one rank holds: {params, grads, optimizer, activations}; they sum to the total.

    Model state at its peak, during backward (measured by `ModelStatePeak`), over dp = N with
    Psi the parameters of the rank's pipeline stage after TP splitting, R its root (embeddings,
    final norm) and B one block (fp32 Adam: 4 Psi params, 4 Psi grads, 8 Psi states before
    sharding; Rajbhandari et al. 2020 for the states):
    stage 0: Psi, Psi, 2 Psi. stage 1: Psi, Psi, 2 Psi / N (params 2 Psi with tp > 1: FSDP2
      `replicate` holds an unsharded copy next to the replica).
    stage 2 (FSDP2 per block, parameters kept from forward to backward): params Psi + Psi / N
      (the unsharded copies next to the shards), grads B (the first block in backward, before
      its reduce-scatter), states 2 Psi / N.
    stage 3: params Psi / N + R + B (the root and one block unsharded), grads at the last
      block: B + (L - 1) B / N, states 2 Psi / N.
    With gradient accumulation (stages 2-3 reduce-scatter every micro-batch) the grads are
    B + Psi / N: the shards accumulated by the earlier micro-batches.
    Under pp > 1 the pipeline schedule keeps unsharded gradients over its micro-batches: ZeRO
    2/3 grads Psi and params Psi + Psi / N (not measured). `pp_rank=None` reports the pipeline
    stage with the largest total.
    """
    stages = range(cfg.parallel.pp) if pp_rank is None else [pp_rank]
    return max((_estimate_stage(cfg, s) for s in stages), key=lambda d: sum(d.values()))


def _model_state_elems(cfg: RunConfig, stage: int) -> tuple[float, float, float]:
    """(params, grads, optimizer states) in fp32 elements at the peak (see `estimate_memory`)."""
    p = cfg.parallel
    root, block, layers = _stage_parts(cfg, stage)
    psi, n = root + layers * block, p.dp * p.cp  # replicas: ZeRO shards over dp x cp (grad_axis)
    zero = 0 if n == 1 or cfg.co2.enabled else p.zero  # one replica or CO2: a plain module
    if zero <= 1:
        # dp over TP parameters is FSDP2 `replicate`: an unsharded copy next to the replica from
        # forward to backward (measured: 2 Psi)
        params = 2 * psi if n > 1 and p.tp > 1 and not cfg.co2.enabled else psi
        return params, psi, 2 * psi / (n if zero == 1 else 1)
    if p.pp > 1:
        return psi + psi / n, psi, 2 * psi / n
    # the gradient shards of earlier micro-batches (all of them after the first) are alive too
    accumulated = psi / n if cfg.grad_accum > 1 else None
    if zero == 2 or not p.reshard_after_forward:
        return psi + psi / n, block + (accumulated or 0.0), 2 * psi / n
    return psi / n + root + block, block + (accumulated or (layers - 1) * block / n), 2 * psi / n


def _estimate_stage(cfg: RunConfig, stage: int) -> dict[str, float]:
    params, grads, optimizer = _model_state_elems(cfg, stage)
    return {"params": FP32 * params, "grads": FP32 * grads, "optimizer": FP32 * optimizer,
            "activations": _activation_bytes(cfg, stage)}


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _optimizer_state(optimizer: torch.optim.Optimizer) -> Any:
    # ZeroRedundancyOptimizer and DTensorZeroOptimizer keep this rank's shard in `.optim`
    return getattr(optimizer, "optim", optimizer).state


def measure_model_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, float]:
    """Bytes of {params, grads, optimizer} this rank stores right now (same keys as `estimate_memory`).

    Local shards only: DTensor (TP, FSDP2) parameters and gradients count `to_local()`; tied
    weights count once; ZeroRedundancyOptimizer counts its local partition. Call it after
    backward and before `zero_grad` to include the gradients. DDP with
    `gradient_as_bucket_view=False` holds a second copy of the gradients in its buckets,
    which is not counted.
    """
    seen: set[int] = set()
    params = grads = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        params += _local_bytes(p)
        if p.grad is not None:
            grads += _local_bytes(p.grad)
    import torch

    opt = 0
    if optimizer is not None:
        for state in _optimizer_state(optimizer).values():
            opt += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return {"params": float(params), "grads": float(grads), "optimizer": float(opt)}


def model_state_records(modules: list[nn.Module], optimizer: torch.optim.Optimizer, *,
                        peak: dict[str, float] | None = None,
                        estimate: dict[str, float] | None = None) -> dict[str, float]:
    """This rank's measured model state (GiB, record name -> value) over its modules, the optimizer
    counted once; `peak` (ModelStatePeak) replaces params and grads by their peak during backward;
    then the analytic `estimate` (estimate_memory) as `estimate_<key>(GiB)`."""
    measured: dict[str, float] = {}
    for i, module in enumerate(modules):
        for key, value in measure_model_state(module, optimizer if i == 0 else None).items():
            measured[key] = measured.get(key, 0.0) + value
    measured.update(peak or {})
    return {**{f"{key}(GiB)": value / 2**30 for key, value in measured.items()},
            **{f"estimate_{key}(GiB)": value / 2**30 for key, value in (estimate or {}).items()}}


def _live_bytes(t: torch.Tensor | None) -> int:
    """Bytes of `t`'s local data while its storage is allocated (FSDP2 frees by resizing to 0)."""
    if t is None:
        return 0
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size() if local.untyped_storage().nbytes() > 0 else 0


class ModelStatePeak:
    """Peak parameter + gradient bytes alive on this rank while it is open (a context manager).

    `measure_model_state` sees a step's end, when ZeRO-2/3 gradients are already sharded; the
    peak comes during backward, while a group's full gradients wait for their reduce-scatter.
    Samples at every gradient accumulation (`register_post_accumulate_grad_hook`) of every
    parameter tensor seen: the modules' own parameters and the unsharded ones FSDP2 swaps in
    (seen by forward pre-hooks, which run after FSDP2's unshard), plus explicit `sample()`s.
    Tensors count their local bytes while their storage is allocated, each tensor once.
    """

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self.tensors: dict[int, torch.Tensor] = {}
        self.peak: dict[str, float] = {"params": 0.0, "grads": 0.0}
        self._handles: list[Any] = []

    def start(self) -> ModelStatePeak:
        """Begin sampling (hooks on every module and parameter)."""
        for module in self.modules:
            self._track(module.parameters())
            for sub in module.modules():
                if next(sub.parameters(recurse=False), None) is not None:
                    self._handles.append(sub.register_forward_pre_hook(
                        lambda m, _args: self._track(m.parameters(recurse=False))))
        return self

    def stop(self) -> dict[str, float]:
        """Take a last sample, remove the hooks; the peak {"params", "grads"} in bytes."""
        self.sample()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return self.peak

    def __enter__(self) -> ModelStatePeak:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _track(self, params: Any) -> None:
        for p in params:
            if id(p) in self.tensors:
                continue
            self.tensors[id(p)] = p
            if p.requires_grad and p.is_leaf:
                with contextlib.suppress(RuntimeError):  # e.g. a DTensor FSDP2 assigns .grad to directly
                    self._handles.append(p.register_post_accumulate_grad_hook(lambda _p: self.sample()))

    def sample(self) -> None:
        """Record the bytes alive now if their sum is the largest so far."""
        params = sum(_live_bytes(t) for t in self.tensors.values())
        grads = sum(_live_bytes(t.grad) for t in self.tensors.values())
        if params + grads > self.peak["params"] + self.peak["grads"]:
            self.peak = {"params": float(params), "grads": float(grads)}


GIB = 2**30


def memory_error(cfg: RunConfig, *, limit_bytes: float, ranks_sharing: int, limit_name: str) -> ConfigError | None:
    """A ConfigError when the estimate exceeds the limit (None when it fits); pure and fast.

    `ranks_sharing` ranks draw on one `limit_bytes` (the ranks of one node on host RAM; 1 on a GPU
    each). The field named is the knob behind the larger term: model size or batch.micro.
    """
    est = estimate_memory(cfg)
    per_rank = sum(est.values())
    need = per_rank * ranks_sharing
    if need <= limit_bytes:
        return None
    state = est["params"] + est["grads"] + est["optimizer"]
    field, value = ("model.d_model", cfg.model.d_model) if state >= est["activations"] else ("batch.micro", cfg.batch.micro)
    split = f"{state / GIB:.3g} GiB model state + {est['activations'] / GIB:.3g} GiB activations"
    per = f" per rank x {ranks_sharing} ranks = {need / GIB:.3g} GiB" if ranks_sharing > 1 else " per rank"
    return ConfigError(field, value, f"the run needs an estimated {per_rank / GIB:.3g} GiB{per} ({split}), "
                       f"more than the {limit_bytes / GIB:.3g} GiB {limit_name}; use a smaller model or "
                       "batch.micro, or more parallel.tp/pp, or parallel.zero")


def machine_limit(cfg: RunConfig, nnodes: int = 1) -> tuple[float, int, str]:
    """(bytes, ranks sharing them, what they are) for this machine: one GPU's memory per rank when
    the run will use CUDA, else the host's available RAM shared by this node's ranks."""
    if _cuda_usable(cfg.backend):
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        return float(total), 1, f"of GPU memory on {torch.cuda.get_device_name(0)}"
    import psutil

    return float(psutil.virtual_memory().available), max(1, cfg.world_size // max(nnodes, 1)), \
        "of RAM available on this machine (psutil)"


def _cuda_usable(backend: str) -> bool:
    """Whether the run will use CUDA (`pick_backend` is nccl and a GPU is usable). Without a GPU
    driver's device node on Linux CUDA cannot be usable: answered without torch (`gpu_driver_present`)."""
    from engine.device import gpu_driver_present, pick_backend

    if backend == "gloo" or not gpu_driver_present():
        return False
    import torch

    return pick_backend(backend) == "nccl" and torch.cuda.is_available()


DEFAULT_DEVICE_GIB = 81559 / 1024  # an 80 GB-class GPU (H100 / A100 80GB): nvidia-smi shows 81559 MiB


def device_memory_target(cfg: RunConfig, device_memory_gib: float | None = None) -> tuple[float, str] | None:
    """(bytes, what they are) of the memory each rank's device will have, or None when the run
    targets this host's CPU and no `--device-memory` was given (then nothing is dry-run). Without a GPU
    driver on the host (`gpu_driver_present`) it is answered without importing torch."""
    if device_memory_gib is not None:
        return device_memory_gib * GIB, "device memory (--device-memory)"
    if _cuda_usable(cfg.backend):
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        return float(total), f"of GPU memory on {torch.cuda.get_device_name(0)}"
    from engine.device import pick_backend

    if pick_backend(cfg.backend) == "nccl" or cfg.cluster.gpus_per_node > 0:
        return DEFAULT_DEVICE_GIB * GIB, "of an 80 GB-class GPU (no GPU here; give --device-memory for another)"
    return None


def check_fits(cfg: RunConfig, nnodes: int = 1) -> None:
    """Raise ConfigError before launch when the run cannot fit this machine's memory (the built-in
    GPT only: a model.entry model's size is unknown until it is built)."""
    if cfg.model.entry is not None:
        return
    limit, ranks, name = machine_limit(cfg, nnodes)
    error = memory_error(cfg, limit_bytes=limit, ranks_sharing=ranks, limit_name=name)
    if error is not None:
        raise error
