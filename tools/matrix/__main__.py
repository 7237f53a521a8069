"""`python -m tools.matrix --write [DOC] [--results JSON]` renders docs/compatibility.md for the current
code; `--sample SEED` prints CI's slice; `--refresh` the cells `make matrix` re-runs. Torch-free."""
from __future__ import annotations

import argparse

from tools.matrix.compat_doc import write
from tools.matrix.compat_results import DOC_PATH, RESULTS_PATH, code_state, load_results, sample, to_refresh


def main(argv: list[str] | None = None) -> int:
    """Render the document, or print CI's slice or the cells to re-run."""
    parser = argparse.ArgumentParser(prog="python -m tools.matrix", description=__doc__)
    parser.add_argument("--write", nargs="?", const=DOC_PATH, help=f"render the document (default {DOC_PATH})")
    parser.add_argument("--results", default=RESULTS_PATH, help="recorded results (JSON)")
    parser.add_argument("--sample", metavar="SEED", help="print the cells of CI's slice for SEED")
    parser.add_argument("--refresh", action="store_true", help="print the cells without a current passing result")
    args = parser.parse_args(argv)
    code = code_state()["code"]
    if args.sample:
        print(",".join(sample(args.sample, load_results(args.results), code)))
    if args.refresh:
        print(",".join(to_refresh(load_results(args.results), code)))
    if args.write:
        print(f"wrote {write(args.write, args.results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
