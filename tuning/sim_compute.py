"""One transformer block's compute, activations and FLOPs on one GPU (the simulator's model terms).

Sources (docs/simulator.md gives the equations):
- GEMMs and FLOPs per layer: Narayanan et al. 2021, sec. 5.1, generalised to grouped-query
  attention (keys and values of kv_heads x head_dim) and SwiGLU MLPs (three matrices of width f),
  read from the model's shape (`ModelSpec`, `engine.shapes`).
- Activations per layer: Korthikanti et al. 2022, eqs. 1-3, with the same generalisation (the
  24 sbh/t inside the tensor-parallel region are 4 q/h + 4 kv/h for attention and 4 f/h, or 8 f/h
  gated, for the MLP; 10 sbh outside, 8 without dropout; 5 a s/h of scores, 2 without dropout,
  none when attention is fused).
- Causal attention: a fused kernel (`flash_attention`) skips the masked blocks, (s + 1) / 2 keys per
  query on average (`engine.shapes.ModelShape.flops_per_token(causal=True)`); reported FLOPs keep the
  convention (full s^2, as Megatron-LM and MosaicML count them).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from tuning.hardware import GB, ClusterSpec
from tuning.sim_framework import per_row
from tuning.sim_spec import ModelSpec

# Non-GEMM kernels (norms, softmax, dropout, activations, residuals) are memory-bound: forward moves
# about the bytes of activations it produces, backward twice that (roofline assumption).
NONGEMM_BWD_FACTOR = 2.0
# The loss over the vocabulary is memory-bound too (ours, counted per logit, forward and backward):
# the 16-bit logits read and upcast to fp32 (2 + 4), the max and the sum of exponentials read them
# (4 + 4), the fp32 gradient written and read back (4 + 4) and cast to 16 bits (2): 24 bytes.
LOSS_BYTES_PER_LOGIT = 24.0


def causal_factor(model: ModelSpec, c: dict[str, np.ndarray], cl: ClusterSpec) -> np.ndarray:
    """Share of the s x s attention a kernel computes: (s + 1) / 2s with fused causal attention
    (masked blocks skipped), 1 without (the scores are computed in full, then masked). A measured
    attention table (CPU profiles) already holds the causal kernel's rate per full-s^2 FLOP: 1."""
    if cl.attention_table:
        return np.asarray(1.0)
    return np.where(np.asarray(c.get("flash_attention", False)), (model.seq + 1) / (2.0 * model.seq), 1.0)


def attention_time(cl: ClusterSpec, flops: Any) -> np.ndarray:
    """Seconds of one attention GEMM of `flops` work at the attention rate (measured, or fitted on
    long-sequence rows): fused or not, Q K^T and scores x V multiply over a head's width (64-128), so
    both run below the large GEMMs' rate; one rate prices both (an assumption, docs/simulator.md)."""
    return flops / cl.attention_rate(flops)


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


def _gemm_times(m: ModelSpec, cl: ClusterSpec, bt: np.ndarray, causal: np.ndarray) -> tuple[Any, Any, Any]:
    """(dense, attention, logits) forward GEMM seconds of one layer for micro-batch / tp = `bt`."""
    s, h, f = m.seq, m.hidden, m.ffn
    # q, k, v (one fused GEMM), the output projection, the MLP's matrices (gate and up apart)
    dense = [2 * bt * s * h * (m.q_dim + 2 * m.kv_dim), 2 * bt * s * m.q_dim * h]
    dense += [2 * bt * s * h * f] * (m.mlp_mats - 1) + [2 * bt * s * f * h]
    attn = 2 * bt * s * s * m.q_dim  # Q K^T and scores x V, each, batched over heads
    t_dense = sum(x / cl.gemm_rate(x) for x in dense)
    t_attn = 2.0 * causal * attention_time(cl, attn)
    logit = 2 * bt * s * h * m.vocab
    return t_dense, t_attn, logit / cl.gemm_rate(logit)


def compute_times(m: ModelSpec, cl: ClusterSpec, c: dict[str, np.ndarray],
                  act: dict[str, np.ndarray], frameworks: Any = None) -> dict[str, np.ndarray]:
    """Per micro-batch on the slowest (last) stage: forward and backward (recompute included) seconds."""
    # Every GEMM's size is a multiple of b/t: price each distinct b/t once (a search has few).
    ratio = np.asarray(c["micro"] / c["tp"], dtype=float)
    causal = causal_factor(m, c, cl)
    bt, inverse = np.unique(ratio, return_inverse=True) if ratio.size > 64 and np.ndim(causal) == 0 else (ratio, None)
    t_dense, t_attn, t_logit = _gemm_times(m, cl, bt, causal)
    if inverse is not None:
        t_dense, t_attn, t_logit = (np.asarray(x)[inverse.reshape(ratio.shape)] for x in (t_dense, t_attn, t_logit))
    hbm = cl.hbm_gb_s * cl.hbm_efficiency * GB
    # Roofline floor: a GEMM cannot run faster than it streams its weights (the layer's matrices / t,
    # vocab h / t for the logits) from memory; binding only at a few tokens per micro-batch. The
    # backward streams them twice (input gradient reads W, weight gradient writes dW). Measured
    # hosts stream them at their own few-token rate (`weight_stream_gb_s`), not the elementwise one.
    stream = cl.weight_stream_gb_s * GB if cl.weight_stream_gb_s > 0 else hbm
    w_dense = m.layer_matmul_params / c["tp"] * c["dtype_bytes"] / stream
    w_logit = m.vocab * m.hidden / c["tp"] * c["dtype_bytes"] / stream
    loss = LOSS_BYTES_PER_LOGIT * c["micro"] * m.seq * m.vocab / c["tp"] / hbm
    t_logit = np.maximum(t_logit, w_logit)
    fwd_layer = np.maximum(t_dense, w_dense) + t_attn + act["full"] / hbm
    # Flash attention's backward recomputes Q K^T (one of the two attention GEMMs) from Q and K.
    t_flash = np.where(c.get("flash_attention", False), 0.5 * t_attn, 0.0)
    bwd_layer = (2.0 * np.maximum(t_dense, w_dense) + 2.0 * t_attn + t_flash
                 + NONGEMM_BWD_FACTOR * act["full"] / hbm)
    rc = c["recompute"]
    re_layer = np.select([rc == 2, rc == 1], [fwd_layer, t_attn + act["attn"] / hbm], 0.0)
    per_stage = m.layers / c["pp"]
    # Host-side time the device does not hide: the measured host's (CPU profiles) and the framework's
    # fitted fixed costs (GPU presets), split 1:2 between forward and backward as the GEMMs are.
    fw = c.get("framework", np.asarray(0))
    layer_ovh = (cl.overhead_layer_s + np.where(c["tp"] > 1, cl.overhead_tp_layer_s, 0.0)
                 + np.where(c["zero"] >= 2, cl.overhead_fsdp_layer_s, 0.0)
                 + per_row(fw, "layer_microbatch_s", frameworks))
    ovh = per_stage * layer_ovh + cl.overhead_microbatch_s + per_row(fw, "microbatch_s", frameworks)
    re_ovh = np.where(rc == 2, per_stage * cl.overhead_layer_s / 3.0, 0.0)
    return {
        "fwd": per_stage * fwd_layer + t_logit + 0.5 * loss + ovh / 3.0,
        "bwd": per_stage * (bwd_layer + re_layer) + 2.0 * t_logit + 0.5 * loss + 2.0 * ovh / 3.0 + re_ovh,
    }


def stage_params(m: ModelSpec, c: dict[str, np.ndarray]) -> np.ndarray:
    """Parameters per GPU of the most loaded stage: its blocks (/t) and the embedding (/t), with the
    untied head too when one stage holds the whole model; learned positions and the final norm are
    replicated (at tp = pp = 1 this is `ModelSpec.params`, engine/shapes.py's count)."""
    vocab = m.vocab * m.hidden / c["tp"] * np.where((c["pp"] == 1) & (not m.tied_embeddings), 2.0, 1.0)
    positions = m.seq * m.hidden if m.learned_positions else 0.0
    return m.layers / c["pp"] * m.dense_layer_params / c["tp"] + vocab + positions + m.norm_params * m.hidden


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
