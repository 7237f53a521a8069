"""CPU of the `workbench` commands the suite and a user start most, this checkout against another revision.

    python bench/cli_cost.py --base 673ce16 [--repeats 5]

Each command runs from both checkouts (a `git worktree` of `--base` in a temporary folder, the same
interpreter), interleaved (base, this, base, this, ...), each in a fresh WORKBENCH_HOME; the medians of the
command's CPU (user + system of it and every process it waited for: a run's agent and ranks too) and wall,
and this / base, side by side."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_cost import child_cost, medians  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPACE = "world_size: 2\nparams:\n  batch.micro: {choices: [2, 4]}\nfixed:\n  train.steps: 2\n  train.eval_interval: 0\n"


def commands(work: Path) -> dict[str, list[str]]:
    """Each measured command's arguments (after `python -m workbench.cli`)."""
    tiny = str(ROOT / "examples" / "tiny.yaml")
    (work / "space.yaml").write_text(SPACE)
    return {
        "run tiny (2 CPU ranks, 2 steps)": ["run", tiny, "--set", "train.steps=2"],
        "tune 1 trial (2 CPU ranks)": ["tune", str(work / "space.yaml"), "--base", tiny, "--trials", "1",
                                       "--storage", "sqlite:///{home}/s.db"],
        "show the run": ["show", "{run}"],
        "runs": ["runs"],
    }


def one(checkout: Path, args: list[str], home: Path) -> tuple[float, float]:
    run = next(iter(sorted((home / "runs").iterdir())), None) if (home / "runs").is_dir() else None
    argv = [a.format(home=home, run=run.name if run else "") for a in args]
    return child_cost([sys.executable, "-m", "workbench.cli", *argv], cwd=checkout, stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL, env={**os.environ, "WORKBENCH_HOME": str(home), "OMP_NUM_THREADS": "1"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision to compare with (a commit or branch)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = work / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), args.base], check=True)
        try:
            arms = {"base": base, "this": ROOT}
            table = {name: {arm: [] for arm in arms} for name in commands(work)}
            for i in range(args.repeats):
                homes = {arm: work / f"home-{arm}-{i}" for arm in arms}
                for name, argv in commands(work).items():  # in order: `show` reads the run `run` made
                    for arm, checkout in arms.items():
                        table[name][arm].append(one(checkout, argv, homes[arm]))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    print(f"median of {args.repeats} interleaved runs; CPU = user + system with the command's children")
    print(f"{'command':36} {'base CPU':>9} {'this CPU':>9} {'ratio':>6} {'base wall':>10} {'this wall':>10}")
    for name, runs in table.items():
        m = medians(runs)
        (bc, bw), (tc, tw) = m["base"], m["this"]
        print(f"{name:36} {bc:8.2f}s {tc:8.2f}s {tc / bc:5.2f}x {bw:9.2f}s {tw:9.2f}s")


if __name__ == "__main__":
    main()
