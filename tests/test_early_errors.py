"""Data, weight and command-line errors a new user met inside the ranks or as tracebacks (issue 52
items 3-5): each now gets one line and exit 2 before any rank starts."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.test_reliability_input import ROOT, _cli_in_process

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
TEXTS = ["the quick brown fox jumps over the lazy dog " * 5, "hello world this is text " * 8] * 20
QUICK = ["--set", "train.steps=2", "--set", "train.eval_interval=0"]


def _tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]"]))
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def _files(tmp: Path) -> dict[str, Path]:
    import torch
    from safetensors.torch import save_file

    (tmp / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    np.arange(100_000, dtype=np.uint16).tofile(tmp / "big_ids.bin")  # ids up to 65535; model.vocab 256
    (np.arange(20) % 200).astype(np.uint16).tofile(tmp / "short.bin")
    (np.arange(100_000) % 200).astype(np.uint16).tofile(tmp / "u16.bin")
    (tmp / "badheads.json").write_text(json.dumps({**LLAMA, "hidden_size": 66}))
    weights = tmp / "weights"
    weights.mkdir()
    (weights / "config.json").write_text(json.dumps(LLAMA))
    save_file({"model.embed_tokens.weight": torch.zeros(300, 64)}, str(weights / "model.safetensors"))
    (tmp / "a_file").write_text("")
    return {"tok": _tokenizer(tmp), "jsonl": tmp / "d.jsonl", "weights": weights}


def _cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    f = _files(tmp)
    run = ["run", "examples/tiny.yaml", *QUICK]
    tokens = ["--set", "data.source=tokens", "--set"]
    hf_data = ["--set", "data.source=hf", "--set", f"data.path={f['jsonl']}", "--set", f"data.tokenizer={f['tok']}"]
    tokenize = ["tokenize", str(f["jsonl"]), "--tokenizer", str(f["tok"]), "-o"]
    return {
        "token id >= vocab": ([*run, *tokens, f"data.path={tmp / 'big_ids.bin'}"],
                              "holds token id 65535 (data.dtype=uint16), not below model.vocab=256"),
        "token file shorter than a batch": ([*run, *tokens, f"data.path={tmp / 'short.bin'}"],
                                            "holds 20 tokens, too few for a training and a validation split"),
        "uint32 declared on a uint16 file": ([*run, *tokens, f"data.path={tmp / 'u16.bin'}", "--set", "data.dtype=uint32",
                                              "--set", "model.vocab=70000"], "is it data.dtype=uint16?"),
        "missing text_field": ([*run, *hf_data, "--set", "data.text_field=body"],
                               "data.text_field='body': is not a field of the records"),
        "hidden size not divisible by heads": (["run", "examples/llama.yaml", *QUICK, "--set",
                                                f"model.hf={tmp / 'badheads.json'}"],
                                               "The hidden size (66) is not a multiple of the number of attention heads"),
        "safetensors that do not match": ([*run, "--set", f"model.hf={f['weights'] / 'config.json'}", "--set",
                                           f"model.hf_weights={f['weights']}"],
                                          "model.embed_tokens.weight is [300, 64] in the checkpoint, [256, 64] in the model"),
        "tokenize --eos-id beyond the vocabulary": ([*tokenize, str(tmp / "eos.bin"), "--eos-id", "70000"],
                                                    "--eos-id=70000: must be a token id of the tokenizer"),
        "tokenize --text-field missing": ([*tokenize, str(tmp / "field.bin"), "--text-field", "body"],
                                          "--text-field='body': is not a field of the records"),
        "tune --storage mysql://": (["tune", "examples/space.yaml", "--base", "examples/tiny.yaml", "--trials", "1",
                                     "--storage", "mysql://x@localhost/db"], "its Python driver 'MySQLdb' is not installed"),
        "--runs with no server": (["--runs", "postgresql://u@127.0.0.1:9/x", "runs"], "Connection refused"),
        "--home is a file": (["--home", str(tmp / "a_file"), "runs"], "is a file; the workbench home is a folder"),
        "--set model.d_model beside model.hf": (["run", "examples/llama.yaml", "--set", "model.d_model=128"],
                                                "model.d_model=128: is read from model.hf (hidden_size=64)"),
    }


@pytest.mark.slow
def test_data_weight_and_cli_errors_are_one_line_and_exit_2_before_any_rank(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    monkeypatch.chdir(ROOT)
    for key, value in {"WORKBENCH_HOME": str(home), "OMP_NUM_THREADS": "1", "COLUMNS": "80"}.items():
        monkeypatch.setenv(key, value)
    failures = []
    for name, (args, expected) in _cases(tmp_path).items():
        out = _cli_in_process(args, monkeypatch, capsys)
        os.environ.pop("WORKBENCH_RUNS", None)  # the --runs case set it in this process
        lines = out.stderr.strip().splitlines()
        if not (out.returncode == 2 and len(lines) == 1 and expected in lines[0] and "Traceback" not in out.stdout):
            failures.append((name, out.returncode, out.stderr[-600:]))
    assert failures == []
    assert not list((home / "runs").glob("*")) if (home / "runs").exists() else True  # no run was started
    assert not (tmp_path / "eos.bin").exists() and not (tmp_path / "field.bin").exists()  # no 0-byte output left


def test_a_failed_tokenize_leaves_no_partial_file(tmp_path):
    from engine.data.sources import write_token_file

    f = _files(tmp_path)
    with pytest.raises(KeyError):
        write_token_file(str(f["jsonl"]), str(f["tok"]), str(tmp_path / "out.bin"), text_field="body")
    assert list(tmp_path.glob("out.bin*")) == []


def _start_lonely_node(tmp_path: Path, *extra: str, ignore_sigint: bool = False) -> subprocess.Popen:
    from tests.ports import server_port

    env = {**os.environ, "WORKBENCH_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1", "COLUMNS": "400"}
    pre = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
    return subprocess.Popen([sys.executable, "-m", "workbench.cli", "run", "examples/tiny.yaml", "--nnodes", "2",
                             "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{server_port()}", *QUICK, *extra],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=pre)


@pytest.mark.slow
@pytest.mark.xdist_group("launch")
def test_a_node_whose_peers_never_come_says_so_and_gives_up(tmp_path):
    """Before: `--nnodes 2` with no peer sat at '0/2 starting ranks' for 10 minutes (torchrun's join
    timeout), then printed torchrun's RendezvousTimeoutError traceback."""
    proc = _start_lonely_node(tmp_path, "--rdzv-timeout", "10")
    out, err = proc.communicate(timeout=300)
    assert "waiting for every node at the rendezvous" in out
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, err[-2000:]
    assert "node 0 of 2 waited 10 s at the rendezvous" in lines[0] and "--node-rank I" in lines[0], lines


@pytest.mark.slow
@pytest.mark.xdist_group("launch")
def test_ctrl_c_stops_a_launcher_started_with_sigint_ignored(tmp_path):
    """A shell's background job starts with SIGINT ignored: the launcher ignored Ctrl-C (kill -INT) and
    waited out the rendezvous instead."""
    proc = _start_lonely_node(tmp_path, ignore_sigint=True)
    deadline = time.time() + 120
    while time.time() < deadline and not list((tmp_path / "home" / "runs").glob("*/config.json")):
        time.sleep(0.5)  # the run is registered: the launcher is waiting for its peer
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "interrupted" in err, err[-2000:]
