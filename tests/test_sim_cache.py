"""The simulator's disk cache (tuning/sim/cache.py, issue 63 item 5): its key covers every module the cached
tables' code imports, two writers of one table never mix their bytes, and two processes wanting one table compute
it once."""
from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd

from tuning.sim import cache
from tuning.sim.cache import ROOT, cache_path, cached_frame, write_table


def test_the_key_covers_every_project_module_the_simulator_imports(monkeypatch) -> None:
    """engine/peaks.py (the GPUs' peak FLOP/s) was outside the key: a change there served a stale table."""
    from tuning.sim.cache import simulator_modules

    files = {str(p.relative_to(ROOT)) for p in simulator_modules()}
    assert {"engine/peaks.py", "engine/model/shapes.py", "tuning/sim/fit.py", "tuning/sim/memory.py"} <= files
    code = ("import sys, tuning.sim.validation, tuning.sim.domain, tuning.sim.fit, tuning.sim.memory_facts\n"
            "print('\\n'.join(m.__file__ for m in list(sys.modules.values()) if getattr(m, '__file__', None)))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    project = {p for p in loaded.stdout.split() if p.startswith(str(ROOT)) and "/.venv/" not in p}
    assert project and project <= {str(p) for p in simulator_modules()}
    peaks = ROOT / "engine" / "peaks.py"
    before = cache_path("loso", ROOT / "tuning" / "data" / "published.yaml")
    monkeypatch.setattr(cache, "_read", lambda p: p.read_bytes() + (b"# edited" if p == peaks else b""))
    assert cache_path("loso", ROOT / "tuning" / "data" / "published.yaml") != before


def test_the_walk_follows_imports_inside_functions(tmp_path) -> None:
    from tuning.sim.cache import simulator_modules

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "entry.py").write_text("def f():\n    from pkg import lazy\n    from .rel import x\n")
    (pkg / "lazy.py").write_text("import json\n")
    (pkg / "rel.py").write_text("x = 1\n")
    (pkg / "unused.py").write_text("")
    found = {p.name for p in simulator_modules(("pkg.entry",), tmp_path)}
    assert found == {"__init__.py", "entry.py", "lazy.py", "rel.py"}


def test_two_writers_of_one_table_do_not_mix_their_bytes(tmp_path, monkeypatch) -> None:
    """A second process fills the same table while the first is half-way through writing it: with one shared
    temporary name the first kept writing into the file the second had renamed into place."""
    target = tmp_path / "loso-x.csv"
    first = pd.DataFrame({"id": [f"a{i}" for i in range(200)], "v": range(200)})
    second = pd.DataFrame({"id": [f"b{i}" for i in range(200)], "v": range(200, 400)})
    write = pd.DataFrame.to_csv
    calls = []

    def interleaved(frame, path, **kw):
        calls.append(path)
        if len(calls) > 1:
            return write(frame, path, **kw)
        text = write(frame, None, **kw)
        with open(path, "w") as out:  # noqa: PTH123 - the writer's own handle, as to_csv holds one
            out.write(text[:len(text) // 2])
            out.flush()
            write_table(target, second)  # the other writer, start to finish
            out.write(text[len(text) // 2:])
        return None

    monkeypatch.setattr(pd.DataFrame, "to_csv", interleaved)
    cached_frame(target, lambda: first)
    monkeypatch.setattr(pd.DataFrame, "to_csv", write)
    kept = pd.read_csv(target)
    assert kept.equals(first) or kept.equals(second), kept
    assert len(calls) == 2 and calls[0] != calls[1]
    # no temporary file left behind (the lock file the first writer computed under stays, empty)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loso-x.csv", "loso-x.csv.lock"]


def test_two_processes_wanting_one_table_compute_it_once(tmp_path) -> None:
    """On a fresh machine the suite's three leave-one-out tests start at once in three workers and each computed
    the same table on the same two cores (192, 128 and 123 s in one run): the second now waits for the first
    and reads what it wrote. On d54d806 both processes computed it."""
    script = ("import sys, time, pandas as pd\nfrom pathlib import Path\nfrom tuning.sim.cache import cached_frame\n"
              "def compute():\n    with open(sys.argv[2], 'a') as f:\n        f.write('computed\\n')\n"
              "    time.sleep(3)\n    return pd.DataFrame({'v': [1, 2, 3]})\n"
              "print(cached_frame(Path(sys.argv[1]), compute)['v'].sum())\n")
    target, log = tmp_path / "loso-y.csv", tmp_path / "computed.log"
    procs = [subprocess.Popen([sys.executable, "-c", script, str(target), str(log)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and [o.strip() for o in outs] == ["6", "6"]
    assert log.read_text().splitlines() == ["computed"]


_BUBBLES = ("import json, sys\n"
            "from tuning.sim.schedule import schedule_bubble\n"
            "codes = [0, 0, 2, 5, 6, 7, 8]  # 1f1b, 1f1b, interleaved, zero_bubble, zbv, dualpipev, skip\n"
            "ratios = schedule_bubble(codes, [4, 8, 4, 2, 4, 2, 4], [8, 64, 8, 4, 8, 6, 8], [1, 1, 2, 1, 1, 1, 1], 8,\n"
            "                         [0, 0, 0, 0, 0, 0, 0.5])\n"
            "print(json.dumps({'ratios': [float(r) for r in ratios],\n"
            "                  'pipelining': 'torch.distributed.pipelining' in sys.modules}))")


def _bubbles(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _BUBBLES], capture_output=True, text=True, cwd=ROOT, check=True,
                         env=env)
    return json.loads(out.stdout)


def test_a_process_that_finds_the_walked_bubbles_kept_never_imports_torchs_pipelining(tmp_path) -> None:
    """A schedule's bubble is walked over torch's own action lists, and importing torch's pipelining for them cost
    every `workbench plan`, `simulate` and `tune --simulate` ~4 s of CPU (before this, each process walked them and
    imported it). The first process keeps what it walked; the next reads the same values without the import;
    a kept file that cannot be read is walked again, and the key covers the schedules' module and the walk's."""
    import os

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    first, second = _bubbles(env), _bubbles(env)
    assert first["pipelining"] and not second["pipelining"]
    assert second["ratios"] == first["ratios"] and first["ratios"][1] < first["ratios"][0]
    [kept] = (tmp_path / "workbench").glob("bubbles-*.json")
    kept.write_text("{not json")
    third = _bubbles(env)
    assert third == first
    files = {str(p.relative_to(ROOT)) for p in cache.simulator_modules(("tuning.sim.schedule",))}
    assert {"engine/parallel/schedules.py", "engine/parallel/skippipe.py", "tuning/sim/schedule.py"} <= files
