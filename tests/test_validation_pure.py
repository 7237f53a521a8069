"""Validation's rules take values; only engine/config/validate_files.py reads the files a config names.

`check(cfg, files)` runs every rule on what `files` says the files hold, so a rule check needs no
file system: the token file, checkpoint and tokenizer below do not exist.
"""
from __future__ import annotations

import ast
from pathlib import Path

from engine.config.schema import load_config
from engine.config.validate import check
from engine.config.validate_files import Files, HfData, TokenFile

ROOT = Path(__file__).resolve().parent.parent
PURE_RULES = ("engine/config/validate.py", "engine/config/validate_data.py", "engine/config/validate_hf.py", "engine/config/hf_fields.py")
FILE_CALLS = {"open", "Path", "is_file", "is_dir", "exists", "stat", "memmap", "read_text", "rglob", "glob",
              "read_files", "read_hf_config", "config_errors", "weight_errors"}


def _config(*overrides: str):
    return load_config(None, ["model.vocab=1000", *overrides], check=False)


def _rules(errors) -> list[str]:
    return [f"{e.field}: {e.rule}" for e in errors]


def test_token_file_rules_take_the_sizes_and_ids_they_are_given() -> None:
    cfg = _config("data.source=tokens", "data.path=/nowhere/tokens.bin", "data.dtype=uint16")
    odd = _rules(check(cfg, Files(token_file=TokenFile(exists=True, size=7))))
    assert any("holds 7 bytes, not a multiple of 2" in r for r in odd), odd
    big_id = _rules(check(cfg, Files(token_file=TokenFile(exists=True, size=2 * 100_000, max_id=4000))))
    assert any("holds token id 4000" in r for r in big_id), big_id
    fine = _rules(check(cfg, Files(token_file=TokenFile(exists=True, size=2 * 100_000, max_id=999))))
    assert not any(r.startswith("data.path") for r in fine), fine


def test_checkpoint_lengths_and_tokenizer_rules_take_values() -> None:
    cfg = _config("train.resume_from=/nowhere/step000010", "data.lengths=/nowhere/lengths.txt")
    assert not any(r.startswith(("train.resume_from", "data.lengths")) for r in
                   _rules(check(cfg, Files(resume_is_checkpoint=True, lengths_is_file=True))))
    missing = _rules(check(cfg, Files(resume_is_checkpoint=False, lengths_is_file=False)))
    assert any(r.startswith("train.resume_from") for r in missing) and any(r.startswith("data.lengths") for r in missing)
    hf = _config("data.source=hf", "data.path=/nowhere/data.jsonl", "data.tokenizer=/nowhere/tok.json")
    found = HfData(exists=True, suffixes=(".jsonl",), first_fields=["text"], tokenizer_exists=True, tokenizer_vocab=5000)
    assert any("has 5000 tokens, more than model.vocab=1000" in r for r in _rules(check(hf, Files(hf_data=found))))


def test_the_rule_modules_open_no_file() -> None:
    """The pure rule modules call nothing that reads the file system (engine/validate.check calls the
    loader only when no `files` are given, from inside `check`)."""
    found = []
    for name in PURE_RULES:
        for node in ast.walk(ast.parse((ROOT / name).read_text())):
            if isinstance(node, ast.Call):
                called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if called in FILE_CALLS:
                    found.append(f"{name}:{node.lineno} {called}()")
    assert found == ["engine/config/validate.py:" + str(_loader_line()) + " read_files()"], found


def _loader_line() -> int:
    tree = ast.parse((ROOT / "engine/config/validate.py").read_text())
    check_fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check")
    return next(n.lineno for n in ast.walk(check_fn) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "read_files")
