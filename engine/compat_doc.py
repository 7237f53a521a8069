"""docs/compatibility.md, rendered from the matrix (engine/compat.py) and its recorded results.

`python -m engine.compat --write docs/compatibility.md` (make matrix runs it); tests/test_matrix.py
checks the committed file equals a fresh render. Torch-free.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine import compat
from engine.compat import FEATURES, SYMBOLS, Cell

_METHOD = """\
Every feature of the engine, every pair of features and the triples people use, each with one
verdict. The matrix is data (`engine/compat.py`); this page is generated from it and from the
recorded runs in `docs/data/matrix.json` by `python -m engine.compat --write docs/compatibility.md`
(`make matrix` runs every cell and then writes it). Do not edit it by hand.

## How a verdict is derived

- **Base config**: the scale of the layout parity tests (`tests/test_engine_layouts.py`): {base}.
  Each feature is a fragment of knobs on it, at the smallest layout where the feature acts
  (the table below). Weight decay is on in every run.
- **Merging** a cell's fragments: parallel degrees take the larger value (dp2 + dp2x ep2 = dp2 ep2);
  knobs a feature *sets* must agree, else the cell is **exclusive** and the knob is named; knobs a
  feature only *defaults* (bidirectional and L-GreCo default to topk) yield to another feature's
  value, so bidirectional+c-randk is a real cell. `link.groups` is two groups, even and odd ranks.
- **Refused**: `validate()` refuses the merged config; the reason is its line for a knob the
  cell's features set (else its first line), with the count of its other lines.
- **Accepted** cells run on real gloo ranks (`tests/matrix_runner.py`: forkserver ranks, the
  engine's own `Trainer` on each) and are **verified** when all of these hold:
  - *parity*: each of the {steps} step losses within {tol:.0e} of the reference (bf16: {bf16:.0e});
  - *same-layout resume*: checkpoint at step {ckpt}, resume in the same layout, the losses of steps
    {ckpt}-{last} within {rtol:.0e} of the uninterrupted run, with dropout {dropout} where `validate()`
    allows it (each rank's RNG state is in the checkpoint);
  - *other-layout resume*: the step-{ckpt} checkpoint of the cell's run, resumed in the first of
    dp=W, ZeRO-1 dp=W, tp=W, dp=W/2 x tp2, dp=W/2 x pp2 (W the cell's ranks; number-changing
    features kept) that differs from the cell and that `validate()` accepts, within {rtol:.0e}
    (bf16 cells: within {bf16:.0e}, another layout rounds otherwise). Where none exists, or the
    feature's checkpoints resume only where they were written (CO2), the row says so (n/a).
  A cell that ran and missed one is **failed** (accepted by `validate()` and wrong: a defect or a
  missing refusal); one without a current result is **not run**; a feature that has not landed
  makes its cells **pending**.
- **References**: a feature that only places the computation (`layout`) must follow **one process**
  running the same model with every layout knob removed (the engine's Trainer, one process; each
  distinct reference is computed once). Dropout is 0 in the parity runs: each rank draws its own
  masks, so no multi-rank layout can match one process with dropout on (engine/checkpoint.py,
  tests/test_zero.py). A feature that changes the numbers in a way one process replays
  (`replay`: bf16, live knobs, model.entry) is kept in that process. A feature that changes the
  numbers by design and exists only on several ranks (`own`: lossy compressors, bidirectional,
  L-GreCo, CO2, LSH-MoE, SkipPipe, adaptive SP) is its own reference in its minimal layout: (zero1,
  topk) must follow topk at dp2; under ZeRO-2/3 a compressor compresses each reduce-scatter shard
  (engine/comm/fsdp_compress.py), another selection than DDP's buckets, so (zero3, randk) follows
  randk at ZeRO-2, dp2. A cell made only of such features is **its own reference**
  (parity by definition; the feature's own tests check it, named in the table) and still needs
  both resumes.
- **Live knobs**: from step 1 on, every step applies those of {live} that
  `engine.live.inert_knobs` says can act in the run, through `Trainer.apply_knobs` (what
  `engine/live.py`'s KnobChannel calls once the tuner answers; the file exchange itself is
  tests/test_live_knobs.py's); the reference applies the same ones.
- **CI** runs a rotating slice: accepted cells of at most {max_world} ranks, shuffled by the UTC date
  (or `MATRIX_SEED`), taken while their recorded seconds fit {budget:.0f} s. A failure names its
  cell; `make matrix CELLS=a+b,c+d` re-runs cells, `make matrix` runs all of them.
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


def _cell_rows(statuses: Mapping[str, tuple[str, str]]) -> list[str]:
    rows = ["| cell | ranks | verdict | reason or evidence |", "|---|---|---|---|"]
    for cell in compat.cells():
        kind, detail = statuses[cell.id]
        world = compat.world_of(compat.merge(cell.features).knobs)
        rows.append(f"| `{cell.id}` | {world} | {SYMBOLS[kind]} {kind} | {detail.replace('|', '/')} |")
    return rows


def render(results: Mapping[str, Any]) -> str:
    """The whole document for these recorded results."""
    statuses = {c.id: compat.status(c, results) for c in compat.cells()}
    counts = Counter(kind for kind, _ in statuses.values())
    method = _METHOD.format(base=_base_text(), steps=compat.STEPS, tol=compat.PARITY_TOL, bf16=compat.BF16_TOL,
                            ckpt=compat.CHECKPOINT_STEP, last=compat.STEPS - 1, rtol=compat.RESUME_TOL,
                            dropout=compat.DROPOUT, live=", ".join(f"`{k}={v}`" for k, v in compat.LIVE_CANDIDATES.items()),
                            max_world=compat.SAMPLE_MAX_WORLD, budget=compat.SAMPLE_BUDGET_S)
    summary = ", ".join(f"{SYMBOLS[k]} {k}: {counts[k]}" for k in SYMBOLS if counts[k])
    failed = [f"- `{cid}`: {detail}" for cid, (kind, detail) in statuses.items() if kind == "failed"]
    lines = ["# Compatibility matrix", "", method, "## Summary", "",
             f"{len(statuses)} cells ({len(FEATURES)} features alone, every pair, {len(compat.TRIPLES)} triples): "
             f"{summary}.", "", "Failed (accepted by `validate()`, and parity or resume does not hold):", "",
             *(failed or ["- none"]), "", "## Features", "", *_features_table(), "",
             "## Pairs", "", "Row feature x column feature (the diagonal: the feature alone). "
             + " ".join(f"{s} {k}" for k, s in SYMBOLS.items()) + ".", "", *_grid(statuses), "",
             "## Every cell", "", *_cell_rows(statuses), ""]
    return "\n".join(lines)


def load_results(path: str | Path = compat.RESULTS_PATH) -> dict[str, Any]:
    path = Path(path)
    return json.loads(path.read_text()) if path.is_file() else {}


def write(doc: str | Path = compat.DOC_PATH, results: str | Path = compat.RESULTS_PATH) -> Path:
    """Render the document from the results file and write it."""
    out = Path(doc)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(load_results(results)))
    return out
