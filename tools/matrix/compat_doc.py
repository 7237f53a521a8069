"""docs/compatibility.md, rendered from the matrix (tools/matrix/compat.py) and its recorded results.

`python -m tools.matrix --write docs/compatibility.md` (make matrix runs it); tests/test_matrix.py
checks the committed file equals a fresh render. Torch-free.
"""
from __future__ import annotations

import fcntl
import json
import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tools.matrix import compat, compat_code, compat_results
from tools.matrix.compat import FEATURES, Cell
from tools.matrix.compat_results import SYMBOLS, checks, commit_text, load_results

_METHOD = """\
Every feature of the engine, every pair of features and the triples people use, each with one
verdict. The matrix is data (`tools/matrix/compat.py`); this page is generated from it and from the
recorded runs in `docs/data/matrix.json` by `python -m tools.matrix --write docs/compatibility.md`
for the code as it is now (`make matrix` re-runs the stale and never-run cells and then writes it).
Do not edit it by hand.

## How a verdict is derived

- **Base config**: the scale of the layout parity tests (`tests/test_engine_layouts.py`): {base}.
  Each feature is a fragment of knobs on it, at the smallest layout where the feature acts
  (the table below). Weight decay is on in every run, and every run evaluates once, after its
  last step (its validation loss is compared like a step's loss).
- **Merging** a cell's fragments: parallel degrees take the larger value (dp2 + dp2x ep2 = dp2 ep2);
  knobs a feature *sets* must agree, else the cell is **exclusive** and the knob is named; knobs a
  feature only *defaults* (bidirectional and L-GreCo default to topk) yield to another feature's
  value, so bidirectional+c-randk is a real cell. `link.groups` is two groups, even and odd ranks.
- **Refused**: `validate()` refuses the merged config; the reason is its line for a knob the
  cell's features set (else its first line), with the count of its other lines.
- **Accepted** cells run on real gloo ranks (`tests/matrix_runner.py`: forkserver ranks, the
  engine's own `Trainer` on each), three checks:
  - *parity*: each of the {steps} step losses and the validation loss within {tol:.0e} (bf16:
    {bf16:.0e}) of a reference in a **different layout** (its layout knobs, defaults left out,
    differ from the cell's);
  - *same-layout resume*: checkpoint at step {ckpt}, resume in the same layout, the losses of steps
    {ckpt}-{last} and the validation loss within {rtol:.0e} of the uninterrupted run, with dropout
    {dropout} where `validate()` allows it (each rank's RNG state is in the checkpoint);
  - *other-layout resume*: the step-{ckpt} checkpoint of the cell's run, resumed in a layout whose
    parallel degrees (dp, tp, pp, cp, ep) differ from the cell's: the first of dp=W, ZeRO-1 dp=W,
    tp=W, dp=W/2 x tp2, dp=W/2 x pp2 (W the cell's ranks; dp2, tp2 for a one-process cell;
    number-changing features kept) that `validate()` accepts, else the reference's layout, within
    {rtol:.0e} (bf16 cells: within {bf16:.0e}, another layout rounds otherwise). Where none exists,
    or the feature's checkpoints resume only where they were written (CO2), the row says why (n/a).
- **Verdicts of accepted cells**: **verified** when all three hold; **no reference** when both
  resumes hold but the cell has no other layout to compare with (a one-process cell with no
  layout knob, or a number-changing feature alone in its minimal layout): counted apart, never as
  verified; **failed** when a check does not hold (accepted by `validate()` and wrong: a defect or
  a missing refusal); **stale** when the recorded result is of another plan or of other code than
  the cell runs now: each result records a content hash of the files its cell's runs can execute
  (uncommitted changes count; "Code each cell runs" below) and its commit, so a change stales only
  the cells that can run it ("last verified on commit X"); **not run** without a result; a feature
  that has not landed makes its cells **pending**.
- **References**: a feature that only places the computation (`layout`) must follow **one process**
  running the same model with every layout knob removed (the engine's Trainer, one process; each
  distinct reference is computed once). Dropout is 0 in the parity runs: each rank draws its own
  masks, so no multi-rank layout can match one process with dropout on (engine/train/checkpoint.py,
  tests/test_zero.py). A feature that changes the numbers in a way one process replays
  (`replay`: bf16, live knobs, model.entry) is kept in that process. A feature that changes the
  numbers by design and exists only on several ranks (`own`: lossy compressors, bidirectional,
  L-GreCo, CO2, LSH-MoE, SkipPipe, adaptive SP) is the reference in its minimal layout: (zero1,
  topk) must follow topk at dp2; under ZeRO-2/3 a compressor compresses each reduce-scatter shard
  (engine/comm/fsdp_compress.py), another selection than DDP's buckets, so (zero3, randk) follows
  randk at ZeRO-2, dp2. Such a feature alone in its minimal layout has **no reference** (the
  feature's own tests check it, named in the table).
- **Live knobs**: from step 1 on, every step applies those of {live} that
  `engine.train.live.inert_knobs` says can act in the run, through `Trainer.apply_knobs` (what
  `engine/train/live.py`'s KnobChannel calls once the tuner answers; the file exchange itself is
  tests/test_live_knobs.py's); the reference applies the same ones.
- **CI** runs a rotating slice, shuffled by the UTC date (or `MATRIX_SEED`), cells without a current
  result first: {big} cell(s) of more than {max_world} ranks, then cells of at most {max_world} ranks
  while their recorded seconds fit {budget:.0f} s in all. It records what it runs into
  `docs/data/matrix.json` and re-renders this page (`MATRIX_RECORD=` turns that off). A failure names
  its cell; `make matrix` re-runs every stale or never-run cell, after printing how many and about
  how long by their recorded durations (resumable: each result is recorded as it ends),
  `make matrix CELLS=a+b,c+d` the cells named, `CELLS=all` all. The suite's
  `test_every_accepted_cell_has_a_passing_current_result` fails while any accepted cell is stale, not
  run or failed, so a change that stales cells lands with their re-run.
"""


def _fmt(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def _base_text() -> str:
    return ", ".join(f"`{k}={_fmt(v)}`" for k, v in compat.BASE.items() if not k.startswith("profile."))


def _features_table() -> list[str]:
    rows = ["| # | feature | what | fragment | reference |", "|---|---|---|---|---|"]
    for i, f in enumerate(FEATURES.values(), 1):
        knobs = {**f.degrees, **f.set, **{f"{k} (default)": v for k, v in f.default.items()}}
        frag = ", ".join(f"`{k}={_fmt(v)}`" for k, v in knobs.items()) or "-"
        ref = f.reference.kind + (f": {f.reference.why}" if f.reference.why else "")
        if f.reference.checked_by:
            ref += f" (alone: {f.reference.checked_by})"
        if f.pending:
            frag, ref = f"pending: {f.pending}", "-"
        rows.append(f"| {i} | `{f.name}` | {f.title} | {frag} | {ref} |")
    return rows


def _grid(statuses: Mapping[str, tuple[str, str]]) -> list[str]:
    names = list(FEATURES)
    head = "| | " + " | ".join(str(i) for i in range(1, len(names) + 1)) + " |"
    rows = [head, "|---" * (len(names) + 1) + "|"]
    for i, a in enumerate(names, 1):
        marks = []
        for b in names:
            cell = Cell.parse(a if a == b else f"{a}+{b}")
            marks.append(SYMBOLS[statuses[cell.id][0]])
        rows.append(f"| {i} `{a}` | " + " | ".join(marks) + " |")
    return rows


def _cell_rows(statuses: Mapping[str, tuple[str, str]], results: Mapping[str, Any]) -> list[str]:
    """Accepted cells: the verdict, each of the three checks and the commit of their result."""
    rows = ["| cell | ranks | verdict | parity vs a different layout | resume, same layout | resume, other layout "
            "| commit |", "|---|---|---|---|---|---|---|"]
    for cell in compat.cells():
        kind, detail = statuses[cell.id]
        if compat.verdict(cell).kind != "accepted":
            continue
        world = compat.world_of(compat.merge(cell.features).knobs)
        r = results.get(cell.id)
        parity, same, other = checks(r) if r else ("-", "-", "-")
        verdict = f"{SYMBOLS[kind]} {kind}" + (f": {detail}" if kind in ("stale", "not run") else "")
        if r and r.get("errors"):
            parity += "; errors: " + "; ".join(f"{k}: {v}" for k, v in r["errors"].items())
        cols = [f"`{cell.id}`", str(world), verdict, parity, same, other, commit_text(r) if r else "-"]
        rows.append("| " + " | ".join(c.replace("|", "/") for c in cols) + " |")
    return rows


def _other_rows(statuses: Mapping[str, tuple[str, str]]) -> list[str]:
    rows = ["| cell | ranks | verdict | reason |", "|---|---|---|---|"]
    for cell in compat.cells():
        kind, detail = statuses[cell.id]
        if compat.verdict(cell).kind == "accepted":
            continue
        world = compat.world_of(compat.merge(cell.features).knobs)
        rows.append(f"| `{cell.id}` | {world} | {SYMBOLS[kind]} {kind} | {detail.replace('|', '/')} |")
    return rows


def _check_totals(statuses: Mapping[str, tuple[str, str]], results: Mapping[str, Any]) -> list[str]:
    """Per check, how many current results ran it, passed it and had none (n/a)."""
    current = [results[cid] for cid, (kind, _) in statuses.items() if kind in compat_results.CURRENT]
    rows = ["| check (current results) | ran | held | failed | not applicable |", "|---|---|---|---|---|"]
    for name, part, none in (("parity vs a different-layout reference", "parity", "why"),
                             ("resume in the same layout", "resume_same", ""),
                             ("resume in another layout (other dims)", "resume_other", "na")):
        ran = [r[part] for r in current if "diff" in r[part]]
        held = sum(p["ok"] for p in ran)
        na = sum(1 for r in current if none and none in r[part])
        rows.append(f"| {name} | {len(ran)} | {held} | {len(ran) - held} | {na} |")
    return rows


def _code_section(codes: Mapping[str, str]) -> list[str]:
    """What the cells' code hashes cover (tools/matrix/compat_code.py): the core, and each gate's cells."""
    index = compat_code.build_index(compat_results.ROOT)
    opened = Counter(g for c in compat.cells() if c.id in codes for g in compat_code.gates_of(c))
    rows = ["| modules (and what they import) | imported where a config of the cell's plan sets | cells |",
            "|---|---|---|"]
    rows += [f"| {', '.join(f'`{m}`' for m in g.modules)} | {g.when} | {opened[g]} |" for g in compat_code.GATES]
    return [f"Every result is keyed by the content of the files its cell's runs can execute, read from the "
            f"imports (`tools/matrix/compat_code.py`): the core every run executes ({len(index.core())} modules "
            f"of `engine/` and `profilers/` the trainer, the checkpoint and the runner import, "
            f"`tests/matrix_runner.py` and `tests/parallel_harness.py` included), and the modules below where a "
            f"config of its plan (the cell's run, its reference, the dropout chain, the other layout) sets "
            f"their knobs. A change to the core stales every cell; a change to a module below only the cells "
            f"that open it ({len(set(codes.values()))} distinct code sets).", "", *rows]


def render(results: Mapping[str, Any], codes: Mapping[str, str] | None = None) -> str:
    """The whole document for these recorded results and the cells' code hashes (default: the current code)."""
    codes = compat_results.cell_codes() if codes is None else codes
    statuses = {c.id: compat_results.status(c, results, codes) for c in compat.cells()}
    counts = Counter(kind for kind, _ in statuses.values())
    method = _METHOD.format(base=_base_text(), steps=compat.STEPS, tol=compat.PARITY_TOL, bf16=compat.BF16_TOL,
                            ckpt=compat.CHECKPOINT_STEP, last=compat.STEPS - 1, rtol=compat.RESUME_TOL,
                            dropout=compat.DROPOUT,
                            live=", ".join(f"`{k}={v}`" for k, v in compat.LIVE_CANDIDATES.items()),
                            big=compat_results.SAMPLE_BIG, max_world=compat_results.SAMPLE_MAX_WORLD,
                            budget=compat_results.SAMPLE_BUDGET_S)
    summary = ", ".join(f"{SYMBOLS[k]} {k}: {counts[k]}" for k in SYMBOLS if counts[k])
    failed = [f"- `{cid}`: {detail}" for cid, (kind, detail) in statuses.items() if kind == "failed"]
    stale = Counter(detail.split(";")[0] for kind, detail in statuses.values() if kind == "stale")
    lines = ["# Compatibility matrix", "", method, "## Summary", "",
             f"{len(statuses)} cells ({len(FEATURES)} features alone, every pair, {len(compat.TRIPLES)} triples): "
             f"{summary}.", "",
             *_check_totals(statuses, results), "",
             "Stale cells by the commit of their last result: "
             + (", ".join(f"{n} {k}" for k, n in stale.most_common()) or "none") + ".", "",
             "Failed (accepted by `validate()`, and a check does not hold):", "",
             *(failed or ["- none"]), "", "## Features", "", *_features_table(), "",
             "## Code each cell runs", "", *_code_section(codes), "",
             "## Pairs", "", "Row feature x column feature (the diagonal: the feature alone). "
             + " ".join(f"{s} {k}" for k, s in SYMBOLS.items()) + ".", "", *_grid(statuses), "",
             "## Accepted cells", "", *_cell_rows(statuses, results), "",
             "## Refused and exclusive cells", "", *_other_rows(statuses), ""]
    return "\n".join(lines)


def write(doc: str | Path = compat_results.ROOT / compat_results.DOC_PATH,
          results: str | Path = compat_results.ROOT / compat_results.RESULTS_PATH) -> Path:
    """Render the document from the results file for the current code and write it."""
    out = Path(doc)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(load_results(results)))
    return out


def record(result: Mapping[str, Any], path: str | Path, doc: str | Path | None = None) -> None:
    """Merge one result into the results file, then render `doc` from it. Under a lock on the folder
    (several processes may record), each file replaced whole (a `make matrix` killed at any point
    keeps every result recorded before)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        data = load_results(path)
        data[result["cell"]] = dict(result)
        text = json.dumps(dict(sorted(data.items())), indent=1, sort_keys=True) + "\n"
        compat.replace_atomically(path, text.encode())
        if doc is not None:
            compat.replace_atomically(Path(doc), render(data).encode())
    finally:
        os.close(folder)  # releases the lock
