"""The matrix's recorded results (docs/data/matrix.json): the code they exercised, each cell's status,
CI's rotating sample and the cells `make matrix` re-runs.

A result is current when it is of the cell's current plan (`tools.matrix.compat.plan(...).key`) and of the
code that cell runs (`code_state`: tools/matrix/compat_code.py's content hash of the modules its runs
can execute, uncommitted changes included; the commit is recorded beside it for the reader). Any
other result is `stale`: shown with the commit it was last verified on, never as verified. A change
stales only the cells whose code it touches; `make matrix` re-runs those and the cells never run.
Torch-free.
"""
from __future__ import annotations

import hashlib
import json
import random
import subprocess
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tools.matrix.compat import RESUME_TOL, Cell, cells, merge, plan, verdict, world_of
from tools.matrix.compat_code import build_index, cell_code, cell_modules

ROOT = Path(__file__).resolve().parents[2]
RESULTS_PATH = "docs/data/matrix.json"
DOC_PATH = "docs/compatibility.md"
# CI's slice: recorded seconds of the sampled cells (issue 36: at most 4 minutes). In a whole suite, beside two
# other workers, a cell takes about 2x what `make matrix` recorded in two shards at once (the 20 slice cells of
# tests/durations.json: 168 s recorded, 316 s in a whole run; 102 s recorded one at a time), so 90 s is ~3 minutes
SAMPLE_BUDGET_S = 90.0
SAMPLE_MAX_WORLD = 4  # CI's 2 cores: cells of at most 4 ranks, and SAMPLE_BIG above that
SAMPLE_BIG = 1  # cells of more than SAMPLE_MAX_WORLD ranks in every slice (issue 48)
OLDER_PLAN_FACTOR = 2.0  # seconds of a result of an older plan x this: the estimate of the current plan's run
CURRENT = ("verified", "no reference", "failed")  # kinds of a current result
TO_RUN = ("stale", "not run")  # what `make matrix` re-runs (a current failure re-runs once its code changes)
SYMBOLS = {"verified": "✓", "no reference": "○", "failed": "!", "stale": "↻", "not run": "?",
           "refused": "✗", "exclusive": "⊘", "pending": "…"}


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30, check=False)


def code_state(cell: Cell, root: Path = ROOT) -> dict[str, Any]:
    """{"code": the hash of the code `cell` runs, "commit": HEAD, "dirty": whether those files differ from
    HEAD}; the hash decides staleness, the commit only names where to look."""
    index = build_index(root)
    files = sorted(index.paths[m] for m in cell_modules(cell, index))
    head = _git(root, "rev-parse", "--short=12", "HEAD")
    dirty = _git(root, "diff", "--quiet", "HEAD", "--", *files).returncode != 0 if head.returncode == 0 else False
    return {"code": cell_code(cell, index), "commit": head.stdout.strip() if head.returncode == 0 else "unknown",
            "dirty": dirty}


def cell_codes(root: Path = ROOT) -> dict[str, str]:
    """Each accepted cell's code hash (`code_state`'s "code") in the checkout at `root`."""
    index = build_index(root)
    return {c.id: cell_code(c, index) for c in cells() if verdict(c).kind == "accepted"}


def load_results(path: str | Path = ROOT / RESULTS_PATH) -> dict[str, Any]:
    path = Path(path)
    return json.loads(path.read_text()) if path.is_file() else {}


def commit_text(r: Mapping[str, Any]) -> str:
    """Where a result was recorded: `abc1234`, `abc1234+` (with uncommitted changes), or `unknown`."""
    if "commit" not in r:
        return "unknown"
    return r["commit"][:7] + ("+" if r.get("dirty") else "")


def status(cell: Cell, results: Mapping[str, Any], codes: Mapping[str, str]) -> tuple[str, str]:
    """(kind, detail): a verdict other than accepted; else, from `results` and the cells' current code
    hashes (`cell_codes`), verified / no reference / failed (current), stale or not run."""
    v = verdict(cell)
    if v.kind != "accepted":
        return v.kind, v.reason
    r = results.get(cell.id)
    if r is None:
        return "not run", "no recorded result"
    if r.get("key") != plan(cell).key or r.get("code") != codes.get(cell.id):
        changed = "the cell's plan changed" if r.get("key") != plan(cell).key else "its code changed"
        was = "verified" if r.get("ok") else "run (failed)"
        where = f"on commit {commit_text(r)}" if "commit" in r else "before results recorded their commit"
        return "stale", f"last {was} {where}; {changed} since"
    if not r["ok"]:
        return "failed", evidence(r)
    return ("no reference" if r["parity"].get("reference") == "none" else "verified"), evidence(r)


def _fig(part: Mapping[str, Any], tol: float) -> str:
    return f"{part['diff']:.1e}" + ("" if part["ok"] else f" (over {tol:.0e})")


def checks(r: Mapping[str, Any]) -> tuple[str, str, str]:
    """The three checks of a result in words: parity vs a different layout, same-layout resume,
    other-layout resume."""
    p, s, o = r["parity"], r["resume_same"], r["resume_other"]
    if p.get("reference") == "none":
        parity = f"none: {p['why']}"
    elif p.get("reference") == "itself":  # results recorded before issue 48
        parity = "vs itself (no comparison)"
    else:
        where = f" [{p['layout']}]" if p.get("layout") not in (None, p["reference"]) else ""
        parity = f"vs {p['reference']}{where} " + (_fig(p, p["tol"]) if "diff" in p else "(no losses)")
    same = _fig(s, RESUME_TOL) + (f", dropout {s['dropout']}" if s.get("dropout") else "")
    other = f"[{o['layout']}] {_fig(o, o['tol'])}" if "diff" in o else f"n/a: {o['na']}"
    return parity, same, other


def evidence(r: Mapping[str, Any]) -> str:
    """A recorded result in one line: the three checks, the errors and the test id."""
    parity, same, other = checks(r)
    errors = "; errors: " + "; ".join(f"{k}: {v}" for k, v in r["errors"].items()) if r.get("errors") else ""
    return f"parity {parity}; resume same {same}; other {other}{errors}; `{r['test']}`"


def _estimate_s(cell: Cell, results: Mapping[str, Any]) -> float:
    r = results.get(cell.id, {})
    if r.get("seconds") and r.get("key") == plan(cell).key:
        return float(r["seconds"])
    if r.get("seconds"):  # a result of an older plan: the same 19 cells ran 179 s before issue 48, 340 s after
        return OLDER_PLAN_FACTOR * float(r["seconds"])
    # unrecorded: 2 ranks ~20 s, 4 ranks ~30 s (this machine at load 10-18 took 4-60 s per cell)
    return 10.0 + 5.0 * world_of(merge(cell.features).knobs)


def sample(seed: str, results: Mapping[str, Any], codes: Mapping[str, str],
           budget_s: float = SAMPLE_BUDGET_S) -> list[str]:
    """CI's rotating slice, shuffled by `seed`, cells without a current result first (so CI refreshes
    them): SAMPLE_BIG cells of more than SAMPLE_MAX_WORLD ranks, then cells of at most that many
    while their recorded (or estimated) seconds fit `budget_s`. A cell whose current result failed is
    left out, and so is every cell with a feature that fails alone: the document lists them as
    failed, and their fix re-runs them (`make matrix`)."""
    statuses = {c.id: status(c, results, codes) for c in cells()}
    failing = {c.features[0] for c in cells() if len(c.features) == 1 and statuses[c.id][0] == "failed"}
    pool = [c for c in cells() if verdict(c).kind == "accepted" and statuses[c.id][0] != "failed"
            and not failing.intersection(c.features)]
    random.Random(seed).shuffle(pool)
    pool.sort(key=lambda c: statuses[c.id][0] in CURRENT)  # stable: the shuffle within each part
    big = [c for c in pool if world_of(merge(c.features).knobs) > SAMPLE_MAX_WORLD][:SAMPLE_BIG]
    out, spent = [c.id for c in big], sum(_estimate_s(c, results) for c in big)
    for c in pool:
        cost = _estimate_s(c, results)
        if world_of(merge(c.features).knobs) <= SAMPLE_MAX_WORLD and spent + cost <= budget_s:
            out.append(c.id)
            spent += cost
    return out


def unverified(results: Mapping[str, Any], codes: Mapping[str, str], kinds: tuple[str, ...] = TO_RUN + ("failed",),
               ) -> dict[str, tuple[str, str]]:
    """The accepted cells whose status is one of `kinds` (by default: no passing result of their current plan
    and code): {cell: (status, why)}."""
    statuses = {c.id: status(c, results, codes) for c in cells()}
    return {cid: s for cid, s in statuses.items() if s[0] in kinds}


def to_refresh(results: Mapping[str, Any], codes: Mapping[str, str]) -> list[str]:
    """The accepted cells whose result is stale or missing: what `make matrix` re-runs."""
    return list(unverified(results, codes, TO_RUN))


def select(wanted: str, results: Mapping[str, Any], codes: Mapping[str, str], seed: str) -> list[str]:
    """The cells a run takes: `stale` (to_refresh), `all` accepted cells, `a+b,c+d` those, '' CI's sample."""
    if wanted == "all":
        return [c.id for c in cells() if verdict(c).kind == "accepted"]
    if wanted == "stale":
        return to_refresh(results, codes)
    if wanted:
        return [Cell.parse(c.strip()).id for c in wanted.split(",") if c.strip()]
    return sample(seed, results, codes)


def estimate_line(chosen: list[str], results: Mapping[str, Any], codes: Mapping[str, str]) -> str:
    """`N cells to run (S stale, M not run, ...), about 3 h 05 min (or 4 min 10 s) by their recorded durations`."""
    kinds = Counter(status(Cell.parse(c), results, codes)[0] for c in chosen)
    s = round(sum(_estimate_s(Cell.parse(c), results) for c in chosen))
    parts = ", ".join(f"{n} {kind}" for kind, n in kinds.most_common())
    took = f"{s // 3600} h {s % 3600 // 60:02d} min" if s >= 3600 else f"{s // 60} min {s % 60:02d} s"
    return f"{len(chosen)} cells to run ({parts or 'none'}), about {took} by their recorded durations (one at a time)"
