"""Live in-job tuning: one long run, a new trial every `segment_steps` steps.

Knobs that need no restart (comm.density, comm.rank, co2.tau, co2.outer_lr, link.*, batch.micro,
train.lr) are taken from the study at each boundary (engine/train/live.py), measured over the segment
(its first step skipped: a knob change can cost a warm-up step) and told to the study. Each
segment is its own trial, linked to the same run; the store's segments table marks the timeline.

A knob that cannot act in the run (engine.train.live.inert_knobs: link.* without a link at start,
comm.density without topk/randk, co2.* without CO2, batch.micro under pp > 1) is refused before
the run starts; a segment whose combination makes a knob inert is pruned with the reason.
lr-like knobs (train.lr, co2.outer_lr) need objective throughput+val_loss: each segment then
ends with an evaluation and is told (tokens/s, val_loss).
"""
from __future__ import annotations

import json
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from engine.config.schema import RunConfig, replace
from engine.errors import ConfigError
from engine.launch.local import launch
from engine.launch.run_record import RunResult
from engine.train.live import inert_knobs
from profilers.store import RunStore, default_home
from tuning.objective import PARETO, THROUGHPUT
from tuning.space import LIVE_KEYS, SearchSpace


def _segment_value(store: RunStore, run_id: str, start: int, end: int, skip: int,
                   wait_s: float = 10.0) -> float | None:
    """Median tokens/s of the segment's steps, once rank 0's telemetry for them reached the store."""
    deadline = time.time() + wait_s
    while True:
        steps = [s for s in store.latest_steps(run_id, n=end - start + 1) if start + skip <= s["step"] < end]
        if len(steps) >= end - start - skip or time.time() > deadline:
            break
        time.sleep(0.05)
    tps = [s["tokens_per_s"] for s in steps if "tokens_per_s" in s]
    return statistics.median(tps) if tps else None


def _segment_val_loss(store: RunStore, run_id: str, end: int, wait_s: float = 10.0) -> float | None:
    """val_loss of the evaluation after the segment's last step (rank 0), once it reached the store."""
    deadline = time.time() + wait_s
    while True:
        found = [r.value for r in store.metrics(run_id, kind="eval", name="val_loss", rank=0)
                 if r.step == end - 1]
        if found or time.time() > deadline:
            return found[-1] if found else None
        time.sleep(0.05)


class LiveTuner:
    """Drives one run's knob channel from the tuner's process."""

    def __init__(self, study: optuna.Study, space: SearchSpace, base: RunConfig, *, segments: int,
                 segment_steps: int, home: str | Path | None = None, skip_steps: int = 1,
                 objective: str = THROUGHPUT) -> None:
        if objective not in (THROUGHPUT, PARETO):
            raise ConfigError("objective", objective, f"must be {THROUGHPUT} or {PARETO}")
        if segment_steps <= skip_steps:
            raise ConfigError("segment_steps", segment_steps, f"must be > {skip_steps} (steps skipped per segment)")
        self.study, self.space, self.segments = study, space, segments
        self.segment_steps, self.skip = segment_steps, skip_steps
        self.home = Path(home) if home else default_home()
        self.store = RunStore.open_home(self.home)
        self.objective = objective
        evals = {"train.eval_interval": segment_steps} if objective == PARETO else {}
        self.cfg = replace(base, {**space.fixed, "live.every": segment_steps,
                                  "train.steps": segment_steps * segments, **evals})
        space.check_live(self.cfg, loss_aware=objective == PARETO)
        self.run_id = f"{self.cfg.name}-live-{uuid.uuid4().hex[:8]}"
        self.run_dir = self.home / "runs" / self.run_id
        self.open: tuple[optuna.trial.Trial, int, int] | None = None  # (trial, segment id, start step)

    def _next_knobs(self, step: int) -> dict[str, Any]:
        for _ in range(20):  # skip invalid combinations, each ends as a pruned trial with its reason
            trial = self.study.ask()
            chosen = self.space.suggest(trial)
            knobs = {k: v for k, v in self.space.to_overrides(chosen, self.cfg).items() if k in LIVE_KEYS}
            try:
                replace(self.cfg, knobs)
                inert = inert_knobs(self.cfg, knobs)
            except ConfigError as exc:
                trial.set_user_attr("reason", f"invalid: {exc}")
                self.study.tell(trial, state=TrialState.PRUNED)
                continue
            if inert:  # e.g. link.latency_us while this segment's link.gbps=0
                trial.set_user_attr("reason", "inert: " + "; ".join(f"{k}: {why}" for k, why in inert.items()))
                self.study.tell(trial, state=TrialState.PRUNED)
                continue
            for key, value in {"run_id": self.run_id, "start_step": step, "live": True}.items():
                trial.set_user_attr(key, value)
            seg = self.store.add_segment(self.run_id, start_step=step, trial_number=trial.number, params=chosen)
            self.open = (trial, seg, step)
            return knobs
        raise RuntimeError("20 invalid knob combinations in a row: check the search space")

    def _close(self, end_step: int) -> None:
        if self.open is None:
            return
        trial, seg, start = self.open
        self.open = None
        value = _segment_value(self.store, self.run_id, start, end_step, self.skip)
        val_loss = _segment_val_loss(self.store, self.run_id, end_step) if self.objective == PARETO else None
        trial.set_user_attr("end_step", end_step)
        self.store.end_segment(seg, end_step=end_step, value=value)
        if value is None or (self.objective == PARETO and val_loss is None):
            trial.set_user_attr("reason", "segment recorded no steady step" if value is None
                                else "segment recorded no val_loss")
            self.study.tell(trial, state=TrialState.FAIL)
            return
        trial.set_user_attr("tokens_per_s", value)
        if self.objective == PARETO:
            trial.set_user_attr("val_loss", val_loss)
            self.study.tell(trial, [value, val_loss])
        else:
            self.study.tell(trial, value)

    def _answer(self, index: int, step: int) -> None:
        self._close(step)
        payload = {"knobs": self._next_knobs(step)} if index < self.segments else {"stop": True}
        tmp = self.run_dir / f"knobs-{index}.tmp"
        tmp.write_text(json.dumps(payload))
        tmp.replace(self.run_dir / f"knobs-{index}.json")  # rank 0 never reads a half-written file

    def run(self) -> RunResult:
        box: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: box.update(
            result=launch(self.cfg, home=self.home, run_id=self.run_id, raise_on_failure=False,
                          parent=f"study:{self.study.study_name}:live")), daemon=True)
        thread.start()
        answered = 0
        while thread.is_alive():
            boundary = self.run_dir / f"boundary-{answered}.json"
            if boundary.exists():
                self._answer(answered, json.loads(boundary.read_text())["step"])
                answered += 1
            time.sleep(0.05)
        result: RunResult = box["result"]
        last = result.steps[-1]["step"] + 1 if result.steps else 0
        if result.status == "completed":
            self._close(last)
        elif self.open is not None:
            trial, seg, _ = self.open
            trial.set_user_attr("reason", f"run failed: {result.error}")
            self.store.end_segment(seg, end_step=last)
            self.study.tell(trial, state=TrialState.FAIL)
        return result
