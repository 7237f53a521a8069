"""The torchrun command line of a run: what the local launcher starts on each node and the Slurm
launcher's srun starts once per node (and what `workbench export --format torchrun` prints)."""
from __future__ import annotations

import sys
from pathlib import Path


RDZV_TIMEOUT_S = 300.0  # a multi-node run's nodes must all join the rendezvous within this (torchrun's own: 600)


def torchrun_command(cfg_path: Path, run_dir: Path, *, nproc: int, nnodes: int = 1, node_rank: int | None = 0,
                     rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                     rdzv_timeout_s: float = RDZV_TIMEOUT_S) -> list[str]:
    """The exact torchrun command line of a run (also what `workbench export --format torchrun` prints).
    node_rank=None leaves node ranks to the c10d rendezvous (one srun task per node starts the same line);
    a node gives up when not every node joined within rdzv_timeout_s."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--max-restarts=0"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}"] + ([f"--node-rank={node_rank}"] if node_rank is not None else [])
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        cmd += [f"--rdzv-id={rdzv_id}"] if rdzv_id else []
        # node 0 hosts the rendezvous store, the others never: torchrun guesses it by host name, so a node
        # whose name resolves to another interface (a namespace) would not host, and on one machine every
        # node would try to (the first to bind wins and node 0 fails: EADDRINUSE)
        conf = ([f"is_host={int(node_rank == 0)}"] if node_rank is not None else []) + \
            [f"join_timeout={rdzv_timeout_s:.0f}"]
        cmd += [f"--rdzv-conf={','.join(conf)}"]
        if node_rank is not None and "$" not in rdzv_endpoint:  # the address peers reach this node by
            cmd += [f"--local-addr={route_source(rdzv_endpoint)}"]
    return cmd + ["-m", "engine.launch.worker", "--config", str(cfg_path), "--run-dir", str(run_dir)]


def route_source(endpoint: str) -> str:
    """This machine's address on the route to `endpoint` ('host:port'): what the other nodes reach it by.
    torchrun would advertise its host name, which may resolve to another interface (or none the peers see)."""
    import socket

    host = endpoint.rpartition(":")[0] or endpoint
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))  # UDP: no packet is sent, the kernel only picks the route
            return s.getsockname()[0]
        except OSError:
            return socket.gethostname()
