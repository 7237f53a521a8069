"""How fast the real data sources hand out global batches (engine/data/sources.py), next to nothing
else: tokens per second of `TokenStream.next_rows` for a token file (memmap), packed and not, and for
local jsonl tokenized while read. Files are written into a temporary folder and removed.

    python bench/data_read.py [--tokens 16000000] [--rows 32] [--seq 2048] [--repeats 5]

Prints the median and the best of interleaved repeats for each source (tokens/s), to compare with a run's
training tokens/s: the reader is not the bottleneck while its rate is far above the run's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config.schema import load_config  # noqa: E402
from engine.data.sources import build_streams  # noqa: E402


def _tokenizer(folder: Path, texts: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]"]))
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def _sources(folder: Path, n_tokens: int, seq: int) -> dict[str, list[str]]:
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 50_000, n_tokens, dtype=np.uint16)
    ids[rng.integers(0, n_tokens, n_tokens // 500)] = 0  # documents of ~500 tokens
    ids.tofile(folder / "train.bin")
    words = [f"w{i}" for i in range(2000)]
    texts = [" ".join(rng.choice(words, 400)) for _ in range(2000)]
    (folder / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = _tokenizer(folder, texts)
    base = [f"model.seq_len={seq}", "model.vocab=50000"]
    return {"tokens": base + ["data.source=tokens", f"data.path={folder / 'train.bin'}"],
            "tokens+pack": base + ["data.source=tokens", f"data.path={folder / 'train.bin'}", "data.eos_id=0",
                                   "data.pack=true"],
            "hf jsonl": base + ["data.source=hf", f"data.path={folder / 'c.jsonl'}", f"data.tokenizer={tok}",
                                "data.eos_id=1"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16_000_000)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=int, default=4)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sources = _sources(Path(tmp), a.tokens, a.seq)
        streams = {}
        for name, sets in sources.items():
            cfg = load_config(None, sets + [f"batch.global={a.rows}", f"batch.micro={a.rows}"])
            streams[name] = build_streams(cfg.data, cfg.model)[0]
        rates: dict[str, list[float]] = {name: [] for name in streams}
        names = list(streams)
        for i in range(a.repeats):  # interleaved, the order rotated: each source meets the same load and goes first
            for name in names[i % len(names):] + names[:i % len(names)]:
                stream = streams[name]
                t0 = time.perf_counter()
                for _ in range(a.batches):
                    stream.next_rows(a.rows)
                rates[name].append(a.batches * a.rows * a.seq / (time.perf_counter() - t0))
    print(f"global batch {a.rows} x {a.seq} tokens, {a.repeats} interleaved repeats of {a.batches} batches "
          "(median, and the best: on a shared machine the median carries the other processes' load)")
    for name, r in rates.items():
        print(f"{name:12s} median {statistics.median(r):14,.0f} tokens/s   best {max(r):14,.0f} tokens/s")


if __name__ == "__main__":
    main()
