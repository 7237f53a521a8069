"""Context parallelism: each sequence is cut into cp contiguous chunks, one per rank of the cp group.

Everything outside attention is per-token, so it runs on the local chunk as is; attention needs
the other chunks' keys and values. Two implementations (`impl`):

- "ulysses" (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all turns the sequence-sharded
  q/k/v (b, H, t/cp, d) into head-sharded full sequences (b, H/cp, t, d), attention runs locally
  (causal, or per packed document), and a second all-to-all turns the output back. Needs
  heads % (tp*cp) == 0. Works on every backend; `torch.distributed.nn.functional.all_to_all_single`
  carries the gradients back.
- "ring" (Ring Attention, Liu et al. 2023): K/V blocks travel around the cp ring while each rank
  merges the partial softmaxes of its queries (online softmax, causal across blocks). On CUDA this
  is torch's own context parallel (DTensor ring flash attention); on CPU see `_ring_attention`.

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

from engine.model import GPT, causal_attention
from engine.validate import CP_IMPLS


def shard_sequence(t: torch.Tensor, *, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's contiguous chunk of `t` along `dim` (the sequence)."""
    return t.chunk(cp, dim=dim)[cp_rank].contiguous() if cp > 1 else t


def chunk_positions(seq_len: int, *, cp: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Position ids of this cp rank's chunk of a seq_len sequence."""
    return shard_sequence(torch.arange(seq_len, device=device), cp=cp, cp_rank=cp_rank, dim=0)


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


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup,
                      dropout_p: float = 0.0, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of sequence-sharded q/k/v through two all-to-alls; `doc_ids` covers the full row."""
    full = [seq_to_heads(x, group) for x in (q, k, v)]
    return heads_to_seq(causal_attention(*full, dropout_p=dropout_p, doc_ids=doc_ids), group)


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
    """One block's attention output and the log-sum-exp of its scores (b, H, tq, 1)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.softmax(scores, dim=-1) @ v, lse


def ring_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup,
                       dropout_p: float = 0.0, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal ring attention over contiguous chunks: the block from rank j < me is seen whole,
    j == me causally, j > me not at all; partial results merge by log-sum-exp (online softmax).

    torch's context_parallel has no CPU sharding strategy for SDPA (platform.md), hence this one.
    """
    if doc_ids is not None or dropout_p:
        raise ValueError("ring attention here supports neither packed documents nor attention dropout; "
                         "use parallel.cp_impl=ulysses")
    n, me = dist.get_world_size(group), dist.get_rank(group)
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
                          dropout_p: float = 0.0, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """torch's ring attention (CUDA): SDPA on DTensors sharded along the sequence dispatches to
    the ring flash-attention kernels. Contiguous chunks, as the rest of this file (no load balancing)."""
    from torch.distributed.tensor import DTensor, Shard

    if doc_ids is not None:
        raise ValueError("torch's ring attention has no packed-document masks; use parallel.cp_impl=ulysses")
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
    for module in model.modules():
        if hasattr(module, "core") and hasattr(module, "head_dim"):
            module.core = core
    return model
