"""The GPU path. Its logic runs here on CPU with fakes (a fake CUDA event clock, a fake pynvml,
device names); the real thing (bench/gpu_check.py, bench/gpu_mfu.py) is marked `gpu` and skips
without CUDA. CI never has a GPU."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from engine.train.comm_setup import CommMonitor
from engine.device import peak_bf16, peak_flops
from engine.parallel.pipeline import Pipeline, _Clock
from profilers import nvml
from profilers.steps import StepTimer

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()


# ------------------------------------------------------------------ a fake CUDA clock
class FakeGpu:
    """The device's own clock (ms): it advances only when a 'kernel' runs. Launches return to
    the host at once, as CUDA's do, so host time around them says nothing about the device."""

    now = 0.0

    @classmethod
    def launch(cls, ms: float) -> None:
        cls.now += ms


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.t: float | None = None

    def record(self, stream: object = None) -> None:
        self.t = FakeGpu.now

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.t is not None and end.t is not None, "event read before it was recorded"
        return end.t - self.t


@pytest.fixture
def fake_cuda(monkeypatch):
    FakeGpu.now = 0.0
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return FakeGpu


def test_step_timer_reads_device_time_with_exposed_comm_from_events(fake_cuda):
    timer = StepTimer("cuda")
    monitor = CommMonitor(2, mark=timer.mark)
    bucket = types.SimpleNamespace(buffer=lambda: torch.zeros(4))
    hook = monitor.track(lambda state, b: "future")
    timer.start_step()
    with timer.phase("forward"):
        fake_cuda.launch(30)
    monitor.begin_backward()
    with timer.phase("backward"):
        fake_cuda.launch(40)         # gradients computed; the last bucket becomes ready here
        hook(None, bucket)
        fake_cuda.launch(10)         # the stream waits for the all-reduce: exposed communication
    timer.move("backward", "comm_exposed", monitor.exposed_tail(timer.last_end("backward"), timer.seconds))
    with timer.phase("optimizer"):
        fake_cuda.launch(20)
    fake_cuda.launch(5)              # untimed work: "other"
    out = timer.end_step()
    assert out["forward"] == pytest.approx(0.030) and out["optimizer"] == pytest.approx(0.020)
    assert out["backward"] == pytest.approx(0.040) and out["comm_exposed"] == pytest.approx(0.010)
    assert out["other"] == pytest.approx(0.005)
    assert timer.step_time == pytest.approx(0.105) == pytest.approx(sum(out.values()))


def test_step_timer_defers_moves_until_end_step(fake_cuda):
    timer = StepTimer("cuda")
    timer.start_step()
    with timer.phase("forward"):
        fake_cuda.launch(10)
    reads: list[str] = []
    timer.move("forward", "bubble", lambda: reads.append("read") or 0.004)
    with pytest.raises(ValueError, match="other"):
        timer.move("forward", "other", 1.0)
    assert reads == []  # nothing is read inside the step: no host synchronise there
    out = timer.end_step()
    assert reads == ["read"] and out["bubble"] == pytest.approx(0.004) and out["forward"] == pytest.approx(0.006)


def test_pipeline_clock_measures_stage_compute_on_the_device_clock(fake_cuda):
    clock = _Clock("cuda")
    assert clock.cuda

    class Schedule:
        def step(self, *args, target=None, losses=None, return_outputs=False) -> None:
            clock.timed(fake_cuda.launch, 8)                 # stage forward
            fake_cuda.launch(5)                              # waiting on the previous stage (bubble)
            clock.timed(fake_cuda.launch, 12, backward=True)  # stage backward

    pipe = Pipeline(stages=[], schedule=Schedule(), n_microbatches=1, clock=clock, embedding_group=None)
    pipe.step(None, None)
    t = pipe.last_timing
    assert t["total_s"] == pytest.approx(0.025) and t["compute_s"] == pytest.approx(0.020)
    assert t["bubble_s"] == pytest.approx(0.005) and t["backward_s"] == pytest.approx(0.012)


def test_cpu_clocks_keep_host_time():
    assert not _Clock("cpu").cuda
    timer = StepTimer("cpu")
    timer.start_step()
    a = timer.mark()
    b = timer.mark()
    assert isinstance(a, float) and timer.seconds(a, b) >= 0.0 and timer.seconds(None, b) == 0.0
    timer.end_step()
    assert timer.mark() is None  # outside a step


# ------------------------------------------------------------------ peak FLOP/s and MFU
@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 836e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12), ("NVIDIA L4", 121e12), ("NVIDIA L40S", 362e12),
    ("NVIDIA A10", 125e12), ("NVIDIA A10G", None), ("AMD Instinct MI250X", 191.5e12),
    ("AMD Instinct MI300X", 1307.4e12), ("Tesla T4", None), ("NVIDIA GeForce RTX 3060", None),
    # whole words only: "l4" is in "L40" and "h200" in "GH200" as substrings, not as words
    ("NVIDIA L40", 181e12), ("NVIDIA GH200 480GB", 989e12), ("NVIDIA H100-SXM5-80GB", 989e12),
])
def test_peak_table_by_device_name(name, peak):
    assert peak_bf16(name) == peak


def test_peak_flops_is_unknown_on_cpu_unless_given(monkeypatch):
    monkeypatch.delenv("WORKBENCH_PEAK_FLOPS", raising=False)
    assert peak_flops(torch.device("cpu")) is None  # MFU reads n/a, never a guess
    monkeypatch.setenv("WORKBENCH_PEAK_FLOPS", "2e11")
    assert peak_flops(torch.device("cpu")) == 2e11


# ------------------------------------------------------------------ NVML with a fake pynvml
def _fake_pynvml() -> types.ModuleType:
    nv = types.ModuleType("pynvml")
    nv.NVML_TEMPERATURE_GPU, nv.NVML_CLOCK_SM, nv.NVML_CLOCK_MEM = 0, 1, 2
    nv.NVML_PCIE_UTIL_TX_BYTES, nv.NVML_PCIE_UTIL_RX_BYTES = 0, 1
    nv.nvmlInit = lambda: None
    nv.nvmlDeviceGetCount = lambda: 2
    nv.nvmlDeviceGetHandleByIndex = lambda i: i
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=90 + h, memory=40)
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=(h + 1) * 2**30, total=80 * 2**30)
    nv.nvmlDeviceGetPowerUsage = lambda h: 650_000  # milliwatts
    nv.nvmlDeviceGetTemperature = lambda h, kind: 61
    nv.nvmlDeviceGetClockInfo = lambda h, kind: {1: 1980, 2: 2619}[kind]
    nv.nvmlDeviceGetPcieThroughput = lambda h, kind: 100  # KB/s

    def no_nvlink(*args: object) -> None:
        raise RuntimeError("not supported")

    nv.nvmlDeviceGetFieldValues = no_nvlink
    nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 0
    return nv


@pytest.fixture
def fake_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    monkeypatch.setattr(nvml, "_state", {"checked": False, "ok": False, "reason": "", "warned": False})


def test_nvml_samples_every_gpu(fake_nvml):
    values = nvml.NvmlSampler().sample()
    assert values["gpu0/util(%)"] == 90 and values["gpu1/util(%)"] == 91
    assert values["gpu1/mem_used(GiB)"] == 2.0 and values["gpu0/power(W)"] == 650.0
    assert values["gpu0/temp(C)"] == 61 and values["gpu0/sm_clock(MHz)"] == 1980
    assert "gpu0/nvlink_tx(B/s)" not in values  # no counters: skipped, not guessed


def test_worker_samples_carry_the_running_step(fake_nvml):
    from engine.config.schema import load_config
    from engine.launch.worker import _samplers

    got = []
    client = types.SimpleNamespace(emit=lambda step, kind, name, value: got.append((step, kind, name)))
    cfg = load_config(None, ["profile.host_interval_s=0", "profile.nvml_interval_s=30"])
    running = [7]
    samplers = _samplers(cfg, client, 0, lambda: running[0])
    try:
        samplers[0].record()
        running[0] = 8
        samplers[0].record()
    finally:
        for s in samplers:
            s.stop()
    steps = {step for step, kind, name in got if name == "gpu1/util(%)"}
    assert {7, 8} <= steps and all(kind == "gpu" for _, kind, _ in got)


def test_launch_refuses_more_nccl_ranks_than_gpus_before_any_process(monkeypatch, tmp_path):
    """On a one-GPU box (the lent H100) a 2-rank run picks NCCL (auto) and its rank 1 asks for
    cuda:1, which is not there; now one line names the field, the value and the rule before
    anything starts."""
    from engine.config.schema import load_config
    from engine.errors import ConfigError
    from engine.launch.local import launch

    from engine import device

    monkeypatch.setattr(device, "gpu_driver_present", lambda: True)  # the lent H100's /dev/nvidiactl
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = load_config(None, ["parallel.dp=2", "model.layers=1", "model.d_model=32", "model.heads=4",
                             "model.seq_len=16", "train.steps=1"])
    with pytest.raises(ConfigError, match=r"^backend='?auto'?: NCCL needs one GPU per rank .*: 2 ranks on this "
                                          r"node, 1 GPU\(s\) visible; .*backend=gloo"):
        launch(cfg, home=tmp_path)
    assert not (tmp_path / "runs").exists()  # refused before the run was registered
    from engine.device import check_ranks_fit_gpus

    with pytest.raises(ConfigError, match="backend='?nccl'?: NCCL needs one GPU per rank: 3 ranks"):
        check_ranks_fit_gpus("nccl", 3)
    check_ranks_fit_gpus("auto", 1)  # one GPU per rank
    check_ranks_fit_gpus("gloo", 4)  # CPU ranks


# ------------------------------------------------------------------ the real GPU (skipped here)
def test_gpu_scripts_refuse_cleanly_without_cuda():
    if CUDA:
        pytest.skip("CUDA present: the gpu-marked tests run the scripts")
    for script in ("bench/gpu_check.py", "bench/gpu_mfu.py", "bench/gpu_layer.py", "bench/gpu_checkpoint.py"):
        r = subprocess.run([sys.executable, script], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (script, r.stdout, r.stderr)
        assert "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
def test_gpu_acceptance_script():
    r = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                       timeout=1800)
    print(r.stdout)  # the table is the record of what works (pytest -s shows it)
    assert r.returncode in (0, 1) and "paths ok" in r.stdout, r.stdout + r.stderr
    rows = [re.split(r"\s{2,}", line.strip()) for line in r.stdout.splitlines() if " rank" in line]
    one_rank = [row for row in rows if row[1] == "1 rank nccl"]
    assert one_rank and all(row[2] == "ok" for row in one_rank), r.stdout + r.stderr
    # through gloo, CUDA tensors carry all-reduce and broadcast at least: plain DP must match
    assert ["dp2", "ok"] in [[row[0], row[2]] for row in rows], r.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
def test_gpu_mfu_script_quick():
    r = subprocess.run([sys.executable, "bench/gpu_mfu.py", "--quick"], cwd=ROOT, capture_output=True,
                       text=True, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MFU" in r.stdout


def test_gpu_checkpoint_script_times_every_checkpoint_form_on_cpu():
    """bench/gpu_checkpoint.py's logic on a tiny CPU GPT: a row per micro-batch and checkpoint form."""
    r = subprocess.run([sys.executable, "bench/gpu_checkpoint.py", "--cpu-dry-run", "--micro", "1,2", "--accumulate", "2",
                        "--repeats", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["1"] * 4 + ["2"] * 4, r.stdout
    assert all(float(row[-2]) > 0 and float(row[-1]) > 0 for row in rows), r.stdout


def test_gpu_layer_script_measures_and_prices_a_shard_on_cpu(tmp_path):
    """bench/gpu_layer.py's logic on a tiny CPU shard, then `--price` of what it wrote: the simulator's
    per-layer price beside each measured row (docs/gpu.md's table is this on an H200)."""
    out = tmp_path / "layer.json"
    r = subprocess.run([sys.executable, "bench/gpu_layer.py", "--cpu-dry-run", "--tp", "1,2", "--repeats", "1",
                        "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(row["shape"], row["tp"]) for row in rows] == [("dry", 1), ("dry", 2), ("dry-llama", 1), ("dry-llama", 2)]
    assert all(row["layer_bwd_s"] > 0 for row in rows)
    r = subprocess.run([sys.executable, "bench/gpu_layer.py", "--price", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    priced = [line.split() for line in r.stdout.splitlines() if line.startswith("dry")]
    assert len(priced) == 4 and all("/" in cell for line in priced for cell in line[2:])


@pytest.mark.slow
def test_gpu_mfu_script_logic_on_cpu():
    """The MFU script's own logic on a tiny CPU model (it measures nothing about GPUs here)."""
    r = subprocess.run([sys.executable, "bench/gpu_mfu.py", "--cpu-dry-run", "--rounds", "1", "--steps", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    for line in ("engine, profilers on", "minimal loop", "engine / minimal loop", "profilers on / off",
                 "breakdown total vs independent wall"):
        assert line in r.stdout, r.stdout
    assert "n/a" in r.stdout  # no peak for a CPU: MFU is not guessed


def test_gpu_mfu_script_steps_a_hugging_face_model(tmp_path):
    """`--hf`: the transformers model a plan was made for (examples/llama3_2_1b, shrunk), at the plan's micro and
    global batch, through the same three interleaved ways of stepping."""
    import json

    config = json.loads((ROOT / "examples/llama3_2_1b/config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512, bos_token_id=1, eos_token_id=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = subprocess.run([sys.executable, "bench/gpu_mfu.py", "--cpu-dry-run", "--hf", str(tmp_path), "--seq", "64",
                        "--micro", "2", "--global-batch", "4", "--rounds", "1", "--steps", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert "llama (Hugging Face)" in r.stdout and "seq 64" in r.stdout and "micro-batch 2, 256 tokens/step" in r.stdout
    assert "engine / minimal loop" in r.stdout, r.stdout


def test_ranks_get_expandable_segments_unless_the_user_set_the_allocator(tmp_path, monkeypatch) -> None:
    """docs/gpu.md (2026-11-27): `plan`'s pick for Llama-3.2-1B on one H100 (77.5 GiB priced) ran out of memory
    under the default caching allocator with 5.9 GiB reserved but unallocated, and trained with
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True at 77.6 GiB peak. Every launcher now gives its ranks that,
    unless the user set the variable, and the run's record says which the ranks ran with."""
    from engine.config.schema import load_config
    from engine.device import ALLOC_CONF
    from engine.launch.local import launch
    from engine.launch.slurm import dry_run
    from profilers.store import RunStore

    monkeypatch.setenv(ALLOC_CONF, "unset below")
    monkeypatch.delenv(ALLOC_CONF)
    cfg = load_config(None, ["model.layers=1", "model.d_model=32", "model.heads=2", "model.seq_len=16",
                             "model.vocab=256", "batch.global=2", "batch.micro=2", "train.steps=2", "precision=fp32",
                             "profile.nvml_interval_s=0", "profile.host_interval_s=0"])
    for user, expected in ((None, "expandable_segments:True"), ("backend:cudaMallocAsync", "backend:cudaMallocAsync")):
        if user:
            monkeypatch.setenv(ALLOC_CONF, user)
        home = tmp_path / (user or "default").replace(":", "-")
        result = launch(cfg, home=home)
        assert RunStore.open_home(home).run(result.run_id)["host"]["cuda_alloc_conf"] == expected
        assert f"{ALLOC_CONF}={expected}" in dry_run(cfg, home=home)  # the Slurm script exports it to every node
