"""The launcher's agent server (engine/launch/agent_server.py): the runs one process launches share it, each agent it
forks is the one `python -m engine.launch.agent` would have been (its run's command line, session and result), and
a server that dies takes its run down with it: the run fails, nothing is left, the next run starts a new one."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil
import pytest

from engine.config.schema import load_config
from engine.launch.agent_server import agent_server_pid
from engine.launch.local import launch
from tests.processes import processes_naming

TINY = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=32", "model.vocab=256",
        "train.steps=3", "train.warmup_steps=0", "batch.global=8", "batch.micro=4", "parallel.dp=2",
        "profile.host_interval_s=0", "profile.nvml_interval_s=0"]


@pytest.fixture(autouse=True)
def _default_start(monkeypatch):
    monkeypatch.delenv("WORKBENCH_RANK_START", raising=False)
    monkeypatch.delenv("WORKBENCH_AGENT_START", raising=False)


def _agents_seen(seen: dict[int, dict], done: threading.Event) -> None:
    """Until `done`: each child of this process's agent server, its parent, session, command line as words and
    whether it is an interpreter of its own (a command line of several arguments, not a title)."""
    while not done.wait(0.05):
        server = agent_server_pid()
        if server is None:
            continue
        try:
            for proc in psutil.Process(server).children():
                words = " ".join(proc.cmdline()).split()
                if "engine.launch.agent" in words:
                    with open(f"/proc/{proc.pid}/cmdline", "rb") as cmdline:  # a title is one string
                        interpreter = cmdline.read().rstrip(b"\0").count(b"\0") > 0
                    seen[proc.pid] = {"server": server, "words": words, "sid": os.getsid(proc.pid),
                                      "interpreter": interpreter}
        except (psutil.Error, OSError):  # ended meanwhile (its /proc files gone: FileNotFoundError)
            continue


def _watched(fn):
    seen: dict[int, dict] = {}
    done = threading.Event()
    watcher = threading.Thread(target=_agents_seen, args=(seen, done))
    watcher.start()
    try:
        return fn(), seen
    finally:
        done.set()
        watcher.join()


@pytest.mark.xdist_group("launch")
def test_a_launchers_runs_share_one_server_and_each_agent_is_its_runs(tmp_path):
    cfg = load_config(None, TINY)
    results, seen = _watched(lambda: [launch(cfg, home=tmp_path) for _ in range(2)])
    assert [r.status for r in results] == ["completed", "completed"]
    assert all(len(r.steps) == 3 for r in results)  # the ranks reached the run's telemetry: its environment
    assert len(seen) == 2, seen  # one agent per run
    assert len({agent["server"] for agent in seen.values()}) == 1  # both forked by the same server
    configs = {str(r.run_dir / "config.json") for r in results}
    for pid, agent in seen.items():
        assert agent["words"][1:3] == ["-m", "engine.launch.agent"], agent
        assert agent["words"][agent["words"].index("--config") + 1] in configs
        assert agent["sid"] == pid  # a session of its own: the launcher stops the run by it
        assert not agent["interpreter"]


@pytest.mark.xdist_group("launch")
def test_a_server_killed_mid_run_fails_that_run_leaves_nothing_and_the_next_run_starts_another(tmp_path):
    killed: list[int] = []

    def kill_server(_step) -> None:
        if not killed:
            killed.append(agent_server_pid())
            os.kill(killed[0], signal.SIGKILL)

    cfg = load_config(None, TINY + ["train.steps=400"])
    started = time.time()
    result = launch(cfg, home=tmp_path, on_progress=kill_server, raise_on_failure=False, timeout_s=240)
    assert killed and result.status == "failed", result
    assert time.time() - started < 120
    deadline = time.time() + 10
    while processes_naming(str(result.run_dir)) and time.time() < deadline:
        time.sleep(0.2)
    assert processes_naming(str(result.run_dir)) == []  # the agent and its ranks went with the server
    again = launch(load_config(None, TINY), home=tmp_path)
    assert again.status == "completed"
    assert agent_server_pid() not in (None, killed[0])


LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}


@pytest.mark.xdist_group("launch")
def test_the_server_imports_a_transformers_model_once_for_its_runs_which_train_as_a_fresh_agents_do(tmp_path,
                                                                                                  monkeypatch):
    """The server imports what a `model.hf` run's agent would (transformers and the model's class, 1.8 s of CPU)
    before it forks the agent, once for every later run; a run with other transformers settings (read as
    transformers is imported) gets an agent started as an interpreter of its own, but not for HF_HUB_OFFLINE, which
    the engine sets itself (validating hf_weights sets it in the launcher). All three train alike."""
    cfg = load_config(None, TINY + ["model.dropout=0", f"model.hf={json.dumps(LLAMA)}"])
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def two_runs() -> list:
        first = launch(cfg, home=tmp_path)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as engine/config/hf_checks.py does in the launcher
        return [first, launch(cfg, home=tmp_path)]

    (first, second), seen = _watched(two_runs)
    with open(f"/proc/{agent_server_pid()}/maps") as maps:
        assert "/safetensors/" in maps.read()  # transformers' model code (it loads safetensors' library)
    (other,), seen_other = _watched(lambda: [launch(cfg, home=tmp_path,
                                                    extra_env={"TRANSFORMERS_VERBOSITY": "error"})])
    assert [r.status for r in (first, second, other)] == ["completed"] * 3
    assert [agent["interpreter"] for agent in seen.values()] == [False, False]  # forked
    assert [agent["interpreter"] for agent in seen_other.values()] == [True]
    losses = [[step["loss"] for step in r.steps] for r in (first, second, other)]
    assert len(losses[0]) == 3 and losses[0] == losses[1] == losses[2], losses
