"""This rank's batches: its dp rows of the step's global batch (fixed windows, packed variable-length
documents, or a real data source's rows read in order), cut to its cp chunk of the sequence.

`rank_batches(...)` reads the configured source; `.train(step)` and `.val(n)` give `Batch` values on the CPU (`Batch.to(device)` moves
them); `cp_shard` is the context-parallel cut alone. The batches are pure functions of the step
(engine/data/corpus.py, engine/data/lengths.py), except a stream's, which moves on with each call.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.config.schema import DataConfig, ModelConfig
from engine.data.corpus import build_splits, local_batch, val_batches
from engine.config.validate_data import STREAM_SOURCES


@dataclass(slots=True)
class Batch:
    """Inputs and targets, and the forward's per-sample inputs besides tokens (positions, doc_ids)."""

    x: torch.Tensor
    y: torch.Tensor
    fwd_kw: dict[str, torch.Tensor] = field(default_factory=dict)
    real_tokens: int | None = None  # packed: the global batch's tokens that are not padding
    loss_norm: float | None = None  # packed: local token-loss sum / this = share of the global mean

    def to(self, device: torch.device, *, non_blocking: bool = True) -> Batch:
        """The batch on `device` (inputs and targets copied `non_blocking`, as a step reads them later)."""
        kw = {k: v.to(device) for k, v in self.fwd_kw.items()}
        return Batch(self.x.to(device, non_blocking=non_blocking), self.y.to(device, non_blocking=non_blocking), kw,
                     self.real_tokens, self.loss_norm)


def cp_shard(x: torch.Tensor, y: torch.Tensor, *, cp_rank: int, cp_size: int, positions: torch.Tensor | None = None,
             doc_ids: torch.Tensor | None = None) -> Batch:
    """This cp rank's sequence chunk of a (dp-local) batch, with the chunk's positions (whole-row
    positions under cp > 1 when none are given); document ids stay whole: Ulysses attends over the
    full row."""
    from engine.parallel.context import shard_sequence

    if positions is None and cp_size > 1:
        positions = torch.arange(x.shape[1]).expand_as(x)
    kw: dict[str, torch.Tensor] = {}
    if positions is not None:
        kw["positions"] = shard_sequence(positions, cp=cp_size, cp_rank=cp_rank)
    if doc_ids is not None:
        kw["doc_ids"] = doc_ids
    return Batch(shard_sequence(x, cp=cp_size, cp_rank=cp_rank), shard_sequence(y, cp=cp_size, cp_rank=cp_rank), kw)


@dataclass(kw_only=True, slots=True)
class RankBatches:
    """Where this rank's batches come from and how they are cut."""

    train_set: Any = None  # TokenDataset or a user's MapDataset (engine/data/corpus.py); None with a stream
    val_set: Any = None
    stream: Any = None  # TokenStream (engine/data/sources.py): a real data source read in order
    val_stream: Any = None
    global_batch: int  # rows of the global batch
    row_len: int  # tokens per row (model.seq_len)
    seed: int
    dp: int = 1
    dp_rank: int = 0
    cp: int = 1
    cp_rank: int = 0
    lengths: str = "fixed"  # data.lengths: fixed windows, or a length distribution packed into rows
    length_mean: float = 0.0
    length_sigma: float = 0.0
    length_max: int = 0  # 0: row_len
    pack: bool = False  # a stream's rows carry positions and document ids

    def train(self, step: int) -> Batch:
        """This rank's batch of `step` (a stream's next one: call once per step)."""
        if self.stream is not None:
            return self._rows(self.stream.next_rows(self.global_batch))
        if self.lengths != "fixed":
            return self._packed(step)
        x, y = local_batch(self.train_set, global_batch=self.global_batch, dp=self.dp, dp_rank=self.dp_rank,
                           seed=self.seed, step=step)
        return cp_shard(x, y, cp_rank=self.cp_rank, cp_size=self.cp)

    def val(self, n: int) -> list[Batch]:
        """This rank's slices of the `n` fixed validation batches."""
        if self.val_stream is None:
            return [cp_shard(x, y, cp_rank=self.cp_rank, cp_size=self.cp)
                    for x, y in val_batches(self.val_set, global_batch=self.global_batch, n=n, dp=self.dp,
                                            dp_rank=self.dp_rank)]
        from engine.data.sources import val_rows

        return [self._rows(rows) for rows in val_rows(self.val_stream, rows=self.global_batch, n=n)]

    def documents(self, step: int) -> list[torch.Tensor]:
        """The documents of `step` up to a global batch of tokens (adaptive SP takes them unpacked)."""
        from engine.data.lengths import budget_documents

        return budget_documents(self.train_set.tokens, budget=self.global_batch * self.row_len, kind=self.lengths,
                                mean=self.length_mean, sigma=self.length_sigma,
                                max_len=self.length_max or self.row_len, seed=self.seed, step=step)

    def _rows(self, global_rows: Any) -> Batch:
        from engine.data.sources import rank_rows

        rows = rank_rows(global_rows, dp=self.dp, dp_rank=self.dp_rank)
        packed = {"positions": rows.positions, "doc_ids": rows.doc_ids} if self.pack else {}
        return cp_shard(rows.x, rows.y, cp_rank=self.cp_rank, cp_size=self.cp, **packed)

    def _packed(self, step: int) -> Batch:
        """The packed variable-length global batch's rows of this rank (engine/data/lengths.py)."""
        from engine.data.lengths import packed_global_batch

        packed = packed_global_batch(self.train_set.tokens, rows=self.global_batch, row_len=self.row_len,
                                     kind=self.lengths, mean=self.length_mean, sigma=self.length_sigma,
                                     max_len=self.length_max or self.row_len, seed=self.seed, step=step)
        per = self.global_batch // self.dp
        rows = slice(self.dp_rank * per, (self.dp_rank + 1) * per)
        batch = cp_shard(packed.x[rows], packed.y[rows], cp_rank=self.cp_rank, cp_size=self.cp,
                         positions=packed.positions[rows], doc_ids=packed.doc_ids[rows])
        batch.real_tokens = packed.real_tokens  # tokens/s counts real tokens, not padding
        # each rank sums its token losses over 1/(dp*cp) of the global real tokens; the gradient
        # average over dp x cp then gives the global token mean whatever each rank's share
        batch.loss_norm = packed.real_tokens / (self.dp * self.cp)
        return batch


def rank_batches(*, data: DataConfig, model: ModelConfig, global_batch: int, seed: int, dp: int = 1, dp_rank: int = 0,
                 cp: int = 1, cp_rank: int = 0, user_dataset: Any = None) -> RankBatches:
    """This rank's batches of the configured source: a user's dataset (model.entry; validated on it
    too: it brings no split, and its samples are fixed), a real data source read in order
    (engine/data/sources.py), or the built-in token splits (engine/data/corpus.py)."""
    common = dict(global_batch=global_batch, row_len=model.seq_len, seed=seed, dp=dp, dp_rank=dp_rank, cp=cp,
                  cp_rank=cp_rank, length_mean=data.length_mean, length_sigma=data.length_sigma,
                  length_max=data.length_max, pack=data.pack)
    if user_dataset is not None:
        return RankBatches(train_set=user_dataset, val_set=user_dataset, **common)
    if data.source in STREAM_SOURCES:
        from engine.data.sources import build_streams

        stream, val_stream = build_streams(data, model)
        return RankBatches(stream=stream, val_stream=val_stream, lengths=data.lengths, **common)
    splits = build_splits(data, model, seed=seed)
    return RankBatches(train_set=splits.train, val_set=splits.val, lengths=data.lengths, **common)
