"""The rules of the real data sources (engine/data/sources.py), checked before any process starts:
the file exists and is whole, the tokenizer exists and fits the model's vocabulary, the source does not
meet a feature it cannot serve. Torch-free (`tokenizers` is imported only to read a vocabulary size)."""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import ConfigError

if TYPE_CHECKING:
    from engine.config import RunConfig

DATA_SOURCES = ("text", "synthetic", "files", "tokens", "megatron", "hf")
STREAM_SOURCES = ("tokens", "megatron", "hf")  # engine/data/sources.py: read in order, position checkpointed
TOKEN_DTYPE_BYTES = {"uint16": 2, "uint32": 4}  # data.dtype of a token file
SAMPLE_CHUNKS, SAMPLE_CHUNK_BYTES = 64, 1 << 20  # token ids read before launch: at most 64 MiB, spread over the file
HF_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".txt": "text"}


def stream_rules(cfg: RunConfig) -> Iterator[ConfigError]:
    """A token file, a Megatron indexed dataset or local files with a tokenizer (engine/data/sources.py)."""
    d, m, p = cfg.data, cfg.model, cfg.parallel
    for on, name in ((m.entry is not None, "model.entry (it brings its own dataset)"),
                     (d.lengths != "fixed", "data.lengths (drawn documents; the data has its own)"),
                     (p.adaptive_sp, "parallel.adaptive_sp")):
        if on:
            yield ConfigError("data.source", d.source, f"does not combine with {name}")
    if d.eos_id >= m.vocab:
        yield ConfigError("data.eos_id", d.eos_id, f"must be < model.vocab={m.vocab} (or -1: none)")
    if d.pack and (p.pp > 1 or p.sequence_parallel):
        yield ConfigError("data.pack", True, "packed documents need parallel.pp=1 and no sequence_parallel "
                          "(their document ids do not cross stage or SP boundaries)")
    if not d.path:
        yield ConfigError("data.path", d.path, f"must name the data when data.source={d.source}")
        return
    if d.source == "tokens":
        yield from _token_file_rules(cfg)
    elif d.source == "megatron":
        prefix = re.sub(r"\.(bin|idx)$", "", d.path)
        for suffix in (".bin", ".idx"):
            if not Path(prefix + suffix).is_file():
                yield ConfigError("data.path", d.path, f"{prefix}{suffix} does not exist (a Megatron indexed "
                                  "dataset is prefix.bin + prefix.idx)")
    else:
        yield from _hf_data_rules(cfg)


def _token_file_rules(cfg: RunConfig) -> Iterator[ConfigError]:
    d = cfg.data
    if d.dtype not in TOKEN_DTYPE_BYTES:
        yield ConfigError("data.dtype", d.dtype, f"must be one of {', '.join(TOKEN_DTYPE_BYTES)}")
    path = Path(d.path or "")
    if not path.is_file():
        yield ConfigError("data.path", d.path, "no such token file")
    elif d.dtype in TOKEN_DTYPE_BYTES and path.stat().st_size % TOKEN_DTYPE_BYTES[d.dtype]:
        size = path.stat().st_size
        yield ConfigError("data.path", d.path, f"holds {size} bytes, not a multiple of {TOKEN_DTYPE_BYTES[d.dtype]} "
                          f"(data.dtype={d.dtype}); is it a token file of another dtype?")
    elif d.dtype in TOKEN_DTYPE_BYTES:
        yield from token_count_rules(d.path or "", path.stat().st_size // TOKEN_DTYPE_BYTES[d.dtype],
                                     seq_len=cfg.model.seq_len, val_fraction=d.val_fraction)
        yield from token_id_rules(d.path or "", d.dtype, sampled_max_id(path, d.dtype), vocab=cfg.model.vocab,
                                  max_as_uint16=sampled_max_id(path, "uint16") if d.dtype == "uint32" else None)


def split_tokens(tokens: int, *, seq_len: int, val_fraction: float) -> tuple[int, int] | None:
    """(train, validation) tokens of a token file, split by tokens; None when either split is shorter than
    one row and its next-token target (seq_len + 2 tokens): engine/data/sources.py reads it so."""
    need = seq_len + 2
    val = max(int(tokens * val_fraction), need)
    return None if tokens - val < need else (tokens - val, val)


def token_count_rules(path: str, tokens: int, *, seq_len: int, val_fraction: float) -> Iterator[ConfigError]:
    if split_tokens(tokens, seq_len=seq_len, val_fraction=val_fraction) is None:
        yield ConfigError("data.path", path, f"holds {tokens} tokens, too few for a training and a validation "
                          f"split of model.seq_len+2 = {seq_len + 2} tokens each (at least {2 * (seq_len + 2)})")


def token_id_rules(path: str, dtype: str, top: int, *, vocab: int,
                   max_as_uint16: int | None = None) -> Iterator[ConfigError]:
    """The largest id read from the file must be below model.vocab; a uint16 file declared uint32 reads
    as ids of 2**16 and more (two ids per value), which `max_as_uint16` tells apart."""
    if top < vocab:
        return
    hint = "raise model.vocab or re-tokenize"
    if max_as_uint16 is not None and max_as_uint16 < vocab:
        hint = f"read as uint16 every id fits (largest {max_as_uint16}): is it data.dtype=uint16?"
    yield ConfigError("data.path", path, f"holds token id {top} (data.dtype={dtype}), not below "
                      f"model.vocab={vocab}; {hint}")


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


def _hf_data_rules(cfg: RunConfig) -> Iterator[ConfigError]:
    d = cfg.data
    path = Path(d.path or "")
    files = sorted(f for f in path.rglob("*") if f.suffix in HF_SUFFIXES) if path.is_dir() else [path]
    if not path.exists():
        yield ConfigError("data.path", d.path, "does not exist")
    elif not files or files[0].suffix not in HF_SUFFIXES:
        yield ConfigError("data.path", d.path, f"must be (or hold) {' / '.join(HF_SUFFIXES)} files")
    elif len({HF_SUFFIXES[f.suffix] for f in files}) > 1:
        yield ConfigError("data.path", d.path, "holds files of several formats; give one format per path")
    else:
        yield from text_field_rules(d.path or "", d.text_field, record_fields(files[0]))
    tok = Path(d.tokenizer or "")
    if not d.tokenizer or not tok.exists():
        yield ConfigError("data.tokenizer", d.tokenizer, "must name a tokenizer.json or a tokenizer folder "
                          "when data.source=hf")
        return
    vocab = tokenizer_vocab(tok)
    if vocab is not None and vocab > cfg.model.vocab:
        yield ConfigError("data.tokenizer", d.tokenizer, f"has {vocab} tokens, more than model.vocab="
                          f"{cfg.model.vocab}; raise model.vocab to at least {vocab}")


def text_field_rules(path: str, field: str, fields: list[str] | None) -> Iterator[ConfigError]:
    if fields is not None and field not in fields:
        yield ConfigError("data.text_field", field, f"is not a field of the records in {path} (its first record "
                          f"has {', '.join(fields) or 'no fields'})")


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
