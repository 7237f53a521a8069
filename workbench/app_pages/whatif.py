"""What-if: the simulator with sliders (predicted breakdown and memory) and a full config search,
for a named model preset (Llama-3.1-8B from examples/llama3_8b/config.json, the GPT sizes of Narayanan
et al.) or any Hugging Face config.json (uploaded or a path), on a preset cluster or a hardware profile
(`workbench calibrate` writes this machine's under <home>/hardware/). It opens on Llama-3.1-8B with
Megatron-core on 64 H100s, inside the validated domain; every label names a quantity and its unit."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

from engine.errors import ConfigError
from tuning.sim.framework import FRAMEWORKS
from tuning.sim.hardware import PRESETS, load_cluster
from tuning.search import best_configs, enumerate_configs, sensitivities
from tuning.sim.simulator import ModelSpec, ParallelSpec, simulate
from workbench import plots
from workbench.app_pages import common
from workbench.ui_state import REPO_ROOT

# GPT sizes of Narayanan et al. 2021, Table 1 (layers, hidden, heads); seq 2048, vocab 51200.
MODELS = {
    "GPT 1.7B": (24, 2304, 24), "GPT 7.5B": (36, 4096, 32), "GPT 18B": (40, 6144, 48),
    "GPT 39B": (48, 8192, 64), "GPT 76B": (60, 10240, 80), "GPT 146B": (80, 12288, 96),
    "GPT 310B": (96, 16384, 128), "GPT 530B": (105, 20480, 128), "GPT 1T": (128, 25600, 160),
}
SEQS = [2048, 4096, 8192, 16384, 32768, 65536, 131072]
HF_PRESETS = {"Llama-3.1-8B": REPO_ROOT / "examples" / "llama3_8b" / "config.json"}  # Meta's config.json values
DEFAULT_MODEL, DEFAULT_CLUSTER, DEFAULT_FRAMEWORK = "Llama-3.1-8B", "dgx-h100", "megatron-core"


def params_text(count: float) -> str:
    """A parameter count as people say it: 8030261248 -> '8.0B', 1.7e9 -> '1.7B', 350e6 -> '350M'."""
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if count >= size:
            return f"{count / size:.1f}{suffix}" if count < 100 * size else f"{count / size:.0f}{suffix}"
    return f"{count:.0f}"


def human_counts(text: str) -> str:
    """Counts of ten digits or more in a sentence (the domain's 'model size 18,449,756,160') as '18.4B'."""
    return re.sub(r"\b\d{1,3}(?:,\d{3}){3,}\b", lambda m: params_text(float(m.group().replace(",", ""))), text)


def preset_models(seq: int, experts: int, top_k: int) -> dict[str, ModelSpec]:
    """Every named preset at ``seq`` tokens, labelled with its parameter count ('Llama-3.1-8B (8.0B parameters)')."""
    models = {name: ModelSpec.from_hf(json.loads(path.read_text()), seq=seq) for name, path in HF_PRESETS.items()}
    models |= {name: ModelSpec(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=51200, experts=experts,
                               top_k=top_k) for name, (layers, hidden, heads) in MODELS.items()}
    return {f"{name} ({params_text(spec.params)} parameters)": spec for name, spec in models.items()}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def local_profiles(home: Path) -> dict[str, str]:
    """Hardware profiles in the home (`workbench calibrate` writes <home>/hardware/cpu-local-WORLD.yaml):
    label -> path."""
    folder = home / "hardware"
    files = sorted([*folder.glob("*.yaml"), *folder.glob("*.yml"), *folder.glob("*.json")]) if folder.is_dir() else []
    return {f"{f.stem} (profile: {f})": str(f) for f in files}


def cluster_picker() -> tuple[str, Any]:
    """(what to load, the ClusterSpec): a preset, a profile of this home, or a profile path typed in."""
    profiles = local_profiles(common.home())
    options = [*sorted(PRESETS), *profiles]
    default = next(iter(profiles), DEFAULT_CLUSTER)  # this machine's calibrated profile first, when there is one
    label = st.selectbox("Cluster (preset or calibrated profile)", options, index=options.index(default))
    typed = st.text_input("or a profile file path", "", placeholder="~/run/hardware/cpu-local-2.yaml")
    source = str(Path(typed).expanduser()) if typed.strip() else profiles.get(label, label)
    try:
        return source, load_cluster(source)
    except (KeyError, ValueError, OSError, TypeError) as exc:
        st.error(f"cluster {source!r}: {exc}")
        st.stop()


def hf_config() -> dict[str, Any] | None:
    """A Hugging Face config.json: uploaded, or read from a path (a file or a folder holding one)."""
    upload = st.file_uploader("config.json", type=["json"], key="whatif_hf_upload")
    typed = st.text_input("or its path (a file, or a model folder holding config.json)", "", key="whatif_hf_path")
    try:
        if upload is not None:
            return json.loads(upload.getvalue().decode())
        if typed.strip():
            from engine.model.shapes import read_hf_config

            return dict(read_hf_config(str(Path(typed.strip()).expanduser())))
    except (ConfigError, OSError, ValueError) as exc:
        st.error(f"config.json: {exc}")
        st.stop()
    return None


def model_picker(seq: int, experts: int, top_k: int) -> tuple[str, ModelSpec]:
    """(a name, the simulator's model) from a GPT preset or a Hugging Face config.json at ``seq`` tokens."""
    kind = st.radio("Model from", ["Preset", "Hugging Face config.json"], horizontal=True, key="whatif_kind")
    if kind == "Preset":
        models = preset_models(seq, experts, top_k)
        name = st.selectbox("Model (parameters)", list(models), key="whatif_model")
        return name.split(" (")[0], models[name]
    data = hf_config()
    if data is None:
        st.info("Upload a Hugging Face config.json (or give its path) to price that model.")
        st.stop()
    try:
        spec = ModelSpec.from_hf(data, seq=seq)
    except (ConfigError, KeyError, ValueError, TypeError) as exc:
        st.error(f"config.json: {exc}")
        st.stop()
    return f"{data.get('model_type', 'model')} (config.json)", spec


COLUMN_NAMES = {"tp": "tp (GPUs)", "pp": "pp (stages)", "dp": "dp (GPUs)", "cp": "cp (GPUs)", "ep": "ep (GPUs)",
                "virtual": "virtual stages (count)", "micro": "micro batch (samples)",
                "global_batch": "global batch (samples)", "zero": "ZeRO stage", "tokens_per_s": "throughput (tokens/s)",
                "tflops_per_gpu": "TFLOP/s per GPU", "mfu": "MFU (fraction)", "fits": "fits in memory",
                "memory_per_gpu_gb": "memory per GPU (GB)",
                "bubble_fraction": "bubble (fraction of the step)", "num_microbatches": "micro-batches (count)",
                "tp_spans_nodes": "tp spans nodes", "cp_impl": "cp implementation",
                "sequence_parallel": "sequence parallel"}


def column_name(column: str) -> str:
    """A search column as people read it: 'iteration_time_s' -> 'iteration time (s)', 'mem_params_gb' ->
    'memory: params (GB)'."""
    if column in COLUMN_NAMES:
        return COLUMN_NAMES[column]
    for suffix, unit in (("_s", "s"), ("_gb", "GB")):
        if column.endswith(suffix):
            stem = column[: -len(suffix)].replace("mem_", "memory: ", 1).replace("_", " ")
            return f"{stem} ({unit})"
    return column.replace("_", " ")


def shown(table: pd.DataFrame) -> pd.DataFrame:
    """A search table with its columns named for people."""
    return table.rename(columns=column_name)


@st.cache_data(show_spinner=False, max_entries=4)
def search(model_json: str, cluster: str, gpus: int, global_batch: int) -> pd.DataFrame:
    """Every valid configuration priced (vectorised; cached per input), ep and cp included."""
    return enumerate_configs(ModelSpec(**json.loads(model_json)), load_cluster(cluster), gpus, global_batch)


st.title("What-if")
st.caption("Analytical model of one iteration (tuning/sim/simulator.py): predictions, not measurements.")
c = st.columns([2, 1, 1])
with c[0]:
    CLUSTER, spec = cluster_picker()
# a calibrated profile has as many "GPUs" as it measured ranks (num_nodes set); a preset as many as asked
LIMIT = spec.total_gpus if spec.num_nodes else 65536
GPUS = int(c[1].number_input("GPUs (count)", 1, LIMIT, min(64, LIMIT), step=1 if spec.num_nodes else 8,
                             key=f"whatif_gpus_{LIMIT}"))
GLOBAL = int(c[2].number_input("Global batch (samples)", 1, 65536, 512, step=8))
with st.expander("Mixture-of-Experts (GPT presets) and sequence length"):
    c = st.columns(3)
    experts = c[0].select_slider("experts per MoE layer (count, 0 = dense)", [0, 4, 8, 16, 32, 64], value=0)
    top_k = c[1].select_slider("experts per token (top-k, count)", [1, 2, 4], value=2)
    seq = c[2].select_slider("sequence length (tokens)", SEQS, value=2048)
MODEL_NAME, MODEL = model_picker(seq, experts, top_k)

st.subheader("One configuration")
c = st.columns(6)
# only degrees the model takes: tp divides the GPUs, the heads and the key/value heads
kv = MODEL.kv_heads or MODEL.heads
tp_options = [d for d in _divisors(GPUS) if MODEL.heads % d == 0 and kv % d == 0]
tp = c[0].select_slider("tensor parallel (tp, GPUs)", tp_options, value=max(d for d in tp_options if d <= 2))
pp_options = _divisors(GPUS // tp)
pp = c[1].select_slider("pipeline stages (pp, count)", pp_options, value=1)
micro = c[2].select_slider("micro batch (samples)", _divisors(GLOBAL), value=1)
zero = c[3].select_slider("ZeRO stage (0-3)", [0, 1, 2, 3], value=1)
recompute = c[4].selectbox("activation recompute", ["none", "selective", "full"], index=1)
virtual = c[5].select_slider("virtual stages per GPU (count)", [1, 2, 4, 8], value=1)
c = st.columns([2, 1])
frameworks = list(FRAMEWORKS)
framework = c[0].selectbox("framework", frameworks, index=frameworks.index(DEFAULT_FRAMEWORK),
                           format_func=lambda f: f"{f}: {FRAMEWORKS[f].description}")
flash = c[1].checkbox("fused attention (FlashAttention / cuDNN)", value=True, key="whatif_flash",
                      help="one kernel for the attention: no sequence x sequence scores held in memory, "
                           "causal blocks skipped (ParallelSpec.flash_attention)")
with st.expander("Context and expert parallelism"):
    c = st.columns(4)
    cp = c[0].select_slider("context parallel (cp, GPUs)", _divisors(GPUS // (tp * pp)), value=1)
    cp_impl = c[1].selectbox("cp implementation", ["ulysses", "ring"])
    ep_options = [e for e in _divisors(GPUS // (tp * pp * cp)) if MODEL.experts and MODEL.experts % e == 0] or [1]
    ep = c[2].select_slider("expert parallel (ep, GPUs)", ep_options, value=1)
    hierarchical = c[3].checkbox("hierarchical all-to-all (inside the node first)")
par = ParallelSpec(dp=GPUS // (tp * pp * cp), tp=tp, pp=pp, micro=micro, global_batch=GLOBAL, zero=zero,
                   recompute=recompute, virtual=virtual, ep=ep, cp=cp, cp_impl=cp_impl,
                   moe_hierarchical=hierarchical, framework=framework, flash_attention=flash)
try:
    result = simulate(MODEL, spec, par)
except ValueError as exc:
    st.error(str(exc))
else:
    m = st.columns(5)
    m[0].metric("iteration (s)", f"{result.iteration_time_s:.3f}")
    m[1].metric("throughput (tokens/s)", f"{result.tokens_per_s:,.0f}")
    m[2].metric("TFLOP/s per GPU", f"{result.tflops_per_gpu:.1f}")
    m[3].metric("MFU (%)", f"{100 * result.mfu:.1f}")
    m[4].metric("memory per GPU (GB)", f"{result.memory_per_gpu_gb:.1f}", "fits" if result.fits else "does not fit",
                delta_color="normal" if result.fits else "inverse")
    from tuning.sim.domain import prediction

    where = prediction(result.iteration_time_s, hardware=spec.name, framework=par.framework, tp=tp, pp=pp,
                       virtual=virtual, zero=zero, gpus=par.gpus, micro=micro, params=float(MODEL.params),
                       seq=MODEL.seq)
    near = "; ".join(f"{n['id']} ({n['error_pct']:+.1f}%)" for n in where["domain"]["nearest"])
    lo, hi = where["interval_s"]
    if where["domain"]["inside"]:
        st.caption(f"Inside the validated domain: measured time likely {lo:.3g}-{hi:.3g} s; nearest published rows: {near}")
    else:
        st.warning(f"Extrapolated: {human_counts('; '.join(where['domain']['reasons']))}. "
                   f"Measured time likely {lo:.3g}-{hi:.3g} s "
                   f"(interval widened); nearest published rows: {near}")
    left, right = st.columns(2)
    left.plotly_chart(plots.fig_sim_breakdown(result.breakdown), width="stretch")
    right.plotly_chart(plots.fig_sim_memory(result.memory_breakdown_gb, spec.memory_gb), width="stretch")

st.subheader("Search every configuration")
st.caption(f"{MODEL_NAME} ({params_text(MODEL.params)} parameters) on {GPUS} GPUs of {spec.name}, "
           f"global batch {GLOBAL}: every valid tp, pp, dp, cp, ep, micro batch, ZeRO stage, recompute, schedule.")
KEY = (json.dumps(dataclasses.asdict(MODEL), sort_keys=True), CLUSTER, GPUS, GLOBAL)
if st.button("Search", type="primary", icon=":material/search:"):
    st.session_state["whatif_search"] = KEY
key = st.session_state.get("whatif_search")
if key is None:
    st.info("Press **Search** to price every configuration of this model and cluster.")
else:
    df = search(*key)
    fits = int(df["fits"].sum())
    stale = " (for the inputs of the last Search)" if key != KEY else ""
    st.write(f"{len(df):,} valid configurations, {fits:,} fit in memory{stale}.")
    st.plotly_chart(plots.fig_search_scatter(df), width="stretch")
    st.markdown("**Best configurations** (shortest iteration, fitting in memory)")
    st.dataframe(shown(best_configs(df, 10)), hide_index=True, width="stretch")
    for name, table in sensitivities(df).items():
        with st.expander(f"Sensitivity: {name.replace('_', ' ')}"):
            st.dataframe(shown(table), hide_index=True, width="stretch")
