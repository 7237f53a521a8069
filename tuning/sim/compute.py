"""One transformer block's compute, activations and FLOPs on one GPU (the simulator's model terms).

Sources (docs/simulator.md gives the equations):
- GEMMs and FLOPs per layer: Narayanan et al. 2021, sec. 5.1, generalised to grouped-query
  attention (keys and values of kv_heads x head_dim) and SwiGLU MLPs (three matrices of width f),
  read from the model's shape (`ModelSpec`, `engine.model.shapes`).
- Activations per layer: Korthikanti et al. 2022, eqs. 1-3, with the same generalisation (the
  24 sbh/t inside the tensor-parallel region are 4 q/h + 4 kv/h for attention and 4 f/h, or 8 f/h
  gated, for the MLP; 10 sbh outside, 8 without dropout; 5 a s/h of scores, 2 without dropout,
  none when attention is fused).
- Causal attention: a fused kernel (`flash_attention`) skips the masked blocks, (s + 1) / 2 keys per
  query on average (`engine.model.shapes.ModelShape.flops_per_token(causal=True)`); reported FLOPs keep the
  convention (full s^2, as Megatron-LM and MosaicML count them).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from tuning.sim.hardware import GB, ClusterSpec
from tuning.sim.framework import per_row
from tuning.sim.groups import row_groups, spread
from tuning.sim.spec import ModelSpec, engine_rows

# Non-GEMM kernels (norms, softmax, dropout, activations, residuals) are memory-bound: forward moves
# about the bytes of activations it produces, backward twice that (roofline assumption).
NONGEMM_BWD_FACTOR = 2.0
# The loss over the vocabulary is memory-bound too (ours, counted per logit, forward and backward):
# the 16-bit logits read and upcast to fp32 (2 + 4), the max and the sum of exponentials read them
# (4 + 4), the fp32 gradient written and read back (4 + 4) and cast to 16 bits (2): 24 bytes.
LOSS_BYTES_PER_LOGIT = 24.0
# Megatron's vocab_parallel_cross_entropy as it runs unfused (--cross-entropy-loss-fusion off, Megatron-LM's
# default; megatron/core/tensor_parallel/cross_entropy.py), per logit: forward the fp32 copy (2 + 4), max (4),
# in-place subtract (4 + 4), in-place exp (4 + 4), sum (4), in-place divide (4 + 4): 38; backward the
# in-place multiply by the output gradient (4 + 4) and the cast back to 16 bits (4 + 2): 14.
UNFUSED_LOSS_BYTES_PER_LOGIT = (38.0, 14.0)


def causal_factor(model: ModelSpec, c: dict[str, np.ndarray], cl: ClusterSpec) -> np.ndarray:
    """Share of the s x s attention a kernel computes: (s + 1) / 2s with fused causal attention
    (masked blocks skipped), 1 without (the scores are computed in full, then masked). A measured
    attention table (CPU profiles) already holds the causal kernel's rate per full-s^2 FLOP: 1."""
    if cl.attention_table:
        return np.asarray(1.0)
    return np.where(np.asarray(c.get("flash_attention", False)), (model.seq + 1) / (2.0 * model.seq), 1.0)


def attention_time(cl: ClusterSpec, flops: Any) -> np.ndarray:
    """CPU profiles: seconds of one attention GEMM of `flops` work at the measured attention rate
    (fused or not, Q K^T and scores x V priced alike)."""
    return flops / cl.attention_rate(flops)


def _impls(c: dict[str, np.ndarray], frameworks: Any) -> list[tuple[np.ndarray, str]]:
    """(rows mask, fused-attention kernel) for each kernel among the rows: the row's `attention_kernel`
    where it names one, else its framework flavour's."""
    from tuning.sim.framework import FRAMEWORK_NAMES, FRAMEWORKS
    from tuning.sim.spec import ATTENTION_KERNELS

    table = frameworks or FRAMEWORKS
    fw = np.asarray(c.get("framework", 0))
    own = np.asarray(c.get("attention_kernel", 0))
    out = [((fw == i) & (own == 0), table[name].attention_kernel) for i, name in enumerate(FRAMEWORK_NAMES)]
    out += [(own == j, kernel) for j, kernel in enumerate(ATTENTION_KERNELS) if j]
    return [(rows, kernel) for rows, kernel in out if np.any(rows)]


def attention_seconds(m: ModelSpec, cl: ClusterSpec, c: dict[str, np.ndarray], *, seq_q: Any, seq_k: Any,
                      blocks: Any = 1.0, causal: bool = True, frameworks: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of the attention core of one layer and micro-batch on a tp rank:
    `blocks` blocks of `seq_q` queries against `seq_k` keys over micro x heads / tp heads.

    GPU presets (`ClusterSpec.kernels`): fused attention at the framework's kernel's measured rate by
    head dim, length and causality (backward as measured: it recomputes Q K^T); unfused attention as
    its batched GEMMs (4 in backward) over every score. CPU profiles: the measured attention table,
    backward 2x (+ Q K^T recomputed when fused)."""
    flash = np.asarray(c.get("flash_attention", False))
    heads = c["micro"] * m.heads / c["tp"]
    if not cl.kernels:
        share = np.where(flash, (np.asarray(seq_k) + 1) / (2.0 * np.asarray(seq_k)), 1.0) if causal else 1.0
        if cl.attention_table:
            share = 1.0
        fwd = blocks * share * 2.0 * attention_time(cl, 2.0 * c["micro"] / c["tp"] * seq_q * seq_k * m.q_dim)
        return fwd, (2.0 + 0.5 * flash) * fwd
    from tuning.sim.kernels import fused_attention_seconds, gemm_seconds, gpu_facts

    facts, peak, d = gpu_facts(cl.kernels), cl.peak_flops, m.hd
    # Q K^T (scores), P V (output) and the backward's K-side products: three shapes, each priced once
    scores, output, keys = (gemm_seconds(facts, peak, *shape, heads)
                            for shape in ((seq_q, seq_k, d), (seq_q, d, seq_k), (seq_k, d, seq_q)))
    plain_fwd = scores + output
    plain_bwd = output + keys + scores + keys
    fused_fwd, fused_bwd = np.zeros_like(plain_fwd), np.zeros_like(plain_bwd)
    for rows, impl in _impls(c, frameworks):
        fused = fused_attention_seconds(facts, impl, heads=heads, seq_q=seq_q, seq_k=seq_k, head_dim=d, causal=causal)
        if fused is None:  # no measured fused kernel: its GEMMs, causal half skipped
            fused = ((0.5 if causal else 1.0) * plain_fwd, (0.5 if causal else 1.0) * plain_bwd)
        fused_fwd = np.where(rows, fused[0], fused_fwd)
        fused_bwd = np.where(rows, fused[1], fused_bwd)
    return blocks * np.where(flash, fused_fwd, plain_fwd), blocks * np.where(flash, fused_bwd, plain_bwd)


def activation_bytes(m: ModelSpec, c: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per layer and micro-batch, bytes (Korthikanti et al. 2022, eqs. 1-3, 16-bit based)."""
    t, sp = c["tp"], c["sequence_parallel"]
    sbh = m.seq * c["micro"] * m.hidden * c["dtype_bytes"] / 2.0
    # softmax (and dropout mask and output) of the s x s scores; fused (flash) attention never materialises them
    scores = 5.0 if m.dropout else 2.0
    attn = np.where(c.get("flash_attention", False), 0.0, scores * m.heads * m.seq / (m.hidden * t))
    inside = (4.0 * m.q_dim + 4.0 * m.kv_dim + (8.0 if m.gated_mlp else 4.0) * m.ffn) / m.hidden
    outside = 10.0 if m.dropout else 8.0  # two norms' inputs (4), QKV and MLP inputs (4), two dropout masks (2)
    linear = np.where(sp, (outside + inside) / t, outside + inside / t)  # sp shards the norms/dropout
    full = sbh * (linear + attn)
    stored = np.select(
        [c["recompute"] == 2, c["recompute"] == 1],
        [2.0 * sbh / np.where(sp, t, 1), sbh * linear],  # full keeps the layer input only
        full,
    )
    return {"full": full, "attn": sbh * attn, "stored": stored}


def _dense_times(m: ModelSpec, cl: ClusterSpec, c: dict[str, np.ndarray]) -> tuple[Any, Any, Any, Any]:
    """(layer forward, layer backward, logits forward, logits backward) GEMM seconds per micro-batch
    on a tp rank. GPU presets: each GEMM by its shape (tokens b s x width / t over the input width;
    backward = input and weight gradients, `tuning.sim.kernels`). CPU profiles: the measured rate by
    FLOPs, no faster than the weights stream at the measured few-token rate."""
    b, t, s, h, f = c["micro"], c["tp"], m.seq, m.hidden, m.ffn
    fp8 = np.asarray(c.get("fp8", False), dtype=bool)
    if cl.kernels:
        from tuning.sim.kernels import fp8_facts, gemm_pairs, gpu_facts

        facts, tok = gpu_facts(cl.kernels), b * s
        shapes = [(tok, (m.q_dim + 2 * m.kv_dim) / t, h), (tok, h, m.q_dim / t)]  # q, k, v fused; out
        shapes += [(tok, f / t, h)] * (m.mlp_mats - 1) + [(tok, h, f / t)]  # gate and up; down
        fwd, bwd = gemm_pairs(facts, cl.peak_flops, [*shapes, (tok, m.vocab / t, h)])
        dense_f, dense_b = sum(fwd[:-1]), sum(bwd[:-1])
        if np.any(fp8):  # the blocks' linear layers in FP8 (Transformer Engine); the output layer stays 16-bit
            fp8_facts(facts, cl.name)  # ValueError naming the GPU where it has no FP8 rate
            fwd8, bwd8 = gemm_pairs(facts, cl.peak_flops, shapes, fp8=True)
            dense_f, dense_b = np.where(fp8, sum(fwd8), dense_f), np.where(fp8, sum(bwd8), dense_b)
        return dense_f, dense_b, fwd[-1], bwd[-1]
    if np.any(fp8):
        raise ValueError(f"fp8=true: cluster {cl.name!r} is a measured CPU profile with no FP8 GEMM rate; use fp8=false")
    bt = b / t
    dense = [2 * bt * s * h * (m.q_dim + 2 * m.kv_dim), 2 * bt * s * m.q_dim * h]
    dense += [2 * bt * s * h * f] * (m.mlp_mats - 1) + [2 * bt * s * f * h]
    t_dense = sum(x / cl.gemm_rate(x) for x in dense)
    logit = 2 * bt * s * h * m.vocab
    # a GEMM cannot run faster than it streams its weights; binding only at a few tokens per micro-batch
    stream = (cl.weight_stream_gb_s or cl.hbm_gb_s * cl.hbm_efficiency) * GB
    w_dense = m.layer_matmul_params / t * c["dtype_bytes"] / stream
    t_dense = np.maximum(t_dense, w_dense)
    t_logit = np.maximum(logit / cl.gemm_rate(logit), m.vocab * h / t * c["dtype_bytes"] / stream)
    return t_dense, 2.0 * t_dense, t_logit, 2.0 * t_logit


KERNEL_KEYS = ("micro", "tp", "flash_attention", "framework", "dtype_bytes", "attn_density",
               "attention_kernel", "fp8")  # what kernel times depend on


def per_unique(c: dict[str, np.ndarray], fn: Any) -> Any:
    """`fn(c)` priced once per distinct (micro, tp, fused, framework, dtype, density) and spread back over
    the rows (a search has few distinct ones; pricing every row's GEMMs by shape would dominate it)."""
    shape = np.shape(c["tp"])
    if int(np.prod(shape)) <= 64:
        return fn(c)
    keys = [k for k in KERNEL_KEYS if k in c]  # an absent column keeps its default in `fn`
    cached = c.get("_kernel_rows")  # the rows' grouping, found once per priced batch (evaluate_arrays' dict)
    if cached is None or cached[0] is not c["tp"]:
        cols = [np.broadcast_to(np.asarray(c[k], dtype=float), shape).ravel() for k in keys]
        key = np.zeros(cols[0].shape, dtype=np.int64)
        for col in cols:  # one mixed-radix integer key (small non-negative integers code themselves)
            lo, hi = col.min(), col.max()
            if lo == hi:
                continue
            if lo >= 0 and hi < 2**20 and np.array_equal(col, np.floor(col)):
                key = key * (int(hi) + 1) + col.astype(np.int64)
            else:
                values, code = np.unique(col, return_inverse=True)
                key = key * len(values) + code
        first, inverse = row_groups(key)
        cached = (c["tp"], first, inverse.reshape(shape))
        c["_kernel_rows"] = cached
    _, first, inverse = cached
    sub = {**c, **{k: np.broadcast_to(np.asarray(c[k]), shape).ravel()[first] for k in keys}}
    return spread(fn(sub), inverse)


def _kernel_times(m: ModelSpec, cl: ClusterSpec, c: dict[str, np.ndarray], frameworks: Any) -> dict[str, Any]:
    """GEMM and attention seconds per micro-batch on a tp rank (priced per distinct row, `per_unique`)."""
    def price(sub: dict[str, np.ndarray]) -> dict[str, Any]:
        dense_f, dense_b, logit_f, logit_b = _dense_times(m, cl, sub)
        attn_f, attn_b = attention_seconds(m, cl, sub, seq_q=m.seq, seq_k=m.seq, frameworks=frameworks)
        return {"dense_f": dense_f, "dense_b": dense_b, "logit_f": logit_f, "logit_b": logit_b,
                "attn_f": attn_f, "attn_b": attn_b}

    return per_unique(c, price)


def fused_block_bytes(m: ModelSpec, c: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) bytes per layer and micro-batch of the memory-bound kernels of a Megatron-core
    block built from Transformer Engine's fused modules, on a tp rank: what each kernel reads and writes.

    Forward, per token: the two norms (TE's LayerNormLinear: read x, write the normed input, 2h each),
    the two bias-dropout-add residuals (megatron/core/fusions/fused_bias_dropout.py: read 2h, write h),
    rotary embedding of q and k (apply_rope_fusion, TE's fused_apply_rotary_pos_emb: read and write
    q + kv), the activation (fused bias-SwiGLU / bias-GeGLU, megatron/core/fusions/fused_bias_swiglu.py:
    read 2f, write f; a plain activation read f, write f). Backward: each norm reads x and dy and
    writes dx (3h), each residual's gradient sum reads two and writes one (3h), rotary as forward,
    SwiGLU's backward reads the saved 2f and the f gradient and writes 2f (swiglu_back; GELU 3f).
    Norms and residuals run on s/t tokens under sequence parallelism, on all s without it; the
    attention core and the GEMMs are priced apart. Dropout adds its 1-byte masks."""
    t, el = c["tp"], c["dtype_bytes"]
    tok = c["micro"] * m.seq
    h_out = m.hidden * np.where(c["sequence_parallel"], 1.0 / t, 1.0)
    rope = 0.0 if m.learned_positions else 2.0 * (m.q_dim + m.kv_dim) / t
    act_f, act_b = ((3.0, 5.0) if m.gated_mlp else (2.0, 3.0))
    mask = 2.0 * h_out if m.dropout else 0.0  # bytes per token, written forward and read backward
    fwd = tok * (el * (10.0 * h_out + rope + act_f * m.ffn / t) + mask)
    bwd = tok * (el * (12.0 * h_out + rope + act_b * m.ffn / t) + mask)
    return fwd, bwd


# Transformer Engine keeps an amax history per FP8 tensor of each GEMM (fp8_meta: forward input, weight and output,
# backward output gradient and input gradient, recipe.DelayedScaling amax_history_len 1024 fp32 values each):
FP8_AMAX_BYTES_PER_GEMM = 5 * 1024 * 4
# bytes a Transformer Engine cast-transpose moves per element cast to FP8 (tex.fp8_cast_transpose_fused: read the
# 16-bit tensor, write its FP8 copy and the FP8 copy of its transpose, one byte each; the amax reduction is fused)
FP8_CAST_BYTES = 4.0


def fp8_cast_bytes(m: ModelSpec, c: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) bytes per layer and micro-batch on a tp rank that Transformer Engine's FP8 casts move
    where a row runs FP8 (`fp8`), 0 elsewhere. Forward: each linear layer's input cast with its transpose (the
    transpose is what wgrad reads): q/k/v's and fc1's h-wide inputs, the output projection's q/t and fc2's f/t;
    and the block's weights (layer_matmul_params / t) cast the same way, each micro-batch, but once a step where
    Megatron-core passes is_first_microbatch (TE caches the FP8 weights and their transposes across the step's
    micro-batches; other callers, Composer's amp_fp8 among them, pass None: no cache). Backward: each GEMM's
    output gradient cast with its transpose (dgrad and wgrad read both): (q + 2 kv)/t, h, (mlp_mats - 1) f/t, h."""
    from tuning.sim.framework import FRAMEWORK_NAMES

    on = np.asarray(c.get("fp8", False), dtype=bool)
    t, tok = c["tp"], c["micro"] * m.seq
    inputs = 2.0 * m.hidden + (m.q_dim + m.ffn) / t
    grads = 2.0 * m.hidden + (m.q_dim + 2.0 * m.kv_dim + (m.mlp_mats - 1) * m.ffn) / t
    fw = np.asarray(c.get("framework", 0))
    cached = (fw == FRAMEWORK_NAMES.index("megatron-core")) | (fw == FRAMEWORK_NAMES.index("megatron"))
    weights = m.layer_matmul_params / t / np.where(cached, np.maximum(np.asarray(c.get("num_mb", 1)), 1), 1)
    fwd = np.where(on, FP8_CAST_BYTES * (tok * inputs + weights), 0.0)
    bwd = np.where(on, FP8_CAST_BYTES * tok * grads, 0.0)
    return fwd, bwd


def unpad_bytes(m: ModelSpec, c: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) bytes per layer and micro-batch on a tp rank that flash-attn's bert_padding moves
    around FlashAttention's varlen kernel where a row runs it so (`attention_unpad`: llm-foundry's
    flash_attn_fn, flash-attn 2.x bert_padding.py). Forward: unpad_input gathers q, k and v
    (IndexFirstAxis: read and write each), pad_input writes a zero output and scatters the kernel's output
    into it (IndexPutFirstAxis: zeros, read, write): 5 q + 4 kv elements per token. Backward: pad_input's
    gather of the output gradient (read, write) and, per q, k and v, a zero gradient the incoming one is
    scattered into (zeros, read, write): 5 q + 6 kv. Zero where the row does not unpad. The index reads and
    the host syncs of unpad_input (a `nonzero` and an `.item()` per call) are not priced."""
    on = np.asarray(c.get("attention_unpad", False)) & np.asarray(c.get("flash_attention", False))
    per = c["micro"] * m.seq * c["dtype_bytes"] / c["tp"]
    fwd = np.where(on, per * (5.0 * m.q_dim + 4.0 * m.kv_dim), 0.0)
    bwd = np.where(on, per * (5.0 * m.q_dim + 6.0 * m.kv_dim), 0.0)
    return fwd, bwd


def compute_times(m: ModelSpec, cl: ClusterSpec, c: dict[str, np.ndarray],
                  act: dict[str, np.ndarray], frameworks: Any = None) -> dict[str, np.ndarray]:
    """Per micro-batch on the slowest (last) stage: forward and backward (recompute included) seconds,
    and the dense GEMM seconds (`gemm`, what tensor-parallel traffic can overlap)."""
    from tuning.sim.kernels import memory_bandwidth

    k = _kernel_times(m, cl, c, frameworks)
    hbm = memory_bandwidth(cl)
    fw = c.get("framework", np.asarray(0))
    # the framework's fitted GPU costs (host work, kernel fusion) apply on GPU presets; a CPU profile
    # carries its own measured host costs and memory-bound rate
    gpu = 1.0 if cl.kernels else 0.0
    # memory-bound kernels: the bytes a Transformer Engine block's fused kernels move (flavours that run
    # them), else the activation bytes the model counts (Korthikanti et al.), backward twice; x the
    # framework's traffic per byte
    moved = (gpu * per_row(fw, "elementwise_traffic", frameworks) + (1.0 - gpu)) / hbm
    fused = gpu * per_row(fw, "fused_kernels", frameworks) > 0
    if np.any(fused):
        block_f, block_b = fused_block_bytes(m, c)
        extra = act.get("moe", 0.0)  # MoE blocks' expert intermediates and token buffers (tuning/sim/moe.py)
        elem_f = np.where(fused, block_f + extra, act["full"])
        elem_b = np.where(fused, block_b + NONGEMM_BWD_FACTOR * extra, NONGEMM_BWD_FACTOR * act["full"])
    else:
        elem_f, elem_b = act["full"], NONGEMM_BWD_FACTOR * act["full"]
    if np.any(c.get("attention_unpad", False)):
        unpad_f, unpad_b = unpad_bytes(m, c)
        elem_f, elem_b = elem_f + unpad_f, elem_b + unpad_b
    logits = c["micro"] * m.seq * m.vocab / c["tp"] / hbm  # seconds per byte a logit moves
    unfused = np.asarray(c.get("unfused_loss", False), dtype=bool)
    loss_f = np.where(unfused, UNFUSED_LOSS_BYTES_PER_LOGIT[0], 0.5 * LOSS_BYTES_PER_LOGIT) * logits
    loss_b = np.where(unfused, UNFUSED_LOSS_BYTES_PER_LOGIT[1], 0.5 * LOSS_BYTES_PER_LOGIT) * logits
    fwd_layer = k["dense_f"] + k["attn_f"] + elem_f * moved
    bwd_layer = k["dense_b"] + k["attn_b"] + elem_b * moved
    if np.any(c.get("fp8", False)):  # Transformer Engine's casts to FP8, at the measured streaming rate
        cast_f, cast_b = fp8_cast_bytes(m, c)
        fwd_layer, bwd_layer = fwd_layer + cast_f / hbm, bwd_layer + cast_b / hbm
    rc = c["recompute"]
    re_layer = np.select([rc == 2, rc == 1], [fwd_layer, k["attn_f"] + act["attn"] * moved], 0.0)
    per_stage = m.layers / c["pp"]
    # Host-side time the device does not hide: the measured host's (CPU profiles) and the framework's
    # fitted fixed costs (GPU presets), split 1:2 between forward and backward as the GEMMs are.
    layer_ovh = (cl.overhead_layer_s + np.where(c["tp"] > 1, cl.overhead_tp_layer_s, 0.0)
                 + np.where(c["zero"] >= 2, cl.overhead_fsdp_layer_s, 0.0)
                 + gpu * per_row(fw, "layer_microbatch_s", frameworks))
    ovh = per_stage * layer_ovh + cl.overhead_microbatch_s + gpu * per_row(fw, "microbatch_s", frameworks)
    # full recomputation runs each layer's forward again, host work included: Megatron-LM's CheckpointFunction
    # and torch.utils.checkpoint call the layer's forward function in the backward (megatron/core/
    # tensor_parallel/random.py CheckpointFunction.backward; torch/utils/checkpoint.py), so the forward's share of
    # the per-layer fixed cost is paid twice, as the forward's kernels are (`re_layer`); not FSDP2's hooks, which
    # sit on the block around the checkpointed module and do not run again
    replayed = layer_ovh - np.where(c["zero"] >= 2, cl.overhead_fsdp_layer_s, 0.0)
    re_ovh = np.where(rc == 2, per_stage * replayed / 3.0, 0.0)
    return {
        "fwd": per_stage * fwd_layer + k["logit_f"] + loss_f + ovh / 3.0,
        "bwd": per_stage * (bwd_layer + re_layer) + k["logit_b"] + loss_b + 2.0 * ovh / 3.0 + re_ovh,
        "gemm": per_stage * (k["dense_f"] + k["dense_b"] + np.where(rc == 2, k["dense_f"], 0.0)),
    }


def stage_params(m: ModelSpec, c: dict[str, np.ndarray]) -> np.ndarray:
    """Parameters per GPU of the most loaded stage: its blocks (/t) and the embedding (/t), with the
    untied head too when one stage holds the whole model; learned positions and the final norm are
    replicated (at tp = pp = 1 this is `ModelSpec.params`, engine/model/shapes.py's count)."""
    # the engine keeps the embedding, the head and the norms' weights replicated over tp (engine/parallel/tensor.py)
    engine = engine_rows(c) if "framework" in c else False
    t = np.where(engine, 1, c["tp"])
    vocab = m.vocab * m.hidden / t * np.where((c["pp"] == 1) & (not m.tied_embeddings), 2.0, 1.0)
    positions = m.seq * m.hidden if m.learned_positions else 0.0
    norms = np.where(engine, 2 * m.norm_params * m.hidden * (1 - 1 / c["tp"]), 0.0)
    return m.layers / c["pp"] * (m.dense_layer_params / c["tp"] + norms) + vocab + positions + m.norm_params * m.hidden


def flops(m: ModelSpec, c: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(executed, model) FLOPs per iteration (Narayanan et al. 2021, sec. 5.1, from the shape).

    Per sample and layer, forward: 2 s x (the layer's matrix weights) + 4 s^2 (q width); logits
    2 s h V; backward twice the forward. Full recomputation replays each layer's forward (for a
    GPT: the 96 B s l h^2 (1 + s/6h + V/16lh) formula); selective replays the attention core.
    Attention counts the full s x s (the convention MFU and Megatron-LM's TFLOP/s use).
    """
    s = m.seq
    core = 4.0 * s * s * m.q_dim
    layer = 2.0 * s * m.layer_matmul_params + core
    model = c["global_batch"] * (3.0 * m.layers * layer + 3.0 * 2.0 * s * m.hidden * m.vocab)
    extra = np.select([c["recompute"] == 2, c["recompute"] == 1], [m.layers * layer, m.layers * core], 0.0)
    return model + c["global_batch"] * extra, model
