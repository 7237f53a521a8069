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


RATIO_NOTED = 1.25
"""A median measured/predicted beyond this factor (either way) gets its reason said on the Run page."""


def flexsp_notes(steps) -> list[str]:
    """Why the plan table reads as it does (issue 52 item 8): why the MILP was skipped, and what a
    measured/predicted far from 1 means, from the run's own recorded steps (flexsp_frames' steps)."""
    import inspect
    import statistics

    from engine.parallel.flexsp import solve

    notes = []
    gap = inspect.signature(solve).parameters["gap"].default
    if "MILP" in steps and (steps["MILP"] == "skipped").any():
        skipped = int((steps["MILP"] == "skipped").sum())
        notes.append(f"MILP skipped at {skipped} of {len(steps)} steps: the balanced or greedy plan was already "
                     f"within {gap:.0%} (the solver's gap) of a lower bound on every plan's time, so no plan the "
                     "MILP could find would be more than that faster, and HiGHS was not started.")
    ratios = steps["measured/predicted"].dropna().tolist() if "measured/predicted" in steps else []
    if ratios:
        median = statistics.median(ratios)
        spread = (max(ratios) - min(ratios)) / median if median else 0.0
        if median > RATIO_NOTED or median < 1 / RATIO_NOTED:
            notes.append(
                f"Measured is {median:.2f}x the prediction (median of {len(ratios)} steps, spread "
                f"{spread:.0%}): the cost model is fitted once when the run starts, from the fastest of "
                "repeated timings (engine/parallel/adaptive_sp.py calibrate), while each step is one timing "
                "of the slowest group under the load of that moment (other processes, a shared host), so "
                "a steady factor says the ranks ran slower than at calibration, not that the plan is wrong: "
                "plans are chosen by their relative predicted times"
                + (", which a steady factor leaves in order." if spread < 0.5 else
                   "; a spread this wide says the load changed during the run (compare the host timeline)."))
    return notes
