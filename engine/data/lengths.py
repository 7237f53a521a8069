"""Variable-length documents: long-tail length draws, packing into fixed rows, document masks.

Real corpora have long-tail lengths (FlexSP, Wang et al. 2025, fig. 1): most documents are short,
a few are very long. `draw_lengths` draws them (seeded lognormal or Pareto, or from a file);
`pack_rows` packs documents into rows of seq_len tokens (first fit, in draw order) where each
token carries its document id and its position inside the document, so attention stays within a
document and positions restart at 0 (engine/model/gpt.py `causal_attention`). Padding has document
id -1 and target -100 (ignored by cross-entropy): tokens/s counts only real tokens.

Like engine/data/corpus.py, the documents of a step are a pure function of (seed, step).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config.validate import LENGTH_KINDS  # noqa: F401  (or a path to a file of lengths)
IGNORE = -100  # cross-entropy's ignore_index: padding targets


def draw_lengths(n: int, *, kind: str, mean: float, sigma: float, max_len: int, seed: int) -> list[int]:
    """`n` document lengths in [2, max_len].

    lognormal: median mean*max_len, log-spread sigma. pareto: minimum mean*max_len, shape sigma
    (alpha; smaller means a longer tail). Otherwise `kind` names a file of whitespace-separated
    lengths, sampled with replacement.
    """
    g = torch.Generator().manual_seed(seed)
    if kind == "lognormal":
        z = torch.randn(n, generator=g, dtype=torch.float64)
        raw = torch.exp(math.log(max(mean * max_len, 1.0)) + sigma * z)
    elif kind == "pareto":
        u = torch.rand(n, generator=g, dtype=torch.float64).clamp_min(1e-12)
        raw = max(mean * max_len, 1.0) * u.pow(-1.0 / sigma)  # inverse CDF of Pareto(x_min, alpha)
    elif kind == "fixed":
        return [max_len] * n
    else:
        table = read_lengths(kind)
        raw = torch.tensor(table, dtype=torch.float64)[torch.randint(0, len(table), (n,), generator=g)]
    return [int(v) for v in raw.round().clamp(2, max_len).tolist()]


def read_lengths(path: str) -> list[int]:
    """Document lengths from a text file (whitespace-separated positive integers)."""
    values = [int(v) for v in Path(path).read_text().split()]
    if not values or min(values) < 1:
        raise ValueError(f"data.lengths={path!r}: needs at least one positive integer length")
    return values


def pack_rows(lengths: list[int], *, rows: int, row_len: int) -> list[list[int]]:
    """Indices of the documents in each row: first fit in draw order; documents that fit no row
    are left out (the next step draws new ones)."""
    free = [row_len] * rows
    out: list[list[int]] = [[] for _ in range(rows)]
    for i, n in enumerate(lengths):
        for r in range(rows):
            if free[r] >= n:
                free[r] -= n
                out[r].append(i)
                break
    return out


@dataclass(slots=True)
class Packed:
    """Rows of packed documents: inputs, targets (-100 on padding), positions, document ids."""

    x: torch.Tensor  # (rows, row_len) int64
    y: torch.Tensor
    positions: torch.Tensor
    doc_ids: torch.Tensor  # -1 on padding

    @property
    def real_tokens(self) -> int:
        return int((self.y != IGNORE).sum())


def pack_documents(docs: list[torch.Tensor], rows: list[list[int]], row_len: int) -> Packed:
    """Lay documents (each a 1-D tensor of length L+1: L inputs and their next tokens) into rows."""
    shape = (len(rows), row_len)
    x, y = torch.zeros(shape, dtype=torch.long), torch.full(shape, IGNORE, dtype=torch.long)
    pos, doc = torch.zeros(shape, dtype=torch.long), torch.full(shape, -1, dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for d in members:
            n = docs[d].numel() - 1
            x[r, at:at + n], y[r, at:at + n] = docs[d][:-1], docs[d][1:]
            pos[r, at:at + n], doc[r, at:at + n] = torch.arange(n), d
            at += n
    return Packed(x, y, pos, doc)


def step_documents(tokens: torch.Tensor, *, n: int, kind: str, mean: float, sigma: float, max_len: int,
                   seed: int, step: int) -> list[torch.Tensor]:
    """The `n` documents drawn for `step`: random windows of the token stream of drawn lengths."""
    s = seed * 1_000_003 + step
    lengths = draw_lengths(n, kind=kind, mean=mean, sigma=sigma, max_len=max_len, seed=s)
    g = torch.Generator().manual_seed(s + 7)
    starts = torch.randint(0, tokens.numel() - max_len - 2, (n,), generator=g).tolist()
    return [tokens[a:a + length + 1] for a, length in zip(starts, lengths)]


def packed_global_batch(tokens: torch.Tensor, *, rows: int, row_len: int, kind: str, mean: float, sigma: float,
                        max_len: int, seed: int, step: int) -> Packed:
    """The packed global batch of `step`: enough drawn documents to fill `rows` rows, packed."""
    # an upper bound on the documents that can fit (each has >= 2 tokens)
    docs = step_documents(tokens, n=rows * row_len // 2, kind=kind, mean=mean, sigma=sigma, max_len=max_len,
                          seed=seed, step=step)
    packing = pack_rows([d.numel() - 1 for d in docs], rows=rows, row_len=row_len)
    return pack_documents(docs, packing, row_len)


def budget_documents(tokens: torch.Tensor, *, budget: int, kind: str, mean: float, sigma: float, max_len: int,
                     seed: int, step: int) -> list[torch.Tensor]:
    """The documents of `step` in draw order up to `budget` real tokens (at least one): a global
    batch of variable-length sequences, as adaptive sequence parallelism takes it."""
    docs = step_documents(tokens, n=max(1, budget // 2), kind=kind, mean=mean, sigma=sigma, max_len=max_len,
                          seed=seed, step=step)
    out, total = [], 0
    for d in docs:
        if out and total + d.numel() - 1 > budget:
            break
        out.append(d)
        total += d.numel() - 1
    return out
