"""`make test` on a fresh machine: skip reasons are printed, and PostgreSQL is set up (or its tests
skip with a reason) the way Chromium and Slurm are."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _target(name: str) -> tuple[str, str]:
    """(prerequisites, recipe) of one Makefile target."""
    text = (ROOT / "Makefile").read_text()
    m = re.search(rf"^{name}:(.*)\n((?:\t.*\n)*)", text, re.M)
    assert m, f"no target {name}"
    return m.group(1), m.group(2)


def test_make_test_prints_skip_reasons_and_sets_up_postgresql():
    # old code: "assert 'postgres' in ['$(STAMP)', 'chromium', 'slurm']"
    prereqs, recipe = _target("test")
    assert "postgres" in prereqs.split()
    assert re.search(r"pytest .*-rs\b", recipe), recipe
    assert "tests/postgres_server.sh" in _target("postgres")[1]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None, reason="needs root to run as another user")
def test_postgres_setup_without_root_skips_with_a_reason():
    # a port where nothing listens, run as a user who cannot install: one line, exit 0
    script = (ROOT / "tests" / "postgres_server.sh").read_text().replace("PORT=5432", "PORT=5999")
    out = subprocess.run(["runuser", "-u", "nobody", "--", "bash", "-s"], input=script, capture_output=True,
                         text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("PostgreSQL not set up (no server on 127.0.0.1:5999; installing one needs root "
                                  "and apt-get): the PostgreSQL tests will skip")


def test_postgres_setup_says_what_it_found_when_a_server_is_there():
    """Issue 65: `make postgres` printed nothing at all where the server was already up (old code: "")."""
    import socket

    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 5432)) != 0:
            pytest.skip("no PostgreSQL on 127.0.0.1:5432 (make postgres starts one)")
    out = subprocess.run(["bash", str(ROOT / "tests" / "postgres_server.sh")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in {f"PostgreSQL for the PostgreSQL tests on 127.0.0.1:5432: found a server already "
                                  f"listening; {db}" for db in ("database test was there", "created database test")}, \
        out.stdout
