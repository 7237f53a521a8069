"""Multi-node for real on one machine: nodes as network namespaces (tests/netns.py), each node's ranks
started by its own `workbench run --nnodes 2 --node-rank I --rdzv-endpoint ADDR:PORT`, gloo over the
veth interfaces. Skipped with the reason where namespaces cannot be made (no root, no iproute2)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from profilers.store import RunStore
from tests.netns import NetnsCluster, NetnsUnavailable

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.xdist_group("launch"), pytest.mark.slow]
TINY = ["model.layers=1", "model.d_model=32", "model.heads=2", "model.seq_len=32", "batch.micro=2",
        "profile.host_interval_s=0", "profile.nvml_interval_s=0", "train.eval_interval=0", "parallel.dp=4",
        "batch.global=8", "train.timeout_s=60"]


@pytest.fixture
def nodes():
    cluster = NetnsCluster(nodes=2)
    try:
        cluster.start()
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    yield cluster
    cluster.stop()


def _node_run(cluster: NetnsCluster, i: int, home: Path, run_id: str, port: int, steps: int) -> subprocess.Popen:
    env = {**os.environ, **cluster.env(i), "OMP_NUM_THREADS": "1", "COLUMNS": "400", "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "workbench.cli", "--home", str(home), "run", "examples/tiny.yaml", "--json",
            "--nnodes", "2", "--node-rank", str(i), "--rdzv-endpoint", f"{cluster.addr(0)}:{port}",
            "--run-id", run_id, "--timeout", "240"]
    for override in TINY + [f"train.steps={steps}"]:
        args += ["--set", override]
    return cluster.popen(i, args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)


def _left(run_dir: Path) -> list[str]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if str(run_dir) in " ".join(p.info["cmdline"] or []):
                out.append(f"{p.pid} {' '.join(p.info['cmdline'])[:100]}")
        except psutil.Error:
            continue
    return out


@pytest.mark.timeout(600)
def test_two_nodes_of_two_ranks_run_over_the_namespace_network(nodes, tmp_path):
    assert nodes.reachable(0, 1) and nodes.reachable(1, 0)
    procs = [_node_run(nodes, i, tmp_path, "netns-ok", 29411, steps=4) for i in range(2)]
    outs = [p.communicate(timeout=400) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-3000:] for o in outs]
    store = RunStore.open_home(tmp_path)
    run = store.run("netns-ok")
    assert run["status"] == "completed" and run["world_size"] == 4
    nodes_of = {r.rank: int(r.value) for r in store.metrics("netns-ok", kind="node", name="node_rank")}
    assert sorted(nodes_of) == [0, 1, 2, 3] and sorted(nodes_of.values()) == [0, 0, 1, 1]
    steps = {(r.rank, r.step) for r in store.metrics("netns-ok", kind="step", name="loss")}
    assert steps == {(rank, step) for rank in range(4) for step in range(4)}
    assert len(store.runs()) == 1  # one run, both nodes' ranks in it


@pytest.mark.timeout(600)
def test_killing_one_nodes_torchrun_fails_the_run_naming_that_nodes_ranks(nodes, tmp_path):
    procs = [_node_run(nodes, i, tmp_path, "netns-kill", 29412, steps=100000) for i in range(2)]
    store, deadline = RunStore.open_home(tmp_path), time.time() + 300
    while time.time() < deadline and all(p.poll() is None for p in procs):  # until a step has landed
        if store.run("netns-kill") and store.latest_steps("netns-kill", n=1):
            break
        time.sleep(0.5)
    assert store.latest_steps("netns-kill", n=1), [p.communicate()[1][-2000:] for p in procs if p.poll() is not None]
    launcher = psutil.Process(procs[1].pid)
    torchrun = [c for c in launcher.children(recursive=True) if "torch.distributed.run" in " ".join(c.cmdline())]
    assert len(torchrun) == 1
    torchrun[0].send_signal(signal.SIGKILL)
    outs = [p.communicate(timeout=300) for p in procs]
    assert procs[1].returncode == 1, outs[1][1][-2000:]
    # node 0 fails because its peers are gone (a killed torchrun takes its ranks with it), not by its own
    # --timeout 240 while node 1's orphaned ranks trained on
    assert procs[0].returncode == 1 and "timed out after" not in outs[0][0] + outs[0][1], outs[0][1][-2000:]
    run = store.run("netns-kill")
    assert run["status"] == "failed"
    # the c10d rendezvous numbers the ranks in joining order: node 1's are whichever it recorded
    ranks = sorted(r.rank for r in store.metrics("netns-kill", kind="node", name="node_rank") if r.value == 1)
    assert len(ranks) == 2, ranks
    assert f"node 1 of 2 (vm, ranks {ranks[0]}, {ranks[1]})" in run["error"].replace(os.uname().nodename, "vm")
    assert "killed by signal 9 (SIGKILL)" in run["error"], run["error"]
    assert run["error_rank"] in ranks
    assert _left(tmp_path / "runs" / "netns-kill") == []
