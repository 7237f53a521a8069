"""A run's report as plain data (for `workbench show --json` and the dashboard), and its text form."""
from __future__ import annotations

from typing import Any

from profilers.store import RunStore


def run_report(run_id: str, store: RunStore | None = None) -> dict[str, Any] | None:
    """Status, config, layout, per-step breakdown per rank, collectives, memory of one run."""
    store = store or RunStore.open_home()
    run = store.run(run_id)
    if run is None:
        return None
    table = store.breakdown_table(run_id)
    breakdown = [{k: (float(v) if k not in ("step", "rank") else int(v)) for k, v in row.items()}
                 for row in table.to_dict(orient="records")]
    memory: dict[int, dict[str, float]] = {}
    for rec in store.metrics(run_id, kind="memory"):
        memory.setdefault(rec.rank, {})
        memory[rec.rank][rec.name] = max(memory[rec.rank].get(rec.name, 0.0), rec.value)
    return {
        "run_id": run_id, "name": run.get("name"), "status": run["status"], "error": run.get("error"),
        "error_rank": run.get("error_rank"), "world_size": run["world_size"], "layout": run.get("layout"),
        "emulated": bool(run.get("emulated")), "config": run.get("config"), "host": run.get("host"),
        "versions": run.get("versions"), "created": run.get("created"), "ended": run.get("ended"),
        "summary": run.get("summary") or {}, "steps": store.latest_steps(run_id, n=100000),
        "breakdown": breakdown, "bubble_s": _per_rank_total(breakdown, "bubble"),
        "collectives": store.comm_totals(run_id), "wire": store.wire_totals(run_id),
        "peak_memory_gib": store.peak_memory(run_id), "memory": memory,
        "segments": store.segments(run_id),
        "trace_dir": trace_dir(run.get("summary") or {}),
        "breakdown_unexplained": _unexplained(breakdown, store.metrics(run_id, kind="step", name="wall_time(s)")),
    }


def _unexplained(rows: list[dict[str, Any]], walls: list) -> dict[int, float]:
    """Per rank, the median fraction of a step's wall time (the trainer's own clock) that no
    timed phase explains (profilers.steps.unexplained); about 0 when the breakdown is whole."""
    import statistics

    from profilers.steps import unexplained

    wall = {(rec.step, rec.rank): rec.value for rec in walls}
    per_rank: dict[int, list[float]] = {}
    for row in rows:
        if (row["step"], row["rank"]) in wall:
            phases = {k: v for k, v in row.items() if k not in ("step", "rank", "total")}
            per_rank.setdefault(row["rank"], []).append(unexplained(phases, wall[(row["step"], row["rank"])]))
    return {rank: statistics.median(values) for rank, values in sorted(per_rank.items())}


def trace_dir(summary: dict[str, Any]) -> str | None:
    """The folder of a run's torch.profiler traces (one file per rank; HTA's `trace_dir`)."""
    from pathlib import Path

    traces = summary.get("traces") or []
    return str(Path(traces[0]).parent) if traces else None


AXIS_MEANING = {"tp": "TP/SP", "dp": "DDP/FSDP/CO2", "pp": "pipeline", "": "other"}
"""What the collectives on each mesh axis are (the axis prefix of a collective's name)."""


def _per_rank_total(rows: list[dict[str, Any]], phase: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for row in rows:
        out[row["rank"]] = out.get(row["rank"], 0.0) + row.get(phase, 0.0)
    return out


def print_report(report: dict[str, Any], console) -> None:
    from rich.table import Table

    lay = report.get("layout") or {}
    head = f"[bold]{report['run_id']}[/] {report['status']}  ranks={report['world_size']}  " \
           f"dp={lay.get('dp')} tp={lay.get('tp')} pp={lay.get('pp')}"
    if report["emulated"]:
        head += "  [yellow](emulated link)[/]"
    console.print(head)
    if report.get("error"):
        console.print(f"[red]error (rank {report.get('error_rank')}):[/] {report['error']}", markup=True)
    summ = report["summary"]
    console.print({k: summ[k] for k in sorted(summ)})
    rows = report["breakdown"]
    if rows:
        phases = [k for k in rows[0] if k not in ("step", "rank")]
        t = Table(title="step-time breakdown (s), mean over steps, per rank")
        t.add_column("rank")
        for p in phases:
            t.add_column(p, justify="right")
        for rank in sorted({r["rank"] for r in rows}):
            mine = [r for r in rows if r["rank"] == rank]
            t.add_row(str(rank), *(f"{sum(r[p] for r in mine) / len(mine):.4f}" for p in phases))
        console.print(t)
        gaps = report.get("breakdown_unexplained") or {}
        if gaps:
            console.print("wall time no phase explains (median per rank): "
                          + ", ".join(f"rank {r} {g:+.1%}" for r, g in gaps.items()))
    if report["collectives"]:
        _print_collectives(report["collectives"], console)
    if report["memory"]:
        t = Table(title="memory per rank (GiB, peak)")
        names = sorted({n for m in report["memory"].values() for n in m})
        t.add_column("rank")
        for n in names:
            t.add_column(n, justify="right")
        for rank, m in sorted(report["memory"].items()):
            t.add_row(str(rank), *(f"{m.get(n, 0.0):.4f}" for n in names))
        console.print(t)


def collectives_frame(collectives: dict[str, dict[str, float]]):
    """`RunStore.comm_totals` as a table: axis, traffic (TP/SP, DDP/FSDP/CO2, pipeline), op,
    count, bytes, time(s), busbw(GB/s), sorted by axis then op."""
    import pandas as pd

    from profilers.collectives import split_key

    rows = []
    for key, v in sorted(collectives.items(), key=lambda kv: split_key(kv[0])):
        axis, op = split_key(key)
        rows.append({"axis": axis or "-", "traffic": AXIS_MEANING.get(axis, axis), "op": op,
                     "count": v["count"], "bytes": v["bytes"], "time(s)": v["time(s)"],
                     "busbw(GB/s)": v["busbw(GB/s)"]})
    return pd.DataFrame(rows, columns=["axis", "traffic", "op", "count", "bytes", "time(s)", "busbw(GB/s)"])


def _print_collectives(collectives: dict[str, dict[str, float]], console) -> None:
    from rich.table import Table

    t = Table(title="collectives per mesh axis and type (per rank, whole run)")
    frame = collectives_frame(collectives)
    for col in frame.columns:
        t.add_column(col, justify="right")
    for row in frame.itertuples(index=False):
        t.add_row(row.axis, row.traffic, row.op, f"{row.count:.0f}", f"{row.bytes:,.0f}", f"{row[5]:.3f}",
                  f"{row[6]:.3f}")
    console.print(t)
