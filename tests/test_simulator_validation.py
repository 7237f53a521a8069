"""The simulator against published measurements (issue 38): every cited row priced or excluded, fits that
read only calibration rows, ranking per table, memory facts, the domain of validity, and the shapes read
from a Hugging Face config (issue 37). No timing is measured here: the published figures are data."""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import yaml

from tuning.sim.hardware import PRESETS, load_cluster
from tuning.sim.published import DATA, calibration_rows, held_out_rows, memory_facts, sources, validation_table
from tuning.sim.simulator import ModelSpec, ParallelSpec, simulate

# the published configs' shape fields (meta-llama/Meta-Llama-3-8B and -70B config.json)
LLAMA3_8B = dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                 max_position_embeddings=8192)
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, intermediate_size=28672)


@pytest.fixture(scope="module")
def table():
    return validation_table()


# ---------------------------------------------------------------- the data

def test_every_row_of_every_cited_table_is_priced_or_excluded() -> None:
    data = yaml.safe_load(DATA.read_text())
    for key, src in data["sources"].items():
        rows = sum(r["source"] == key for r in data["rows"])
        excluded = sum(e["count"] for e in src["excluded"])
        assert rows + excluded == src["rows_in_source"], key
        assert all(e["reason"] for e in src["excluded"]), key
    # the MosaicML README's tables, counted there (scripts/train/benchmarking/README.md): no row left out
    counts = {k: data["sources"][k]["rows_in_source"] for k in data["sources"] if k.startswith("mosaicml")}
    assert counts == {"mosaicml-a100-80": 61, "mosaicml-a100-40": 78, "mosaicml-h100-80": 52,
                      "mosaicml-h100-large": 18, "mosaicml-h100-fp8": 7}
    oom = [r for r in data["rows"] if r.get("oom")]
    assert len(oom) == 3 and all("value" not in r for r in oom)


def _table_rows(text: str) -> int:
    """Data rows of the markdown tables in `text`: not a header (the line above a separator), not a
    separator, not an empty row."""
    import re

    lines = [line.strip() for line in text.splitlines()]
    cells = [[c.strip() for c in line.strip("|").split("|")] if line.startswith("|") else None for line in lines]
    sep = [c is not None and any(c) and all(re.fullmatch(r":?-+:?", x) for x in c if x) for c in cells]
    return sum(1 for i, c in enumerate(cells)
               if c is not None and any(c) and not sep[i] and not (i + 1 < len(cells) and sep[i + 1]))


def test_rows_in_source_is_the_count_of_the_stored_transcription() -> None:
    """Issue 48 item 4: `rows_in_source` was typed by hand (BLOOM 02-21 listed 12 of its section's 17
    rows); each source's tables are transcribed in tuning/data/sources/<source>.md and counted here."""
    data = yaml.safe_load(DATA.read_text())
    folder = DATA.parent / "sources"
    counted = {key: _table_rows((folder / f"{key}.md").read_text()) for key in data["sources"]}
    assert counted == {key: src["rows_in_source"] for key, src in data["sources"].items()}
    assert counted["bloom-0221"] == 17 and _table_rows("| a |\n| - |\n| 1 |\n|   |\n| 2 |\n") == 2
    # issue 63 item 5: the count alone checks the transcription against itself; each priced row's published
    # figure must also be read off its source's verbatim text (a tokens/s-per-GPU row: the table's tokens/s
    # over the row's GPUs, to the 0.1 the row keeps), so a mistyped or misattributed row fails
    untraced = [r["id"] for r in data["rows"] if "value" in r
                and not _traced(r, (folder / f"{r['source']}.md").read_text())]
    assert not untraced, untraced
    typo = next(r for r in data["rows"] if r["id"] == "bloom-0225-72x14336-dp8tp8pp6-mb4-b1568")
    assert not _traced({**typo, "value": typo["value"] + 0.01}, (folder / "bloom-0225.md").read_text())


def _traced(row: dict, text: str) -> bool:
    """Whether the row's `value` is a number of its source's transcription (for tokens_per_s_per_gpu, or a
    number that over the row's GPUs rounds to it: a table of tokens/s for the job)."""
    import re

    numbers = {float(m.replace(",", "")) for m in re.findall(r"\d[\d,]*(?:\.\d+)?", text)}
    if row["value"] in numbers:
        return True
    gpus = row.get("dp", 1) * row.get("tp", 1) * row.get("pp", 1) * row.get("cp", 1)
    return row["metric"] == "tokens_per_s_per_gpu" and any(abs(n / gpus - row["value"]) <= 0.05 + 1e-9
                                                           for n in numbers)


def test_leave_one_source_out_fits_never_read_the_left_out_source(tmp_path) -> None:
    from tuning.sim.fit import fit_frameworks

    data = yaml.safe_load(DATA.read_text())
    for row in data["rows"]:
        if row["source"] == "bloom-0225" and "value" in row:
            row["value"] = row["value"] * 3.0  # garbage in every row of the left-out source
            row["layers"] = 1
    garbled = tmp_path / "published.yaml"
    garbled.write_text(yaml.safe_dump(data))
    kept = fit_frameworks(exclude_source="bloom-0225", zooms=2, only=("deepspeed",))
    assert fit_frameworks(garbled, exclude_source="bloom-0225", zooms=2, only=("deepspeed",)) == kept
    assert fit_frameworks(garbled, zooms=2, only=("deepspeed",)) != kept  # the rows do count when not left out


def test_framework_terms_are_the_fit_on_every_source_and_no_kernel_rate_is_fitted() -> None:
    from tuning.sim.fit import FITTED_TERMS, fit_terms
    from tuning.sim.framework import FRAMEWORKS

    fitted = fit_terms()
    # every term the code calls fitted is moved by some published row and fitted on it (issue 63 item 5: the
    # old check walked the fit's own output, so a term the fit left out was never compared)
    assert set(fitted) == set(FITTED_TERMS), set(FITTED_TERMS) ^ set(fitted)
    for name, value in fitted.items():
        flavour, field = name.split(".")
        assert getattr(FRAMEWORKS[flavour], field) == pytest.approx(value, rel=0.01, abs=1e-6), name
    # a small, named set, every one a framework's term: no GEMM, attention or bandwidth rate of a GPU
    assert len(FITTED_TERMS) == 15 and all(t.split(".")[0] in FRAMEWORKS for t in FITTED_TERMS)
    for preset in ("dgx-a100-80gb", "dgx-a100-40gb", "dgx-h100", "frontier", "jean-zay-a100"):
        cluster = PRESETS[preset]
        assert cluster.kernels and cluster.attention_max_efficiency == 0.0 and not cluster.gemm_table


def test_kernel_rates_are_the_cited_measurements() -> None:
    from tuning.sim.kernels import KERNELS, gemm_seconds, gpu_facts, quantisation

    facts = yaml.safe_load(KERNELS.read_text())
    assert all(src.get("paper") and src.get("where") for src in facts["sources"].values())
    h100 = gpu_facts("h100-published")  # the presets price with "h100", this project's H100 (test_calibrate_gpu.py)
    # the FlashAttention-3 paper's cuDNN bars at 2k (head dim 128): forward 617, backward 465 TFLOP/s
    cudnn = h100.attention["cudnn"]
    assert cudnn.rate(128, False, "fwd", 2048) == pytest.approx(617e12)
    assert cudnn.rate(128, False, "bwd", 2048) == pytest.approx(465e12)
    # a large, well-shaped GEMM runs near MAMF (80.1% of 989); one tile more than a wave costs a wave
    big = 2 * 16384 * 8192 * 8192 / gemm_seconds(h100, 989e12, 16384, 8192, 8192) / 989e12
    assert 0.78 < big <= 0.801
    assert quantisation(h100, 128 * 133, 128) == pytest.approx(133 / 264)  # 133 tiles: 2 waves of 132
    # a few-token GEMM is memory-bound: it streams its weights at the measured bandwidth
    small = gemm_seconds(h100, 989e12, 8, 8192, 8192)
    assert small == pytest.approx(2 * (8 * 8192 + 8192 * 8192 + 8 * 8192) / (h100.hbm_gb_s * 1e9))


def test_a_gpu_like_one_that_is_like_another_takes_both(tmp_path) -> None:
    """kernels.yaml's `like` chains: a kind like one that is itself like another takes the fields of both,
    the nearer overriding (before, only one level was followed and the farther kind's fields were lost)."""
    import yaml

    from tuning.sim.kernels import gpu_facts

    gpus = {"base": {"sms": 108, "gemm_efficiency": 0.8, "tiles": [[128, 128]], "hbm_gb_s": 1500.0},
            "mid": {"like": "base", "hbm_gb_s": 2000.0}, "top": {"like": "mid", "sms": 132}}
    path = tmp_path / "kernels.yaml"
    path.write_text(yaml.safe_dump({"gpus": gpus}))
    top = gpu_facts("top", str(path))
    assert (top.sms, top.gemm_efficiency, top.hbm_gb_s, top.tiles) == (132, 0.8, 2000.0, ((128, 128),))


def test_triton_attention_is_the_flashattention2_papers_a100_bars() -> None:
    """Triton FlashAttention (llm-foundry's attn_impl 'triton') at the FlashAttention-2 paper's Figure 4 rates:
    forward + backward together take the figure's time (3.5 x the forward's work at the bar's TFLOP/s), split
    by FlashAttention-2's backward / forward ratio; on H100 the v1 bars scaled by Triton / v1 on A100."""
    from tuning.sim.kernels import gpu_facts

    def fwd_bwd(table, hd, causal, seq):  # TFLOP/s of the pair, FlashAttention's convention
        return 3.5 / (1 / table.rate(hd, causal, "fwd", seq) + 2.5 / table.rate(hd, causal, "bwd", seq)) / 1e12

    a100 = gpu_facts("a100").attention["triton"]
    for hd, causal, seq, bar in ((64, False, 1024, 102), (64, True, 2048, 79), (128, False, 16384, 95),
                                 (128, True, 512, 50)):
        assert fwd_bwd(a100, hd, causal, seq) == pytest.approx(bar), (hd, causal, seq)
    assert gpu_facts("a100-40").attention["triton"] is not None  # the 40 GB part is like the 80 GB one
    h100 = gpu_facts("h100").attention["triton"]
    assert fwd_bwd(h100, 128, True, 8192) == pytest.approx(round(135 * 78 / 80), abs=0.5)  # v1 H100 x Triton / v1 A100
    # slower than FlashAttention-2 on either GPU (the paper's point), faster than nothing fused
    for gpu in ("a100", "h100"):
        fa2 = gpu_facts(gpu).attention["fa2"]
        triton = gpu_facts(gpu).attention["triton"]
        assert fwd_bwd(triton, 128, True, 4096) < 0.75 * fwd_bwd(fa2, 128, True, 4096)


def test_mosaicml_rows_name_the_attention_kernel_their_script_ran() -> None:
    """The 2023 MosaicML tables ran submit_benchmarks.py's default attn_impl 'triton'; the 2024 large-scale
    H100 table what its commit's sweep.py passes model by model: 'flash' (FlashAttention-2, "" = the
    framework's kernel) for 1b, 3b, 7b and 70b, 'triton' for 13b and 30b."""
    kernels: dict[str, set[str]] = {}
    for r in calibration_rows() + held_out_rows():
        if r.source.startswith("mosaicml-"):
            key = r.source if r.source != "mosaicml-h100-large" else f"{r.source} {r.row.split(',')[0]}"
            kernels.setdefault(key, set()).add(r.attention)
    large = {f"mosaicml-h100-large {m}": {"" if m in ("1b", "3b", "7b", "70b") else "triton"}
             for m in ("1b", "3b", "7b", "13b", "30b", "70b")}
    # the FP8 table is the 2023 README's too (submit_benchmarks.py's default attn_impl)
    assert kernels == {"mosaicml-a100-80": {"triton"}, "mosaicml-a100-40": {"triton"}, "mosaicml-h100-80": {"triton"},
                       "mosaicml-h100-fp8": {"triton"}, **large}
    # llm-foundry's flash_attn_fn runs FlashAttention-2's varlen kernel behind bert_padding; Triton gets the tensors
    unpadded = {r.id for r in calibration_rows() + held_out_rows() if r.attention_unpad}
    assert unpadded == {r.id for r in held_out_rows() if r.source == "mosaicml-h100-large" and r.attention == ""}
    assert len(unpadded) == 12


def test_unpadding_moves_the_bytes_bert_padding_moves() -> None:
    """flash-attn's bert_padding around the varlen kernel, counted by hand for MPT-1B's layer (d 2048, MHA,
    12 x 2048 tokens, bf16): forward, three gathers (read + write q, k, v) and pad_input's zeros, read and
    write of the output, 9 x 2048 elements a token; backward, the output gradient's gather and three
    zero-filled scatters, 11 x 2048. Grouped-query k and v count their own width; nothing without unpadding."""
    from tuning.sim.compute import unpad_bytes
    from tuning.sim.spec import columns

    mpt1b = ModelSpec(layers=24, hidden=2048, heads=16, seq=2048, vocab=50368)
    par = ParallelSpec(dp=128, micro=12, global_batch=1536, zero=2, flash_attention=True, framework="fsdp",
                       attention_unpad=True)
    fwd, bwd = unpad_bytes(mpt1b, columns(par))
    assert float(fwd) == 12 * 2048 * 2 * 9 * 2048 == 905_969_664
    assert float(bwd) == 12 * 2048 * 2 * 11 * 2048
    gqa = dataclasses.replace(mpt1b, kv_heads=4)  # k and v 512 wide
    fwd, bwd = unpad_bytes(gqa, columns(dataclasses.replace(par, tp=2, dp=64)))
    assert float(fwd) == 12 * 2048 * 2 * (5 * 2048 + 4 * 512) / 2
    assert float(bwd) == 12 * 2048 * 2 * (5 * 2048 + 6 * 512) / 2
    assert float(unpad_bytes(mpt1b, columns(dataclasses.replace(par, attention_unpad=False)))[0]) == 0.0
    # the same layout runs slower unpadded, and unpadding without a fused kernel is refused in one line
    cl = load_cluster("dgx-h100")
    assert simulate(mpt1b, cl, par).iteration_time_s > simulate(mpt1b, cl, dataclasses.replace(
        par, attention_unpad=False)).iteration_time_s
    with pytest.raises(ValueError, match="attention_unpad=True needs parallel.flash_attention=True"):
        simulate(mpt1b, cl, dataclasses.replace(par, flash_attention=False))


def test_megatron_lms_unfused_loss_moves_the_bytes_its_code_moves() -> None:
    """Megatron's vocab_parallel_cross_entropy without --cross-entropy-loss-fusion (store_true in Megatron-LM's
    arguments.py: off unless passed), per logit: forward .float() (2 + 4), max (4), subtract in place (4 + 4),
    exp in place (4 + 4), sum (4), divide in place (4 + 4) = 38 bytes; backward multiply in place (4 + 4) and
    the cast back to bf16 (4 + 2) = 14; against the fused 24. The Megatron-LM README rows (mcore-*) ran it so;
    the DGX Cloud recipes that set cross_entropy_loss_fusion: true (Llama 3.1, Nemotron-4) do not."""
    from tuning.sim.kernels import memory_bandwidth

    model = ModelSpec(layers=2, hidden=2048, heads=16, seq=4096, vocab=131072)
    cl = load_cluster("dgx-h100")
    par = ParallelSpec(micro=1, global_batch=2, framework="megatron-core", flash_attention=True)
    fused, unfused = (simulate(model, cl, dataclasses.replace(par, unfused_loss=u)).breakdown["compute"]
                      for u in (False, True))
    assert unfused - fused == pytest.approx(2 * (38 + 14 - 24) * 4096 * 131072 / memory_bandwidth(cl), rel=1e-9)
    rows = {r.id: r for r in calibration_rows() + held_out_rows()}
    assert {i for i, r in rows.items() if r.unfused_loss} == {
        "mcore-h100-1.7b", "mcore-h100-7.1b", "mcore-h100-16b", "mcore-h100-32b", "mcore-moe-mixtral-8x7b"}


# The MPT models' parameter counts as the benchmark tables give them (NumParams column; one value per model
# and sequence length, the learned position table being s x d): mosaicml/llm-foundry@8c8dd48f
# scripts/train/benchmarking/README.md
MPT_NUM_PARAMS = {
    "125m": {512: 124131840, 1024: 124525056, 2048: 125311488, 4096: 126884352, 8192: 130030080,
             16384: 136321536, 32768: 148904448, 65536: 174070272},
    "350m": {512: 354412544, 1024: 354936832, 2048: 355985408, 4096: 358082560, 8192: 362276864,
             16384: 370665472, 32768: 387442688, 65536: 420997120},
    "760m": {512: 758111232, 1024: 758897664, 2048: 760470528, 4096: 763616256, 8192: 769907712,
             16384: 782490624, 32768: 807656448, 65536: 857988096},
    "1b": {512: 1312804864, 1024: 1313853440, 2048: 1315950592, 4096: 1320144896, 8192: 1328533504,
           16384: 1345310720, 32768: 1378865152, 65536: 1445974016},
    "3b": {512: 2647905280, 1024: 2649216000, 2048: 2651837440, 4096: 2657080320, 8192: 2667566080,
           16384: 2688537600, 32768: 2730480640, 65536: 2814366720},
    "7b": {512: 6652567552, 1024: 6654664704, 2048: 6658859008, 4096: 6667247616, 8192: 6684024832,
           16384: 6717579264, 32768: 6784688128, 65536: 6918905856},
    "13b": {512: 12846090240, 1024: 12848711680, 2048: 12853954560, 4096: 12864440320, 8192: 12885411840,
            16384: 12927354880, 32768: 13011240960},
    "30b": {512: 29964204032, 1024: 29967874048, 2048: 29975214080, 4096: 29989894144, 8192: 30019254272},
    "70b": {2048: 64862437376},
}


def test_mosaicml_rows_count_the_parameters_their_tables_give() -> None:
    """MPT keeps MPTConfig's defaults the benchmark yamls leave alone: biases on every linear layer and norm
    and a learned position table (no_bias False, learned_pos_emb True, no ALiBi). Every MosaicML row's
    shape counts what its table's NumParams column says, to the parameter."""
    rows = [r for r in calibration_rows() + held_out_rows() if r.source.startswith("mosaicml-")]
    assert len(rows) > 200
    counted = {(r.row.split(",")[0], r.seq): r.model().params for r in rows}
    assert counted == {key: MPT_NUM_PARAMS[key[0]][key[1]] for key in counted}


def test_a_term_no_row_informs_takes_its_documented_default() -> None:
    """Issue 63 item 1: without Narayanan et al.'s Table 2 no DeepSpeed row is ZeRO-3, so no row left moves
    with its ZeRO-3 terms: the fit returns each at the Framework dataclass default, not the shipped value
    fitted on that table; with every source the same terms are fitted, away from their defaults."""
    from tuning.sim.fit import FRAMEWORK_FITS, fit_frameworks, fit_rows, informed, term_defaults, with_terms
    from tuning.sim.framework import Framework

    zero3 = ("deepspeed.zero3_bw_efficiency", "deepspeed.overlap_interference")
    defaults = {f.name: f.default for f in dataclasses.fields(Framework)}
    without = fit_frameworks(exclude_source="narayanan2021-t2", zooms=2, only=("deepspeed",))
    assert {k: without[k] for k in zero3} == {k: defaults[k.split(".")[1]] for k in zero3} == {k: term_defaults()[k]
                                                                                               for k in zero3}
    assert without["deepspeed.layer_microbatch_s"] != defaults["layer_microbatch_s"]  # the rest is fitted
    every = fit_frameworks(zooms=2, only=("deepspeed",))
    assert all(every[k] != defaults[k.split(".")[1]] for k in zero3), every
    # what decides it is whether a row's metric moves with the term, not a list of field names
    rows = fit_rows()
    base, clusters = with_terms(term_defaults()), {r.cluster: load_cluster(r.cluster) for r in rows}
    params = FRAMEWORK_FITS["deepspeed"]
    names = lambda rs: {p.name for p in informed(rs, params, clusters=clusters, frameworks=base)}  # noqa: E731
    zero1 = [r for r in rows if r.source == "bloom-0225"]
    assert not names(zero1) & set(zero3) and "deepspeed.layer_microbatch_s" in names(zero1)
    assert names([r for r in rows if r.id == "nar-t2-zero3-175b-384"]) >= set(zero3)


def test_leave_one_source_out_prices_a_source_with_nothing_fitted_on_it(tmp_path, monkeypatch) -> None:
    """Issue 63 item 1: the leave-one-source-out walk priced Narayanan et al.'s Table 2 ZeRO-3 rows with the
    shipped DeepSpeed ZeRO-3 terms (0.1056, 0.3714), fitted on those six rows alone. On a published file of
    that table and BLOOM's 02-25 (ZeRO-1) table, the walk prices them with the ZeRO-3 terms at their
    documented defaults and the other DeepSpeed terms fitted on 02-25; the Megatron rows, with no Megatron
    row left, at Megatron's defaults."""
    from tuning.sim.fit import FRAMEWORK_FITS, fit_frameworks, row_metric, with_terms
    from tuning.sim.framework import FRAMEWORKS, Framework
    from tuning.sim.validation import loso

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = yaml.safe_load(DATA.read_text())
    kept = ("narayanan2021-t2", "bloom-0225")
    data["sources"] = {k: v for k, v in data["sources"].items() if k in kept}
    data["rows"] = [r for r in data["rows"] if r["source"] in kept]
    path = tmp_path / "published.yaml"
    path.write_text(yaml.safe_dump(data))
    table = loso(path, zooms=2).set_index("id")
    defaults = {f.name: f.default for f in dataclasses.fields(Framework)}
    fitted = fit_frameworks(path, exclude_source="narayanan2021-t2", zooms=2, only=("deepspeed",))
    expected = with_terms({**fitted, "deepspeed.zero3_bw_efficiency": defaults["zero3_bw_efficiency"],
                           "deepspeed.overlap_interference": defaults["overlap_interference"],
                           **{p.name: defaults[p.name.split(".")[1]] for p in FRAMEWORK_FITS["megatron"]}})
    t2 = [r for r in calibration_rows(path) + held_out_rows(path) if r.source == "narayanan2021-t2"]
    assert len(t2) == 12
    for r in t2:
        priced = float(np.asarray(row_metric(r, load_cluster(r.cluster), expected)).reshape(-1)[0])
        shipped = float(np.asarray(row_metric(r, load_cluster(r.cluster), FRAMEWORKS)).reshape(-1)[0])
        assert table.loc[r.id, "loso"] == pytest.approx(priced, rel=1e-9), r.id
        assert abs(priced / shipped - 1.0) > 0.01, r.id  # the shipped terms price it otherwise
    zero3_rows = table.loc[[r.id for r in t2 if r.zero == 3]]
    assert set(zero3_rows["terms_at_default"]) == {"deepspeed.zero3_bw_efficiency deepspeed.overlap_interference"}


# Sources whose leave-one-source-out median is over 10% or not under the flat baseline's, each with its cause
# (issue 63: listed, not tuned away; every other source is held to both bounds)
LOSO_EXCEPTIONS = {
    # its six ZeRO-3 rows are the only DeepSpeed ZeRO-3 rows: left out, zero3_bw_efficiency and
    # overlap_interference have no row to be fitted on and take their defaults (1.0, 0.0), which price
    # ZeRO-3's per-parameter gathers at the link's full bus bandwidth with no cost to the compute under them:
    # 40-351% too fast (median 25.9% over the table's 12 rows, baseline 9.7%); with the shipped terms, fitted
    # on these rows, it read 5.9%
    "narayanan2021-t2": "no other DeepSpeed ZeRO-3 row: its ZeRO-3 terms at their defaults",
    # issue 62: llm-foundry's amp_fp8 table, never fitted on (tests/test_sim_fp8.py): 12.0% against the flat
    # baseline's 17.3%, too slow at 8k-32k tokens (-12 to -20%) where its attention kernel is not published
    "mosaicml-h100-fp8": "FP8 rows priced from kernel facts only; 12.0% median, under its baseline's 17.3%",
}


def test_every_source_leave_one_source_out_beside_the_baseline() -> None:
    """Issue 49's done-when: every source's leave-one-source-out median <= 10% and below the flat-MFU
    baseline's. With the published H100 kernel facts (h100-published) in place of this project's calibrated
    H100, NeMo's GPT-3 175B was at 2.6% against the baseline's 1.3% and Nemotron-4 15B at 10.8%; with the
    calibration, Megatron-core's H100 weak-scaling table was at 7.9% against its baseline's 6.9% until its
    loss was priced as Megatron-LM runs it unfused (6.4%). MosaicML's A100 40GB table, at 9.8% against the
    baseline's 7.5% while priced with FlashAttention-2's rates, is under 5% with the Triton kernel it ran.
    MosaicML's H100 large-scale table: 12.7% while its 13b and 30b rows were priced with FlashAttention-2
    though its sweep ran them on Triton, 11.7% before llm-foundry's unpadding around FlashAttention-2 was
    priced, 17.7% before its fp32 gradient reduce-scatters, 14.1% before the slowest GPU."""
    from tuning.sim.validation import baseline_metric, loso, loso_by_source

    assert baseline_metric("mfu", 989e12) == 50.0 and baseline_metric("tflops_per_gpu", 312e12) == 156.0
    rows = loso()
    per = loso_by_source(validation_table(), rows, sources()).set_index("source")
    priced = per[per["rows"] > 0]
    assert set(priced.index) >= {"narayanan2021-t1", "mosaicml-h100-80", "bloom-0221", "smith2022-mtnlg",
                                 "dgxc-llama31-8b", "dgxc-llama31-70b", "dgxc-grok1-314b", "mcore-moe-mixtral"}
    missed = priced[(priced["loso_median_pct"] > 10.0) | ~priced["beats_baseline"].astype(bool)]
    assert set(missed.index) == set(LOSO_EXCEPTIONS), missed
    held = rows[rows["source"] == "narayanan2021-t2"].fillna({"terms_at_default": ""})
    zero3 = held[held["id"].str.startswith("nar-t2-zero3")]
    assert set(zero3["terms_at_default"]) == {"deepspeed.zero3_bw_efficiency deepspeed.overlap_interference"}
    assert (held["terms_at_default"] != "").sum() == 6  # the cause named above: the ZeRO-3 rows alone
    # issue 63 item 3: no source is pinned to the error its knobs reached; each is held to the bounds above
    assert per.loc["bloom-0225", "spearman"] >= 0.8 and per.loc["bloom-0225", "top1_regret"] <= 0.05
    # the H100 Megatron-class tables, 1.2-2x too slow with the 2021 Megatron-LM terms, within 10% out of sample
    h100 = priced[priced.index.str.startswith(("dgxc-", "mcore-"))]
    assert len(h100) == 9 and h100["loso_median_pct"].median() < 8.0


# Leave-one-family-out misses (issue 63 item 2), each with its cause: listed, not tuned away; every other source and
# family is held to <= 10% and under the flat baseline's median
LOFO_SOURCE_EXCEPTIONS = {
    # the Megatron-LM 2021 flavour's only priced rows are this paper's: left out with Table 2, its terms take their
    # defaults (no fixed cost per layer, fused kernels' bytes): Table 1 priced 23% too fast against 10.6
    "narayanan2021-t1": "no megatron row outside the paper: megatron terms at their defaults",
    "narayanan2021-t2": "megatron terms and DeepSpeed's ZeRO-3 terms at their defaults (LOSO_EXCEPTIONS)",
    # every FSDP row priced is MosaicML's: the family out, all four fsdp terms take their defaults (no fixed cost,
    # ZeRO-3 gathers at the link's full bandwidth with no interference): 10.8-18.2% against 7.5-25.7
    "mosaicml-a100-80": "no fsdp row outside MosaicML's README: fsdp terms at their defaults",
    "mosaicml-a100-40": "no fsdp row outside MosaicML's README: fsdp terms at their defaults",
    "mosaicml-h100-80": "no fsdp row outside MosaicML's README: fsdp terms at their defaults",
    "mosaicml-h100-large": "no fsdp row outside MosaicML's README: fsdp terms at their defaults",
    "mosaicml-h100-fp8": "no fsdp row outside MosaicML's README: fsdp terms at their defaults",
    # without BLOOM's log DeepSpeed's terms are fitted on Narayanan's six ZeRO-3 rows and MT-NLG's three: their
    # fixed costs and ZeRO-1 bandwidth share price the Jean Zay runs too slow: 02-23 20.1% against 20.2, 02-25 17.0
    # against 16.4 (02-21 at 9.99% against 19.7 since NCCL's cost model and the recomputed forward's fixed cost)
    "bloom-0223": "DeepSpeed fitted on ZeRO-3 and MT-NLG rows only: too slow",
    "bloom-0225": "DeepSpeed fitted on ZeRO-3 and MT-NLG rows only: too slow",
    # the recipe ran at the baseline's own 50% MFU (baseline 1.3% off): 1.4% without the dgxc family, 0.2% LOSO
    "dgxc-gpt3-175b": "the baseline is exact here (its run's MFU is 50%)",
}
LOFO_FAMILY_EXCEPTIONS = {
    "narayanan2021": "no megatron row left: megatron terms at their defaults (22.3% against 10.2)",
    "mosaicml": "no fsdp row left: fsdp terms at their defaults (12.2% against 12.3)",
    "bigscience": "DeepSpeed fitted on ZeRO-3 and MT-NLG rows only (17.7% against 18.8)",
}


def test_families_group_the_tables_of_one_file_and_every_family_is_cited() -> None:
    """A family is the tables of one campaign, repository or report: every member is a cited source, no source is
    in two, and sources whose `where` is one file of one repository (MosaicML's README, BigScience's log) share
    one."""
    import re
    from collections import Counter

    from tuning.sim.validation import FAMILIES, family_of

    cited = sources()
    members = [key for keys in FAMILIES.values() for key in keys]
    assert set(members) <= set(cited) and max(Counter(members).values()) == 1
    files: dict[tuple[str, str], set[str]] = {}
    for key, src in cited.items():
        where = re.match(r"\s*([\w.-]+/[\w.-]+)(?:@\w+)?(?: \([^)]*\))?:([\w./-]+)", str(src["where"]))
        if where:
            files.setdefault(where.groups(), set()).add(family_of(key))
    assert files and all(len(f) == 1 for f in files.values()), files
    assert family_of("bloom-0223") == family_of("bloom-0225") == "bigscience" and family_of("llama3-t4") == "llama3-t4"


def test_every_source_and_family_leave_one_family_out_beside_the_baseline() -> None:
    """Issue 63 item 2: each family's tables left out together (`lofo`); MosaicML's four tables then read 10.8 /
    12.2 / 12.8 / 18.2% (baselines 9.6 / 7.5 / 25.7 / 21.0), BigScience's three 11.5 / 20.7 / 18.2% (19.7 / 20.2 /
    16.4): the exceptions above, each with its cause."""
    from tuning.sim.validation import lofo_by_family, loso, loso_by_source

    rows, table = loso(), validation_table()
    assert (rows["lofo_error_pct"] == rows["loso_error_pct"])[~rows["family"].isin(
        ["narayanan2021", "mosaicml", "bigscience", "dgxc", "megatron-lm-readmes"])].all()  # a family of one
    per = loso_by_source(table, rows, sources()).set_index("source")
    priced = per[per["rows"] > 0]
    missed = priced[(priced["lofo_median_pct"] > 10.0) | ~priced["lofo_beats_baseline"].astype(bool)]
    assert set(missed.index) == set(LOFO_SOURCE_EXCEPTIONS) & set(priced.index), missed
    families = lofo_by_family(table, rows, sources()).set_index("family")
    missed = families[(families["lofo_median_pct"] > 10.0) | ~families["beats_baseline"].astype(bool)]
    assert set(missed.index) == set(LOFO_FAMILY_EXCEPTIONS), missed
    fsdp = rows[rows["family"] == "mosaicml"]["lofo_terms_at_default"].fillna("")
    assert fsdp.str.contains("fsdp.layer_microbatch_s").all()  # the cause named for MosaicML


# ---------------------------------------------------------------- ranking and errors

def test_ranking_metrics_by_hand() -> None:
    from tuning.sim.validation import spearman, top1_regret

    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # the simulator picks the row measured at 100 where the best measured 125: 25% more GPU time per sample
    assert top1_regret(published=[125, 100, 90], simulated=[1.0, 2.0, 0.5]) == pytest.approx(0.25)
    assert top1_regret(published=[125, 100, 90], simulated=[3.0, 2.0, 0.5]) == 0.0


def test_zero3_rows_fall_with_gpu_count_as_measured(table) -> None:
    from tuning.sim.validation import loso

    zero3 = table[table["id"].str.startswith("nar-t2-zero3")].merge(loso()[["id", "loso"]], on="id")
    for size in ("175b", "530b"):
        part = zero3[zero3["id"].str.contains(size)].sort_values("gpus")
        assert list(part["published"]) == sorted(part["published"], reverse=True)
        assert list(part["simulated"]) == sorted(part["simulated"], reverse=True)  # falls as measured
        assert list(part["loso"]) == sorted(part["loso"], reverse=True)  # also with ZeRO-3's terms at defaults
    # issue 38: each within 25% in sample. Out of sample no row informs ZeRO-3's terms (LOSO_EXCEPTIONS)
    assert (zero3["error_pct"].abs() <= 25.0).all(), zero3[["id", "error_pct"]]


def test_the_expected_slowest_gpu_is_the_order_statistic_of_its_spread() -> None:
    """E[max of n standard normals] against the exact values (Harter 1961's table: 0.5642 = 1/sqrt(pi) at 2,
    1.4236 at 8, 3.2414 at 1000), and the spread Sinha et al. publish: an 8% whisker span (4 IQR / median) is
    a standard deviation of 8 / (4 x 1.349) percent."""
    from tuning.sim.stragglers import GPU_SPEED_SD, expected_max_normal, slowest_gpu_factor

    assert expected_max_normal(1) == 0.0 and slowest_gpu_factor(1, GPU_SPEED_SD) == 0.0
    assert expected_max_normal(2) == pytest.approx(1.0 / np.sqrt(np.pi), rel=0.05)
    assert expected_max_normal(8) == pytest.approx(1.4236, rel=0.01)
    assert expected_max_normal(1000) == pytest.approx(3.2414, rel=0.01)
    assert GPU_SPEED_SD == pytest.approx(0.0148, abs=1e-4)
    assert PRESETS["dgx-h100"].gpu_speed_sd == GPU_SPEED_SD and PRESETS["dgx-a100-40gb"].gpu_speed_sd == GPU_SPEED_SD


def test_weak_scaling_slows_as_published_the_step_waits_for_its_slowest_gpu() -> None:
    """NeMo's Nemotron-4 15B recipe at the same work per GPU from 16 to 2,048 H100s: the published tokens/s
    per GPU fall 4.4% (5789 to 5535). The simulator had them flat (+0.4%: nothing it priced grew with the
    GPU count but hidden collectives); with every GPU waiting for the slowest of the job (Sinha et al.'s
    1.48% spread) they fall 2.0%, the larger job waiting longer; a cluster with no spread waits for none."""
    rows = {r.id: r for r in held_out_rows() + calibration_rows()}
    small, large = rows["dgxc-n15-16"], rows["dgxc-n15-2048"]
    pace = {r.id: simulate(r.model(), load_cluster(r.cluster), r.parallel()) for r in (small, large)}
    per_gpu = {k: v.tokens_per_s / rows[k].gpus for k, v in pace.items()}
    ratio = per_gpu[large.id] / per_gpu[small.id]
    assert large.value / small.value == pytest.approx(0.956, abs=0.001)
    assert ratio < 0.99, ratio
    assert 0 < pace[small.id].breakdown["straggler"] < pace[large.id].breakdown["straggler"]
    one = simulate(small.model(), dataclasses.replace(load_cluster(small.cluster), gpu_speed_sd=0.0), small.parallel())
    assert one.breakdown["straggler"] == 0.0


def test_memory_facts_trained_layouts_fit(table) -> None:
    from tuning.sim.validation import memory_check

    # every published row trained, so each must fit (Nemotron-4 340B on 128 H100 too: NeMo's distributed_fused_adam
    # with optim.dtype bf16 keeps 4 bytes of Adam state per parameter, tests/test_sim_memory.py)
    # but NeMo 24.07's FP8 rows whose settings are assumed (tests/test_sim_memory.py KNOWN says why)
    from tests.test_sim_memory import KNOWN

    assert set(table.loc[~table["fits"], "id"]) <= set(KNOWN), table.loc[~table["fits"], "id"]
    facts = memory_check(memory_facts())
    trained, oom = facts[~facts["oom"]], facts[facts["oom"]]
    assert trained["fits"].all() and len(oom) == 3 and (~oom["fits"]).sum() >= 2
    # nvidia-smi's peak includes the allocator's cache, which DeepSpeed's fitted allocator_reserve prices: the
    # prediction is centred on the readings (tests/test_sim_memory.py fits it without each table in turn).
    # The 02-25 table lists DP 8 TP 4 PP 12 MBS 2 twice, "44GB" and "38GB" (a snapshot, not a peak): the larger counts
    trained = trained[trained["id"] != "bloom-0225-72x14336-dp8tp4pp12-mb2-b2048-2"]
    # 02-21's 84 x 13824 DP 8 TP 8 PP 6 reads "65GB" at MBS 2 and "56GB" at MBS 4: the MBS 2 reading is off
    ratio = trained.set_index("id")["ratio"].dropna()
    assert len(ratio) >= 30 and abs(ratio.median() - 1.0) <= 0.03, ratio
    off = ratio[~ratio.between(0.9, 1.12)]
    assert list(off.index) == ["bloom-0221-84x13824-dp8tp8pp6-mb2-b2048"], off


# ---------------------------------------------------------------- domain of validity

def test_prediction_outside_the_validated_domain_is_flagged_and_wider() -> None:
    from tuning.sim.domain import prediction

    mpt7b = ModelSpec(layers=32, hidden=4096, heads=32, seq=2048, vocab=50368, biases=False, learned_positions=False)
    common = dict(hardware="dgx-a100-80gb", framework="fsdp", tp=1, pp=1, virtual=1, zero=3, micro=6,
                  params=float(mpt7b.params), seq=2048)
    inside = prediction(1.0, gpus=8, **common)
    far = prediction(1.0, gpus=4096, **common)  # the FSDP rows on A100 ran on 8-128 GPUs
    assert inside["domain"]["inside"] and not far["domain"]["inside"]
    assert any("GPUs 4,096 outside" in r for r in far["domain"]["reasons"]) and far["domain"]["nearest"]
    width = lambda p: p["interval_s"][1] - p["interval_s"][0]  # noqa: E731
    assert width(far) > width(inside) and "extrapolation" in far["interval_basis"]
    frontier = prediction(1.0, gpus=8, **{**common, "hardware": "frontier"})
    assert not frontier["domain"]["inside"] and "hardware frontier has no validated row" in frontier["domain"]["reasons"]
    assert width(frontier) > width(inside)


def test_every_frontier_prediction_is_extrapolated() -> None:
    from tuning.search import add_uncertainty, enumerate_configs

    df = add_uncertainty(enumerate_configs(ModelSpec(layers=48, hidden=6144, heads=64, seq=2048, vocab=51200),
                                           load_cluster("frontier"), 64, 256), hardware="frontier")
    assert len(df) and df["extrapolated"].all()


# ---------------------------------------------------------------- shapes and attention

def test_fused_causal_attention_and_grouped_query_heads() -> None:
    a100 = load_cluster("dgx-a100-80gb")
    mha = ModelSpec(layers=4, hidden=4096, heads=32, seq=16384, vocab=32000, biases=False, learned_positions=False)
    gqa = ModelSpec(layers=4, hidden=4096, heads=32, kv_heads=4, seq=16384, vocab=32000, biases=False,
                    learned_positions=False)
    par = ParallelSpec(dp=8, zero=3, micro=1, global_batch=8, recompute="none", flash_attention=True)
    unfused = simulate(mha, a100, ParallelSpec(dp=8, zero=3, micro=1, global_batch=8, flash_attention=False))
    fused = simulate(mha, a100, par)
    # same reported FLOPs (the full s^2 convention), less compute time (masked blocks skipped)
    assert fused.model_flops_per_iteration == unfused.model_flops_per_iteration
    assert fused.breakdown["compute"] < unfused.breakdown["compute"]
    # grouped-query attention: smaller K/V activations, fewer parameters and FLOPs, less ring traffic
    assert simulate(gqa, a100, par).memory_breakdown_gb["activations"] < fused.memory_breakdown_gb["activations"]
    assert gqa.params < mha.params and gqa.layer_matmul_params < mha.layer_matmul_params
    slow = dataclasses.replace(a100, intra_bw_gb_s=1.0)  # a slow link: the ring's sends show
    ring = ParallelSpec(cp=4, cp_impl="ring", micro=1, global_batch=4, flash_attention=True)
    assert simulate(gqa, slow, ring).breakdown["cp_comm"] < simulate(mha, slow, ring).breakdown["cp_comm"]


def test_llama3_long_context_row_per_gpu_as_published() -> None:
    """Llama 3 Table 4 at 16,384 H100: 8,192 tokens (tp8 pp16 dp128) 400 TFLOP/s, 131,072 tokens (tp8 cp16
    pp16 dp8) 380: ratio 0.95. Excluded from the error figures (schedule unpublished: 126 layers, priced at
    128 here, interleaved v4 and micro-batch 1 assumed); TFLOP/s counted with causal attention as half the
    s x s (the convention that puts both rows near the published figures; counting the full s x s, as MFU
    tables do, makes the 128K row 1.35x the 8K row). With this project's calibrated H100 (kernels.yaml `h100`):
    345 and 361 TFLOP/s (-13.8%, -5.0%); with the published H100 facts (`h100-published`): 372 and 366 (-7.0%,
    -3.7%); before issue 49's kernels: ratio 0.66, attention at a fitted 19% of peak."""
    h100 = load_cluster("dgx-h100")
    tflops = []
    for seq, cp, dp in ((8192, 1, 128), (131072, 16, 8)):
        model = ModelSpec(layers=128, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, gated_mlp=True,
                          seq=seq, vocab=128256, biases=False, learned_positions=False)
        par = ParallelSpec(tp=8, pp=16, virtual=4, schedule="interleaved", cp=cp, cp_impl="ring", dp=dp, micro=1,
                           global_batch=16 * dp, zero=1, flash_attention=True, sequence_parallel=True)
        sim = simulate(model, h100, par)
        causal = sim.model_flops_per_iteration - par.global_batch * 3 * model.layers * 2 * seq * seq * model.q_dim
        tflops.append(causal / sim.iteration_time_s / par.gpus / 1e12)
    assert abs(tflops[0] / 400 - 1) < 0.15 and abs(tflops[1] / 380 - 1) < 0.1, tflops
    assert 0.9 < tflops[1] / tflops[0] < 1.05


@pytest.mark.parametrize("config, published", [(LLAMA3_8B, 8.03e9), (LLAMA3_70B, 70.6e9)])
def test_simulate_a_hugging_face_config_json(tmp_path, config, published) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "simulate", "--model", str(path), "--gpus", "64",
                          "--config", "dp=8,tp=8,zero=1,micro=1,global_batch=64,recompute=full,flash_attention=true",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    assert abs(data["model_params"] / published - 1) < 0.01
    assert "(8 kv)" in data["model"] and "SwiGLU" in data["model"] and "untied" in data["model"]
    assert 1.0 < data["memory_per_gpu_gb"] < 85.9 and set(data["memory_breakdown_gb"]) >= {"params", "activations"}
    text = subprocess.run([sys.executable, "-m", "workbench.cli", "simulate", "--model", str(path), "--gpus", "64",
                           "--config", "dp=8,tp=8,zero=1,micro=1,global_batch=64"], capture_output=True, text=True,
                          timeout=300)
    assert f"{data['model_params']:,} parameters" in text.stdout and "memory_per_gpu_gb" in text.stdout


def test_a_model_that_is_not_key_value_lists_the_presets_and_config_json() -> None:
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "simulate", "--model", "7b", "--gpus", "8",
                          "--config", "dp=8"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "22b, 175b, 1t" in out.stderr and "config.json" in out.stderr and out.stderr.count("\n") == 1


def test_validate_json_reports_leave_one_source_out_per_source() -> None:
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "simulate", "--validate", "--json"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    per = {row["source"]: row for row in data["loso"]}
    assert set(per) == set(data["sources"])
    for key in ("rows", "loso_median_pct", "loso_worst_pct", "baseline_median_pct", "in_sample_median_pct",
                "spearman", "top1_regret"):
        assert key in per["bloom-0225"], key
    for key in ("family", "lofo_median_pct", "lofo_spearman", "lofo_top1_regret"):
        assert key in per["bloom-0225"], key
    families = {row["family"]: row for row in data["lofo"]}
    assert families["bigscience"]["sources"] == "bloom-0221 bloom-0223 bloom-0225"
    assert families["bigscience"]["rows"] == sum(per[k]["rows"] for k in ("bloom-0221", "bloom-0223", "bloom-0225"))
    for key in ("lofo_median_pct", "baseline_median_pct", "loso_median_pct", "spearman", "top1_regret"):
        assert key in families["bigscience"], key
    # every term it reports as fitted holds a fitted value, not the default a term no row informs takes
    from tuning.sim.fit import term_defaults
    from tuning.sim.framework import FRAMEWORKS

    assert per["bloom-0221"]["rows"] == 15 and len(data["fitted_terms"]) == data["fitted_term_count"] == 15
    shipped = {t: getattr(FRAMEWORKS[t.split(".")[0]], t.split(".")[1]) for t in data["fitted_terms"]}
    assert all(shipped[t] != term_defaults()[t] for t in shipped), shipped
    assert data["in_sample_pooled_median_abs_error_pct"] > 0
    tables = {t["source"]: t for t in data["tables"] if t["search_table"]}
    assert "bloom-0225" in tables and all(np.isfinite(t["spearman"]) and t["top1_regret"] >= 0 for t in tables.values())
    cited = {c["source"]: c for c in data["cited_tables"]}
    assert cited["mosaicml-a100-40"]["priced"] == 78 and cited["llama3-t4"]["excluded"] == 3
    assert cited["bloom-0221"]["priced"] + cited["bloom-0221"]["excluded"] == 17
    text = subprocess.run([sys.executable, "-m", "workbench.cli", "simulate", "--validate"], capture_output=True,
                          text=True, timeout=900).stdout
    for needle in ("Leave-one-source-out, per source", "Leave-one-family-out, per family", "Fitted terms: 15", "In-sample", "Ranking per table",
                   "nar-t2-zero3-175b-1536", "chronicles-prequel.md", "excluded 18", "Memory facts"):
        assert needle in text, needle


def test_the_json_export_carries_the_model_shape() -> None:
    """Issue 37 item 2: the export carries the shape the simulator and the engine priced."""
    import optuna

    from engine.config.schema import load_config
    from engine.model.gpt import count_parameters
    from tuning.export.trial import export_trial

    cfg = load_config(None, ["model.layers=3", "model.d_model=64", "model.heads=4", "model.seq_len=32"])
    study = optuna.create_study(direction="maximize")
    study.add_trial(optuna.trial.create_trial(value=1.0, user_attrs={"config": cfg.to_dict()}))
    shape = json.loads(export_trial(study, fmt="json"))["model_shape"]
    assert shape["family"] == "gpt" and shape["layers"] == 3 and shape["kv_heads"] == 4 and shape["seq"] == 32
    assert shape["params"] == count_parameters(cfg.model)["total"]


# sources whose framework-only reading is over 15%, each with its cause (issue 63 item 3; not tuned away)
FRAMEWORK_ONLY_EXCEPTIONS = {
    # llm-foundry's amp_fp8 runs ran Triton attention (the 2023 README's attn_impl default); the fsdp flavour's
    # default kernel is FlashAttention-2, as torchtitan and llm-foundry's later releases run it
    "mosaicml-h100-fp8": "Triton attention, where the flavour's default is FlashAttention-2",
}


def test_each_source_priced_with_only_its_framework_named_is_within_15pct() -> None:
    """What a user who names only hardware, model, layout, framework and precision gets: every other knob at
    the flavour's defaults (FLAVOUR_DEFAULTS). Per source median |error| <= 15%, but the sources listed with
    their cause; `simulate --validate` reports the same reading (`framework_only_median_pct`)."""
    from tuning.sim.validation import framework_only

    rows = calibration_rows() + held_out_rows()
    errors: dict[str, list[float]] = {}
    for r, named in zip(rows, framework_only(rows)):
        errors.setdefault(r.source, []).append(abs(named / r.value - 1.0) * 100.0)
    over = {source for source, errs in errors.items() if float(np.median(errs)) > 15.0}
    assert over == set(FRAMEWORK_ONLY_EXCEPTIONS), {s: float(np.median(errors[s])) for s in over}


# PublishedRow fields that say which job ran and what it measured (identity, model shape, layout, the measurement);
# every other field is a per-row knob, which each source cites in its `knobs` (issue 63 item 3)
NOT_KNOBS = {"id", "source", "row", "cluster", "layers", "hidden", "heads", "seq", "vocab", "kv_heads", "ffn_hidden",
             "gated_mlp", "biases", "learned_positions", "dropout", "norm_params", "tied_embeddings", "experts", "top_k",
             "tp", "pp", "dp", "virtual", "micro", "global_batch", "zero", "recompute", "sequence_parallel", "cp", "ep",
             "metric", "value", "source_mfu", "fitted", "memory_gb", "oom"}
# a citation names the code or config that ran the knob (owner/repo@commit:path), or says what else it rests on
CITATION = re.compile(r"[\w.-]+/[\w.-]+@[0-9a-f]{7,40}:[\w./-]+|^(assumed|table)\b")


def uncited_knobs(data: dict) -> list[str]:
    """'source: knob (row)' for each knob a row sets away from PublishedRow's default with no citation in its
    source's `knobs`, or with a citation that names no repository path and does not say 'assumed' or 'table'."""
    from tuning.sim.published import PublishedRow

    defaults = {f.name: f.default for f in dataclasses.fields(PublishedRow) if f.name not in NOT_KNOBS}
    missing = []
    for row in data["rows"]:
        cited = data["sources"][row["source"]].get("knobs") or {}
        for knob in sorted(k for k in defaults if k in row and row[k] != defaults[k]):
            if not CITATION.search(str(cited.get(knob, ""))):
                missing.append(f"{row['source']}: {knob} ({row['id']})")
    return missing


def test_every_per_row_knob_cites_the_code_that_ran_it() -> None:
    """Issue 63 item 3: a knob a row sets (attention kernel, overlap, optimizer, reduce dtype, FP8...) is read
    from the code or config that ran it, cited in its source's `knobs` as owner/repo@commit:path, or marked as
    resting on the table or an assumption; a knob without one fails, and so does a citation of a knob no row of
    the source sets."""
    from tuning.sim.published import PublishedRow, _raw

    knobs = {f.name for f in dataclasses.fields(PublishedRow)} - NOT_KNOBS
    assert knobs == {"flash_attention", "attention", "overlap_dp", "tp_comm_overlap", "grad_accum_fp32", "dist_adam",
                     "defer_embedding_wgrad", "attention_unpad", "unfused_loss", "reduce_bytes", "fp8",
                     "capacity_factor", "cp_impl", "framework"}  # a new field is classified here first
    data = _raw(str(DATA))
    assert uncited_knobs(data) == []
    for name, src in data["sources"].items():
        rows = [r for r in data["rows"] if r["source"] == name]
        for knob in src.get("knobs") or {}:
            assert knob in knobs and any(knob in r for r in rows), f"{name}: cites {knob}, which no row sets"
    # the check can fail: one citation taken away is reported
    trimmed = {**data, "sources": {**data["sources"], "mosaicml-h100-large": {
        **data["sources"]["mosaicml-h100-large"],
        "knobs": {k: v for k, v in data["sources"]["mosaicml-h100-large"]["knobs"].items() if k != "reduce_bytes"}}}}
    assert uncited_knobs(trimmed) and all("reduce_bytes" in m for m in uncited_knobs(trimmed))
