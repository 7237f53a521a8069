"""A median pruner that prunes only on differences larger than the trial's measured step noise.

Optuna's MedianPruner compares one step's value with the other trials' median at that step; on a
shared machine one slow step is noise, and it cut trials at steps 2-6. Here a trial is pruned only
when the upper end of the ~95% interval of its own steady values (`median_ci`: its measured
step-to-step noise) is below the median of the finished trials' medians up to the same step
(for a minimised value: the lower end above it).
"""
from __future__ import annotations

import statistics

import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from tuning.objective import median_ci


class NoiseAwareMedianPruner(optuna.pruners.BasePruner):
    """Prune when even the optimistic end of a trial's own interval is worse than the median trial."""

    def __init__(self, *, n_startup_trials: int = 2, n_warmup_steps: int = 0, min_values: int = 2) -> None:
        """`n_startup_trials` finished trials before any pruning; no pruning before step
        `n_warmup_steps`, nor with fewer than `min_values` reported values (no noise to measure)."""
        self.n_startup_trials, self.n_warmup_steps, self.min_values = n_startup_trials, n_warmup_steps, min_values

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        step = trial.last_step
        if step is None or step < self.n_warmup_steps:
            return False
        own = list(trial.intermediate_values.values())
        if len(own) < self.min_values:
            return False
        others = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.intermediate_values]
        if len(others) < self.n_startup_trials:
            return False
        medians = [statistics.median(vs) for t in others
                   if (vs := [v for s, v in t.intermediate_values.items() if s <= step])]
        if not medians:
            return False
        reference = statistics.median(medians)
        _, low, high = median_ci(own)
        if study.direction == StudyDirection.MINIMIZE:
            return low > reference
        return high < reference
