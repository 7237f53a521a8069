"""The Megatron-core (2024+) flavour of the simulator (issue 49): H100 runs of NeMo / Megatron-core priced from
what Transformer Engine's fused kernels move, tensor-parallel traffic under TE's userbuffers overlap, the
distributed optimizer's gathers under the forward, the attention kernel a run names, and a tokens/s metric
whose baseline counts FLOPs as the source does. Its three fitted terms are fitted on its own rows only."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tuning.sim.hardware import load_cluster
from tuning.sim.simulator import ModelSpec, ParallelSpec, simulate
from tuning.sim.spec import columns

H100 = load_cluster("dgx-h100")
LLAMA3_8B = ModelSpec(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, gated_mlp=True, seq=8192,
                      vocab=128256, tied_embeddings=False, learned_positions=False, biases=False, norm_params=1,
                      dropout=False, family="llama")


def _cols(par: ParallelSpec) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in columns(par).items()}


def test_fused_block_bytes_count_each_transformer_engine_kernel() -> None:
    """Forward per token: 2 norms (2h each), 2 residual adds (3h), rotary on q and k (2 (q + kv)), SwiGLU
    (read 2f, write f); backward 2 x 3h + 2 x 3h + rotary + 5f; x 2 bytes. Under sequence parallelism the
    norms and residuals run on s/t tokens, the rest on a tp shard."""
    from tuning.sim.compute import fused_block_bytes

    h, q, kv, f, tok = 4096, 4096, 1024, 14336, 8192
    fwd, bwd = fused_block_bytes(LLAMA3_8B, _cols(ParallelSpec(framework="megatron-core")))
    assert float(fwd) == 2 * tok * (10 * h + 2 * (q + kv) + 3 * f)
    assert float(bwd) == 2 * tok * (12 * h + 2 * (q + kv) + 5 * f)
    fwd4, _ = fused_block_bytes(LLAMA3_8B, _cols(ParallelSpec(tp=4, sequence_parallel=True, framework="megatron-core")))
    assert float(fwd4) == pytest.approx(float(fwd) / 4)
    gpt = dataclasses.replace(LLAMA3_8B, gated_mlp=False, learned_positions=True, ffn_hidden=4 * h, dropout=True)
    fwd_g, _ = fused_block_bytes(gpt, _cols(ParallelSpec(framework="megatron-core")))
    assert float(fwd_g) == tok * (2 * (10 * h + 2 * 4 * h) + 2 * h)  # GELU read f, write f; 1-byte dropout masks


def test_tp_comm_overlap_leaves_one_chunk_in_t_or_what_the_gemms_cannot_cover() -> None:
    from tuning.sim.tensor import tp_comm_time

    c = _cols(ParallelSpec(tp=8, sequence_parallel=True, tp_comm_overlap=True, framework="megatron-core"))
    total = tp_comm_time(LLAMA3_8B, H100, 8, c)  # no window: every byte exposed
    assert float(tp_comm_time(LLAMA3_8B, H100, 8, c, np.asarray(10.0))) == pytest.approx(float(total) / 8)
    assert float(tp_comm_time(LLAMA3_8B, H100, 8, c, np.asarray(0.25 * float(total)))) == pytest.approx(0.75 * float(total))
    plain = _cols(ParallelSpec(tp=8, sequence_parallel=True, framework="megatron-core"))
    assert float(tp_comm_time(LLAMA3_8B, H100, 8, plain, np.asarray(10.0))) == pytest.approx(float(total))
    par = ParallelSpec(tp=8, sequence_parallel=True, global_batch=8, flash_attention=True, framework="megatron-core")
    on = simulate(LLAMA3_8B, H100, dataclasses.replace(par, tp_comm_overlap=True))
    off = simulate(LLAMA3_8B, H100, par)
    assert on.breakdown["tp_comm"] == pytest.approx(off.breakdown["tp_comm"] / 8)


def test_megatron_core_gathers_the_updated_shards_under_the_next_forward() -> None:
    """--overlap-param-gather: the distributed optimizer's all-gather hides under the first forward, one bucket
    exposed; Megatron-LM 2021 (`megatron`) gathers after the step, exposed."""
    par = ParallelSpec(dp=64, zero=1, global_batch=64, flash_attention=True)
    core = simulate(LLAMA3_8B, H100, dataclasses.replace(par, framework="megatron-core"))
    old = simulate(LLAMA3_8B, H100, dataclasses.replace(par, framework="megatron"))
    assert core.breakdown["dp_comm_exposed"] < 0.5 * old.breakdown["dp_comm_exposed"]
    # the same bytes; the buckets differ: torch DDP's 25 MB against megatron-core's max(40M, 1M x dp) = 64M elements,
    # each reduce-scatter paying the link's alpha (tuning.sim.framework.Framework.bucket_elems)
    grads = LLAMA3_8B.params * 2  # tp = pp = 1: every parameter on every rank
    buckets = grads / 25e6 - grads / (64e6 * 2)
    assert old.dp_comm_total_s - core.dp_comm_total_s == pytest.approx(buckets * H100.inter_latency_s, rel=1e-6)


def test_a_run_names_its_attention_kernel() -> None:
    """NeMo runs with NVTE_FUSED_ATTN=0 call FlashAttention-2, whose H100 rates are below cuDNN's (FA3 paper)."""
    par = ParallelSpec(global_batch=1, flash_attention=True, framework="megatron-core")
    cudnn = simulate(LLAMA3_8B, H100, par)
    fa2 = simulate(LLAMA3_8B, H100, dataclasses.replace(par, attention_kernel="fa2"))
    assert fa2.iteration_time_s > cudnn.iteration_time_s
    assert simulate(LLAMA3_8B, H100, dataclasses.replace(par, attention_kernel="cudnn")).iteration_time_s \
        == pytest.approx(cudnn.iteration_time_s)
    with pytest.raises(ValueError, match="attention_kernel='fa3' must be one of"):
        columns(dataclasses.replace(par, attention_kernel="fa3"))


def test_tokens_rows_and_their_baseline() -> None:
    """A tokens/s row's baseline is the source's FLOPs per token at half the peak: value x 50 / its MFU."""
    from tuning.sim.published import held_out_rows, simulated_metric
    from tuning.sim.validation import baseline_metric

    row = next(r for r in held_out_rows() if r.id == "dgxc-l70-64")
    assert row.gpus == 64 and row.cp == 2 and row.framework == "megatron-core"
    assert baseline_metric(row.metric, 989e12, value=row.value, source_mfu=row.source_mfu) \
        == pytest.approx(row.value * 50.0 / 54.10)
    res = simulate(row.model(), H100, row.parallel())
    assert simulated_metric(row) == pytest.approx(res.tokens_per_s / 64)


def test_megatron_core_terms_are_fitted_on_its_own_rows() -> None:
    from tuning.sim.fit import FITTED_TERMS, fitted_rows

    mine = [t for t in FITTED_TERMS if t.startswith("megatron-core.")]
    assert mine == ["megatron-core.layer_microbatch_s", "megatron-core.elementwise_traffic", "megatron-core.microbatch_s"]
    rows = fitted_rows()["framework megatron-core"]
    assert len(rows) == 49 and all(r.startswith(("dgxc-", "mcore-")) for r in rows)
    assert not any(r.startswith(("dgxc-", "mcore-")) for r in fitted_rows()["framework megatron"])
