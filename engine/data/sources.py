"""Real token data, read in order with a position a checkpoint keeps.

Three sources, each a list of documents of token ids read only when asked:
- `tokens`: a flat file of uint16/uint32 ids (nanoGPT's train.bin), through `numpy.memmap`;
  `data.eos_id` marks where documents end (the token after it starts the next one).
- `megatron`: a Megatron indexed dataset (`prefix.bin` + `prefix.idx`) through megatron-core's own
  `IndexedDataset`; each sequence is a document.
- `hf`: local jsonl / json / parquet / arrow / text files through Hugging Face `datasets` (Arrow,
  memory-mapped) and a local tokenizer (`tokenizer.json` or a tokenizer folder); each record is
  tokenized when read, `data.eos_id` appended.

`TokenStream` walks the documents in order: the global batch of a step is the next
`global_batch` rows of seq_len + 1 tokens (rows share their boundary token, as nanoGPT's windows
do), the same on every rank whatever the dp degree, each dp rank taking its contiguous rows. Its
position (document, offset, epoch) is the whole data state: `state_dict()` goes into the
checkpoint (engine/train/checkpoint.py) and a resumed run reads the batch an uninterrupted one would.
The last `data.val_fraction` of the documents (of the tokens, for a one-document token file) is
the validation split.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config.schema import DataConfig, ModelConfig

from engine.config.validate_data import HF_SUFFIXES as HF_FORMATS, STREAM_SOURCES, split_tokens  # noqa: F401  (torch-free names)

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


@dataclass(slots=True)
class Documents:
    """Documents `lo..hi-1` of a source: `read(i)` returns document i's ids (a numpy array or memmap)."""

    read: Callable[[int], np.ndarray]
    lo: int
    hi: int
    eos_id: int = -1  # tokens source: a document ends after this id (-1: the file is one document)

    def __len__(self) -> int:
        return self.hi - self.lo

    def doc(self, i: int) -> np.ndarray:
        return self.read(self.lo + i)


@dataclass(slots=True)
class Rows:
    """A global batch: inputs, targets, and per-token position / document id for packed attention."""

    x: torch.Tensor  # (rows, seq_len) int64
    y: torch.Tensor
    positions: torch.Tensor
    doc_ids: torch.Tensor


@dataclass(slots=True)
class TokenStream:
    """The documents read in order from a position; `next_rows` returns a global batch and moves on."""

    docs: Documents
    seq_len: int
    vocab: int
    doc: int = 0  # the document the next row starts in
    offset: int = 0  # its first unread token
    epoch: int = 0  # completed passes over the documents
    _cache: dict[int, np.ndarray] = field(default_factory=dict)

    def state_dict(self) -> dict[str, int]:
        return {"doc": self.doc, "offset": self.offset, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.doc, self.offset, self.epoch = int(state["doc"]), int(state["offset"]), int(state["epoch"])

    def _document(self, i: int) -> np.ndarray:
        if i not in self._cache:
            self._cache = {i: self.docs.doc(i)}  # one document held at a time (tokenized ones are costly)
        return self._cache[i]

    def _take(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The next `n` tokens and whether each starts a document; the position moves past them."""
        ids, starts, empty = [], [], 0
        while n > 0:
            d = self._document(self.doc)
            empty = empty + 1 if len(d) == self.offset else 0
            if empty > len(self.docs):  # a whole pass without one token
                raise ValueError("data.path: every document is empty (no tokens to read)")
            part = np.asarray(d[self.offset:self.offset + n], dtype=np.int64)
            flags = np.zeros(len(part), dtype=bool)
            if self.offset == 0 and len(part):
                flags[0] = True
            if self.docs.eos_id >= 0 and len(part) > 1:  # separators inside one flat token file
                flags[1:] |= part[:-1] == self.docs.eos_id
            ids.append(part)
            starts.append(flags)
            n -= len(part)
            self.offset += len(part)
            if self.offset >= len(d):
                self.doc, self.offset = self.doc + 1, 0
                if self.doc == len(self.docs):
                    self.doc, self.epoch = 0, self.epoch + 1
        return np.concatenate(ids), np.concatenate(starts)

    def next_rows(self, rows: int) -> Rows:
        """The next global batch of `rows` rows."""
        span = rows * self.seq_len
        ids, starts = self._take(span)
        state = self.state_dict()
        last, last_start = self._take(1)  # the final target; read again as the next batch's first input
        self.load_state_dict(state)
        ids, starts = np.concatenate([ids, last]), np.concatenate([starts, last_start])
        tokens = torch.from_numpy(ids.astype(np.int64))
        top = int(tokens.max())
        if top >= self.vocab:
            raise ValueError(f"data.path: token id {top} >= model.vocab={self.vocab}; raise model.vocab or "
                             "re-tokenize")
        idx = torch.arange(rows)[:, None] * self.seq_len + torch.arange(self.seq_len + 1)[None, :]
        chunk, first = tokens[idx], torch.from_numpy(starts)[idx[:, :-1]]
        first[:, 0] = True  # a row attends only within itself: a document cut by the row starts anew
        return Rows(chunk[:, :-1], chunk[:, 1:], _positions(first), torch.cumsum(first.long(), dim=1) - 1)


def _positions(first: torch.Tensor) -> torch.Tensor:
    """Position of each token inside its document (0 where `first` is set)."""
    t = torch.arange(first.shape[1]).expand_as(first)
    start = torch.cummax(torch.where(first, t, torch.zeros_like(t)), dim=1).values
    return t - start


# ---------------------------------------------------------------- sources

def token_file(path: str, dtype: str) -> np.memmap:
    """The ids of a nanoGPT-style token file (memory-mapped, nothing read yet)."""
    return np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")


def _split_docs(n: int, val_fraction: float) -> int:
    """Documents in the train split: all but the last val_fraction, at least one on each side."""
    if n < 2:
        raise ValueError(f"data.path: {n} document(s); a validation split needs at least 2 "
                         "(or a token file, split by tokens)")
    return min(n - 1, max(1, n - max(1, round(n * val_fraction))))


def _token_docs(data: DataConfig, seq_len: int) -> tuple[Documents, Documents]:
    ids = token_file(data.path or "", data.dtype)
    split = split_tokens(len(ids), seq_len=seq_len, val_fraction=data.val_fraction)
    if split is None:  # validate() refuses it before launch (engine/config/validate_data.py)
        raise ValueError(f"data.path={data.path!r}: {len(ids)} tokens, too few for two splits of {seq_len + 2}")
    cut = split[0]
    parts = (ids[:cut], ids[cut:])
    # the memmap itself: TokenStream converts only the slices it reads
    return tuple(Documents(lambda i, p=p: p, 0, 1, data.eos_id) for p in parts)


def megatron_dataset(prefix: str) -> Any:
    """megatron-core's reader of `prefix.bin` / `prefix.idx` (imported only for this source)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(re.sub(r"\.(bin|idx)$", "", prefix), mmap=True)


def _megatron_docs(data: DataConfig) -> tuple[Documents, Documents]:
    ds = megatron_dataset(data.path or "")
    cut = _split_docs(len(ds), data.val_fraction)
    read = lambda i: np.asarray(ds[i], dtype=np.int64)  # noqa: E731
    return Documents(read, 0, cut), Documents(read, cut, len(ds))


def load_tokenizer(path: str) -> Any:
    """A `tokenizers.Tokenizer` from a tokenizer.json, or a folder holding one (else transformers' fast
    tokenizer of that folder, offline)."""
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir() and (p / "tokenizer.json").is_file():
        p = p / "tokenizer.json"
    if p.is_file():
        return Tokenizer.from_file(str(p))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p), local_files_only=True).backend_tokenizer


def hf_dataset(path: str) -> Any:
    """The records of local files through `datasets` (one format per path, by its suffix)."""
    import datasets

    datasets.disable_progress_bars()  # its per-split bars would interleave with the ranks' output
    p = Path(path)
    files = sorted(str(f) for f in p.rglob("*") if f.suffix in HF_FORMATS) if p.is_dir() else [str(p)]
    kind = HF_FORMATS[Path(files[0]).suffix]
    if kind == "arrow":
        return datasets.concatenate_datasets([datasets.Dataset.from_file(f) for f in files])
    return datasets.load_dataset(kind, data_files=files, split="train")


def _hf_docs(data: DataConfig) -> tuple[Documents, Documents]:
    ds, tok = hf_dataset(data.path or ""), load_tokenizer(data.tokenizer or "")
    tail = [data.eos_id] if data.eos_id >= 0 else []

    def read(i: int) -> np.ndarray:
        return np.asarray(tok.encode(ds[i][data.text_field]).ids + tail, dtype=np.int64)

    cut = _split_docs(len(ds), data.val_fraction)
    return Documents(read, 0, cut), Documents(read, cut, len(ds))


def build_streams(data: DataConfig, model: ModelConfig) -> tuple[TokenStream, TokenStream]:
    """Train and validation streams of `data.source` (one of STREAM_SOURCES), at their start."""
    if data.source == "tokens":
        train, val = _token_docs(data, model.seq_len)
    elif data.source == "megatron":
        train, val = _megatron_docs(data)
    else:
        train, val = _hf_docs(data)
    if data.split == "val":
        train = val
    return TokenStream(train, model.seq_len, model.vocab), TokenStream(val, model.seq_len, model.vocab)


def val_rows(val: TokenStream, *, rows: int, n: int) -> list[Rows]:
    """`n` fixed validation batches: the first n global batches of the validation split."""
    fresh = TokenStream(val.docs, val.seq_len, val.vocab)
    return [fresh.next_rows(rows) for _ in range(n)]



def encode_state(state: dict[str, int]) -> torch.Tensor:
    """A stream position as a uint8 tensor (DCP stores tensors without pickling)."""
    return torch.frombuffer(bytearray(json.dumps(state).encode()), dtype=torch.uint8)


def decode_state(t: torch.Tensor) -> dict[str, int]:
    return json.loads(bytes(t.tolist()).decode())


def rank_rows(batch: Rows, *, dp: int, dp_rank: int) -> Rows:
    """This dp rank's contiguous rows of a global batch."""
    per = batch.x.shape[0] // dp
    s = slice(dp_rank * per, (dp_rank + 1) * per)
    return Rows(batch.x[s], batch.y[s], batch.positions[s], batch.doc_ids[s])



def write_token_file(src: str, tokenizer: str, out: str, *, text_field: str = "text", eos_id: int = -1,
                     chunk: int = 1 << 20) -> tuple[int, str]:
    """Tokenize local files (jsonl / json / parquet / arrow / txt) into a nanoGPT-style token file, record
    by record, `eos_id` after each (-1: none); uint16 when the vocabulary fits, else uint32.
    Returns (tokens written, dtype)."""
    ds, tok = hf_dataset(src), load_tokenizer(tokenizer)
    dtype = "uint16" if tok.get_vocab_size(with_added_tokens=True) <= 1 << 16 else "uint32"
    tail, buf, total = ([eos_id] if eos_id >= 0 else []), [], 0
    part = f"{out}.part"  # renamed when whole: a failure leaves no half-written token file behind
    try:
        with open(part, "wb") as f:
            for i in range(len(ds)):
                buf += tok.encode(ds[i][text_field]).ids + tail
                if len(buf) >= chunk or i == len(ds) - 1:
                    np.asarray(buf, dtype=TOKEN_DTYPES[dtype]).tofile(f)
                    total, buf = total + len(buf), []
        os.replace(part, out)
    finally:
        Path(part).unlink(missing_ok=True)
    return total, dtype
