"""Export: the best (or any) trial's config in every format of `workbench export` (tuning.export.trial.FORMATS)."""
from __future__ import annotations

import json

import streamlit as st
import yaml

from workbench.app_pages import common

LABELS = {  # format: (label, file suffix, mime); every format of tuning.export.trial.FORMATS gets a button
    "yaml": ("YAML config", "yaml", "application/x-yaml"),
    "torchrun": ("torchrun script", "sh", "text/x-shellscript"),  # writes best.yaml, then runs torchrun
    "json": ("JSON config", "json", "application/json"),
    "megatron": ("Megatron-LM launch", "sh", "text/x-shellscript"),
    "deepspeed": ("DeepSpeed JSON", "deepspeed.json", "application/json"),
    "torchtitan": ("torchtitan job TOML", "torchtitan.toml", "application/toml"),
    "accelerate": ("accelerate config YAML", "accelerate.yaml", "application/x-yaml"),
}


def formats() -> dict[str, tuple[str, str, str]]:
    """(label, suffix, mime) of every format `workbench export --format` takes (tuning.export.trial.FORMATS):
    one the page has no label for yet still gets a button, named after it."""
    from tuning.export.trial import FORMATS

    return {f: LABELS.get(f, (f"{f} export", "txt", "text/plain")) for f in FORMATS}


def _best_numbers(study) -> list[int]:
    from optuna.trial import TrialState

    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return []
    if len(study.directions) == 1:
        return [study.best_trial.number]
    return [t.number for t in study.best_trials]


def study_export(home: str) -> None:
    """Pick a study and one of its completed trials; one download button per format."""
    try:
        from tuning.export.trial import export_notes, export_trial
    except ImportError as exc:
        st.warning(f"tuning.export.trial is not importable ({exc}): trial export is unavailable.")
        return
    studies = common.studies_table(home)
    if studies.empty:
        st.info("No studies yet: start one on the **Tune** page, then export its best trial here.")
        return
    name = st.selectbox("Study", list(studies["study"]))
    study = common.load_study(home, name)
    trials = common.trials_frame(home, name)
    done = trials[trials["state"] == "COMPLETE"] if len(trials) else trials
    if done.empty:
        st.info("This study has no completed trial yet.")
        return
    best = _best_numbers(study)
    numbers = [int(n) for n in done.sort_values("tokens/s", ascending=False)["number"]]
    trial = st.selectbox("Trial", numbers, format_func=lambda n: f"trial {n}" + (" (best)" if n in best else ""))
    from tuning.export.trial import trial_config
    from tuning.plan import stand_in_line

    stand_in = stand_in_line(trial_config(study, trial), name)
    if stand_in:  # the study tuned a scaled-down model or fewer ranks: the export is that stand-in's
        st.info(stand_in)
    shown = formats()
    cols = st.columns(4)
    for i, (fmt, (label, suffix, mime)) in enumerate(shown.items()):
        col = cols[i % len(cols)]
        try:
            text = export_trial(study, trial, fmt=fmt)
        except ValueError as exc:  # the target refuses this model in one line (e.g. no torchtitan flavor matches)
            col.warning(f"{label}: {exc}")
            continue
        except Exception as exc:  # one format failing must not hide the others
            col.error(f"{label}: {exc}")
            continue
        col.download_button(label, text, file_name=f"{name}-trial{trial}.{suffix}", mime=mime,
                            key=f"dl-{fmt}", icon=":material/download:")
    for fmt, (label, _, _) in shown.items():
        try:
            items = export_notes(study, trial, fmt)
        except Exception:  # the button above already shows this format's error
            continue
        if items:  # beside the file, never inside it
            st.caption(f"{label}, not mapped: " + "; ".join(items))
    with st.expander("Preview (YAML)"):
        st.code(export_trial(study, trial, fmt="yaml"), language="yaml")


def run_export(home: str) -> None:
    """Any recorded run's config as YAML or JSON (what `workbench run` would repeat)."""
    runs = common.runs_table(home)
    if runs.empty:
        common.empty_runs_message()
        return
    labels = {row["run_id"]: common.run_label(row) for _, row in runs.iterrows()}
    run_id = st.selectbox("Run", list(labels), format_func=labels.__getitem__, key="export_run")
    config = (common.store().run(run_id) or {}).get("config") or {}
    left, right = st.columns(2)
    left.download_button("run config (YAML)", yaml.safe_dump(config, sort_keys=False), file_name=f"{run_id}.yaml",
                         mime="application/x-yaml", key="dl-run-yaml", icon=":material/download:")
    right.download_button("run config (JSON)", json.dumps(config, indent=2), file_name=f"{run_id}.json",
                          mime="application/json", key="dl-run-json", icon=":material/download:")


st.title("Export")
HOME = str(common.home())
st.subheader("From a study")
study_export(HOME)
st.subheader("From a run")
run_export(HOME)
