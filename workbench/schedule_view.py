"""A pipeline run's executed schedule: measured vs predicted bubble per rank, and the rank x time grid.

`schedule_report(store, run_id)` reads the actions the engine recorded (kind "schedule", and
"skip_path" under SkipPipe) for the run's last recorded step and prices the schedule's own action
list with the costs read off that step (tuning/calibrate/schedule.py: action durations and input delays
drawn from the recorded ones over DRAWS walks; host work, head and tail at their means);
`schedule_figure(report)` draws
the executed actions of each rank on a shared time axis (plotly), so the gaps are the bubble.
"""
from __future__ import annotations

from typing import Any

from profilers.store import RunStore

COLORS = {"F": "#4c78a8", "B": "#f58518", "I": "#e45756", "W": "#72b7b2"}
DRAWS = 20  # walks with costs drawn from the step's recorded ones (tuning/calibrate/schedule.py predicted_bubble)


def schedule_report(store: RunStore, run_id: str, step: int | None = None) -> dict[str, Any] | None:
    """{"schedule", "step", "per_rank": {rank: {"measured", "predicted"}}, "ranks": {rank: [[action,
    start, end], ...]} (seconds from the earliest rank's step start), "paths"}; None without records."""
    from tuning.calibrate.schedule import executed_steps, measured_bubble, predicted_bubble

    run = store.run(run_id)
    records = store.metrics(run_id, kind="schedule") + store.metrics(run_id, kind="skip_path")
    if run is None or not records:
        return None
    steps = executed_steps(records)
    chosen = step if step in steps else max(steps)
    ranks = steps[chosen]
    cfg = run.get("config") or {}
    par, batch, model = cfg.get("parallel", {}), cfg.get("batch", {}), cfg.get("model", {})
    n_micro = batch.get("global", 0) // max(par.get("dp", 1) * batch.get("micro", 1), 1)
    pp_ranks = _pp_ranks(ranks, par.get("pp", 1))
    try:
        by_index = predicted_bubble(pp_ranks, schedule=par.get("schedule", "1f1b"), pp=par.get("pp", 1),
                                    n_microbatches=n_micro, virtual=par.get("virtual", 1),
                                    layers=model.get("layers"), draws=DRAWS)
        predicted = {rank: by_index[i] for i, rank in enumerate(sorted(pp_ranks))}
    except (RuntimeError, ValueError, KeyError):  # e.g. a step recorded only in part
        predicted = {}
    measured = measured_bubble(ranks)
    origin = min(row["wall_start"] for row in ranks.values())
    return {"schedule": par.get("schedule"), "step": chosen,
            "per_rank": {rank: {"measured": measured[rank], "predicted": predicted.get(rank)} for rank in sorted(ranks)},
            "ranks": {rank: [[a, s + row["wall_start"] - origin, e + row["wall_start"] - origin]
                             for a, s, e in row["actions"]] for rank, row in sorted(ranks.items())},
            "paths": next((row["paths"] for row in ranks.values() if row["paths"]), {})}


def _pp_ranks(ranks: dict[int, dict[str, Any]], pp: int) -> dict[int, dict[str, Any]]:
    """The ranks of the first pipeline (dp/tp replicas repeat its schedule), keyed in pp order."""
    stage_of = {}
    for rank, row in ranks.items():
        if row["actions"]:
            stage_of.setdefault(rank, min(int(_stage(a)) for a, _, _ in row["actions"]))
    firsts = sorted(ranks)[:pp] if len(ranks) == pp else sorted(ranks, key=lambda r: (stage_of.get(r, 0), r))[:pp]
    return {rank: ranks[rank] for rank in firsts}


def _stage(action: str) -> str:
    digits = ""
    for ch in action.lstrip("("):
        if not ch.isdigit():
            break
        digits += ch
    return digits or "0"


def schedule_figure(report: dict[str, Any]):
    """Rank x time grid of the executed actions (one bar per action, colour by F/B/I/W, label
    stage+micro-batch); empty time on a row is that rank's bubble."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for kind, color in COLORS.items():
        xs, bases, ys, texts = [], [], [], []
        for rank, actions in report["ranks"].items():
            for name, start, end in actions:
                if _kind(name) == kind:
                    xs.append(end - start)
                    bases.append(start)
                    ys.append(f"rank {rank}")
                    texts.append(name)
        if xs:
            fig.add_bar(x=xs, base=bases, y=ys, orientation="h", name=kind, marker_color=color, text=texts,
                        textposition="inside", insidetextanchor="middle",
                        hovertemplate="%{text}: %{base:.4f}s + %{x:.4f}s<extra></extra>")
    bubble = ", ".join(f"r{r} {v['measured']:.0%}" + (f" (pred {v['predicted']:.0%})" if v["predicted"] is not None
                                                       else "") for r, v in report["per_rank"].items())
    fig.update_layout(barmode="overlay", height=120 + 40 * len(report["ranks"]), xaxis_title="seconds",
                      title=f"{report['schedule']} step {report['step']}: bubble {bubble}",
                      yaxis={"autorange": "reversed"}, margin={"t": 40, "b": 30},
                      # a label that does not fit its bar at 9 px is hidden (hover still names it), never squeezed
                      uniformtext={"minsize": 9, "mode": "hide"})
    return fig


def _kind(name: str) -> str:
    return name.rstrip("0123456789")[-1]
