"""Plan: `workbench plan` as a page. The layouts of the real model on the real cluster ranked by the simulator
for a target framework (tuning/plan.py `make_plan`), published runs of a job like it (tuning/plan_published.py),
the dry run of the top layouts on demand (`dry_run_top`: minutes for an 8B model) and each format's export."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

from engine.errors import ConfigError
from tuning.plan import (TARGETS, base_config, dry_run_top, export_for_user, global_batch_rule, make_plan,
                         whole_nodes_rule)
from tuning.plan_published import SIZE_TOLERANCE, published_like
from tuning.sim.hardware import PRESETS, load_cluster
from tuning.sim.simulator import ModelSpec, format_count
from workbench.cli_plan import EXPORT_FILES
from workbench.cli_sim import MODEL_KEYS, MODEL_PRESETS, parse_pairs

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama3_8b" / "config.json"
FROM_PATH, FROM_UPLOAD, FROM_PRESET = "a config.json path", "an uploaded config.json", "a GPT preset"
# the ranked table's columns as the page names them (the simulator's names in `workbench plan --json`)
COLUMNS = {"tp": "TP", "pp": "PP", "dp": "DP", "cp": "CP", "cp_impl": "CP kind", "ep": "EP",
           "virtual": "virtual stages", "micro": "micro-batch (sequences)", "zero": "ZeRO stage",
           "recompute": "recompute", "sequence_parallel": "sequence parallel", "schedule": "schedule",
           "iteration_time_s": "iteration (s)", "time_lo_s": "measured likely from (s)",
           "time_hi_s": "measured likely to (s)", "tokens_per_s": "tokens/s", "mfu": "MFU (%)",
           "memory_per_gpu_gb": "memory per GPU (GB)", "correction_factor": "study's correction (x)",
           "corrected_time_s": "corrected iteration (s)", "framework": "priced as", "attention": "attention kernel",
           "tp_comm_overlap": "TP comm overlap", "precision": "precision"}
PUBLISHED_COLUMNS = {"paper": "source", "row": "row as published", "params": "parameters", "seq": "sequence (tokens)",
                     "gpus": "GPUs", "layout": "layout", "global_batch": "global batch (sequences)",
                     "framework": "framework", "metric": "metric", "published": "measured",
                     "simulated": "simulated"}
NUMBER_FORMATS = {"iteration (s)": "%.4g", "measured likely from (s)": "%.4g", "measured likely to (s)": "%.4g",
                  "tokens/s": "localized", "MFU (%)": "%.1f", "memory per GPU (GB)": "%.1f",
                  "corrected iteration (s)": "%.4g", "study's correction (x)": "%.3f"}
MIME = {"yaml": "application/x-yaml", "megatron": "text/x-shellscript", "deepspeed": "application/json",
        "torchtitan": "application/toml", "accelerate": "application/x-yaml"}


def ranked_frame(table: pd.DataFrame) -> pd.DataFrame:
    """The plan's table as shown: a pick column, MFU in percent, human column names with their units (a column
    COLUMNS does not name yet: its name with spaces)."""
    out = table.assign(mfu=table["mfu"] * 100.0) if "mfu" in table else table.copy()
    out.insert(0, "pick", range(1, len(out) + 1))
    return out.rename(columns=lambda name: COLUMNS.get(name, name.replace("_", " ")))


def layout_label(row: pd.Series) -> str:
    """One ranked layout in a line: its degrees, micro-batch and ZeRO stage."""
    return (f"tp{row['tp']} pp{row['pp']} dp{row['dp']} cp{row['cp']} ep{row['ep']} mb{row['micro']} "
            f"zero{row['zero']} recompute {row['recompute']}")


def _preset_model(name: str, seq: int | None) -> ModelSpec:
    spec = parse_pairs(MODEL_PRESETS[name], {k: int for k in MODEL_KEYS}, "model")
    return ModelSpec(**(spec | ({"seq": seq} if seq else {})))


def model_input(seq: int | None) -> tuple[ModelSpec, str | dict[str, Any] | None]:
    """(the simulator's model, its source for the exports) from a config.json path, an upload or a preset."""
    kind = st.radio("Model from", [FROM_PATH, FROM_UPLOAD, FROM_PRESET], horizontal=True, key="plan_model_kind")
    try:
        if kind == FROM_PRESET:
            name = st.selectbox("GPT preset (Narayanan et al. 2021)", list(MODEL_PRESETS), key="plan_preset")
            return _preset_model(name, seq), None
        if kind == FROM_UPLOAD:
            upload = st.file_uploader("config.json", type=["json"], key="plan_upload")
            if upload is None:
                st.info("Upload a Hugging Face config.json to plan that model.")
                st.stop()
            data = json.loads(upload.getvalue().decode())
            return ModelSpec.from_hf(data, seq=seq), data
        text = st.text_input("config.json (a file, or a model folder holding one)",
                             str(EXAMPLE) if EXAMPLE.is_file() else "", key="plan_model_path").strip()
        if not text:
            st.info("Give the path of a Hugging Face config.json to plan that model.")
            st.stop()
        path = Path(text).expanduser()
        source = str(path / "config.json" if path.is_dir() else path)
        return ModelSpec.from_hf(source, seq=seq), source
    except (ConfigError, OSError, ValueError, KeyError, TypeError) as exc:
        st.error(f"model: {exc}")
        st.stop()


def cluster_input() -> Any:
    """The ClusterSpec of a preset, or of a hardware profile file typed in."""
    presets = sorted(PRESETS)
    name = st.selectbox("Cluster", presets, index=presets.index("dgx-h100"), key="plan_cluster")
    typed = st.text_input("or a hardware profile file", "", key="plan_profile",
                          placeholder="~/.workbench/hardware/cpu-local-2.yaml").strip()
    source = str(Path(typed).expanduser()) if typed else name
    try:
        return load_cluster(source)
    except (KeyError, ValueError, OSError, TypeError) as exc:
        st.error(f"cluster {source!r}: {exc}")
        st.stop()


def base_input() -> dict[str, Any]:
    """The user's run config (data, tokenizer, steps, lr) the exports carry: a YAML path and key=value lines."""
    with st.expander("Your run config (data, tokenizer, weights, steps, learning rate: carried into the exports)"):
        path = st.text_input("run config YAML", "", key="plan_base").strip()
        lines = st.text_area("key=value overrides, one per line", "", key="plan_set", placeholder="data.source=synthetic")
    try:
        return base_config(Path(path).expanduser() if path else None, [x.strip() for x in lines.splitlines() if x.strip()])
    except (ConfigError, OSError, ValueError) as exc:
        st.error(f"run config: {exc}")
        st.stop()


def show_ranked(plan: Any) -> None:
    st.subheader("Ranked layouts")
    st.caption(f"{plan.target} layouts of a {format_count(plan.model.params)}-parameter model at "
               f"{plan.model.seq:,} tokens on {plan.gpus} GPUs of {plan.cluster.name}, global batch "
               f"{plan.global_batch}, best first: the simulator's iteration time, the range the measured time "
               f"likely falls in, and the memory per GPU (of {plan.cluster.memory_gb:g} GB).")
    st.dataframe(ranked_frame(plan.table), hide_index=True, width="stretch", key="plan_table",
                 column_config={name: st.column_config.NumberColumn(format=f) for name, f in NUMBER_FORMATS.items()})
    cal = plan.calibration
    if cal:
        st.caption(f"Ranked by the time corrected with study {cal['study']}'s measured / predicted factors per "
                   f"strategy class ({cal['trials']} trials of a stand-in).")


def show_published(plan: Any) -> None:
    st.subheader("Published runs of a job like this")
    like = published_like(float(plan.model.params), plan.gpus, plan.cluster.name, seq=plan.model.seq)
    if like.empty:
        st.info(f"No published run of a model of {format_count(plan.model.params)} parameters "
                f"(within {SIZE_TOLERANCE:.0%}) on {plan.gpus} GPUs of {plan.cluster.name} "
                "in tuning/data/published.yaml.")
        return
    st.caption("What the people who ran such a job chose and measured (tuning/data/published.yaml), beside the "
               "simulator's value for their layout.")
    st.dataframe(like[list(PUBLISHED_COLUMNS)].rename(columns=PUBLISHED_COLUMNS), hide_index=True, width="stretch")


def dry_run_frame(checks: list[Any]) -> pd.DataFrame:
    """Each dry-run layout's peak per rank role beside the simulator's memory (GiB)."""
    verdict = {True: "yes", False: "no", None: "not judged"}
    return pd.DataFrame([{"pick": c.pick, "fits": verdict[c.fits], "judged by": c.judged_by,
                          "peak per rank role (GiB)": ", ".join(f"{role} {b / 2**30:.2f}" for role, b in c.peaks),
                          "runtime beside it (GiB)": c.runtime_bytes / 2**30,
                          "simulator (GiB)": c.simulator_bytes / 2**30, "largest": c.largest,
                          "took (s)": c.seconds} for c in checks])


def run_dry_runs(plan: Any, k: int, device_memory: float | None) -> list[Any]:
    """`dry_run_top` with its progress drawn: one bar step per layout."""
    with st.status(f"Dry-running the top {k} layout{'s' if k > 1 else ''}", expanded=True) as status:
        bar = st.progress(0.0, text="judging the layouts")

        def progress(pick: int, cfg: Any) -> None:
            bar.progress((pick - 1) / k, text=f"dry-running layout {pick} of {k} at world {cfg.world_size} "
                                              "(one step of the real program on fake ranks)")

        checks = dry_run_top(plan, k, device_memory_gib=device_memory, progress=progress)
        bar.progress(1.0, text=f"{len(checks)} of {k} judged")
        status.update(label=f"Dry-ran the top {k} layout{'s' if k > 1 else ''}", state="complete", expanded=False)
    return checks


def show_dry_runs(plan: Any, key: Any) -> list[Any]:
    st.subheader("Dry run")
    st.caption("One step of the real program at the real world size on torch's fake backend "
               "(`workbench dryrun`), judged against the GPU memory: seconds for a small model, minutes for 8B.")
    c = st.columns([1, 1, 2])
    k = int(c[0].number_input("Layouts to dry-run (the top K)", 1, len(plan.table), 1, key="plan_dry_k"))
    memory = c[1].number_input("GPU memory (GiB, empty: the cluster's)", min_value=0.001, value=None,
                               key="plan_device_memory")
    if c[2].button("Dry-run", icon=":material/play_arrow:", key="plan_dry_run"):
        try:
            st.session_state["plan_dry_runs"] = (key, run_dry_runs(plan, k, memory))
        except (ValueError, ConfigError) as exc:
            st.error(str(exc))
    kept = st.session_state.get("plan_dry_runs")
    checks = kept[1] if kept and kept[0] == key else []
    if checks:
        st.dataframe(dry_run_frame(checks), hide_index=True, width="stretch", key="plan_dry_table",
                     column_config={"simulator (GiB)": st.column_config.NumberColumn(format="%.2f"),
                                    "took (s)": st.column_config.NumberColumn(format="%.1f")})
        for check in checks:
            if check.note:
                st.caption(f"Layout {check.pick}: {check.note}")
            if check.fits is False:
                st.warning(f"Layout {check.pick} does not fit: {check.refusal}")
    return checks


def show_exports(plan: Any, checks: list[Any]) -> None:
    st.subheader("Export")
    labels = [f"{i}: {layout_label(row)}" for i, (_, row) in enumerate(plan.table.iterrows(), start=1)]
    pick = labels.index(st.selectbox("Layout", labels, key="plan_pick")) + 1
    unfit = next((c.refusal for c in checks if c.pick == pick and c.fits is False), None)
    if unfit:
        st.warning(f"Layout {pick} does not fit (its dry run): export another layout.")
    notes: list[str] = []
    refused: list[str] = []
    for col, fmt in zip(st.columns(len(TARGETS)), TARGETS):
        try:
            export = export_for_user(plan, pick, fmt)
        except ValueError as exc:  # the target cannot take the layout (deepspeed: tp/cp) or the model (torchtitan)
            col.button(EXPORT_FILES[fmt], disabled=True, key=f"plan_export_{fmt}", help=str(exc))
            refused.append(str(exc))
            continue
        col.download_button(EXPORT_FILES[fmt], export.text, file_name=EXPORT_FILES[fmt], mime=MIME[fmt],
                            disabled=unfit is not None, icon=":material/download:", key=f"plan_export_{fmt}")
        notes += [f"{fmt}: not mapped: {note}" for note in export.notes]
        notes += [f"{fmt}: {line}" for line in export.defaults]
    for line in refused:
        st.caption(line)
    if notes:
        with st.expander(f"Notes on the exports: what they do not carry, defaults they took ({len(notes)})"):
            st.markdown("\n".join(f"- {line}" for line in notes))
    st.caption("accelerate: `workbench plan ... --export accelerate -o FOLDER` also writes its training script.")


st.title("Plan")
st.caption("The layouts of your model on your cluster, ranked by the simulator for the framework you run "
           "(`workbench plan`): predictions with the range the measured time likely falls in, not measurements.")
c = st.columns([2, 1, 1, 1])
with c[0]:
    MODEL_BOX = st.container()  # the model's inputs above the length they are read at
    SEQ = st.number_input("Sequence length (tokens; empty: config.json's, up to 8192, or the preset's)", min_value=1,
                          value=None, step=1024, key="plan_seq")
with MODEL_BOX:
    MODEL, SOURCE = model_input(int(SEQ) if SEQ else None)
with c[1]:
    CLUSTER = cluster_input()
GPUS = int(c[2].number_input("GPUs", 1, 1 << 20, 64, step=8, key="plan_gpus"))
GLOBAL = int(c[2].number_input("Global batch (sequences)", 1, 1 << 24, 512, step=8, key="plan_global"))
TARGET = c[3].selectbox("Target framework", TARGETS, index=TARGETS.index("megatron"), key="plan_target")
TOP = int(c[3].number_input("Layouts shown", 1, 50, 5, key="plan_top"))
BASE = base_input()
KEY = json.dumps([str(SOURCE) if not isinstance(SOURCE, dict) else SOURCE, repr(MODEL), CLUSTER.name,
                  repr(CLUSTER), GPUS, GLOBAL, TARGET, TOP, BASE], sort_keys=True, default=str)
NODES_RULE = whole_nodes_rule(GPUS, CLUSTER)  # the search would find no layout (`workbench plan --gpus` refuses too)
if NODES_RULE:
    st.error(f"GPUs={GPUS}: {NODES_RULE}")
    st.stop()
BATCH_RULE, BATCH_NOTE = global_batch_rule(MODEL, GPUS, GLOBAL, TARGET)  # `workbench plan --global-batch` says both
if BATCH_RULE:
    st.error(f"Global batch={GLOBAL}: {BATCH_RULE}")
    st.stop()
if BATCH_NOTE:
    st.caption(f"Global batch {GLOBAL} {BATCH_NOTE}")
if st.button("Rank layouts", type="primary", icon=":material/sort:", key="plan_rank"):
    try:
        with st.spinner("Pricing every layout"):
            st.session_state["plan_result"] = (KEY, make_plan(MODEL, CLUSTER, gpus=GPUS, global_batch=GLOBAL,
                                                              target=TARGET, top=TOP, model_source=SOURCE,
                                                              base=BASE))
    except (ValueError, ConfigError) as exc:
        st.error(str(exc))
        st.session_state.pop("plan_result", None)
KEPT = st.session_state.get("plan_result")
if KEPT is None:
    st.info("Press **Rank layouts** to price every layout of this model on this cluster.")
    st.stop()
PLAN_KEY, PLAN = KEPT
if PLAN_KEY != KEY:
    st.caption("The inputs changed: these results are for the last **Rank layouts**.")
show_ranked(PLAN)
show_published(PLAN)
show_exports(PLAN, show_dry_runs(PLAN, PLAN_KEY))
