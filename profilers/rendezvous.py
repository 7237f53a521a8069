"""The rendezvous store of ranks this process starts, hosted here as torchrun's agent hosts it.

Picking a free port, closing it and letting rank 0 bind it later leaves a gap in which another
process (a second test suite, another run) can take the port: rank 0 then fails with
EADDRINUSE. Here the launching process binds port 0 itself and keeps the store; the ranks join
it as clients (``TORCHELASTIC_USE_AGENT_STORE=True``, the switch torchrun sets for its workers),
so ``init_process_group`` with ``env://`` works unchanged in them.
"""
from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def hosted_store(world_size: int, *, timeout_s: float, host: str = "127.0.0.1") -> Iterator[dict[str, str]]:
    """Host a TCPStore on a port the OS picks while binding; yield the environment the ranks need
    (MASTER_ADDR, MASTER_PORT and the agent-store switch). The store lives until the block ends."""
    from torch.distributed import TCPStore

    store = TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield {"MASTER_ADDR": host, "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    finally:
        del store
