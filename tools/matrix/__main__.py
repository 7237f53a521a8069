"""`python -m tools.matrix --write [DOC] [--results JSON]` renders docs/compatibility.md for the current
code; `--sample SEED` prints CI's slice; `--refresh` the cells `make matrix` re-runs; `--estimate CELLS`
how many cells `make matrix CELLS=...` runs (`stale` by default) and about how long. Torch-free."""
from __future__ import annotations

import argparse

from tools.matrix.compat_doc import write
from tools.matrix.compat_results import DOC_PATH, RESULTS_PATH, cell_codes, estimate_line, load_results, sample, \
    select, to_refresh


def main(argv: list[str] | None = None) -> int:
    """Render the document, or print CI's slice, the cells to re-run or their count and time."""
    parser = argparse.ArgumentParser(prog="python -m tools.matrix", description=__doc__)
    parser.add_argument("--write", nargs="?", const=DOC_PATH, help=f"render the document (default {DOC_PATH})")
    parser.add_argument("--results", default=RESULTS_PATH, help="recorded results (JSON)")
    parser.add_argument("--sample", metavar="SEED", help="print the cells of CI's slice for SEED")
    parser.add_argument("--refresh", action="store_true", help="print the cells whose result is stale or missing")
    parser.add_argument("--estimate", metavar="CELLS", help="print how many of CELLS (stale, all, a+b,c) run, "
                        "and about how long by their recorded durations")
    args = parser.parse_args(argv)
    if args.sample or args.refresh or args.estimate:
        results, codes = load_results(args.results), cell_codes()
        if args.sample:
            print(",".join(sample(args.sample, results, codes)))
        if args.refresh:
            print(",".join(to_refresh(results, codes)))
        if args.estimate:
            print("make matrix: " + estimate_line(select(args.estimate, results, codes, ""), results, codes))
    if args.write:
        print(f"wrote {write(args.write, args.results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
