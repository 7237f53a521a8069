"""engine/quick_exit.py: a finished command ends without the interpreter's teardown (0.45-1.1 s of CPU with torch
loaded, bench/quick_exit.py) and loses nothing a normal exit keeps: its status, its atexit hooks, its output,
the non-daemon threads it started. The `workbench` command and the dry-run process end this way."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# An object alive at exit whose __del__ says so: only the interpreter's teardown collects it
TORN_DOWN = "class Sentinel:\n    def __del__(self):\n        print('torn down', flush=True)\nkept = Sentinel()\n"


def _python(code: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python -c code args` with the project importable and its input closed at once."""
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, input="", capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                               "WORKBENCH_HOME": str(cwd / "home")})


def test_quick_exit_keeps_the_status_the_atexit_hooks_the_output_and_the_threads(tmp_path):
    code = TORN_DOWN + f"""
import atexit, threading, time, sys
from pathlib import Path
from engine.quick_exit import quick_exit
atexit.register(lambda: Path({str(tmp_path)!r}, "atexit").write_text("ran"))
print("buffered", end="")  # no newline, no flush
sys.stderr.write("to stderr")
if sys.argv[1] == "thread":
    threading.Thread(target=lambda: (time.sleep(0.5), Path({str(tmp_path)!r}, "thread").write_text("done"))).start()
quick_exit(int(sys.argv[2]) if sys.argv[2].isdigit() else sys.argv[2])
"""
    out = _python(code, "none", "3")
    assert (out.returncode, out.stdout, out.stderr) == (3, "buffered", "to stderr")  # no teardown: no "torn down"
    assert (tmp_path / "atexit").read_text() == "ran"
    message = _python(code, "none", "a message")
    assert (message.returncode, message.stderr) == (1, "to stderra message\n")  # as sys.exit("a message")
    threaded = _python(code, "thread", "0")  # a non-daemon thread still running: a normal exit, which joins it
    assert threaded.returncode == 0 and (tmp_path / "thread").read_text() == "done"
    assert threaded.stdout == "bufferedtorn down\n"


def test_the_workbench_command_ends_without_the_interpreters_teardown(tmp_path):
    """`workbench` commands end by quick_exit, whatever their status; on 660927c each ran the teardown."""
    code = TORN_DOWN + "import sys\nsys.argv = ['workbench', *sys.argv[1:]]\nfrom workbench.cli import main\nmain()\n"
    ok = _python(code, "runs", "--limit", "1", cwd=tmp_path)
    refused = _python(code, "runs", "--limit", "0", cwd=tmp_path)
    assert ok.returncode == 0 and "torn down" not in ok.stdout, (ok.stdout, ok.stderr[-2000:])
    assert refused.returncode == 2 and "torn down" not in refused.stdout
    assert refused.stderr.strip() == "error: --limit=0: must be >= 1"


def test_the_dry_run_process_ends_without_the_interpreters_teardown():
    """`python -m engine.train.dryrun --serve` (the process plan's dry runs use) ends by quick_exit when its input
    closes: `DryRunProcess.close()` waits for that end; on 660927c it waited for torch's teardown too."""
    code = TORN_DOWN + ("import runpy, sys\nsys.argv = ['dryrun', '--serve']\n"
                        "runpy.run_module('engine.train.dryrun', run_name='__main__')\n")
    out = _python(code)
    assert out.returncode == 0 and "torn down" not in out.stdout + out.stderr, (out.stdout, out.stderr[-2000:])
