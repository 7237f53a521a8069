"""The processes a test looks for after a run: its own descendants, and any live process naming a run's files."""
from __future__ import annotations

import os

import psutil


def descendants() -> set[int]:
    """This process's descendants, but for the launcher's agent server, which stays for the next run."""
    from engine.launch.agent_server import agent_server_pid

    return {p.pid for p in psutil.Process().children(recursive=True)} - {agent_server_pid()}


def processes_naming(text: str) -> list[str]:
    """Every live process but this one whose command line mentions `text` (a run's config, folder or home), as
    "pid: command line"."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            if text in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE and proc.pid != os.getpid():
                found.append(f"{proc.info['pid']}: {cmdline[:200]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found
