"""Ranks started by the suite and by `workbench commbench` rendezvous on a store their launcher
hosts, so a second suite or run that takes a port between its pick and rank 0's bind cannot
fail them (EADDRINUSE, seen with two suites at once)."""
from __future__ import annotations

import socket

import pytest

import parallel_harness
import profilers.commbench as commbench
from parallel_harness import run_ranks
from profilers.rendezvous import hosted_store


@pytest.fixture
def taken_port(monkeypatch):
    """A port another process took after it was picked as free: every old pick returns it."""
    with socket.create_server(("127.0.0.1", 0)) as thief:
        port = thief.getsockname()[1]
        # the old launchers picked with these, then let rank 0 bind the port later
        monkeypatch.setattr(parallel_harness, "free_port", lambda: port, raising=False)
        monkeypatch.setattr(commbench, "_free_port", lambda: port, raising=False)
        yield port


def _world_sum(rank: int, world_size: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def test_run_ranks_starts_when_a_picked_port_was_taken(taken_port):
    assert run_ranks(2, _world_sum, timeout=60) == [3.0, 3.0]


def test_commbench_starts_when_a_picked_port_was_taken(taken_port):
    rows = commbench.spawn_commbench(2, ops=("all_reduce",), sizes=[1024], iters=1, timeout=120)
    assert [r["size"] for r in rows] == [1024]


def test_the_hosted_store_binds_its_port_before_it_hands_it_out():
    with hosted_store(2, timeout_s=10) as env:
        port = int(env["MASTER_PORT"])
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_a_server_port_is_free_and_below_the_range_bind_0_and_connections_draw_from():
    from ports import ephemeral_range, server_port

    first_ephemeral, _ = ephemeral_range()
    ports = {server_port() for _ in range(20)}
    assert all(10000 <= p < first_ephemeral for p in ports), ports
    assert len(ports) > 1  # drawn at random: two suites at once do not walk the same ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))
