"""Gradient compression as DDP communication hooks: fp16, bf16, int8, topk, randk, powersgd.

Every hook reports, per bucket, the bytes this rank puts on the wire against the bytes a dense
fp32 all_reduce of the same bucket would put there. Both use the ring bus factors of
nccl-tests (formulas.md): an all_reduce of B bytes sends 2(n-1)/n x B per rank, an all_gather
of b bytes per rank sends (n-1) x b, so a compressor that needs an all_gather is charged for
its growth with the group size.
"""

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from engine.comm.link import LinkEmulator, bus_factor
from engine.config.validate import COMPRESSORS
from profilers.bandwidth import all_gather_flat
OnBytes = Callable[[int, int], None]
Hook = Callable[["CompressionState", dist.GradBucket], torch.futures.Future]

INT8_MAX = 127


# ---- pure math (unit-testable without a process group) ------------------------------------


def k_for(numel: int, density: float) -> int:
    """Entries kept at `density`: ceil(density x numel), at least 1 and at most numel."""
    return max(1, min(numel, math.ceil(density * numel)))


def topk_compress(tensor: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k entries of largest magnitude of a flat tensor: (values, int64 indices)."""
    flat = tensor.reshape(-1)
    _, indices = torch.topk(flat.abs(), k, sorted=False)
    return flat[indices], indices


def error_feedback(
    tensor: torch.Tensor, residual: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k of tensor + residual (error feedback, Stich et al. 2018): (values, indices, new residual).

    Conserves mass: densify(values, indices) + new_residual == tensor + residual.
    """
    acc = tensor.reshape(-1).clone() if residual is None else tensor.reshape(-1) + residual
    values, indices = topk_compress(acc, k)
    acc[indices] = 0.0
    return values, indices, acc


def densify(values: torch.Tensor, indices: torch.Tensor, numel: int) -> torch.Tensor:
    """A dense flat tensor with `values` summed at `indices` (repeated indices add up)."""
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    return out.index_add_(0, indices.reshape(-1).long(), values.reshape(-1))


def randk_indices(numel: int, k: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """k distinct indices drawn uniformly from range(numel) on `device`, by a generator of that
    device seeded with `seed`: equal on every rank for equal seeds (and device types), and no
    host draw or host-to-device copy on the step path."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randperm(numel, generator=gen, device=device)[:k]


def randk_compress(tensor: torch.Tensor, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unbiased Rand-k: k random entries scaled by numel/k, so E[densify(...)] == tensor."""
    flat = tensor.reshape(-1)
    indices = randk_indices(flat.numel(), k, seed, flat.device)
    return flat[indices] * (flat.numel() / k), indices


def int8_scale(absmax: float | torch.Tensor) -> float | torch.Tensor:
    """Symmetric int8 scale so that [-absmax, absmax] maps onto [-127, 127] (1 for absmax 0); a
    tensor absmax gives a tensor scale on its device, computed there without a host read."""
    if isinstance(absmax, torch.Tensor):
        return torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax))
    return absmax / INT8_MAX if absmax > 0 else 1.0


def quantize_int8(tensor: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """Round to nearest of tensor/scale, clamped to [-127, 127]; error <= scale/2 when |t| <= 127 scale."""
    return torch.clamp(torch.round(tensor / scale), -INT8_MAX, INT8_MAX).to(torch.int8)


def dequantize_int8(q: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """Back to float32 (accepts int8 or the wider int32 sum of several ranks' int8 values)."""
    return q.to(torch.float32) * scale


def int8_error_feedback(
    tensor: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 of tensor + residual with error feedback (Seide et al. 2014; Karimireddy et al. 2019):
    (int8 values, 0-d fp32 scale on the tensor's device, new residual). Round-to-nearest alone
    is biased (an entry below half a step is always sent as 0); carrying the rounding error into
    the next round sends every entry's sum up to one residual:
    dequantize(q, scale) + new_residual == tensor + residual."""
    acc = tensor.reshape(-1).clone() if residual is None else tensor.reshape(-1) + residual
    scale = int8_scale(acc.abs().max().float())  # stays on the device: no host read per bucket
    q = quantize_int8(acc, scale)
    return q, scale, acc.sub_(dequantize_int8(q, scale))


def _mix_seed(seed: int, bucket_index: int, call: int) -> int:
    # Same (seed, bucket, call) on every rank gives the same Rand-k indices without sending them.
    return (seed * 1_000_003 + bucket_index * 10_007 + call) % (2**63 - 1)


# ---- what each compressor sends (the hooks below and tuning/sim/simulator.py use these) -----------


@dataclass(frozen=True, slots=True)
class Wire:
    """What one bucket's compression puts in collectives: `op`, the bytes each rank hands it
    (an all_reduce's buffer, an all_gather's per-rank input) and how many collectives."""

    op: str
    nbytes: float
    num_ops: int = 1

    def on_wire(self, n: int) -> float:
        """Bytes this rank sends over a ring of `n` ranks (nccl-tests bus factors, formulas.md):
        all_gather forwards the n-1 other ranks' inputs, so it grows with the group."""
        if self.op == "all_gather":
            return (n - 1) * self.nbytes
        return self.nbytes * bus_factor(self.op, n)


def powersgd_numel(shapes: list[tuple[int, ...]], rank: int, min_compression_rate: float = 2.0) -> int:
    """Entries torch's `powerSGD_hook` all_reduces for gradients of `shapes`: each tensor viewed
    as (shape[0], rest) is sent as P (n r) and Q (m r) when (n + m) r x rate < n m, else dense
    (its `_should_compress`; 1-D tensors are never worth it)."""
    total = 0
    for shape in shapes:
        n = shape[0] if shape else 1
        m = math.prod(shape) // n if n else 0
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * min_compression_rate < n * m else n * m
    return total


def bucket_wire(compressor: str, numel: int, *, density: float = 0.01, rank: int = 4,
                shapes: list[tuple[int, ...]] | None = None) -> Wire:
    """What `compressor` sends for one fp32 gradient bucket of `numel` entries (`shapes`: its
    tensors, needed by powersgd). The hooks below send exactly this."""
    if compressor == "none":
        return Wire("all_reduce", numel * 4)
    if compressor in ("fp16", "bf16"):
        return Wire("all_reduce", numel * 2)
    if compressor == "int8":
        return Wire("all_gather", numel + 4)  # int8 values + this rank's fp32 scale
    if compressor == "topk":
        return Wire("all_gather", 2 * k_for(numel, density) * 4)  # fp32 values + int32 indices
    if compressor == "randk":
        return Wire("all_reduce", k_for(numel, density) * 4)  # indices from a shared seed
    if compressor == "powersgd":
        if shapes is None:
            raise ValueError("bucket_wire('powersgd') needs the bucket's tensor shapes")
        return Wire("all_reduce", powersgd_numel(shapes, rank) * 4, 3)  # dense 1-D + Ps + Qs
    raise ValueError(f"comm.compressor={compressor!r} is not one of {', '.join(COMPRESSORS)}")


def ddp_buckets(shapes: list[tuple[int, ...]], bucket_cap_mb: float = 25.0,
                first_bucket_mb: float = 1.0) -> list[list[tuple[int, ...]]]:
    """DDP's gradient buckets of fp32 parameters of `shapes` (model order), approximately: filled
    in reverse order (backward's), the first up to `first_bucket_mb` MiB, then `bucket_cap_mb`
    MiB each (DDP rebuilds buckets in the real gradient order after the first step)."""
    buckets: list[list[tuple[int, ...]]] = [[]]
    size, cap = 0, min(first_bucket_mb, bucket_cap_mb) * 2**20
    for shape in reversed(shapes):
        buckets[-1].append(shape)
        size += math.prod(shape) * 4
        if size >= cap:
            buckets.append([])
            size, cap = 0, bucket_cap_mb * 2**20
    return [b for b in buckets if b]


def step_wire_bytes(compressor: str, shapes: list[tuple[int, ...]], n: int, *, density: float = 0.01,
                    rank: int = 4, bucket_cap_mb: float = 25.0) -> tuple[float, float]:
    """(wire, dense) bytes one rank sends per step for fp32 gradients of `shapes` over `n` ranks:
    the compressed collectives against a dense fp32 all_reduce of the same buckets."""
    wire = dense = 0.0
    for bucket in ddp_buckets(shapes, bucket_cap_mb):
        numel = sum(math.prod(s) for s in bucket)
        wire += bucket_wire(compressor, numel, density=density, rank=rank, shapes=bucket).on_wire(n)
        dense += Wire("all_reduce", numel * 4).on_wire(n)
    return wire, dense


# ---- state -----------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class HookState:
    """What every gradient compression hook keeps between calls (the DDP hook state): the part
    `CompressionState` and the bidirectional hook's `BidirectionalState` share."""

    compressor: str
    """One of COMPRESSORS (`BidirectionalState`: of BIDIRECTIONAL_COMPRESSORS)."""
    process_group: dist.ProcessGroup | None = None
    """Group to reduce over; None is the default (world) group."""
    density: float = 0.01
    """Fraction of entries sent by topk and randk."""
    seed: int = 0
    """Shared seed of randk (and of PowerSGD's first random Q)."""
    on_bytes: OnBytes | None = None
    """Called per bucket with (wire_bytes, dense_bytes)."""
    wire_bytes: int = 0
    """Total bytes this rank put on the wire (bus factors applied)."""
    dense_bytes: int = 0
    """Total bytes the dense fp32 collectives of the same buckets would have put there."""
    calls: dict[int, int] = field(default_factory=dict)
    last_cost: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Per bucket index: (wire bytes, number of collectives) of its latest call (the link emulator reads it)."""

    def group_size(self) -> int:
        """Ranks in the process group."""
        return dist.get_world_size(self.process_group)

    def set_density(self, density: float) -> None:
        """Change the density; call between steps."""
        if not 0.0 < density <= 1.0:
            raise ValueError(f"comm.density={density} must be in (0, 1]; e.g. 0.01")
        self.density = density

    def account(self, wire: int, dense: int) -> None:
        """Add one bucket's (or leg's) wire and dense bytes to the totals and report them."""
        self.wire_bytes += wire
        self.dense_bytes += dense
        if self.on_bytes is not None:
            self.on_bytes(wire, dense)

    def next_call(self, bucket_index: int) -> int:
        """How many times this bucket was hooked before (identical on every rank)."""
        call = self.calls.get(bucket_index, 0)
        self.calls[bucket_index] = call + 1
        return call

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a resumed run needs back (engine/train/checkpoint.py): the calls per bucket (Rand-k's seeds)."""
        return {"calls": torch.tensor(sorted(self.calls.items()), dtype=torch.int64)} if self.calls else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what `state_dict` returned."""
        if "calls" in state:
            self.calls = {int(i): int(c) for i, c in state["calls"].tolist()}


@dataclass(kw_only=True, slots=True)
class CompressionState(HookState):
    """What a compression hook keeps between calls; passed to DDP as the hook state."""

    rank: int = 4
    """PowerSGD matrix approximation rank."""
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    powersgd: PowerSGDState | None = None
    pending: torch.futures.Future | None = None

    def set_level(self, *, density: float | None = None, rank: int | None = None) -> None:
        """Change density and/or rank; call between steps. Error-feedback memory is kept."""
        if density is not None:
            self.set_density(density)
        if rank is not None:
            if rank < 1:
                raise ValueError(f"comm.rank={rank} must be >= 1; e.g. 4")
            self.rank = rank
            if self.powersgd is not None and self.powersgd.matrix_approximation_rank != rank:
                self.powersgd.matrix_approximation_rank = rank
                # warm-start P/Q memories have the old rank's shape
                self.powersgd.p_memory_dict.clear()
                self.powersgd.q_memory_dict.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The calls per bucket, the error-feedback residuals and PowerSGD's state (its Q and error
        memories, step count and random stream): this rank's, for engine/train/checkpoint.py."""
        out = HookState.state_dict(self)  # slots dataclasses: no zero-argument super()
        out.update({f"residual.{i}": t for i, t in self.residuals.items()})
        if self.powersgd is not None:
            out.update(_powersgd_state(self.powersgd))
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what `state_dict` returned."""
        HookState.load_state_dict(self, state)
        self.residuals = {int(k.split(".")[1]): v for k, v in state.items() if k.startswith("residual.")}
        if self.powersgd is not None:
            _load_powersgd(self.powersgd, state)

    def record(self, bucket: dist.GradBucket, sent: Wire) -> None:
        """Account one bucket's wire bytes against its dense fp32 all_reduce cost."""
        n = self.group_size()
        dense = int(round(Wire("all_reduce", bucket.buffer().numel() * 4).on_wire(n)))
        wire_int, num_ops = int(round(sent.on_wire(n))), sent.num_ops
        self.last_cost[bucket.index()] = (wire_int, num_ops)
        self.account(wire_int, dense)


_PSGD_MEMORIES = ("error_dict", "p_memory_dict", "q_memory_dict")


def _powersgd_state(ps: PowerSGDState) -> dict[str, torch.Tensor]:
    """torch's PowerSGDState as tensors: its memories per bucket, counters and numpy random stream."""
    out = {f"powersgd.{name}.{i}": t for name in _PSGD_MEMORIES for i, t in getattr(ps, name).items()}
    out["powersgd.counters"] = torch.tensor(
        [ps.iter, ps.total_numel_before_compression, ps.total_numel_after_compression], dtype=torch.int64)
    _, keys, pos, has_gauss, cached = ps.rng.get_state()
    out["powersgd.rng_keys"] = torch.from_numpy(keys.astype("int64"))
    out["powersgd.rng_pos"] = torch.tensor([pos, has_gauss], dtype=torch.int64)
    out["powersgd.rng_gauss"] = torch.tensor([cached], dtype=torch.float64)
    return out


def _load_powersgd(ps: PowerSGDState, state: dict[str, torch.Tensor]) -> None:
    for name in _PSGD_MEMORIES:
        prefix = f"powersgd.{name}."
        setattr(ps, name, {int(k[len(prefix):]): v for k, v in state.items() if k.startswith(prefix)})
    if "powersgd.counters" in state:
        ps.iter, ps.total_numel_before_compression, ps.total_numel_after_compression = state["powersgd.counters"].tolist()
        pos, has_gauss = state["powersgd.rng_pos"].tolist()
        keys = state["powersgd.rng_keys"].cpu().numpy().astype("uint32")
        ps.rng.set_state(("MT19937", keys, pos, has_gauss, float(state["powersgd.rng_gauss"][0])))


# ---- hooks -----------------------------------------------------------------------------------


def none_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Dense fp32 all_reduce (what DDP does by default), with byte accounting."""
    buf = bucket.buffer()
    n = state.group_size()
    state.record(bucket, bucket_wire("none", buf.numel()))
    buf.div_(n)
    fut = dist.all_reduce(buf, group=state.process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _cast_hook(
    dtype: torch.dtype, state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    n = state.group_size()
    # pre-divide as torch's fp16_compress_hook does, so the 16-bit sum cannot overflow
    low = buf.div(n).to(dtype)
    state.record(bucket, bucket_wire(state.compressor, buf.numel()))
    fut = dist.all_reduce(low, group=state.process_group, async_op=True).get_future()

    def decompress(f: torch.futures.Future) -> torch.Tensor:
        buf.copy_(f.value()[0])
        return buf

    return fut.then(decompress)


def fp16_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Cast the bucket to fp16, all_reduce, cast back: half the bytes of fp32."""
    return _cast_hook(torch.float16, state, bucket)


def bf16_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """bf16 cast; torch's bf16_compress_hook needs NCCL (platform.md), hence this explicit one."""
    return _cast_hook(torch.bfloat16, state, bucket)


def int8_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """int8 with a per-bucket, per-rank scale and error feedback: all_gather of int8 values +
    the 4-byte scale.

    An int32 all_reduce of int8 values would put 4 bytes per entry on the wire, as many as
    fp32, so the int8 values travel by all_gather and are summed after dequantisation. Sending
    each rank's scale avoids a blocking MAX all_reduce before the data can leave. Each rank
    keeps its rounding error per bucket and adds it to the next step's gradient (unbiased over
    steps; `int8_error_feedback`).
    """
    buf = bucket.buffer()
    n, numel, index = state.group_size(), buf.numel(), bucket.index()
    residual = state.residuals.get(index)
    if residual is not None and residual.numel() != numel:
        residual = None  # DDP rebuilt its buckets after the first step
    q, scale, state.residuals[index] = int8_error_feedback(buf, residual)
    payload = torch.cat([q, scale.reshape(1).view(torch.int8)])  # the fp32 scale's 4 bytes
    gathered = torch.empty(n * (numel + 4), dtype=torch.int8, device=buf.device)
    state.record(bucket, bucket_wire("int8", numel))
    work = all_gather_flat(gathered, payload, group=state.process_group, async_op=True)

    def decompress(_f: torch.futures.Future) -> torch.Tensor:
        rows = gathered.view(n, numel + 4)
        scales = rows[:, numel:].contiguous().view(torch.float32)  # (n, 1)
        total = (rows[:, :numel].to(torch.float32) * scales).sum(dim=0)
        buf.copy_(total.div_(n))
        return buf

    return work.get_future().then(decompress)


def topk_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Top-k with error feedback per bucket; all_gather of values + int32 indices, mean."""
    buf = bucket.buffer()
    n, numel, index = state.group_size(), buf.numel(), bucket.index()
    residual = state.residuals.get(index)
    if residual is not None and residual.numel() != numel:
        residual = None  # DDP rebuilt its buckets after the first step
    k = k_for(numel, state.density)
    values, indices, state.residuals[index] = error_feedback(buf, residual, k)
    fut = gather_sparse(values, indices, state.process_group, n, numel=numel)
    state.record(bucket, bucket_wire("topk", numel, density=state.density))

    def decompress(f: torch.futures.Future) -> torch.Tensor:
        all_values, all_indices = f.value()
        buf.copy_(densify(all_values, all_indices, numel).div_(n))
        return buf

    return fut.then(decompress)


def gather_sparse(
    values: torch.Tensor, indices: torch.Tensor, group: dist.ProcessGroup | None, n: int, *, numel: int
) -> torch.futures.Future:
    """all_gather (values, indices) of equal length on every rank in one message; `indices` are
    positions in a flat tensor of `numel` entries."""
    # the bound is the tensor's size, known on the host: no read of the indices from the device
    if numel > 2**31:
        raise ValueError(f"a bucket of {numel} entries (more than 2**31) cannot use int32 indices; "
                         "lower bucket_cap_mb")
    k = values.numel()
    # int32 indices travel bit-cast inside the float32 message: one collective instead of two
    payload = torch.cat([values.to(torch.float32), indices.to(torch.int32).view(torch.float32)])
    gathered = torch.empty(n * 2 * k, dtype=torch.float32, device=values.device)
    fut = all_gather_flat(gathered, payload, group=group, async_op=True).get_future()

    def unpack(_f: torch.futures.Future) -> tuple[torch.Tensor, torch.Tensor]:
        rows = gathered.view(n, 2 * k)
        return rows[:, :k].reshape(-1), rows[:, k:].contiguous().view(torch.int32).reshape(-1)

    return fut.then(unpack)


def randk_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Unbiased Rand-k with indices from a shared seed: an all_reduce of k scaled values."""
    buf = bucket.buffer()
    n, numel, index = state.group_size(), buf.numel(), bucket.index()
    k = k_for(numel, state.density)
    values, indices = randk_compress(buf, k, _mix_seed(state.seed, index, state.next_call(index)))
    values.div_(n)
    state.record(bucket, bucket_wire("randk", numel, density=state.density))
    fut = dist.all_reduce(values, group=state.process_group, async_op=True).get_future()

    def decompress(f: torch.futures.Future) -> torch.Tensor:
        buf.zero_()
        buf[indices] = f.value()[0]
        return buf

    return fut.then(decompress)


def powersgd_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's PowerSGD (rank r, warm start, error feedback), with its wire bytes counted.

    torch counts the elements it all_reduces (uncompressed 1-D tensors + Ps + Qs) in
    `total_numel_after_compression` before it launches them; the first `start_powerSGD_iter`
    steps are a plain all_reduce.
    """
    ps = state.powersgd
    if ps is None:
        raise ValueError("powersgd_hook needs CompressionState.powersgd; build it with make_comm_hook")
    buf = bucket.buffer()
    n = state.group_size()
    if state.pending is not None:
        # torch's hook launches its P and Q all_reduces from future callbacks; gloo pairs
        # collectives by call order, so the previous bucket must finish before this one starts
        # or two ranks can interleave them differently and hang.
        state.pending.wait()
    before = ps.total_numel_after_compression
    compressing = ps.iter >= ps.start_powerSGD_iter
    fut = powerSGD_hook(ps, bucket)
    state.pending = None if bucket.is_last() else fut
    # measured from torch's own count (bucket_wire('powersgd') predicts it from the shapes)
    if compressing:
        sent = (ps.total_numel_after_compression - before) * buf.element_size()
        state.record(bucket, Wire("all_reduce", sent, 3))
    else:
        state.record(bucket, bucket_wire("none", buf.numel()))
    return fut


HOOKS: dict[str, Hook] = {
    "none": none_hook,
    "fp16": fp16_hook,
    "bf16": bf16_hook,
    "int8": int8_hook,
    "topk": topk_hook,
    "randk": randk_hook,
    "powersgd": powersgd_hook,
}


def make_comm_hook(
    compressor: str,
    *,
    process_group: dist.ProcessGroup | None = None,
    density: float = 0.01,
    rank: int = 4,
    seed: int = 0,
    on_bytes: OnBytes | None = None,
    powersgd_start_iter: int = 2,
) -> tuple[CompressionState, Hook]:
    """The (state, hook) pair for `compressor`, ready for `ddp_model.register_comm_hook`.

    `powersgd_start_iter` plain all_reduce steps precede PowerSGD (torch requires >= 2 with
    error feedback or warm start).
    """
    if compressor not in HOOKS:
        raise ValueError(f"comm.compressor={compressor!r} is not one of {', '.join(COMPRESSORS)}")
    state = CompressionState(
        compressor=compressor, process_group=process_group, seed=seed, on_bytes=on_bytes
    )
    state.set_level(density=density, rank=rank)
    if compressor == "powersgd":
        state.powersgd = PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=powersgd_start_iter,
            use_error_feedback=True,
            warm_start=True,
            random_seed=seed,
        )
    return state, HOOKS[compressor]


def apply_compression(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    compressor: str,
    *,
    process_group: dist.ProcessGroup | None = None,
    density: float = 0.01,
    rank: int = 4,
    seed: int = 0,
    on_bytes: OnBytes | None = None,
    link: LinkEmulator | None = None,
) -> CompressionState:
    """Register the `compressor` hook on a DDP model; with `link`, each bucket also waits as
    long as its real wire bytes would take on that link. Returns the state (byte totals, set_level).
    """
    state, hook = make_comm_hook(
        compressor, process_group=process_group, density=density, rank=rank, seed=seed, on_bytes=on_bytes
    )
    if link is not None:
        hook = link.wrap_hook(hook, group_size=state.group_size(), cost=_link_cost(link),
                              group=process_group if process_group is not None else dist.group.WORLD)
    ddp_model.register_comm_hook(state, hook)
    return state


def _link_cost(link: LinkEmulator) -> Callable[[CompressionState, dist.GradBucket], float]:
    def cost(state: CompressionState, bucket: dist.GradBucket) -> float:
        wire, num_ops = state.last_cost[bucket.index()]
        return link.wire_delay(wire, num_ops)

    return cost
