"""`die_with_parent()`: a child process that ends when the process that started it does."""
from __future__ import annotations

import os
import signal


def die_with_parent() -> None:
    """In a child: get SIGTERM when its parent dies. The launcher sets it on torchrun (a killed tuner
    leaves no ranks behind) and every rank sets it on itself: a SIGKILLed torchrun cannot stop its ranks,
    which trained on as orphans until the other node's launcher timed out (2 nodes, 240 s)."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
