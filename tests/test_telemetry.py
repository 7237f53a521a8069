"""Telemetry: real rank processes ship batches to one TelemetryServer writing the run store."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from profilers.records import Record
from profilers.store import RunStore
from profilers.telemetry import TelemetryClient, TelemetryServer

STEPS, PER_STEP = 30, 8


def _rank(address: str, token: str, rank: int, go_path: str) -> None:
    client = TelemetryClient(address, "run", rank, flush_interval=0.05, token=token)
    for step in range(STEPS):
        for i in range(PER_STEP):
            client.emit(step, "step", f"m{i}", step * 10 + i)
        time.sleep(0.03)
    deadline = time.time() + 30
    while not os.path.exists(go_path) and time.time() < deadline:  # stay open until told
        time.sleep(0.02)
    client.close()


def _poll(store: RunStore, until: int, timeout: float = 20.0) -> list[int]:
    counts, deadline = [], time.time() + timeout
    while time.time() < deadline:
        counts.append(len(store.metrics("run")))
        if counts[-1] >= until:
            break
        time.sleep(0.05)
    return counts


def test_two_ranks_all_records_arrive_and_rows_grow_live(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db")
    server = TelemetryServer(store, run_id="run")
    address = server.start()
    go = tmp_path / "go"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(address, server.token, r, str(go))) for r in range(2)]
    for p in procs:
        p.start()
    total = 2 * STEPS * PER_STEP
    counts = _poll(store, total)
    alive_at_end = all(p.is_alive() for p in procs)
    go.touch()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    server.stop()
    # every record arrived while the clients were still open, and the reader saw it grow
    assert counts[-1] == total and alive_at_end
    growing = sorted(set(c for c in counts if 0 < c < total))
    assert len(growing) >= 3, counts
    records = store.metrics("run")
    assert len(records) == total
    assert {(r.rank, r.step, r.name) for r in records} == {
        (rank, step, f"m{i}") for rank in range(2) for step in range(STEPS)
        for i in range(PER_STEP)}
    assert all(r.value == r.step * 10 + int(r.name[1:]) for r in records)
    assert server.records_written == total


def test_finished_step_becomes_visible(tmp_path: Path) -> None:
    """Each step's record reaches the store while the client is open (5 s: a hang guard); the
    lag against the 1 s target is a timing claim: bench/timing_claims.py telemetry."""
    store = RunStore(tmp_path / "runs.db")
    with TelemetryServer(store, run_id="run") as server:
        client = TelemetryClient(server.address, "run", 0, token=server.token)  # default flush_interval
        lags = []
        for step in range(3):
            emitted = time.time()
            client.emit(step, "step", "loss", 1.0)
            while not store.metrics("run", since_step=step - 1):
                assert time.time() - emitted < 5.0
                time.sleep(0.01)
            lags.append(time.time() - emitted)
        client.close()
    assert len(lags) == 3


def _killed_rank(address: str, token: str, progress_path: str) -> None:
    client = TelemetryClient(address, "run", 0, flush_interval=0.02, token=token)
    step = 0
    while True:  # runs until SIGKILL
        client.emit(step, "step", "loss", float(step))
        step += 1
        time.sleep(0.005)
        tmp = progress_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(client.delivered))
        os.replace(tmp, progress_path)


def test_sigkilled_client_keeps_flushed_batches(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db")
    server = TelemetryServer(store, run_id="run")
    address = server.start()
    progress = tmp_path / "delivered"
    proc = mp.get_context("spawn").Process(target=_killed_rank, args=(address, server.token, str(progress)))
    proc.start()
    deadline = time.time() + 30
    while time.time() < deadline:
        if progress.exists() and int(progress.read_text() or 0) >= 200:
            break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    delivered = int(progress.read_text())
    server.stop()
    steps = sorted(r.step for r in store.metrics("run"))
    assert delivered >= 200
    # every acknowledged batch survived the kill, once and in order: a prefix 0..k of steps
    assert len(steps) >= delivered
    assert steps == list(range(len(steps)))


def test_server_stop_drains_unacknowledged_batches(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db")
    server = TelemetryServer(store, run_id="run")
    host, port = server.start().split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(json.dumps({"token": server.token}).encode() + b"\n")
    lines = [json.dumps({"seq": s, "records": [["run", 1, s, "step", "loss", 0.5, 1.0]] * 4})
             for s in range(50)]
    sock.sendall(("\n".join(lines) + "\n").encode())
    server.stop()
    sock.close()
    assert len(store.metrics("run")) == 200


def test_direct_store_fallback_without_server(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    with TelemetryClient(None, "solo", 3, store_path=path, flush_interval=0.05) as client:
        client.emit_many(0, "breakdown", {"forward(s)": 0.1, "backward(s)": 0.2})
        client.record("host", "cpu(%)", 50.0)
    got = RunStore(path).metrics("solo")
    assert sorted((r.step, r.name, r.value, r.rank) for r in got) == [
        (-1, "cpu(%)", 50.0, 3), (0, "backward(s)", 0.2, 3), (0, "forward(s)", 0.1, 3)]


def test_unreachable_server_never_raises_into_training() -> None:
    with socket.socket() as sock:  # a port with nobody listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = TelemetryClient(f"127.0.0.1:{port}", "run", 0, flush_interval=0.05)
    client.emit(0, "step", "loss", 1.0)
    client.emit(1, "step", "loss", "not a number")  # type: ignore[arg-type]
    assert client.dropped == 1
    assert client.flush() is False
    t0 = time.time()
    client.close()
    assert time.time() - t0 < 5.0
    assert client.delivered == 0


def test_bad_address_is_rejected_up_front() -> None:
    with pytest.raises(ValueError, match="must be 'host:port'"):
        TelemetryClient("localhost", "run", 0)


def test_record_wire_format_round_trip() -> None:
    record = Record("r", 1, 2, "comm", "all_reduce/bytes", 4096.0, 12.5)
    assert Record.from_row(json.loads(json.dumps(record.to_list()))) == record


def _batch_lines(run_id: str, n: int) -> bytes:
    return "".join(json.dumps({"seq": s, "records": [[run_id, 9, s, "step", "loss", 6.66, 1.0]]}) + "\n"
                   for s in range(n)).encode()


def _try_to_write(address: str, opening: bytes) -> bytes:
    """Open a connection, send `opening` then ten batches, and return whatever the server answered."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        try:
            sock.sendall(opening + _batch_lines("intruder", 10))
            sock.shutdown(socket.SHUT_WR)
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
        except OSError:  # the server closed it under us: refused
            answer = b""
    return answer


def test_a_connection_without_the_runs_token_is_refused_counted_and_never_stored(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db")
    server = TelemetryServer(store, run_id="run")
    address = server.start()
    answers = [_try_to_write(address, b""),  # no token line: the first batch is taken as the opening
               _try_to_write(address, json.dumps({"token": "guess"}).encode() + b"\n"),
               _try_to_write(address, json.dumps({"token": server.token[:-1]}).encode() + b"\n"),
               _try_to_write(address, b"not json\n")]
    good = TelemetryClient(address, "run", 0, flush_interval=0.05, token=server.token)
    good.emit(0, "step", "loss", 1.0)
    assert good.flush() is True
    good.close()
    server.stop()
    assert answers == [b""] * 4  # no ack, no auth: nothing was taken
    assert server.connections_refused == 4
    assert store.metrics("intruder") == []
    assert [(r.rank, r.value) for r in store.metrics("run")] == [(0, 1.0)]
    assert server.records_written == 1


def test_a_client_with_the_wrong_token_keeps_its_records_and_never_raises(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db")
    with TelemetryServer(store, run_id="run") as server:
        client = TelemetryClient(server.address, "run", 0, flush_interval=0.05, token="wrong")
        client.emit(0, "step", "loss", 1.0)
        assert client.flush() is False
        client.close()
        refused = server.connections_refused
    assert refused >= 1 and client.delivered == 0
    assert store.metrics("run") == []


def test_the_server_binds_one_address_and_refuses_a_wildcard(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db")
    for wildcard in ("0.0.0.0", "::"):
        with pytest.raises(ValueError, match="is a wildcard; name the one address"):
            TelemetryServer(store, run_id="run", host=wildcard)
    with TelemetryServer(store, run_id="run", host="localhost") as server:
        assert server._listener is not None
        assert server._listener.getsockname()[0] == "127.0.0.1"
        assert server.address.startswith("127.0.0.1:")


def test_two_runs_tokens_differ() -> None:
    from profilers.telemetry import new_token

    tokens = {new_token() for _ in range(100)}
    assert len(tokens) == 100 and min(len(t) for t in tokens) >= 40


INTRUDER_MODULE = '''
import os

import torch

from profilers.telemetry import TOKEN_ENV, TelemetryClient


def build():
    """A rank of run A: with A's telemetry address and token, it writes a loss into run B first."""
    client = TelemetryClient(os.environ["WORKBENCH_TELEMETRY"], os.environ["WB_OTHER_RUN"], 0,
                             token=os.environ[TOKEN_ENV])
    client.emit(0, "step", "loss", 999.0)
    client.emit(1, "step", "loss", 998.0)
    client.close()
    model = torch.nn.Sequential(torch.nn.Embedding(100, 16), torch.nn.Flatten(), torch.nn.Linear(16 * 16, 5))
    x = torch.randint(0, 100, (16, 16), generator=torch.Generator().manual_seed(7))
    return model, torch.utils.data.TensorDataset(x, x.sum(dim=1) % 5)
'''


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_rank_of_one_run_cannot_write_into_another_run_on_a_shared_store(tmp_path, monkeypatch, backend):
    """A rank holds its run's telemetry token; the server takes records of its own run only and counts
    the others in the summary (telemetry_records_refused). Old code stored the rank's 999.0 in run B."""
    from contextlib import nullcontext

    from engine.config.schema import load_config
    from engine.launch.local import launch
    from profilers.store import RUNS_ENV
    from tests.pg_schema import pg_schema

    (tmp_path / "wb_intruder.py").write_text(INTRUDER_MODULE)
    with pg_schema() if backend == "postgresql" else nullcontext(None) as url:
        if url:
            monkeypatch.setenv(RUNS_ENV, url)
        store = RunStore.open_home(tmp_path)
        store.create_run("other-run", name="other", config={}, world_size=1)
        store.write([Record("other-run", 0, 0, "step", "loss", 1.0, time.time())])
        cfg = load_config(None, ["model.entry=wb_intruder:build", "train.steps=2", "batch.global=4", "batch.micro=4",
                                 "profile.host_interval_s=0", "profile.nvml_interval_s=0", "train.eval_interval=0"])
        path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
        result = launch(cfg, home=tmp_path, extra_env={"PYTHONPATH": path, "WB_OTHER_RUN": "other-run"},
                        timeout_s=240)
        assert [(r.step, r.value) for r in store.metrics("other-run")] == [(0, 1.0)]
        assert result.status == "completed" and [s["step"] for s in result.steps] == [0, 1]
        assert result.summary["telemetry_records_refused"] == 2
        assert store.run(result.run_id)["summary"]["telemetry_records_refused"] == 2
        store.close()


def test_a_batch_mixing_runs_keeps_only_the_servers_run(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db")
    with TelemetryServer(store, run_id="run") as server:
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            reader = sock.makefile("rb")
            sock.sendall(json.dumps({"token": server.token}).encode() + b"\n")
            assert json.loads(reader.readline()) == {"auth": "ok"}
            rows = [["run", 0, 0, "step", "loss", 1.0, 0.0], ["other", 0, 0, "step", "loss", 9.0, 0.0]]
            sock.sendall(json.dumps({"seq": 1, "records": rows}).encode() + b"\n")
            assert json.loads(reader.readline()) == {"ack": 1}  # acked: the client need not resend
    assert [r.value for r in store.metrics("run")] == [1.0] and store.metrics("other") == []
    assert server.records_refused == 1 and server.records_written == 1
