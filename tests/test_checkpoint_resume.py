"""Resuming from a checkpoint that does not fit the config, or is damaged, stops in the launcher
with one line (the field, the tensor, both shapes), exit 2, before any rank starts."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.config.schema import load_config
from engine.errors import ConfigError

TINY = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=32", "model.vocab=256",
        "train.steps=2", "batch.global=8", "profile.enabled=false", "train.timeout_s=60"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A one-process checkpoint of the tiny model at step 2."""
    from engine.train.trainer import Trainer

    folder = tmp_path_factory.mktemp("ckpt")
    cfg = load_config(None, TINY + ["train.checkpoint_interval=2", f"train.checkpoint_dir={folder}"])
    list(Trainer(cfg, device=torch.device("cpu")).run())
    return folder / "step000002"


def _launch(tmp_path: Path, ckpt: Path, *extra: str):
    from engine.launch.local import launch

    cfg = load_config(None, TINY + ["train.steps=3", f"train.resume_from={ckpt}", *extra])
    return launch(cfg, home=tmp_path / "home", timeout_s=120)


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(ckpt, tmp_path / "step000002"))


def test_resume_into_another_d_model_names_the_tensor_and_both_shapes(tmp_path, ckpt):
    # old code: "rank 0 failed: CheckpointException ranks:dict_keys([0])" with the size mismatch 80 lines down
    with pytest.raises(ConfigError, match=r"train.resume_from=.*step000002.*: model.tok_emb.weight is \[256, 32\] "
                                          r"in the checkpoint but \[256, 64\] in this model"):
        _launch(tmp_path, ckpt, "model.d_model=64")
    assert not (tmp_path / "home" / "runs").exists() or not any((tmp_path / "home" / "runs").iterdir())


def test_resume_into_more_or_fewer_layers_names_the_tensor(tmp_path, ckpt):
    with pytest.raises(ConfigError, match=r"the checkpoint has no model.layers.2.ln1.weight \[32\]"):
        _launch(tmp_path, ckpt, "model.layers=3")
    with pytest.raises(ConfigError, match=r"the checkpoint holds model.layers.1.ln1.weight \[32\], which this "
                                          r"model lacks \(model.layers=1\)"):
        _launch(tmp_path, ckpt, "model.layers=1")


def test_a_corrupt_metadata_file_is_one_line(tmp_path, ckpt):
    # old code: "ValueError: invalid literal for int() with base 10: 'arbage'" from a rank
    folder = _copy(ckpt, tmp_path)
    data = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(data[:40] + b"garbage" * 20 + data[180:])
    with pytest.raises(ConfigError, match=r"its .metadata cannot be read \(.*\); the checkpoint is damaged"):
        _launch(tmp_path, folder)


def test_truncated_or_overwritten_shards_are_one_line(tmp_path, ckpt):
    # old code: a rank's EOFError
    folder = _copy(ckpt, tmp_path)
    shard = folder / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=r"shard __0_0.distcp has \d+ bytes, \d+ needed .*incomplete"):
        _launch(tmp_path, folder)
    shard.write_bytes(b"\0" * len(data))
    with pytest.raises(ConfigError, match=r"shard __0_0.distcp is damaged at byte 0"):
        _launch(tmp_path, folder)


def test_the_cli_prints_one_line_and_exits_2(tmp_path, ckpt):
    env = {**os.environ, "WORKBENCH_HOME": str(tmp_path)}
    sets = [a for s in TINY + [f"train.resume_from={ckpt}", "model.d_model=64"] for a in ("--set", s)]
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "run", *sets], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "model.tok_emb.weight is [256, 32] in the checkpoint but [256, 64]" in lines[0], lines


def test_a_matching_checkpoint_passes(ckpt):
    from engine.train.checkpoint import check_resume

    check_resume(load_config(None, TINY + [f"train.resume_from={ckpt}", "parallel.dp=2", "batch.micro=4"]))


def test_a_co2_checkpoint_of_the_same_model_passes(tmp_path):
    # CO2 saves one replica per dp rank (dp0.model..., dp1.model...). The first version of this check
    # looked for model.* only and refused every CO2 resume: "the checkpoint has no model.tok_emb.weight [256, 32]"
    from types import SimpleNamespace

    from engine.train.checkpoint import _check_model_shapes
    from engine.model.gpt import GPT

    cfg = load_config(None, TINY)
    with torch.device("meta"):
        names = {k: SimpleNamespace(size=torch.Size(v.shape)) for k, v in GPT(cfg.model).state_dict().items()}
    saved = {f"dp{d}.model.{k}": v for d in range(2) for k, v in names.items()}
    _check_model_shapes(cfg, tmp_path, saved)
    saved["dp0.model.tok_emb.weight"] = SimpleNamespace(size=torch.Size([256, 64]))
    with pytest.raises(ConfigError, match=r"model.tok_emb.weight is \[256, 64\] in the checkpoint but \[256, 32\]"):
        _check_model_shapes(cfg, tmp_path, saved)
