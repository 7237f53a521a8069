"""Expert parallelism (GShard, Lepikhin et al. 2020): the experts of each MoE layer sharded over
`ep` ranks carved out of the data-parallel ranks; tokens travel to their expert's rank and back
with `all_to_all_single` of variable splits.

Layout: the dp ranks of one (pp, tp) coordinate (the mesh's dp group, in mesh order, so a
placement reorders them too) are cut into dp/ep consecutive ep groups; ep rank j holds experts
[j*E/ep, (j+1)*E/ep), under their global ids. Experts are replicated over tp (every tp rank sees the same
tokens and computes the same expert outputs; the TP plan leaves MoE blocks alone), so
all_to_all never crosses tp. Gradients: dense parameters are averaged over dp by the dp wrapper
(DDP / FSDP2 replicate), which ignores the experts; an expert's gradient is summed over its
replicas (the dp ranks with the same ep rank: dp/ep of them) and divided by dp, since every
replica already summed the contributions of its ep group's tokens in backward.

Per MoE layer and forward: one all_to_all of the per-expert token counts (so each rank knows its
receive splits), one of the tokens (dispatch) and one of the outputs (combine); backward runs
the two token all_to_alls in reverse. With `hierarchical`, each token exchange is two steps,
inside the node then across nodes with the same local index (SE-MoE, DeepSpeed-MoE's
hierarchical all-to-all); nodes are the `link.groups` entries when set (heterogeneous links),
else `ranks_per_node` consecutive ranks, the groups the link emulator treats as one machine. An
emulated link (engine/comm/link.py) delays the bytes a rank sends off its node: latency per
off-node message plus bytes / bandwidth.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from engine.model.moe import MoE, moe_layers
from profilers.collectives import recorded


# ---------------------------------------------------------------- pure layout logic

def expert_group_ranks(dp_groups: Sequence[Sequence[int]], ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(ep groups, expert-replica groups) as global rank lists, cut out of the mesh's dp groups
    (`engine.mesh.mesh_axis_groups(mesh, "dp")`, placement included): dp index d = block*ep + j
    is ep rank j of ep group `block`; the replicas of ep rank j are its dp/ep blocks."""
    dp = len(dp_groups[0]) if dp_groups else 0
    if ep < 1 or not dp or dp % ep:
        raise ValueError(f"parallel.ep={ep} must divide parallel.dp={dp}")
    ep_groups = [list(g[b * ep:(b + 1) * ep]) for g in dp_groups for b in range(dp // ep)]
    replicas = [list(g[j::ep]) for g in dp_groups for j in range(ep)]
    return ep_groups, replicas


def rank_nodes(*, ranks_per_node: int = 1, groups: Sequence[Sequence[int]] | None = None) -> Callable[[int], int]:
    """Where each global rank sits: the index of its `link.groups` entry when groups are set (the
    heterogeneous links' islands), else rank // ranks_per_node (uniform emulated nodes)."""
    if groups:
        node = {r: i for i, ranks in enumerate(groups) for r in ranks}
        return node.__getitem__
    return lambda r: r // ranks_per_node


def node_split(ranks: list[int], node_of: Callable[[int], int] | int) -> list[list[int]]:
    """The members of one ep group (indices into `ranks`) split by node (`node_of(rank)`, or
    rank // node_of for a number of ranks per node); every node must hold the same number of
    consecutive members for the hierarchical exchange."""
    where = (lambda r: r // node_of) if isinstance(node_of, int) else node_of
    nodes: dict[int, list[int]] = {}
    for i, r in enumerate(ranks):
        nodes.setdefault(where(r), []).append(i)
    split = list(nodes.values())
    if len({len(n) for n in split}) != 1 or [i for n in split for i in n] != list(range(len(ranks))):
        raise ValueError(f"ep group {ranks} does not split into equal, consecutive nodes "
                         f"(nodes: {[where(r) for r in ranks]})")
    return split


def transpose_chunks(sizes: list[list[int]]) -> torch.Tensor:
    """Row indices that reorder chunks laid out (a, b)-major with `sizes[a][b]` rows to (b, a)-major."""
    a_n = len(sizes)
    b_n = len(sizes[0]) if sizes else 0
    offsets, off = [[0] * b_n for _ in range(a_n)], 0
    for a in range(a_n):
        for b in range(b_n):
            offsets[a][b], off = off, off + sizes[a][b]
    parts = [torch.arange(offsets[a][b], offsets[a][b] + sizes[a][b]) for b in range(b_n) for a in range(a_n)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


# ---------------------------------------------------------------- exchange

@dataclass(slots=True)
class _Wire:
    """One rank's emulated link: seconds = latency x off-node messages + off-node bytes / bandwidth."""

    link: object | None  # engine.comm.link.LinkEmulator
    sent: list[float] = field(default_factory=lambda: [0.0, 0.0])  # (bytes put on the wire, all bytes)

    def wait(self, started: float, offnode_bytes: float, messages: int) -> None:
        if self.link is None or (offnode_bytes <= 0 and messages <= 0):
            return
        left = started + self.link.wire_delay(offnode_bytes, messages) - time.perf_counter()
        if left > 0:
            time.sleep(left)


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, *, axis: str,
              wire: _Wire, offnode: list[bool]) -> torch.Tensor:
    """all_to_all_single of `x` (rows split by `in_splits` per peer) recorded as one all_to_all,
    including the emulated link's wait for the rows this rank sends off its node."""
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    row = math.prod(x.shape[1:]) * x.element_size()  # bytes per row, also when this rank sends no rows
    nbytes = x.numel() * x.element_size()
    off_bytes = float(sum(s for s, o in zip(in_splits, offnode) if o) * row)
    with recorded("all_to_all", nbytes, group, axis=axis, tensor=x):
        start = time.perf_counter()
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        wire.wait(start, off_bytes, sum(offnode))
    return out


class _AllToAll(torch.autograd.Function):
    """Differentiable all_to_all_single: backward sends the gradients back along the same paths."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, axis, wire, offnode):  # noqa: D102
        ctx.args = (out_splits, in_splits, group, axis, wire, offnode)
        return _exchange(x, out_splits, in_splits, group, axis=axis, wire=wire, offnode=offnode)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        out_splits, in_splits, group, axis, wire, offnode = ctx.args
        return (_exchange(grad, in_splits, out_splits, group, axis=axis, wire=wire, offnode=offnode),
                None, None, None, None, None, None)


def all_to_all(x, out_splits, in_splits, group, *, axis="ep", wire=None, offnode=None) -> torch.Tensor:
    n = len(in_splits)
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group, axis, wire or _Wire(None),
                           list(offnode) if offnode is not None else [False] * n)


class ExpertExchange:
    """The `exchange(tokens, counts)` of one MoE layer under expert parallelism."""

    def __init__(self, layer: MoE, *, ep_group, ep_rank: int, ep: int, node_of: list[int],
                 nodes: list[list[int]] | None, intra_group=None, inter_group=None, wire: _Wire) -> None:
        self.layer, self.group, self.ep_rank, self.ep = layer, ep_group, ep_rank, ep
        self.nodes, self.intra, self.inter, self.wire = nodes, intra_group, inter_group, wire
        self.node_of = node_of  # node of each ep rank: traffic between nodes crosses the emulated link

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep = self.ep
        local = counts.numel() // ep
        # split sizes first: recv[s, e] = rows source s sends to my local expert e
        recv = torch.empty_like(counts)
        with recorded("all_to_all", counts.numel() * counts.element_size(), self.group, axis="ep", tensor=counts):
            dist.all_to_all_single(recv, counts.contiguous(), group=self.group)
        recv = recv.view(ep, local)
        sends = counts.view(ep, local).sum(1)
        parts = [sends, recv.sum(1), recv.sum(0)]
        if self.nodes is not None:
            parts.append(self._count_matrix(sends).reshape(-1))
        # the layer's one host read: all_to_all_single and the experts' split take Python ints
        host = torch.cat(parts).tolist()
        send_splits, recv_splits, per_expert = host[:ep], host[ep:2 * ep], host[2 * ep:2 * ep + local]
        if self.nodes is not None:
            flat = host[2 * ep + local:]
            matrix = [flat[i * ep:(i + 1) * ep] for i in range(ep)]
            arrived = self._hierarchical(tokens, matrix, forward=True)
        else:
            offnode = [self.node_of[p] != self.node_of[self.ep_rank] for p in range(ep)]
            arrived = all_to_all(tokens, recv_splits, send_splits, self.group, wire=self.wire, offnode=offnode)
        # rows arrive by source, then by local expert: group them by local expert for the experts
        # (output_size given: repeat_interleave would otherwise read the total from the device)
        expert_of_row = torch.repeat_interleave(torch.arange(local, device=tokens.device).repeat(ep), recv.reshape(-1),
                                                output_size=sum(recv_splits))
        order = torch.argsort(expert_of_row, stable=True)
        y = self.layer.run_experts(arrived[order], per_expert)
        y = y[torch.argsort(order)]
        if self.nodes is not None:
            return self._hierarchical(y, [list(col) for col in zip(*matrix)], forward=False)
        return all_to_all(y, send_splits, recv_splits, self.group, wire=self.wire, offnode=offnode)

    def _count_matrix(self, sends: torch.Tensor) -> torch.Tensor:
        """C[src, dst]: rows each ep rank sends each ep rank (all_gather of the send splits)."""
        out = torch.empty(self.ep * self.ep, dtype=sends.dtype, device=sends.device)
        with recorded("all_gather", out.numel() * out.element_size(), self.group, axis="ep", tensor=out):
            dist.all_gather_into_tensor(out, sends.contiguous(), group=self.group)
        return out.view(self.ep, self.ep)

    def _hierarchical(self, x: torch.Tensor, cm: list[list[int]], *, forward: bool) -> torch.Tensor:
        """Rows of `x` ordered by destination ep rank (C[src, dst] rows each) -> rows ordered by
        source ep rank, in two exchanges: to the local peer with the destination's local index,
        then across nodes. The combine direction passes C transposed (outputs go back)."""
        g_n, l_n = len(self.nodes), len(self.nodes[0])
        me = self.ep_rank
        g, l = divmod(me, l_n)
        rank = lambda gg, ll: gg * l_n + ll  # noqa: E731
        # step 1, inside the node: reorder my chunks from (g', l') to (l', g') and send l' its share
        # (the row orders are built on the host from known sizes; non_blocking: no stream sync)
        mine = [[cm[me][rank(gg, ll)] for ll in range(l_n)] for gg in range(g_n)]
        x = x.index_select(0, transpose_chunks(mine).to(x.device, non_blocking=True))
        in1 = [sum(cm[me][rank(gg, ll)] for gg in range(g_n)) for ll in range(l_n)]
        out1 = [sum(cm[rank(g, ls)][rank(gg, l)] for gg in range(g_n)) for ls in range(l_n)]
        x = all_to_all(x, out1, in1, self.intra, axis="ep_intra", wire=self.wire, offnode=[False] * l_n)
        # now ordered (local source ls, destination node g'): reorder to (g', ls) and cross nodes
        held = [[cm[rank(g, ls)][rank(gg, l)] for gg in range(g_n)] for ls in range(l_n)]
        x = x.index_select(0, transpose_chunks(held).to(x.device, non_blocking=True))
        in2 = [sum(cm[rank(g, ls)][rank(gg, l)] for ls in range(l_n)) for gg in range(g_n)]
        out2 = [sum(cm[rank(gs, ls)][me] for ls in range(l_n)) for gs in range(g_n)]
        offnode = [gg != g for gg in range(g_n)]
        return all_to_all(x, out2, in2, self.inter, axis="ep_inter", wire=self.wire, offnode=offnode)


# ---------------------------------------------------------------- entry

@dataclass(slots=True)
class ExpertParallel:
    """What the engine needs after sharding: the expert parameters (kept out of the dp wrapper and
    of the replicated gradient norm) and the expert-gradient reduction."""

    expert_params: list[nn.Parameter]
    replica_group: object | None
    dp: int
    ep_group: object | None = None

    def reduce_gradients(self) -> None:
        """Sum each expert gradient over its replicas, divide by dp (the global-batch mean)."""
        grads = [p.grad for p in self.expert_params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.replica_group is not None and dist.get_world_size(self.replica_group) > 1:
            dist.all_reduce(flat, group=self.replica_group)
        flat.div_(self.dp)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _new_groups(lists: list[list[int]], rank: int, timeout):
    """Every rank creates every group in the same order (torch.distributed.new_group's contract)."""
    mine = None
    for ranks in lists:
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine


def apply_expert_parallel(model: nn.Module, mesh, *, ep: int, hierarchical: bool = False,
                          ranks_per_node: int = 1, node_groups: Sequence[Sequence[int]] | None = None, link=None,
                          compression: str = "none", lsh_buckets: int = 16, lsh_hashes: int = 1, seed: int = 0,
                          timeout=None) -> ExpertParallel:
    """Keep this rank's experts of every MoE layer and route tokens to the others by all_to_all.

    The ep groups are cut out of the dp groups of `mesh` (a DeviceMesh with a "dp" axis): which
    rank sits where is the mesh's answer (placement included), never recomputed here.
    Nodes (hierarchical exchange, off-node traffic on the emulated link) are `node_groups` (the
    ranks of each `link.groups` entry) when given, else `ranks_per_node` consecutive ranks.

    Every rank must hold the full, identically initialised model (same seed); the experts this
    rank does not own are deleted. Call on every rank (it creates process groups).
    """
    from engine.mesh import mesh_axis_groups

    rank = dist.get_rank()
    dp = mesh["dp"].size()
    ep_lists, replica_lists = expert_group_ranks(mesh_axis_groups(mesh, "dp"), ep)
    ep_group = _new_groups(ep_lists, rank, timeout)
    replica_group = _new_groups(replica_lists, rank, timeout)
    my_ep = next(g for g in ep_lists if rank in g)
    ep_rank = my_ep.index(rank)
    nodes = intra = inter = None
    node_of = rank_nodes(ranks_per_node=ranks_per_node, groups=node_groups)
    if hierarchical:
        nodes = node_split(my_ep, node_of)
        intra_lists = [[g[i] for i in n] for g in ep_lists for n in node_split(g, node_of)]
        inter_lists = [[g[n[k]] for n in node_split(g, node_of)] for g in ep_lists for k in range(len(nodes[0]))]
        intra = _new_groups(intra_lists, rank, timeout)
        inter = _new_groups(inter_lists, rank, timeout)
    wire = _Wire(link)
    expert_params: list[nn.Parameter] = []
    for index, layer in enumerate(moe_layers(model)):
        per_rank = layer.num_experts // ep
        keep = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
        # kept under their global ids (engine/model/moe.py): checkpoints name expert e the same on every layout
        layer.experts = nn.ModuleDict({str(e): layer.experts[str(e)] for e in keep})
        expert_params += list(layer.experts.parameters())
        layer.exchange = ExpertExchange(layer, ep_group=ep_group, ep_rank=ep_rank, ep=ep, nodes=nodes,
                                        node_of=[node_of(r) for r in my_ep],
                                        intra_group=intra, inter_group=inter, wire=wire)
        if compression == "lsh":
            from engine.comm.lsh import LSHCompressor

            layer.compressor = LSHCompressor(layer.router.in_features, buckets=lsh_buckets, hashes=lsh_hashes,
                                             seed=seed * 1000 + index)
    return ExpertParallel(expert_params=expert_params, replica_group=replica_group, dp=dp, ep_group=ep_group)
