"""The Run page's charts as Vega-Lite specs with their data apart (`Chart`: title, spec, frame).

Why not Plotly here: Streamlit keys a Plotly chart by a hash of its figure, so every poll of a live
run remounted every chart, blank until the browser drew it again (issue 52 item 6: at most one of
ten charts drawn at a time while a run was live). A Vega-Lite chart keeps its view: while its spec
stays the same, Streamlit swaps the data into the drawn view. So every spec here is a constant of
the chart's kind (nothing of the data in titles or axes: the step drawn is in the data and the
tooltip), and the data are long frames. Every axis and legend names a quantity and its unit for people
(`fmt.quantity`: 'activations, estimated (GiB)', not 'estimate_activations(GiB)'); bytes and bytes per
second are labelled in the decimal unit that reads best (kB/s, MB/s, GB/s) by a Vega expression, so the
spec stays the same as the values grow. Charts are drawn as SVG, so their text is in the page.
Nothing here reads the store (STYLE habit 7).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from workbench import fmt
from workbench.plots import PHASE_COLORS, thin

HEIGHT = 260


@dataclass(frozen=True, slots=True)
class Chart:
    """One chart: its title, a Vega-Lite spec without data, and the frame it draws."""

    title: str
    spec: dict[str, Any]
    data: pd.DataFrame


def _spec(title: str, height: int = HEIGHT, **body: Any) -> dict[str, Any]:
    # legend labels whole (Vega cuts them at 160 px with an ellipsis); SVG: the text is in the page
    return {"title": {"text": title, "anchor": "start", "limit": 0}, "height": height, **body,
            "config": {"legend": {"labelLimit": 0}, "axis": {"titleLimit": 0}},
            "usermeta": {"embedOptions": {"renderer": "svg"}}}


def _si_label(expr: str, unit: str) -> str:
    """A Vega expression writing ``expr`` (a count of ``unit``) in kilo/mega/giga/tera: '12.5 MB/s'."""
    steps = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")]
    out = f"format({expr}, '.3~g') + ' {unit}'"
    for size, prefix in reversed(steps):
        out = f"abs({expr}) >= {size:g} ? format({expr} / {size:g}, '.3~g') + ' {prefix}{unit}' : {out}"
    return out


BYTES_PER_S_LABEL = _si_label("datum.value", "B/s")
BYTES_LABEL = _si_label("datum.value", "B")


def _axis(field: str, kind: str, title: str, **extra: Any) -> dict[str, Any]:
    return {"field": field, "type": kind, "title": title, **extra}


def message(title: str, text: str) -> Chart:
    """A chart holding only a message (its data have not arrived yet): no axes."""
    spec = _spec(title, 120, mark={"type": "text", "fontSize": 14},
                 encoding={"text": {"field": "message", "type": "nominal"}})
    return Chart(title, spec, pd.DataFrame({"message": [text]}))


LOSS_NAMES = {"train loss": "training loss", "val loss": "validation loss"}


def loss(steps: pd.DataFrame, evals: pd.DataFrame | None = None) -> Chart:
    """Training loss per step (mean over ranks) as a line, validation loss as diamonds."""
    rows = [thin(steps.dropna(subset=["loss"]))[["step", "loss"]].assign(series="train loss")
            if "loss" in steps else pd.DataFrame(columns=["step", "loss", "series"])]
    if evals is not None and len(evals):
        rows.append(evals[["step", "value"]].rename(columns={"value": "loss"}).assign(series="val loss"))
    data = pd.concat(rows, ignore_index=True)
    data["series"] = data["series"].map(LOSS_NAMES)
    x = _axis("step", "quantitative", "step")
    y = _axis("loss", "quantitative", "loss (nats/token)", scale={"zero": False})
    color = {"field": "series", "type": "nominal", "title": None,
             "scale": {"domain": list(LOSS_NAMES.values())}}
    spec = _spec("Loss", layer=[
        {"transform": [{"filter": "datum.series == 'training loss'"}], "mark": "line",
         "encoding": {"x": x, "y": y, "color": color}},
        {"transform": [{"filter": "datum.series == 'validation loss'"}],
         "mark": {"type": "point", "shape": "diamond", "size": 90, "filled": True},
         "encoding": {"x": x, "y": y, "color": color}}])
    return Chart("Loss", spec, data)


def has_mfu(steps: pd.DataFrame) -> bool:
    """Whether the run recorded MFU: only where the device's peak FLOP/s is known (engine.device.peak_flops)."""
    return "mfu" in steps and bool(steps["mfu"].notna().any())


def throughput(steps: pd.DataFrame) -> Chart:
    """Tokens/s per step (left axis) and, where the run recorded it, MFU (right axis, %). A CPU run has no
    peak FLOP/s, hence no MFU: its chart draws throughput alone, with no empty MFU axis."""
    data = thin(steps)
    x = _axis("step", "quantitative", "step")
    tokens = "throughput (tokens/s)"
    if not has_mfu(steps):
        frame = pd.DataFrame({"step": data["step"], "value": data.get("tokens_per_s")})
        spec = _spec("Throughput", mark="line", encoding={
            "x": x, "y": _axis("value", "quantitative", tokens, axis={"format": ".3~s"}, scale={"zero": False})})
        return Chart("Throughput", spec, frame)
    frame = pd.DataFrame({"step": data["step"], tokens: data.get("tokens_per_s"), "MFU (%)": 100 * data["mfu"]})
    # the legend at the right, as every chart's: one at the bottom pushed this chart's title out of its frame
    color = {"field": "series", "type": "nominal", "title": None, "scale": {"domain": [tokens, "MFU (%)"]}}

    def layer(series: str, title: str, orient: str, dash: list[int] | None, number: str) -> dict[str, Any]:
        return {"transform": [{"fold": [series], "as": ["series", "value"]}, {"filter": "isValid(datum.value)"}],
                "mark": {"type": "line", **({"strokeDash": dash} if dash else {})},
                "encoding": {"x": x, "y": _axis("value", "quantitative", title, axis={"orient": orient, "format": number},
                                                scale={"zero": False}), "color": color}}

    spec = _spec("Throughput and MFU", layer=[layer(tokens, tokens, "left", None, ".3~s"),
                                              layer("MFU (%)", "MFU (%)", "right", [4, 3], ".3~g")],
                 resolve={"scale": {"y": "independent"}})
    return Chart("Throughput and MFU", spec, frame)


PHASE_NAMES = {"data": "data loading", "forward": "forward", "backward": "backward", "optimizer": "optimizer step",
               "comm_exposed": "exposed communication", "bubble": "pipeline bubble", "other": "other"}
"""The step-time phases (profilers.records.PHASES) as the legends name them."""
PHASE_COLOR = {"field": "phase", "type": "nominal", "title": None,
               "scale": {"domain": [PHASE_NAMES[p] for p in PHASE_COLORS], "range": list(PHASE_COLORS.values())}}
PHASE_ORDER = {PHASE_NAMES[p]: i for i, p in enumerate(PHASE_COLORS)}


def _phase_long(table: pd.DataFrame, index: list[str]) -> pd.DataFrame:
    phases = [c for c in table.columns if c not in ("step", "rank", "total", "run")]
    long = table.melt(id_vars=index, value_vars=phases, var_name="phase", value_name="seconds")
    long["phase"] = long["phase"].map(lambda p: PHASE_NAMES.get(p) or fmt.quantity(p))
    return long.assign(phase_order=long["phase"].map(PHASE_ORDER).fillna(len(PHASE_ORDER)))


def breakdown_ranks(last: pd.DataFrame) -> Chart:
    """Stacked step-time phases per rank of the latest recorded step (the step is in the tooltip)."""
    long = _phase_long(last, ["step", "rank"])
    long["rank"] = "rank " + long["rank"].astype(int).astype(str)
    title = "Step-time breakdown per rank (latest step)"
    spec = _spec(title, mark="bar", encoding={
        "x": _axis("rank", "nominal", "rank", sort=None, axis={"labelAngle": 0}),
        "y": _axis("seconds", "quantitative", "time (s)", stack=True),
        "color": PHASE_COLOR,
        "order": {"field": "phase_order", "type": "quantitative"},
        "tooltip": [{"field": "step", "type": "quantitative"}, {"field": "phase", "type": "nominal"},
                    {"field": "seconds", "type": "quantitative", "format": ".4f"}]})
    return Chart(title, spec, long)


def breakdown_steps(table: pd.DataFrame) -> Chart:
    """Phases per step, mean over ranks, as a stacked area over the run."""
    mean = table.drop(columns=["rank"]).groupby("step", as_index=False).mean() if "rank" in table else table
    long = _phase_long(thin(mean, 500), ["step"])
    title = "Step-time breakdown over the run (mean of ranks)"
    spec = _spec(title, mark={"type": "area", "interpolate": "step-after"}, encoding={
        "x": _axis("step", "quantitative", "step"), "y": _axis("seconds", "quantitative", "time (s)", stack=True),
        "color": PHASE_COLOR,
        "order": {"field": "phase_order", "type": "quantitative"}})
    return Chart(title, spec, long)


def _collective_name(op: str) -> str:
    """'dp:all_reduce' -> 'all-reduce (dp)'."""
    axis, _, name = op.rpartition(":")
    return f"{name.replace('_', '-')} ({axis})" if axis else name.replace("_", "-")


def busbw(comm: pd.DataFrame) -> Chart:
    """Bus bandwidth against message size (log), one colour per collective op."""
    data = pd.concat([thin(rows.sort_values("size(B)")) for _, rows in comm.groupby("op")], ignore_index=True)
    ops = {op: _collective_name(op) for op in data["op"].unique()}
    data = pd.DataFrame({"op": data["op"].map(ops), "size": data["size(B)"],
                         "busbw": data["busbw(GB/s)"] * 1e9})  # bytes/s: the axis writes kB/s ... GB/s
    title = "Collective bus bandwidth by message size"
    spec = _spec(title, mark={"type": "point", "filled": True, "opacity": 0.7}, encoding={
        "x": _axis("size", "quantitative", "message size (bytes, log scale)", scale={"type": "log"},
                   axis={"labelExpr": BYTES_LABEL}),
        "y": _axis("busbw", "quantitative", "bus bandwidth (bytes/s)", axis={"labelExpr": BYTES_PER_S_LABEL}),
        "color": {"field": "op", "type": "nominal", "title": "collective"},
        "tooltip": [{"field": "op", "type": "nominal", "title": "collective"},
                    {"field": "size", "type": "quantitative", "title": "message size (B)", "format": ".4~s"},
                    {"field": "busbw", "type": "quantitative", "title": "bus bandwidth (B/s)", "format": ".4~s"}]})
    return Chart(title, spec, data)


def memory(peaks: pd.DataFrame) -> Chart:
    """Peak memory per rank (GiB), one bar per record name in each rank's group."""
    names = {n: fmt.quantity(n) for n in peaks["name"].unique()}
    data = peaks.assign(rank="rank " + peaks["rank"].astype(int).astype(str), name=peaks["name"].map(names))
    title = "Memory per rank (peak)"
    spec = _spec(title, mark="bar", encoding={
        "x": _axis("rank", "nominal", "rank", sort=None, axis={"labelAngle": 0}), "xOffset": {"field": "name", "type": "nominal"},
        "y": _axis("value", "quantitative", "peak memory (GiB)"),
        "color": {"field": "name", "type": "nominal", "title": None}})
    return Chart(title, spec, data[["rank", "name", "value"]])


def timeline(samples: pd.DataFrame, title: str, unit_label: str) -> Chart:
    """Sampled values (columns time, name, value, rank) against wall-clock time, a line per name and rank,
    each named for people ('network received (bytes/s)', ', rank 1' where several ranks report)."""
    parts = [thin(rows.sort_values("time")) for _, rows in samples.groupby(["name", "rank"], sort=False)]
    data = pd.concat(parts, ignore_index=True) if parts else samples
    several = data["rank"].nunique() > 1
    keys = data[["name", "rank"]].drop_duplicates()
    names = {(n, r): fmt.quantity(n) + (f", rank {int(r)}" if several else "")
             for n, r in zip(keys["name"], keys["rank"])}
    data = pd.DataFrame({"time": pd.to_datetime(data["time"], unit="s"), "value": data["value"],
                         "series": [names[k] for k in zip(data["name"], data["rank"])]})
    rate = unit_label.endswith("(bytes/s)")  # kB/s ... GB/s on the axis, not raw bytes per second
    spec = _spec(title, mark="line", encoding={
        "x": _axis("time", "temporal", "time (UTC)", axis={"format": "%H:%M:%S"}, scale={"type": "utc"}),
        "y": _axis("value", "quantitative", unit_label, **({"axis": {"labelExpr": BYTES_PER_S_LABEL}} if rate else {})),
        "color": {"field": "series", "type": "nominal", "title": None}})
    return Chart(title, spec, data)


def segments(steps: pd.DataFrame, segs: Sequence[Mapping[str, Any]], metric: str = "tokens_per_s") -> Chart:
    """A live in-job study: one metric over the run's steps, each trial's segment shaded and named."""
    last = int(steps["step"].max()) if len(steps) else 0
    spans = pd.DataFrame([{"x0": s["start_step"] - 0.5, "x1": (s.get("end_step") if s.get("end_step") is not None
                                                                 else max(last, s["start_step"])) + 0.5,
                           "trial": f"trial {s.get('trial_number')}"} for s in segs])
    line = thin(steps.dropna(subset=[metric]))[["step", metric]] if metric in steps else pd.DataFrame()
    data = pd.concat([line.rename(columns={metric: "value"}), spans], ignore_index=True)
    title = "Live tuning: segments over the run"
    x = _axis("step", "quantitative", "step")
    spec = _spec(title, layer=[
        {"transform": [{"filter": "isValid(datum.x0)"}], "mark": {"type": "rect", "opacity": 0.15},
         "encoding": {"x": {"field": "x0", "type": "quantitative", "title": "step"}, "x2": {"field": "x1"},
                      "color": {"field": "trial", "type": "nominal", "title": None}}},
        {"transform": [{"filter": "isValid(datum.value)"}], "mark": "line",
         "encoding": {"x": x, "y": _axis("value", "quantitative",
                                         "throughput (tokens/s)" if metric == "tokens_per_s" else metric)}}])
    return Chart(title, spec, data)


def moe_load(per_step: Sequence[Mapping[str, Any]]) -> Chart:
    """Tokens each rank routed to each expert (summed over steps), stacked by rank."""
    totals: dict[tuple[int, int], float] = {}
    for row in per_step:
        for e, n in enumerate(row["tokens_per_expert"]):
            totals[(int(row["rank"]), e)] = totals.get((int(row["rank"]), e), 0.0) + n
    data = pd.DataFrame([{"expert": f"e{e}", "rank": f"rank {r}", "tokens": n} for (r, e), n in sorted(totals.items())])
    title = "Tokens per expert per rank (whole run)"
    spec = _spec(title, mark="bar", encoding={
        "x": _axis("expert", "nominal", "expert", sort=None, axis={"labelAngle": 0}),
        "y": _axis("tokens", "quantitative", "tokens (count)", stack=True),
        "color": {"field": "rank", "type": "nominal", "title": None}})
    return Chart(title, spec, data)


def moe_drops(per_step: Sequence[Mapping[str, Any]]) -> Chart:
    """Drop rate per step and rank."""
    data = pd.DataFrame([{"step": r["step"], "rank": f"rank {int(r['rank'])}", "dropped": r.get("drop_rate", 0.0)}
                         for r in per_step])
    title = "MoE token drop rate"
    spec = _spec(title, mark={"type": "line", "point": True}, encoding={
        "x": _axis("step", "quantitative", "step"), "y": _axis("dropped", "quantitative", "dropped share (fraction)"),
        "color": {"field": "rank", "type": "nominal", "title": None}})
    return Chart(title, spec, data)


def flexsp_groups(groups: pd.DataFrame) -> Chart:
    """Adaptive SP: each step's groups, stacked by size (ranks), coloured by their tokens."""
    data = groups[[c for c in ("step", "group", "size", "tokens", "first_rank", "sequences", "predicted(s)",
                               "measured(s)") if c in groups]].rename(columns={"predicted(s)": "predicted_s",
                                                                             "measured(s)": "measured_s"})
    title = "Adaptive SP groups per step"
    tips = [{"field": c, "type": "quantitative"} for c in data.columns if c != "step"]
    spec = _spec(title, mark="bar", encoding={
        "x": _axis("step", "ordinal", "step", axis={"labelAngle": 0}),
        "y": _axis("size", "quantitative", "ranks per group (count)", stack=True, axis={"tickMinStep": 1}),
        "color": {"field": "tokens", "type": "quantitative", "title": "tokens (count)"}, "tooltip": tips})
    return Chart(title, spec, data)
