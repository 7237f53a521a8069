"""The adaptive-SP (FlexSP) plans of a run as tables: one row per step, one per (step, group)."""
from __future__ import annotations

from typing import Any


def flexsp_frames(metrics) -> tuple[Any, Any]:
    """(steps, groups) DataFrames from a run's metrics frame (RunStore.metrics(as_frame=True)):
    steps has solve(s), predicted(s), measured(s), measured/predicted, groups, max_tokens_per_rank,
    token_cap, plan (the solver whose plan ran: milp, balanced or greedy) and MILP (ran, or skipped when
    the balanced or greedy plan was already within the gap of the lower bound) per step; groups has
    step, group, size, first_rank, sequences, tokens, predicted(s), measured(s).
    Both empty when the run did not use adaptive_sp."""
    import pandas as pd

    steps = metrics[metrics["kind"] == "flexsp"].pivot_table(index="step", columns="name", values="value",
                                                            aggfunc="last").reset_index()
    _name_the_solver(steps)
    if {"measured(s)", "predicted(s)"} <= set(steps.columns):
        steps["measured/predicted"] = steps["measured(s)"] / steps["predicted(s)"]
    per = metrics[metrics["kind"] == "flexsp_group"].copy()
    if per.empty:
        return steps, pd.DataFrame()
    per["group"] = per["name"].str.extract(r"^g(\d+)_")[0].astype(int)
    per["field"] = per["name"].str.replace(r"^g\d+_", "", regex=True)
    groups = per.pivot_table(index=["step", "group"], columns="field", values="value", aggfunc="last").reset_index()
    for col in ("size", "first_rank", "sequences", "tokens"):
        if col in groups:
            groups[col] = groups[col].astype(int)
    return steps, groups


def _name_the_solver(steps) -> None:
    """The recorded solver index as its name, and whether HiGHS ran at all (milp_vars > 0); a 0/1
    "milp" column read as "the MILP failed" on runs whose cheap plans were already near-optimal."""
    from engine.parallel.flexsp import SOLVERS

    if "solver" in steps:
        steps["plan"] = [SOLVERS[int(i)] for i in steps.pop("solver")]
    if "milp_vars" in steps:
        steps["MILP"] = ["ran" if v > 0 else "skipped" for v in steps.pop("milp_vars")]
