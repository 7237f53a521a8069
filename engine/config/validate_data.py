"""The rules of the real data sources (engine/data/sources.py), checked before any process starts:
the file exists and is whole, the tokenizer exists and fits the model's vocabulary, the source does not
meet a feature it cannot serve. Pure: the rules take what engine/config/validate_files.py read from the files
(`Files`: sizes, sampled ids, record fields, vocabulary sizes) and open nothing.

`RunConfig` (engine/config/schema.py) and `Files` are named in annotations only: config imports validation,
so validation does not import config (no import circle)."""
from __future__ import annotations

from collections.abc import Iterator

from engine.errors import ConfigError

DATA_SOURCES = ("text", "synthetic", "files", "tokens", "megatron", "hf")
STREAM_SOURCES = ("tokens", "megatron", "hf")  # engine/data/sources.py: read in order, position checkpointed
TOKEN_DTYPE_BYTES = {"uint16": 2, "uint32": 4}  # data.dtype of a token file
HF_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".txt": "text"}


def stream_rules(cfg: RunConfig, files: Files) -> Iterator[ConfigError]:
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
        yield from _token_file_rules(cfg, files.token_file)
    elif d.source == "megatron":
        for missing in files.megatron_missing:
            yield ConfigError("data.path", d.path, f"{missing} does not exist (a Megatron indexed "
                              "dataset is prefix.bin + prefix.idx)")
    else:
        yield from _hf_data_rules(cfg, files.hf_data)


def _token_file_rules(cfg: RunConfig, file: TokenFile) -> Iterator[ConfigError]:
    d = cfg.data
    if d.dtype not in TOKEN_DTYPE_BYTES:
        yield ConfigError("data.dtype", d.dtype, f"must be one of {', '.join(TOKEN_DTYPE_BYTES)}")
    if not file.exists:
        yield ConfigError("data.path", d.path, "no such token file")
    elif d.dtype in TOKEN_DTYPE_BYTES and file.size % TOKEN_DTYPE_BYTES[d.dtype]:
        yield ConfigError("data.path", d.path, f"holds {file.size} bytes, not a multiple of "
                          f"{TOKEN_DTYPE_BYTES[d.dtype]} (data.dtype={d.dtype}); is it a token file of another dtype?")
    elif d.dtype in TOKEN_DTYPE_BYTES:
        yield from token_count_rules(d.path or "", file.size // TOKEN_DTYPE_BYTES[d.dtype],
                                     seq_len=cfg.model.seq_len, val_fraction=d.val_fraction)
        yield from token_id_rules(d.path or "", d.dtype, file.max_id, vocab=cfg.model.vocab,
                                  max_as_uint16=file.max_as_uint16)


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


def hf_files_problem(path: str, exists: bool, suffixes: tuple[str, ...]) -> ConfigError | None:
    """What is wrong with a `data.source=hf` path given its data files' suffixes (None: nothing)."""
    if not exists:
        return ConfigError("data.path", path, "does not exist")
    if not suffixes or suffixes[0] not in HF_SUFFIXES:
        return ConfigError("data.path", path, f"must be (or hold) {' / '.join(HF_SUFFIXES)} files")
    if len({HF_SUFFIXES[s] for s in suffixes}) > 1:
        return ConfigError("data.path", path, "holds files of several formats; give one format per path")
    return None


def _hf_data_rules(cfg: RunConfig, found: HfData) -> Iterator[ConfigError]:
    d = cfg.data
    problem = hf_files_problem(d.path or "", found.exists, found.suffixes)
    if problem is not None:
        yield problem
    else:
        yield from text_field_rules(d.path or "", d.text_field, found.first_fields)
    if not d.tokenizer or not found.tokenizer_exists:
        yield ConfigError("data.tokenizer", d.tokenizer, "must name a tokenizer.json or a tokenizer folder "
                          "when data.source=hf")
        return
    vocab = found.tokenizer_vocab
    if vocab is not None and vocab > cfg.model.vocab:
        yield ConfigError("data.tokenizer", d.tokenizer, f"has {vocab} tokens, more than model.vocab="
                          f"{cfg.model.vocab}; raise model.vocab to at least {vocab}")


def text_field_rules(path: str, field: str, fields: list[str] | None) -> Iterator[ConfigError]:
    if fields is not None and field not in fields:
        yield ConfigError("data.text_field", field, f"is not a field of the records in {path} (its first record "
                          f"has {', '.join(fields) or 'no fields'})")
