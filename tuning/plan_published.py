"""Published layouts of a job like the user's: the rows of tuning/data/published.yaml measured on the same
hardware preset at the same GPU count with a model of about the same size, nearest first. What the people who
ran such a job chose and measured, beside what the simulator says of their layout."""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from tuning.sim.published import DATA, PublishedRow, calibration_rows, held_out_rows, simulated_metric, sources
from tuning.sim.simulator import format_count

SIZE_TOLERANCE = 0.25  # a model within +-25% of the parameters counts as "about the same size"
METRIC_NAMES = {"tflops_per_gpu": "TFLOP/s per GPU (recomputation counted)",
                "model_tflops_per_gpu": "model TFLOP/s per GPU", "mfu": "MFU (%)",
                "tokens_per_s_per_gpu": "tokens/s per GPU"}
COLUMNS = ["id", "source", "paper", "row", "params", "seq", "gpus", "layout", "global_batch", "framework", "metric",
           "published", "simulated"]


def layout_text(r: PublishedRow) -> str:
    """The published layout in one line: degrees above 1, ZeRO stage, micro-batch, recomputation."""
    degrees = [f"{name}{value}" for name, value in (("tp", r.tp), ("pp", r.pp), ("dp", r.dp), ("cp", r.cp),
                                                     ("ep", r.ep), ("v", r.virtual)) if value > 1 or name == "dp"]
    zero = [f"zero{r.zero}"] if r.zero else []
    return " ".join([*degrees, *zero, f"mb{r.micro}", f"recompute {r.recompute}"])


def _like(r: PublishedRow, params: float, gpus: int, hardware: str, tolerance: float) -> bool:
    return r.cluster == hardware and r.gpus == gpus and abs(r.model().params / params - 1) <= tolerance


def published_like(params: float, gpus: int, hardware: str, *, seq: int | None = None,
                   tolerance: float = SIZE_TOLERANCE, path: str | Path = DATA) -> pd.DataFrame:
    """Published rows on `hardware` (a preset name) at `gpus` GPUs whose model is within `tolerance` of `params`
    parameters, the nearest sequence length first (given `seq`), then the nearest size; each with the simulator's value of its
    metric for its own layout (empty, with the columns, where no such row exists)."""
    rows = [r for r in calibration_rows(path) + held_out_rows(path) if _like(r, params, gpus, hardware, tolerance)]
    rows.sort(key=lambda r: (abs(math.log(r.seq / seq)) if seq else 0.0, abs(math.log(r.model().params / params)),
                             r.id))
    srcs = sources(path)
    return pd.DataFrame([{"id": r.id, "source": r.source, "paper": srcs[r.source]["paper"].split(",")[0],
                          "row": r.row, "params": format_count(r.model().params), "seq": r.seq, "gpus": r.gpus,
                          "layout": layout_text(r), "global_batch": r.global_batch, "framework": r.framework,
                          "metric": METRIC_NAMES[r.metric], "published": r.value,
                          "simulated": simulated_metric(r)} for r in rows], columns=COLUMNS)
