"""A run's report as plain data (for `workbench show --json` and the dashboard), and its text form."""
from __future__ import annotations

from typing import Any

from profilers.store import RunStore


def model_line(config: dict[str, Any] | None) -> str | None:
    """The run's model in one line: its family (a Hugging Face model_type and where its config came
    from, or the built-in GPT) and shape (engine/model/shapes.py); None when the config names no model."""
    from engine.errors import ConfigError
    from engine.model.shapes import from_gpt, from_hf_config

    mdl = (config or {}).get("model") or {}
    try:
        if mdl.get("hf"):
            shape = from_hf_config(mdl["hf"])
            src = mdl["hf"] if isinstance(mdl["hf"], str) else "inline config"
            name = f"{shape.family} (Hugging Face, {src})"
        elif mdl.get("entry"):
            return f"user model {mdl['entry']}"
        else:
            shape = from_gpt(layers=int(mdl.get("layers", 2)), d_model=int(mdl.get("d_model", 64)),
                             heads=int(mdl.get("heads", 4)), seq_len=int(mdl.get("seq_len", 64)),
                             vocab=int(mdl.get("vocab", 256)), mlp_ratio=int(mdl.get("mlp_ratio", 4)),
                             experts=int(mdl.get("experts", 0)), top_k=int(mdl.get("top_k", 2)))
            name = "gpt (built-in)"
    except (ConfigError, TypeError, ValueError):
        return None
    kv = f"/{shape.kv_heads} kv" if shape.kv_heads != shape.heads else ""
    moe = f", {shape.experts} experts top-{shape.top_k}" if shape.experts else ""
    return (f"{name}: {shape.layers} layers, hidden {shape.hidden}, {shape.heads}{kv} heads, "
            f"ffn {shape.ffn_hidden}{moe}, vocab {shape.vocab}, {shape.params / 1e6:.3g}M parameters")


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
        "model": model_line(run.get("config")),
        "summary": run.get("summary") or {}, "steps": store.latest_steps(run_id, n=100000),
        "breakdown": breakdown, "bubble_s": _per_rank_total(breakdown, "bubble"),
        "collectives": store.comm_totals(run_id), "wire": store.wire_totals(run_id),
        "peak_memory_gib": store.peak_memory(run_id), "memory": memory,
        "segments": store.segments(run_id),
        "trace_dir": trace_dir(run.get("summary") or {}),
        "breakdown_unexplained": _unexplained(breakdown, store.metrics(run_id, kind="step", name="wall_time(s)")),
        "moe": moe_report(store, run_id),
        "schedule": _schedule(store, run_id),
        "diagnosis": _diagnosis(store, run_id),
    }


def _diagnosis(store: RunStore, run_id: str) -> dict[str, Any] | None:
    """What bounds the run and what to try (tuning/diagnose.py), as plain data."""
    from dataclasses import asdict

    from tuning.diagnose import diagnose

    found = diagnose(store, run_id)
    return asdict(found) if found is not None else None


DIAGNOSIS_FINDINGS, DIAGNOSIS_SUGGESTIONS = 3, 2  # shown of each: a short diagnosis


def diagnosis_lines(diag: dict[str, Any], *, findings: int = DIAGNOSIS_FINDINGS,
                    suggestions: int = DIAGNOSIS_SUGGESTIONS) -> list[str]:
    """The diagnosis in a few lines of text: each finding, then its best priced suggestions with
    their command (`workbench show` opens with them)."""
    step = diag["step_s"]
    lines = [diagnosis_title(diag) + ":"]
    if not diag["findings"]:
        lines.append("  nothing stands out: no exposed communication, bubble, optimizer or data loading above "
                     "its threshold, and no rank slower than its peers")
    for i, finding in enumerate(diag["findings"][:findings], 1):
        lines.append(f"  {i}. {finding['headline']}")
        for sug in finding["suggestions"][:suggestions]:
            lines.append(f"     {suggestion_line(sug, step)}")
            lines.append(f"       $ {sug['command']}")
    return lines


def diagnosis_title(diag: dict[str, Any]) -> str:
    return (f"What bounds this run (steady steps: {diag['step_s'] * 1e3:.3g} ms a step; suggestions priced on "
            f"{diag['profile']})")


def suggestion_line(sug: dict[str, Any], step_s: float) -> str:
    """'try ACTION: 112 ms a step (-42%), 9,129 tokens/s [simulator]': a suggestion and its price."""
    from workbench.fmt import num

    pred = sug["predicted_step_s"]
    change = f"{pred * 1e3:.3g} ms a step ({(pred - step_s) / step_s:+.0%}), " if pred else ""
    tps = f"{num(sug['predicted_tokens_per_s'])} tokens/s" if sug["predicted_tokens_per_s"] else "tokens/s n/a"
    return f"try {sug['action']}: {change}{tps} [{sug['basis']}]"


def moe_report(store: RunStore, run_id: str) -> dict[str, Any]:
    """Mixture-of-Experts load per step and rank: tokens routed to each expert (before dropping),
    drop rate and imbalance (max / mean expert load); empty for a dense run."""
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for rec in store.metrics(run_id, kind="moe"):
        row = rows.setdefault((rec.step, rec.rank), {"step": rec.step, "rank": rec.rank, "tokens_per_expert": {}})
        if rec.name.startswith("tokens/e"):
            row["tokens_per_expert"][int(rec.name[len("tokens/e"):])] = rec.value
        else:
            row[rec.name] = rec.value
    if not rows:
        return {}
    per_step = [rows[k] for k in sorted(rows)]
    for row in per_step:
        row["tokens_per_expert"] = [row["tokens_per_expert"][e] for e in sorted(row["tokens_per_expert"])]
    return {"per_step": per_step,
            "mean_drop_rate": sum(r.get("drop_rate", 0.0) for r in per_step) / len(per_step)}


def _schedule(store: RunStore, run_id: str) -> dict[str, Any] | None:
    """Measured vs predicted bubble per rank of a pipeline run (workbench/schedule_view.py)."""
    from workbench.schedule_view import schedule_report

    return schedule_report(store, run_id)


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


AXIS_MEANING = {"tp": "TP/SP", "dp": "DDP/FSDP/CO2", "pp": "pipeline", "": "other", "cp": "context parallel",
                "dp_cp": "dp x cp", "sp": "adaptive SP groups",
                "ep": "MoE experts", "ep_intra": "MoE in node", "ep_inter": "MoE across nodes"}
"""What the collectives on each mesh axis are (the axis prefix of a collective's name)."""


def _per_rank_total(rows: list[dict[str, Any]], phase: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for row in rows:
        out[row["rank"]] = out.get(row["rank"], 0.0) + row.get(phase, 0.0)
    return out


def fit_table(title: str, header: list[str], rows: list[list[str]], console, *, wide: bool = False,
              transpose: bool = False) -> None:
    """Print a table that fits the console: too wide, it is transposed (when `transpose`, e.g. ranks
    as columns), then trailing columns are dropped with a note; `wide` prints every column."""
    from rich.cells import cell_len
    from rich.table import Table

    def build(head: list[str], body: list[list[str]]) -> Table:
        t = Table(title=title)
        for i, name in enumerate(head):
            t.add_column(name, justify="left" if i == 0 else "right", no_wrap=True)
        for row in body:
            t.add_row(*row)
        return t

    def width(head: list[str], body: list[list[str]], n: int) -> int:  # rich's box: 2 padding + 1 rule each
        return 1 + sum(3 + max(cell_len(r[i]) for r in [head, *body]) for i in range(n))

    if not wide and width(header, rows, len(header)) > console.width and transpose and rows:
        flipped = [list(col) for col in zip(header, *rows)]
        header, rows = flipped[0], flipped[1:]
    shown = len(header)
    while not wide and shown > 2 and width(header, rows, shown) > console.width:
        shown -= 1
    body = [r[:shown] for r in rows]
    table = build(header[:shown], body)
    if wide and width(header, body, shown) > console.width:  # as wide as it needs; the terminal wraps it
        from rich.console import Console

        Console(file=console.file, width=width(header, body, shown), color_system=console.color_system,
                force_terminal=console.is_terminal).print(table)
    else:
        console.print(table)
    if shown < len(header):
        hidden = header[shown:]
        names = ", ".join(hidden[:4]) + (", ..." if len(hidden) > 4 else "")
        console.print(f"({len(hidden)} more columns: {names}; use --wide or --json)", highlight=False, markup=False)


SUMMARY_LABELS = {"ratio": "wire / dense bytes (ratio)", "tokens_per_s": "tokens/s (median, steady)",
                  "step_time_s": "step time (s)", "mfu": "MFU", "wall_s": "wall time (s)"}


def summary_rows(summ: dict[str, Any]) -> list[list[str]]:
    """A run summary as (metric, value) rows with readable labels and numbers."""
    from workbench.fmt import num, pct, ratio

    out = []
    for key in sorted(summ):
        value = summ[key]
        shown = pct(value) if key == "mfu" else ratio(value) if key == "ratio" else num(value)
        out.append([SUMMARY_LABELS.get(key, key.replace("_", " ")), shown])
    return out


def print_report(report: dict[str, Any], console, *, wide: bool = False) -> None:
    from workbench.fmt import bandwidth, count, layout, num, seconds, size

    head = f"[bold]{report['run_id']}[/] {report['status']}  ranks={report['world_size']}  " \
           f"{layout(report.get('layout'), report.get('config'))}"
    if report["emulated"]:
        head += "  [yellow](emulated link)[/]"
    console.print(head)
    if report.get("model"):
        console.print(f"model: {report['model']}", markup=False, highlight=False)
    if report.get("diagnosis"):
        for line in diagnosis_lines(report["diagnosis"]):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    if report.get("schedule"):
        sched = report["schedule"]
        cells = "  ".join(f"rank {r}: {v['measured']:.1%}" + (f" (predicted {v['predicted']:.1%})"
                                                               if v["predicted"] is not None else "")
                          for r, v in sched["per_rank"].items())
        console.print(f"pipeline {sched['schedule']} bubble at step {sched['step']}, measured vs predicted "
                      f"from its action list: {cells}", markup=False, highlight=False)
    if report.get("error"):
        console.print(f"[red]error (rank {report.get('error_rank')}):[/] {report['error']}", markup=True)
    fit_table("summary", ["metric", "value"], summary_rows(report["summary"]), console, wide=wide)
    rows = report["breakdown"]
    if rows:
        phases = [k for k in rows[0] if k not in ("step", "rank")]
        body = []
        for rank in sorted({r["rank"] for r in rows}):
            mine = [r for r in rows if r["rank"] == rank]
            body.append([str(rank), *(num(sum(r[p] for r in mine) / len(mine)) for p in phases)])
        fit_table("step-time breakdown (s), mean over steps", ["rank", *phases], body, console, wide=wide,
                  transpose=True)
        gaps = report.get("breakdown_unexplained") or {}
        if gaps:
            console.print("wall time no phase explains (median per rank): "
                          + ", ".join(f"rank {r} {g:+.1%}" for r, g in gaps.items()))
    if report["collectives"]:
        frame = collectives_frame(report["collectives"])
        body = [[row.axis, row.traffic, row.op, count(row.count), size(row.bytes), seconds(row[5]), bandwidth(row[6])]
                for row in frame.itertuples(index=False)]
        fit_table("collectives per mesh axis and type (per rank, whole run)",
                  ["axis", "traffic", "op", "count", "bytes", "time", "busbw"], body, console, wide=wide)
    moe = report.get("moe") or {}
    if moe:
        body = []
        for rank in sorted({r["rank"] for r in moe["per_step"]}):
            mine = [r for r in moe["per_step"] if r["rank"] == rank]
            tokens = [sum(col) for col in zip(*(r["tokens_per_expert"] for r in mine))]
            body.append([str(rank), *(num(t) for t in tokens), f"{sum(r.get('drop_rate', 0.0) for r in mine) / len(mine):.1%}"])
        experts = len(moe["per_step"][0]["tokens_per_expert"])
        fit_table("MoE tokens routed per expert (whole run) and mean drop rate", ["rank", *(f"e{i}" for i in range(experts)),
                  "dropped"], body, console, wide=wide)
    if report["memory"]:
        names = sorted({n for m in report["memory"].values() for n in m})
        # records are in GiB (names end in "(GiB)"); shown in the unit that reads best: 0.0004449 GiB -> 466.5 KiB
        shown = {n: (lambda v: size(v * 2**30)) if n.endswith("(GiB)") else num for n in names}
        body = [[str(rank), *(shown[n](m.get(n, 0.0)) for n in names)] for rank, m in sorted(report["memory"].items())]
        fit_table("memory per rank (peak)", ["rank", *(n.removesuffix("(GiB)") for n in names)], body, console,
                  wide=wide, transpose=True)


def collectives_frame(collectives: dict[str, dict[str, float]]):
    """`RunStore.comm_totals` as a table: axis, traffic (TP/SP, DDP/FSDP/CO2, pipeline), op,
    count, bytes, time(s), busbw(GB/s), sorted by axis then op."""
    import pandas as pd

    from profilers.bandwidth import split_key

    rows = []
    for key, v in sorted(collectives.items(), key=lambda kv: split_key(kv[0])):
        axis, op = split_key(key)
        rows.append({"axis": axis or "-", "traffic": AXIS_MEANING.get(axis, axis), "op": op,
                     "count": v["count"], "bytes": v["bytes"], "time(s)": v["time(s)"],
                     "busbw(GB/s)": v["busbw(GB/s)"]})
    return pd.DataFrame(rows, columns=["axis", "traffic", "op", "count", "bytes", "time(s)", "busbw(GB/s)"])
