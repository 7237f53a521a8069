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

# Score elements (batch x heads x query rows x keys) one block's forward or backward holds at a time: its
# query rows go in chunks of at most this many scores (256 MiB in fp32), so a layer's transient
# scores stay a slice of the (s/cp)^2 block (Llama-3.1-8B at seq 8192, cp 2: 2 GiB a block)
SCORE_CHUNK = 2**26


def _shift(x: torch.Tensor, group: dist.ProcessGroup, direction: int) -> torch.Tensor:
    """Send `x` to the rank `direction` steps along the ring, receive the one from `direction` steps back."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x.contiguous(), dist.get_global_rank(group, (me + direction) % n), group),
           dist.P2POp(dist.irecv, out, dist.get_global_rank(group, (me - direction) % n), group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


def _row_chunks(q: torch.Tensor, keys: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of q's rows whose scores against `keys` keys fit SCORE_CHUNK."""
    rows = max(1, SCORE_CHUNK // max(1, q.shape[0] * q.shape[1] * keys))
    return [(r, min(r + rows, q.shape[-2])) for r in range(0, q.shape[-2], rows)]


def _scores(q: torch.Tensor, k: torch.Tensor, start: int, causal: bool) -> torch.Tensor:
    """Scaled fp32 scores of q's rows (from row `start` of the block) against k; with `causal`, the
    keys after each row's own position masked to -inf (the block on the diagonal)."""
    s = (q @ k.transpose(-2, -1)).mul_(1.0 / math.sqrt(q.shape[-1]))
    if causal:
        rows = torch.arange(start, start + q.shape[-2], device=q.device)[:, None]
        s.masked_fill_(torch.arange(k.shape[-2], device=q.device)[None, :] > rows, float("-inf"))
    return s


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output and the log-sum-exp of its scores (b, H, tq), fp32 q/k/v with
    k/v already repeated to q's heads."""
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1])
    for a, b in _row_chunks(q, k.shape[-2]):
        s = _scores(q[..., a:b, :], k, a, causal)
        lse[..., a:b] = torch.logsumexp(s, dim=-1)
        out[..., a:b, :] = s.sub_(lse[..., a:b, None]).exp_() @ v
    return out, lse


def _block_backward(q, k, v, d_out, lse, delta, causal: bool, dq: torch.Tensor):
    """FlashAttention-2's backward of one block (fp32, k/v repeated to q's heads): each row's
    probabilities P recomputed from q, k and its saved whole-row log-sum-exp, dS = P (dP - delta)
    with delta = rowsum(dO * O); dQ is added into `dq`, (dK, dV) of this block's keys returned."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for a, b in _row_chunks(q, k.shape[-2]):
        p = _scores(q[..., a:b, :], k, a, causal).sub_(lse[..., a:b, None]).exp_()
        dv += p.transpose(-2, -1) @ d_out[..., a:b, :]
        ds = (d_out[..., a:b, :] @ v.transpose(-2, -1)).sub_(delta[..., a:b, None]).mul_(p).mul_(scale)
        dq[..., a:b, :] += ds @ k
        dk += ds.transpose(-2, -1) @ q[..., a:b, :]
    return dk, dv


def _fold_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `repeat_heads`: (b, H, t, d) summed back to (b, kv_heads, t, d)."""
    b, h, t, d = grad.shape
    return grad if h == kv_heads else grad.reshape(b, kv_heads, h // kv_heads, t, d).sum(2)


class _RingAttention(torch.autograd.Function):
    """Causal ring attention over contiguous chunks, keeping for backward what flash attention keeps:
    the local q, k, v, the output and the log-sum-exp, never a block's scores.

    Forward: K/V (one stacked tensor, their own GQA heads) go around the ring; rank `me` sees the
    block from rank j < me whole, its own causally and later ones not at all, and merges the partial
    softmaxes by log-sum-exp. Backward: K/V go around again; each visible block's dK/dV travel with it
    and, after a last step, reach the block's owner. All in fp32, autocast off (as in the backward)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        n, me = dist.get_world_size(group), dist.get_rank(group)
        with torch.autocast(q.device.type, enabled=False):
            qf = q.float()
            out, lse = _block_forward(qf, *(repeat_heads(x.float(), q.shape[1]) for x in (k, v)), causal=True)
            kv = torch.stack([k, v])
            for step in range(1, n):
                kv = _shift(kv, group, +1)  # now rank (me - step)'s block
                if (me - step) % n < me:  # an earlier chunk: wholly visible
                    o_b, lse_b = _block_forward(qf, *(repeat_heads(x.float(), q.shape[1]) for x in kv), causal=False)
                    new = torch.logaddexp(lse, lse_b)
                    out = out * torch.exp(lse - new)[..., None] + o_b * torch.exp(lse_b - new)[..., None]
                    lse = new
        out = out.to(q.dtype)
        ctx.group = group
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group, heads, kv_heads = ctx.group, q.shape[1], k.shape[1]
        n, me = dist.get_world_size(group), dist.get_rank(group)
        with torch.autocast(q.device.type, enabled=False):
            qf, do = q.float(), d_out.float()
            delta = (do * out.float()).sum(-1)
            dq = torch.zeros_like(qf)
            grads = _block_backward(qf, *(repeat_heads(x.float(), heads) for x in (k, v)), do, lse, delta, True, dq)
            dkv_mine = torch.stack([_fold_heads(g, kv_heads) for g in grads])
            kv, dkv = torch.stack([k, v]), None  # dkv: the travelling block's dK/dV from the ranks it passed
            for step in range(1, n):
                kv = _shift(kv, group, +1)  # rank (me - step)'s block, as in forward
                dkv = torch.zeros_like(kv) if dkv is None else _shift(dkv, group, +1)
                if (me - step) % n < me:
                    grads = _block_backward(qf, *(repeat_heads(x.float(), heads) for x in kv), do, lse, delta,
                                            False, dq)
                    dkv = (dkv.float() + torch.stack([_fold_heads(g, kv_heads) for g in grads])).to(kv.dtype)
            if dkv is not None:  # at rank me - 1 after the last step: one more brings it home
                dkv_mine += _shift(dkv, group, +1).float()
        return dq.to(q.dtype), dkv_mine[0].to(k.dtype), dkv_mine[1].to(v.dtype), None


def _ring_refuses(q: torch.Tensor, n: int, dropout_p: float, doc_ids, window: int | None) -> None:
    if doc_ids is not None or dropout_p or (window is not None and window < n * q.shape[-2]):
        raise ValueError("ring attention here is causal only: no packed documents, attention dropout or "
                         "sliding window; use parallel.cp_impl=ulysses")


def ring_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup,
                       dropout_p: float = 0.0, doc_ids: torch.Tensor | None = None,
                       window: int | None = None) -> torch.Tensor:
    """Causal ring attention over contiguous chunks (`_RingAttention`): O(s/cp x d) kept per rank for
    backward, as torch's ring flash attention on CUDA. K/V travel with their own (GQA) heads.

    torch's context_parallel has no CPU sharding strategy for SDPA (platform.md), hence this one.
    """
    _ring_refuses(q, dist.get_world_size(group), dropout_p, doc_ids, window)
    return _RingAttention.apply(q, k, v, group)


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
