"""Checkpoints through torch.distributed.checkpoint (DCP): every layout, resumable in any other.

Every rank calls `save()`. DCP writes each rank's share of the state (its DTensor shards under
TP and FSDP2, its pipeline stages, its ZeRO-1 optimizer partition) into one folder
`stepNNNNNN/`, each tensor named by its fully qualified name in the FULL model; replicated
tensors are written once. `load()` asks each rank for exactly the slices its own layout holds,
so a checkpoint saved in one layout resumes in any other valid layout of the same model
(pp2 x tp2 -> dp4 ZeRO-3 -> tp2).

- Model and optimizer: `get_state_dict` / `set_state_dict` with the optimizer state flattened
  per parameter (`state.layers.3.attn.wq.weight.exp_avg`), which is what lets pipeline stages
  reshard (torchtitan's ModelWrapper/OptimizersContainer do the same). Pipeline stages keep the
  global block names (`layers.3`, engine/model/gpt.py), so a pp=2 checkpoint loads into pp=1. The
  tied embedding/head is one parameter named `tok_emb.weight` in a pp=1 model, two on pipeline
  stages: the last stage's `head.weight` optimizer state is stored under `tok_emb.weight` too.
- Optimizer hyperparameters (`param_groups`) are saved but the config's values win at resume.
- Data order: batches are a pure function of (seed, step) (engine/data/corpus.py), so the step is the
  whole data state; a real data source read in order (engine/data/sources.py) saves its position
  under `data` (the same on every rank) and resumes from it.
- Experts keep their global ids under expert parallelism (`experts.2` is expert 2 on every
  rank that holds it, engine/model/moe.py), so an ep=2 checkpoint resumes at ep=1 and back.
- RNG: each rank's torch generator states, restored when the layout (dp, tp, pp, cp, ep) is the saved
  one; in another layout dropout masks differ anyway (other shapes per rank), so the seeded
  state stays.
- CO2: each dp rank trains its own replica between outer rounds, so the checkpoint holds each dp
  rank's parameters and inner optimizer state, plus CO2's anchor, outer momentum and in-flight
  round (engine/comm/co2.py). Such a checkpoint resumes in the same dp and tp degrees only; a
  plain checkpoint resumes into a CO2 run (CO2 re-takes its anchor from the loaded weights).
- Gradient compressors: each rank's memory (error-feedback residuals, Rand-k's call counters,
  PowerSGD's memories and random stream, L-GreCo's levels) under `comm.rank<r>`, with the DDP
  bucket order it was made in (engine/comm/bucket_order.py). It resumes into the same kind of
  compressor in the same degrees (ZeRO-1 <-> DDP and ZeRO-2 <-> ZeRO-3 keep it); other degrees
  are refused, another compressor starts with empty memories.
- layer_split=auto: the split the run used is in the metadata, and a resumed auto run takes it
  (the measured one depends on timings).
"""
from __future__ import annotations

import contextlib
import json
import logging
import pickle
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.errors import ConfigError

if TYPE_CHECKING:
    from engine.config.schema import RunConfig
    from engine.parallel.parallelize import Parallelized

logger = logging.getLogger(__name__)

# engine/model/gpt.py ties GPT.head.weight to GPT.tok_emb.weight; a pp=1 model names the pair by the latter
_TIED = {"head.weight": "tok_emb.weight"}
_OPTIM_SECTIONS = ("state", "param_groups")
_TORCH_SAVE_MAGIC = b"PK\x03\x04"  # DCP writes each item with torch.save: a zip archive
_STEP_NAME = re.compile(r"step([0-9]+)")  # checkpoint_path's names


@dataclass(slots=True)
class RankState:
    """What one rank's checkpoint saves and loads back into: its model parts and optimizer (`par`),
    the degrees that decide what it holds (`layout`: dp, tp, pp, cp, ep) and its place in them
    (`coords`), and the per-rank extras: the gradient compressor's memory (`comm`, a CommMonitor),
    CO2's state, a data source's position (`stream`). Loading fills these objects in place."""

    par: Parallelized
    layout: dict[str, int]
    coords: dict[str, int]
    rank: int
    device: torch.device
    seed: int
    dropout: float
    data_source: str
    compressor: str
    zero: int
    comm: Any = None
    co2: Any = None
    stream: Any = None


def checkpoint_folder(cfg: Any, run_dir: Path | None) -> Path:
    """Where a run's checkpoints go: train.checkpoint_dir, else the run folder's `checkpoints`."""
    return Path(cfg.train.checkpoint_dir) if cfg.train.checkpoint_dir else (run_dir or Path(".")) / "checkpoints"


def checkpoint_path(folder: Path, step: int) -> Path:
    """The folder DCP writes the checkpoint of `step` into."""
    return Path(folder) / f"step{step:06d}"


def step_of(path: str | Path) -> int | None:
    """The step a checkpoint folder's name gives (`step000042` -> 42, `step1000000` -> 1000000), else None."""
    found = _STEP_NAME.fullmatch(Path(path).name)
    return int(found.group(1)) if found else None


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The complete checkpoint of the highest step in `folder` (DCP writes `.metadata` last), or None.

    By number, not by name: the names grow a digit past step999999, so as strings step999000 sorts last."""
    folder = Path(folder)
    done = [(step, p) for p in (folder.iterdir() if folder.is_dir() else ())
            if (step := step_of(p)) is not None and (p / ".metadata").is_file()]
    return max(done)[1] if done else None


def save(parts: RankState, step: int, folder: Path) -> Path:
    """Write the checkpoint of `step` (every rank calls this); returns its folder."""
    import torch.distributed.checkpoint as dcp

    path = checkpoint_path(folder, step)
    state, _ = _train_state(parts, co2=parts.co2 is not None)
    comm = _comm_state(parts)
    if comm is not None:
        state["comm"] = {f"rank{parts.rank}": comm[1]}
    meta = json.dumps({"step": step, **_layout(parts), "co2": parts.co2 is not None,
                       "seed": parts.seed, "layer_split": parts.par.layer_split,
                       "comm": comm[0] if comm else None})
    state["meta"] = torch.frombuffer(bytearray(meta.encode()), dtype=torch.uint8)  # a tensor: read without pickle
    state["rng"] = {f"rank{parts.rank}": _rng_state(parts.device)}
    if parts.stream is not None:
        from engine.data.sources import encode_state

        state["data"] = encode_state(parts.stream.state_dict())
    dcp.save(state, checkpoint_id=str(path))  # .metadata is written last: a half-written folder does not load
    return path


def read_meta(path: str | Path) -> dict[str, Any]:
    """The checkpoint's metadata record (step, layout, seed, ...), read by this rank alone."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    saved = _reader(path).read_metadata().state_dict_metadata
    _tensors_only(path, saved, ["meta"])
    got = {"meta": torch.empty(saved["meta"].size, dtype=torch.uint8)}
    dcp.load(got, storage_reader=_reader(path), no_dist=True)
    return json.loads(bytes(got["meta"].tolist()).decode())


def saved_layer_split(path: str | Path, *, layers: int, pp: int) -> list[int] | None:
    """The blocks per stage the checkpoint's run used, when it is a split of `layers` over `pp` stages."""
    split = read_meta(path).get("layer_split")  # absent in checkpoints written before it was recorded
    if isinstance(split, list) and len(split) == pp and sum(split) == layers:
        return [int(n) for n in split]
    return None


def load(parts: RankState, path: str | Path) -> int:
    """Restore the state saved in `path` into this rank's layout; returns the step to continue from."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    saved = _reader(path).read_metadata().state_dict_metadata
    _tensors_only(path, saved, ["meta"])
    got = {"meta": torch.empty(saved["meta"].size, dtype=torch.uint8)}
    dcp.load(got, storage_reader=_reader(path))
    meta = json.loads(bytes(got["meta"].tolist()).decode())
    _check_co2_layout(parts, meta)
    if meta["seed"] != parts.seed:
        logger.warning("train.seed=%s differs from the checkpoint's %s: batches after step %s follow the new seed",
                       parts.seed, meta["seed"], meta["step"])
    state, apply = _train_state(parts, co2=meta["co2"])
    # only tensors are read back (DCP unpickles anything else without restriction); so the
    # config's hyperparameters (param_groups) win over the saved ones
    to_read = {k: v for k, v in _flat(state).items() if isinstance(v, torch.Tensor) and not _is_param_group(k)}
    rng_key = f"rng.rank{parts.rank}"
    # checkpoints written before cp and ep were recorded had both at 1 (ep > 1 did not resume then)
    same_layout = all(meta.get(axis, 1) == value for axis, value in _layout(parts).items())
    if same_layout and any(k.startswith(rng_key + ".") for k in saved):
        to_read.update({f"{rng_key}.{name}": t for name, t in _rng_state(parts.device).items()})
    elif parts.dropout > 0:
        logger.warning("resume in another layout than %s: dropout masks are drawn afresh", meta)
    comm_key = f"comm.rank{parts.rank}."
    if _comm_resumes(parts, meta):
        to_read.update({k: torch.empty(md.size, dtype=md.properties.dtype, device=parts.device)
                        for k, md in saved.items() if k.startswith(comm_key)})
    _tensors_only(path, saved, to_read)
    dcp.load(to_read, storage_reader=_reader(path))
    _load_comm_state(parts, {k[len(comm_key):]: v for k, v in to_read.items() if k.startswith(comm_key)})
    _set_rng_state({k[len(rng_key) + 1:]: v for k, v in to_read.items() if k.startswith(rng_key + ".")})
    apply({k: to_read.get(k, v) for k, v in _flat(state).items()})
    _load_data_position(parts, path, saved)
    return int(meta["step"])


def _load_data_position(parts: RankState, path: Path, saved: dict[str, Any]) -> None:
    """Move a real data source's stream to the saved position (engine/data/sources.py)."""
    if parts.stream is None:
        return
    import torch.distributed.checkpoint as dcp

    from engine.data.sources import decode_state

    if "data" not in saved:
        raise ValueError(f"train.resume_from={path}: the checkpoint has no data position (saved with "
                         f"data.source other than {parts.data_source}); resume with its own data.source")
    _tensors_only(path, saved, ["data"])
    got = {"data": torch.empty(saved["data"].size, dtype=torch.uint8)}
    dcp.load(got, storage_reader=_reader(path))
    parts.stream.load_state_dict(decode_state(got["data"]))


def check_resume(cfg: RunConfig) -> None:
    """Before any rank starts: train.resume_from is a readable checkpoint of this config's model.

    Reads the checkpoint's `.metadata` (the saved tensors' names and full shapes) and compares them
    with the model the config builds on the meta device (no memory, no weights); checks that each
    shard file lies inside the checkpoint folder, each saved item inside its shard file and starts as
    torch.save writes it, and that nothing but param_groups is stored as pickled bytes. Raises a
    ConfigError naming the first mismatched tensor and both shapes, or the unreadable file or item."""
    if not cfg.train.resume_from:
        return
    path = Path(cfg.train.resume_from)
    try:
        metadata = _reader(path).read_metadata()
        saved = metadata.state_dict_metadata  # param_groups are stored pickled, and never read back
        _tensors_only(path, saved, [key for key in saved if not _is_param_group(key)])
    except RefusedCheckpoint as exc:
        raise ConfigError("train.resume_from", str(path), f"its .metadata {exc.what}; refused, nothing in it was "
                          "run: resume from a checkpoint this engine wrote") from None
    except Exception as exc:  # a truncated or overwritten pickle fails in many ways (ValueError, EOFError, ...)
        raise ConfigError("train.resume_from", str(path), f"its .metadata cannot be read ({type(exc).__name__}: "
                          f"{exc}); the checkpoint is damaged: resume from another stepNNNNNN folder") from None
    _check_shards(path, metadata.storage_data)
    if cfg.model.entry is None and cfg.model.hf is None:  # a user's or HF model's shapes are known inside its ranks
        _check_model_shapes(cfg, path, metadata.state_dict_metadata)


def _check_shards(path: Path, storage: dict[Any, Any]) -> None:
    for index, info in storage.items():
        shard = _shard_file(path, info.relative_path, index.fqn)
        size = shard.stat().st_size if shard.is_file() else None
        if size is None or size < info.offset + info.length:
            found = "is missing" if size is None else f"has {size} bytes, {info.offset + info.length} needed"
            raise ConfigError("train.resume_from", str(path), f"shard {info.relative_path} {found} (for {index.fqn}); "
                              "the checkpoint is incomplete: resume from another stepNNNNNN folder")
        with open(shard, "rb") as f:
            f.seek(info.offset)
            head = f.read(4)
        if not info.transform_descriptors and head != _TORCH_SAVE_MAGIC:
            raise ConfigError("train.resume_from", str(path), f"shard {info.relative_path} is damaged at byte "
                              f"{info.offset} ({index.fqn} does not start as torch.save writes it); "
                              "resume from another stepNNNNNN folder")


def _check_model_shapes(cfg: RunConfig, path: Path, saved: dict[str, Any]) -> None:
    from engine.model.gpt import GPT

    with torch.device("meta"):
        model = GPT(cfg.model)
    expected = {f"model.{name}": tuple(t.shape) for name, t in model.state_dict().items()}
    # a CO2 checkpoint holds one replica per dp rank (dp0.model..., dp1.model...): the first one is compared
    replica = "dp0." if any(k.startswith("dp0.model.") for k in saved) else ""
    found = {k[len(replica):]: tuple(v.size) for k, v in saved.items()
             if k.startswith(replica + "model.") and hasattr(v, "size")}
    for name, shape in expected.items():
        if name not in found:
            raise ConfigError("train.resume_from", str(path), f"the checkpoint has no {name} {list(shape)}, which "
                              f"this model has (model.layers={cfg.model.layers}); resume with the model config "
                              "the checkpoint was written with")
        if found[name] != shape:
            raise ConfigError("train.resume_from", str(path), f"{name} is {list(found[name])} in the checkpoint but "
                              f"{list(shape)} in this model (model.d_model={cfg.model.d_model}, "
                              f"model.vocab={cfg.model.vocab}); resume with the model config the checkpoint was "
                              "written with")
    extra = [k for k in found if k not in expected]
    if extra:
        raise ConfigError("train.resume_from", str(path), f"the checkpoint holds {extra[0]} {list(found[extra[0]])}, "
                          f"which this model lacks (model.layers={cfg.model.layers}); resume with the model config "
                          "the checkpoint was written with")


# ---------------------------------------------------------------- model + optimizer

def _train_state(parts: RankState, *, co2: bool) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    """The live state dict of this rank under global names, and a function that loads one back.

    With `co2` the model and optimizer live under `dp<d>.` (each dp rank's replica) and CO2's
    own state under `co2.tp<t>` (shared by the dp ranks of a tp rank).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    par = parts.par
    module, strip = _as_one_module(par.modules)
    optimizer = getattr(par.optimizer, "optim", par.optimizer)  # ZeRO-1 wrappers step an inner optimizer
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(module, optimizer, options=options)
    model_names = {k: strip(k) for k in model_sd}
    # an untied head (most Hugging Face models, engine/model/hf.py) is its own parameter, never the embedding
    tied = all(getattr(getattr(m, "module", m), "tied", True) for m in par.modules)
    param_names = _optimizer_names(optim_sd, strip, tied=tied)
    prefix = f"dp{parts.coords['dp']}." if co2 else ""
    state: dict[str, Any] = {
        f"{prefix}model": {model_names[k]: v for k, v in model_sd.items()},
        f"{prefix}optim": {_rename_optim_key(k, param_names): v for k, v in optim_sd.items()},
    }
    if co2 and parts.co2 is not None:
        state["co2"] = {f"tp{parts.coords['tp']}": parts.co2.state_dict()}

    def apply(flat: dict[str, Any]) -> None:
        back_model = {v: k for k, v in model_names.items()}
        back_optim = {_rename_optim_key(k, param_names): k for k in optim_sd}
        new_model = {back_model[k[len(prefix) + 6:]]: v for k, v in flat.items() if k.startswith(f"{prefix}model.")}
        new_optim = {back_optim[k[len(prefix) + 6:]]: v for k, v in flat.items() if k.startswith(f"{prefix}optim.")}
        with _without_empty_groups(optimizer):
            set_state_dict(module, optimizer, model_state_dict=new_model, optim_state_dict=new_optim, options=options)
        if parts.co2 is not None:
            co2_key = f"co2.tp{parts.coords['tp']}."
            own = {k[len(co2_key):]: v for k, v in flat.items() if k.startswith(co2_key)}
            if own:
                parts.co2.load_state_dict(own)
            else:  # a plain checkpoint: the loaded weights are the first round's start point
                parts.co2.reset_anchor()

    return state, apply


@contextlib.contextmanager
def _without_empty_groups(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Hide param groups with no parameters while loading, then put them back in place.

    torch 2.13's `_unflatten_optim_state_dict` indexes the first parameter of every group, and a
    ZeRO-1 rank may own no parameter of a group (IndexError otherwise).
    """
    groups = optimizer.param_groups
    empty = [(i, g) for i, g in enumerate(groups) if not g["params"]]
    optimizer.param_groups = [g for g in groups if g["params"]]
    try:
        yield
    finally:
        loaded = list(optimizer.param_groups)  # load_state_dict builds new group dicts
        for i, group in empty:
            loaded.insert(i, group)
        optimizer.param_groups = loaded


def _as_one_module(modules: list[nn.Module]) -> tuple[nn.Module, Callable[[str], str]]:
    """One module over this rank's model parts, and the map from its names to the full model's.

    Interleaved pipeline ranks hold several stage chunks; `get_state_dict` takes one module, so
    they go into a ModuleList and its index prefix (`0.`, `1.`) is dropped again: the chunks
    already carry global block names and never share one.
    """
    if len(modules) == 1:
        return modules[0], lambda name: name
    return nn.ModuleList(modules), lambda name: name.split(".", 1)[1]


def _optimizer_names(optim_sd: dict[str, Any], strip: Callable[[str], str], *, tied: bool = True) -> dict[str, str]:
    """Local parameter name -> global name, for the parameters the optimizer holds."""
    local = {_split_optim_key(k)[1] for k in optim_sd}
    names = {name: strip(name) for name in local}
    held = set(names.values())
    for name, global_name in names.items():
        # a last pipeline stage holds the tied head without the embedding: store it as the embedding
        if tied and global_name in _TIED and _TIED[global_name] not in held:
            names[name] = _TIED[global_name]
    return names


def _split_optim_key(key: str) -> tuple[str, str, str]:
    """`state.layers.0.ln1.weight.exp_avg` -> (`state`, `layers.0.ln1.weight`, `exp_avg`)."""
    section, rest = key.split(".", 1)
    name, attr = rest.rsplit(".", 1)  # AdamW's state is one level deep (step, exp_avg, exp_avg_sq)
    if section not in _OPTIM_SECTIONS:
        raise ValueError(f"unexpected flattened optimizer key {key!r}")
    return section, name, attr


def _rename_optim_key(key: str, names: dict[str, str]) -> str:
    section, name, attr = _split_optim_key(key)
    return f"{section}.{names[name]}.{attr}"


def _is_param_group(flat_key: str) -> bool:
    return ".param_groups." in f".{flat_key}"


def _flat(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> one level with dotted keys (DCP's own flattening, which load mirrors)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# ---------------------------------------------------------------- layout, rng, metadata

def _layout(parts: RankState) -> dict[str, int]:
    """The degrees that decide what each rank holds and draws: dp, tp, pp, cp and ep."""
    return {axis: parts.layout.get(axis, 1) for axis in ("dp", "tp", "pp", "cp", "ep")}


def _check_co2_layout(parts: RankState, meta: dict[str, Any]) -> None:
    if not meta["co2"]:
        return
    here = _layout(parts)
    if parts.co2 is None or meta["dp"] != here["dp"] or meta["tp"] != here["tp"]:
        raise ValueError(f"train.resume_from: a CO2 checkpoint (dp={meta['dp']}, tp={meta['tp']}) holds one "
                         f"replica per dp rank and resumes only as a CO2 run with the same dp and tp; "
                         f"this run has co2.enabled={parts.co2 is not None}, dp={here['dp']}, tp={here['tp']}")


# ---------------------------------------------------------------- compressor state

def _comm_state(parts: RankState) -> tuple[str, dict[str, torch.Tensor]] | None:
    """(kind, tensors) of this rank's gradient compressor memory, or None when it keeps none.

    Residuals, Rand-k's call counters, PowerSGD's memories and L-GreCo's levels are per rank (each
    dp rank's error differs) and tied to its buckets, so they are saved per global rank with the
    DDP bucket order they were made in (engine/comm/bucket_order.py).
    """
    monitor = parts.comm
    state = getattr(monitor, "compressor_state", None)
    tensors = state.state_dict() if hasattr(state, "state_dict") else {}
    if not tensors:  # fp16/bf16, or nothing sent yet
        return None
    order = monitor.bucket_order.state() if monitor.bucket_order is not None else {}
    tensors["bucket_order"] = torch.frombuffer(bytearray(json.dumps(order).encode()), dtype=torch.uint8)
    return _comm_kind(parts, state), tensors


def _comm_kind(parts: RankState, state: Any) -> str:
    """Which memory a compressor state is: its class, compressor, and DDP buckets or FSDP2 groups."""
    return f"{type(state).__name__}:{parts.compressor}:{'fsdp' if parts.zero >= 2 else 'ddp'}"


def _comm_resumes(parts: RankState, meta: dict[str, Any]) -> bool:
    """Whether this run takes the checkpoint's compressor state: the same kind of compressor in the
    same degrees; a compressor state into other degrees is refused (it has no exact mapping)."""
    saved = meta.get("comm")
    if not saved:
        return False
    monitor = parts.comm
    state = getattr(monitor, "compressor_state", None)
    here = _comm_kind(parts, state)
    if not hasattr(state, "load_state_dict") or here != saved:
        logger.warning("train.resume_from: the checkpoint's compressor state (%s) does not apply to this run's "
                       "compressor (%s): it starts with empty memories", saved, here if state is not None else "none")
        return False
    layout = _layout(parts)
    if any(meta.get(axis, 1) != value for axis, value in layout.items()):
        saved_layout = ", ".join(f"{axis}={meta.get(axis, 1)}" for axis in layout)
        raise ValueError(f"train.resume_from: the checkpoint's gradient compressor state ({saved}) is per rank "
                         f"and resumes only in its own degrees ({saved_layout}); this run has "
                         f"{', '.join(f'{a}={v}' for a, v in layout.items())} (comm.compressor=none drops it)")
    return True


def _load_comm_state(parts: RankState, tensors: dict[str, torch.Tensor]) -> None:
    if not tensors:
        return
    monitor = parts.comm
    order = tensors.pop("bucket_order", None)
    if order is not None and monitor.bucket_order is not None:
        monitor.bucket_order.load(json.loads(bytes(order.tolist()).decode()))
    monitor.compressor_state.load_state_dict(tensors)


def _reader(path: Path):
    """DCP's file reader, reading `.metadata` with an allow-list instead of a plain pickle.load, and
    refusing every item stored as pickled bytes.

    DCP pickles its metadata and unpickles it with no restriction (torch 2.13); tensors it loads
    with weights_only=True, but an item the metadata calls bytes (BytesStorageMetadata) with
    torch.load(weights_only=False), whatever the state dict asked for. The engine reads tensors
    only (param_groups, saved as bytes, are never read back), so a checkpoint file can hold data
    only, never code. Every shard the metadata names must lie inside the checkpoint folder.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with open(path / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(f, path / ".metadata").load()
            for index, info in metadata.storage_data.items():  # before any rank opens a shard
                _shard_file(path, info.relative_path, index.fqn)
            metadata.storage_meta = metadata.storage_meta or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            for item in plan.items:
                if item.type == LoadItemType.BYTE_IO:
                    raise RefusedCheckpoint(path / ".metadata", _pickled(item.storage_index.fqn))
            return super().read_data(plan, planner)

    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"train.resume_from={path}: not a checkpoint folder (no .metadata); "
                                "checkpoints are folders named stepNNNNNN")
    return SafeReader(str(path))


def _shard_file(path: Path, relative: Any, fqn: str) -> Path:
    """The shard file of `fqn`, refused unless `relative` (from .metadata) names a file inside the checkpoint
    folder `path`: a relative path without `..` that no symlink leads out of."""
    name = Path(relative) if isinstance(relative, (str, PurePath)) else None
    if name is None or name.is_absolute() or ".." in name.parts \
            or not (path / name).resolve().is_relative_to(path.resolve()):
        raise RefusedCheckpoint(path / ".metadata", f"puts {fqn} in shard {relative!r}, outside the checkpoint "
                                "folder (a shard must lie inside it: no '..', no absolute path, no symlink out)")
    return path / name


def _tensors_only(path: Path, saved: dict[str, Any], keys: Iterable[str]) -> None:
    """Refuse before DCP reads them: items of `keys` the metadata says are pickled bytes (see _reader)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    for key in keys:
        if isinstance(saved.get(key), BytesStorageMetadata):
            raise RefusedCheckpoint(path / ".metadata", _pickled(key))


def _pickled(key: str) -> str:
    return f"stores {key} as pickled bytes, which this engine never reads back (DCP would unpickle them " \
        "without restriction)"


class RefusedCheckpoint(pickle.UnpicklingError):
    """A checkpoint's `.metadata` names a class outside the allow-list, or an item stored as pickled bytes:
    refused before anything in it runs."""

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what = path, what
        super().__init__(f"{path}: {what}; refused, nothing in it was run or loaded")


# every global a DCP checkpoint's .metadata names (torch 2.13: recorded from DDP, FSDP2/ZeRO, pipeline,
# TP, CO2, compressor and data-source checkpoints); exact (module, name) pairs: a pickle of protocol 4
# looks a dotted name up attribute by attribute, so a module-wide allowance also reaches the module's
# imports (torch.distributed.checkpoint.metadata imports os: "os.system" ran)
_DCP = "torch.distributed.checkpoint.metadata"
_ALLOWED = frozenset({(_DCP, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
                                               "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                               "_MEM_FORMAT_ENCODING")}
                     | {(module, name) for module in ("pathlib", "pathlib._local")  # 3.13 moved the classes
                        for name in ("PosixPath", "PurePosixPath")}
                     | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                        ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
                     | {("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)})


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: its own dataclasses, torch sizes, dtypes and layouts, paths; nothing else."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise RefusedCheckpoint(self.path, f"refers to {module}.{name}, which a DCP checkpoint of this engine "
                                    "never holds (a pickle naming it could run code)")
        return super().find_class(module, name)


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device).cpu()
    return states


def _set_rng_state(states: dict[str, torch.Tensor]) -> None:
    if "cpu" in states:
        torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
