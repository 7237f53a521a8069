"""Token data: a byte-level corpus built offline from the standard library's own sources, random
tokens for benchmarks, text files, or a user's dataset.

Batches are a pure function of (seed, step): the global batch of step t is the same whatever the
dp degree, each dp rank takes its contiguous slice of it, and a resumed run needs no iterator state.
"""
from __future__ import annotations

import importlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config.schema import DataConfig, ModelConfig

CORPUS_BYTES = 4 * 1024 * 1024  # enough text that tiny models do not memorise it in a few hundred steps
SYNTHETIC_TOKENS = 1 << 20


def stdlib_corpus(max_bytes: int = CORPUS_BYTES) -> bytes:
    """The standard library's top-level .py sources, sorted by name: the same bytes on every machine
    with the same Python, no download."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for path in sorted(root.glob("*.py")):
        out += path.read_bytes()
        if len(out) >= max_bytes:
            break
    return bytes(out[:max_bytes])


def _files_corpus(path: str) -> bytes:
    p = Path(path)
    files = sorted(p.rglob("*")) if p.is_dir() else [p]
    return b"".join(f.read_bytes() for f in files if f.is_file())


@dataclass(slots=True)
class TokenDataset:
    """A flat token stream; a sample is a window of seq_len tokens and its next-token targets."""

    tokens: torch.Tensor  # int64, 1-D
    seq_len: int

    def __len__(self) -> int:
        return self.tokens.numel() - self.seq_len - 1

    def windows(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        chunk = self.tokens[idx]
        return chunk[:, :-1], chunk[:, 1:]


@dataclass(slots=True)
class Splits:
    train: TokenDataset
    val: TokenDataset


def build_splits(data: DataConfig, model: ModelConfig, *, seed: int) -> Splits:
    """Train/val token streams for the configured source (the last val_fraction is validation)."""
    if data.source == "synthetic":
        g = torch.Generator().manual_seed(seed + 12345)
        tokens = torch.randint(0, model.vocab, (SYNTHETIC_TOKENS,), generator=g)
    else:
        raw = stdlib_corpus() if data.source == "text" else _files_corpus(data.path or "")
        if not raw:
            raise ValueError(f"data.path={data.path!r}: no readable text (0 bytes found)")
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
    n_val = max(int(tokens.numel() * data.val_fraction), model.seq_len + 2)
    if tokens.numel() - n_val < model.seq_len + 2:
        raise ValueError(f"data has {tokens.numel()} tokens, too few for seq_len={model.seq_len}")
    train, val = tokens[:-n_val], tokens[-n_val:]
    if data.split == "val":
        train = val
    return Splits(TokenDataset(train, model.seq_len), TokenDataset(val, model.seq_len))


def global_batch_starts(dataset_len: int, global_batch: int, *, seed: int, step: int) -> torch.Tensor:
    """Window starts of the whole global batch of `step`: the same on every rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, dataset_len, (global_batch,), generator=g)


def local_batch(ds: TokenDataset, *, global_batch: int, dp: int, dp_rank: int, seed: int,
                step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp rank's contiguous slice of the global batch of `step`."""
    starts = global_batch_starts(len(ds), global_batch, seed=seed, step=step)
    per_rank = global_batch // dp
    return ds.windows(starts[dp_rank * per_rank:(dp_rank + 1) * per_rank])


def val_batches(ds: TokenDataset, *, global_batch: int, n: int, dp: int,
                dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` fixed validation batches (evenly spaced windows) of global_batch samples each, this dp
    rank's slice of each: the same samples whatever the layout."""
    starts = torch.linspace(0, len(ds) - 1, global_batch * n).long().view(n, global_batch)
    per_rank = global_batch // dp
    return [ds.windows(row[dp_rank * per_rank:(dp_rank + 1) * per_rank]) for row in starts]


@dataclass(slots=True)
class MapDataset:
    """A user's dataset of (input, target) tensor pairs, read with the same batch indexing."""

    items: object  # anything with __len__ and __getitem__ -> (input, target)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def seq_len(self) -> int:
        """Tokens (elements) per sample, for tokens/s."""
        return int(self.items[0][0].numel())

    def windows(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self.items[int(i)] for i in starts]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def load_entry(entry: str):
    """Import a user's `module:function` (only when model.entry names it) and call it.

    It returns (model, train_dataset) where dataset items are (input, target) tensors.
    """
    module_name, func_name = entry.split(":", 1)
    func = getattr(importlib.import_module(module_name), func_name)
    return func()
