"""What a local CPU run costs when its ranks fork from the torchrun agent (engine/launch/agent.py, the default
for single-node gloo runs) against each rank starting its own interpreter as torchrun does
(WORKBENCH_RANK_START=spawn).

`workbench run examples/tiny.yaml` (20 steps) at 2 and 4 ranks and `examples/llama.yaml` (a transformers model,
its 4 ranks; the forked ones also share the agent's import of transformers), each way REPEATS times, interleaved;
per row the medians of the whole command's CPU (user + system of it and every process under it, from the parent's
rusage) and wall, and their ratio.

    python bench/launch_fork.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from child_cost import child_cost, medians

ROOT = Path(__file__).resolve().parent.parent
STARTS = {"spawn (torchrun's)": "spawn", "fork (the agent)": ""}


CASES = [("examples/tiny.yaml", ["parallel.dp=2"]), ("examples/tiny.yaml", ["parallel.dp=4"]),
         ("examples/llama.yaml", [])]


def measure(home: str, config: str, sets: list[str], start: str) -> tuple[float, float]:
    """CPU and wall seconds of one `workbench run` (its own rusage and its children's, waited for alone)."""
    return child_cost([sys.executable, "-m", "workbench.cli", "--home", home, "run", config,
                       *[arg for key in sets for arg in ("--set", key)]], cwd=ROOT, stdout=subprocess.DEVNULL,
                      env={**os.environ, "OMP_NUM_THREADS": "1", "WORKBENCH_RANK_START": start})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    print(f"{'run':<34} {'rank start':<20} {'CPU s':>7} {'wall s':>7}   (medians of {repeats}, interleaved)")
    with tempfile.TemporaryDirectory() as home:
        for config, sets in CASES:
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in STARTS}
            for _ in range(repeats):
                for name, start in STARTS.items():
                    runs[name].append(measure(home, config, sets, start))
            med = medians(runs)
            label = " ".join([config, *sets])
            for name, (cpu, wall) in med.items():
                print(f"{label:<34} {name:<20} {cpu:7.2f} {wall:7.2f}")
            (cpu_s, wall_s), (cpu_f, wall_f) = med.values()
            print(f"{'':<34} {'saved':<20} {cpu_s - cpu_f:7.2f} {wall_s - wall_f:7.2f}   "
                  f"(fork / spawn: CPU {cpu_f / cpu_s:.2f}x, wall {wall_f / wall_s:.2f}x)")


if __name__ == "__main__":
    main()
