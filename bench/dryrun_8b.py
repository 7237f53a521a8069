"""`workbench dryrun` on Llama-3.1-8B at 64 ranks in three layouts (issue 50 item 2): the wall time of
each dry run on this CPU (target: under 5 minutes each) and, per rank role, the peak with its largest
category and the collective bytes per axis beside the simulator's.

Run: `python bench/dryrun_8b.py [--save FILE.json]`. Each layout runs as a user runs it, one
`workbench dryrun examples/llama3_8b.yaml --world 64 --set ... --json` process after the other
(no interleaving: a dry run's time is its own Python dispatch, one process at a time). Beside the
wall time each prints the process's CPU seconds (user + system: one thread, so on a busy host the
time it would take alone) and its peak RSS.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {  # the config is examples/llama3_8b.yaml (dp 64, ZeRO-3, global 64, micro 1, seq 8192, bf16, AC)
    "fsdp64": [],
    "tp8 x dp8": ["parallel.tp=8", "batch.micro=4"],  # 2 micro-batches of 4 sequences per dp rank
    "pp4 x dp16 (1F1B)": ["parallel.pp=4"],  # 4 micro-batches of 1 sequence per pipeline
}


def dry_run(overrides: list[str]) -> tuple[dict[str, float], dict]:
    """({wall_s, cpu_s, max_rss_gib}, the JSON report) of one `workbench dryrun` process."""
    cmd = [sys.executable, "-m", "workbench.cli", "dryrun", "examples/llama3_8b.yaml", "--world", "64", "--json"]
    for item in overrides:
        cmd += ["--set", item]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (CPU seconds, peak RSS)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {err.read().decode()[-2000:]}")
        report = json.loads(out.read())
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "max_rss_gib": usage.ru_maxrss / 2**20}, report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--save", type=Path, help="write every report with its wall time to this JSON file")
    args = ap.parse_args()
    saved = {}
    for name, overrides in LAYOUTS.items():
        cost, report = dry_run(overrides)
        saved[name] = {**cost, "overrides": overrides, "report": report}
        print(f"{name}: {cost['wall_s']:.0f} s wall ({'under' if cost['wall_s'] < 300 else 'OVER'} 5 minutes), "
              f"{cost['cpu_s']:.0f} CPU s, peak RSS {cost['max_rss_gib']:.2f} GiB")
        for role in report["roles"]:
            where = ", ".join(f"{k} {v}" for k, v in role["coords"].items())
            top = max(role["memory"], key=lambda row: row["dry_run"])
            print(f"  rank {role['rank']} ({where}): peak {role['peak'] / 2**30:.1f} GiB, {top['category']} "
                  f"{top['dry_run'] / 2**30:.1f} GiB; simulator {role['simulator_total'] / 2**30:.1f} GiB")
            print("    " + ", ".join(f"{row['category']} {row['dry_run'] / 2**30:.2f}" for row in role["memory"]))
            for row in role["comm"]:
                sim = "n/a" if row["simulator"] is None else f"{row['simulator'] / 1e9:.2f}"
                print(f"    {row['axis']}: {row['dry_run'] / 1e9:.2f} GB sent or reduced, simulator {sim} GB")
    if args.save:
        args.save.write_text(json.dumps(saved, indent=1))


if __name__ == "__main__":
    main()
