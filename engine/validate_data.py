"""The rules of the real data sources (engine/data_sources.py), checked before any process starts:
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
STREAM_SOURCES = ("tokens", "megatron", "hf")  # engine/data_sources.py: read in order, position checkpointed
TOKEN_DTYPE_BYTES = {"uint16": 2, "uint32": 4}  # data.dtype of a token file
HF_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".txt": "text"}


def stream_rules(cfg: RunConfig) -> Iterator[ConfigError]:
    """A token file, a Megatron indexed dataset or local files with a tokenizer (engine/data_sources.py)."""
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
    tok = Path(d.tokenizer or "")
    if not d.tokenizer or not tok.exists():
        yield ConfigError("data.tokenizer", d.tokenizer, "must name a tokenizer.json or a tokenizer folder "
                          "when data.source=hf")
        return
    vocab = _tokenizer_vocab(tok)
    if vocab is not None and vocab > cfg.model.vocab:
        yield ConfigError("data.tokenizer", d.tokenizer, f"has {vocab} tokens, more than model.vocab="
                          f"{cfg.model.vocab}; raise model.vocab to at least {vocab}")


def _tokenizer_vocab(path: Path) -> int | None:
    """The tokenizer's vocabulary size, added tokens included (None: a folder without tokenizer.json)."""
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        return None
    from tokenizers import Tokenizer  # Rust, imports in milliseconds; no torch

    return Tokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True)
