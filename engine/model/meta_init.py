"""Meta-device construction: a model is built without memory, the layout is applied to it, then each
rank materialises only the tensors it holds, bit-identical to the seeded build of the whole model.

Today's initial weights come from one seeded CPU generator drawn over the whole model in the
constructor's order (nn.Linear's kaiming draws, then the model's own re-init; transformers
interleaves the two per sub-model), so a rank holding a shard must replay every draw in that order.
`record()` runs the real constructor on meta under a dispatch mode that logs each aten op on the
tensors it creates (no memory, no draws). `materialize()` replays the log on CPU: every seeded op
runs full-size, so the generator advances exactly as in the full build; an op no tensor of this
rank needs is skipped; a storage is freed after its last use; each parameter's own part (DTensor
shard, pipeline stage, expert) is copied out as soon as its value is final.
Chosen over re-deriving each family's init by hand: the real constructor is the one source of truth
(GPT, MoE, every transformers family, and its buffers), so parity is exact by construction; the
peak is the rank's own tensors plus the largest tensor in flight, never the model.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine.torch_compat import TorchDispatchMode, tree_flatten, tree_map_only

aten = torch.ops.aten
META = torch.device("meta")
# ops that write every element of their target without reading it: an earlier value is dead
_OVERWRITE = {aten.normal_.default, aten.uniform_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default,
              aten.copy_.default, aten.random_.default, getattr(aten.random_, "from"), aten.random_.to,
              aten.exponential_.default, aten.bernoulli_.float, aten.log_normal_.default, aten.cauchy_.default,
              aten.geometric_.default}


@dataclasses.dataclass(frozen=True, slots=True)
class _Ref:
    """A recorded tensor: a strided view of recorded storage `sid`."""

    sid: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Op:
    """One recorded aten call; tensors in `args`/`kwargs` are `_Ref`s."""

    func: Any
    args: tuple
    kwargs: dict
    creates: tuple[tuple[int, _Ref], ...]  # (index in the flat outputs, ref) of each new storage
    reads: frozenset[int]  # storages whose values it reads
    writes: frozenset[int]  # storages it writes (in place or new)
    overwrites: frozenset[int]  # storages it writes entirely without reading
    seeded: bool  # draws from the default generator


class InitRecord:
    """The constructor's ops, the storage sizes, and each parameter's / buffer's recorded tensor by
    name (every alias: a tied head is the embedding's tensor). Shared, never copied: a pipeline
    chunk deep-copied from the meta model refers to the same record."""

    def __init__(self, ops: list[_Op], nbytes: dict[int, int], sources: dict[str, _Ref],
                 rng_state: torch.Tensor) -> None:
        self.ops, self.nbytes, self.sources, self.rng_state = ops, nbytes, sources, rng_state
        # hf_weights: (folder, read(name, box) -> the box of that tensor, None where the checkpoint lacks it)
        self.load: tuple[str, Callable[[str, tuple[slice, ...]], torch.Tensor | None]] | None = None

    def __deepcopy__(self, memo: dict) -> InitRecord:
        return self


class _Recorder(TorchDispatchMode):
    """Runs every op on meta (factory ops too) and logs those that create or write a storage."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.sids: dict[int, int] = {}
        self.nbytes: dict[int, int] = {}
        self._keep: list[torch.UntypedStorage] = []  # alive, so no two storages share an address

    def ref(self, t: torch.Tensor) -> _Ref:
        storage = t.untyped_storage()
        sid = self.sids.get(storage._cdata)
        if sid is None:
            sid = self.sids[storage._cdata] = len(self.sids)
            self.nbytes[sid] = storage.nbytes()
            self._keep.append(storage)
        return _Ref(sid, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if any(a.name == "device" for a in func._schema.arguments):
            kwargs["device"] = META
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        if seeded and kwargs.get("generator") is not None:
            raise NotImplementedError(f"{func}: an init drawing from its own generator cannot be replayed")
        inputs = {id(t): self.ref(t) for t in tree_flatten((args, kwargs))[0] if _is_meta(t)}
        out = func(*args, **kwargs)
        flat_out = tree_flatten(out)[0]
        creates = tuple((i, self.ref(t)) for i, t in enumerate(flat_out)
                        if _is_meta(t) and t.untyped_storage()._cdata not in self.sids)
        written = [self.ref(t) for t in _written(func, args, kwargs)]
        if not creates and not written and not seeded:
            return out  # a view or a read: replayed through the refs of the ops that use it
        if any(isinstance(t, torch.Tensor) and not t.is_meta for t in flat_out):
            raise NotImplementedError(f"{func} made a tensor off meta during a meta build")
        full = {r.sid for r in written if func in _OVERWRITE and self._covers(r)}
        overwrites = frozenset(full | {r.sid for _, r in creates})
        self.ops.append(_Op(func, *tree_map_only(torch.Tensor, lambda t: inputs[id(t)] if _is_meta(t) else t,
                                                 (args, kwargs)),
                            creates=creates, reads=frozenset(r.sid for r in inputs.values()) - overwrites,
                            writes=frozenset(r.sid for r in written) | overwrites, overwrites=overwrites,
                            seeded=seeded))
        return out

    def _covers(self, r: _Ref) -> bool:
        """Whether `r` is its whole storage, densely."""
        expected, step = [], 1
        for n in reversed(r.size):
            expected.append(step)
            step *= n
        dense = all(s == e for s, e, n in zip(r.stride, reversed(expected), r.size) if n > 1)
        return r.offset == 0 and dense and step * r.dtype.itemsize == self.nbytes[r.sid]


def _is_meta(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_meta


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors `func` writes in place (its schema's mutable arguments)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(a.name)
        out += [t for t in (value if isinstance(value, (list, tuple)) else [value]) if _is_meta(t)]
    return out


def record(build: Callable[[], nn.Module], *, seed: int) -> nn.Module:
    """`build()` (a model's constructor, seeded with `seed` as the full build is) run on meta, with
    its init recorded in `model.init_record` for `materialize()`. No memory, no draws."""
    torch.manual_seed(seed)
    state = torch.get_rng_state()
    recorder = _Recorder()
    with recorder:
        model = build()
    sources = {name: recorder.ref(t) for name, t in _named_tensors(model) if t.is_meta}
    model.init_record = InitRecord(recorder.ops, recorder.nbytes, sources, state)
    return model


def _named_tensors(module: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    return itertools.chain(module.named_parameters(remove_duplicate=False),
                           module.named_buffers(remove_duplicate=False))


def record_of(modules: Iterable[nn.Module]) -> InitRecord | None:
    """The init record of meta-built `modules` (None: they are real already)."""
    for m in modules:
        for sub in m.modules():
            rec = sub.__dict__.get("init_record")
            if rec is not None:
                return rec
    return None


def is_meta(module: nn.Module) -> bool:
    """Whether `module` still holds meta tensors."""
    return any(t.is_meta for _, t in _named_tensors(module))


def materialize(modules: list[nn.Module], *, device: torch.device | str = "cpu", values: bool = True) -> None:
    """Allocate the meta tensors of `modules` (this rank's model parts, layout applied: DTensor
    shards, pipeline chunks, kept experts) on `device` and fill them with the values the full seeded
    build gives, or the `hf_weights` checkpoint's; afterwards the default generator is where the full
    build leaves it. One call for all of a rank's parts (one replay of the draws). `values=False`
    only allocates (uninitialised: a dry run's `FakeTensorMode`). A no-op on real modules."""
    modules = [m for m in modules if is_meta(m)]
    record = record_of(modules)
    if record is None:
        return
    for m in modules:
        if not values and _UNVALUED and not _fsdp_wrapped(m):
            _allocate_under(m, torch.device(device), _UNVALUED[-1])
        else:
            _allocate(m, torch.device(device))
        for sub in m.modules():
            sub.__dict__.pop("init_record", None)
    if not values:
        return
    targets = _targets(modules, record)
    loaded = _load(record, targets) if record.load is not None else set()  # the checkpoint's, not drawn
    _replay(record, {sid: ts for sid, ts in targets.items() if sid not in loaded}, seeded=record.load is None)


_UNVALUED: list[Any] = []  # the mode `values=False` allocates under (`allocating_under`)


@contextlib.contextmanager
def allocating_under(mode: Any) -> Iterator[None]:
    """`materialize(values=False)` allocates under `mode` here (a dry run's FakeTensorMode: tensors without
    storage, so the wrappers applied after it, FSDP2's `replicate` copying each parameter into its own
    storage, touch no memory: 11 GiB for Llama-3.1-8B at tp 4 otherwise)."""
    _UNVALUED.append(mode)
    try:
        yield
    finally:
        _UNVALUED.pop()


def _fsdp_wrapped(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(sub, FSDPModule) for sub in module.modules())


def _allocate_under(module: nn.Module, device: torch.device, mode: Any) -> None:
    """`_allocate` under `mode` (`allocating_under`) of a module no FSDP2 wraps yet: each meta parameter and
    buffer made again under it, a DTensor swapped in place (its wrapper keeps its references), a plain tensor
    set in its place (the mode keeps a weak reference to what it makes: swap_tensors refuses those, and so
    does `_apply` for every fake tensor). A tensor held under several names is one tensor again."""
    from torch.distributed.tensor import DTensor

    made: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    with mode:
                        new = torch.empty_like(t, device=device) if isinstance(t, DTensor) \
                            else torch.empty(t.shape, dtype=t.dtype, device=device)
                        if isinstance(t, nn.Parameter):
                            new = nn.Parameter(new, requires_grad=t.requires_grad)
                    if isinstance(t, DTensor):
                        torch.utils.swap_tensors(t, new)
                        new = t
                    made[id(t)] = new
                table[name] = made[id(t)]


def _allocate(module: nn.Module, device: torch.device) -> None:
    """`module.to_empty(device)` for its meta tensors only (real ones made after the build are kept),
    through `_apply` so FSDP2 re-registers its shards. Parameters are swapped in place
    (`swap_tensors`), so the layout's references to them stay valid (expert parallelism's expert
    list, which DDP must ignore); a buffer held under several names is one tensor again afterwards."""
    shared: dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str]]]] = {}  # a buffer by its registrations
    for sub in module.modules():
        for name, b in sub._buffers.items():
            if b is not None and b.is_meta:
                shared.setdefault(id(b), (b, []))[1].append((sub, name))
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    for _, ((first, first_name), *others) in shared.values():
        for sub, name in others:
            sub._buffers[name] = first._buffers[first_name]


@dataclasses.dataclass(frozen=True, slots=True)
class _Target:
    ref: _Ref  # the full tensor, recorded
    local: torch.Tensor  # this rank's tensor to fill
    box: tuple[slice, ...]  # the part of the full tensor it holds
    name: str
    is_param: bool


def _targets(modules: list[nn.Module], record: InitRecord) -> dict[int, list[_Target]]:
    """Every tensor of `modules` by the recorded storage its value comes from."""
    out: dict[int, list[_Target]] = {}
    for m in modules:
        params = {id(p) for p in m.parameters()}
        for name, t in _named_tensors(m):
            key = _canonical(name)
            ref = record.sources.get(key)
            if ref is None:
                continue  # made after the build (real already)
            local, box = _owned(t)
            out.setdefault(ref.sid, []).append(_Target(ref, local, box, key, id(t) in params))
    return out


def _canonical(name: str) -> str:
    """A parameter's name in the model as built (a DDP wrapper's `module.` removed; FSDP2, TP and
    the pipeline keep the names)."""
    return name.removeprefix("module.")


def _owned(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(the local tensor, the box of the full tensor it holds): a DTensor's shard, else all of it."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t.data, tuple(slice(0, n) for n in t.shape)
    from engine.torch_compat import compute_local_shape_and_global_offset  # DTensor's: loaded when a DTensor is here

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t._local_tensor
    if tuple(local.shape) != tuple(shape):
        raise NotImplementedError(f"a shard of shape {tuple(local.shape)} is not a box {shape} of {tuple(t.shape)}")
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _as_tensor(storage: torch.UntypedStorage, ref: _Ref) -> torch.Tensor:
    return torch.empty(0, dtype=ref.dtype).set_(storage, ref.offset, ref.size, ref.stride)


def _schedule(record: InitRecord, wanted: set[int], seeded: bool) -> tuple[list[bool], list[bool], list[list[int]],
                                                                          list[list[int]]]:
    """(run, keep, extract, free) per op, by one backward pass: an op is kept when a storage it
    writes is needed later; seeded ops always run (they advance the generator); a wanted storage
    is copied out after the last op that touches it; a storage is freed after its last use."""
    n = len(record.ops)
    run, keep = [False] * n, [False] * n
    extract: list[list[int]] = [[] for _ in range(n)]
    free: list[list[int]] = [[] for _ in range(n)]
    need: set[int] = set()  # storages whose value is needed after the op at hand
    pending = set(wanted)
    for i in range(n - 1, -1, -1):
        op = record.ops[i]
        touched = op.reads | op.writes
        extract[i] = sorted(touched & pending)
        pending -= touched
        need |= set(extract[i])
        free[i] = sorted(touched - need)
        if op.writes & need:
            run[i] = keep[i] = True
            need -= op.overwrites
            need |= op.reads
        elif op.seeded and seeded:
            run[i] = True
            need |= op.reads - op.writes
    if pending or need:
        raise RuntimeError(f"no recorded init for storages {sorted(pending | need)[:5]}")
    return run, keep, extract, free


@torch.no_grad()
def _replay(record: InitRecord, targets: dict[int, list[_Target]], *, seeded: bool) -> None:
    """Run the scheduled ops on CPU from the recorded generator state; copy each target's box out."""
    run, keep, extract, free = _schedule(record, set(targets), seeded)
    live: dict[int, torch.UntypedStorage] = {}

    def real(r: _Ref) -> torch.Tensor:
        if r.sid not in live:  # first use, or the value before is dead: fresh memory
            live[r.sid] = torch.UntypedStorage(record.nbytes[r.sid])
        return _as_tensor(live[r.sid], r)

    if seeded:
        torch.set_rng_state(record.rng_state)
    for i, op in enumerate(record.ops):
        if run[i] and not keep[i] and _advance(op):
            pass
        elif run[i]:
            args, kwargs = tree_map_only(_Ref, real, (op.args, op.kwargs))
            if "device" in kwargs:
                kwargs["device"] = torch.device("cpu")  # the full build's draws ran on CPU
            out = op.func(*args, **kwargs)
            flat = tree_flatten(out)[0]
            for index, ref in op.creates:
                t = flat[index]
                if (tuple(t.shape), tuple(t.stride()), t.storage_offset()) != (ref.size, ref.stride, ref.offset):
                    raise RuntimeError(f"{op.func} made {tuple(t.shape)}/{tuple(t.stride())} on CPU, "
                                       f"{ref.size}/{ref.stride} on meta")
                if keep[i]:
                    live[ref.sid] = t.untyped_storage()
            del args, kwargs, out, flat
        for sid in extract[i]:
            for tgt in targets[sid]:
                tgt.local.copy_(_as_tensor(live[sid], tgt.ref)[tgt.box])
            live.pop(sid, None)
        for sid in free[i]:
            live.pop(sid, None)


_CHUNK = 1 << 22  # elements (16 MiB of fp32)
_DRAWS = {aten.normal_.default, aten.uniform_.default}


def _advance(op: _Op) -> bool:
    """Run a draw no tensor needs (a weight redrawn later: nn.Linear's kaiming before the model's
    own init) on a small buffer, piece by piece, instead of a full-size tensor; False when it cannot.
    Over a dense fp32 target each element takes one uniform draw (normal_ transforms 16 at a time
    and redraws a short tail once), so pieces of 16k elements, the last >= 16, leave the generator
    where one call leaves it (tests/test_meta_init.py checks it on the installed torch)."""
    target = op.args[0] if op.args else None
    if op.func not in _DRAWS or not isinstance(target, _Ref) or target.sid not in op.overwrites \
            or target.dtype != torch.float32:
        return False
    left = math.prod(target.size)
    if left <= _CHUNK + 16:
        return False
    buf = torch.empty(_CHUNK + 32)
    while left > _CHUNK + 16:
        op.func(buf[:_CHUNK], *op.args[1:], **op.kwargs)
        left -= _CHUNK
    op.func(buf[:left], *op.args[1:], **op.kwargs)
    return True


@torch.no_grad()
def _load(record: InitRecord, targets: dict[int, list[_Target]]) -> set[int]:
    """Fill the targets from the checkpoint (each reads only its box; a tied head may be saved under
    the embedding's name); the storages done. A parameter the checkpoint lacks is refused."""
    from engine.errors import ConfigError

    folder, read = record.load
    names: dict[_Ref, list[str]] = {}
    for name, ref in record.sources.items():
        names.setdefault(ref, []).append(name)
    done = set()
    for sid, group in targets.items():
        for t in group:
            aliases = [t.name] + [n for n in names[t.ref] if n != t.name]
            value = next((v for v in (read(n, t.box) for n in aliases) if v is not None), None)
            if value is None and t.is_param:
                raise ConfigError("model.hf_weights", folder, f"its safetensors files hold no tensor for "
                                  f"parameter {t.name}")
            if value is not None:
                t.local.copy_(value)
                done.add(sid)
    return done


