"""Holmes vs naive placement over kernel-shaped links (issue 39): bench/heterogeneous.py's pp=2 x dp=2
job on 4 "nodes" (network namespaces, one rank each, tests/netns.py), where the kernel, not the
Python emulator, holds the links: nodes {0, 2} form group "ib" and {1, 3} group "eth", and every
packet between the groups leaves its node through an htb class held to `--inter-gbps` (unshaped
inside a group). The engine still gets `link.groups` (placement needs them), at rates so high that
the emulator adds no wait. Each round launches both placements through the product's multi-node
command (`workbench run --nnodes 4 --node-rank i`), interleaved; prints measured tokens/s (medians),
the ratio, and the simulator's predicted ratio beside it (the same prediction as the emulated bench).

    sudo python -m bench.holmes_links [--rounds 3] [--steps 7] [--inter-gbps 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from bench.heterogeneous import BASE, PLACEMENTS, predicted  # noqa: E402

GROUPS = {"ib": [0, 2], "eth": [1, 3]}  # nodes (= ranks: one rank per node) of each group
# placement reads the groups; rates this high make the emulator's wait zero: the kernel shapes the links
UNEMULATED = ["link.groups=[" + ", ".join(f"{{name: {n}, ranks: {r}, gbps: 100000, latency_us: 0}}"
                                          for n, r in GROUPS.items()) + "]",
              "link.inter_gbps=100000", "link.inter_latency_us=0"]


def shape_between_groups(cluster, rate: str) -> None:
    """On every node's interface: htb, unshaped by default, `rate` for packets to the other group."""
    group_of = {node: name for name, nodes in GROUPS.items() for node in nodes}
    for i in range(cluster.nodes):
        dev, ns = cluster.iface(i), cluster.ns(i)

        def tc(*args: str) -> None:
            subprocess.run(["tc", "-n", ns, *args], check=True, capture_output=True, timeout=30)

        tc("qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
        tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", "100gbit")
        tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", rate, "burst", "512kb",
           "cburst", "512kb")
        for j in range(cluster.nodes):
            if group_of[j] != group_of[i]:
                tc("filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip",
                   "dst", f"{cluster.addr(j)}/32", "flowid", "1:20")


def tcp_gbps(cluster, src: int, dst: int, mb: int = 64) -> float:
    """Gbit/s of one TCP stream from node src to node dst (checks the shaping)."""
    server = (f"import socket,time\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
              f"s.bind(('{cluster.addr(dst)}',5099));s.listen(1);c,_=s.accept();n=0;t=time.perf_counter()\n"
              f"while True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\n"
              f"print(n*8/(time.perf_counter()-t)/1e9)")
    client = (f"import socket,time\nfor _ in range(50):\n try:\n  s=socket.create_connection(('{cluster.addr(dst)}',5099));break\n"
              f" except OSError: time.sleep(0.1)\nb=bytes(1<<20)\nfor _ in range({mb}): s.sendall(b)\ns.close()")
    srv = subprocess.Popen(cluster.command(dst, [sys.executable, "-c", server]), stdout=subprocess.PIPE, text=True)
    subprocess.run(cluster.command(src, [sys.executable, "-c", client]), check=True, timeout=120)
    return float(srv.communicate(timeout=120)[0])


def measure(cluster, name: str, steps: int, home: Path, port: int) -> tuple[float, dict[int, int]]:
    """Tokens/s of one 4-node launch and each rank's node (as the store recorded it)."""
    from profilers.store import RunStore

    run_id = f"holmes-links-{name}-{port}"
    overrides = [o for o in BASE if not o.startswith(("link.groups", "link.inter"))] + UNEMULATED
    overrides += PLACEMENTS[name] + [f"train.steps={steps}"]
    procs = []
    for i in range(cluster.nodes):
        args = [sys.executable, "-m", "workbench.cli", "--home", str(home), "run", "examples/tiny.yaml", "--json",
                "--nnodes", str(cluster.nodes), "--node-rank", str(i), "--rdzv-endpoint",
                f"{cluster.addr(0)}:{port}", "--run-id", run_id, "--timeout", "600"]
        for o in overrides:
            args += ["--set", o]
        env = {**os.environ, **cluster.env(i), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        procs.append(cluster.popen(i, args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True))
        time.sleep(0.5)
    outs = [p.communicate(timeout=900) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{name}: a node failed: " + " | ".join(o[1][-800:] for o in outs))
    store = RunStore.open_home(home)
    run = store.run(run_id)
    nodes = {r.rank: int(r.value) for r in store.metrics(run_id, kind="node", name="node_rank")}
    tokens = run["config"]["batch"]["global"] * run["config"]["model"]["seq_len"]
    return tokens / float(run["summary"]["step_time_s"]), nodes


def main() -> None:
    from netns import NetnsCluster, free_port

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--inter-gbps", type=float, default=1.0, help="the kernel-shaped link between the groups")
    args = ap.parse_args()
    print(f"host: {os.cpu_count()} cpus, load1 {os.getloadavg()[0]:.1f} at start; groups {GROUPS}; "
          f"{args.inter_gbps} Gbit/s between them (htb), unshaped inside", flush=True)
    sim = predicted(args.steps, [f"link.inter_gbps={args.inter_gbps}"])
    cluster = NetnsCluster(nodes=4).start()
    try:
        shape_between_groups(cluster, f"{int(args.inter_gbps * 1000)}mbit")
        print(f"TCP check: across groups (0->1) {tcp_gbps(cluster, 0, 1):.2f} Gbit/s, inside a group (0->2) "
              f"{tcp_gbps(cluster, 0, 2):.2f} Gbit/s", flush=True)
        got: dict[str, list[float]] = {name: [] for name in PLACEMENTS}
        with tempfile.TemporaryDirectory(prefix="bench-holmes-links-") as tmp:
            for r in range(args.rounds):
                for name in PLACEMENTS:
                    t0 = time.perf_counter()
                    tps, nodes = measure(cluster, name, args.steps, Path(tmp), free_port())
                    if nodes != {0: 0, 1: 1, 2: 2, 3: 3}:
                        raise RuntimeError(f"ranks landed on nodes {nodes}, not rank i on node i: the groups are wrong")
                    got[name].append(tps)
                    print(f"round {r + 1} {name:7s} {tps:8.1f} tokens/s ({time.perf_counter() - t0:.0f} s, load1 "
                          f"{os.getloadavg()[0]:.1f})", flush=True)
    finally:
        cluster.stop()
    med = {name: statistics.median(v) for name, v in got.items()}
    ratio, sim_ratio = med["holmes"] / med["naive"], sim["holmes"]["tokens_per_s"] / sim["naive"]["tokens_per_s"]
    print(f"\n{'placement':10s} {'measured tok/s':>15s} {'simulated tok/s':>16s}")
    for name in PLACEMENTS:
        print(f"{name:10s} {med[name]:15.1f} {sim[name]['tokens_per_s']:16.1f}")
    print(f"\nholmes / naive tokens/s over kernel-shaped links: measured {ratio:.2f}x, simulated {sim_ratio:.2f}x; "
          f"simulated ratio off by {100 * (sim_ratio - ratio) / ratio:+.1f}%")


if __name__ == "__main__":
    main()
