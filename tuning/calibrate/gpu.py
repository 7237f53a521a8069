"""This GPU measured for the simulator (issue 49, item 5): bf16 GEMM rates by shape, fused attention
(`scaled_dot_product_attention`'s FlashAttention-2 and cuDNN kernels) by head dim, sequence length and
causality, forward and backward, and streaming bandwidth. `measure_gpu` writes them as a kernel-facts
profile in `tuning/data/kernels.yaml`'s schema (`tuning.sim.kernels.gpu_facts` reads it by path), with
the hardware-fact prior's price of every point measured beside the measurement.

What is measured, and what is kept from the prior:
- `gemm_efficiency` is the median, over the compute-bound shapes measured, of the rate over peak x
  the tiles' quantisation: what prices the measured GEMMs best in the simulator's GEMM model. The
  best square's rate (`mamf`, the published prior's kind of figure) is kept beside it for comparison.
  The tile shapes stay the prior's (cuBLAS's, not measurable here).
- attention rates use FlashAttention's FLOP convention (forward 4 s^2 d per head, backward 2.5x,
  causal half) at 16k tokens and hidden 2048, the setting of the prior's FlashAttention-3 figures.
- `hbm_gb_s` is a Triad (a = b + s c) over 3 x 512 MiB, the prior's BabelStream kernel.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SQUARE = (2048, 4096, 6144, 8192, 12288, 16384)  # MAMF sweep (M = N = K)
TOKENS = 8192  # a step's tokens per GEMM in the transformer shapes
HIDDENS = (2048, 4096, 8192)
TP = (1, 8)
WAVE_N = tuple(range(1024, 8193, 256))  # M 8192, K 4096: the tile/wave sawtooth
SKINNY_M = (1, 16, 64, 256)  # N = K = 8192: weight streaming, memory-bound
ATTN_SEQ = (512, 1024, 2048, 4096, 8192, 16384)
ATTN_HEAD_DIMS = (64, 128)
ATTN_TOKENS, ATTN_HIDDEN = 16384, 2048


def gemm_shapes() -> list[tuple[int, int, int]]:
    """(M, N, K) measured: the MAMF squares, a linear layer's three GEMMs (forward, input and weight
    gradients) at each hidden size and tensor-parallel split, the wave sweep and the skinny GEMMs."""
    shapes = [(s, s, s) for s in SQUARE]
    for h in HIDDENS:
        for tp in TP:
            for n, k in ((3 * h // tp, h), (h, h // tp), (4 * h // tp, h), (h, 4 * h // tp)):
                shapes += [(TOKENS, n, k), (TOKENS, k, n), (k, n, TOKENS)]
    shapes += [(TOKENS, n, 4096) for n in WAVE_N] + [(m, 8192, 8192) for m in SKINNY_M]
    return list(dict.fromkeys(shapes))


@dataclass(frozen=True)
class Timer:
    """Seconds per call of `fn` on `device`: the CPU calibration's probe timer (the median of `repeats`
    batches of calls lasting about `min_s`, the device synchronised after each batch)."""

    device: str = "cuda"
    min_s: float = 0.02
    repeats: int = 3

    def __call__(self, fn: Callable[[], Any]) -> float:
        from tuning.calibrate.kernels import _device_sync, _time_call

        return _time_call(fn, min_time_s=self.min_s, repeats=self.repeats, sync=_device_sync(self.device))


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs of fused attention in FlashAttention's convention (4 s^2 d per head, causal half)."""
    return 4.0 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)


def measure_gemms(shapes: Sequence[tuple[int, int, int]], *, timer: Timer, dtype: str = "bfloat16",
                  deadline: float = float("inf")) -> list[dict[str, float]]:
    """Seconds and FLOP/s of `A (M x K) @ B (K x N)` for each shape, random normal operands; shapes
    past `deadline` (a perf_counter time) are left out."""
    import torch

    rows = []
    for m, n, k in shapes:
        if time.perf_counter() > deadline:
            break
        a = torch.randn(m, k, device=timer.device, dtype=getattr(torch, dtype))
        b = torch.randn(k, n, device=timer.device, dtype=getattr(torch, dtype))
        out = torch.empty(m, n, device=timer.device, dtype=getattr(torch, dtype))
        seconds = timer(lambda: torch.matmul(a, b, out=out))
        rows.append({"m": m, "n": n, "k": k, "seconds": seconds, "flops_s": 2.0 * m * n * k / seconds})
    return rows


def sdpa_backends() -> dict[str, list[Any]]:
    """The fused kernels measured, by the name `tuning/data/kernels.yaml` gives them."""
    from torch.nn.attention import SDPBackend

    return {"fa2": [SDPBackend.FLASH_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION]}


def measure_attention(*, timer: Timer, backends: dict[str, list[Any]], seqs: Sequence[int] = ATTN_SEQ,
                      head_dims: Sequence[int] = ATTN_HEAD_DIMS, tokens: int = ATTN_TOKENS,
                      hidden: int = ATTN_HIDDEN, dtype: str = "bfloat16",
                      deadline: float = float("inf")) -> list[dict[str, Any]]:
    """Forward and backward FLOP/s (FlashAttention's convention) of each backend at each head dim,
    length and causality, `tokens` tokens a call over `hidden` / head-dim heads; a backend that
    refuses a point records why."""
    import torch
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    rows = []
    for impl, backend in backends.items():
        for hd in head_dims:
            for causal in (False, True):
                for seq in seqs:
                    if time.perf_counter() > deadline:
                        return rows
                    batch, heads = max(1, tokens // seq), hidden // hd
                    shape = (batch, heads, seq, hd)
                    q, k, v = (torch.randn(shape, device=timer.device, dtype=getattr(torch, dtype),
                                           requires_grad=True) for _ in range(3))
                    grad = torch.randn(shape, device=timer.device, dtype=getattr(torch, dtype))
                    work = attention_flops(batch, heads, seq, hd, causal)
                    row: dict[str, Any] = {"impl": impl, "head_dim": hd, "causal": causal, "seq": seq,
                                           "batch": batch, "heads": heads}
                    try:
                        with sdpa_kernel(backend):
                            with torch.no_grad():
                                fwd = timer(lambda: sdpa(q, k, v, is_causal=causal))
                            out = sdpa(q, k, v, is_causal=causal)
                            bwd = timer(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
                        row.update(fwd_flops_s=work / fwd, bwd_flops_s=2.5 * work / bwd)
                    except RuntimeError as exc:  # this backend does not take this shape on this GPU
                        row["refused"] = str(exc).strip().splitlines()[0][:200]
                    rows.append(row)
    return rows


def measure_triad(*, timer: Timer, elements: int = 1 << 28, dtype: str = "bfloat16") -> float:
    """Bytes/s of a = b + s c over `elements` each (3 arrays read or written: BabelStream's Triad)."""
    import torch

    b, c = (torch.randn(elements, device=timer.device, dtype=getattr(torch, dtype)) for _ in range(2))
    a = torch.empty_like(b)
    seconds = timer(lambda: torch.add(b, c, alpha=0.4, out=a))
    return 3.0 * elements * b.element_size() / seconds


def attention_tables(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """kernels.yaml `attention` entries (TFLOP/s) from measured rows: per kernel, the lengths every
    head dim and causality of it reached, and per head dim its full / causal forward and backward."""
    tables: dict[str, Any] = {}
    for impl in dict.fromkeys(r["impl"] for r in rows):
        ok = [r for r in rows if r["impl"] == impl and "refused" not in r]
        keys = {(r["head_dim"], r["causal"]) for r in ok}
        seqs = sorted(set.intersection(*({r["seq"] for r in ok if (r["head_dim"], r["causal"]) == key}
                                         for key in keys))) if keys else []
        if not seqs:
            continue
        table: dict[str, Any] = {"seq": seqs}
        for hd, causal in sorted(keys):
            at = {r["seq"]: r for r in ok if (r["head_dim"], r["causal"]) == (hd, causal)}
            table.setdefault(f"hd{hd}", {})["causal" if causal else "full"] = {
                kind: [float(f"{at[s][f'{kind}_flops_s'] / 1e12:.4g}") for s in seqs] for kind in ("fwd", "bwd")}
        tables[impl] = {k: v for k, v in table.items() if k == "seq" or {"full", "causal"} <= set(v)}
    return {impl: t for impl, t in tables.items() if len(t) > 1}


def with_prior(measurements: dict[str, Any], *, prior: str | None, peak: float) -> dict[str, Any]:
    """`measurements` with the hardware-fact prior's FLOP/s (`tuning.sim.kernels`) beside each measured
    rate (`prior_*` keys, and the prior's Triad bandwidth); unchanged without a prior."""
    from tuning.sim.kernels import fused_attention_seconds, gemm_seconds, gpu_facts

    gemms, attention = ([dict(r) for r in measurements[kind]] for kind in ("gemm", "attention"))
    hbm = {"triad_gb_s": measurements["hbm"]["triad_gb_s"], "prior_gb_s": None}
    if prior is None:
        return {"gemm": gemms, "attention": attention, "hbm": hbm}
    facts = gpu_facts(prior)
    hbm["prior_gb_s"] = facts.hbm_gb_s
    for r in gemms:
        r["prior_flops_s"] = 2.0 * r["m"] * r["n"] * r["k"] / float(gemm_seconds(facts, peak, r["m"], r["n"], r["k"]))
    for r in attention:
        if "refused" in r or r["impl"] not in facts.attention:
            continue
        work = attention_flops(r["batch"], r["heads"], r["seq"], r["head_dim"], r["causal"])
        fwd, bwd = fused_attention_seconds(facts, r["impl"], heads=r["batch"] * r["heads"], seq_q=r["seq"],
                                           seq_k=r["seq"], head_dim=r["head_dim"], causal=r["causal"])
        r["prior_fwd_flops_s"], r["prior_bwd_flops_s"] = work / float(fwd), 2.5 * work / float(bwd)
    return {"gemm": gemms, "attention": attention, "hbm": hbm}


# the published prior each GPU's measurement is compared with (tuning/data/kernels.yaml), and the preset
# whose cluster the measured kernels go into
PRIORS = {"h100": ("h100-published", "dgx-h100"), "a100": ("a100", "dgx-a100-80gb"),
          "a100-40": ("a100-40", "dgx-a100-40gb"), "mi250x": ("mi250x", "frontier")}


def prior_kind(device_name: str, memory_gb: float) -> str | None:
    """The PRIORS key of this device (by its name, and memory for the A100s), or None."""
    words = device_name.lower()
    for key in ("h100", "mi250x"):
        if key in words:
            return key
    if "a100" in words:
        return "a100" if memory_gb > 50 else "a100-40"
    return None


def measure_gpu(*, budget_s: float = 170.0, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """This GPU's kernel-facts profile (see the module docstring), measured in about `budget_s`:
    points past the budget are left out and the profile says how many."""
    import torch

    from engine.device import peak_flops

    if not torch.cuda.is_available():
        raise RuntimeError(f"calibrate --gpu needs a CUDA GPU: torch.cuda.is_available() is False "
                           f"(torch {torch.__version__}); nothing was measured")
    torch.backends.cuda.matmul.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    name, memory_gb = torch.cuda.get_device_name(0), props.total_memory / 1e9
    peak = peak_flops(torch.device("cuda", 0))
    device = prior_kind(name, memory_gb)
    prior = PRIORS[device][0] if device else None
    if peak is None:
        raise RuntimeError(f"calibrate --gpu: no datasheet bf16 peak for {name!r} (engine/peaks.py PEAK_BF16); "
                           "set WORKBENCH_PEAK_FLOPS")
    start = time.perf_counter()
    timer, shapes = Timer("cuda"), gemm_shapes()
    progress(f"GEMMs ({len(shapes)} shapes)")
    gemms = measure_gemms(shapes, timer=timer, deadline=start + 0.45 * budget_s)
    progress("fused attention (FlashAttention-2 and cuDNN through scaled_dot_product_attention)")
    attention = measure_attention(timer=timer, backends=sdpa_backends(), deadline=start + 0.9 * budget_s)
    progress("HBM bandwidth (Triad)")
    triad = measure_triad(timer=timer)
    measurements = {"gemm": gemms, "attention": attention, "hbm": {"triad_gb_s": triad / 1e9}}
    facts = derive_facts(measurements, sms=props.multi_processor_count, peak=peak, prior=prior)
    return {
        "device": name, "memory_gb": round(memory_gb, 1), "torch": str(torch.__version__),
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.perf_counter() - start, 1), "peak_flops": peak, "prior": prior,
        "preset": PRIORS[device][1] if device else None,
        "mamf": round(max(r["flops_s"] for r in gemms if r["m"] == r["n"] == r["k"]) / peak, 4),
        "left_out": {"gemm": len(shapes) - len(gemms),
                     "attention": len(sdpa_backends()) * len(ATTN_HEAD_DIMS) * 2 * len(ATTN_SEQ) - len(attention)},
        "gpus": {"measured": facts}, "measurements": with_prior(measurements, prior=prior, peak=peak),
    }


def compute_bound(facts: Any, peak: float, m: float, n: float, k: float) -> bool:
    """Whether `facts` price this GEMM by its tiles rather than by streaming its operands (1.5x margin)."""
    from tuning.sim.kernels import quantisation

    compute = 2.0 * m * n * k / (peak * facts.gemm_efficiency * float(quantisation(facts, m, n)))
    return compute > 1.5 * 2.0 * (m * k + k * n + m * n) / (facts.hbm_gb_s * 1e9)


def derive_facts(measurements: dict[str, Any], *, sms: int, peak: float, prior: str | None) -> dict[str, Any]:
    """kernels.yaml facts from measurements: `gemm_efficiency` is the median, over the compute-bound
    shapes, of the measured rate / (peak x the tiles' quantisation): the one number that prices the
    measured GEMMs best in the simulator's GEMM model (not the best shape's rate, `mamf`, which the
    published prior gives); tile shapes stay the prior's; attention as measured; Triad bandwidth."""
    import dataclasses
    import statistics

    from tuning.sim.kernels import gpu_facts, quantisation

    hbm = measurements["hbm"]["triad_gb_s"]
    shape_facts = dataclasses.replace(gpu_facts(prior or "h100-published"), sms=sms, hbm_gb_s=hbm)
    tiles = [list(t) for t in shape_facts.tiles]
    bound = [r for r in measurements["gemm"] if compute_bound(shape_facts, peak, r["m"], r["n"], r["k"])]
    effs = [r["flops_s"] / (peak * float(quantisation(shape_facts, r["m"], r["n"])))
            for r in bound or measurements["gemm"]]  # none compute-bound: a tiny device or sweep
    return {"sms": sms, "gemm_efficiency": round(statistics.median(effs), 4), "tiles": tiles,
            "hbm_gb_s": round(hbm, 1), "attention": attention_tables(measurements["attention"])}


def combine(profiles: list[dict[str, Any]]) -> dict[str, Any]:
    """One profile from repeated runs on one GPU: each point's median rate, facts derived from those."""
    import statistics

    first = profiles[0]

    def median_rows(kind: str, key: tuple[str, ...], rates: tuple[str, ...]) -> list[dict[str, Any]]:
        groups: dict[tuple, list[dict[str, Any]]] = {}
        for run in profiles:
            for r in run["measurements"][kind]:
                groups.setdefault(tuple(r[k] for k in key), []).append(r)
        out = []
        for rows in groups.values():
            ok = [r for r in rows if "refused" not in r]
            row = {k: v for k, v in rows[0].items() if not k.endswith("flops_s") and k != "seconds"}
            row.update({name: statistics.median(r[name] for r in ok) for name in rates} if ok else {})
            out.append(row)
        return out

    measurements = {"gemm": median_rows("gemm", ("m", "n", "k"), ("flops_s",)),
                    "attention": median_rows("attention", ("impl", "head_dim", "causal", "seq"),
                                             ("fwd_flops_s", "bwd_flops_s")),
                    "hbm": {"triad_gb_s": statistics.median(r["measurements"]["hbm"]["triad_gb_s"] for r in profiles)}}
    for r in measurements["attention"]:
        if "fwd_flops_s" in r:
            r.pop("refused", None)
    facts = derive_facts(measurements, sms=first["gpus"]["measured"]["sms"], peak=first["peak_flops"],
                         prior=first["prior"])
    kept = ("device", "memory_gb", "torch", "cuda", "cudnn", "peak_flops", "prior", "preset")
    return {**{k: first.get(k) for k in kept},
            "runs": [{k: run[k] for k in ("measured_at", "seconds", "mamf") if k in run} for run in profiles],
            "mamf": statistics.median(run.get("mamf") or 0.0 for run in profiles),
            "left_out": {k: max(run["left_out"][k] for run in profiles) for k in first["left_out"]},
            "gpus": {"measured": facts}, "measurements": with_prior(measurements, prior=first["prior"],
                                                                    peak=first["peak_flops"])}


def summary(profile: dict[str, Any]) -> list[str]:
    """Lines comparing the measurement with the prior: MAMF, the GEMM groups' median measured / prior
    rate, each attention kernel's per head dim and causality, and the Triad bandwidth."""
    import statistics

    facts, m, prior = profile["gpus"]["measured"], profile["measurements"], profile["prior"]
    runs = profile.get("runs") or [profile]  # a `combine`d profile lists its runs
    took = " + ".join(f"{run['seconds']:.0f}" for run in runs)
    lines = [f"{profile['device']} (torch {profile['torch']}, CUDA {profile['cuda']}, cuDNN {profile['cudnn']}): "
             f"measured in {took} s; prior: {prior or 'none'} (tuning/data/kernels.yaml)"]
    if prior:
        from tuning.sim.kernels import gpu_facts

        lines.append(f"GEMM efficiency (median of the compute-bound shapes) {facts['gemm_efficiency']:.1%}, best "
                     f"square (MAMF) {profile['mamf']:.1%} of peak; "
                     f"prior (MAMF) {gpu_facts(prior).gemm_efficiency:.1%}")
    groups = {"square": lambda r: r["m"] == r["n"] == r["k"], "skinny (M <= 256)": lambda r: r["m"] <= 256,
              "wave sweep (M 8192, K 4096)": lambda r: r["m"] == TOKENS and r["k"] == 4096 and r["n"] in WAVE_N,
              "all": lambda r: True}
    for name, keep in groups.items():
        ratios = [r["flops_s"] / r["prior_flops_s"] for r in m["gemm"] if keep(r) and "prior_flops_s" in r]
        if ratios:
            lines.append(f"GEMM {name}: {len(ratios)} shapes, measured / prior median {statistics.median(ratios):.3f}"
                         f" (range {min(ratios):.2f}-{max(ratios):.2f})")
    for impl in dict.fromkeys(r["impl"] for r in m["attention"]):
        for hd in sorted({r["head_dim"] for r in m["attention"]}):
            for causal in (False, True):
                rows = [r for r in m["attention"] if (r["impl"], r["head_dim"], r["causal"]) == (impl, hd, causal)]
                ok = [r for r in rows if "refused" not in r]
                if not ok:
                    lines.append(f"{impl} hd{hd} {'causal' if causal else 'full'}: refused "
                                 f"({rows[0]['refused'] if rows else 'not measured'})")
                    continue
                fwd = "/".join(f"{r['fwd_flops_s'] / 1e12:.0f}" for r in ok)
                bwd = "/".join(f"{r['bwd_flops_s'] / 1e12:.0f}" for r in ok)
                text = (f"{impl} hd{hd} {'causal' if causal else 'full'} seq {ok[0]['seq']}-{ok[-1]['seq']}: "
                        f"fwd {fwd}, bwd {bwd} TFLOP/s")
                if "prior_fwd_flops_s" in ok[0]:
                    fr = statistics.median(r["fwd_flops_s"] / r["prior_fwd_flops_s"] for r in ok)
                    br = statistics.median(r["bwd_flops_s"] / r["prior_bwd_flops_s"] for r in ok)
                    text += f"; measured / prior median fwd {fr:.2f}, bwd {br:.2f}"
                lines.append(text)
    hbm = m["hbm"]
    prior_hbm = f"; prior {hbm['prior_gb_s']:.0f}" if hbm["prior_gb_s"] else ""
    lines.append(f"Triad {hbm['triad_gb_s']:.0f} GB/s{prior_hbm}")
    if any(profile["left_out"].values()):
        lines.append(f"left out past the time budget: {profile['left_out']}")
    return lines


def save_profile(profile: dict[str, Any], path: Path) -> tuple[Path, Path | None]:
    """Write the kernel-facts profile at `path` and, where the GPU has a preset, a cluster profile
    beside it (`<stem>-cluster.yaml`: that preset with `kernels` naming the measured file, relative to
    the cluster file), which `workbench simulate --cluster` reads. Returns both paths (the second None
    without a preset, or where the device is another part of the preset's name, with another peak)."""
    import dataclasses

    import yaml

    from tuning.sim.hardware import PRESETS, save_cluster

    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(profile, sort_keys=False))
    preset = PRESETS.get(profile.get("preset") or "")
    if preset is None or preset.peak_flops != profile.get("peak_flops", preset.peak_flops):
        return path, None
    cluster = dataclasses.replace(preset, name=f"{preset.name}-measured", kernels=path.name)  # beside it
    return path, save_cluster(cluster, path.with_name(f"{path.stem}-cluster.yaml"))


__all__ = ["Timer", "attention_flops", "attention_tables", "gemm_shapes", "measure_attention", "measure_gemms", "measure_gpu",
           "measure_triad", "prior_kind", "save_profile", "sdpa_backends", "summary", "with_prior",
           "combine", "compute_bound", "derive_facts"]
