"""Real data sources (engine/data/sources.py): a nanoGPT token file, a Megatron indexed dataset
written by megatron-core's own builder, local jsonl/parquet/text through `datasets` with a tiny
tokenizer trained here; in order, the same global batch whatever the dp degree, document masks,
and a resumed run reading the batch an uninterrupted one reads."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from parallel_harness import run_ranks

from engine.config.schema import load_config
from engine.data.sources import build_streams, rank_rows
from engine.errors import ConfigError, ConfigErrors
from engine.train.trainer import Trainer

SEQ = 16
TINY = ["model.layers=2", "model.d_model=32", "model.heads=4", f"model.seq_len={SEQ}", "model.vocab=512",
        "train.lr=0.003", "train.warmup_steps=0", "train.schedule=constant", "batch.global=4", "batch.micro=2",
        "profile.enabled=false", "train.timeout_s=60"]
TEXTS = ["the cat sat on the mat", "a dog ran in the park and the cat ran too", "hello world",
         "pack these documents into rows of tokens", "the end of the corpus is near", "one more line of text",
         "tokens are ids and ids are tokens", "short", "a longer sentence about nothing in particular at all"]


def token_file(folder: Path, n: int = 4000, dtype: type = np.uint16, vocab: int = 512) -> Path:
    """A nanoGPT-style train.bin: ids 0..vocab-1 in a known pattern (id 0 ends each document)."""
    ids = (np.arange(n) * 7919 + np.arange(n) // 13) % vocab
    ids[::37] = 0
    path = folder / "train.bin"
    ids.astype(dtype).tofile(path)
    return path


def tiny_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer trained on TEXTS with `tokenizers` (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]"]))
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def _cfg(overrides: list[str]):
    return load_config(None, TINY + overrides)


def test_token_file_rows_are_consecutive_windows_of_the_file(tmp_path):
    path = token_file(tmp_path)
    ids = np.fromfile(path, dtype=np.uint16).astype(np.int64)
    train, _ = build_streams(_cfg(["data.source=tokens", f"data.path={path}"]).data,
                             _cfg(["data.source=tokens", f"data.path={path}"]).model)
    first, second = train.next_rows(4), train.next_rows(4)
    # row r of step s starts at token (4s + r) * SEQ; its targets are the next tokens
    for s, batch in enumerate((first, second)):
        for r in range(4):
            at = (4 * s + r) * SEQ
            assert batch.x[r].tolist() == ids[at:at + SEQ].tolist()
            assert batch.y[r].tolist() == ids[at + 1:at + SEQ + 1].tolist()
    assert train.state_dict() == {"doc": 0, "offset": 8 * SEQ, "epoch": 0}
    assert isinstance(train._document(0), np.memmap)  # the file stays on disk: only read slices are converted


def test_uint32_ids_beyond_uint16_are_read(tmp_path):
    path = token_file(tmp_path, dtype=np.uint32, vocab=100_000)
    cfg = _cfg(["data.source=tokens", f"data.path={path}", "data.dtype=uint32", "model.vocab=100000"])
    batch = build_streams(cfg.data, cfg.model)[0].next_rows(4)
    assert int(batch.x.max()) > 65535
    assert batch.x[0].tolist() == np.fromfile(path, dtype=np.uint32)[:SEQ].tolist()


def test_dp_ranks_take_contiguous_rows_of_one_global_batch(tmp_path):
    cfg = _cfg(["data.source=tokens", f"data.path={token_file(tmp_path)}"])
    whole = build_streams(cfg.data, cfg.model)[0].next_rows(4)
    halves = [rank_rows(build_streams(cfg.data, cfg.model)[0].next_rows(4), dp=2, dp_rank=r) for r in (0, 1)]
    assert torch.equal(torch.cat([h.x for h in halves]), whole.x)
    assert torch.equal(torch.cat([h.y for h in halves]), whole.y)


def test_megatron_indexed_dataset_written_by_megatron_core_reads_back_in_order(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    docs = [np.arange(1 + 5 * i, 1 + 5 * i + 9 + 3 * i) % 500 for i in range(12)]
    builder = IndexedDatasetBuilder(str(tmp_path / "corpus.bin"), dtype=np.uint16)
    for d in docs:
        builder.add_document(torch.tensor(d), [len(d)])
    builder.finalize(str(tmp_path / "corpus.idx"))
    cfg = _cfg(["data.source=megatron", f"data.path={tmp_path / 'corpus'}", "data.pack=true"])
    train, val = build_streams(cfg.data, cfg.model)
    stream = np.concatenate(docs[:11])  # val_fraction 0.05 of 12 documents: the last one
    batch = train.next_rows(2)
    assert batch.x.flatten().tolist() == stream[:2 * SEQ].tolist()
    # positions restart where each document starts; document ids count the documents in a row
    starts = np.cumsum([0] + [len(d) for d in docs[:11]])
    for r in range(2):
        for t in range(SEQ):
            g = r * SEQ + t
            doc = int(np.searchsorted(starts, g, side="right") - 1)
            assert int(batch.positions[r, t]) == (g - max(starts[doc], r * SEQ))
    assert val.docs.doc(0).tolist() == docs[11].tolist()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "txt"])
def test_local_files_through_datasets_are_tokenized_in_order(tmp_path, fmt):
    from tokenizers import Tokenizer

    tok_path = tiny_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(tok_path))
    path = tmp_path / f"corpus.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    elif fmt == "txt":
        path.write_text("\n".join(TEXTS) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": TEXTS}), path)
    eos = tok.token_to_id("[EOS]")
    cfg = _cfg(["data.source=hf", f"data.path={path}", f"data.tokenizer={tok_path}", f"data.eos_id={eos}",
                "model.vocab=64"])
    train, _ = build_streams(cfg.data, cfg.model)
    batch = train.next_rows(2)
    expected = [i for t in TEXTS[:8] for i in tok.encode(t).ids + [eos]]
    assert batch.x.flatten().tolist() == expected[:2 * SEQ]
    assert int(batch.doc_ids[0, -1]) > 0  # several documents in the first row


LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": False}


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_packed_rows_attend_within_each_document(tmp_path, arch):
    """A row holding two documents gives each the logits it gets alone (document mask, positions),
    for the built-in GPT and a Hugging Face Llama (model.hf)."""
    from engine.model.gpt import build_model

    hf = [f"model.hf={json.dumps(LLAMA)}"] if arch == "llama" else []
    cfg = _cfg(["data.source=tokens", f"data.path={token_file(tmp_path)}", "data.eos_id=0", "data.pack=true", *hf])
    if arch == "llama":
        from engine.model.hf import build_hf_model

        model = build_hf_model(cfg.model, seed=0).eval()
        assert type(model).__name__ == "HFCausalLM"
    else:
        model = build_model(cfg.model, seed=0).eval()
    x = torch.randint(1, 500, (1, SEQ))
    x[0, 5] = 0  # document 1 ends with the separator; document 2 starts at token 6
    from engine.data.sources import _positions

    first = torch.zeros(1, SEQ, dtype=torch.bool)
    first[0, 0] = first[0, 6] = True
    packed = model(x, positions=_positions(first), doc_ids=torch.cumsum(first.long(), 1) - 1)
    alone = model(x[:, 6:])
    assert torch.allclose(packed[0, 6:], alone[0], atol=1e-5)
    assert not torch.allclose(model(x)[0, 6:], alone[0], atol=1e-3)  # without the mask they differ
    rows = build_streams(cfg.data, cfg.model)[0].next_rows(4)
    ends = (rows.x[:, :-1] == 0)
    assert torch.equal(rows.positions[:, 1:][ends], torch.zeros(int(ends.sum()), dtype=torch.long))


def _run(overrides: list[str]) -> tuple[list[float], list[torch.Tensor]]:
    trainer = Trainer(_cfg(overrides), device=torch.device("cpu"))
    seen: list[torch.Tensor] = []
    take = trainer._local_batch

    def record(step):
        x, y = take(step)
        seen.append(x.clone())
        return x, y

    trainer._local_batch = record
    return [m.loss for m in trainer.run()], seen


def megatron_dataset(folder: Path, n: int = 40) -> Path:
    """An indexed dataset written by megatron-core's own builder: n documents of 9.. ids."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(folder / "corpus.bin"), dtype=np.uint16)
    for i in range(n):
        builder.add_document(torch.tensor((np.arange(9 + 3 * (i % 7)) * 31 + i) % 500), [9 + 3 * (i % 7)])
    builder.finalize(str(folder / "corpus.idx"))
    return folder / "corpus"


@pytest.mark.parametrize("source", ["tokens", "megatron", "hf"])
def test_a_resumed_run_reads_the_next_batch_of_the_uninterrupted_one(tmp_path, source):
    if source == "tokens":
        data = ["data.source=tokens", f"data.path={token_file(tmp_path)}", "data.eos_id=0", "data.pack=true"]
    elif source == "megatron":
        data = ["data.source=megatron", f"data.path={megatron_dataset(tmp_path)}", "data.pack=true"]
    else:
        path = tmp_path / "c.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 3))
        data = ["data.source=hf", f"data.path={path}", f"data.tokenizer={tiny_tokenizer(tmp_path)}", "data.eos_id=1"]
    full, full_x = _run(data + ["train.steps=4", "train.checkpoint_interval=2", f"train.checkpoint_dir={tmp_path}"])
    resumed, resumed_x = _run(data + ["train.steps=4", f"train.resume_from={tmp_path / 'step000002'}"])
    assert len(resumed_x) == 2
    for a, b in zip(full_x[2:], resumed_x):
        assert torch.equal(a, b)
    assert resumed == pytest.approx(full[2:], abs=1e-6)


def _dp2(rank: int, world: int, overrides: list[str]) -> list[float]:
    return [m.loss for m in Trainer(_cfg(overrides + ["parallel.dp=2"]), device=torch.device("cpu")).run()]


@pytest.mark.slow
@pytest.mark.parametrize("source", ["tokens", "hf"])
def test_dp2_follows_one_process(tmp_path, source):
    """Both ranks read the one global batch (the hf source: both open the same datasets cache at once)."""
    if source == "tokens":
        data = ["data.source=tokens", f"data.path={token_file(tmp_path)}", "data.eos_id=0", "data.pack=true"]
    else:
        path = tmp_path / "c.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 3))
        data = ["data.source=hf", f"data.path={path}", f"data.tokenizer={tiny_tokenizer(tmp_path)}", "data.eos_id=1",
                "data.pack=true"]
    data.append("train.steps=3")
    two = run_ranks(2, _dp2, data, timeout=120)[0]  # first: the ranks build the datasets cache together
    one = _run(data)[0]
    assert two == pytest.approx(one, abs=1e-4)


@pytest.mark.parametrize("overrides, match", [
    (["data.source=tokens", "data.path=/nonexistent/train.bin"], r"data.path.*no such token file"),
    (["data.source=tokens", "data.path=@odd"], r"not a multiple of 2 \(data.dtype=uint16\)"),
    (["data.source=tokens", "data.path=@bin", "data.dtype=int8"], r"data.dtype.*must be one of uint16, uint32"),
    (["data.source=megatron", "data.path=/nonexistent/corpus"], r"corpus.bin does not exist"),
    (["data.source=hf", "data.path=@jsonl"], r"data.tokenizer.*must name a tokenizer"),
    (["data.source=hf", "data.path=@jsonl", "data.tokenizer=@tok", "model.vocab=8"], r"has \d+ tokens, more than "
     r"model.vocab=8"),
    (["data.source=hf", "data.path=/nonexistent.jsonl", "data.tokenizer=@tok"], r"data.path.*does not exist"),
    (["data.source=tokens", "data.path=@bin", "data.pack=true", "parallel.pp=2", "model.layers=2"],
     r"data.pack.*parallel.pp=1"),
    (["data.pack=true"], r"data.pack.*needs data.source one of tokens, megatron, hf"),
    (["data.source=tokens", "data.path=@bin", "data.eos_id=600"], r"data.eos_id.*must be < model.vocab=512"),
])
def test_bad_data_configs_are_refused_in_one_line(tmp_path, overrides, match):
    files = {"@odd": tmp_path / "odd.bin", "@bin": token_file(tmp_path), "@jsonl": tmp_path / "c.jsonl",
             "@tok": tiny_tokenizer(tmp_path)}
    files["@odd"].write_bytes(b"\x00" * 1001)
    files["@jsonl"].write_text(json.dumps({"text": "x"}) + "\n")
    overrides = [o.split("=")[0] + "=" + str(files.get(o.split("=")[1], o.split("=")[1])) for o in overrides]
    with pytest.raises((ConfigError, ConfigErrors), match=match):
        _cfg(overrides)


def test_the_stream_wraps_to_the_first_document_and_counts_the_epoch(tmp_path):
    cfg = _cfg(["data.source=tokens", f"data.path={token_file(tmp_path, n=400)}", "data.val_fraction=0.2"])
    train, val = build_streams(cfg.data, cfg.model)
    ids = np.fromfile(tmp_path / "train.bin", dtype=np.uint16).astype(np.int64)[:320]  # the train split
    for _ in range(5):  # 5 x 64 = 320 tokens: one pass exactly
        train.next_rows(4)
    assert train.state_dict() == {"doc": 0, "offset": 0, "epoch": 1}
    again = train.next_rows(4)
    assert again.x[0].tolist() == ids[:SEQ].tolist()
    assert val.next_rows(1).x[0].tolist() == np.fromfile(tmp_path / "train.bin", dtype=np.uint16)[320:336].tolist()


def test_documents_that_are_all_empty_are_named_not_looped_over():
    from engine.data.sources import Documents, TokenStream

    stream = TokenStream(Documents(lambda i: np.zeros(0, dtype=np.int64), 0, 3), seq_len=4, vocab=8)
    with pytest.raises(ValueError, match="every document is empty"):
        stream.next_rows(1)
