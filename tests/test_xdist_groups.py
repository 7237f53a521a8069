"""The suite's `xdist_group` marks really group: `make test` runs `-n 4 --dist loadgroup`, and the
launch, dashboard, tuner, Slurm ... groups keep their tests (and module fixtures) on one worker.
pytest 9.2 silently broke this (pytest-xdist#1386: the worker's nodeid suffix no longer reaches the
scheduler, so the tests went round-robin and module fixtures were set up on both workers)."""
from __future__ import annotations

import re
import subprocess
import sys

from tests.test_suite_order import inner_env


def test_loadgroup_keeps_a_modules_group_on_one_worker(tmp_path) -> None:
    (tmp_path / "test_grouped.py").write_text(
        "import pytest\n"
        'pytestmark = pytest.mark.xdist_group("launch")\n'
        + "".join(f"def test_{i}():\n    pass\n" for i in range(6)))
    out = subprocess.run([sys.executable, "-m", "pytest", "-v", "-n", "2", "--dist", "loadgroup", "-p",
                          "no:cacheprovider", "test_grouped.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env=inner_env())
    ran = re.findall(r"\[(gw\d)\] \[\s*\d+%\] PASSED (\S+)", out.stdout)
    assert len(ran) == 6, out.stdout[-2000:]
    assert all(nodeid.endswith("@launch") for _, nodeid in ran), ran
    assert len({worker for worker, _ in ran}) == 1, ran
