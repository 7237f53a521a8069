"""What-if: the simulator with sliders (predicted breakdown and memory) and a full config search."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from tuning.hardware import PRESETS, load_cluster
from tuning.search import best_configs, enumerate_configs, sensitivities
from tuning.simulator import ModelSpec, ParallelSpec, simulate
from workbench import plots

# GPT sizes of Narayanan et al. 2021, Table 1 (layers, hidden, heads); seq 2048, vocab 51200.
MODELS = {
    "GPT 1.7B": (24, 2304, 24), "GPT 7.5B": (36, 4096, 32), "GPT 18B": (40, 6144, 48),
    "GPT 39B": (48, 8192, 64), "GPT 76B": (60, 10240, 80), "GPT 146B": (80, 12288, 96),
    "GPT 310B": (96, 16384, 128), "GPT 530B": (105, 20480, 128), "GPT 1T": (128, 25600, 160),
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.cache_data(show_spinner=False, max_entries=4)
def search(model_key: str, cluster: str, gpus: int, global_batch: int, experts: int = 0, top_k: int = 2,
           seq: int = 2048) -> pd.DataFrame:
    """Every valid configuration priced (vectorised; cached per input), ep and cp included."""
    layers, hidden, heads = MODELS[model_key]
    model = ModelSpec(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=51200, experts=experts, top_k=top_k)
    return enumerate_configs(model, load_cluster(cluster), gpus, global_batch)


st.title("What-if")
st.caption("Analytical model of one iteration (tuning/simulator.py): predictions, not measurements.")
c = st.columns(4)
CLUSTER = c[0].selectbox("Cluster", sorted(PRESETS), index=sorted(PRESETS).index("frontier"))
MODEL_KEY = c[1].selectbox("Model", list(MODELS), index=2)
GPUS = int(c[2].number_input("GPUs", 1, 65536, 64, step=8))
GLOBAL = int(c[3].number_input("Global batch (samples)", 1, 65536, 512, step=8))
layers, hidden, heads = MODELS[MODEL_KEY]
MODEL = ModelSpec(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200)
spec = load_cluster(CLUSTER)

st.subheader("One configuration")
c = st.columns(6)
tp = c[0].select_slider("tp", _divisors(GPUS), value=min(8, GPUS) if GPUS % min(8, GPUS) == 0 else 1)
pp_options = _divisors(GPUS // tp)
pp = c[1].select_slider("pp", pp_options, value=pp_options[min(2, len(pp_options) - 1)])
micro = c[2].select_slider("micro batch", _divisors(GLOBAL), value=1)
zero = c[3].select_slider("ZeRO", [0, 1, 2, 3], value=1)
recompute = c[4].selectbox("recompute", ["none", "selective", "full"], index=1)
virtual = c[5].select_slider("virtual stages", [1, 2, 4, 8], value=1)
with st.expander("Mixture-of-Experts and long sequences (context parallelism)"):
    c = st.columns(6)
    experts = c[0].select_slider("experts (0 = dense)", [0, 4, 8, 16, 32, 64], value=0)
    top_k = c[1].select_slider("top-k", [1, 2, 4], value=2)
    seq = c[2].select_slider("sequence length", [2048, 4096, 8192, 16384, 32768, 65536, 131072], value=2048)
    cp = c[3].select_slider("cp", _divisors(GPUS // (tp * pp)), value=1)
    cp_impl = c[4].selectbox("cp implementation", ["ulysses", "ring"])
    ep_options = [e for e in _divisors(GPUS // (tp * pp * cp)) if experts and experts % e == 0] or [1]
    ep = c[5].select_slider("ep", ep_options, value=1)
    hierarchical = st.checkbox("hierarchical all_to_all (inside the node first)")
MODEL = ModelSpec(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=51200, experts=experts, top_k=top_k)
par = ParallelSpec(dp=GPUS // (tp * pp * cp), tp=tp, pp=pp, micro=micro, global_batch=GLOBAL, zero=zero,
                   recompute=recompute, virtual=virtual, ep=ep, cp=cp, cp_impl=cp_impl,
                   moe_hierarchical=hierarchical)
try:
    result = simulate(MODEL, spec, par)
except ValueError as exc:
    st.error(str(exc))
else:
    m = st.columns(5)
    m[0].metric("iteration (s)", f"{result.iteration_time_s:.3f}")
    m[1].metric("tokens/s", f"{result.tokens_per_s:,.0f}")
    m[2].metric("TFLOP/s per GPU", f"{result.tflops_per_gpu:.1f}")
    m[3].metric("MFU", f"{100 * result.mfu:.1f} %")
    m[4].metric("memory per GPU (GB)", f"{result.memory_per_gpu_gb:.1f}", "fits" if result.fits else "does not fit",
                delta_color="normal" if result.fits else "inverse")
    from tuning.sim_domain import prediction

    where = prediction(result.iteration_time_s, hardware=spec.name, framework=par.framework, tp=tp, pp=pp,
                       virtual=virtual, zero=zero, gpus=par.gpus, micro=micro, params=float(MODEL.params),
                       seq=MODEL.seq)
    near = "; ".join(f"{n['id']} ({n['error_pct']:+.1f}%)" for n in where["domain"]["nearest"])
    lo, hi = where["interval_s"]
    if where["domain"]["inside"]:
        st.caption(f"Inside the validated domain: measured time likely {lo:.3g}-{hi:.3g} s; nearest published rows: {near}")
    else:
        st.warning(f"Extrapolated: {'; '.join(where['domain']['reasons'])}. Measured time likely {lo:.3g}-{hi:.3g} s "
                   f"(interval widened); nearest published rows: {near}")
    left, right = st.columns(2)
    left.plotly_chart(plots.fig_sim_breakdown(result.breakdown), width="stretch")
    right.plotly_chart(plots.fig_sim_memory(result.memory_breakdown_gb, spec.memory_gb), width="stretch")

st.subheader("Search every configuration")
st.caption(f"{MODEL_KEY} ({MODEL.params / 1e9:.1f}B parameters) on {GPUS} GPUs of {CLUSTER}, "
           f"global batch {GLOBAL}: every valid tp, pp, dp, cp, ep, micro batch, ZeRO stage, recompute, schedule.")
if st.button("Search", type="primary", icon=":material/search:"):
    st.session_state["whatif_search"] = (MODEL_KEY, CLUSTER, GPUS, GLOBAL, experts, top_k, seq)
key = st.session_state.get("whatif_search")
if key is None:
    st.info("Press **Search** to price every configuration of this model and cluster.")
else:
    df = search(*key)
    fits = int(df["fits"].sum())
    st.write(f"{len(df):,} valid configurations, {fits:,} fit in memory ({key[0]}, {key[1]}, {key[2]} GPUs).")
    st.plotly_chart(plots.fig_search_scatter(df), width="stretch")
    st.markdown("**Best configurations** (shortest iteration, fitting in memory)")
    st.dataframe(best_configs(df, 10), hide_index=True, width="stretch")
    for name, table in sensitivities(df).items():
        with st.expander(f"Sensitivity: {name.replace('_', ' ')}"):
            st.dataframe(table, hide_index=True, width="stretch")
