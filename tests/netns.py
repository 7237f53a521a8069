"""N "nodes" on one machine: Linux network namespaces joined by veth pairs through a bridge.

Node i is namespace `<prefix>n<i>` with interface `eth<i>` at 10.<net>.0.<i+1>/24; its veth peer sits
on a bridge in a namespace of its own (`<prefix>br`), so the host's own network is never touched.
`shape(i, "1gbit")` puts a tbf qdisc on both ends of node i's link (this kernel has no netem: latency
stays with the Python link emulator). Processes run on a node with `cluster.popen(i, cmd)` (`ip netns
exec`); the filesystem is shared, so a home folder on it is every node's.

By hand: `make netns N=2` (root) builds the nodes, prints how to start a run on each, and removes
them on Ctrl-C or SIGTERM. Needs root and iproute2; `NetnsUnavailable` says why not.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here; the message says why (tests skip with it)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {out.stderr.strip()}")
    return out


@dataclass
class NetnsCluster:
    """`nodes` namespaces on one bridge; `start()` builds them, `stop()` deletes every one."""

    nodes: int = 2
    prefix: str = field(default_factory=lambda: f"wb{uuid.uuid4().hex[:4]}")
    net: int = 77  # addresses 10.<net>.0.<i+1>
    made: list[str] = field(default_factory=list)

    def ns(self, i: int) -> str:
        return f"{self.prefix}n{i}"

    def addr(self, i: int) -> str:
        return f"10.{self.net}.0.{i + 1}"

    def iface(self, i: int) -> str:
        return f"eth{i}"

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}br"

    def start(self) -> NetnsCluster:
        if shutil.which("ip") is None:
            raise NetnsUnavailable("iproute2 (`ip`) is not installed")
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root; not root here")
        try:
            self._build()
        except BaseException:
            self.stop()
            raise
        return self

    def _build(self) -> None:
        br = self.bridge_ns
        _ip("netns", "add", br)
        self.made.append(br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns, peer = self.ns(i), f"{self.prefix}p{i}"
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("link", "add", peer, "type", "veth", "peer", "name", self.iface(i), "netns", ns)
            _ip("link", "set", peer, "netns", br)
            _ip("-n", br, "link", "set", peer, "master", "br0")
            _ip("-n", br, "link", "set", peer, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", self.iface(i))
            _ip("-n", ns, "link", "set", self.iface(i), "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def shape(self, i: int, rate: str, *, burst: str = "512kb", latency: str = "100ms") -> None:
        """tbf at `rate` on both directions of node i's link (its interface and the bridge port). At 1gbit a
        64kb burst delivered 0.28 Gbit/s here (the bucket empties between timer ticks); 512kb: 0.94."""
        for ns, dev in ((self.ns(i), self.iface(i)), (self.bridge_ns, f"{self.prefix}p{i}")):
            subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                            "burst", burst, "latency", latency], check=True, capture_output=True, timeout=30)

    def command(self, i: int, cmd: list[str]) -> list[str]:
        """`cmd` run inside node i's namespace."""
        return ["ip", "netns", "exec", self.ns(i), *cmd]

    def popen(self, i: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(i, cmd), **kwargs)

    def env(self, i: int) -> dict[str, str]:
        """Environment for node i's processes: gloo on the node's interface, not loopback."""
        return {"GLOO_SOCKET_IFNAME": self.iface(i), "TP_SOCKET_IFNAME": self.iface(i)}

    def reachable(self, src: int, dst: int, port: int = 9) -> bool:
        """Whether node src reaches node dst by TCP (a refused connection counts: the route works)."""
        code = (f"import socket\ns = socket.socket()\ns.settimeout(3)\n"
                f"try:\n    s.connect(('{self.addr(dst)}', {port}))\nexcept ConnectionRefusedError:\n    pass\n")
        out = subprocess.run(self.command(src, ["python3", "-c", code]), capture_output=True, timeout=30)
        return out.returncode == 0

    def stop(self) -> None:
        """Delete every namespace made (their veths go with them); they outlive the process otherwise."""
        for ns in reversed(self.made):
            _ip("netns", "del", ns, check=False)
        self.made.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> int:
    """Build N nodes (argv[0], default 2), print how to use them, remove them on a signal."""
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    cluster = NetnsCluster(nodes=int(argv[0]) if argv else 2)
    try:
        cluster.start()
        n = cluster.nodes
        print(f"{n} nodes: " + ", ".join(f"{cluster.ns(i)} {cluster.addr(i)} ({cluster.iface(i)})" for i in range(n)))
        print("On node I (one shell each):")
        print(f"  ip netns exec {cluster.prefix}nI env GLOO_SOCKET_IFNAME=ethI workbench --home /tmp/wb run "
              f"examples/tiny.yaml --nnodes {n} --node-rank I --rdzv-endpoint {cluster.addr(0)}:29400 --run-id tiny-netns")
        print(f"Shape a link: tc -n {cluster.prefix}nI qdisc replace dev ethI root tbf rate 1gbit burst 64kb latency 100ms")
        print("Ctrl-C removes the namespaces.", flush=True)
        while True:
            time.sleep(1)
    except NetnsUnavailable as exc:
        print(f"cannot build the nodes: {exc}")
        return 2
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()
        print("removed: no namespace left", flush=True)


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
