"""Variable-length documents (engine/data/lengths.py): long-tail draws, packing, document-aware attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.data.lengths import IGNORE, draw_lengths, pack_documents, pack_rows, packed_global_batch
from parallel_harness import tiny_model_config


def test_lognormal_lengths_are_seeded_bounded_and_long_tailed():
    a = draw_lengths(2000, kind="lognormal", mean=0.1, sigma=1.0, max_len=512, seed=1)
    assert a == draw_lengths(2000, kind="lognormal", mean=0.1, sigma=1.0, max_len=512, seed=1)
    assert min(a) >= 2 and max(a) <= 512
    median, mean = sorted(a)[len(a) // 2], sum(a) / len(a)
    assert median == pytest.approx(51, abs=6)  # exp(mu) = 0.1 * 512
    assert mean > 1.3 * median  # a long right tail: lognormal mean/median = exp(sigma^2/2) = 1.65 unclipped


def test_lengths_from_a_file(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("10 20\n30\n")
    got = draw_lengths(50, kind=str(path), mean=1, sigma=1, max_len=25, seed=0)
    assert set(got) <= {10, 20, 25}  # 30 is clipped to max_len


def test_first_fit_packing_leaves_out_what_fits_nowhere():
    assert pack_rows([5, 4, 3, 6, 2], rows=2, row_len=8) == [[0, 2], [1, 4]]


def test_packed_rows_carry_positions_document_ids_and_padding():
    docs = [torch.arange(4), torch.arange(10, 13)]  # 3 and 2 (input, target) pairs
    p = pack_documents(docs, [[0, 1]], row_len=6)
    assert p.x.tolist() == [[0, 1, 2, 10, 11, 0]]
    assert p.y.tolist() == [[1, 2, 3, 11, 12, IGNORE]]
    assert p.positions.tolist() == [[0, 1, 2, 0, 1, 0]]
    assert p.doc_ids.tolist() == [[0, 0, 0, 1, 1, -1]]
    assert p.real_tokens == 5


def test_packed_batch_gives_the_loss_and_gradients_of_the_sequences_run_one_by_one():
    from engine.model.gpt import build_model

    cfg = tiny_model_config()
    tokens = torch.randint(0, cfg.vocab, (4096,), generator=torch.Generator().manual_seed(0))
    packed = packed_global_batch(tokens, rows=4, row_len=cfg.seq_len, kind="lognormal", mean=0.25, sigma=0.8,
                                 max_len=cfg.seq_len, seed=3, step=0)
    assert (packed.doc_ids[:, 0] >= 0).all() and packed.doc_ids.unique().numel() > 8  # several per row
    model = build_model(cfg, seed=0)
    logits = model(packed.x, positions=packed.positions, doc_ids=packed.doc_ids)
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), packed.y.reshape(-1))  # ignores padding
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # the reference: every document alone, unpadded, positions 0..L-1, token-weighted mean
    total, count = torch.zeros(()), 0
    for r in range(packed.x.shape[0]):
        for d in packed.doc_ids[r].unique():
            if d < 0:
                continue
            sel = packed.doc_ids[r] == d
            x, y = packed.x[r][sel][None], packed.y[r][sel][None]
            total = total + F.cross_entropy(model(x).reshape(-1, cfg.vocab), y.reshape(-1), reduction="sum")
            count += int(sel.sum())
    ref = total / count
    ref.backward()
    assert count == packed.real_tokens
    assert abs(loss.item() - ref.item()) <= 1e-5
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_without_document_ids_packed_sequences_would_attend_across_each_other():
    """The masks matter: the same packed rows without document ids give another loss."""
    from engine.model.gpt import build_model

    cfg = tiny_model_config()
    tokens = torch.randint(0, cfg.vocab, (4096,), generator=torch.Generator().manual_seed(0))
    packed = packed_global_batch(tokens, rows=2, row_len=cfg.seq_len, kind="lognormal", mean=0.25, sigma=0.8,
                                 max_len=cfg.seq_len, seed=3, step=0)
    model = build_model(cfg, seed=0)
    masked = model(packed.x, positions=packed.positions, doc_ids=packed.doc_ids)
    unmasked = model(packed.x, positions=packed.positions)
    assert (masked - unmasked).abs().max() > 1e-3
