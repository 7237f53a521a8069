"""The I/O half of validation: what the files a run config names hold, read once before the rules run.

`read_files(cfg)` opens the checkpoint folder, the lengths file, the token file, the Megatron
dataset, the Hugging Face data and tokenizer, `model.hf`'s config.json and `model.hf_weights`, and
returns plain values (`Files`: sizes, ids, field names, vocabulary sizes, shapes, problems). The rules
(engine/config/validate.py, engine/config/validate_data.py) take those values and open nothing, so a rule check can
be run on values alone. Each file is read only when the rules will look at what it holds (as before:
no token sampling for a file of the wrong size, no weights check for a config transformers refuses).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ConfigError
from engine.config.validate_data import HF_SUFFIXES, STREAM_SOURCES, TOKEN_DTYPE_BYTES, hf_files_problem

SAMPLE_CHUNKS, SAMPLE_CHUNK_BYTES = 64, 1 << 20  # token ids read before launch: at most 64 MiB, spread over the file


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenFile:
    """A `data.source=tokens` file: whether it is there, its bytes, its largest sampled id."""

    exists: bool
    size: int = 0
    max_id: int = -1  # read only when the size fits data.dtype
    max_as_uint16: int | None = None  # the largest id read as uint16, for a file declared uint32


@dataclass(frozen=True, kw_only=True, slots=True)
class HfData:
    """A `data.source=hf` path and tokenizer."""

    exists: bool
    suffixes: tuple[str, ...] = ()  # of the data files (the path itself when it is not a folder)
    first_fields: list[str] | None = None  # fields of the first file's first record (None: not known)
    tokenizer_exists: bool = False
    tokenizer_vocab: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class HfModel:
    """`model.hf` and `model.hf_weights`: the config read (or why it cannot be), transformers' refusals."""

    config: dict[str, Any] | None = None
    error: ConfigError | None = None  # the config cannot be read or has no usable shape
    config_problems: list[ConfigError] = field(default_factory=list)
    weights_is_dir: bool = False
    weight_problems: list[ConfigError] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True, slots=True)
class Files:
    """What validation needs to know of the files a config names (defaults: nothing named, nothing wrong)."""

    resume_is_checkpoint: bool = True  # train.resume_from holds a .metadata file
    lengths_is_file: bool = False  # data.lengths names a file
    token_file: TokenFile | None = None
    megatron_missing: tuple[str, ...] = ()  # prefix.bin / prefix.idx not there
    hf_data: HfData | None = None
    hf_model: HfModel | None = None


def read_files(cfg: Any) -> Files:
    """Read what the rules need from the files `cfg` (a RunConfig) names."""
    d, m = cfg.data, cfg.model
    resume = cfg.train.resume_from
    stream = d.source in STREAM_SOURCES and bool(d.path)
    return Files(
        resume_is_checkpoint=not resume or (Path(resume) / ".metadata").is_file(),
        lengths_is_file=Path(d.lengths).is_file(),
        token_file=read_token_file(Path(d.path), d.dtype) if stream and d.source == "tokens" else None,
        megatron_missing=_megatron_missing(d.path) if stream and d.source == "megatron" else (),
        hf_data=read_hf_data(d.path, d.tokenizer) if stream and d.source == "hf" else None,
        hf_model=read_hf_model(m.hf, m.hf_weights) if m.hf is not None else None)


def read_token_file(path: Path, dtype: str) -> TokenFile:
    if not path.is_file():
        return TokenFile(exists=False)
    size = path.stat().st_size
    if dtype not in TOKEN_DTYPE_BYTES or size % TOKEN_DTYPE_BYTES[dtype]:
        return TokenFile(exists=True, size=size)
    return TokenFile(exists=True, size=size, max_id=sampled_max_id(path, dtype),
                     max_as_uint16=sampled_max_id(path, "uint16") if dtype == "uint32" else None)


def _megatron_missing(path: str) -> tuple[str, ...]:
    prefix = re.sub(r"\.(bin|idx)$", "", path)
    return tuple(prefix + suffix for suffix in (".bin", ".idx") if not Path(prefix + suffix).is_file())


def read_hf_data(path_name: str, tokenizer: str | None) -> HfData:
    path = Path(path_name)
    files = sorted(f for f in path.rglob("*") if f.suffix in HF_SUFFIXES) if path.is_dir() else [path]
    suffixes = tuple(f.suffix for f in files)
    exists = path.exists()
    fields = record_fields(files[0]) if hf_files_problem(path_name, exists, suffixes) is None else None
    tok = Path(tokenizer or "")
    tokenizer_exists = bool(tokenizer) and tok.exists()
    return HfData(exists=exists, suffixes=suffixes, first_fields=fields, tokenizer_exists=tokenizer_exists,
                  tokenizer_vocab=tokenizer_vocab(tok) if tokenizer_exists else None)


def read_hf_model(spec: Any, weights: str | None) -> HfModel:
    """The config of `model.hf` (a path or a mapping) and, when transformers takes it, the weights' check."""
    from engine.config.hf_checks import config_errors, weight_errors
    from engine.model.shapes import from_hf_config, read_hf_config

    weights_is_dir = weights is not None and Path(weights).is_dir()
    try:
        config = read_hf_config(spec)
        from_hf_config(config)
    except ConfigError as exc:
        return HfModel(error=exc, weights_is_dir=weights_is_dir)
    problems = list(config_errors(spec))
    weight_problems = list(weight_errors(weights, spec)) if weights_is_dir and not problems else []
    return HfModel(config=config, config_problems=problems, weights_is_dir=weights_is_dir,
                   weight_problems=weight_problems)


def sampled_max_id(path: Path, dtype: str) -> int:
    """The largest id in the token file: all of a small file, else SAMPLE_CHUNKS evenly spaced chunks
    (the ranks check every batch they read as well)."""
    import numpy as np

    ids = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    if len(ids) == 0:
        return -1
    per_chunk = SAMPLE_CHUNK_BYTES // ids.itemsize
    if len(ids) <= SAMPLE_CHUNKS * per_chunk:
        return int(ids.max())
    starts = np.linspace(0, len(ids) - per_chunk, SAMPLE_CHUNKS).astype(np.int64)
    return max(int(ids[s:s + per_chunk].max()) for s in starts)


def record_fields(file: Path) -> list[str] | None:
    """The fields of the file's first record, as `datasets` will read them (None: not known cheaply)."""
    kind = HF_SUFFIXES[file.suffix]
    if kind == "text":
        return ["text"]  # datasets' text loader: one record per line, in the field `text`
    if kind == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(file).names)
    if kind == "arrow":
        import pyarrow as pa

        with pa.memory_map(str(file)) as source:
            return list(pa.ipc.open_stream(source).schema.names)
    return _json_fields(file)


def _json_fields(file: Path) -> list[str] | None:
    import json

    with open(file, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError:
                    return None  # a whole-file JSON array: datasets reads it; too costly to parse here
                return list(record) if isinstance(record, dict) else None
    return None


def tokenizer_vocab(path: Path) -> int | None:
    """The tokenizer's vocabulary size, added tokens included (None: a folder without tokenizer.json)."""
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        return None
    from tokenizers import Tokenizer  # Rust, imports in milliseconds; no torch

    return Tokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True)
