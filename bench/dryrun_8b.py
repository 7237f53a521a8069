"""`workbench dryrun` on Llama-3.1-8B at 64 ranks in three layouts (issue 50 item 2): the wall time of
each dry run on this CPU (target: under 5 minutes each) and, per rank role, the peak with its largest
category and the collective bytes per axis beside the simulator's.

Run: `python bench/dryrun_8b.py [--save FILE.json]`. Each layout runs as a user runs it, one
`workbench dryrun examples/llama3_8b.yaml --world 64 --set ... --json` process after the other
(no interleaving: a dry run's time is its own Python dispatch, one process at a time).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {  # the config is examples/llama3_8b.yaml (dp 64, ZeRO-3, global 64, micro 1, seq 8192, bf16, AC)
    "fsdp64": [],
    "tp8 x dp8": ["parallel.tp=8", "batch.micro=4"],  # 2 micro-batches of 4 sequences per dp rank
    "pp4 x dp16 (1F1B)": ["parallel.pp=4"],  # 4 micro-batches of 1 sequence per pipeline
}


def dry_run(overrides: list[str]) -> tuple[float, dict]:
    """(wall seconds, the JSON report) of one `workbench dryrun` process."""
    cmd = [sys.executable, "-m", "workbench.cli", "dryrun", "examples/llama3_8b.yaml", "--world", "64", "--json"]
    for item in overrides:
        cmd += ["--set", item]
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    return time.perf_counter() - start, json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--save", type=Path, help="write every report with its wall time to this JSON file")
    args = ap.parse_args()
    saved = {}
    for name, overrides in LAYOUTS.items():
        seconds, report = dry_run(overrides)
        saved[name] = {"wall_s": seconds, "overrides": overrides, "report": report}
        print(f"{name}: {seconds:.0f} s wall ({'under' if seconds < 300 else 'OVER'} 5 minutes)")
        for role in report["roles"]:
            where = ", ".join(f"{k} {v}" for k, v in role["coords"].items())
            top = max(role["memory"], key=lambda row: row["dry_run"])
            print(f"  rank {role['rank']} ({where}): peak {role['peak'] / 2**30:.1f} GiB, {top['category']} "
                  f"{top['dry_run'] / 2**30:.1f} GiB; simulator {role['simulator_total'] / 2**30:.1f} GiB")
            for row in role["comm"]:
                sim = "n/a" if row["simulator"] is None else f"{row['simulator'] / 1e9:.2f}"
                print(f"    {row['axis']}: {row['dry_run'] / 1e9:.2f} GB sent or reduced, simulator {sim} GB")
    if args.save:
        args.save.write_text(json.dumps(saved, indent=1))


if __name__ == "__main__":
    main()
