"""The New-run form's validation stays light (issue 64 item 3): `parse_config` runs the memory fit check
(engine/train/memory.py), which must not import torch (~3 s of CPU on the dashboard's first render). A fresh
interpreter validates real configs and then asserts torch never loaded."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

VALIDATE_WITHOUT_TORCH = textwrap.dedent("""
    import sys
    from workbench.ui_state import parse_config

    for text in sys.argv[1:]:
        config, errors = parse_config(text)
        assert config is not None and not errors, (text, errors)
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    assert not loaded, f"the form's validation imported {loaded[:5]}"
""")

# backend gloo: the fit check needs no CUDA query on any machine, GPU or not
DENSE = "model: {layers: 6, d_model: 64, heads: 4, seq_len: 64, vocab: 256}\nparallel: {pp: 2, virtual: 3, schedule: interleaved}\n" \
        "batch: {global: 16, micro: 2}\nbackend: gloo\n"
MOE = "model: {layers: 4, d_model: 64, heads: 4, seq_len: 64, vocab: 256, experts: 4}\nbackend: gloo\n"


def test_form_validation_imports_no_torch():
    done = subprocess.run([sys.executable, "-c", VALIDATE_WITHOUT_TORCH, DENSE, MOE, (ROOT / "examples" / "tiny.yaml")
                           .read_text().replace("backend: auto", "backend: gloo")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("backend", ["auto", "nccl"])
def test_no_gpu_device_node_means_no_cuda_without_asking_torch(monkeypatch, backend):
    from engine import device
    from engine.train import memory

    monkeypatch.setattr(device.sys, "platform", "linux")
    monkeypatch.setattr(device.os.path, "exists", lambda path: False)
    monkeypatch.setitem(sys.modules, "torch", None)  # importing torch now would raise
    assert memory._cuda_usable(backend) is False
    assert device.pick_backend("auto") == "gloo" and device.pick_backend("nccl") == "nccl"  # nccl: as asked


def test_gpu_device_node_defers_to_torch(monkeypatch):
    import torch

    from engine import device
    from engine.train import memory

    monkeypatch.setattr(device.os.path, "exists", lambda path: True)
    assert memory._cuda_usable("auto") is torch.cuda.is_available()
    assert memory._cuda_usable("gloo") is False
    assert device.pick_backend("auto") == ("nccl" if torch.cuda.is_available() else "gloo")


# a CPU run and a tune of one trial through the CLI's own entry, in a fresh interpreter; then no torch in it
CLI_WITHOUT_TORCH = textwrap.dedent("""
    import sys
    from workbench.cli import run_command

    for args in (sys.argv[1:4], sys.argv[4:]):
        sys.argv = ["workbench", *args]
        assert run_command() == 0, args
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    assert not loaded, f"the launcher imported {loaded[:5]}"
""")


def test_a_cpu_run_and_a_tune_launch_without_importing_torch(tmp_path):
    """A `workbench run` or `tune` of CPU ranks on a host without a GPU driver imports no torch in its own
    process (its ranks do): the CUDA question of backend=auto is answered from the device nodes, the dry-run
    pre-flight and the checkpoint reader load only where a device memory or a resume asks for them (each
    such process paid about 2 s of CPU for torch; the suite starts ~110 of them)."""
    from engine.device import gpu_driver_present

    if gpu_driver_present():
        pytest.skip("a GPU driver is here: backend=auto asks torch whether CUDA is usable")
    (tmp_path / "space.yaml").write_text("world_size: 2\nparams:\n  batch.micro: {choices: [2, 4]}\n"
                                         "fixed:\n  train.steps: 2\n  train.eval_interval: 0\n")
    tiny = str(ROOT / "examples" / "tiny.yaml")
    args = ["run", tiny, "--set=train.steps=2",
            "tune", str(tmp_path / "space.yaml"), "--base", tiny, "--trials", "1", "--json",
            "--storage", f"sqlite:///{tmp_path}/studies.db"]
    done = subprocess.run([sys.executable, "-c", CLI_WITHOUT_TORCH, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "WORKBENCH_HOME": str(tmp_path / "home")})
    assert done.returncode == 0, (done.stdout[-1500:], done.stderr[-2000:])
    runs = sorted(p.name for p in (tmp_path / "home" / "runs").iterdir())
    assert len(runs) == 2 and all(name.startswith("tiny-") for name in runs), runs  # both ran


def test_the_run_pages_collective_tables_import_no_torch():
    """The Run page's collectives table reads profilers/bandwidth.py (split_key, bus factors): no torch there (it
    imported torch at the top, ~3 s of the page's first render)."""
    code = textwrap.dedent("""
        import sys
        from profilers.bandwidth import bus_factor, split_key, tensor_bytes
        from workbench import report
        assert bus_factor("all_reduce", 4) == 1.5 and tensor_bytes([1, "x"]) == 0
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        assert not loaded, f"imported {loaded[:5]}"
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
