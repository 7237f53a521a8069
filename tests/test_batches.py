"""engine/data/batches.py: a rank's batch is its dp rows and cp chunk of the one global batch, whatever
the layout (fixed windows and packed documents), and cp_shard alone cuts the sequence."""
from __future__ import annotations

import pytest
import torch

from engine.data.batches import RankBatches, cp_shard
from engine.data.corpus import TokenDataset

TOKENS = torch.arange(5000) % 251


def _batches(dp: int, dp_rank: int, cp: int, cp_rank: int, lengths: str) -> RankBatches:
    data = TokenDataset(TOKENS, 16)
    return RankBatches(train_set=data, val_set=data, global_batch=8, row_len=16, seed=3, dp=dp, dp_rank=dp_rank,
                       cp=cp, cp_rank=cp_rank, lengths=lengths, length_mean=6.0, length_sigma=0.5)


@pytest.mark.parametrize("lengths", ["fixed", "lognormal"])
def test_dp_rows_and_cp_chunks_put_back_together_are_the_one_process_batch(lengths):
    whole = _batches(1, 0, 1, 0, lengths).train(2)
    rows = [torch.cat([_batches(2, d, 2, c, lengths).train(2).x for c in range(2)], dim=1) for d in range(2)]
    assert torch.equal(torch.cat(rows), whole.x)
    if lengths != "fixed":  # the share of the global real tokens each of dp x cp ranks divides its sum by
        part = _batches(2, 1, 2, 0, lengths).train(2)
        assert part.real_tokens == whole.real_tokens and part.loss_norm == whole.real_tokens / 4
        assert torch.equal(part.fwd_kw["doc_ids"], whole.fwd_kw["doc_ids"][4:])  # ids stay whole rows


def test_validation_batches_are_the_same_whatever_the_layout():
    whole = _batches(1, 0, 1, 0, "fixed").val(2)
    mine = _batches(2, 1, 1, 0, "fixed").val(2)
    assert [torch.equal(a.x[4:], b.x) for a, b in zip(whole, mine)] == [True, True]


def test_cp_shard_gives_each_rank_its_chunk_and_its_positions():
    x = torch.arange(16).view(2, 8)
    second = cp_shard(x, x + 1, cp_rank=1, cp_size=2)
    assert torch.equal(second.x, x[:, 4:]) and torch.equal(second.y, x[:, 4:] + 1)
    assert torch.equal(second.fwd_kw["positions"], torch.arange(4, 8).expand(2, 4))
    assert cp_shard(x, x, cp_rank=0, cp_size=1).fwd_kw == {}  # one rank, no positions: the model's own
