"""The objective: one trial = one real engine run, measured at steady state.

Invalid combinations and repeats of an earlier trial's config are skipped by `screen` (told PRUNED
with user attribute `skipped`, no process starts; the study loop draws again).
Intermediate values (tokens/s per step after warm-up) feed the pruner; a pruned trial's ranks
are stopped. Crash and hang end as FAIL, CUDA out-of-memory as PRUNED with reason "oom"; the
reason is the trial's user attribute `reason` and the study goes on.
"""
from __future__ import annotations

import math
import statistics
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from engine.config.schema import RunConfig, replace
from engine.errors import ConfigError
from engine.launch.run_record import RunResult
from tuning.space import SearchSpace

THROUGHPUT = "throughput"
PARETO = "throughput+val_loss"


SKIPPED_ATTR = "skipped"  # trial user attribute: a draw told PRUNED without running (invalid or a repeat)
KEY_ATTR = "config_key"  # trial user attribute: digest of the trial's full config (finds repeats)


def config_key(cfg: RunConfig) -> str:
    """A digest of the whole config: equal for two trials that would run the same thing."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:20]


@dataclass(slots=True)
class TrialOutcome:
    state: optuna.trial.TrialState
    values: list[float] | None
    reason: str | None = None


def median_ci(values: list[float], z: float = 1.96) -> tuple[float, float, float]:
    """Median and a distribution-free ~95% confidence interval from order statistics
    (Conover, Practical Nonparametric Statistics, the binomial interval for a quantile)."""
    xs = sorted(values)
    n = len(xs)
    med = statistics.median(xs)
    if n < 3:
        return med, xs[0], xs[-1]
    half = z * math.sqrt(n) / 2
    lo = max(0, int(math.floor(n / 2 - half)))
    hi = min(n - 1, int(math.ceil(n / 2 + half)) - 1)
    return med, xs[lo], xs[hi]


class Objective:
    """Runs trials of `space` on top of `base`; used through `evaluate(trial)` by the study loop."""

    def __init__(self, base: RunConfig, space: SearchSpace, *, home: str | Path | None = None,
                 objective: str = THROUGHPUT, warmup_steps: int = 1, memory_limit_gb: float | None = None,
                 trial_timeout_s: float | None = 600.0, extra_env: dict[str, str] | None = None,
                 cluster=None, launcher: str = "local") -> None:
        self.base, self.space, self.home = base, space, home
        self.objective, self.warmup = objective, warmup_steps
        self.memory_limit_gb, self.timeout = memory_limit_gb, trial_timeout_s
        self.extra_env = extra_env
        self.cluster = cluster  # a calibrated hardware profile: predictions are recorded per trial
        self.launcher = launcher  # local (torchrun here) | slurm (a job per trial, cfg.cluster sizes it)

    def prepare(self) -> None:
        """Load what a trial's checks import (torch and the engine: seconds, far more on a loaded node)
        before the first trial: loading an extension module holds the GIL, so done under a trial's
        heartbeat it stalled the beats past the grace period and another worker failed the live trial
        as stale (two workers on a busy CI machine: 'worker died: no heartbeat since ... (5 s, grace 3 s)')."""
        import contextlib

        import engine.launch.local  # noqa: F401 - what a trial's launch loads (torch only where a GPU driver is)
        from engine.device import gpu_driver_present
        from engine.train.memory import check_fits

        if gpu_driver_present():
            import torch  # noqa: F401 - a GPU host's trial asks torch for CUDA (engine/device.py `pick_backend`)

        if self.launcher == "local":
            with contextlib.suppress(Exception):  # only a warm-up: a trial reports its own config's errors
                check_fits(self.base)

    def config_for(self, trial: optuna.trial.BaseTrial) -> RunConfig:
        """The validated config of a trial (raises ConfigError)."""
        overrides = self.space.to_overrides(self.space.suggest(trial), self.base)
        overrides.setdefault("profile.warmup_steps", self.warmup)
        if self.objective == PARETO:
            overrides["train.eval_interval"] = overrides.get("train.steps", self.base.train.steps)
        return replace(self.base, overrides)

    def screen(self, trial: optuna.trial.Trial) -> tuple[RunConfig | None, str | None]:
        """The trial's config, or why the draw is skipped before anything runs: its point is invalid,
        or its config is the one another trial of the study ran (or runs) and did not fail. Any other
        trial, not only earlier ones: workers screen one at a time (run_trials holds the study's lock),
        so of two drawing one config at once the first screened runs it and the second sees its key.
        Comparing with earlier trials only let both run: the earlier one, screened second, saw none."""
        try:
            cfg = self.config_for(trial)
        except ConfigError as exc:
            return None, f"invalid: {exc}"
        key = config_key(cfg)
        trial.set_user_attr(KEY_ATTR, key)
        for t in trial.study.get_trials(deepcopy=False):  # a failed trial may be retried: crashes can be transient
            if (t.number != trial.number and t.state != optuna.trial.TrialState.FAIL
                    and not t.user_attrs.get(SKIPPED_ATTR) and t.user_attrs.get(KEY_ATTR) == key):
                return None, f"repeat: the config of trial {t.number}"
        return cfg, None

    def evaluate(self, trial: optuna.trial.Trial, cfg: RunConfig | None = None) -> TrialOutcome:
        """Run the trial (`cfg`: its config from `screen`, else derived here)."""
        if cfg is None:
            try:
                cfg = self.config_for(trial)
            except ConfigError as exc:
                return self._prune(trial, f"invalid: {exc}")
        trial.set_user_attr("config", cfg.to_dict())
        if self.cluster is not None:  # multi-fidelity: the simulator's figure (raw and corrected) next to the measured one
            from tuning.warmstart import record_prediction

            record_prediction(trial, cfg, self.cluster)
        over = self._memory_over(cfg)
        if over:
            return self._prune(trial, over)
        # the launcher here, not at the top: it imports torch, which `workbench studies`, `export` and a refused
        # `tune` never need (~2 s of CPU each)
        from engine.launch.local import launch
        from engine.train.memory import check_fits

        try:
            if self.launcher == "local":  # this machine's memory, as `workbench run` checks it (not a cluster's nodes)
                check_fits(cfg)
        except ConfigError as exc:
            return self._prune(trial, f"does not fit: {exc}")
        run_id = f"{cfg.name}-{trial.study.study_name}-t{trial.number}-{uuid.uuid4().hex[:6]}"
        trial.set_user_attr("run_id", run_id)
        try:
            result = launch(cfg, home=self.home, run_id=run_id, timeout_s=self.timeout,
                            parent=f"study:{trial.study.study_name}#{trial.number}", raise_on_failure=False,
                            on_progress=self._reporter(trial), extra_env=self.extra_env, launcher=self.launcher,
                            on_job=self._job_recorder(trial) if self.launcher == "slurm" else None)
        except optuna.TrialPruned as exc:
            return self._prune(trial, f"pruned at step {exc}")
        except ConfigError as exc:  # launch()'s pre-flight dry run: a GPU target's device would not hold it
            return self._prune(trial, f"does not fit: {exc}")
        return self._outcome(trial, result)

    def _memory_over(self, cfg: RunConfig) -> str | None:
        if self.memory_limit_gb is None:
            return None
        from engine.train.memory import estimate_memory

        est = sum(estimate_memory(cfg).values()) / 2**30
        trial_note = f"estimated {est:.2f} GiB per rank > memory limit {self.memory_limit_gb:.2f} GiB"
        return trial_note if est > self.memory_limit_gb else None

    def _reporter(self, trial: optuna.trial.Trial):
        if self.objective != THROUGHPUT:
            return None  # Optuna reports intermediate values only for single-objective studies

        def report(step: dict[str, Any]) -> None:
            if step["step"] < self.warmup or "tokens_per_s" not in step:
                return
            trial.report(step["tokens_per_s"], step["step"])
            if trial.should_prune():
                raise optuna.TrialPruned(step["step"])

        return report

    @staticmethod
    def _job_recorder(trial: optuna.trial.Trial):
        """Keep the trial's Slurm job id, state and queued/run seconds on the trial (the dashboard reads them)."""

        def record(state) -> None:
            for key, value in state.to_dict().items():
                if value is not None:
                    trial.set_user_attr(key, round(value, 3) if isinstance(value, float) else value)

        return record

    def _prune(self, trial: optuna.trial.Trial, reason: str) -> TrialOutcome:
        trial.set_user_attr("reason", reason)
        return TrialOutcome(optuna.trial.TrialState.PRUNED, None, reason)

    def _outcome(self, trial: optuna.trial.Trial, result: RunResult) -> TrialOutcome:
        if result.status != "completed":
            error = result.error or "unknown failure"
            if "OutOfMemoryError" in error or "out of memory" in error:
                return self._prune(trial, "oom")
            if "Slurm ended job" in error or "sbatch refused" in error:  # Slurm's words: time limit, node failure
                reason = error.split("failed: ", 1)[-1].splitlines()[0]
                trial.set_user_attr("reason", reason)
                state = optuna.trial.TrialState.PRUNED if " as PREEMPTED" in reason else optuna.trial.TrialState.FAIL
                return TrialOutcome(state, None, reason)
            reason = "timeout" if "timed out" in error else f"crash (rank {result.error_rank}): {error.splitlines()[0]}"
            trial.set_user_attr("reason", reason)
            return TrialOutcome(optuna.trial.TrialState.FAIL, None, reason)
        steady = [s["tokens_per_s"] for s in result.steps[self.warmup:] if "tokens_per_s" in s]
        if not steady:
            return self._prune(trial, "no steady-state steps: train.steps <= warmup")
        med, lo, hi = median_ci(steady)
        for key, value in {"tokens_per_s": med, "tokens_per_s_ci_low": lo, "tokens_per_s_ci_high": hi,
                           "mfu": result.summary.get("mfu"), "final_loss": result.final_loss,
                           "val_loss": result.summary.get("val_loss"),
                           "wire_ratio": result.summary.get("ratio")}.items():
            if value is not None:
                trial.set_user_attr(key, value)
        self._attach_breakdown(trial, result.run_id)
        if self.objective == PARETO:
            val = result.summary.get("val_loss")
            if val is None:
                return self._prune(trial, "no val loss recorded")
            return TrialOutcome(optuna.trial.TrialState.COMPLETE, [med, val])
        return TrialOutcome(optuna.trial.TrialState.COMPLETE, [med])

    def _attach_breakdown(self, trial: optuna.trial.Trial, run_id: str) -> None:
        """Mean compute / exposed communication / bubble per step (rank-averaged), so users see why.

        Tensor-parallel collectives are on the critical path: the engine moves their time out
        of forward/backward into comm_exposed, so a TP trial's compute excludes them.
        ``comm_by_axis`` gives the recorded traffic per mesh axis (bytes and seconds per step
        per rank), e.g. ``{"tp": {"bytes": ..., "time_s": ...}}``; ``tp_comm_s`` and
        ``pp_comm_s`` are its seconds, named as the simulator's predictions."""
        from profilers.bandwidth import split_key
        from profilers.store import RunStore

        store = RunStore.open_home(self.home)
        every = store.breakdown_table(run_id)
        table = every[every["step"] >= self.warmup]
        if table.empty:
            return
        mean = table.mean(numeric_only=True)
        trial.set_user_attr("compute_s", float(mean.get("forward", 0) + mean.get("backward", 0)))
        trial.set_user_attr("comm_exposed_s", float(mean.get("comm_exposed", 0)))
        trial.set_user_attr("bubble_s", float(mean.get("bubble", 0)))
        trial.set_user_attr("step_time_s", float(mean.get("total", 0)))
        steps = int(every["step"].nunique())  # comm_totals covers the whole run
        by_axis: dict[str, dict[str, float]] = {}
        for key, agg in store.comm_totals(run_id).items():  # whole run, per rank
            axis, op = split_key(key)
            if op == "ddp_bucket":  # the DDP buckets' all-reduces are recorded as themselves too
                continue
            cell = by_axis.setdefault(axis or "other", {"bytes": 0.0, "time_s": 0.0})
            cell["bytes"] += agg["bytes"] / steps
            cell["time_s"] += agg["time(s)"] / steps
        if by_axis:
            trial.set_user_attr("comm_by_axis", by_axis)
        for axis in ("tp", "pp"):  # measured next to the simulator's tp_comm_s / pp_comm_s
            if axis in by_axis:
                trial.set_user_attr(f"{axis}_comm_s", by_axis[axis]["time_s"])
