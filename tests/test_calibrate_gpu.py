"""`workbench calibrate --gpu` (tuning/calibrate/gpu.py): the probes' logic on the CPU, the profile's
round trip into the simulator, the H100 profile measured on 2026-11-26, and the real thing (marked `gpu`)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from torch.nn.attention import SDPBackend

from tuning.calibrate import gpu
from tuning.sim.hardware import PRESETS, load_cluster
from tuning.sim.kernels import KERNELS, gpu_facts
from tuning.sim.simulator import from_run_config, simulate

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
RUNS = ROOT / "docs" / "data" / "h100_calibrate_2026-11-26"
MEASURED = RUNS / "h100.yaml"  # the three runs' per-point medians
GPT_1B = {"model": {"layers": 20, "d_model": 2048, "heads": 16, "seq_len": 2048, "vocab": 50304},
          "batch": {"global": 8, "micro": 4}, "precision": "bf16"}  # bench/gpu_mfu.py's GPT


def test_calibrate_gpu_refuses_in_one_line_without_cuda():
    if CUDA:
        pytest.skip("CUDA present: the gpu-marked test measures")
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "calibrate", "--gpu"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "calibrate --gpu needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_probes_time_gemms_attention_and_triad_and_tabulate_what_ran():
    timer = gpu.Timer("cpu", min_s=0.001, repeats=2)
    gemms = gpu.measure_gemms([(32, 64, 16), (1, 64, 64)], timer=timer, dtype="float32")
    assert [(r["m"], r["n"], r["k"]) for r in gemms] == [(32, 64, 16), (1, 64, 64)]
    assert all(r["flops_s"] == pytest.approx(2 * r["m"] * r["n"] * r["k"] / r["seconds"]) for r in gemms)
    # the math kernel stands in for FlashAttention-2; the cuDNN kernel refuses the CPU, and says why
    backends = {"fa2": [SDPBackend.MATH], "cudnn": [SDPBackend.CUDNN_ATTENTION]}
    rows = gpu.measure_attention(timer=timer, backends=backends, seqs=(16, 32), head_dims=(8, 16), tokens=64,
                                 hidden=32, dtype="float32")
    assert len(rows) == 2 * 2 * 2 * 2
    assert all("refused" in r for r in rows if r["impl"] == "cudnn")
    assert all(r["fwd_flops_s"] > 0 and r["bwd_flops_s"] > 0 for r in rows if r["impl"] == "fa2")
    tables = gpu.attention_tables(rows)
    assert list(tables) == ["fa2"] and tables["fa2"]["seq"] == [16, 32]
    assert set(tables["fa2"]) == {"seq", "hd8", "hd16"}
    causal_32 = next(r for r in rows if (r["impl"], r["head_dim"], r["causal"], r["seq"]) == ("fa2", 8, True, 32))
    assert tables["fa2"]["hd8"]["causal"]["bwd"][1] == pytest.approx(causal_32["bwd_flops_s"] / 1e12, rel=1e-3)
    assert gpu.measure_triad(timer=timer, elements=1 << 12, dtype="float32") > 0
    assert gpu.measure_gemms([(8, 8, 8)], timer=timer, deadline=0.0) == []  # past the time budget


def _profile_from(kind: str, **override) -> dict:
    """A profile whose measured facts are `kind`'s prior facts (kernels.yaml), as measure_gpu writes one."""
    raw = yaml.safe_load(KERNELS.read_text())["gpus"][kind]  # a kind with no `like`
    facts = {**{k: raw[k] for k in ("sms", "gemm_efficiency", "tiles", "hbm_gb_s")}, "attention": raw["attention"],
             **override}
    return {"device": "NVIDIA H100 80GB HBM3", "prior": kind, "preset": "dgx-h100", "gpus": {"measured": facts},
            "measurements": {"gemm": [], "attention": [],
                             "hbm": {"triad_gb_s": facts["hbm_gb_s"], "prior_gb_s": None}},
            "left_out": {"gemm": 0, "attention": 0}}


def test_a_profile_holding_the_priors_facts_prices_runs_as_the_preset_does(tmp_path):
    model, par = from_run_config(GPT_1B)
    preset = simulate(model, dataclasses.replace(PRESETS["dgx-h100"], kernels="h100-published"), par).iteration_time_s
    path, cluster = gpu.save_profile(_profile_from("h100-published"), tmp_path / "sub" / "gpu.yaml")
    assert cluster == tmp_path / "sub" / "gpu-cluster.yaml"
    assert yaml.safe_load(cluster.read_text())["kernels"] == "gpu.yaml"  # beside it: the pair moves together
    moved = tmp_path / "elsewhere"
    (tmp_path / "sub").rename(moved)
    spec = load_cluster(moved / "gpu-cluster.yaml")
    assert spec.name == "dgx-h100-measured" and spec.kernels == str(moved / "gpu.yaml")
    assert simulate(model, spec, par).iteration_time_s == pytest.approx(preset, rel=1e-12)
    _, slow = gpu.save_profile(_profile_from("h100-published", gemm_efficiency=0.4), tmp_path / "slow.yaml")
    assert simulate(model, load_cluster(slow), par).iteration_time_s > 1.3 * preset


def test_the_h100_measured_on_2026_11_26_against_its_published_prior():
    """docs/gpu.md's figures: three runs, their per-point medians, and the published prior's price of the same
    points."""
    runs = [yaml.safe_load((RUNS / f"run{i}.yaml").read_text()) for i in (1, 2, 3)]
    for run in runs:
        assert run["prior"] == "h100-published" and run["seconds"] < 180 and not any(run["left_out"].values())
        assert len(run["measurements"]["gemm"]) == len(gpu.gemm_shapes())
        assert not any("refused" in r for r in run["measurements"]["attention"])
        squares = [r["flops_s"] for r in run["measurements"]["gemm"] if r["m"] == r["n"] == r["k"]]
        assert run["mamf"] == pytest.approx(max(squares) / 989e12, abs=1e-4)
    assert [run["gpus"]["measured"]["gemm_efficiency"] for run in runs] == [0.7049, 0.7067, 0.7075]
    assert [run["mamf"] for run in runs] == [0.7569, 0.7728, 0.7844]  # the best square varies more than the median
    profile = yaml.safe_load(MEASURED.read_text())
    assert gpu.combine(runs)["gpus"] == profile["gpus"]
    m, published = profile["measurements"], gpu_facts("h100-published")
    ratios = sorted(r["flops_s"] / r["prior_flops_s"] for r in m["gemm"])
    assert 0.87 < ratios[len(ratios) // 2] < 0.90  # the published prior prices the median GEMM 13% fast
    small_k = [r["flops_s"] / r["prior_flops_s"] for r in m["gemm"] if r["k"] <= 1024 and r["m"] > 1024]
    assert max(small_k) < 0.85  # short reductions: the tile and wave model misses them
    measured = gpu_facts(str(MEASURED))
    fa2 = [facts.attention["fa2"].rate(128, False, "fwd", 16384) for facts in (measured, published)]
    assert 0.9 < fa2[0] / fa2[1] < 1.0
    lines = gpu.summary(profile)
    assert any(line.startswith("GEMM efficiency (median of the compute-bound shapes) 70.7%, best square (MAMF) 77.3%"
                               " of peak; prior (MAMF) 80.1%") for line in lines), lines


def test_the_simulators_h100_is_the_calibrated_one():
    """kernels.yaml `h100` (what dgx-h100 prices with) holds the measured facts; what was not measured (the
    tile shapes, the Triton table) is the published prior's."""
    measured, h100, published = gpu_facts(str(MEASURED)), gpu_facts("h100"), gpu_facts("h100-published")
    assert PRESETS["dgx-h100"].kernels == "h100"
    for field in ("sms", "gemm_efficiency", "hbm_gb_s"):
        assert getattr(h100, field) == getattr(measured, field), field
    for impl in ("fa2", "cudnn"):
        for key, rates in measured.attention[impl].rates.items():
            assert h100.attention[impl].rates[key] == pytest.approx(rates), (impl, key)
    assert h100.tiles == published.tiles
    for key, rates in published.attention["triton"].rates.items():
        assert h100.attention["triton"].rates[key] == pytest.approx(rates), key
    assert list(h100.attention)[0] == "fa2"  # the fallback kernel


def test_the_measured_profile_prices_the_mfu_scripts_gpt():
    """The cluster profile beside the measured kernels is what `simulate --cluster` takes."""
    model, par = from_run_config(GPT_1B)
    spec = load_cluster(MEASURED.with_name(MEASURED.stem + "-cluster.yaml"))
    assert dataclasses.replace(spec, name="dgx-h100", kernels="h100") == PRESETS["dgx-h100"]
    published = dataclasses.replace(spec, kernels="h100-published")
    assert simulate(model, spec, par).iteration_time_s > simulate(model, published, par).iteration_time_s


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
def test_calibrate_gpu_measures_in_under_three_minutes(tmp_path):
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "calibrate", "--gpu", "-o", str(tmp_path / "g.yaml")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert time.perf_counter() - start < 180, r.stdout
    facts = gpu_facts(str(tmp_path / "g.yaml"))
    assert facts.gemm_efficiency > 0.3 and "fa2" in facts.attention and facts.hbm_gb_s > 500
