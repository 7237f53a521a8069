"""The run store's derived views: what the dashboard, the CLI, the tuner and the diagnosis read from a
run's recorded metrics (phase breakdowns per step and rank, collective totals, wire bytes, memory peaks,
headline summaries and comparisons, step-strided frames for charts). `RunStore` (profilers/store.py)
inherits them; they read only through its `_query`, `run`, `latest_steps` and `path`.
"""
from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from profilers.records import PHASES

if TYPE_CHECKING:
    import pandas as pd


class RunQueries:
    """The read-only views of a run (a mixin of RunStore)."""

    def step_breakdown(self, run_id: str, step: int) -> dict[int, dict[str, float]]:
        """``{rank: {phase: seconds}}`` of one step (phase names without the ``(s)`` unit)."""
        rows = self._query("SELECT rank, name, value FROM metrics WHERE run_id = ? AND "
                           "kind = 'breakdown' AND step = ? ORDER BY rank, rowid", (run_id, step))
        out: dict[int, dict[str, float]] = defaultdict(dict)
        for row in rows:
            out[row["rank"]][_phase(row["name"])] = row["value"]
        return dict(out)

    def breakdown_table(self, run_id: str) -> pd.DataFrame:
        """One row per (step, rank): a column per phase in seconds plus ``total``."""
        import pandas as pd

        rows = self._query("SELECT step, rank, name, value FROM metrics WHERE run_id = ? AND "
                           "kind = 'breakdown' ORDER BY step, rank", (run_id,))
        table: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
        for row in rows:
            table[(row["step"], row["rank"])][_phase(row["name"])] = row["value"]
        extra = sorted({p for v in table.values() for p in v} - set(PHASES))
        columns = ["step", "rank", *PHASES, *extra, "total"]
        data = [[step, rank, *(v.get(p, 0.0) for p in (*PHASES, *extra)), sum(v.values())]
                for (step, rank), v in sorted(table.items())]
        return pd.DataFrame(data, columns=columns)

    def breakdown_means(self, run_id: str, first_step: int = 0) -> pd.DataFrame:
        """Each rank's mean seconds per phase over its steps from ``first_step`` on (index ``rank``, a
        column per recorded phase; a phase a step did not record counts 0, as in `breakdown_table`),
        averaged in SQL: the rows of `breakdown_table` grouped by rank, without reading them."""
        import pandas as pd

        where = "WHERE run_id = ? AND kind = 'breakdown' AND step >= ?"
        counts = dict(self._query(f"SELECT rank, COUNT(DISTINCT step) FROM metrics {where} GROUP BY rank",
                                  (run_id, first_step)))
        sums = self._frame(f"SELECT rank, name, SUM(value) FROM metrics {where} GROUP BY rank, name",
                           (run_id, first_step), ["rank", "name", "value"])
        if sums.empty:
            return pd.DataFrame(columns=list(PHASES), index=pd.Index([], name="rank"))
        sums["value"] /= sums["rank"].map(counts)
        wide = sums.assign(name=sums["name"].map(_phase)).pivot(index="rank", columns="name", values="value")
        wide.columns.name = None
        return wide.fillna(0.0)

    def recorded_steps(self, run_id: str, kind: str) -> list[int]:
        """The steps with a record of ``kind``, in order."""
        return [row[0] for row in self._query("SELECT DISTINCT step FROM metrics WHERE run_id = ? AND kind = ? "
                                              "ORDER BY step", (run_id, kind))]

    def comm_totals(self, run_id: str) -> dict[str, dict[str, float]]:
        """Per collective op over the whole run: bytes and time per rank, count and busbw.

        ``bytes`` and ``time(s)`` are summed over steps and averaged over ranks; ``busbw(GB/s)``
        is time-weighted (sum of busbw x time over sum of time), which equals the bus bytes over
        the total time (nccl-tests definitions, see collectives.py).
        """
        # summed in SQL, one row per op: the Python loop over every record took 0.1 s at 100k records
        field = "substr(name, instr(name, '/') + 1)"
        cells = ("SELECT substr(name, 1, instr(name, '/') - 1) AS op, rank, step, "
                 + ", ".join(f"SUM(CASE WHEN {field} = '{f}' THEN value END) AS {alias}" for f, alias in
                             (("bytes", "b"), ("time(s)", "t"), ("count", "c"), ("busbw(GB/s)", "bw")))
                 + " FROM metrics WHERE run_id = ? AND kind = 'comm' AND instr(name, '/') > 0 GROUP BY op, rank, step")
        rows = self._query("SELECT op, COUNT(DISTINCT rank), SUM(COALESCE(b, 0.0)), SUM(COALESCE(t, 0.0)), "
                           "SUM(COALESCE(c, 1.0)), SUM(COALESCE(bw, 0.0) * COALESCE(t, 0.0)) "
                           f"FROM ({cells}) AS cells GROUP BY op ORDER BY op", (run_id,))
        out = {}
        for op, ranks, total_bytes, seconds, calls, bus_seconds in rows:
            n = max(int(ranks), 1)
            out[op] = {"bytes": total_bytes / n, "time(s)": seconds / n, "count": calls / n, "ranks": float(n),
                       "busbw(GB/s)": bus_seconds / seconds if seconds else 0.0}
        return out

    def wire_totals(self, run_id: str) -> dict[str, float]:
        """Compressed bytes on the wire vs dense bytes over the run (summed over ranks)."""
        rows = self._query("SELECT name, SUM(value) AS total FROM metrics WHERE run_id = ? AND "
                           "kind = 'comm' AND name IN ('wire_bytes', 'dense_bytes') GROUP BY name",
                           (run_id,))
        totals = {r["name"]: float(r["total"]) for r in rows}
        wire, dense = totals.get("wire_bytes", 0.0), totals.get("dense_bytes", 0.0)
        return {"wire_bytes": wire, "dense_bytes": dense,
                "ratio": wire / dense if dense else 1.0}

    def peak_memory(self, run_id: str) -> dict[int, float]:
        """``{rank: GiB}``: the highest CUDA peak allocated, else the highest (peak) RSS."""
        rows = self._query("SELECT rank, name, MAX(value) AS peak FROM metrics WHERE run_id = ? "
                           "AND kind = 'memory' AND name IN ('peak_allocated(GiB)', "
                           "'peak_rss(GiB)', 'rss(GiB)') GROUP BY rank, name", (run_id,))
        preference = {"peak_allocated(GiB)": 0, "peak_rss(GiB)": 1, "rss(GiB)": 2}
        best: dict[int, tuple[int, float]] = {}
        for row in rows:
            rank, rank_pref = row["rank"], preference[row["name"]]
            if rank not in best or rank_pref < best[rank][0]:
                best[rank] = (rank_pref, float(row["peak"]))
        return {rank: value for rank, (_, value) in sorted(best.items())}

    def run_summary(self, run_id: str) -> dict[str, Any]:
        """Headline figures of one run (what `compare` puts in a column)."""
        info = self.run(run_id)
        if info is None:
            raise KeyError(f"no run {run_id!r} in {self.path}")
        steps = self.latest_steps(run_id, n=1_000_000)
        times = [s["step_time(s)"] for s in steps if "step_time(s)" in s]
        tput = [s["tokens_per_s"] for s in steps if "tokens_per_s" in s]
        losses = [s["loss"] for s in steps if "loss" in s]
        peak = self.peak_memory(run_id)
        out: dict[str, Any] = {
            "name": info["name"], "status": info["status"], "world_size": info["world_size"],
            "emulated": info["emulated"], "steps": len(steps),
            "duration(s)": (info["ended"] - info["started"]) if info["ended"] and info["started"]
            else None,
            "final_loss": losses[-1] if losses else None,
            # the first step includes warm-up (allocation, DDP bucket rebuild): median is robust
            "median_step_time(s)": statistics.median(times) if times else None,
            "mean_tokens_per_s": statistics.fmean(tput) if tput else None,
            "peak_memory(GiB)": max(peak.values()) if peak else None,
        }
        table = self.breakdown_table(run_id)
        for phase in PHASES:
            out[f"mean_{phase}(s)"] = float(table[phase].mean()) if len(table) else None
        for op, agg in self.comm_totals(run_id).items():
            out[f"{op}/bytes"] = agg["bytes"]
            out[f"{op}/busbw(GB/s)"] = agg["busbw(GB/s)"]
        for key, value in _flatten(info.get("config") or {}, "config").items():
            out[key] = value
        return out

    def compare(self, run_ids: Sequence[str]) -> pd.DataFrame:
        """Runs side by side: one column per run id, one row per summary figure/config key."""
        import pandas as pd

        columns = {rid: self.run_summary(rid) for rid in run_ids}
        frame = pd.DataFrame(columns)
        return frame.reindex(list(dict.fromkeys(k for s in columns.values() for k in s)))

    # -- bounded readers for charts: aggregated and thinned in SQL, whatever the run's length --
    def _frame(self, sql: str, params: Sequence[Any], columns: list[str]) -> pd.DataFrame:
        import pandas as pd

        return pd.DataFrame.from_records([tuple(r) for r in self._query(sql, params)], columns=columns)

    def _step_stride(self, run_id: str, kind: str, max_steps: int | None) -> tuple[str, list[Any]]:
        """SQL condition keeping about ``max_steps`` evenly spaced steps of ``kind`` (last kept)."""
        if not max_steps:
            return "", []
        lo, hi = self._query("SELECT MIN(step), MAX(step) FROM metrics WHERE run_id = ? AND kind = ?",
                             (run_id, kind))[0]
        n = hi - lo + 1 if hi is not None else 0  # steps are numbered without gaps
        if n <= max_steps:
            return "", []
        stride = -(-n // max_steps)
        return " AND ((step - ?) % ? = 0 OR step = ?)", [lo, stride, hi]

    def step_frame(self, run_id: str) -> pd.DataFrame:
        """One row per step: ``step``, ``time`` (latest), ``ranks`` (how many reported) and each
        step metric by its stored name, averaged over ranks (`latest_steps` as a DataFrame)."""
        long = self._frame("SELECT step, name, AVG(value), MAX(time), COUNT(*) FROM metrics "
                           "WHERE run_id = ? AND kind = 'step' GROUP BY step, name ORDER BY step",
                           (run_id,), ["step", "name", "value", "time", "ranks"])
        if long.empty:
            return long.drop(columns=["name", "value"])
        wide = long.pivot(index="step", columns="name", values="value")
        wide.columns.name = None
        per_step = long.groupby("step").agg(time=("time", "max"), ranks=("ranks", "max"))
        return per_step.join(wide).reset_index()

    def breakdown_steps(self, run_id: str, max_steps: int | None = 500) -> pd.DataFrame:
        """Step-time phases per step, mean over ranks (s): columns ``step``, one per phase and
        ``total``; at most about ``max_steps`` evenly spaced steps (the last one kept)."""
        cond, params = self._step_stride(run_id, "breakdown", max_steps)
        long = self._frame("SELECT step, name, AVG(value) FROM metrics WHERE run_id = ? AND "
                           f"kind = 'breakdown'{cond} GROUP BY step, name ORDER BY step",
                           (run_id, *params), ["step", "name", "value"])
        return _phase_table(long, ["step"])

    def breakdown_ranks(self, run_id: str, step: int | None = None) -> pd.DataFrame:
        """Step-time phases per rank of one step (default: the last): columns ``step``, ``rank``,
        one per phase and ``total`` (the rows `breakdown_table` has for that step)."""
        if step is None:
            row = self._query("SELECT MAX(step) FROM metrics WHERE run_id = ? AND kind = 'breakdown'",
                              (run_id,))[0]
            step = row[0] if row[0] is not None else -1
        long = self._frame("SELECT step, rank, name, value FROM metrics WHERE run_id = ? AND "
                           "kind = 'breakdown' AND step = ? ORDER BY rank, rowid", (run_id, step),
                           ["step", "rank", "name", "value"])
        return _phase_table(long, ["step", "rank"])

    def comm_points(self, run_id: str, max_steps: int | None = 2000) -> pd.DataFrame:
        """Per (rank, step, op): ``size(B)`` (bytes per call) and ``busbw(GB/s)``, from the
        ``OP/bytes``, ``OP/count`` and ``OP/busbw(GB/s)`` comm records; at most about
        ``max_steps`` evenly spaced steps."""
        cond, params = self._step_stride(run_id, "comm", max_steps)
        sql = ("SELECT rank, step, substr(name, 1, instr(name, '/') - 1) AS op, "
               "SUM(CASE WHEN name LIKE '%/bytes' THEN value END), "
               "SUM(CASE WHEN name LIKE '%/count' THEN value END), "
               "SUM(CASE WHEN name LIKE '%/busbw(GB/s)' THEN value END) FROM metrics "
               f"WHERE run_id = ? AND kind = 'comm' AND instr(name, '/') > 0{cond} "
               "GROUP BY rank, step, op ORDER BY step, rank")
        raw = self._frame(sql, (run_id, *params), ["rank", "step", "op", "bytes", "count", "busbw(GB/s)"])
        raw = raw.dropna(subset=["bytes", "busbw(GB/s)"])
        raw["size(B)"] = raw["bytes"] / raw["count"].fillna(1.0).clip(lower=1.0)
        return raw[["rank", "step", "op", "size(B)", "busbw(GB/s)"]].reset_index(drop=True)

    def series(self, run_id: str, kind: str, max_points: int | None = 2000) -> pd.DataFrame:
        """Sampled values of one kind (host, gpu, ...) as columns ``time``, ``name``, ``value``,
        ``rank``, ``step``; at most about ``max_points`` evenly spaced samples per (name, rank)."""
        columns = ["time", "name", "value", "rank", "step"]
        # INDEXED BY: without it SQLite picks the (run_id, name) index and reads the whole run
        longest = self._query("SELECT MAX(n) FROM (SELECT COUNT(*) AS n FROM metrics INDEXED BY "
                              "metrics_kind_step WHERE run_id = ? AND kind = ? GROUP BY name, rank) AS counts",
                              (run_id, kind))[0][0] or 0
        if not max_points or longest <= max_points:
            return self._frame("SELECT time, name, value, rank, step FROM metrics WHERE run_id = ? "
                               "AND kind = ? ORDER BY time, rowid", (run_id, kind), columns)
        # window functions (SQLite >= 3.25): number each series' samples, keep every k-th and the last
        sql = ("SELECT time, name, value, rank, step FROM (SELECT time, name, value, rank, step, "
               "(ROW_NUMBER() OVER w) - 1 AS i, COUNT(*) OVER (PARTITION BY name, rank) AS n FROM metrics "
               "INDEXED BY metrics_kind_step WHERE run_id = ? AND kind = ? WINDOW w AS (PARTITION BY name, rank ORDER BY time, rowid)) AS numbered "
               "WHERE i % ((n + ? - 1) / ?) = 0 OR i = n - 1 ORDER BY time")
        return self._frame(sql, (run_id, kind, max_points, max_points), columns)

    def memory_peaks(self, run_id: str) -> pd.DataFrame:
        """The highest value of each memory record per rank: columns ``rank``, ``name``, ``value``."""
        return self._frame("SELECT rank, name, MAX(value) FROM metrics WHERE run_id = ? AND "
                           "kind = 'memory' GROUP BY rank, name ORDER BY rank, name", (run_id,),
                           ["rank", "name", "value"])


def _phase_table(long: pd.DataFrame, index: list[str]) -> pd.DataFrame:
    """Long (index..., name, value) breakdown rows as one column per phase (s) plus ``total``."""
    import pandas as pd

    if long.empty:
        return pd.DataFrame(columns=[*index, *PHASES, "total"])
    long = long.assign(name=long["name"].map(_phase))
    wide = long.pivot(index=index, columns="name", values="value")  # one row per (index, name) already
    extra = sorted(set(wide.columns) - set(PHASES))
    wide = wide.reindex(columns=[*PHASES, *extra]).fillna(0.0)
    wide.columns.name = None
    wide["total"] = wide.sum(axis=1)
    return wide.reset_index()


def _phase(name: str) -> str:
    return name[:-3] if name.endswith("(s)") else name


def _flatten(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}"))
        return out
    return {prefix: json.dumps(value) if isinstance(value, list) else value}
