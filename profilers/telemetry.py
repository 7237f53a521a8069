"""Telemetry: ranks ship records in batches to one writer, which commits them to the run store.

Wire protocol (TCP, newline-delimited JSON): a connection opens with ``{"token": T}``, the run's
secret (``$WORKBENCH_TELEMETRY_TOKEN``, made by the launcher and handed only to its ranks); the
server answers ``{"auth": "ok"}`` or closes it, counted in ``connections_refused``, before reading
any record. Then the client sends one line per batch,
``{"seq": 7, "records": [[run_id, rank, step, kind, name, value, time], ...]}``, and the
server answers ``{"ack": 7}`` once that batch is committed. A server serves one run: records naming
another run id are dropped and counted in ``records_refused`` (the token proves the client is one
of this run's ranks, not that what it sends is about this run; on a shared store it could be any). ``TelemetryClient.flush()`` waits
for the ack, so whatever a flush returned for is durable even if the rank is then killed.

Training never waits on telemetry: `TelemetryClient.emit` appends a tuple to a deque (well
under a microsecond) and never raises; a daemon thread sends a batch every ``flush_interval``
seconds (0.25 s), and the server commits it at once, so a reader polling the store sees a
finished step within about half a second.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from profilers.records import Record
from profilers.store import RunStore

log = logging.getLogger(__name__)

_MAX_LINE = 64 * 1024 * 1024
_MAX_HELLO = 4096
_HELLO_TIMEOUT_S = 10.0
_STOP = object()
TOKEN_ENV = "WORKBENCH_TELEMETRY_TOKEN"


def _parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"telemetry address {address!r} must be 'host:port', e.g. 127.0.0.1:5555")
    return host or "127.0.0.1", int(port)


def bind_address(host: str) -> str:
    """The one IP address `host` names, for the server to bind; a wildcard is refused.

    Binding 0.0.0.0 would take connections from every network the machine is on; the ranks need
    exactly the address they are told to connect to."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
        except (OSError, IndexError) as exc:
            raise ValueError(f"telemetry host {host!r} does not resolve: {exc}") from None
    if ip.is_unspecified:
        raise ValueError(f"telemetry host {host!r} is a wildcard; name the one address the ranks "
                         "connect to (cluster.telemetry_host), e.g. the login node's cluster-network IP")
    return str(ip)


def new_token() -> str:
    """A fresh per-run secret (32 random bytes, URL-safe)."""
    return secrets.token_urlsafe(32)


class TelemetryServer:
    """The one writer: accepts rank connections and commits each received batch to the store."""

    def __init__(self, store: RunStore, *, run_id: str, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None) -> None:
        self.store = store
        self.run_id = run_id  # the one run whose records this server takes
        self.host = bind_address(host)
        self.port = port
        self.token = token or new_token()  # hand it to the ranks as $WORKBENCH_TELEMETRY_TOKEN
        self.connections_refused = 0  # connections that did not open with this run's token
        self._count_lock = threading.Lock()
        self.records_refused = 0  # records naming another run id: dropped
        self.records_written = 0
        self.batches_written = 0
        self.records_failed = 0
        self.error: str | None = None  # the first commit failure (full disk, read-only store), for the launcher
        self._queue: queue.Queue[object] = queue.Queue()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conn_threads: list[threading.Thread] = []
        self._writer: threading.Thread | None = None
        self.address: str | None = None

    def start(self) -> str:
        """Bind, start the accept and writer threads, and return ``'host:port'``."""
        if self.address is not None:
            return self.address
        listener = socket.create_server((self.host, self.port), backlog=256)
        listener.settimeout(0.2)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self.address = f"{self.host}:{self.port}"
        self._writer = threading.Thread(target=self._write_loop, name="telemetry-writer",
                                        daemon=True)
        self._writer.start()
        accept = threading.Thread(target=self._accept_loop, name="telemetry-accept", daemon=True)
        accept.start()
        self._threads.append(accept)
        return self.address

    def submit(self, records: Sequence[Record]) -> None:
        """Queue records of this server's run from this process (e.g. the launcher's) for the writer thread."""
        records = self._own(records)
        if records:
            self._queue.put((records, None, None))

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, drain every byte already received, commit it, and join the threads."""
        if self.address is None or self._stopping.is_set():
            return
        self._stopping.set()
        for thread in self._threads:  # the accept loop takes the last queued connections first
            thread.join(timeout)
        for thread in list(self._conn_threads):
            thread.join(timeout)
        self._queue.put(_STOP)
        if self._writer is not None:
            self._writer.join(timeout)
        if self._listener is not None:
            self._listener.close()

    def __enter__(self) -> TelemetryServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            stopping = self._stopping.is_set()
            if stopping:  # connections already in the backlog still get drained
                self._listener.setblocking(False)
            try:
                conn, _ = self._listener.accept()
            except (TimeoutError, BlockingIOError):
                if stopping:
                    return
                continue
            except OSError:
                return
            conn.settimeout(0.2)
            thread = threading.Thread(target=self._read_loop, args=(conn,), daemon=True,
                                      name="telemetry-conn")
            thread.start()
            self._conn_threads.append(thread)

    def _authenticate(self, conn: socket.socket) -> bytes | None:
        """Read the opening ``{"token": ...}`` line; the bytes after it, or None if refused."""
        buffer, deadline = b"", time.monotonic() + _HELLO_TIMEOUT_S
        while b"\n" not in buffer and len(buffer) <= _MAX_HELLO and time.monotonic() < deadline:
            try:
                chunk = conn.recv(_MAX_HELLO)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                break
            buffer += chunk
        line, _, rest = buffer.partition(b"\n")
        try:
            given = json.loads(line).get("token")
        except (ValueError, AttributeError):
            given = None
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self.token.encode()):
            conn.sendall(b'{"auth": "ok"}\n')
            return rest
        with self._count_lock:
            self.connections_refused += 1
        log.warning("telemetry: refused a connection without this run's token (%d so far)",
                    self.connections_refused)
        _close_quietly(conn)
        return None

    def _read_loop(self, conn: socket.socket) -> None:
        send_lock = threading.Lock()
        try:
            buffer = self._authenticate(conn)
        except OSError:
            buffer = None
        if buffer is None:
            _close_quietly(conn)
            return
        try:
            while True:
                try:
                    chunk = conn.recv(1 << 20)
                except TimeoutError:
                    if self._stopping.is_set():
                        buffer += _drain_nonblocking(conn)
                        self._dispatch(buffer, conn, send_lock, final=True)
                        return
                    continue
                except OSError:
                    chunk = b""
                if not chunk:  # peer closed or died: complete lines only, a torn tail is dropped
                    self._dispatch(buffer, conn, send_lock, final=True)
                    return
                buffer = self._dispatch(buffer + chunk, conn, send_lock, final=False)
                if len(buffer) > _MAX_LINE:
                    log.warning("telemetry: dropping a connection sending a %d-byte line", len(buffer))
                    return
        finally:
            # the writer may still ack: closing after the final commit would need a handshake
            # the dying peer cannot answer, so acks after this point are best effort
            self._queue.put((None, conn, send_lock))

    def _dispatch(self, data: bytes, conn: socket.socket, send_lock: threading.Lock, *,
                  final: bool) -> bytes:
        *lines, rest = data.split(b"\n")
        for line in lines:
            if not line.strip():
                continue
            try:
                message = json.loads(line)
                records = self._own([Record.from_row(r) for r in message["records"]])
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("telemetry: skipping a malformed batch: %s", exc)
                continue
            self._queue.put((records, conn, (send_lock, message.get("seq"))))  # acked even if all were refused
        return b"" if final else rest

    def _own(self, records: Sequence[Record]) -> list[Record]:
        """The records of this server's run; the others are counted in `records_refused`."""
        own = [r for r in records if r.run_id == self.run_id]
        if len(own) < len(records):
            with self._count_lock:
                first = self.records_refused == 0
                self.records_refused += len(records) - len(own)
            if first:
                other = next(r.run_id for r in records if r.run_id != self.run_id)
                log.warning("telemetry: refused records for run %r: this server takes run %r's only",
                            other, self.run_id)
        return own

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            pending = [item]
            while len(pending) < 256:  # coalesce what queued meanwhile into one transaction
                try:
                    pending.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._commit([p for p in pending if p is not _STOP])
            if any(p is _STOP for p in pending):
                return

    def _commit(self, items: list[object]) -> None:
        records = [r for recs, _, _ in items if recs for r in recs]  # type: ignore[misc]
        try:
            self.store.write(records)
            committed = True
        except Exception as exc:  # the writer must survive a full disk: it just acks nothing
            log.error("telemetry: could not write %d records: %s", len(records), exc)
            committed = False
            self.records_failed += len(records)
            self.error = self.error or str(exc)
        self.records_written += len(records) if committed else 0
        for recs, conn, meta in items:  # type: ignore[misc]
            if recs is None:
                _close_quietly(conn)
                continue
            if not committed:
                continue
            self.batches_written += 1
            if conn is not None and isinstance(meta, tuple) and meta[1] is not None:
                lock, seq = meta
                try:
                    with lock:
                        conn.sendall(json.dumps({"ack": seq}).encode() + b"\n")
                except OSError:
                    pass


def _drain_nonblocking(conn: socket.socket) -> bytes:
    data = b""
    conn.setblocking(False)
    try:
        while True:
            chunk = conn.recv(1 << 20)
            if not chunk:
                break
            data += chunk
    except (BlockingIOError, OSError):
        pass
    return data


def _close_quietly(conn: object) -> None:
    try:
        conn.close()  # type: ignore[attr-defined]
    except OSError:
        pass


class _Unacked(ConnectionError):
    """A batch was sent whole but its ack never came."""


class TelemetryClient:
    """A rank's batched sender; ``emit`` is cheap, never blocks and never raises.

    With ``address=None`` batches go straight into the `RunStore` at ``store_path`` (default:
    the home store), for ranks started by an external torchrun without a telemetry server.
    """

    def __init__(self, address: str | None, run_id: str, rank: int, *,
                 flush_interval: float = 0.25, store_path: str | Path | None = None,
                 max_buffer: int = 1_000_000, ack_timeout: float = 10.0,
                 token: str | None = None) -> None:
        self.address = address
        self.token = token or ""
        self.run_id = run_id
        self.rank = int(rank)
        self.flush_interval = float(flush_interval)
        self.max_buffer = int(max_buffer)
        self.ack_timeout = float(ack_timeout)
        self.delivered = 0
        self.dropped = 0
        self.unacked = 0
        self._buf: deque[tuple] = deque()
        self._flush_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._reader = None
        self._seq = 0
        self._warned = False
        self._closed = threading.Event()
        self._store: RunStore | None = None
        if address is None:
            self._store = RunStore(store_path) if store_path else RunStore.open_home()
        else:
            _parse_address(address)
        self._thread = threading.Thread(target=self._loop, name=f"telemetry-rank{rank}",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, rank: int, *, run_id: str | None = None, **kwargs: object) -> TelemetryClient:
        """A client for ``$WORKBENCH_TELEMETRY`` / ``$WORKBENCH_RUN_ID`` /
        ``$WORKBENCH_TELEMETRY_TOKEN`` (set by the launcher)."""
        address = os.environ.get("WORKBENCH_TELEMETRY") or None
        run = run_id or os.environ.get("WORKBENCH_RUN_ID") or "unnamed"
        return cls(address, run, rank, token=os.environ.get(TOKEN_ENV), **kwargs)  # type: ignore[arg-type]

    def emit(self, step: int, kind: str, name: str, value: float) -> None:
        """Buffer one value (pass a Python number: ``tensor.item()`` would sync the device)."""
        try:
            self._buf.append((self.run_id, self.rank, int(step), kind, name, float(value),
                              time.time()))
            if len(self._buf) > self.max_buffer:  # a dead sink must not eat all memory
                self._buf.popleft()
                self.dropped += 1
        except Exception:  # never raise into training
            self.dropped += 1

    def emit_many(self, step: int, kind: str, values: dict[str, float]) -> None:
        """`emit` each ``{name: value}`` of one step and kind."""
        for name, value in values.items():
            self.emit(step, kind, name, value)

    def record(self, kind: str, name: str, value: float) -> None:
        """`emit` a value not tied to a step (a sampler's ``emit(kind, name, value)`` sink)."""
        self.emit(-1, kind, name, value)

    def flush(self) -> bool:
        """Send everything buffered and wait until it is committed; False if some could not be."""
        with self._flush_lock:
            try:
                return self._flush_locked()
            except Exception as exc:
                self._warn(f"telemetry flush failed: {exc}")
                return False

    def close(self) -> None:
        """Stop the flush thread, flush everything, and close the connection."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(timeout=max(5.0, 4 * self.flush_interval))
        self.flush()
        if self._sock is not None:
            _close_quietly(self._sock)
            self._sock = None
        if self._store is not None:
            self._store.close()

    def __enter__(self) -> TelemetryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _loop(self) -> None:
        while not self._closed.wait(self.flush_interval):
            self.flush()

    def _take(self) -> list[tuple]:
        count = len(self._buf)
        return [self._buf.popleft() for _ in range(count)]

    def _flush_locked(self) -> bool:
        batch = self._take()
        if not batch:
            return True
        try:
            if self._store is not None:
                self._store.write([Record(*row) for row in batch])
            else:
                self._send(batch)
        except _Unacked as exc:
            # sent but not acknowledged: resending could store it twice, so count it as lost
            self.unacked += len(batch)
            self._warn(f"telemetry: {len(batch)} records sent but not acknowledged ({exc})")
            self._reset()
            return False
        except Exception as exc:
            self._buf.extendleft(reversed(batch))  # nothing was sent: keep it for the next try
            self._warn(f"telemetry: could not deliver {len(batch)} records ({exc}); will retry")
            self._reset()
            return False
        self.delivered += len(batch)
        return True

    def _send(self, batch: list[tuple]) -> None:
        if self._sock is None:
            assert self.address is not None
            self._sock = socket.create_connection(_parse_address(self.address), timeout=5.0)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._reader = self._sock.makefile("rb")
            self._sock.sendall(json.dumps({"token": self.token}).encode() + b"\n")
            if json.loads(self._reader.readline() or b"{}").get("auth") != "ok":
                raise ConnectionRefusedError("the telemetry server refused this client's token "
                                             f"(${TOKEN_ENV} does not match the run's)")
        self._seq += 1
        payload = json.dumps({"seq": self._seq, "records": batch}).encode() + b"\n"
        self._sock.settimeout(self.ack_timeout)
        self._sock.sendall(payload)
        assert self._reader is not None
        try:
            while True:
                line = self._reader.readline()
                if not line:
                    raise ConnectionError("telemetry server closed the connection")
                if json.loads(line).get("ack") == self._seq:
                    return
        except (OSError, ValueError) as exc:
            raise _Unacked(str(exc)) from exc

    def _reset(self) -> None:
        if self._sock is not None:
            _close_quietly(self._sock)
        self._sock, self._reader = None, None

    def _warn(self, message: str) -> None:
        if not self._warned:
            log.warning(message)
            self._warned = True
        else:
            log.debug(message)
