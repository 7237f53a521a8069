"""What a finished command pays for the interpreter's teardown, and what engine/quick_exit.py saves.

Three processes a command can be: torch imported; torch with an optimizer built (torch's optimizers import
torch._dynamo); that and a transformers model (what `workbench plan` on a config.json and the dry run hold).
Each is run REPEATS times ending normally and ending with quick_exit, interleaved; per row the medians of the
process's CPU (user + system, from the parent's rusage) and wall, and their ratio.

    python bench/quick_exit.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from child_cost import child_cost, medians

ROOT = Path(__file__).resolve().parent.parent

BODIES = {
    "torch": "import torch",
    "torch + optimizer": "import torch\ntorch.optim.AdamW(torch.nn.Linear(4, 4).parameters())",
    "torch + optimizer + transformers model": (
        "import torch\nfrom transformers import AutoConfig, AutoModelForCausalLM\n"
        "cfg = AutoConfig.for_model('llama', hidden_size=128, intermediate_size=256, num_hidden_layers=4,\n"
        "                           num_attention_heads=8, num_key_value_heads=4, vocab_size=512)\n"
        "model = AutoModelForCausalLM.from_config(cfg)\ntorch.optim.AdamW(model.parameters())"),
}
ENDINGS = {"normal exit": "", "quick_exit": "\nfrom engine.quick_exit import quick_exit\nquick_exit(0)"}


def measure(code: str) -> tuple[float, float]:
    """CPU and wall seconds of one `python -c code` (the child's own rusage, waited for alone)."""
    return child_cost([sys.executable, "-c", code], cwd=ROOT,
                      env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    print(f"{'process':<40} {'ending':<12} {'CPU s':>7} {'wall s':>7}   (medians of {repeats}, interleaved)")
    for name, body in BODIES.items():
        runs: dict[str, list[tuple[float, float]]] = {e: [] for e in ENDINGS}
        for _ in range(repeats):
            for ending, tail in ENDINGS.items():
                runs[ending].append(measure(body + tail))
        med = medians(runs)
        for ending, (cpu, wall) in med.items():
            print(f"{name:<40} {ending:<12} {cpu:7.2f} {wall:7.2f}")
        (cpu_n, wall_n), (cpu_q, wall_q) = med["normal exit"], med["quick_exit"]
        print(f"{'':<40} {'saved':<12} {cpu_n - cpu_q:7.2f} {wall_n - wall_q:7.2f}   "
              f"(quick / normal: CPU {cpu_q / cpu_n:.2f}x, wall {wall_q / wall_n:.2f}x)")


if __name__ == "__main__":
    main()
