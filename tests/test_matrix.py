"""The compatibility matrix (tools/matrix/compat.py): its rules as units, the generated document, and the
cells on real ranks (tests/matrix_runner.py).

`test_cell` runs CI's rotating slice by default (tools/matrix/compat_results.py `sample`: cells without a
current result first, one of more than 4 ranks, then cells of <= 4 ranks shuffled by the UTC date
(`MATRIX_SEED` overrides it) within SAMPLE_BUDGET_S of recorded seconds), and records each result
into docs/data/matrix.json and re-renders docs/compatibility.md (`MATRIX_RECORD=` turns that off,
`MATRIX_RECORD=PATH` records elsewhere). `MATRIX_CELLS=a+b,c+d` runs those cells, `MATRIX_CELLS=stale`
every accepted cell whose result is stale or missing (`make matrix`), `MATRIX_CELLS=all` all of them.
"""
from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import pytest

from tools.matrix import compat, compat_code, compat_doc, compat_results
from tools.matrix.compat import FEATURES, Cell
from tools.matrix.compat_doc import render
from tools.matrix.compat_results import load_results, status

from tests.run_once import computed_once

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / compat_results.RESULTS_PATH
SEED = os.environ.get("MATRIX_SEED") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")


# the results as this run found them, before test_cell records its cells: the slice is drawn from them (a loaded
# whole run recorded dp+tp+pp-dualpipev at 111.7 s where `make matrix` had 24.0, over the slice's 90 s alone)
AT_START = load_results(RESULTS)


def _selected() -> list[str]:
    wanted = os.environ.get("MATRIX_CELLS", "")
    if wanted and wanted not in ("stale", "all"):  # named cells: no need to hash every cell's code
        return compat_results.select(wanted, {}, {}, SEED)
    return compat_results.select(wanted, AT_START, compat_results.cell_codes(), SEED)


SELECTED = computed_once(f"matrix-slice-{SEED}", _selected)  # one xdist worker draws it; the others read it
_DONE: list[float] = []  # seconds of each cell run so far (the progress line)


# ---------------------------------------------------------------- the document and the record (before the cells)

@pytest.mark.xdist_group("matrix")  # with test_cell, which rewrites both files
def test_committed_document_is_the_generated_one() -> None:
    """docs/compatibility.md is `python -m tools.matrix --write` of the recorded results for the code
    as it is: a change to the code a cell runs shows that cell as stale once the page is rendered."""
    committed = (ROOT / compat_results.DOC_PATH).read_text()
    assert committed == render(load_results(RESULTS)), \
        "docs/compatibility.md is not the render of docs/data/matrix.json for the current code: run " \
        "`python -m tools.matrix --write` (renders only, seconds), or `make matrix` (re-runs the stale cells)"


def _check_current(results: dict, codes: dict[str, str]) -> None:
    bad = compat_results.unverified(results, codes)
    kinds = [k for k, _ in bad.values()]
    failed = ",".join(cid for cid, (kind, _) in bad.items() if kind == "failed")
    assert not bad, (
        f"docs/compatibility.md is not current for this code: {kinds.count('stale')} accepted cells stale, "
        f"{kinds.count('not run')} not run, {kinds.count('failed')} failed; run `make matrix` "
        f"({compat_results.estimate_line(compat_results.to_refresh(results, codes), results, codes)})"
        + (f", fix the failed ones (then `make matrix CELLS={failed}`)" if failed else "")
        + " and commit docs/data/matrix.json with the change. First ones: "
        + "; ".join(f"{cid}: {kind}" for cid, (kind, _) in list(bad.items())[:10]))


@pytest.mark.xdist_group("matrix")
def test_every_accepted_cell_has_a_passing_current_result() -> None:
    """Issue 64: no cell is unknown; each accepted cell has a passing result of its current plan and code,
    so a change that stales cells fails here until `make matrix` re-ran them (only those: each cell's
    result is keyed by the code it runs, tools/matrix/compat_code.py)."""
    _check_current(load_results(RESULTS), compat_results.cell_codes())


@pytest.mark.xdist_group("matrix")  # reads docs/data/matrix.json, which test_cell rewrites
def test_a_stale_cell_fails_the_currency_test_instead_of_skipping() -> None:
    """Before issue 64 the currency test skipped while any cell was stale (CI never failed on a stale
    document); one cell's result of other code must now fail it, naming that cell."""
    results, codes = load_results(RESULTS), compat_results.cell_codes()
    cell = next(c for c in compat.cells() if compat.verdict(c).kind == "accepted")  # the first listed
    stale = {**results, cell.id: {**results.get(cell.id, {}), "code": "0" * 12}}
    try:
        _check_current(stale, codes)
        outcome: BaseException | None = None
    except BaseException as exc:  # noqa: BLE001 - the old code raised pytest's Skipped here
        outcome = exc
    assert isinstance(outcome, AssertionError), outcome
    assert f"{cell.id}: stale" in str(outcome)


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
        assert status(Cell.parse("planted"), {"planted": result}, {"planted": result["code"]})[0] == "failed"
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


@pytest.mark.xdist_group("matrix")
def test_the_sample_is_seeded_within_budget_and_draws_a_big_cell() -> None:
    """Of the results the slice was drawn from (AT_START): read after test_cell had recorded a loaded run's seconds,
    one cell took the whole budget and every seed drew it alone (CI of a4b87bd)."""
    results, codes = AT_START, compat_results.cell_codes()
    a, b = compat_results.sample("20260101", results, codes), compat_results.sample("20260101", results, codes)
    assert a == b and a != compat_results.sample("20260102", results, codes)
    worlds = [compat.world_of(compat.merge(Cell.parse(c).features).knobs) for c in a]
    assert sum(w > compat_results.SAMPLE_MAX_WORLD for w in worlds) == compat_results.SAMPLE_BIG == 1
    for cell in a:
        assert compat.verdict(Cell.parse(cell)).kind == "accepted"
    assert sum(compat_results._estimate_s(Cell.parse(c), results) for c in a) <= compat_results.SAMPLE_BUDGET_S
    # cells without a current result come first: a current one is drawn only when none is left
    kinds = [status(Cell.parse(c), results, codes)[0] for c in a]
    assert kinds == sorted(kinds, key=lambda k: k in compat_results.CURRENT) or len(set(kinds)) == 1


def _passed(cell_id: str, code: str) -> dict:
    """A passing result of the cell's current plan, recorded for `code`."""
    return {"cell": cell_id, "key": compat.plan(Cell.parse(cell_id)).key, "code": code, "commit": "0123456789ab",
            "dirty": False, "ok": True,
            "parity": {"reference": "one process", "layout": "one process", "diff": 0.0, "tol": 1e-4, "ok": True},
            "resume_same": {"diff": 0.0, "ok": True}, "resume_other": {"na": "x", "ok": True}, "errors": {},
            "test": "t"}


def test_a_result_of_other_code_is_stale_and_names_its_commit() -> None:
    cell = Cell.parse("dp")
    result = _passed("dp", "old")
    assert status(cell, {"dp": result}, {"dp": "old"})[0] == "verified"
    kind, detail = status(cell, {"dp": result}, {"dp": "new"})
    assert kind == "stale" and detail == "last verified on commit 0123456; its code changed since"
    assert status(cell, {"dp": {**result, "key": "other"}}, {"dp": "old"})[0] == "stale"
    none = {**result, "parity": {"reference": "none", "why": "x", "ok": True}}
    assert status(cell, {"dp": none}, {"dp": "old"})[0] == "no reference"  # counted apart, never as verified
    assert "dp" in compat_results.to_refresh({"dp": result}, {"dp": "new"})
    assert "dp" not in compat_results.to_refresh({"dp": result}, {"dp": "old"})
    failed = {**result, "ok": False}  # a current failure re-runs once its code changes, not before
    assert "dp" not in compat_results.to_refresh({"dp": failed}, {"dp": "old"})
    assert "ac" in compat_results.to_refresh({}, {})  # never run


def _copy_code(root: Path, into: Path) -> Path:
    """A git checkout at `into` of the files a cell's code hash reads (engine/, profilers/, the runner's)."""
    import shutil
    import subprocess

    for part in (*compat_code.PACKAGES, *compat_code.RUNNER_FILES.values()):
        copy = shutil.copytree if (root / part).is_dir() else shutil.copy
        (into / part).parent.mkdir(parents=True, exist_ok=True)
        copy(root / part, into / part)
    git = ["git", "-C", str(into), "-c", "user.email=m@x", "-c", "user.name=m"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    return into


def test_a_change_stales_only_the_cells_that_run_the_changed_module(tmp_path: Path) -> None:
    """Results are keyed by the code their cell runs (tools/matrix/compat_code.py), not by the whole
    product: in a copy of the code, a change to tensor parallelism's module stales exactly the cells whose
    plan runs tp > 1 in some config; a change to the trainer stales every cell. Old code: one hash of
    engine/ and profilers/, so every change staled all 503 cells."""
    copy = _copy_code(ROOT, tmp_path)
    before = compat_results.cell_codes(copy)
    assert before == compat_results.cell_codes(ROOT)  # the copy hashes like the tree it came from
    results = {cid: _passed(cid, code) for cid, code in before.items()}
    assert compat_results.to_refresh(results, before) == []
    runs_tp = {cid for cid in before if any(c.get("parallel.tp", 1) > 1 for c in
                                            compat_code.plan_configs(compat.plan(Cell.parse(cid))))}
    assert 0 < len(runs_tp) < len(before) and "dp+tp" in runs_tp and "hf+tokens" not in runs_tp
    with open(copy / "engine/parallel/tensor.py", "a") as f:
        f.write("\n# a change to tensor parallelism\n")
    after = compat_results.cell_codes(copy)
    assert set(compat_results.to_refresh(results, after)) == runs_tp
    state = compat_results.code_state(Cell.parse("dp+tp"), copy)
    assert state["code"] == after["dp+tp"] and state["dirty"]  # uncommitted changes count, and are flagged
    assert not compat_results.code_state(Cell.parse("hf+tokens"), copy)["dirty"]  # its files are as committed
    with open(copy / "engine/train/trainer.py", "a") as f:
        f.write("\n# a change every run executes\n")
    assert set(compat_results.to_refresh(results, compat_results.cell_codes(copy))) == set(before)


def test_the_code_a_featureless_run_loads_is_in_every_cells_hash() -> None:
    """The gates are honest: a one-process run of the matrix's base config (no feature) imports no module of
    engine/ or profilers/ outside the core, and no core module imports a gated one at its top (which would
    run it in every process). A cell of a gated feature hashes what its run loads (tokens)."""
    import json
    import subprocess
    import sys

    script = ("import json, sys, torch\n"
              "from tools.matrix import compat\n"
              "from engine.config.schema import from_dict\n"
              "from engine.train.trainer import Trainer\n"
              "loaded = {}\n"
              "for name, knobs in (('base', {}), ('tokens', compat.FEATURES['tokens'].set)):\n"
              "    flat = {**compat.overrides(knobs), 'train.steps': 1, 'train.eval_interval': 1}\n"
              "    list(Trainer(from_dict(compat.nested(flat)), device=torch.device('cpu')).run())\n"
              "    loaded[name] = sorted(m for m in sys.modules if m.split('.')[0] in ('engine', 'profilers'))\n"
              "print(json.dumps(loaded))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=240, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    index = compat_code.build_index(ROOT)
    core = index.core()
    assert set(loaded["base"]) - core == set()
    assert set(loaded["tokens"]) - compat_code.cell_modules(Cell.parse("tokens"), index) == set()
    assert set(loaded["tokens"]) - core  # the token file's reader is gated: the check can fail
    gated = {m for m in index.paths if compat_code._is_gated(m)}
    assert {m: sorted(index.top[m] & gated) for m in core if index.top[m] & gated} == {}


# each place the core imports a gated module, read when its gate was written (tools/matrix/compat_code.py GATES)
REVIEWED_GATE_SITES = {
    "engine.data.batches": ["engine.data.lengths", "engine.data.sources"],
    "engine.model.build": ["engine.model.hf"],
    "engine.parallel.parallelize": ["engine.comm", "engine.comm.link", "engine.parallel.adaptive_sp",
                                    "engine.parallel.expert", "engine.parallel.expert_fused",
                                    "engine.parallel.layer_split", "engine.parallel.skippipe",
                                    "engine.parallel.tensor"],
    "engine.train.checkpoint": ["engine.data.sources"],
    "engine.train.comm_setup": ["engine.comm", "engine.comm.adaptive", "engine.comm.bidirectional",
                                "engine.comm.bucket_order", "engine.comm.co2", "engine.comm.compress",
                                "engine.comm.fsdp_compress", "engine.comm.link", "engine.comm.link_patch"],
    "engine.train.memory": ["engine.parallel.layer_split"],
    "engine.train.trainer": ["engine.parallel.adaptive_sp"],
}


def test_every_import_of_a_gated_module_from_the_core_is_a_reviewed_site() -> None:
    """A new import of a gated module from the core may run it where its gate is closed: this fails until
    the site is read and the gate's condition still holds (then add it here)."""
    index = compat_code.build_index(ROOT)
    sites = {m: sorted(x for x in index.imports[m] if compat_code._is_gated(x)) for m in index.core()}
    assert {m: got for m, got in sites.items() if got} == REVIEWED_GATE_SITES


def test_make_matrix_says_how_many_cells_and_how_long_before_it_starts() -> None:
    results = {"ac": {"key": compat.plan(Cell.parse("ac")).key, "code": "old", "ok": True, "seconds": 600.0}}
    line = compat_results.estimate_line(["ac", "dp"], results, {"ac": "new", "dp": "x"})
    assert line.startswith("2 cells to run (1 stale, 1 not run), about 10 min 20 s")  # 600 s + dp's 20 s estimate
    assert compat_results.estimate_line([], {}, {}).startswith("0 cells to run (none), about 0 min 00 s")
    many = {**results, "ac": {**results["ac"], "seconds": 7300.0}}
    assert "about 2 h 01 min" in compat_results.estimate_line(["ac"], many, {"ac": "new"})


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
