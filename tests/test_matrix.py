"""The compatibility matrix (engine/compat.py): its rules as units, the generated document, and the
cells on real ranks (tests/matrix_runner.py).

`test_cell` runs CI's rotating slice by default: accepted cells of <= 4 ranks shuffled by the UTC
date (`MATRIX_SEED` overrides it), within compat.SAMPLE_BUDGET_S of recorded seconds.
`MATRIX_CELLS=a+b,c+d` runs those cells, `MATRIX_CELLS=all` every accepted cell; `MATRIX_RECORD=PATH`
records each result (`make matrix` sets both, then regenerates docs/compatibility.md).
"""
from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest

from engine import compat
from engine.compat import Cell, FEATURES
from engine.compat_doc import load_results, render

ROOT = Path(__file__).resolve().parent.parent
SEED = os.environ.get("MATRIX_SEED") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")


def _selected() -> list[str]:
    wanted = os.environ.get("MATRIX_CELLS", "")
    if wanted == "all":
        return [c.id for c in compat.cells() if compat.verdict(c).kind == "accepted"]
    if wanted:
        return [Cell.parse(c.strip()).id for c in wanted.split(",") if c.strip()]
    return compat.sample(SEED, load_results(ROOT / compat.RESULTS_PATH))


# ---------------------------------------------------------------- the cells on real ranks

@pytest.mark.slow
@pytest.mark.timeout(900)  # one cell: up to 8 ranks, 4-5 Trainer runs and a reference
@pytest.mark.xdist_group("matrix")
@pytest.mark.parametrize("cell", _selected())
def test_cell(cell: str) -> None:
    """Parity with the cell's reference and both resumes (engine/compat.py's module docstring)."""
    from matrix_runner import record, run_cell, summary

    result = run_cell(cell)
    if os.environ.get("MATRIX_RECORD"):
        record(result, os.environ["MATRIX_RECORD"])
    assert result["ok"], f"{summary(result)}\nsample seed {SEED}; re-run: make matrix CELLS={cell}"


# ---------------------------------------------------------------- the document and the record

def test_committed_document_is_the_generated_one() -> None:
    """docs/compatibility.md is `python -m engine.compat --write` of the recorded results."""
    committed = (ROOT / compat.DOC_PATH).read_text()
    assert committed == render(load_results(ROOT / compat.RESULTS_PATH)), \
        "docs/compatibility.md is stale: run `python -m engine.compat --write` (or make matrix)"


def test_every_accepted_cell_has_a_passing_current_result() -> None:
    """No cell is unknown: each accepted cell has a recorded result of its current plan that passed.

    Only `make matrix` (about 90 minutes) can make this true, so CI shows it as a skip with the count
    (`-rs`) until the recorded results are complete; MATRIX_COMPLETE=1 makes it a failure."""
    results = load_results(ROOT / compat.RESULTS_PATH)
    open_cells = {c.id: compat.status(c, results) for c in compat.cells()}
    bad = {cid: s for cid, s in open_cells.items() if s[0] in ("not run", "failed")}
    if bad and not os.environ.get("MATRIX_COMPLETE"):
        kinds = [k for k, _ in bad.values()]
        pytest.skip(f"the matrix is not complete: {kinds.count('not run')} accepted cells not run, "
                    f"{kinds.count('failed')} failed (docs/compatibility.md lists them; make matrix)")
    assert not bad, f"{len(bad)} accepted cells are not verified (make matrix CELLS=...): " + \
        "; ".join(f"{cid}: {kind}" for cid, (kind, _) in list(bad.items())[:20])


def test_pending_features_have_not_landed() -> None:
    """A feature stays pending only while its config key does not exist; model.hf landed, so the hf
    features have fragments that validate() accepts alone."""
    from engine.config import ModelConfig

    assert "hf" in ModelConfig.__dataclass_fields__
    assert not FEATURES["hf"].pending and not FEATURES["hf-moe"].pending
    assert compat.verdict(Cell.parse("hf")).kind == "accepted"
    assert compat.verdict(Cell.parse("hf-moe+ep")).kind == "accepted"
    assert "dense" in compat.verdict(Cell.parse("hf+ep")).reason


# ---------------------------------------------------------------- the rules, as units

def test_degrees_take_the_larger_and_set_knobs_must_agree() -> None:
    merged = compat.merge(["dp", "ep"])
    assert merged.knobs["parallel.dp"] == 2 and merged.knobs["parallel.ep"] == 2 and not merged.conflict
    assert compat.merge(["moe-hier", "ep"]).knobs["parallel.dp"] == 4
    assert compat.verdict(Cell.parse("zero1+zero3")) == compat.Verdict("exclusive", "parallel.zero: zero1 sets 1, zero3 sets 3")
    assert compat.verdict(Cell.parse("c-topk+c-randk")).kind == "exclusive"


def test_a_default_yields_to_a_set_knob() -> None:
    assert compat.merge(["bidirectional"]).knobs["comm.compressor"] == "topk"
    assert compat.merge(["bidirectional", "c-randk"]).knobs["comm.compressor"] == "randk"
    assert compat.verdict(Cell.parse("bidirectional+c-powersgd")).reason.startswith("comm.bidirectional=True: needs")


def test_a_refusal_is_validates_line_for_the_cells_own_knob() -> None:
    from engine.config import from_dict
    from engine.validate import check

    cell = Cell.parse("tp+c-topk")
    flat = compat.overrides(compat.merge(cell.features).knobs)
    lines = [str(e) for e in check(from_dict(compat.nested(flat)))]
    assert compat.verdict(cell).kind == "refused"
    assert compat.verdict(cell).reason.split(" (+")[0] in lines
    # the pipeline's batch rule and the MoE rule both fire: the cell's own knob is named
    assert compat.verdict(Cell.parse("pp-dualpipev+moe-hier")).reason.startswith("model.experts=4: needs parallel.pp=1")


def test_references_by_kind() -> None:
    tp = compat.plan(Cell.parse("dp+tp"))
    assert tp.reference_kind == "one process" and compat.world_of(tp.reference) == 1
    topk = compat.plan(Cell.parse("zero1+c-topk"))  # (topk, zero1) follows topk at dp2
    assert topk.reference_kind == "own: c-topk"
    assert topk.reference["parallel.dp"] == 2 and "parallel.zero" not in topk.reference
    ep = compat.plan(Cell.parse("ep"))  # one process of the same MoE model
    assert ep.reference["model.experts"] == 4 and compat.world_of(ep.reference) == 1
    assert "parallel.ep" not in ep.reference
    assert compat.plan(Cell.parse("bf16+tp")).tol == compat.BF16_TOL
    assert compat.plan(Cell.parse("c-topk")).reference_kind == "itself"
    # ZeRO-2/3 compress reduce-scatter shards: their reference is the compressor at ZeRO-2
    assert compat.plan(Cell.parse("zero3+c-randk")).reference["parallel.zero"] == 2
    assert compat.plan(Cell.parse("zero2+c-randk")).reference_kind == "itself"


def test_other_layout_and_dropout_chain() -> None:
    assert compat.plan(Cell.parse("dp+tp")).other_note == "dp=4"
    assert compat.plan(Cell.parse("dp")).other_note == "dp=2, zero=1"
    assert compat.plan(Cell.parse("ep")).other["parallel.dp"] == 2 and "parallel.ep" not in compat.plan(Cell.parse("ep")).other
    assert compat.plan(Cell.parse("tp+co2")).other is None  # a CO2 checkpoint resumes only as CO2 in its dp, tp
    ring = compat.plan(Cell.parse("cp-ring"))
    assert ring.dropout_config["model.dropout"] == 0.0 and ring.dropout_note.startswith("parallel.cp_impl")
    assert compat.plan(Cell.parse("tp")).dropout_config["model.dropout"] == compat.DROPOUT


def test_cells_are_every_pair_and_the_triples() -> None:
    n = len(FEATURES)
    ids = [c.id for c in compat.cells()]
    assert len(ids) == len(set(ids)) == n + n * (n - 1) // 2 + len(compat.TRIPLES)
    assert "dp+tp+pp-1f1b" in ids and "tp+ep+holmes" in ids
    with pytest.raises(ValueError, match="unknown feature"):
        Cell.parse("dp+warp")


def test_the_sample_is_seeded_small_and_within_budget() -> None:
    results = load_results(ROOT / compat.RESULTS_PATH)
    a, b = compat.sample("20260101", results), compat.sample("20260101", results)
    assert a == b and a != compat.sample("20260102", results)
    for cell in a:
        assert compat.verdict(Cell.parse(cell)).kind == "accepted"
        assert compat.world_of(compat.merge(Cell.parse(cell).features).knobs) <= compat.SAMPLE_MAX_WORLD
    assert sum(compat._estimate_s(Cell.parse(c), results) for c in a) <= compat.SAMPLE_BUDGET_S


def test_feature_names_are_unique_and_use_validates_names() -> None:
    from engine.validate import COMPRESSORS, CP_IMPLS, SCHEDULES

    names = [f.name for f in compat._features()]
    assert len(names) == len(set(names))
    assert {f"pp-{s}" for s in SCHEDULES} | {f"cp-{i}" for i in CP_IMPLS} | {f"c-{c}" for c in COMPRESSORS[1:]} <= set(names)
