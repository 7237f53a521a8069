"""Context (sequence) parallelism and long-tail batches in the performance simulator (issue 19).

`tuning.sim.core.evaluate_arrays` prices a context-parallel degree cp on a model whose rank
holds s/cp tokens of every sequence (`local_model`), then corrects what that local view gets
wrong: attention, whose s^2 work is split over cp but not shrunk by cp^2 (`attention_delta`),
the attention-score memory (`score_memory_scale`), and the cp communication (`cp_comm_time`).

- Ulysses (Jacobs et al. 2023, DeepSpeed-Ulysses): four all-to-alls per layer forward (Q, K, V
  from sequence- to head-sharded, the output back), each of the rank's b s (width) / (cp t)
  activation bytes, with keys and values at the grouped-query width kv_heads x head_dim (repeated
  to lcm(kv_heads/t, cp) heads where cp does not divide them), four in backward; attention runs on
  a/(t cp) heads over the full sequence, so it needs heads % (tp x cp) == 0.
- Ring (Liu et al. 2023, Ring Attention; Megatron-LM context parallelism): cp - 1 steps, each
  sending the K and V blocks (2 b s kv_width / (cp t) bytes) to the next rank while the current block's
  attention runs (overlapped); backward also sends dK, dV (twice the bytes). Both keep the
  s x s / cp scores per rank unless attention is fused (`flash_attention`), as without cp; a fused
  causal kernel computes (s + 1) / 2s of the s x s over the whole sequence (load-balanced ring).
- Gradients are reduced over dp x cp ranks (cp ranks hold the same parameters, as Megatron-LM).
- `long_tail_batch`: packed rows of variable-length sequences (FlexSP, Wang et al. 2024) cost
  attention E[s^2] / (S E[s]) of a row's S^2 (block-diagonal masks), the GEMMs all S tokens.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tuning.sim.hardware import GB, ClusterSpec
from tuning.sim.comm import all_to_all_time
from tuning.sim.compute import attention_seconds, causal_factor, per_unique
from tuning.sim.groups import take_rows
from tuning.sim.spec import CP_IMPLS



def local_model(model: Any, cp: int) -> Any:
    """The model one cp rank sees: s / cp tokens of each sequence (GEMMs, activations, tp and pp
    messages, logits all shrink with the local sequence)."""
    return dataclasses.replace(model, seq=model.seq // cp)


def _ring(c: dict[str, np.ndarray]) -> np.ndarray:
    return np.asarray(c.get("cp_impl", 0)) == CP_IMPLS.index("ring")


def score_memory_scale(c: dict[str, np.ndarray], cp: int) -> np.ndarray:
    """Factor on the local model's (s/cp)^2 score memory: Ulysses holds a/(t cp) heads of the full
    s x s scores, ring the cp blocks of s/cp x s/cp its backward needs: cp x the local view either
    way (fused attention, `flash_attention`, stores none); scaled by the long-tail density."""
    return float(cp) * np.asarray(c.get("attn_density", 1.0))


def _ring_block(model: Any, local: Any, cl: ClusterSpec, c: dict[str, np.ndarray],
                frameworks: Any) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of one ring step's s/cp x s/cp block of attention: load-balanced,
    so each block carries the whole sequence's causal share of its keys, scaled by the density."""
    share = np.asarray(c.get("attn_density", 1.0)) * causal_factor(model, c, cl)
    return attention_seconds(local, cl, c, seq_q=local.seq, seq_k=local.seq, blocks=share, causal=False,
                             frameworks=frameworks)


def attention_delta(model: Any, local: Any, cl: ClusterSpec, c: dict[str, np.ndarray], cp: int,
                    frameworks: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) attention seconds per layer and micro-batch beyond what the local model priced.

    The local model priced causal attention over s/cp tokens. Ulysses runs it over the full
    sequence on a/(t cp) heads; ring runs cp blocks of the local size (load-balanced, so the causal
    share is the full sequence's). Both are scaled by the attention density of long-tail batches
    (1 for one sequence per row).
    """
    s = local.seq

    def price(sub: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        priced = attention_seconds(local, cl, sub, seq_q=s, seq_k=s, frameworks=frameworks)
        ring = _ring_block(model, local, cl, sub, frameworks)
        uly = attention_seconds(model, cl, sub, seq_q=model.seq, seq_k=model.seq, blocks=1.0 / cp, frameworks=frameworks)
        return {"ring_f": ring[0], "ring_b": ring[1], "uly_f": uly[0], "uly_b": uly[1],
                "local_f": priced[0], "local_b": priced[1]}

    t = per_unique(c, price)
    density = np.asarray(c.get("attn_density", 1.0))
    return tuple(np.where(_ring(c), cp * t[f"ring_{k}"], density * t[f"uly_{k}"]) - t[f"local_{k}"] for k in ("f", "b"))


def add_attention(times: dict[str, np.ndarray], model: Any, local: Any, cl: ClusterSpec, c: dict[str, np.ndarray],
                  cp: int, frameworks: Any = None) -> dict[str, np.ndarray]:
    """Add `attention_delta` to forward and backward; selective and full recomputation replay the forward."""
    fwd, bwd = attention_delta(model, local, cl, c, cp, frameworks)
    n = local.layers / c["pp"]
    return {**times, "fwd": times["fwd"] + n * fwd, "bwd": times["bwd"] + n * (bwd + fwd * (c["recompute"] >= 1))}


def ulysses_message_bytes(local: Any, c: dict[str, np.ndarray], cp: int) -> tuple[np.ndarray, np.ndarray]:
    """(Q or output, K or V) bytes one rank puts into one Ulysses all-to-all (its input: the
    collectives profiler's count). K/V travel at their own heads, repeated only until cp divides
    the rank's kv heads (engine/parallel/context.py: lcm(kv/tp, cp) heads)."""
    t = np.asarray(c["tp"])
    tokens = c["micro"] * local.seq * c["dtype_bytes"]
    kv_heads = np.lcm(np.maximum(local.kv // t.astype(int), 1), cp)
    return tokens * local.q_dim / t, tokens * kv_heads * local.hd


def ulysses_step_bytes(model: Any, c: dict[str, np.ndarray], cp: int) -> np.ndarray:
    """Bytes one rank sends through Ulysses' all-to-alls in one training step: per layer of its
    stage and micro-batch, Q, K, V and the output forward and their gradients backward (the
    forward again under full recomputation)."""
    q_bytes, kv_bytes = ulysses_message_bytes(local_model(model, cp), c, cp)
    per_layer = 2.0 * (q_bytes + kv_bytes) * (2 + (c["recompute"] == 2))
    micro_batches = c["global_batch"] // (c["dp"] * c["micro"])
    return model.layers / c["pp"] * micro_batches * per_layer


def cp_comm_time(model: Any, local: Any, cl: ClusterSpec, gpus: int, c: dict[str, np.ndarray],
                 cp: int, frameworks: Any = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(exposed context-parallel communication, {fwd, bwd} compute it hides under) per
    micro-batch on one stage, seconds; the hidden part is no window for other traffic.

    The cp group's ranks are tp apart (tp innermost, then cp, as Megatron-LM), on the
    intra-node link while tp x cp ranks fit in a node. Ulysses: 4 all-to-alls forward (Q, K, V
    and the output: keys and values at the grouped-query width) and 4 backward (2 more with full
    recomputation), not overlapped. Ring: per step a send/recv of the K and V blocks (backward:
    K, V, dK, dV, at the grouped-query width) hidden under that step's block of attention.
    """
    if cp == 1:
        zero = np.zeros(np.shape(c["tp"]))
        return zero, {"fwd": zero, "bwd": zero}
    t = c["tp"]
    tokens = c["micro"] * local.seq * c["dtype_bytes"] / t  # b (s/cp) x dtype / t, per unit of width
    q_bytes, kv_bytes = ulysses_message_bytes(local, c, cp)
    a2a = 2.0 * all_to_all_time(cl, gpus, q_bytes, cp, t) + 2.0 * all_to_all_time(cl, gpus, kv_bytes, cp, t)
    ulysses = a2a * (2 + (c["recompute"] == 2))
    inside = t * cp <= cl.gpus_per_node
    inter_bw, inter_lat = cl.inter_link(gpus)
    bw, lat = cl.measured_link("p2p", (np.where(inside, cl.intra_bw_gb_s, inter_bw),
                                       np.where(inside, cl.intra_latency_s, inter_lat)))
    # each step's attention, hiding its sends
    block, bwd_block = per_unique(c, lambda sub: _ring_block(model, local, cl, sub, frameworks))
    kv = tokens * local.kv_dim
    send_fwd, send_bwd = lat + 2.0 * kv / (bw * GB), lat + 4.0 * kv / (bw * GB)
    fwd, bwd = (cp - 1) * np.maximum(send_fwd - block, 0.0), (cp - 1) * np.maximum(send_bwd - bwd_block, 0.0)
    replay = 1 + (c["recompute"] == 2)
    layers, ring = local.layers / c["pp"], _ring(c)
    hidden = {"fwd": np.where(ring, layers * (cp - 1) * np.minimum(send_fwd, block), 0.0),
              "bwd": np.where(ring, layers * (cp - 1) * (np.minimum(send_bwd, bwd_block)
                                                          + (replay - 1) * np.minimum(send_fwd, block)), 0.0)}
    return layers * np.where(ring, fwd * replay + bwd, ulysses), hidden


def by_degree(evaluate: Callable[..., dict[str, np.ndarray]], model: Any, cluster: ClusterSpec, gpus: int,
              c: dict[str, np.ndarray], **kwargs: Any) -> dict[str, np.ndarray]:
    """`evaluate` once per distinct cp (the local sequence is a scalar of the model), merged
    back into the rows' order (slices, no gathers, when each degree's rows are contiguous, as
    `tuning.search` orders them)."""
    cp = np.asarray(c["cp"])
    n = cp.size
    starts = np.concatenate(([0], np.flatnonzero(cp[1:] != cp[:-1]) + 1))
    runs = [slice(a, b) for a, b in zip(starts, [*starts[1:], n])]
    if len(set(cp[starts].tolist())) != len(runs):  # interleaved degrees: gather each degree's rows
        runs = [np.flatnonzero(cp == value) for value in np.unique(cp)]
    parts = []
    for rows in runs:
        sub = take_rows(c, rows, n)
        sub["cp"] = np.asarray(int(cp[rows].flat[0]))
        parts.append((rows, evaluate(model, cluster, gpus, sub, **kwargs)))
    return _merge(parts, n)


def _merge(parts: list[tuple[Any, dict[str, np.ndarray]]], n: int) -> dict[str, np.ndarray]:
    """The parts' results as full-length columns: one block per dtype, filled in place (a search's
    columns are 100k rows each: one allocation, not one per column, is half the copying time)."""
    keys = list(parts[0][1])
    dtypes = {key: np.result_type(*[res[key] for _, res in parts]) for key in keys}
    out: dict[str, np.ndarray] = {}
    for dtype in dict.fromkeys(dtypes.values()):
        names = [key for key in keys if dtypes[key] == dtype]
        block = np.empty((len(names), n), dtype=dtype)
        for rows, res in parts:
            for i, key in enumerate(names):
                block[i, rows] = res[key]
        out.update(zip(names, block))
    return {key: out[key] for key in keys}


def validate(model: Any, par: Any) -> list[str]:
    """Every reason the context-parallel fields of `par` cannot run `model` (empty when valid)."""
    if par.cp < 1:
        return [f"parallel.cp={par.cp} must be >= 1"]
    reasons = []
    if par.cp_impl not in CP_IMPLS:
        reasons.append(f"parallel.cp_impl={par.cp_impl!r} must be one of {CP_IMPLS}")
    if model.seq % par.cp:
        reasons.append(f"parallel.cp={par.cp} must divide model.seq_len={model.seq}")
    if par.cp > 1 and par.cp_impl == "ulysses" and model.heads % (par.tp * par.cp):
        reasons.append(f"parallel.cp_impl='ulysses' needs parallel.tp * parallel.cp = {par.tp} * {par.cp} "
                       f"to divide model.heads={model.heads} (heads are sharded over both)")
    if not 0 < par.attn_density <= 1:
        reasons.append(f"attn_density={par.attn_density} must be in (0, 1]")
    return reasons


# ---------------------------------------------------------------- long-tail batches

def long_tail_batch(lengths: Sequence[int] | np.ndarray, seq: int) -> dict[str, float]:
    """Attention cost of packing sequences of `lengths` into rows of `seq` tokens.

    A packed row holds about seq / E[s] sequences, each attending only to itself (block-diagonal
    mask), so its attention costs seq E[s^2] / E[s] of the seq^2 a single sequence would:
    attn_density = E[s^2] / (seq E[s]). A sequence longer than a row is cut into rows of seq
    tokens and a remainder (the moments are over these pieces). GEMMs cost every token either
    way. Also returns E[s], E[s^2] and the share of real tokens when each piece is padded to seq
    instead (E[s] / seq).
    """
    s = np.asarray(lengths, dtype=float)
    if s.size == 0 or s.min() < 1:
        raise ValueError("lengths must be >= 1 token and not empty")
    full, rest = np.floor_divide(s, seq), np.mod(s, seq)
    pieces = full.sum() + np.count_nonzero(rest)
    mean, mean_sq = float(s.sum() / pieces), float((full * seq * seq + rest * rest).sum() / pieces)
    return {"mean": mean, "mean_sq": mean_sq, "attn_density": min(1.0, mean_sq / (seq * mean)),
            "padded_real_share": mean / seq}


def sample_lengths(kind: str, seq: int, *, mean: float = 0.25, sigma: float = 1.0, longest: int = 0,
                   n: int = 20_000, seed: int = 0) -> np.ndarray:
    """Lengths as the engine's `data.lengths` draws them (fixed seed): lognormal with median
    mean x seq and shape sigma, or Pareto with minimum mean x seq and shape alpha = sigma; cut
    at `longest` (0 = seq). `kind` may also be a file of whitespace-separated lengths."""
    cap = longest or seq
    rng = np.random.default_rng(seed)
    if kind == "lognormal":
        s = np.exp(np.log(mean * seq) + sigma * rng.standard_normal(n))
    elif kind == "pareto":
        s = mean * seq * (1.0 + rng.pareto(sigma, n))
    elif Path(kind).is_file():
        s = np.asarray(Path(kind).read_text().split(), dtype=float)
    else:
        raise ValueError(f"data.lengths={kind!r} must be fixed, lognormal, pareto or a file of lengths")
    return np.clip(np.rint(s), 1, cap)


def density_from_config(data: dict[str, Any], seq: int) -> float:
    """attn_density of the run config's `data.lengths` (1.0 for fixed-length samples)."""
    kind = str(data.get("lengths", "fixed"))
    if kind == "fixed":
        return 1.0
    lengths = sample_lengths(kind, seq, mean=float(data.get("length_mean", 0.25)),
                             sigma=float(data.get("length_sigma", 1.0)), longest=int(data.get("length_max", 0)))
    return long_tail_batch(lengths, seq)["attn_density"]


def flops_delta(model: Any, c: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(executed, model) FLOPs per iteration that long-tail attention removes: (density - 1) x the
    4 s^2 h per layer and sample of the attention core (context parallelism changes no FLOPs)."""
    attn = (np.asarray(c.get("attn_density", 1.0)) - 1.0) * c["global_batch"] * model.layers * 4.0 \
        * model.seq * model.seq * model.q_dim
    return attn * (3.0 + (c["recompute"] >= 1)), 3.0 * attn
