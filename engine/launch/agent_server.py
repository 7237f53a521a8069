"""One process per launcher that forks each run's torch elastic agent (engine/launch/agent.py), so that torch and
torch._dynamo are imported once for all the runs a launcher starts, not once per run (about 2.7 s of CPU each on a
2-core host: a tuner's trials, a test worker's runs; bench/agent_server.py measures it).

`python -m engine.launch.agent_server` imports torch (`preload`), then reads one JSON request per input line, {"token",
"argv", "env", "log", "cwd"}. For each it imports what the run's agent would import for its config (`preload_for`:
transformers for a `model.hf` run, once for all), forks, and the child becomes what
`python -m engine.launch.agent ARGV`, started by the launcher with `env` in `cwd`, stdout and stderr to `log`, in a
session of its own, would be, with that command line as its title (setproctitle), so `ps` and the scans for a run's
processes see it as before (once transformers is imported, a run whose transformers settings are not the server's
gets that command itself: `fresh_start`). It answers {"token", "pid"}, then {"token", "exit": CODE}
when that agent ends (CODE as Popen's returncode: negative, the signal). It ends when its input closes, its launcher
having ended, and each agent then gets SIGTERM, as it did when its launcher ended.

multiprocessing's forkserver does the same but imports the launcher's __main__ again in every child (the CLI's or
a tuner's, ~0.3 s, and a script that starts runs from unguarded top-level code could not start any), hence this one.
"""
from __future__ import annotations

import itertools
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

START_TIMEOUT_S = 300.0  # for the server to answer a start (the first one imports torch: seconds, more when loaded)


class ForkedAgent:
    """An agent the server forked, with the face of the `subprocess.Popen` the launcher would otherwise hold: pid,
    poll(), wait(timeout), returncode."""

    def __init__(self, server: AgentServer, pid: int, token: int) -> None:
        self._server, self.pid, self._token = server, pid, token

    @property
    def returncode(self) -> int | None:
        return self._server.exit_code(self._token)

    def poll(self) -> int | None:
        return self._server.exit_code(self._token)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.time() >= deadline:
                raise subprocess.TimeoutExpired(f"engine.launch.agent (pid {self.pid})", timeout or 0.0)
            time.sleep(0.05)
        return code


class AgentServer:
    """The launcher's side of the server: `start` forks an agent; the server process starts on the first call
    (and again if it ended)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._exits: dict[int, int] = {}  # by the token each start is given (a pid may come again)
        self._running: set[int] = set()  # the tokens of the agents the running server has forked and not reaped
        self._tokens = itertools.count()
        self._unread = b""
        self._lock = threading.Lock()

    def start(self, argv: list[str], *, env: dict[str, str], log_path: str) -> ForkedAgent:
        token = next(self._tokens)
        request = {"token": token, "argv": list(argv), "env": dict(env), "log": str(log_path), "cwd": os.getcwd()}
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start_server()
            assert self._proc is not None and self._proc.stdin is not None
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
            self._running.add(token)
            while True:
                for message in self._read(block=True):
                    if message["token"] == token and "exit" not in message:
                        return ForkedAgent(self, message["pid"], token)

    def exit_code(self, token: int) -> int | None:
        """The exit status of the agent started with `token` once it ended (None while it runs)."""
        with self._lock:
            if token not in self._exits and self._proc is not None:
                self._read(block=False)
            return self._exits.get(token)

    def pid(self) -> int | None:
        """The server process's pid while it runs."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def close(self, timeout_s: float = 10.0) -> None:
        """End the server (its input closes) and wait for it: a launcher's exit does this (atexit)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()

    def _start_server(self) -> None:
        # it ends when its input closes, which the launcher's end does; not PR_SET_PDEATHSIG, which would end it
        # with the thread that started it, under the runs other threads started since
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "engine.launch.agent_server"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        self._unread = b""

    def _read(self, *, block: bool) -> list[dict[str, Any]]:
        """The server's messages that have arrived (with `block`, at least one); exits are recorded. If the server
        ended, every agent not yet reported is taken as ended by SIGTERM, which the server's end sent it."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._unread:
            if not select.select([fd], [], [], START_TIMEOUT_S if block else 0)[0]:
                if block:
                    raise RuntimeError(f"the launcher's agent server did not start the run in {START_TIMEOUT_S:.0f} s")
                return []
            chunk = os.read(fd, 65536)
            if not chunk:
                return self._server_ended(block)
            self._unread += chunk
        *lines, self._unread = self._unread.split(b"\n")
        messages = [json.loads(line) for line in lines]
        for message in messages:
            if "exit" in message:
                self._exits[message["token"]] = message["exit"]
                self._running.discard(message["token"])
        return messages

    def _server_ended(self, block: bool) -> list[dict[str, Any]]:
        assert self._proc is not None
        code = self._proc.wait()
        self._proc = None
        for token in self._running:
            self._exits[token] = -signal.SIGTERM
        self._running.clear()
        if block:
            raise RuntimeError(f"the launcher's agent server ended (exit status {code}) before it started the run")
        return []


_SERVER: tuple[int, AgentServer] | None = None
_SERVER_LOCK = threading.Lock()


def start_agent(argv: list[str], *, env: dict[str, str], log_path: str) -> ForkedAgent:
    """`python -m engine.launch.agent ARGV` with `env`, its output to `log_path`, forked by this process's server."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None or _SERVER[0] != os.getpid():  # a forked copy of a launcher starts its own
            import atexit

            _SERVER = (os.getpid(), AgentServer())
            atexit.register(_SERVER[1].close)
        server = _SERVER[1]
    return server.start(argv, env=env, log_path=log_path)


def agent_server_pid() -> int | None:
    """The pid of this process's agent server while it runs: a helper that stays for the launcher's next run (and
    ends with the launcher), not a process a run left behind."""
    with _SERVER_LOCK:
        server = _SERVER[1] if _SERVER is not None and _SERVER[0] == os.getpid() else None
    return server.pid() if server is not None else None


# ------------------------------------------------------------------------------------------------ the server


def preload() -> None:
    """What every agent imports first, imported once in the server: torch and torch._dynamo (every optimizer's
    step imports it)."""
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401


# transformers and huggingface_hub read these as they are imported: the server imports transformers for the runs
# whose values of them are its own, and an agent whose run has others starts afresh once it did (`fresh_start`). Not
# by setting the run's environment in the server: that moves the memory setproctitle rewrites, and titles fail
IMPORT_TIME_SETTINGS = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_")
# but for HF_HUB_OFFLINE, which the engine sets in any process that reads a transformers model (it reads local files
# only): validating a config with hf_weights sets it in the launcher, after its server started
ENGINES_OWN_SETTINGS = ("HF_HUB_OFFLINE",)


def _settings(env: Any) -> dict[str, str]:
    return {key: value for key, value in env.items()
            if key.startswith(IMPORT_TIME_SETTINGS) and key not in ENGINES_OWN_SETTINGS}


def preload_for(request: dict[str, Any]) -> None:
    """What this run's agent imports for its config before it forks the ranks (engine/launch/agent.py
    `import_what_the_run_needs`: torch's pipelining, transformers and the model's class: 1.8 s of CPU), imported
    here once for it and every later run, from the run's folder; not for a run with other transformers settings."""
    if _settings(request["env"]) != _settings(os.environ):
        return
    from engine.launch.agent import import_what_the_run_needs

    here = os.getcwd()
    try:
        os.chdir(request["cwd"])  # the run's config path may be relative to it
        import_what_the_run_needs(request["argv"])
    except OSError:  # its folder is gone: the agent's to report
        return
    finally:
        os.chdir(here)


def fresh_start(env: dict[str, str]) -> bool:
    """Whether an agent with `env` must start as an interpreter of its own: the server imported transformers, and
    the run's transformers settings are not the server's."""
    return "transformers" in sys.modules and _settings(env) != _settings(os.environ)


def serve() -> None:
    """The server's loop (module docstring)."""
    preload()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's: it stops each run's session itself
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else printed goes to stderr
    agents: dict[int, int] = {}  # pid: its start's token
    unread = b""
    while True:
        if select.select([0], [], [], 0.2)[0]:
            chunk = os.read(0, 65536)
            if not chunk:
                return  # the launcher ended (or closed its side)
            *lines, unread = (unread + chunk).split(b"\n")
            for line in lines:
                request = json.loads(line)
                preload_for(request)
                pid = _fork_agent(request, replies.fileno())
                agents[pid] = request["token"]
                _reply(replies, {"token": request["token"], "pid": pid})
        for pid in list(agents):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                _reply(replies, {"token": agents.pop(pid), "exit": os.waitstatus_to_exitcode(status)})


def _reply(replies: Any, message: dict[str, Any]) -> None:
    replies.write(json.dumps(message) + "\n")
    replies.flush()


def _fork_agent(request: dict[str, Any], replies_fd: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.close(replies_fd)
        code = _become_agent(request)
    finally:
        _exit(code)
    raise AssertionError("unreachable")


def _become_agent(request: dict[str, Any]) -> int:
    """In the forked child: what `python -m engine.launch.agent ARGV` started by the launcher is; its exit status."""
    import io
    import traceback

    from engine.launch.parent_death import die_with_parent
    from engine.quick_exit import exit_code

    os.setsid()  # the launcher stops the run by its session, as with start_new_session=True
    signal.signal(signal.SIGINT, signal.default_int_handler)
    die_with_parent()  # the server: it ends when the launcher does
    env, argv, cwd = request["env"], request["argv"], request["cwd"]
    command = [sys.executable, "-m", "engine.launch.agent", *argv]
    fresh = fresh_start(env)  # before the environment changes
    _title(command)  # before the environment changes: it reads it
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:0] = [p for p in [cwd, *env.get("PYTHONPATH", "").split(os.pathsep)] if p and p not in sys.path]
    null, log = os.open(os.devnull, os.O_RDONLY), os.open(request["log"], os.O_WRONLY | os.O_APPEND)
    for source, fd in ((null, 0), (log, 1), (log, 2)):
        os.dup2(source, fd)
    os.close(null), os.close(log)
    if fresh:
        os.execve(sys.executable, command, env)
    sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), line_buffering=True,
                                               write_through=True, errors=errors)  # as PYTHONUNBUFFERED
                              for fd, errors in ((1, "strict"), (2, "backslashreplace")))
    import engine.launch.agent as agent

    sys.argv = [agent.__file__, *argv]
    try:
        agent.main(argv)
        return 0
    except SystemExit as exc:
        return exit_code(exc.code)
    except BaseException:  # as the interpreter ends on it: its traceback in the log, exit status 1
        traceback.print_exc()
        return 1


def _title(argv: list[str]) -> None:
    """The command line `ps` and psutil show for this process (and the ranks it forks)."""
    try:
        import setproctitle
    except ImportError:  # a platform without its wheel: the server's command line shows instead
        return
    setproctitle.setproctitle(" ".join(argv))


def _exit(code: int) -> None:
    """End the forked agent as its interpreter would end (its threads joined, then engine/quick_exit.py
    `end_process`), never back in the server's loop."""
    from engine.quick_exit import end_process

    try:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
    finally:
        end_process(code)


if __name__ == "__main__":
    serve()
