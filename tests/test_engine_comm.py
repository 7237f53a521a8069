"""Compression, L-GreCo, CO2 and the emulated link through the real engine: every knob reaches
the ranks, the bytes on the wire really change, and emulated runs are marked in the store."""
from __future__ import annotations

import pytest

from engine.config.schema import load_config
from engine.launch.local import launch
from profilers.store import RunStore

pytestmark = pytest.mark.xdist_group("launch")

TINY = ["model.layers=2", "model.d_model=64", "model.heads=4", "model.seq_len=32", "batch.global=8",
        "batch.micro=4", "parallel.dp=2", "train.steps=4", "train.warmup_steps=0",
        "profile.host_interval_s=0", "profile.nvml_interval_s=0", "ddp.bucket_cap_mb=0.1"]
# wire/dense ratio bounds per method at 2 ranks (ring accounting of engine/comm/compress.py)
CASES = {
    "none": ([], 1.0, 1.0),
    "fp16": (["comm.compressor=fp16"], 0.5, 0.5),
    "bf16": (["comm.compressor=bf16"], 0.5, 0.5),
    "int8": (["comm.compressor=int8"], 0.2, 0.3),
    "topk": (["comm.compressor=topk", "comm.density=0.01"], 0.01, 0.03),
    "randk": (["comm.compressor=randk", "comm.density=0.01"], 0.005, 0.02),
    # PowerSGD's first 2 steps are dense warm-up (torch's start_powerSGD_iter)
    "powersgd": (["comm.compressor=powersgd", "comm.rank=2"], 0.3, 0.7),
    "adaptive": (["comm.compressor=topk", "comm.adaptive=true", "comm.adaptive_interval=1"], 0.001, 0.2),
    "co2": (["co2.enabled=true", "co2.tau=2"], 0.4, 0.6),
}


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    """The uncompressed run, launched once: the "none" case and the emulated link's fast side."""
    home = tmp_path_factory.mktemp("dense")
    return launch(load_config(None, TINY), home=home), home


@pytest.mark.parametrize("name", list(CASES))
def test_method_changes_wire_bytes(tmp_path, name, dense_run):
    extra, low, high = CASES[name]
    result = dense_run[0] if name == "none" else launch(load_config(None, TINY + extra), home=tmp_path)
    assert result.status == "completed" and len(result.steps) == 4
    s = result.summary
    assert s["dense_bytes"] > 0
    assert low <= s["wire_bytes"] / s["dense_bytes"] <= high, (s["wire_bytes"], s["dense_bytes"])
    assert all(step["loss"] == step["loss"] for step in result.steps)  # no NaN


def test_emulated_link_slows_the_step_and_is_marked(dense_run):
    fast, home = dense_run
    slow = launch(load_config(None, TINY + ["link.gbps=0.1", "link.latency_us=1000"]), home=home)
    # 0.1 Gbit/s: each step's gradient all-reduce (about 0.25 MB at 2 ranks) takes ~20 ms more; the
    # two runs' step times side by side: bench/timing_claims.py link_step
    assert slow.status == "completed" and len(slow.steps) == len(fast.steps)
    store = RunStore.open_home(home)
    assert store.run(slow.run_id)["emulated"] and not store.run(fast.run_id)["emulated"]
