"""The compatibility matrix (tools/matrix/compat.py): its rules as units, the generated document, and the
cells on real ranks (tests/matrix_runner.py).

`test_cell` runs CI's rotating slice by default (tools/matrix/compat_results.py `sample`: cells without a
current result first, one of more than 4 ranks, then cells of <= 4 ranks shuffled by the UTC date
(`MATRIX_SEED` overrides it) within SAMPLE_BUDGET_S of recorded seconds), and records each result
into docs/data/matrix.json and re-renders docs/compatibility.md (`MATRIX_RECORD=` turns that off,
`MATRIX_RECORD=PATH` records elsewhere). `MATRIX_CELLS=a+b,c+d` runs those cells, `MATRIX_CELLS=stale`
every accepted cell without a current passing result (`make matrix`), `MATRIX_CELLS=all` all of them.
"""
from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import pytest

from tools.matrix import compat, compat_doc, compat_results
from tools.matrix.compat import FEATURES, Cell
from tools.matrix.compat_doc import render
from tools.matrix.compat_results import load_results, status

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / compat_results.RESULTS_PATH
SEED = os.environ.get("MATRIX_SEED") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")


def _selected() -> list[str]:
    wanted = os.environ.get("MATRIX_CELLS", "")
    if wanted == "all":
        return [c.id for c in compat.cells() if compat.verdict(c).kind == "accepted"]
    if wanted == "stale":
        return compat_results.to_refresh(load_results(RESULTS), compat_results.code_state()["code"])
    if wanted:
        return [Cell.parse(c.strip()).id for c in wanted.split(",") if c.strip()]
    return compat_results.sample(SEED, load_results(RESULTS), compat_results.code_state()["code"])


SELECTED = _selected()
_DONE: list[float] = []  # seconds of each cell run so far (the progress line)


# ---------------------------------------------------------------- the document and the record (before the cells)

@pytest.mark.xdist_group("matrix")  # with test_cell, which rewrites both files
def test_committed_document_is_the_generated_one() -> None:
    """docs/compatibility.md is `python -m tools.matrix --write` of the recorded results for the code
    as it is: a change to engine/ or profilers/ shows its cells as stale once the page is rendered."""
    committed = (ROOT / compat_results.DOC_PATH).read_text()
    assert committed == render(load_results(RESULTS)), \
        "docs/compatibility.md is not the render of docs/data/matrix.json for the current code: run " \
        "`python -m tools.matrix --write` (renders only, seconds), or `make matrix` (re-runs the stale cells)"


@pytest.mark.xdist_group("matrix")
def test_every_accepted_cell_has_a_passing_current_result() -> None:
    """No cell is unknown: each accepted cell has a passing result of its current plan and code.

    Only `make matrix` (hours) can make this true after a code change, so CI shows it as a skip with
    the counts (`-rs`) until the recorded results are complete; MATRIX_COMPLETE=1 makes it a failure."""
    results = load_results(RESULTS)
    code = compat_results.code_state()["code"]
    statuses = {c.id: status(c, results, code) for c in compat.cells()}
    bad = {cid: s for cid, s in statuses.items() if s[0] in ("not run", "stale", "failed")}
    if bad and not os.environ.get("MATRIX_COMPLETE"):
        kinds = [k for k, _ in bad.values()]
        pytest.skip(f"the matrix is not current: {kinds.count('stale')} accepted cells stale, "
                    f"{kinds.count('not run')} not run, {kinds.count('failed')} failed "
                    "(docs/compatibility.md lists them; make matrix)")
    assert not bad, f"{len(bad)} accepted cells are not verified (make matrix CELLS=...): " + \
        "; ".join(f"{cid}: {kind}" for cid, (kind, _) in list(bad.items())[:20])


# ---------------------------------------------------------------- the cells on real ranks

@pytest.mark.slow
@pytest.mark.timeout(900)  # one cell: up to 8 ranks, 4-5 Trainer runs and a reference
@pytest.mark.xdist_group("matrix")
@pytest.mark.parametrize("cell", SELECTED)
def test_cell(cell: str, request: pytest.FixtureRequest) -> None:
    """Parity with a reference in another layout and both resumes (tools/matrix/compat.py's module docstring)."""
    from matrix_runner import run_cell, summary

    result = run_cell(cell)
    target = os.environ.get("MATRIX_RECORD", str(RESULTS))
    if target:
        same = Path(target).resolve() == RESULTS.resolve()
        compat_doc.record(result, target, doc=ROOT / compat_results.DOC_PATH if same else None)
    _progress(request, cell, result)
    assert result["ok"], f"{summary(result)}\nsample seed {SEED}; re-run: make matrix CELLS={cell}"


def _progress(request: pytest.FixtureRequest, cell: str, result: dict) -> None:
    """`[n/N] cell: ok in s (about m min left)` on the terminal, also while pytest captures output."""
    _DONE.append(result["seconds"])
    left = (len(SELECTED) - len(_DONE)) * sum(_DONE) / len(_DONE) / 60
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    line = (f"[{len(_DONE)}/{len(SELECTED)}] {cell}: {'ok' if result['ok'] else 'FAILED'} in {result['seconds']} s "
            f"(about {left:.0f} min left) {time.strftime('%H:%M:%S')}")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_feature_broken_on_purpose_fails_its_cell(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted feature whose loss is 1.001 times too large on several ranks (dp2; one process trains
    it right) fails its cell's parity: the matrix can fail. Alone in one process it has no
    different-layout reference, and its passing run counts apart, not as verified."""
    from matrix_runner import PLANTED_SCALE, run_cell

    planted = compat.Feature("planted", "loss scaled on several ranks", degrees={"parallel.dp": 2},
                             set={"model.entry": "matrix_runner:planted_entry"},
                             reference=compat.Reference(compat.REPLAY, "the user's model in one process"))
    alone = compat.Feature("planted1", "the same in one process", set={"model.entry": "matrix_runner:planted_entry"},
                           reference=compat.Reference(compat.REPLAY, "the user's model in one process"))
    monkeypatch.setitem(FEATURES, "planted", planted)
    monkeypatch.setitem(FEATURES, "planted1", alone)
    _clear_caches()
    try:
        assert compat.plan(Cell.parse("planted")).reference_kind == "one process"
        result = run_cell("planted")
        assert not result["ok"] and not result["parity"]["ok"], result
        first = result["parity"]["losses"][0]
        assert result["parity"]["diff"] >= first * (PLANTED_SCALE - 1) / PLANTED_SCALE * 0.99
        assert status(Cell.parse("planted"), {"planted": result}, result["code"])[0] == "failed"
        one = compat.plan(Cell.parse("planted1"))
        assert one.reference is None and one.reference_kind == "none"
        assert one.other is not None and compat.dims_of(one.other) != compat.dims_of(one.config)
    finally:
        _clear_caches()


def _clear_caches() -> None:
    compat.plan.cache_clear()
    compat.verdict.cache_clear()


def test_pending_features_have_not_landed() -> None:
    """A feature stays pending only while its config key does not exist; model.hf landed, so the hf
    features have fragments that validate() accepts alone."""
    from engine.config.schema import ModelConfig

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
    from engine.config.schema import from_dict
    from engine.config.validate import check

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
    # ZeRO-2/3 compress reduce-scatter shards: their reference is the compressor at ZeRO-2
    assert compat.plan(Cell.parse("zero3+c-randk")).reference["parallel.zero"] == 2
    assert compat.plan(Cell.parse("ac")).reference_note == "one process"  # activation checkpointing removed


def test_a_cell_that_would_be_its_own_reference_has_none() -> None:
    """No cell takes its own run as its parity reference (issue 48): topk alone at dp2, bf16 alone in one
    process, randk at ZeRO-2 have none, say why, and a passing result of theirs is counted apart."""
    for cid, why in (("c-topk", "minimal layout of c-topk"), ("dp+c-topk", "minimal layout of c-topk"),
                     ("zero2+c-randk", "minimal layout of c-randk"), ("bf16", "one process with no layout knob"),
                     ("hf+tokens", "one process with no layout knob")):
        p = compat.plan(Cell.parse(cid))
        assert p.reference is None and p.reference_kind == "none" and why in p.reference_note, (cid, p.reference_note)
    for cell in compat.cells():
        if compat.verdict(cell).kind == "accepted" and compat.plan(cell).reference is not None:
            p = compat.plan(cell)
            assert compat.layout_of(p.reference) != compat.layout_of(p.config), cell.id
    # writing out a default is no layout: dp=1 and zero=0 change nothing
    assert compat.layout_of({**compat.BASE, "parallel.dp": 1, "parallel.zero": 0}) == {}


def test_every_other_layout_differs_in_dims_or_says_why_none() -> None:
    """The other-layout resume has other parallel degrees than its cell (writing out dp=1 was counted as
    another layout before), or the cell names why there is none."""
    for cell in compat.cells():
        if compat.verdict(cell).kind != "accepted":
            continue
        p = compat.plan(cell)
        if p.other is None:
            assert p.other_note.startswith(("no layout of", "a CO2 checkpoint")), (cell.id, p.other_note)
        else:
            assert compat.dims_of(p.other) != compat.dims_of(p.config), cell.id
            assert not compat.refusal(p.other), cell.id
    assert compat.plan(Cell.parse("dp+tp")).other_note == "dp=4"
    assert compat.plan(Cell.parse("dp")).other_note == "tp=2"  # ZeRO-1 at dp2 has the cell's dims
    assert compat.plan(Cell.parse("ac")).other_note == "dp=2"  # a one-process cell resumes on 2 ranks
    assert compat.plan(Cell.parse("dp+pp-skip")).other_note.startswith("pp=3")  # SkipPipe's own layout
    assert "c-topk holds dp=2" in compat.plan(Cell.parse("c-topk")).other_note


def test_other_layout_and_dropout_chain() -> None:
    ep = compat.plan(Cell.parse("ep")).other
    assert ep["parallel.dp"] == 2 and "parallel.ep" not in ep
    assert compat.plan(Cell.parse("tp+co2")).other is None  # a CO2 checkpoint resumes only as CO2 in its dp, tp
    ring = compat.plan(Cell.parse("cp-ring"))
    assert ring.dropout_config["model.dropout"] == 0.0 and ring.dropout_note.startswith("parallel.cp_impl")
    assert compat.plan(Cell.parse("tp")).dropout_config["model.dropout"] == compat.DROPOUT
    assert compat.plan(Cell.parse("pp-zbv")).config["train.eval_interval"] == compat.STEPS  # one evaluation


def test_cells_are_every_pair_and_the_triples() -> None:
    n = len(FEATURES)
    ids = [c.id for c in compat.cells()]
    assert len(ids) == len(set(ids)) == n + n * (n - 1) // 2 + len(compat.TRIPLES)
    assert "dp+tp+pp-1f1b" in ids and "tp+ep+holmes" in ids
    with pytest.raises(ValueError, match="unknown feature"):
        Cell.parse("dp+warp")


@pytest.mark.xdist_group("matrix")  # reads docs/data/matrix.json, which test_cell rewrites
def test_the_sample_is_seeded_within_budget_and_draws_a_big_cell() -> None:
    results, code = load_results(RESULTS), compat_results.code_state()["code"]
    a, b = compat_results.sample("20260101", results, code), compat_results.sample("20260101", results, code)
    assert a == b and a != compat_results.sample("20260102", results, code)
    worlds = [compat.world_of(compat.merge(Cell.parse(c).features).knobs) for c in a]
    assert sum(w > compat_results.SAMPLE_MAX_WORLD for w in worlds) == compat_results.SAMPLE_BIG == 1
    for cell in a:
        assert compat.verdict(Cell.parse(cell)).kind == "accepted"
    assert sum(compat_results._estimate_s(Cell.parse(c), results) for c in a) <= compat_results.SAMPLE_BUDGET_S
    # cells without a current result come first: a current one is drawn only when none is left
    kinds = [status(Cell.parse(c), results, code)[0] for c in a]
    assert kinds == sorted(kinds, key=lambda k: k in compat_results.CURRENT) or len(set(kinds)) == 1


def test_a_result_of_other_code_is_stale_and_names_its_commit() -> None:
    cell = Cell.parse("dp")
    result = {"cell": "dp", "key": compat.plan(cell).key, "code": "old", "commit": "0123456789ab", "dirty": False,
              "ok": True, "parity": {"reference": "one process", "layout": "one process", "diff": 0.0, "tol": 1e-4,
                                     "ok": True},
              "resume_same": {"diff": 0.0, "ok": True}, "resume_other": {"na": "x", "ok": True}, "errors": {},
              "test": "t"}
    assert status(cell, {"dp": result}, "old")[0] == "verified"
    kind, detail = status(cell, {"dp": result}, "new")
    assert kind == "stale" and detail == "last verified on commit 0123456; the code changed since"
    assert status(cell, {"dp": {**result, "key": "other"}}, "old")[0] == "stale"
    none = {**result, "parity": {"reference": "none", "why": "x", "ok": True}}
    assert status(cell, {"dp": none}, "old")[0] == "no reference"  # counted apart, never as verified
    assert "dp" in compat_results.to_refresh({"dp": result}, "new")
    assert "dp" not in compat_results.to_refresh({"dp": result}, "old")


def test_the_code_hash_covers_uncommitted_changes(tmp_path: Path) -> None:
    """The hash is of the .py files' content under engine/ and profilers/, committed or not."""
    import subprocess

    (tmp_path / "engine").mkdir()
    (tmp_path / "profilers").mkdir()
    (tmp_path / "engine" / "a.py").write_text("x = 1\n")
    (tmp_path / "profilers" / "b.py").write_text("y = 1\n")
    (tmp_path / "tools" / "matrix").mkdir(parents=True)  # the matrix runner: outside the hashed code
    (tmp_path / "tools" / "matrix" / "compat_doc.py").write_text("# renders only\n")
    git = ["git", "-C", str(tmp_path), "-c", "user.email=m@x", "-c", "user.name=m"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    first = compat_results.code_state(tmp_path)
    assert not first["dirty"] and len(first["commit"]) == 12
    (tmp_path / "tools" / "matrix" / "compat_doc.py").write_text("# renders otherwise\n")
    assert compat_results.code_state(tmp_path)["code"] == first["code"]
    (tmp_path / "profilers" / "b.py").write_text("y = 2\n")  # uncommitted
    second = compat_results.code_state(tmp_path)
    assert second["code"] != first["code"] and second["dirty"] and second["commit"] == first["commit"]


def test_the_token_file_is_private_and_written_through_tempfile(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """compat.py wrote its token file through `<tmp>/...bin.<pid>`, a name anyone could plant a link at
    (issue 48): the file now lives in this user's 0700 folder, is written through mkstemp, and planted
    bytes are replaced."""
    import tempfile

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    victim = tmp_path / "victim"
    victim.write_text("precious")
    for name in (f"workbench-matrix-tokens-v1.bin.{os.getpid()}",
                 f"workbench-matrix-{os.getuid()}/tokens-v1.bin.{os.getpid()}"):
        (tmp_path / name).parent.mkdir(mode=0o700, exist_ok=True)
        (tmp_path / name).symlink_to(victim)
    getattr(compat.matrix_token_file, "cache_clear", lambda: None)()
    try:
        path = Path(compat.matrix_token_file())
        assert victim.read_text() == "precious"
        assert path.parent == tmp_path / f"workbench-matrix-{os.getuid()}"
        assert path.stat().st_size == 2 * compat.MATRIX_TOKENS
        assert (path.parent.stat().st_mode & 0o777) == 0o700
        good = path.read_bytes()
        path.write_bytes(b"\0" * len(good))  # planted bytes are replaced
        compat.matrix_token_file.cache_clear()
        assert Path(compat.matrix_token_file()).read_bytes() == good
        path.parent.chmod(0o755)  # a folder others can write into is refused
        compat.matrix_token_file.cache_clear()
        with pytest.raises(RuntimeError, match="mode 0700"):
            compat.matrix_token_file()
    finally:
        getattr(compat.matrix_token_file, "cache_clear", lambda: None)()


def test_feature_names_are_unique_and_use_validates_names() -> None:
    from engine.config.validate import COMPRESSORS, CP_IMPLS, SCHEDULES

    names = [f.name for f in compat._features()]
    assert len(names) == len(set(names))
    assert {f"pp-{s}" for s in SCHEDULES} | {f"cp-{i}" for i in CP_IMPLS} | {f"c-{c}" for c in COMPRESSORS[1:]} <= set(names)
