"""Numbers and labels people read: one formatting helper (workbench/fmt.py) for bytes, counts,
durations and layouts; run ids never cut; every collective labelled with its group."""
from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd

from workbench import fmt


def test_bytes_counts_durations_and_layouts_read_as_people_write_them():
    # old code: "AttributeError: module 'workbench.fmt' has no attribute 'size'" (the page showed 2585806560)
    assert fmt.size(2585806560) == "2.408 GiB" and fmt.size(512) == "512 B" and fmt.size(1536) == "1.5 KiB"
    assert fmt.count(244.5) == "245" and fmt.count(7864587.75) == "7,864,588"
    assert fmt.seconds(3e-7) == "0.3 µs" and fmt.seconds(0.0042) == "4.2 ms" and fmt.seconds(12.5) == "12.5 s"
    assert fmt.num(45815.01329358271) == "45,815"
    assert fmt.layout({"dp": 2, "tp": 1, "pp": 1, "world_size": 2}, {"parallel": {"ep": 2}}) == "dp2 · tp1 · pp1 · cp1 · ep2"
    assert fmt.layout({"dp": 1, "tp": 1, "pp": 1, "cp": 2}) == "dp1 · tp1 · pp1 · cp2 · ep1"


def test_the_run_pages_collectives_table_is_formatted_and_labelled():
    from workbench.app_pages.common import collectives_shown
    from workbench.report import collectives_frame

    totals = {key: {"count": 244.5, "bytes": 2585806560.0, "time(s)": 3e-7, "busbw(GB/s)": 1.23456}
              for key in ("cp:all_to_all", "dp_cp:all_reduce", "sp:all_to_all")}
    shown = collectives_shown(collectives_frame(totals))
    assert list(shown["count"]) == ["245"] * 3 and list(shown["bytes"]) == ["2.408 GiB"] * 3
    assert list(shown["time"]) == ["0.3 µs"] * 3
    assert "-" not in set(shown["axis"]) and "other" not in set(shown["traffic"])
    assert dict(zip(shown["axis"], shown["traffic"])) == {"cp": "context parallel", "dp_cp": "dp x cp",
                                                          "sp": "adaptive SP groups"}


def _cli(*args: str, home, columns: int = 80) -> subprocess.CompletedProcess:
    env = {**os.environ, "WORKBENCH_HOME": str(home), "COLUMNS": str(columns)}
    return subprocess.run([sys.executable, "-m", "workbench.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_runs_lists_whole_ids_at_80_columns_and_show_names_every_axis(tmp_path):
    from profilers.store import RunStore

    run_id = "tune-ui-study-with-a-long-name-trial-0042-3f9a1c2b"
    store = RunStore.open_home(tmp_path)
    store.create_run(run_id, name="tune-ui", config={"parallel": {"dp": 1, "cp": 2, "ep": 1}}, world_size=2,
                     layout={"dp": 1, "tp": 1, "pp": 1, "cp": 2, "world_size": 2}, host={}, versions={},
                     emulated=False, parent=None)
    out = _cli("runs", home=tmp_path)
    assert out.returncode == 0, out.stderr
    # old code: the id wrapped over two lines of the 80-column table
    assert run_id in out.stdout, out.stdout
    assert "dp1 · tp1 · pp1 · cp2 · ep1" in _cli("show", run_id, home=tmp_path, columns=200).stdout
    help_text = " ".join(_cli("run", "--help", home=tmp_path, columns=200).stdout.split())
    assert "dp*tp*pp*cp" in help_text and "ep" in help_text


def test_headline_tokens_per_second_are_thousands_separated():
    steps = pd.DataFrame([{"step": 3, "loss": 4.123456, "tokens_per_s": 45815.013, "mfu": None}])
    assert fmt.num(steps.iloc[-1]["tokens_per_s"]) == "45,815"


def test_schedule_grid_hides_labels_that_do_not_fit_their_bar():
    # old code: "AssertionError: assert (None == 'hide')": plotly shrank each label into its bar, unreadable
    from workbench.schedule_view import schedule_figure

    report = {"schedule": "1f1b", "step": 3, "per_rank": {0: {"measured": 0.2, "predicted": None}},
              "ranks": {0: [["0F0", 0.0, 0.010], ["0B0", 0.010, 0.0102]]}, "paths": {}}
    fig = schedule_figure(report)
    assert fig.layout.uniformtext.mode == "hide" and fig.layout.uniformtext.minsize >= 8


def test_bandwidths_read_with_their_unit_in_every_table():
    """Issue 52 item 7: busbw read `1.49e-07` (GB/s) on the Run page, in Compare and in `workbench show`."""
    from workbench.app_pages.common import collectives_shown
    from workbench.report import collectives_frame

    shown = collectives_shown(collectives_frame({"dp:all_reduce": {"count": 3.0, "bytes": 1536.0, "time(s)": 0.01,
                                                                   "busbw(GB/s)": 1.49e-07}}))
    assert list(shown.iloc[:, -1]) == ["149 B/s"]  # old code: ['1.49e-07']
    from workbench.app_pages.common import side_by_side

    assert fmt.bandwidth(0.0227) == "22.7 MB/s" and fmt.bandwidth(1.908) == "1.908 GB/s"
    table = pd.DataFrame({"run-a": [1.49e-07, 2585806560.0, 0.0042, 29395.4, "completed"]},
                         index=["dp:all_reduce/busbw(GB/s)", "dp:all_reduce/bytes", "median_step_time(s)",
                                "mean_tokens_per_s", "status"])
    assert list(side_by_side(table)["run-a"]) == ["149 B/s", "2.408 GiB", "4.2 ms", "29,395", "completed"]


def test_show_prints_bandwidth_with_its_unit(tmp_path):
    from profilers.records import Record
    from profilers.store import RunStore

    store = RunStore.open_home(tmp_path)
    store.create_run("bw-1", name="bw", config={"parallel": {"dp": 2}}, world_size=2,
                     layout={"dp": 2, "tp": 1, "pp": 1, "world_size": 2}, host={}, versions={}, emulated=False, parent=None)
    store.write([Record("bw-1", r, 0, "comm", f"dp:all_reduce/{k}", v, 0.0) for r in (0, 1)
                 for k, v in (("bytes", 1536.0), ("count", 3.0), ("time(s)", 0.01), ("busbw(GB/s)", 1.49e-07))])
    store.close()
    out = _cli("show", "bw-1", home=tmp_path, columns=200).stdout
    assert "149 B/s" in out and "e-07" not in out, out
