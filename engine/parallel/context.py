"""Context parallelism: each sequence is cut into cp contiguous chunks, one per rank of the cp group.

Everything outside attention is per-token, so it runs on the local chunk as is; attention needs
the other chunks' keys and values. Two implementations (`impl`):

- "ulysses" (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all turns the sequence-sharded
  q/k/v (b, H, t/cp, d) into head-sharded full sequences (b, H/cp, t, d), attention runs locally
  (causal, sliding-window, or per packed document), and a second all-to-all turns the output back.
  Needs heads % (tp*cp) == 0. Works on every backend; `torch.distributed.nn.functional.all_to_all_single`
  carries the gradients back.
- "ring" (Ring Attention, Liu et al. 2023): K/V blocks travel around the cp ring while each rank
  merges the partial softmaxes of its queries (online softmax, causal across blocks). On CUDA this
  is torch's own context parallel (DTensor ring flash attention); on CPU see `ring_attention_cpu`.
  Causal only: no sliding window, packed documents or attention dropout (validate() refuses them).

Grouped-query attention (k/v with KV < H heads, engine/model/hf.py): K/V travel with their own KV heads
and are repeated to the query heads after the exchange (`local_attention`), as Megatron-LM's
context parallelism; Ulysses replicates them only as far as cp must divide their heads
(`_kv_heads_for`: KV=2 at cp=4 sends 4 heads, not H). torch's ring kernels on CUDA take equal
heads: there K/V are repeated first.

Gradients: each rank's loss is its chunk's mean, so averaging gradients over dp x cp (the
"dp_cp" mesh axis) gives the gradient of the global mean loss for equal chunks.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.model.gpt import GPT, causal_attention
from engine.config.validate import CP_IMPLS


def shard_sequence(t: torch.Tensor, *, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's contiguous chunk of `t` along `dim` (the sequence)."""
    return t.chunk(cp, dim=dim)[cp_rank].contiguous() if cp > 1 else t


def chunk_positions(seq_len: int, *, cp: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Position ids of this cp rank's chunk of a seq_len sequence."""
    return shard_sequence(torch.arange(seq_len, device=device), cp=cp, cp_rank=cp_rank, dim=0)


# ---------------------------------------------------------------- local attention

def repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, KV, t, d) -> (b, heads, t, d), each kv head repeated for its heads/KV query heads in
    order (transformers' `repeat_kv`: query head h reads kv head h // (heads/KV))."""
    groups = heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def window_mask(t: int, window: int, doc_ids: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """(t, t) or (b, 1, t, t) keep-mask: causal, a key at most `window` - 1 positions back
    (transformers' sliding_window_overlay: kv > q - window), inside the query's packed document."""
    i = torch.arange(t, device=device)
    keep = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    if doc_ids is None:
        return keep
    same = doc_ids[:, None, :, None] == doc_ids[:, None, None, :]
    return keep & same


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0,
                    doc_ids: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Attention of full sequences on one rank: k/v heads repeated to q's (GQA), then causal
    (`engine.model.gpt.causal_attention`) or, with a `window` shorter than the sequence, the sliding
    window transformers masks (Mistral, Qwen2's sliding layers)."""
    k, v = repeat_heads(k, q.shape[1]), repeat_heads(v, q.shape[1])
    t = q.shape[-2]
    if window is None or window >= t:
        return causal_attention(q, k, v, dropout_p=dropout_p, doc_ids=doc_ids)
    mask = window_mask(t, window, doc_ids, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


# ---------------------------------------------------------------- Ulysses (all-to-all)

def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """all_to_all_single over dim 0 of a contiguous (cp, ...) tensor, differentiable."""
    from engine.torch_compat import all_to_all_single_autograd

    # the functional collective: differentiable and traceable (torch.distributed.nn's is deprecated)
    return all_to_all_single_autograd(x.contiguous(), None, None, group)


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(b, H, t/cp, d) sequence-sharded -> (b, H/cp, t, d) head-sharded, full sequence."""
    cp = dist.get_world_size(group)
    b, h, tc, d = x.shape
    parts = x.reshape(b, cp, h // cp, tc, d).permute(1, 0, 2, 3, 4)  # part j: head group j
    got = _all_to_all(parts, group)  # got[i]: rank i's sequence chunk of my head group
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * tc, d)


def heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(b, H/cp, t, d) head-sharded -> (b, H, t/cp, d) sequence-sharded (inverse of seq_to_heads)."""
    cp = dist.get_world_size(group)
    b, hc, t, d = y.shape
    parts = y.reshape(b, hc, cp, t // cp, d).permute(2, 0, 1, 3, 4)  # part j: sequence chunk j
    got = _all_to_all(parts, group)  # got[i]: head group i of my sequence chunk
    return got.permute(1, 0, 2, 3, 4).reshape(b, cp * hc, t // cp, d)


def _kv_heads_for(k: torch.Tensor, cp: int) -> torch.Tensor:
    """k (or v) with its KV heads repeated the least number of times r that makes cp divide KV*r
    (r = 1 when it already does): each rank's query heads then find their kv heads in its share."""
    r = cp // math.gcd(k.shape[1], cp)
    return k if r == 1 else k.repeat_interleave(r, dim=1)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup,
                      dropout_p: float = 0.0, doc_ids: torch.Tensor | None = None,
                      window: int | None = None) -> torch.Tensor:
    """Attention of sequence-sharded q/k/v through two all-to-alls; `doc_ids` covers the full row.
    k/v keep their own (GQA) heads through the exchange and are repeated after it."""
    cp = dist.get_world_size(group)
    k, v = _kv_heads_for(k, cp), _kv_heads_for(v, cp)
    full = [seq_to_heads(x, group) for x in (q, k, v)]
    return heads_to_seq(local_attention(*full, dropout_p=dropout_p, doc_ids=doc_ids, window=window), group)


# ---------------------------------------------------------------- ring (CPU: explicit)

class _RingShift(torch.autograd.Function):
    """Send to the next rank of the ring, receive from the previous; backward goes the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _shift(x, group, +1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _shift(grad.contiguous(), ctx.group, -1), None


def _shift(x: torch.Tensor, group: dist.ProcessGroup, direction: int) -> torch.Tensor:
    n, me = dist.get_world_size(group), dist.get_rank(group)
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x.contiguous(), dist.get_global_rank(group, (me + direction) % n), group),
           dist.P2POp(dist.irecv, out, dist.get_global_rank(group, (me - direction) % n), group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output and the log-sum-exp of its scores (b, H, tq, 1); k/v heads
    repeated to q's here, after they travelled."""
    k, v = repeat_heads(k, q.shape[1]), repeat_heads(v, q.shape[1])
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.softmax(scores, dim=-1) @ v, lse


def _ring_refuses(q: torch.Tensor, n: int, dropout_p: float, doc_ids, window: int | None) -> None:
    if doc_ids is not None or dropout_p or (window is not None and window < n * q.shape[-2]):
        raise ValueError("ring attention here is causal only: no packed documents, attention dropout or "
                         "sliding window; use parallel.cp_impl=ulysses")


def ring_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup,
                       dropout_p: float = 0.0, doc_ids: torch.Tensor | None = None,
                       window: int | None = None) -> torch.Tensor:
    """Causal ring attention over contiguous chunks: the block from rank j < me is seen whole,
    j == me causally, j > me not at all; partial results merge by log-sum-exp (online softmax).
    K/V travel with their own (GQA) heads.

    torch's context_parallel has no CPU sharding strategy for SDPA (platform.md), hence this one.
    """
    n, me = dist.get_world_size(group), dist.get_rank(group)
    _ring_refuses(q, n, dropout_p, doc_ids, window)
    out, lse = _block(q, k, v, causal=True)
    # K and V travel as one tensor: one chain of shifts whose backward runs in the same order on
    # every rank (two chains could interleave differently and cross their gradients on the wire)
    kv = torch.stack([k, v])
    for step in range(1, n):
        kv = _RingShift.apply(kv, group)  # now rank (me - step)'s block
        if (me - step) % n < me:  # an earlier chunk: wholly visible
            o_b, lse_b = _block(q, kv[0], kv[1], causal=False)
            new = torch.logaddexp(lse, lse_b)
            out, lse = out * torch.exp(lse - new) + o_b * torch.exp(lse_b - new), new
    # every shift on the graph: each rank must run each shift's backward (its peers wait for it)
    return out + 0.0 * kv.sum()


def _torch_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mesh,
                          dropout_p: float = 0.0, doc_ids: torch.Tensor | None = None,
                          window: int | None = None) -> torch.Tensor:
    """torch's ring attention (CUDA): SDPA on DTensors sharded along the sequence dispatches to
    the ring flash-attention kernels. Contiguous chunks, as the rest of this file (no load balancing)."""
    from torch.distributed.tensor import DTensor, Shard

    if doc_ids is not None or (window is not None and window < mesh.size() * q.shape[-2]):
        raise ValueError("torch's ring attention has no packed-document or sliding-window masks; "
                         "use parallel.cp_impl=ulysses")
    # its kernels take as many k/v heads as query heads: repeated before they travel here
    k, v = repeat_heads(k, q.shape[1]), repeat_heads(v, q.shape[1])
    dq, dk, dv = (DTensor.from_local(x, mesh, [Shard(2)], run_check=False) for x in (q, k, v))
    out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True, dropout_p=dropout_p)
    return out.to_local()


# ---------------------------------------------------------------- entry

def attention_core(cp_mesh, *, impl: str, device_type: str):
    """The attention function context parallelism puts in every block (plain keywords in, q/k/v out)."""
    if impl not in CP_IMPLS:
        raise ValueError(f"parallel.cp_impl={impl!r} must be one of {', '.join(CP_IMPLS)}")
    group = cp_mesh.get_group() if hasattr(cp_mesh, "get_group") else cp_mesh
    if impl == "ulysses":
        return functools.partial(ulysses_attention, group=group)
    if device_type == "cuda":
        from engine.torch_compat import enable_ring_attention_dispatch

        # SDPA on sequence-sharded DTensors becomes ring attention, forward and backward, from here
        # on (torch's context_parallel does the same inside its context); contiguous chunks here
        enable_ring_attention_dispatch(load_balance=False)
        return functools.partial(_torch_ring_attention, mesh=cp_mesh)
    return functools.partial(ring_attention_cpu, group=group)


def apply_context_parallel(model: nn.Module, cp_mesh, *, impl: str = "ulysses", device_type: str = "cpu") -> nn.Module:
    """Make every attention block of `model` context-parallel over `cp_mesh` (a 1-D DeviceMesh or a
    process group) in place and return it.

    The model then takes this rank's sequence chunk (`shard_sequence`) with its `positions`
    (`chunk_positions`); under tensor parallelism each tp rank's local heads are split again over cp.
    """
    cp = cp_mesh.size() if hasattr(cp_mesh, "size") else dist.get_world_size(cp_mesh)
    if isinstance(model, GPT):
        tp_heads = model.cfg.heads
        if impl == "ulysses" and tp_heads % cp:
            raise ValueError(f"ulysses needs cp={cp} to divide the heads per rank ({tp_heads})")
    core = attention_core(cp_mesh, impl=impl, device_type=device_type)
    group = cp_mesh.get_group() if hasattr(cp_mesh, "get_group") else cp_mesh
    for module in model.modules():
        if hasattr(module, "core") and hasattr(module, "head_dim"):
            module.core = core
        if hasattr(module, "router_count_group"):  # engine/model/hf.py: router counts of the whole sequence
            module.router_count_group = group
    return model
