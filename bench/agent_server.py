"""What a launcher that starts several runs (a tuner's worker, a test worker) spends when each run's agent is forked
by its agent server (engine/launch/agent_server.py, the default for single-node gloo runs) against each agent
starting as an interpreter of its own (WORKBENCH_AGENT_START=exec); the ranks fork from the agent either way.

One Python process launches examples/tiny.yaml at dp 2 (4 steps) RUNS times, each way REPEATS times, interleaved;
per row the medians of that process's CPU (user + system of it and every process under it, the server's included:
the launcher waits for its server as it exits) and wall, per run, and their ratio. With --hf the model is a tiny
transformers Llama (`model.hf`), which the server also imports once for all the runs (`preload_for`).

    python bench/agent_server.py [--runs 4] [--repeats 5] [--hf]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from child_cost import child_cost, medians

ROOT = Path(__file__).resolve().parent.parent
STARTS = {"exec (own interpreter)": "exec", "server (forked)": ""}
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
LAUNCHER = """
import sys
from engine.config.schema import load_config
from engine.launch.local import launch
cfg = load_config("examples/tiny.yaml", ["parallel.dp=2", "train.steps=4", "profile.host_interval_s=0"] + sys.argv[3:])
for _ in range(int(sys.argv[2])):
    assert launch(cfg, home=sys.argv[1]).status == "completed"
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hf", action="store_true", help="a tiny transformers Llama instead of the engine's GPT")
    args = parser.parse_args()
    model = [f"model.hf={json.dumps(TINY_LLAMA)}", "model.dropout=0"] if args.hf else []
    print(f"{'agent start':<24} {'CPU s/run':>9} {'wall s/run':>10}   "
          f"(one process, {args.runs} runs; medians of {args.repeats}, interleaved)")
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in STARTS}
    with tempfile.TemporaryDirectory() as home:
        for _ in range(args.repeats):
            for name, start in STARTS.items():
                cpu, wall = child_cost([sys.executable, "-c", LAUNCHER, home, str(args.runs), *model], cwd=ROOT,
                                       env={**os.environ, "OMP_NUM_THREADS": "1", "WORKBENCH_AGENT_START": start})
                runs[name].append((cpu / args.runs, wall / args.runs))
    med = medians(runs)
    for name, (cpu, wall) in med.items():
        print(f"{name:<24} {cpu:9.2f} {wall:10.2f}")
    (cpu_e, wall_e), (cpu_s, wall_s) = med.values()
    print(f"{'saved per run':<24} {cpu_e - cpu_s:9.2f} {wall_e - wall_s:10.2f}   "
          f"(server / exec: CPU {cpu_s / cpu_e:.2f}x, wall {wall_s / wall_e:.2f}x)")


if __name__ == "__main__":
    main()
