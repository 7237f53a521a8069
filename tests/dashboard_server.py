"""The dashboard as a browser test starts it: `streamlit run app.py` on a free 127.0.0.1 port with its own
workbench home, returned once it answers its health check."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ports import server_port

REPO = Path(__file__).resolve().parents[1]


def start_dashboard(home: Path) -> tuple[subprocess.Popen, str]:
    """(process, url) of the dashboard over WORKBENCH_HOME=`home` (its log in home/streamlit.log), in a session
    of its own (os.killpg stops it and what it started); pytest.fail with the log's tail when it does not
    answer within 60 s."""
    home.mkdir(parents=True, exist_ok=True)
    port = server_port()
    env = {**os.environ, "WORKBENCH_HOME": str(home), "OMP_NUM_THREADS": "1"}
    log = open(home / "streamlit.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(REPO / "app.py"),
                             "--server.address", "127.0.0.1", "--server.port", str(port),
                             "--server.headless", "true", "--browser.gatherUsageStats", "false",
                             "--server.fileWatcherType", "none"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).status == 200:
                return proc, url
        except OSError:
            time.sleep(0.5)
    os.killpg(proc.pid, 9)
    pytest.fail("streamlit did not start: " + (home / "streamlit.log").read_text()[-2000:])

