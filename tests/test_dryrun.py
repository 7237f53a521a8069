"""The dry run (engine/train/dryrun.py, `workbench dryrun`, the launcher's pre-flight): one step of the real
program at the real world size in one CPU process, judged by hand counts, by a real run's own
telemetry and by the same memory tracker on a real step."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine.config.schema import load_config
from engine.errors import ConfigError

# a Llama-shaped model whose every dim 0 divides by 8: FSDP2 pads no shard at world 8, so its gathers
# carry exactly the parameters
HF = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
      "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 512, "tie_word_embeddings": False}
BASE = [f"model.hf={json.dumps(HF)}", "model.seq_len=32", "data.source=synthetic", "precision=fp32",
        "train.steps=2", "batch.micro=1"]


def _cfg(*overrides: str):
    return load_config(None, [*BASE, *overrides])


def _transformers_params() -> int:
    """Parameters transformers' own LlamaForCausalLM has for HF (not the engine's count)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: v for k, v in HF.items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **kwargs))
    return sum(p.numel() for p in model.parameters())


def test_fsdp2_gathers_every_parameter_twice_per_micro_batch_in_fp32():
    """ZeRO-3 at world 8, 2 micro-batches: each of the 5 FSDP2 groups (4 layers, the root) gathers
    before forward and before backward, 4 bytes per parameter (the engine keeps fp32 parameters),
    and reduce-scatters its gradients once per micro-batch."""
    from engine.train.dryrun import dry_run

    result = dry_run(_cfg("parallel.dp=8", "parallel.zero=3", "batch.global=16"))
    (role,) = result.roles
    params = _transformers_params()
    gather, scatter = role.collectives["dp:all_gather"], role.collectives["dp:reduce_scatter"]
    assert (gather["count"], gather["bytes"]) == (2 * 2 * 5, 2 * 2 * 4 * params)
    assert (scatter["count"], scatter["bytes"]) == (2 * 5, 2 * 4 * params)
    assert role.tracker == "FSDPMemTracker" and role.coords == {"pp": 0, "dp": 0, "tp": 0}
    assert role.memory["Sharded Param"] == pytest.approx(4 * params / 8, rel=0.01)  # plus the rotary buffer
    assert role.peak == pytest.approx(sum(role.memory.values()))


def test_bf16_under_fsdp2_gathers_bf16_weights_and_keeps_no_autocast_copy_of_them():
    """precision=bf16 with ZeRO-3: FSDP2's MixedPrecisionPolicy gathers bf16 copies of the fp32 shards (2 bytes
    per parameter) and reduce-scatters fp32 gradients; autocast then finds bf16 weights and caches no copy, so the
    step's activations and temporaries take fewer bytes than in fp32 (autocast over gathered fp32 weights held a
    bf16 copy of every weight until the forward ended, more than bf16 saved on a small model)."""
    from engine.train.dryrun import dry_run

    layout = ("parallel.dp=8", "parallel.zero=3", "batch.global=16")
    (bf16,) = dry_run(_cfg(*layout, "precision=bf16")).roles
    (fp32,) = dry_run(_cfg(*layout)).roles
    params = _transformers_params()
    gather, scatter = bf16.collectives["dp:all_gather"], bf16.collectives["dp:reduce_scatter"]
    assert (gather["count"], gather["bytes"]) == (2 * 2 * 5, 2 * 2 * 2 * params)
    assert (scatter["count"], scatter["bytes"]) == (2 * 5, 2 * 4 * params)
    assert bf16.memory["Sharded Param"] == fp32.memory["Sharded Param"]  # fp32 shards: the optimizer's master
    assert bf16.memory["Unsharded Param"] == fp32.memory["Unsharded Param"] / 2
    step = {name: r.memory["Activation"] + r.memory["Temp"] for name, r in (("bf16", bf16), ("fp32", fp32))}
    assert step["bf16"] < step["fp32"], step


def _real_step_peak(cfg):
    """A real step of `cfg` on this CPU, tracked as the dry run tracks its fake one: the peak bytes per category
    and the tracker's name."""
    from engine.train.dryrun import _optimizer_states, _per_micro_batch, _tracker
    from engine.train.trainer import Trainer

    trainer = Trainer(cfg, device=torch.device("cpu"))
    _optimizer_states(trainer.par)
    tracker, name = _tracker(trainer.par)
    with _per_micro_batch(tracker, trainer.par.modules), tracker:
        trainer.train_step(1)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return {getattr(k, "value", k): v for k, v in peak.items() if k != "Total"}, name


def test_dry_run_memory_equals_the_same_tracker_on_a_real_step():
    """One rank, the same config: the fake step's categories at the peak are the real step's bytes."""
    from engine.train.dryrun import dry_run

    cfg = _cfg("batch.global=2", "train.activation_checkpointing=true")
    (fake,) = dry_run(cfg).roles
    real, name = _real_step_peak(cfg)
    assert name == fake.tracker == "MemTracker"
    assert fake.memory == pytest.approx(real, rel=1e-6)
    assert fake.memory["Optstate"] > 0 and fake.memory["Activation"] > 0


@pytest.mark.slow
@pytest.mark.xdist_group("launch")
def test_dry_run_collectives_equal_a_real_runs_telemetry(tmp_path):
    """The real program on 2 gloo ranks records its step's collectives per axis; the dry run of the
    same config counts the same calls and bytes."""
    from engine.train.dryrun import dry_run
    from engine.launch.local import launch
    from profilers.store import RunStore

    cfg = _cfg("parallel.dp=2", "parallel.zero=3", "batch.global=4")
    result = launch(cfg, home=tmp_path)
    recorded = {r.name: r.value for r in RunStore.open_home(tmp_path).metrics(result.run_id, kind="comm", rank=0)
                if r.step == 1}
    (role,) = dry_run(cfg).roles
    for key in ("dp:all_gather", "dp:reduce_scatter", "dp:all_reduce"):
        assert role.collectives[key]["count"] == recorded[f"{key}/count"], key
        assert role.collectives[key]["bytes"] == recorded[f"{key}/bytes"], key


@pytest.mark.slow
@pytest.mark.xdist_group("launch")
def test_a_bf16_pipeline_over_fsdp2_sends_what_a_real_run_sends(tmp_path):
    """pp2 x dp2, ZeRO-3, bf16 on 4 gloo ranks: the stages pass FSDP2's bf16 hidden states (the dry run's
    static stage shapes say so) and gather bf16 weights; rank 0's calls and bytes per axis are the real run's."""
    from engine.train.dryrun import dry_run
    from engine.launch.local import launch
    from profilers.store import RunStore

    cfg = _cfg("parallel.pp=2", "parallel.dp=2", "parallel.zero=3", "batch.global=4", "precision=bf16")
    result = launch(cfg, home=tmp_path)
    recorded = {r.name: r.value for r in RunStore.open_home(tmp_path).metrics(result.run_id, kind="comm", rank=0)
                if r.step == 1}
    role = dry_run(cfg).roles[0]
    assert recorded["pp:send/bytes"] == 2 * 32 * 128 * 2  # 2 micro-batches of a bf16 (1, 32, 128) hidden state
    for key in ("pp:send", "pp:recv", "dp:all_gather", "dp:reduce_scatter"):
        vote = key.startswith("pp:")  # the dry step is the schedule's first: its one 4-byte warm-up vote each way
        assert role.collectives[key]["count"] == recorded[f"{key}/count"] + vote, key
        assert role.collectives[key]["bytes"] == recorded[f"{key}/bytes"] + 4 * vote, key


def test_a_pipeline_reports_each_stage_with_its_sends():
    """pp2 x dp2, 1F1B over 2 micro-batches: one role per stage; stage 0 sends each micro-batch's
    activation, stage 1 each gradient back (plus the schedule's 4-byte warm-up vote), and the two
    ends sum the tied embedding gradient."""
    from engine.train.dryrun import dry_run

    cfg = load_config(None, ["model.layers=4", "model.d_model=64", "model.heads=4", "model.seq_len=32",
                             "model.vocab=256", "parallel.pp=2", "parallel.dp=2", "batch.global=8",
                             "batch.micro=2", "data.source=synthetic"])
    roles = dry_run(cfg).roles
    assert [r.rank for r in roles] == [0, 2] and [r.coords["pp"] for r in roles] == [0, 1]
    activation = 2 * 32 * 64 * 4  # micro x seq x d_model, fp32
    for role in roles:
        assert role.collectives["pp:send"]["bytes"] == 2 * activation + 4
        assert role.collectives["pp:recv"]["bytes"] == 2 * activation + 4
        assert role.collectives["all_reduce"]["bytes"] == 256 * 64 * 4  # the embedding group (no mesh axis)
        assert role.tracker == "MemTracker" and role.memory["Optstate"] > 0


def test_a_step_of_many_micro_batches_plays_three_and_counts_the_middle_one_for_the_rest(monkeypatch):
    """tp2 x dp4 (FSDP2 replicate) and ZeRO-3, 6 micro-batches a step: the dry run plays the first, one middle and
    the last; the collectives are the whole step's, call for call, and so is the memory at the peak, but for the
    token ids of the 3 micro-batches not played (8 bytes a token)."""
    import engine.train.dryrun as dryrun

    for layout in (("parallel.tp=2", "parallel.dp=4", "parallel.zero=0"), ("parallel.dp=8", "parallel.zero=3")):
        cfg = _cfg(*layout, "batch.global=48", "precision=bf16")
        assert dryrun.played_config(cfg).grad_accum == 3
        (played,) = dryrun.dry_run(cfg).roles
        monkeypatch.setattr(dryrun, "PLAYED_MICRO_BATCHES", 6)
        (whole,) = dryrun.dry_run(cfg).roles
        monkeypatch.undo()
        assert played.collectives == whole.collectives, layout
        assert {k: v for k, v in played.memory.items() if k != "Activation"} == \
            {k: v for k, v in whole.memory.items() if k != "Activation"}, layout
        assert 0 <= whole.memory["Activation"] - played.memory["Activation"] <= 3 * 32 * 8 + 64, layout


def test_the_dry_run_builds_parameters_without_storage():
    """The build's allocation runs under the dry run's fake mode (engine/model/meta_init.py `allocating_under`):
    FSDP2's replicate, which copies every parameter of a tp rank into storage of its own, copies fake tensors
    (11 GiB of real pages for Llama-3.1-8B at tp 4 before)."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.distributed.tensor import DTensor

    from engine.model.meta_init import allocating_under
    from engine.torch_compat import fake_tensor_mode
    from engine.train.dryrun import _fake_world
    from engine.train.trainer import Trainer

    cfg = _cfg("parallel.tp=2", "parallel.dp=4", "batch.global=8")
    with _fake_world(cfg.world_size, 0), allocating_under(fake_tensor_mode()(allow_non_fake_inputs=True)):
        trainer = Trainer(cfg, device=torch.device("cpu"), init_values=False)
        trainer.collectives.disable()  # one profiler per process: the next dry run enables its own
        params = list(trainer.par.parameters())
    assert params and all(is_fake(p.to_local() if isinstance(p, DTensor) else p) for p in params)


def test_mixtral_dry_runs_as_the_same_tracker_on_a_real_step():
    """transformers' Mixtral (fused experts, engine/parallel/expert_fused.py): the fake step answers the tokens per
    expert (`torch.bincount`, whose output shape the fake mode cannot know) with a balanced router's counts; a real
    step of the same dropless layer runs as many rows through its experts, so the bytes per category agree."""
    from engine.train.dryrun import dry_run

    mixtral = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "num_local_experts": 4,
               "num_experts_per_tok": 2, "tie_word_embeddings": False}
    base = [f"model.hf={json.dumps(mixtral)}", "model.seq_len=32", "data.source=synthetic", "batch.micro=1"]
    cfg = load_config(None, [*base, "precision=fp32", "batch.global=2"])
    (fake,) = dry_run(cfg).roles
    real, _ = _real_step_peak(cfg)
    assert fake.memory == pytest.approx(real, rel=0.02) and fake.memory["Activation"] > 0
    # FSDP2 over 4 fake ranks, bf16, the router's load-balancing loss on: routed as well
    aux = json.dumps({**mixtral, "output_router_logits": True})
    (sharded,) = dry_run(load_config(None, [*base, f"model.hf={aux}", "batch.global=8", "parallel.dp=4",
                                            "parallel.zero=3", "precision=bf16"])).roles
    assert sharded.collectives["dp:all_gather"]["count"] > 0 and sharded.memory["Unsharded Param"] > 0


def test_layouts_the_dry_run_cannot_play_are_named_in_one_line():
    from engine.train.dryrun import at_world, dry_run

    with pytest.raises(ConfigError, match=r"comm.compressor='topk': the dry run plays DDP's gradient all-reduce"):
        dry_run(_cfg("parallel.dp=2", "batch.global=2", "comm.compressor=topk"))
    assert at_world(_cfg("parallel.tp=2", "batch.global=8"), 8).parallel.dp == 4
    with pytest.raises(ConfigError, match=r"--world=6: must be a multiple of tp\(4\)"):
        at_world(_cfg("parallel.tp=4"), 6)
    gpt_moe = ["model.layers=2", "model.d_model=64", "model.heads=4", "model.vocab=256", "model.seq_len=32",
               "model.experts=4", "data.source=synthetic", "batch.global=4", "batch.micro=1", "parallel.dp=4",
               "parallel.zero=3"]
    with pytest.raises(ConfigError, match=r"model.capacity_factor=1.25: the dry run cannot play the GPT's token drop"):
        dry_run(load_config(None, gpt_moe))
    (role,) = dry_run(load_config(None, [*gpt_moe, "model.capacity_factor=0"])).roles  # dropless: played
    assert role.memory["Activation"] > 0


def cli(*args: str, home=None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "WORKBENCH_HOME": str(home)} if home else dict(os.environ)
    return subprocess.run([sys.executable, "-m", "workbench.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.mark.slow
def test_workbench_dryrun_prints_the_simulators_figures_beside_its_own(tmp_path):
    """fp32, ZeRO-3: the simulator's dp bytes (2 gathers + 1 reduce-scatter of the parameters per
    micro-batch) are the dry run's, less the loss all-reduce; memory rows carry both columns."""
    from types import SimpleNamespace

    from workbench.cli_common import console
    from workbench.cli_dryrun import _print_report

    config = tmp_path / "c.yaml"
    config.write_text(f"model: {{hf: {json.dumps(HF)}, seq_len: 32}}\ndata: {{source: synthetic}}\n"
                      "parallel: {dp: 2, zero: 3}\nbatch: {global: 8, micro: 1}\nprecision: fp32\n")
    out = cli("dryrun", str(config), "--world", "8", "--json", "--device-memory", "0.0001", home=tmp_path)
    assert out.returncode == 2 and "peaks at" in out.stderr and "Traceback" not in out.stderr
    report = json.loads(out.stdout)
    (role,) = report["roles"]
    assert report["layout"]["dp"] == 8 and report["fits"] is False and "peaks at" in report["refusal"]
    (dp,) = [row for row in role["comm"] if row["axis"] == "dp"]
    loss = dp["ops"]["all_reduce"]["bytes"]
    assert dp["dry_run"] - loss == pytest.approx(dp["simulator"], rel=1e-3)
    rows = {row["category"]: row for row in role["memory"]}
    assert set(rows) >= {"params", "grads", "optimizer", "activations"}
    assert all(rows[c]["simulator"] is not None for c in ("params", "grads", "optimizer", "activations", "temp"))
    assert all(rows[c]["simulator"] > 0 for c in ("params", "optimizer", "activations"))
    # the simulator prices fp32 ZeRO-3 at the end of the forward (one micro-batch: no gradient yet), the dry run
    # peaks inside the backward: categories trade places, the totals agree (5.16 against 5.02 MB)
    simulated, measured = (sum(row[k] or 0.0 for row in rows.values()) for k in ("simulator", "dry_run"))
    assert simulated == pytest.approx(measured, rel=0.10)
    with console.capture() as captured:
        _print_report(SimpleNamespace(name="c"), report)
    text = captured.get()
    assert "simulator (GiB)" in text and "Sharded Param" in text and "sent or reduced" in text


def test_workbench_dryrun_judges_device_memory_with_the_cuda_context_and_nccl_buffers_beside_the_peak(tmp_path):
    """tiny (dp 2) on dgx-h100: a rank holds the preset's CUDA context (0.47 GiB) and one data-parallel
    communicator's buffers (32 channels x 2 connections x 10 MiB) beside its tensors, which the dry run does not
    see. A device between the peak and the peak plus those is refused, as plan's dry runs refuse it."""
    runtime = 0.47 * 2**30 + 32 * 2 * 10 * 2**20
    fits = cli("dryrun", "examples/tiny.yaml", "--json", home=tmp_path)
    assert fits.returncode == 0, fits.stderr[-2000:]
    report = json.loads(fits.stdout)
    peak = max(role["peak"] for role in report["roles"])
    assert report["runtime_bytes"] == pytest.approx(runtime)
    between = (peak + runtime / 2) / 2**30
    out = cli("dryrun", "examples/tiny.yaml", "--device-memory", f"{between:.6f}", home=tmp_path)
    assert out.returncode == 2, out.stdout[-2000:]
    line = out.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert f"beside the {runtime / 2**30:.2g} GiB of CUDA context and NCCL buffers a rank holds (priced)" in line
    roomy = cli("dryrun", "examples/tiny.yaml", "--device-memory", f"{(peak + runtime) / 2**30 + 0.01:.6f}",
                home=tmp_path)
    assert roomy.returncode == 0, roomy.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.xdist_group("launch")
def test_run_refuses_a_config_that_would_not_fit_before_any_rank_starts(tmp_path):
    """--device-memory: the launcher dry-runs the config first; a busiest rank above it is refused in
    one line naming the category that dominates and the figures, and no run is registered."""
    out = cli("run", "examples/tiny.yaml", "--set", "parallel.zero=3", "--device-memory", "0.001", home=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    line = out.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert "the dry run of rank 0 (pp 0, dp 0, tp 0) peaks at" in line and "activations" in line
    assert "GiB the largest, more than the 0.001 GiB device memory (--device-memory)" in line
    assert not (tmp_path / "runs").exists()


def test_the_preflight_dry_runs_ddp_and_judges_what_it_cannot_play_by_the_analytic_estimate():
    """DDP (dp 2) is dry-run; the GPT's token-dropping MoE, which the dry run cannot play, is refused by
    engine/train/memory.py's estimate."""
    from engine.train.dryrun import preflight

    with pytest.raises(ConfigError, match=r"the dry run of rank 0 \(pp 0, dp 0, tp 0\) peaks at .* more than the 0.001"):
        preflight(load_config("examples/tiny.yaml"), device_memory_gib=0.001)
    with pytest.raises(ConfigError, match=r"needs an estimated .* GiB per rank .* more than the 0.001 GiB device memory"):
        preflight(load_config("examples/tiny.yaml", ["model.experts=4"]), device_memory_gib=0.001)


def test_a_cpu_run_without_a_device_target_is_not_dry_run(monkeypatch):
    """The pre-flight stays free for CPU runs: no device memory known, nothing is dry-run."""
    import engine.train.dryrun as dryrun

    monkeypatch.setattr(dryrun, "dry_run_subprocess", lambda cfg: pytest.fail("dry-ran a CPU run"))
    assert dryrun.preflight(load_config("examples/tiny.yaml", ["backend=gloo"])) is None
    assert dryrun.device_memory_target(load_config("examples/tiny.yaml", ["backend=gloo"])) is None
    limit, name = dryrun.device_memory_target(load_config("examples/tiny.yaml", ["cluster.gpus_per_node=2"]))
    assert limit == pytest.approx(79.65 * 2**30, rel=1e-3) and "80 GB-class" in name


@pytest.mark.parametrize("zero", [0, 1])
def test_ddp_and_zero1_play_their_gradients_and_sharded_states(zero):
    """DDP (zero 0/1 without tp; issue 62 item 5's megatron pick, cp2 x dp ZeRO-1): each gradient is held
    once and all-reduced once over dp x cp (the parameters' fp32 bytes), ZeRO-1's AdamW states are this
    rank's share of dp x cp = 4 (+ its step counters). Refused before (the DDP reducer needs real storage)."""
    from engine.model.shapes import from_hf_config
    from engine.train.dryrun import dry_run

    psi_bytes = 4 * from_hf_config(HF).params
    (role,) = dry_run(_cfg("parallel.dp=2", "parallel.cp=2", "batch.global=4", f"parallel.zero={zero}")).roles
    assert role.memory["Parameter"] == psi_bytes and role.memory["Gradient"] == psi_bytes
    assert role.collectives["dp_cp:all_reduce"]["bytes"] == psi_bytes + 8  # + the loss (float64)
    states = role.memory["Optstate"]
    assert states == pytest.approx(2 * psi_bytes / (4 if zero == 1 else 1), rel=0.05)


def test_one_process_answers_several_dry_runs_as_this_process_does_and_survives_a_failure(tmp_path):
    """`plan --dry-run K` dry-runs its K layouts in one process (DryRunProcess: the imports paid once, not K times):
    each answer equals `dry_run` here; a config that fails there is a RuntimeError with its last line and the same
    process answers the next; a process that died is replaced at the next call."""
    from engine.train.dryrun import DryRunProcess, dry_run

    def same(result) -> list:
        return [(r.coords, r.peak, r.memory, r.collectives) for r in result.roles]

    zero3, tp2 = _cfg("parallel.dp=4", "parallel.zero=3", "batch.global=4"), _cfg("parallel.tp=2", "batch.global=1")
    (tmp_path / "config.json").write_text(json.dumps(HF))
    gone = load_config(None, [f"model.hf={tmp_path}", *BASE[1:]])
    (tmp_path / "config.json").unlink()  # the process reads the model's config.json again: now it is not there
    with DryRunProcess() as run:
        assert same(run(zero3)) == same(dry_run(zero3))
        pid = run._proc.pid
        with pytest.raises(RuntimeError, match=r"(?s)the dry run failed: .*ConfigError: model.hf="):
            run(gone)
        assert same(run(tp2)) == same(dry_run(tp2)) and run._proc.pid == pid
        run._proc.kill()
        run._proc.wait()
        assert same(run(tp2)) == same(dry_run(tp2)) and run._proc.pid != pid
