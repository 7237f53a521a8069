"""The ways in (docs/reliability.md, "Trust boundaries"): every place outside data enters names the test
that checks it, and the checks no other file holds: study names, run names."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
BAD_NAMES = ["../x", "a/b", "", "x" * 65, "..", ".", "-x", "a b", "x\ny"]
# the ways in the table must cover (issue 48): a word of each row's first cell
WAYS_IN = ["config file", "model.entry", "checkpoint", "token file", "tokenizer", "dataset", "model.hf",
           "study database", "run store", "telemetry port", "dashboard"]


def _boundary_rows() -> list[list[str]]:
    text = (ROOT / "docs" / "reliability.md").read_text()
    section = text.split("\n## Trust boundaries\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # past the header and |---|
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in rows]


def _defined(node_id: str) -> bool:
    """Whether `tests/x.py::name` (or `::Class::name`) names a test function defined in that file."""
    import ast

    path, *names = node_id.split("::")
    if not (ROOT / path).is_file() or not names:
        return False
    scope: list[ast.stmt] = ast.parse((ROOT / path).read_text()).body
    for name in names:
        found = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name]
        if not found:
            return False
        scope = found[0].body
    return names[-1].startswith("test_")


def test_the_trust_boundary_table_covers_every_way_in_and_names_tests_that_exist():
    rows = _boundary_rows()
    assert all(len(row) == 4 and all(row) for row in rows), rows
    ways = [row[0] for row in rows]
    assert [w for w in WAYS_IN if not any(w in way for way in ways)] == []
    for way, _, _, tests in rows:
        named = re.findall(r"`(tests/[^`]+)`", tests)
        assert named, f"{way}: names no test"
        assert [n for n in named if not _defined(n)] == [], way


def test_the_table_check_would_catch_a_missing_test():
    assert _defined("tests/test_trust_boundaries.py::test_the_dashboard_renders_no_raw_html")
    assert not _defined("tests/test_trust_boundaries.py::test_that_does_not_exist")
    assert not _defined("tests/no_such_file.py::test_x")
    assert not _defined("tests/test_trust_boundaries.py::_defined")  # a helper, not a test


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_a_study_name_that_is_not_a_run_name_is_refused_before_it_becomes_a_path(tmp_path, name):
    """A study's name becomes its folder (<home>/studies/<name>) and part of each trial's run id. Old
    code: `../x` created the study, and the dashboard's workers wrote <home>/x/space.yaml."""
    from tuning import control
    from tuning.study import load_study

    with pytest.raises(ConfigError) as raised:
        load_study(name, home=tmp_path)
    assert str(raised.value).startswith("study=") and "\n" not in str(raised.value).replace(repr(name), "")
    assert "must be 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit" in str(raised.value)
    with pytest.raises(ConfigError):
        control.study_dir(name, home=tmp_path / "home")
    assert list(tmp_path.iterdir()) == []  # no study database, no folder


def test_a_good_study_name_still_makes_its_folder_and_study(tmp_path):
    from tuning import control
    from tuning.study import load_study

    name = "a" * 63 + "b"
    assert load_study(name, home=tmp_path).study_name == name
    assert control.study_dir("study-1.x_y", home=tmp_path) == tmp_path / "studies" / "study-1.x_y"


@pytest.mark.parametrize("name", ["../x", "x" * 65])
def test_tune_refuses_a_bad_study_name_in_one_line_before_any_study_exists(tmp_path, name):
    space = tmp_path / "space.yaml"
    space.write_text("params:\n  batch.micro: {choices: [2, 4]}\n")
    env = {**os.environ, "WORKBENCH_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1", "COLUMNS": "400"}
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "tune", str(space), "--study", name, "--trials", "1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stderr.strip().splitlines() == [f"error: --study={name!r}: must be 1-64 letters, digits, '_', '.' "
                                               "or '-', starting with a letter or digit"]
    assert not (tmp_path / "home").exists() and not (tmp_path / "x").exists()


def test_the_tune_page_refuses_a_bad_study_name_and_starts_nothing(tmp_path, monkeypatch):
    from tests.test_app import render

    at = render(tmp_path, "tune", monkeypatch)
    at.text_input(key="new_study_name").set_value("../x").run()
    assert not at.exception
    assert [e.value for e in at.error] == ["study='../x': must be 1-64 letters, digits, '_', '.' or '-', starting "
                                           "with a letter or digit"]
    start = next(b for b in at.button if b.label == "Start / continue study")
    assert start.disabled
    assert not (tmp_path / "studies").exists() and not (tmp_path / "x").exists()


@pytest.mark.parametrize("name", ["-x", "..", ".hidden"])
def test_a_run_name_starts_with_a_letter_or_digit(name):
    """The rule study names share: a run named "-x" reads as an option on a command line."""
    from engine.config.schema import load_config
    from engine.config.validate import validate

    with pytest.raises(ConfigError, match=r"^name='.*': must be 1-64 letters, digits, '_', '.' or '-', starting"):
        validate(load_config(None, [f"name={name}"]))


# ---------------------------------------------------------------- checkpoint items

TINY_CKPT = ["model.layers=1", "model.d_model=16", "model.heads=2", "model.seq_len=8", "model.vocab=256",
             "batch.global=2", "batch.micro=2", "profile.enabled=false"]

class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> Path:
    """A one-process checkpoint of a tiny GPT at step 1."""
    import torch

    from engine.config.schema import load_config
    from engine.train.trainer import Trainer

    folder = tmp_path_factory.mktemp("ckpt")
    cfg = load_config(None, [*TINY_CKPT, "train.steps=1", "train.checkpoint_interval=1",
                             f"train.checkpoint_dir={folder}"])
    list(Trainer(cfg, device=torch.device("cpu")).run())
    return folder / "step000001"


def _stored_as_pickled_bytes(ckpt: Path, folder: Path, key: str, marker: Path) -> Path:
    """A copy of `ckpt` whose .metadata says `key` is a pickled object (BytesStorageMetadata, only allowed
    classes), stored as torch.save of an object whose unpickling runs `touch marker`."""
    import io
    import pickle
    import shutil

    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from engine.train.checkpoint import _reader

    copy = Path(shutil.copytree(ckpt, folder / ckpt.name))
    metadata = _reader(copy).read_metadata()
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data.pop(index)
    blob = io.BytesIO()
    torch.save(_Exploit(marker), blob)
    shard = copy / info.relative_path
    info.offset, info.length = shard.stat().st_size, len(blob.getvalue())
    with open(shard, "ab") as f:
        f.write(blob.getvalue())
    metadata.storage_data[MetadataIndex(key)] = info
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_meta = None
    (copy / ".metadata").write_bytes(pickle.dumps(metadata))
    return copy


@pytest.mark.parametrize("key", ["model.tok_emb.weight", "rng.rank0.cpu"])
def test_a_checkpoint_item_stored_as_pickled_bytes_runs_nothing(tmp_path, small_checkpoint, key):
    """DCP reads an item its .metadata calls bytes with torch.load(weights_only=False): a crafted .metadata
    of allowed classes only ran code when a rank resumed (old code: `touch` ran, and training went on).
    The engine's reader refuses every pickled-bytes item: it never saves one that it reads back."""
    import torch
    import torch.distributed.checkpoint as dcp

    from engine.train.checkpoint import _reader, check_resume
    from engine.config.schema import load_config
    from engine.train.trainer import Trainer

    marker = tmp_path / "pwned"
    copy = _stored_as_pickled_bytes(small_checkpoint, tmp_path, key, marker)
    cfg = load_config(None, [*TINY_CKPT, "train.steps=2", f"train.resume_from={copy}"])
    with pytest.raises(Exception) as raised:  # noqa: PT011 (the old code raised nothing: it ran the command)
        list(Trainer(cfg, device=torch.device("cpu")).run())
    assert not marker.exists(), f"the crafted item ran `touch` ({raised.value!r})"
    assert f"{copy / '.metadata'}: stores {key} as pickled bytes" in str(raised.value)
    with pytest.raises(ConfigError) as raised:  # the launcher's check, before any rank starts
        check_resume(cfg)
    assert str(raised.value).startswith(f"train.resume_from={str(copy)!r}: its .metadata stores {key} as pickled "
                                        "bytes") and "\n" not in str(raised.value)
    with pytest.raises(BaseException, match=f"stores {key} as pickled bytes"):  # DCP's CheckpointException
        dcp.load({key: torch.empty(0)}, storage_reader=_reader(copy), no_dist=True)  # the reader's own guard
    assert not marker.exists()


_REFUSED_SHARD = "outside the checkpoint folder (a shard must lie inside it: no '..', no absolute path, no symlink out)"


def _shard_elsewhere(ckpt: Path, folder: Path, key: str, shard: str) -> Path:
    """A copy of `ckpt` at folder/ckpts/ whose .metadata reads `key` from `shard`; folder/outside.distcp is
    a shard torch's DCP wrote, holding `key` as 666, 667, 668, ..."""
    import dataclasses
    import pickle
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp

    from engine.train.checkpoint import _reader

    copy = Path(shutil.copytree(ckpt, folder / "ckpts" / ckpt.name))
    metadata = _reader(copy).read_metadata()
    saved = metadata.state_dict_metadata[key]
    values = 666 + torch.arange(saved.size.numel(), dtype=saved.properties.dtype).reshape(saved.size)
    dcp.save({key: values}, checkpoint_id=str(folder / "other"), no_dist=True)
    other = next(info for index, info in _reader(folder / "other").read_metadata().storage_data.items()
                 if index.fqn == key)
    (folder / "other" / other.relative_path).rename(folder / "outside.distcp")
    for index in [i for i in metadata.storage_data if i.fqn == key]:
        metadata.storage_data[index] = dataclasses.replace(other, relative_path=shard)
    metadata.storage_meta = None
    (copy / ".metadata").write_bytes(pickle.dumps(metadata))
    return copy


@pytest.mark.parametrize("where", ["../../outside.distcp", "absolute", "symlink"])
def test_a_shard_outside_the_checkpoint_folder_is_refused_before_any_rank_reads_it(tmp_path, small_checkpoint,
                                                                                     where):
    """A .metadata rewritten so a tensor's shard is ../../outside.distcp, an absolute path, or a symlink
    out of the folder. Old code: the pre-flight accepted it and a resumed rank loaded the outside file's
    tensors (tok_emb = 666, 667, ...). Now the pre-flight and the reader refuse it in one line."""
    import torch
    import torch.distributed.checkpoint as dcp

    from engine.config.schema import load_config
    from engine.train.checkpoint import _reader, check_resume
    from engine.train.trainer import Trainer

    key, outside = "model.tok_emb.weight", tmp_path / "outside.distcp"
    shard = {"absolute": str(outside), "symlink": "linked.distcp"}.get(where, where)
    copy = _shard_elsewhere(small_checkpoint, tmp_path, key, shard)
    if where == "symlink":
        (copy / shard).symlink_to(outside)
    cfg = load_config(None, [*TINY_CKPT, "train.steps=2", f"train.resume_from={copy}"])
    with pytest.raises(ConfigError) as raised:  # the launcher's pre-flight, before any rank starts
        check_resume(cfg)
    assert str(raised.value).startswith(f"train.resume_from={str(copy)!r}: its .metadata puts {key} in shard "
                                        f"{shard!r}, {_REFUSED_SHARD}; refused") and "\n" not in str(raised.value)
    got = {key: torch.zeros(256, 16)}
    with pytest.raises(BaseException, match=re.escape(f"{shard!r}, {_REFUSED_SHARD}")):  # each rank's reader
        dcp.load(got, storage_reader=_reader(copy), no_dist=True)
    assert got[key].abs().sum() == 0
    with pytest.raises(Exception, match=re.escape(_REFUSED_SHARD)):  # noqa: PT011 (old code: it trained on)
        list(Trainer(cfg, device=torch.device("cpu")).run())


def test_the_crafted_shard_loads_when_it_lies_inside_the_folder(tmp_path, small_checkpoint):
    """The crafting above is sound: the same shard copied into the folder passes and loads 666, 667, ..."""
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp

    from engine.config.schema import load_config
    from engine.train.checkpoint import _reader, check_resume

    key = "model.tok_emb.weight"
    copy = _shard_elsewhere(small_checkpoint, tmp_path, key, "inside.distcp")
    shutil.copy(tmp_path / "outside.distcp", copy / "inside.distcp")
    check_resume(load_config(None, [*TINY_CKPT, "train.steps=2", f"train.resume_from={copy}"]))
    got = {key: torch.zeros(256, 16)}
    dcp.load(got, storage_reader=_reader(copy), no_dist=True)
    assert got[key].flatten()[:4].tolist() == [666.0, 667.0, 668.0, 669.0]


# ---------------------------------------------------------------- data, weights, dashboard

def test_a_token_id_beyond_the_vocabulary_is_named_not_looked_up(tmp_path):
    """A token file is data: memory-mapped read-only (never unpickled); an id the model has no row for
    stops the read with the rule, instead of an index error (or a wrong row on a device)."""
    import numpy as np

    from engine.config.schema import load_config
    from engine.data.sources import build_streams

    ids = np.arange(4000) % 256
    ids[1234] = 300
    path = tmp_path / "train.bin"
    ids.astype(np.uint16).tofile(path)
    sets = ["data.source=tokens", f"data.path={path}", "model.vocab=256", "model.seq_len=16"]
    with pytest.raises(ConfigError, match=r"holds token id 300 \(data.dtype=uint16\), not below model.vocab=256"):
        load_config(None, sets)  # before any rank starts: the file is read once (sampled when large)
    cfg = load_config(None, sets, check=False)  # and each rank checks every batch it reads
    train, _ = build_streams(cfg.data, cfg.model)
    with pytest.raises(ValueError, match=r"^data.path: token id 300 >= model.vocab=256; raise model.vocab or "
                                         r"re-tokenize$"):
        for _ in range(200):
            train.next_rows(4)


def test_a_weights_folder_that_would_run_code_runs_nothing(tmp_path):
    """model.hf / model.hf_weights: config.json is JSON, its model_type one of the trained families; an
    `auto_map` naming a module beside it is not imported (no trust_remote_code), and a pickled
    pytorch_model.bin goes through torch.load(weights_only=True): refused, nothing ran."""
    import json

    import torch

    from engine.config.schema import load_config
    from engine.errors import ConfigError
    from engine.model.hf import build_hf_model

    llama = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
    (tmp_path / "config.json").write_text(json.dumps({**llama, "auto_map": {"AutoModelForCausalLM": "evil.Model"}}))
    (tmp_path / "evil.py").write_text(f"import os\nos.system('touch {tmp_path / 'ran-py'}')\nclass Model: pass\n")
    torch.save({"model.embed_tokens.weight": _Exploit(tmp_path / "ran-bin")}, tmp_path / "pytorch_model.bin")
    sets = [f"model.hf={tmp_path}", f"model.hf_weights={tmp_path}", "model.seq_len=16"]
    with pytest.raises(ConfigError, match=r"^model.hf_weights=.*does not match model.hf: .*safetensors"):
        load_config(None, sets)  # before any rank: transformers' loader, safetensors only (the .bin is not opened)
    cfg = load_config(None, sets, check=False).model  # and a rank given it anyway refuses the pickle
    with pytest.raises(Exception, match="Weights only load failed|safetensors"):  # noqa: PT011 (torch's own UnpicklingError)
        build_hf_model(cfg, seed=0)
    assert not (tmp_path / "ran-py").exists() and not (tmp_path / "ran-bin").exists()


def test_the_dashboard_renders_no_raw_html():
    """Names and values from runs and studies reach the page only through Streamlit's escaping elements."""
    import ast

    # reviewed raw HTML: module constants built from literals only, never from run or study data
    reviewed = {("run.py", "NO_DIM")}  # the live panel's stylesheet: no dimming while Streamlit reruns
    raw = []
    for path in [ROOT / "app.py", *sorted((ROOT / "workbench").rglob("*.py"))]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "unsafe_allow_html" and not (
                    isinstance(node.value, ast.Constant) and node.value.value is False):
                raw.append(f"{path.name}:{node.lineno} unsafe_allow_html")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("html", "iframe") and isinstance(node.func.value, (ast.Name, ast.Attribute)):
                arg = node.args[0] if node.args else None
                if not (isinstance(arg, ast.Name) and (path.name, arg.id) in reviewed
                        and _literal_constant(tree, arg.id)):
                    raw.append(f"{path.name}:{node.lineno} .{node.func.attr}")
    assert raw == []


def _literal_constant(tree, name: str) -> bool:
    """`name` is assigned once at module level, from string literals and other module-level names only."""
    import ast

    assigned = [n for n in tree.body if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == name for t in n.targets)]
    return len(assigned) == 1 and not any(isinstance(n, (ast.Call, ast.Attribute, ast.Subscript))
                                          for n in ast.walk(assigned[0].value))
