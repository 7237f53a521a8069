"""Bidirectional gradient compression after MASHA1/MASHA2 (Beznosikov, Richtárik, Diskin,
Ryabinin, Gasnikov, NeurIPS 2022): both legs of the gradient mean are compressed, the
worker -> aggregator leg and the aggregator -> workers leg, as a DDP comm hook.

There is no parameter server in data parallelism, so every rank is the aggregator of one
shard: a bucket of N entries is cut into n equal shards of S = ceil(N / n) entries (zero
padded) and rank r aggregates shard r.

- reduce leg: each worker compresses each shard of its gradient and sends it to its owner
  (randk: a `reduce_scatter` of the kept values; topk: an `all_to_all` of values + indices);
- broadcast leg: each owner compresses the mean of its shard and all-gathers it.

Rand-k (MASHA1's unbiased compressor): k = ceil(density x S) entries per shard, scaled by S/k,
at indices drawn from a seed shared by every rank, so no index is sent and the workers' values
can be summed inside the reduce-scatter. Ours: because every worker keeps the same indices, the
owner's mean is already k-sparse and its Rand-k on the broadcast leg keeps those same k entries
(the paper draws the server's Q independently); the composite is one unbiased Rand-k of variance
S/k - 1 instead of (S/k)^2 - 1, and both legs still carry k values per shard.

Top-k (MASHA2's contractive compressor) with error feedback on both legs, as MASHA2: every
worker keeps a residual per bucket (what its Top-k left out), every owner keeps a residual per
bucket shard (what its Top-k of the mean left out); each is added back before the next
compression of the same bucket, so over calls the sent mass plus the residuals equals the true
mean. Values travel as fp32 with int32 indices bit-cast into the same message.

Only the communication primitive is MASHA's: the optimizer around it is whatever the run uses
(AdamW for the GPT; extragradient in examples/minmax.py). MASHA1's loopless variance reduction
(a reference point whose full operator value is sent uncompressed) is not implemented (ours).

Bytes: each leg's wire bytes are measured from the tensors handed to its collective (ring bus
factors, formulas.md: reduce_scatter / all_to_all send (n-1)/n of their input, all_gather (n-1)
x its input) against a dense fp32 reduce-scatter / all-gather of the same bucket; the
CollectiveProfiler records the two collectives themselves.
"""

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from engine.comm.compress import HookState, OnBytes, _mix_seed, k_for
from engine.config.validate import BIDIRECTIONAL_COMPRESSORS
from profilers.bandwidth import all_gather_flat, reduce_scatter_flat

LEGS = ("reduce", "broadcast")


# ---- pure math (unit-testable without a process group) ------------------------------------


def shard_size(numel: int, n: int) -> int:
    """Entries of each of the n equal shards of a bucket of `numel` entries (the last padded)."""
    return max(1, math.ceil(numel / n))


def shard_randk_indices(shard: int, k: int, seed: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(n, k) int64 on `device`: for each of n shards of `shard` entries, k distinct indices from a
    seed every rank shares (so equal on every rank, different per shard). Drawn on the device by
    a generator of that device: the k smallest of n x shard uniform keys per row, one kernel for
    every shard instead of n host permutations and a copy."""
    gen = torch.Generator(device=device).manual_seed(seed)
    keys = torch.rand(n, shard, generator=gen, device=device, dtype=torch.float64)  # 53 bits: no ties
    return torch.topk(keys, k, dim=1, largest=False, sorted=False).indices


def rowwise_error_feedback(acc: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k of each row of `acc` (rows x S): (values, int64 indices, residual). The residual
    is `acc` with the kept entries zeroed, so densified values + residual == acc."""
    _, indices = torch.topk(acc.abs(), k, dim=1, sorted=False)
    values = acc.gather(1, indices)
    return values, indices, acc.scatter(1, indices, 0.0)


def densify_rows(values: torch.Tensor, indices: torch.Tensor, shard: int) -> torch.Tensor:
    """(rows x shard) dense tensor with each row's values placed at its indices (summed on repeats)."""
    out = torch.zeros(values.shape[0], shard, dtype=values.dtype, device=values.device)
    return out.scatter_add_(1, indices.long(), values)


def leg_ratio(compressor: str, numel: int, n: int, density: float) -> float:
    """Wire bytes / dense fp32 bytes of each leg for a bucket of `numel` entries over n ranks:
    n k value(s) per shard against N floats; Top-k also sends an int32 index per value."""
    k = k_for(shard_size(numel, n), density)
    per_entry = 1 if compressor == "randk" else 2
    return n * k * per_entry / numel


# ---- state -----------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class BidirectionalState(HookState):
    """What the bidirectional hook keeps between calls (the DDP hook state). `density` is the
    fraction of each shard's entries sent on each leg; `on_bytes` gets both legs of a bucket."""

    legs: dict[str, list[int]] = field(default_factory=lambda: {leg: [0, 0] for leg in LEGS})
    """Per leg: [wire bytes, dense bytes] since the start (bus factors applied)."""
    worker_residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    server_residuals: dict[int, torch.Tensor] = field(default_factory=dict)

    def set_level(self, *, density: float | None = None, rank: int | None = None) -> None:
        """Change the density between steps (rank is PowerSGD's; ignored). Residuals are kept."""
        if density is not None:
            self.set_density(density)

    def record_leg(self, leg: str, wire: float, numel: int, n: int) -> int:
        """Account `wire` bytes sent on `leg` against a dense fp32 leg of `numel` entries."""
        dense = int(round((n - 1) / n * numel * 4))
        wire_int = int(round(wire))
        self.legs[leg][0] += wire_int
        self.legs[leg][1] += dense
        self.account(wire_int, dense)
        return wire_int

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The calls per bucket and both residual memories: this rank's, for engine/train/checkpoint.py."""
        out = HookState.state_dict(self)  # slots dataclasses: no zero-argument super()
        out.update({f"worker.{i}": t for i, t in self.worker_residuals.items()})
        out.update({f"server.{i}": t for i, t in self.server_residuals.items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what `state_dict` returned."""
        HookState.load_state_dict(self, state)
        self.worker_residuals = {int(k[7:]): v for k, v in state.items() if k.startswith("worker.")}
        self.server_residuals = {int(k[7:]): v for k, v in state.items() if k.startswith("server.")}

    def residual(self, store: dict[int, torch.Tensor], index: int, like: torch.Tensor) -> torch.Tensor:
        """The residual of bucket `index`, zeros when new or when DDP rebuilt its buckets."""
        res = store.get(index)
        if res is None or res.shape != like.shape:
            res = torch.zeros_like(like)
        return res


# ---- the two legs ------------------------------------------------------------------------------


def _sent_by_reduce_scatter(nbytes_in: int, n: int) -> float:
    return (n - 1) / n * nbytes_in  # also all_to_all: the n-1 rows for the other ranks


def _sent_by_all_gather(nbytes_in: int, n: int) -> float:
    return (n - 1) * nbytes_in


def bidirectional_mean(state: BidirectionalState, tensor: torch.Tensor, index: int = 0) -> torch.futures.Future:
    """Replace flat `tensor` by the bidirectionally compressed mean over the group, in place;
    the future completes with `tensor` once the broadcast leg has arrived. `index` names the
    bucket (its residuals and Rand-k call counter)."""
    n, numel = state.group_size(), tensor.numel()
    shard = shard_size(numel, n)
    k = k_for(shard, state.density)
    padded = torch.zeros(n * shard, dtype=torch.float32, device=tensor.device)
    padded[:numel] = tensor.reshape(-1)
    rows = padded.view(n, shard)
    if state.compressor == "randk":
        mine, fut = _randk_legs(state, rows, k, index, n)
    elif state.compressor == "topk":
        mine, fut = _topk_legs(state, rows, k, index, n)
    else:
        raise ValueError(f"comm.compressor={state.compressor!r} has no bidirectional form; "
                         f"use one of {', '.join(BIDIRECTIONAL_COMPRESSORS)}")
    state.last_cost[index] = (mine, 2)

    def unpack(f: torch.futures.Future) -> torch.Tensor:
        tensor.reshape(-1).copy_(f.value().reshape(-1)[:numel])
        return tensor

    return fut.then(unpack)


def _randk_reduce(state: BidirectionalState, rows: torch.Tensor, k: int, index: int, n: int
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Reduce leg of Rand-k: (the mean's k values of my shard, the (n, k) shared indices, wire bytes)."""
    shard = rows.shape[1]
    seed = _mix_seed(state.seed, index, state.next_call(index))
    indices = shard_randk_indices(shard, k, seed, n, rows.device)
    # unbiased: scaled by shard/k; pre-divided by n so the reduce-scatter's sum is the mean
    values = (rows.gather(1, indices) * (shard / k / n)).reshape(-1).contiguous()
    mean_values = torch.empty(k, dtype=torch.float32, device=rows.device)
    reduce_scatter_flat(mean_values, values, group=state.process_group)
    wire = state.record_leg("reduce", _sent_by_reduce_scatter(values.numel() * 4, n), rows.numel(), n)
    return mean_values, indices, wire


def _randk_legs(state: BidirectionalState, rows: torch.Tensor, k: int, index: int, n: int
                ) -> tuple[int, torch.futures.Future]:
    shard = rows.shape[1]
    mean_values, indices, wire = _randk_reduce(state, rows, k, index, n)
    # broadcast leg: the owner's mean is supported on the shared indices (see the module docstring)
    gathered = torch.empty(n * k, dtype=torch.float32, device=rows.device)
    work = all_gather_flat(gathered, mean_values, group=state.process_group, async_op=True)
    wire += state.record_leg("broadcast", _sent_by_all_gather(mean_values.numel() * 4, n), rows.numel(), n)

    def decompress(_f: torch.futures.Future) -> torch.Tensor:
        return densify_rows(gathered.view(n, k), indices, shard)

    return wire, work.get_future().then(decompress)


def _pack(values: torch.Tensor, indices: torch.Tensor, shard: int) -> torch.Tensor:
    """fp32 values then int32 indices (positions in a shard of `shard` entries) bit-cast to fp32,
    per row: one message instead of two."""
    # the bound is the shard's size, known on the host: no read of the indices from the device
    if shard > 2**31:
        raise ValueError(f"a shard of {shard} entries (more than 2**31) cannot use int32 indices; "
                         "lower bucket_cap_mb")
    return torch.cat([values.float(), indices.to(torch.int32).view(torch.float32)], dim=-1).contiguous()


def _unpack(message: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return message[..., :k], message[..., k:].contiguous().view(torch.int32).long()


def _topk_reduce(state: BidirectionalState, rows: torch.Tensor, k: int, index: int, n: int
                 ) -> tuple[torch.Tensor, int]:
    """Reduce leg of Top-k with worker error feedback: (the mean of my shard (1, S), wire bytes)."""
    shard = rows.shape[1]
    acc = rows + state.residual(state.worker_residuals, index, rows)
    values, indices, state.worker_residuals[index] = rowwise_error_feedback(acc, k)
    message = _pack(values, indices, shard)  # row r goes to the owner of shard r
    received = torch.empty_like(message)  # row j: worker j's message for my shard
    dist.all_to_all_single(received, message, group=state.process_group)
    wire = state.record_leg("reduce", _sent_by_reduce_scatter(message.numel() * 4, n), rows.numel(), n)
    worker_values, worker_indices = _unpack(received, k)
    return densify_rows(worker_values, worker_indices, shard).sum(dim=0, keepdim=True) / n, wire


def _topk_legs(state: BidirectionalState, rows: torch.Tensor, k: int, index: int, n: int
               ) -> tuple[int, torch.futures.Future]:
    shard, group = rows.shape[1], state.process_group
    mean, wire = _topk_reduce(state, rows, k, index, n)
    server_acc = mean + state.residual(state.server_residuals, index, mean)
    v, i, state.server_residuals[index] = rowwise_error_feedback(server_acc, k)
    mine = _pack(v, i, shard).reshape(-1)
    gathered = torch.empty(n * 2 * k, dtype=torch.float32, device=rows.device)
    work = all_gather_flat(gathered, mine, group=group, async_op=True)
    wire += state.record_leg("broadcast", _sent_by_all_gather(mine.numel() * 4, n), rows.numel(), n)

    def decompress(_f: torch.futures.Future) -> torch.Tensor:
        owner_values, owner_indices = _unpack(gathered.view(n, 2 * k), k)
        return densify_rows(owner_values, owner_indices, shard)

    return wire, work.get_future().then(decompress)


def compressed_reduce_scatter(state: BidirectionalState, flat: torch.Tensor, index: int = 0) -> torch.Tensor:
    """The reduce leg alone: the mean over the group of shard `rank` of `flat` (n equal shards),
    compressed on the way (randk or topk with worker error feedback); dense, shard-sized.
    FSDP2's custom reduce-scatter (engine/comm/fsdp_compress.py) uses it."""
    n = state.group_size()
    rows = flat.reshape(n, -1)
    k = k_for(rows.shape[1], state.density)
    if state.compressor == "randk":
        values, indices, wire = _randk_reduce(state, rows, k, index, n)
        mine = dist.get_rank(state.process_group)
        mean = torch.zeros(rows.shape[1], dtype=torch.float32, device=rows.device)
        mean[indices[mine]] = values
    else:
        mean, wire = _topk_reduce(state, rows, k, index, n)
    state.last_cost[index] = (wire, 1)
    return mean.reshape(-1)


# ---- DDP --------------------------------------------------------------------------------------


def bidirectional_hook(state: BidirectionalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's gradient mean with both legs compressed (module docstring).

    The reduce leg is waited for inside the hook and only the broadcast leg runs asynchronously:
    gloo pairs collectives by call order, so a leg launched from a future callback could
    interleave with the next bucket's differently on two ranks and hang.
    """
    return bidirectional_mean(state, bucket.buffer(), bucket.index())


def make_bidirectional_hook(compressor: str, *, process_group: dist.ProcessGroup | None = None,
                            density: float = 0.01, seed: int = 0, on_bytes: OnBytes | None = None
                            ) -> tuple[BidirectionalState, Callable]:
    """The (state, hook) pair for `ddp_model.register_comm_hook`."""
    if compressor not in BIDIRECTIONAL_COMPRESSORS:
        raise ValueError(f"comm.bidirectional needs comm.compressor in {', '.join(BIDIRECTIONAL_COMPRESSORS)}, "
                         f"got {compressor!r}")
    state = BidirectionalState(compressor=compressor, process_group=process_group, seed=seed, on_bytes=on_bytes)
    state.set_level(density=density)
    return state, bidirectional_hook
