"""Runs one cell of the compatibility matrix (tools/matrix/compat.py) on real gloo ranks.

A cell's runs on its own ranks go through one `run_ranks` call (forkserver ranks, the engine's own
Trainer on each), in this order: the cell's run (checkpoint at CHECKPOINT_STEP), the same-layout
resume chain with dropout on where validate() allows it (a second run and its resume), then the
resume in the other layout from the first run's checkpoint (on its own ranks when it has another
world). Every run evaluates once, after its last step. Rank 0 appends each run's losses to a file as
it ends, so a run that fails or hangs loses nothing before it. The parity reference runs in this
process when it is one process, on its own ranks otherwise, and once per distinct reference.

`PYTHONPATH=. python tests/matrix_runner.py CELL ...` runs cells and prints their results (nothing recorded;
`make matrix CELLS=...` records them, tools/matrix/compat_doc.py `record`, and regenerates docs/compatibility.md).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools.matrix import compat, compat_results

_REFERENCES: dict[str, dict[str, Any]] = {}  # reference key -> {"losses", "val"} or {"error"}
PLANTED_SCALE = 1.001  # planted_entry's loss scale on several ranks (tests/test_matrix.py)


def tiny_entry():
    """model.entry of the matrix: the built-in GPT at BASE's shape and byte windows of the stdlib
    corpus as a user's (input, target) dataset (engine/data/corpus.py MapDataset)."""
    import torch

    from engine.config.schema import ModelConfig
    from engine.data.corpus import stdlib_corpus
    from engine.model.gpt import build_model

    b = compat.BASE
    cfg = ModelConfig(layers=b["model.layers"], d_model=b["model.d_model"], heads=b["model.heads"],
                      seq_len=b["model.seq_len"], vocab=b["model.vocab"])
    tokens = torch.frombuffer(bytearray(stdlib_corpus()[:65536]), dtype=torch.uint8).to(torch.int64)
    n, seq = 512, cfg.seq_len
    windows = [tokens[i * seq:(i + 1) * seq + 1] for i in range(n)]
    return build_model(cfg, seed=0), [(w[:-1], w[1:]) for w in windows]


def planted_entry():
    """model.entry of a feature broken on purpose (tests/test_matrix.py): tiny_entry's model and data
    with a step function that scales the loss by PLANTED_SCALE when it runs on several ranks, as a
    parallel-only defect would; one process trains it unscaled."""
    import torch
    import torch.distributed as dist

    from engine.model.gpt import loss_fn

    model, data = tiny_entry()
    scale = PLANTED_SCALE if dist.is_initialized() and dist.get_world_size() > 1 else 1.0

    def step(module: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, lr: float) -> torch.Tensor:
        loss = loss_fn(module(inputs), targets) * scale  # plain SGD: the step function updates the weights
        loss.backward()
        with torch.no_grad():
            for p in module.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
                    p.grad = None
        return loss

    return model, data, step


# ---------------------------------------------------------------- inside a rank

def _config(flat: dict[str, Any]):
    from engine.config.schema import from_dict
    from engine.config.validate import validate

    return validate(from_dict(compat.nested(flat)))


def acting_knobs(flat: dict[str, Any], offered: dict[str, Any]) -> dict[str, Any]:
    """The live knobs of `offered` that can act in a run of these overrides (engine.train.live's rule)."""
    from engine.errors import ConfigError
    from engine.train.live import inert_knobs

    cfg, out = _config(flat), {}
    for key, value in offered.items():
        try:
            if not inert_knobs(cfg, {key: value}):
                out[key] = value
        except ConfigError:  # e.g. batch.micro that global batch / dp does not divide
            pass
    return out


def _losses(flat: dict[str, Any], knobs: dict[str, Any]) -> dict[str, Any]:
    """One Trainer run of these overrides, `knobs` applied at every step from step 1 (live tuning):
    {"losses": per step, "val": the validation loss of its one evaluation}."""
    import torch

    from engine.train.trainer import Trainer

    def on_boundary(trainer, step: int) -> None:
        if knobs and step >= 1:
            trainer.apply_knobs(knobs)

    trainer = Trainer(_config(flat), device=torch.device("cpu"))
    steps = list(trainer.run(on_boundary))
    vals = [m.val_loss for m in steps if m.val_loss is not None]
    if len(vals) != 1:
        raise RuntimeError(f"the run evaluated {len(vals)} times, not once (train.eval_interval)")
    return {"losses": [m.loss for m in steps], "val": vals[0]}


def _error_line(exc: BaseException) -> str:
    """The exception in one line; for a DCP CheckpointException, the first failing rank's own."""
    failures = getattr(exc, "failures", None)
    if failures:  # torch.distributed.checkpoint: {rank: (exception, stack)}
        rank, (inner, _) = min(failures.items())
        return f"{type(exc).__name__} on ranks {sorted(failures)}: (rank {rank}) {_error_line(inner)}"[:500]
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:500]


def _rank_body(rank: int, world: int, runs: list[dict[str, Any]], out: str) -> None:
    """Each run in order; rank 0 appends {name, losses} or {name, error} per run. Stops at an error."""
    for run in runs:
        flat = dict(run["config"])
        if run.get("checkpoint"):
            flat.update({"train.checkpoint_interval": compat.CHECKPOINT_STEP,
                         "train.checkpoint_dir": str(Path(out) / run["name"])})
        if run.get("resume"):
            flat["train.resume_from"] = str(Path(out) / run["resume"] / f"step{compat.CHECKPOINT_STEP:06d}")
        t0 = time.perf_counter()
        try:
            got: dict[str, Any] = _losses(flat, run.get("knobs") or {})
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - recorded (DCP's CheckpointException is a BaseException)
            got = {"error": _error_line(exc)}
        if rank == 0:
            with open(Path(out) / "runs.jsonl", "a") as f:
                f.write(json.dumps({"name": run["name"], "seconds": round(time.perf_counter() - t0, 2), **got}) + "\n")
        if "error" in got:
            return


# ---------------------------------------------------------------- the parent

def _run_on_ranks(world: int, runs: list[dict[str, Any]], out: str, timeout: float) -> dict[str, dict[str, Any]]:
    """The runs on `world` ranks, checkpoints under `out`; {name: result}, with a failed harness (a
    hang, a crash) recorded on the first run that has no result."""
    from parallel_harness import run_ranks

    failure = None
    try:
        run_ranks(world, _rank_body, runs, out, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - RankFailure or a timeout: keep what finished
        lines = str(exc).strip().splitlines()
        failure = (lines[0] + (f" ... {lines[-1]}" if len(lines) > 1 else ""))[:500]
    path = Path(out) / "runs.jsonl"
    names = {r["name"] for r in runs}
    done = {r["name"]: r for r in map(json.loads, path.read_text().splitlines()) if r["name"] in names} \
        if path.exists() else {}
    missing = [r["name"] for r in runs if r["name"] not in done]
    if missing and failure:
        done[missing[0]] = {"name": missing[0], "error": failure}
    return done


def _reference(plan: compat.Plan, knobs: dict[str, Any]) -> dict[str, Any]:
    """The reference's {"losses", "val"} (computed once per distinct reference), or {"error"}."""
    key = json.dumps([plan.reference, knobs], sort_keys=True, default=str)
    if key not in _REFERENCES:
        world = compat.world_of(plan.reference)
        if world == 1:
            import torch

            torch.set_num_threads(1)
            try:
                _REFERENCES[key] = _losses(plan.reference, knobs)
            except Exception as exc:  # noqa: BLE001
                _REFERENCES[key] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        else:
            with tempfile.TemporaryDirectory(prefix="matrix-ref-") as tmp:
                got = _run_on_ranks(world, [{"name": "reference", "config": plan.reference, "knobs": knobs}], tmp, 300)
            _REFERENCES[key] = got.get("reference", {"error": "no result"})
    return _REFERENCES[key]


def _series(run: dict[str, Any], tail: slice = slice(None)) -> list[float]:
    """A run's step losses (`tail` of them) and then its validation loss: what the checks compare."""
    return run.get("losses", [])[tail] + ([run["val"]] if "val" in run else [])


def _diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) for x, y in zip(a, b))


def _runs(plan: compat.Plan, knobs: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """The runs of a cell in order (the other layout last), and the run the same-layout resume continues."""
    runs = [{"name": "cell", "config": plan.config, "checkpoint": True, "knobs": knobs}]
    chain = "cell"
    if plan.dropout_config != plan.config:  # dropout on: a chain of its own (RNG state restored)
        runs.append({"name": "dropout", "config": plan.dropout_config, "checkpoint": True, "knobs": knobs})
        chain = "dropout"
    runs.append({"name": "resume_same", "config": plan.dropout_config, "resume": chain, "knobs": knobs})
    if plan.other is not None:
        other_knobs = {k: v for k, v in knobs.items() if k in acting_knobs(plan.other, knobs)}
        runs.append({"name": "resume_other", "config": plan.other, "resume": "cell", "knobs": other_knobs})
    return runs, chain


def _execute(plan: compat.Plan, runs: list[dict[str, Any]], timeout: float) -> dict[str, dict[str, Any]]:
    """The runs on the cell's ranks; an other layout of another world then on its own ranks."""
    other_world = compat.world_of(plan.other) if plan.other is not None else plan.world
    mine = [r for r in runs if r["name"] != "resume_other" or other_world == plan.world]
    with tempfile.TemporaryDirectory(prefix="matrix-") as tmp:
        got = _run_on_ranks(plan.world, mine, tmp, timeout)
        rest = [r for r in runs if r not in mine]
        if rest and "losses" in got.get("cell", {}):
            got.update(_run_on_ranks(other_world, rest, tmp, timeout))
    return got


def _parity(plan: compat.Plan, knobs: dict[str, Any], cell_run: dict[str, Any],
            errors: dict[str, str]) -> dict[str, Any]:
    if plan.reference is None:
        return {"reference": "none", "why": plan.reference_note, "ok": True}
    ref_knobs = {k: v for k, v in knobs.items() if k in acting_knobs(plan.reference, knobs)}
    ref = _reference(plan, ref_knobs)
    out: dict[str, Any] = {"reference": plan.reference_kind, "layout": plan.reference_note}
    if "error" in ref:
        errors["reference"] = ref["error"]
        return {**out, "ok": False}
    diff = _diff(_series(cell_run), _series(ref))
    return {**out, "diff": diff, "tol": plan.tol, "ok": diff <= plan.tol, "losses": cell_run.get("losses"),
            "val": cell_run.get("val"), "reference_losses": ref["losses"], "reference_val": ref["val"]}


def run_cell(cell_id: str, timeout: float = 400.0) -> dict[str, Any]:
    """Run an accepted cell; its result (what docs/data/matrix.json records), with the code it ran."""
    plan = compat.plan(compat.Cell.parse(cell_id))
    code = compat_results.code_state(compat.Cell.parse(cell_id))  # the hash of the code this cell runs
    t0 = time.perf_counter()
    knobs = acting_knobs(plan.config, compat.LIVE_CANDIDATES) if plan.live else {}
    runs, chain = _runs(plan, knobs)
    got = _execute(plan, runs, timeout)
    full, chain_full = got.get("cell", {}), got.get(chain, {})
    tail = slice(compat.CHECKPOINT_STEP, compat.STEPS)
    result: dict[str, Any] = {"cell": plan.cell, "key": plan.key, **code, "world": plan.world, "knobs": knobs,
                              "test": f"tests/test_matrix.py::test_cell[{plan.cell}]"}
    errors = {name: r["error"] for name, r in got.items() if "error" in r}
    errors.update({r["name"]: "not run (an earlier run failed)" for r in runs if r["name"] not in got})
    result["parity"] = _parity(plan, knobs, full, errors)
    same = _diff(_series(got.get("resume_same", {})), _series(chain_full, tail))
    result["resume_same"] = {"diff": same, "ok": same <= compat.RESUME_TOL,
                             "dropout": 0.0 if plan.dropout_note else compat.DROPOUT, "note": plan.dropout_note}
    if plan.other is None:
        result["resume_other"] = {"na": plan.other_note, "ok": True}
    else:
        other = _diff(_series(got.get("resume_other", {})), _series(full, tail))
        result["resume_other"] = {"layout": plan.other_note, "dims": compat.dims_text(plan.other), "diff": other,
                                  "tol": plan.other_tol, "ok": other <= plan.other_tol}
    result["errors"] = errors
    result["ok"] = not errors and all(result[k]["ok"] for k in ("parity", "resume_same", "resume_other"))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["run_seconds"] = {name: r.get("seconds") for name, r in got.items()}
    return result


def summary(result: dict[str, Any]) -> str:
    """One line per result: the figures a failure message shows."""
    return f"{result['cell']} ({result['world']} ranks, {result['seconds']} s): {compat_results.evidence(result)}"


def main(cells: list[str]) -> None:
    for cell in cells:
        print(summary(run_cell(cell)), flush=True)


if __name__ == "__main__":  # through the importable module, so the ranks unpickle its functions
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import matrix_runner

    matrix_runner.main(sys.argv[1:])
