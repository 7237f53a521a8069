"""`quick_exit(code)`: end a finished command without CPython tearing down its modules.

With torch loaded, the interpreter's own finalization (clearing every module, collecting what they held) takes
0.45 s of CPU after the work is done, 0.8 s once torch._dynamo is in (torch's optimizers import it), 1.1 s with a
transformers model as well (bench/quick_exit.py, medians of 5 on 2 cores). A command's user and a tuner that runs
many short commands wait for it for nothing. What a normal exit runs for the program itself still runs: non-daemon
threads are waited for (while one is alive this is a normal exit), then the atexit hooks (logging, temporary
folders, multiprocessing, weakref finalizers, storage engines), then stdout and stderr are flushed. What it skips is
the `__del__` of objects still alive: a file must be closed (or written with `with` / `Path.write_*`), not left to
the garbage collector.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_code(code: object) -> int:
    """The status `sys.exit(code)` would end with (None: 0; a message: printed to stderr, 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def quick_exit(code: object = 0) -> NoReturn:
    """End the process with `sys.exit(code)`'s status, skipping only the interpreter's teardown (above)."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)  # threading's shutdown joins them before the atexit hooks: let it
    end_process(exit_code(code))


def end_process(status: int) -> NoReturn:
    """The end of `quick_exit` once no non-daemon thread is left: the atexit hooks, stdout and stderr flushed, then
    `os._exit(status)` (a forked child's way out too: engine/launch/agent_server.py)."""
    try:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: what a normal exit would also lose
                pass
    finally:
        os._exit(status)
