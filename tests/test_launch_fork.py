"""The local launcher's ranks on CPU fork from torch's elastic agent (engine/launch/agent.py): which runs do, that
they really are forked, and that they train exactly as ranks torchrun starts as interpreters of their own."""
from __future__ import annotations

import psutil
import pytest

from engine.config.schema import load_config
from engine.launch.agent import fork_arguments
from engine.launch.local import forks_ranks, launch
from engine.launch.torchrun import torchrun_command

TINY = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=32", "model.vocab=256", "model.dropout=0.1",
        "train.steps=4", "train.lr=0.003", "train.warmup_steps=0", "train.weight_decay=0.1", "batch.global=8",
        "batch.micro=4", "parallel.dp=2", "profile.host_interval_s=0", "profile.nvml_interval_s=0"]


def test_single_node_gloo_forks_and_nccl_or_several_nodes_do_not(monkeypatch):
    monkeypatch.delenv("WORKBENCH_RANK_START", raising=False)
    gloo, nccl = load_config(None, TINY + ["backend=gloo"]), load_config(None, TINY + ["backend=nccl"])
    assert forks_ranks(gloo, nnodes=1, rdzv_endpoint=None)
    assert not forks_ranks(nccl, nnodes=1, rdzv_endpoint=None)
    assert not forks_ranks(gloo, nnodes=2, rdzv_endpoint="10.0.0.1:29400")
    assert not forks_ranks(gloo, nnodes=1, rdzv_endpoint="10.0.0.1:29400")
    monkeypatch.setenv("WORKBENCH_RANK_START", "spawn")
    assert not forks_ranks(gloo, nnodes=1, rdzv_endpoint=None)


def test_the_agent_keeps_torchruns_arguments_and_runs_only_the_worker(tmp_path):
    import engine.launch.worker as worker

    line = torchrun_command(tmp_path / "config.json", tmp_path, nproc=2)[3:]  # after `python -m torch.distributed.run`
    args = fork_arguments(line)
    assert args[:2] == ["--start-method=fork", "--run-path"]
    at = args.index(worker.__file__)
    assert args[2:at] == line[:line.index("-m")]  # torchrun's own options unchanged
    assert args[at + 1:] == ["--config", str(tmp_path / "config.json"), "--run-dir", str(tmp_path)]
    with pytest.raises(ValueError, match="runs `-m engine.launch.worker` only"):
        fork_arguments(line[:-5] + ["-m", "somebody.else"])


def _words(proc: psutil.Process) -> list[str]:
    """A process's command line as words: a forked agent's is its title, one string (engine/launch/agent_server.py)."""
    return " ".join(proc.cmdline()).split()


def _rank_command_lines() -> set[str]:
    """Options 1-2 of each live process whose parent is the launcher's agent (ours or torchrun)."""
    lines = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            parent = _words(proc.parent())
            if "engine.launch.agent" in parent or "torch.distributed.run" in parent:
                lines.add(" ".join(_words(proc)[1:3]))
        except (psutil.Error, AttributeError):  # exited meanwhile
            continue
    return lines


@pytest.mark.xdist_group("launch")
def test_forked_ranks_train_exactly_as_spawned_ones(tmp_path, monkeypatch):
    """With dropout and weight decay: both ways give the same losses, bit for bit; while the run goes on, its
    ranks are the agent's forks (their command line is the agent's) or torchrun's interpreters."""
    import threading

    seen: dict[str, set[str]] = {}

    def losses(start: str) -> list[float]:
        monkeypatch.setenv("WORKBENCH_RANK_START", start)
        lines, done = seen.setdefault(start, set()), threading.Event()

        def look() -> None:
            while not done.wait(0.05):
                lines.update(_rank_command_lines())

        watcher = threading.Thread(target=look)
        watcher.start()
        try:
            result = launch(load_config(None, TINY), home=tmp_path)
        finally:
            done.set()
            watcher.join()
        assert result.status == "completed"
        return [s["loss"] for s in result.steps]

    forked, spawned = losses("fork"), losses("spawn")
    assert len(forked) == 4 and forked == spawned
    assert seen["fork"] == {"-m engine.launch.agent"}, seen
    # torchrun's ranks are interpreters of their own (`python -u -m engine.launch.worker`); a look between
    # torchrun's fork and its exec sees the agent's own line
    assert "-u -m" in seen["spawn"] and seen["spawn"] <= {"-u -m", "-m torch.distributed.run"}, seen

def _die(index: int) -> None:
    import os
    import signal
    import time

    if index == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer ends a rank
    time.sleep(0.3)  # rank 0 then ends on its own, as it does when its peer's connection drops
    raise SystemExit(1)


def test_the_agent_names_the_killed_rank_behind_a_rank_that_exited_after_it(tmp_path, monkeypatch, capsys):
    """Both ranks have ended when the agent next polls: torch's join names rank 0 (exit 1) alone; the agent's
    report names rank 1's SIGKILL too, and the launcher's root cause is rank 1."""
    import time

    from torch.multiprocessing import ProcessContext, start_processes

    from engine.launch.agent import report_each_failed_rank
    from engine.launch.run_record import first_failure

    monkeypatch.setattr(ProcessContext, "join", ProcessContext.join)  # put back after the test
    report_each_failed_rank()
    context = start_processes(_die, nprocs=2, join=False, start_method="fork")
    deadline = time.time() + 30
    while any(p.is_alive() for p in context.processes) and time.time() < deadline:
        time.sleep(0.05)
    with pytest.raises(Exception, match="process 0 terminated with exit code 1"):
        context.join()
    failure = first_failure(tmp_path, capsys.readouterr().out)
    assert (failure.rank, failure.reason) == (1, "killed by signal 9 (SIGKILL)")


@pytest.mark.xdist_group("launch")
def test_a_rank_that_finished_goes_with_its_agent_when_the_launcher_dies(tmp_path):
    """A forked rank that finished waits for the agent to read its result. When the launcher is killed first, the
    agent gets SIGTERM (its PDEATHSIG) and stops its ranks: that rank, done training (so past ignoring SIGTERM
    while it records its outcome), must go at once, not hold the agent for torch's 30 s grace before its SIGKILL
    (seen in a fresh-clone run: a tuner SIGKILLed mid-trial left the agent and its rank 15 s later)."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from profilers.store import RunStore

    config = tmp_path / "config.json"
    config.write_text(json.dumps(load_config(None, TINY + ["parallel.dp=1", "train.steps=2"]).to_dict()))
    line = torchrun_command(config, tmp_path / "run", nproc=1)
    agent_line = [sys.executable, "-m", "engine.launch.agent", "--monitor-interval=120"] + line[3:]
    env = {**os.environ, "WORKBENCH_HOME": str(tmp_path), "WORKBENCH_RUN_ID": "finished", "OMP_NUM_THREADS": "1"}
    env.pop("WORKBENCH_TELEMETRY", None)  # the rank records the run itself, as under an outside torchrun
    agent = subprocess.Popen(agent_line, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        deadline = time.time() + 120
        with RunStore.open_home(tmp_path) as store:
            while time.time() < deadline and (store.run("finished") or {}).get("status") != "completed":
                assert agent.poll() is None, "the agent ended before its rank finished"
                time.sleep(0.2)
        ranks = psutil.Process(agent.pid).children()
        assert len(ranks) == 1, "the rank finished and waits for the agent (which polls every 120 s)"
        os.kill(agent.pid, signal.SIGTERM)  # what the agent gets when its launcher dies
        started = time.time()
        agent.wait(timeout=60)
        took = time.time() - started
        assert took < 10, f"the agent took {took:.1f} s to stop a rank that had finished"
        assert not ranks[0].is_running() or ranks[0].status() == psutil.STATUS_ZOMBIE
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)


def test_the_agent_imports_what_the_runs_ranks_need_once_for_them(tmp_path):
    """Before forking, the agent imports torch's pipelining for pp > 1 and, for `model.hf`, transformers and the
    model's class (each rank spent 1.8 s of CPU on it); for a dp run of the engine's own GPT neither; a config it
    cannot read is the ranks' to report, not the agent's failure."""
    import json
    import subprocess
    import sys

    llama = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
    configs = {"hf": TINY + ["model.dropout=0", f"model.hf={json.dumps(llama)}"], "gpt": TINY,
               "pp": TINY + ["parallel.dp=1", "parallel.pp=2"]}
    for name, overrides in configs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(load_config(None, overrides).to_dict()))
    probe = ("import sys; from engine.launch.agent import import_what_the_run_needs as f; "
             "f(['--config', sys.argv[1]]); print(sorted(m for m in ('transformers', "
             "'transformers.models.llama.modeling_llama', 'torch.distributed.pipelining') if m in sys.modules))")
    imported = {name: subprocess.run([sys.executable, "-c", probe, str(tmp_path / f"{name}.json")], text=True,
                                     capture_output=True, check=True).stdout.strip()
                for name in ("hf", "gpt", "pp", "missing")}
    assert imported == {"hf": "['transformers', 'transformers.models.llama.modeling_llama']", "gpt": "[]",
                        "pp": "['torch.distributed.pipelining']", "missing": "[]"}
