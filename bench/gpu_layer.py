"""One GPU's share of a Megatron-LM GPT layer at tensor-parallel degree t: its GEMMs, its fused attention,
the whole layer forward and backward, and the backward under full recomputation, measured.

    python bench/gpu_layer.py [--shapes gpt-22b,gpt-175b] [--tp 1,2,4,8] [--micro 1] [--seq 2048]
                              [--repeats 7] [--json OUT.json] [--cpu-dry-run]
    python bench/gpu_layer.py --price docs/data/gpu_layer_2026-11-27/layer.json [--cluster dgx-h100]

The shard is what one rank of Megatron-LM's tensor-parallel layer runs (Shoeybi et al. 2019, fig. 3;
megatron/core/transformer): layer norm, the QKV GEMM (h -> 3h/t), flash attention over heads/t, the output
GEMM (h/t -> h), dropout + residual, layer norm, FC1 (h -> 4h/t), GeLU, FC2 (4h/t -> h), dropout + residual;
bf16, Megatron's default dropouts (0.1). The all-reduces tensor parallelism adds are not here (one GPU):
these are the compute terms the simulator prices per layer (tuning/sim/kernels.py), measured.
Full recomputation is torch.utils.checkpoint around the layer (what Megatron's CheckpointFunction does:
the forward runs again inside the backward). Each figure is the median of `--repeats` timings of 10
back-to-back calls between CUDA events. Without CUDA it exits 2 unless `--cpu-dry-run`, which checks
this script on a small shape and measures nothing about GPUs.

`--price` runs anywhere: beside each measured row it prints the simulator's price of the same shard
(`tuning.sim.compute.compute_times` per layer: a two-layer model less a one-layer one, so the logits and
loss cancel) on `--cluster`, with the `fsdp` flavour (eager PyTorch kernels, flash attention, as here), and
the bytes `activation_bytes` says a layer keeps (Korthikanti et al. 2022). "held" is what the forward leaves
allocated: the layer's output counted, its input (allocated before) not; the price counts the input and not
the output, the same 2 s b h bytes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from gpu_check import no_cuda_message, versions  # noqa: E402

@dataclasses.dataclass(frozen=True)
class Shape:
    """A decoder layer's widths: Megatron-LM's GPT (LayerNorm, GeLU MLP of 4h, dropout 0.1, learned positions)
    or a Llama (RMSNorm, SwiGLU, grouped-query attention, rotary embeddings, no dropout)."""

    hidden: int
    heads: int
    kv_heads: int = 0  # 0: heads
    ffn: int = 0  # 0: 4 hidden
    llama: bool = False

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def dropout(self) -> float:
        return 0.0 if self.llama else 0.1


# Narayanan et al. 2021 Table 1 and Korthikanti et al. 2022 Table 3's GPTs; Llama 3.1's config.json widths
SHAPES = {"gpt-1.3b": Shape(2048, 16), "gpt-22b": Shape(6144, 64), "gpt-175b": Shape(12288, 96),
          "gpt-530b": Shape(20480, 128), "llama-8b": Shape(4096, 32, 8, 14336, llama=True),
          "llama-70b": Shape(8192, 64, 8, 28672, llama=True)}
DRY_SHAPES = {"dry": Shape(64, 4), "dry-llama": Shape(64, 4, 2, 160, llama=True)}
CALLS = 10


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers' Llama applies it (eager: rotate_half)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Shard:
    """One rank's weights of a decoder layer at tensor-parallel degree `tp`, and its forward."""

    def __init__(self, shape: Shape, tp: int, seq: int, device: torch.device, dtype: torch.dtype):
        def w(n_out: int, n_in: int) -> torch.Tensor:
            return (torch.randn(n_out, n_in, device=device, dtype=dtype) * 0.02).requires_grad_()

        hidden, self.shape = shape.hidden, shape
        self.heads, self.kv, self.head_dim = shape.heads // tp, max(shape.kv // tp, 1), hidden // shape.heads
        width, ffn = self.heads * self.head_dim, shape.ffn_width // tp
        self.qkv, self.proj = w(width + 2 * self.kv * self.head_dim, hidden), w(hidden, width)
        self.fc1, self.fc2 = w((2 if shape.llama else 1) * ffn, hidden), w(hidden, ffn)
        self.norms = [torch.ones(hidden, device=device, dtype=dtype, requires_grad=True) for _ in range(2)]
        angle = torch.arange(seq, device=device)[:, None] * 10000.0 ** (
            -torch.arange(0, self.head_dim, 2, device=device) / self.head_dim)
        angle = torch.cat((angle, angle), dim=-1)
        self.cos, self.sin = angle.cos().to(dtype), angle.sin().to(dtype)

    def norm(self, x: torch.Tensor, i: int) -> torch.Tensor:
        h = (x.shape[-1],)
        return F.rms_norm(x, h, self.norms[i]) if self.shape.llama else F.layer_norm(x, h, self.norms[i])

    def attention(self, qkv: torch.Tensor) -> torch.Tensor:
        b, s, _ = qkv.shape
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv * self.head_dim, self.kv * self.head_dim], dim=-1)
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.shape.llama:
            q, k = rotary(q, self.cos, self.sin), rotary(k, self.cos, self.sin)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.shape.dropout, is_causal=True,
                                             enable_gqa=self.kv != self.heads)
        return out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.shape.llama:
            gate, up = F.linear(x, self.fc1).chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(F.linear(x, self.fc1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.shape.dropout
        x = x + F.dropout(F.linear(self.attention(F.linear(self.norm(x, 0), self.qkv)), self.proj), p)
        return x + F.dropout(F.linear(self.mlp(self.norm(x, 1)), self.fc2), p)

    def gemms(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The layer's four GEMMs alone, each on an input of its own shape."""
        b, s, h = x.shape
        attn_out = x.new_zeros(b, s, self.heads * self.head_dim).requires_grad_()
        fc1_out = x.new_zeros(b, s, self.fc2.shape[1]).requires_grad_()
        return [F.linear(x, self.qkv), F.linear(attn_out, self.proj), F.linear(x, self.fc1), F.linear(fc1_out, self.fc2)]


def timed(device: torch.device, fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of one call: `repeats` timings of CALLS calls between CUDA events (perf_counter on CPU)."""
    fn()  # warm-up: allocator, kernel selection
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(CALLS):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / CALLS)
        else:
            t0 = time.perf_counter()
            for _ in range(CALLS):
                fn()
            samples.append((time.perf_counter() - t0) / CALLS)
    return statistics.median(samples)


def backward_of(device: torch.device, forward: Callable[[], torch.Tensor], repeats: int) -> float:
    """Median seconds of the backward alone: each timing runs CALLS forwards untimed, then their backwards."""
    samples = []
    for r in range(repeats + 1):
        outs = [forward() for _ in range(CALLS)]
        grads = [torch.ones_like(o) for o in outs]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for o, g in zip(outs, grads):
            o.backward(g)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if r:
            samples.append((time.perf_counter() - t0) / CALLS)
        del outs, grads
    return statistics.median(samples)


def held_bytes(device: torch.device, forward: Callable[[], torch.Tensor]) -> int:
    """Bytes the forward leaves allocated for its backward (its output included)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    out = forward()
    held = torch.cuda.memory_allocated(device) - before
    out.backward(torch.ones_like(out))
    return held


def measure(name: str, shape: Shape, tp: int, micro: int, seq: int, device: torch.device,
            dtype: torch.dtype, repeats: int) -> dict:
    shard = Shard(shape, tp, seq, device, dtype)
    x = torch.randn(micro, seq, shape.hidden, device=device, dtype=dtype, requires_grad=True)

    def layer() -> torch.Tensor:
        return shard.forward(x)

    def recomputed() -> torch.Tensor:
        return checkpoint(shard.forward, x, use_reentrant=False)

    def gemm_sum() -> torch.Tensor:
        return sum(g.float().sum() for g in shard.gemms(x))

    def attention() -> torch.Tensor:
        qkv = x.new_zeros(micro, seq, shard.qkv.shape[0]).normal_().requires_grad_()
        return shard.attention(qkv)

    row = {"shape": name, **dataclasses.asdict(shape), "tp": tp, "micro": micro, "seq": seq}
    with torch.no_grad():
        row["gemm_fwd_s"] = timed(device, lambda: shard.gemms(x), repeats)
        row["attn_fwd_s"] = timed(device, attention, repeats)
        row["layer_fwd_nograd_s"] = timed(device, layer, repeats)
    row["layer_fwd_s"] = timed(device, layer, repeats)
    row["gemm_bwd_s"] = backward_of(device, gemm_sum, repeats)
    row["attn_bwd_s"] = backward_of(device, attention, repeats)
    row["layer_bwd_s"] = backward_of(device, layer, repeats)
    row["recompute_fwd_s"] = timed(device, recomputed, repeats)
    row["recompute_bwd_s"] = backward_of(device, recomputed, repeats)
    row["held_bytes"] = held_bytes(device, layer)
    row["held_bytes_recompute"] = held_bytes(device, recomputed)
    row["recompute_overhead"] = ((row["recompute_fwd_s"] + row["recompute_bwd_s"])
                                 / (row["layer_fwd_s"] + row["layer_bwd_s"]) - 1.0)
    gemm_flops = 2 * micro * seq * sum(w.numel() for w in (shard.qkv, shard.proj, shard.fc1, shard.fc2))
    row["gemm_fwd_tflops"] = gemm_flops / row["gemm_fwd_s"] / 1e12
    row["gemm_bwd_tflops"] = 2 * gemm_flops / row["gemm_bwd_s"] / 1e12
    return row


def fused_attention(run: Callable[[], dict], device: torch.device) -> dict:
    """`run` under SDPA's flash kernel, else (a shape flash refuses) its memory-efficient one; never the math
    kernel, which would store the s x s scores. The row names the kernel that ran."""
    if device.type != "cuda":
        return {**run(), "attention_kernel": "cpu"}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                return {**run(), "attention_kernel": backend.name.lower()}
        except RuntimeError as e:
            print(f"  {backend.name}: {str(e).splitlines()[0][:160]}", flush=True)
            torch.cuda.empty_cache()
    raise RuntimeError("neither fused attention kernel ran this shape")


def priced(row: dict, cluster: str, framework: str = "fsdp") -> dict[str, float]:
    """The simulator's per-layer seconds for a measured row's shard: GEMMs (forward + backward), forward,
    backward, the recompute overhead (full recomputation's layer time over none's, less 1), and the bytes a layer
    keeps for its backward without recomputation and with full recomputation (`activation_bytes`)."""
    import numpy as np

    from tuning.sim.compute import activation_bytes, compute_times
    from tuning.sim.hardware import PRESETS
    from tuning.sim.spec import ModelSpec, ParallelSpec, columns

    def times(layers: int, recompute: str) -> tuple[dict[str, float], dict[str, float]]:
        llama = row.get("llama", False)  # the shard has no biases; a GPT's dropout and GELU MLP as ModelSpec's
        m = ModelSpec(layers=layers, hidden=row["hidden"], heads=row["heads"], seq=row["seq"], vocab=50304,
                      biases=False, kv_heads=row.get("kv_heads", 0), ffn_hidden=row.get("ffn", 0), gated_mlp=llama,
                      learned_positions=not llama, norm_params=1 if llama else 2, dropout=not llama)
        c = columns(ParallelSpec(tp=row["tp"], micro=row["micro"], global_batch=row["micro"], recompute=recompute,
                                 framework=framework, flash_attention=True))
        c["num_mb"] = np.asarray(1)
        act = activation_bytes(m, c)
        return ({k: float(v) for k, v in compute_times(m, PRESETS[cluster], c, act).items()},
                {k: float(v) for k, v in act.items()})

    one, two, two_full = times(1, "none")[0], times(2, "none")[0], times(2, "full")
    one_full = times(1, "full")[0]
    fwd, bwd = two["fwd"] - one["fwd"], two["bwd"] - one["bwd"]
    return {"gemm_s": two["gemm"] - one["gemm"], "fwd_s": fwd, "bwd_s": bwd,
            "recompute_overhead": (fwd + two_full[0]["bwd"] - one_full["bwd"]) / (fwd + bwd) - 1.0,
            "held_bytes": two_full[1]["full"], "held_bytes_recompute": two_full[1]["stored"]}


def price_report(paths: list[Path], cluster: str) -> str:
    """Measured (the JSON files `--json` wrote) beside priced, one line per row."""
    lines = [f"measured/priced; measured: {json.loads(paths[0].read_text())['versions']}; priced: {cluster}, fsdp flavour",
             f"{'shape':9} {'tp':>2} {'GEMMs f+b (ms)':>17} {'layer fwd (ms)':>15} {'layer bwd (ms)':>15} "
             f"{'bwd/fwd':>11} {'recompute +':>15} {'held (MiB)':>11} {'recompute held':>15}"]
    for path in paths:
        for r in json.loads(path.read_text())["rows"]:
            p = priced(r, cluster)
            gemm = r["gemm_fwd_s"] + r["gemm_bwd_s"]
            lines.append(f"{r['shape']:9} {r['tp']:2d} {gemm * 1e3:8.2f}/{p['gemm_s'] * 1e3:<8.2f} "
                         f"{r['layer_fwd_s'] * 1e3:7.2f}/{p['fwd_s'] * 1e3:<7.2f} "
                         f"{r['layer_bwd_s'] * 1e3:7.2f}/{p['bwd_s'] * 1e3:<7.2f} "
                         f"{r['layer_bwd_s'] / r['layer_fwd_s']:5.2f}/{p['bwd_s'] / p['fwd_s']:<5.2f} "
                         f"{r['recompute_overhead']:+7.1%}/{p['recompute_overhead']:<+7.1%} "
                         f"{r['held_bytes'] / 2**20:5.0f}/{p['held_bytes'] / 2**20:<5.0f} "
                         f"{r['held_bytes_recompute'] / 2**20:7.0f}/{p['held_bytes_recompute'] / 2**20:<7.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu_layer.py", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="gpt-22b,gpt-175b", help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--tp", default="1,2,4,8", help="tensor-parallel degrees (the shard one rank runs)")
    ap.add_argument("--micro", default="1", help="micro-batch sizes")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--cpu-dry-run", action="store_true", help="check this script on CPU")
    ap.add_argument("--price", type=Path, nargs="+", help="print the simulator's price beside these measurements")
    ap.add_argument("--cluster", default="dgx-h100", help="the cluster preset --price prices on")
    args = ap.parse_args(argv)
    if args.price:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        print(price_report(args.price, args.cluster))
        return 0
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print(no_cuda_message("bench/gpu_layer.py"), file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.cpu_dry_run else "cuda")
    dtype = torch.float32 if args.cpu_dry_run else torch.bfloat16
    print(versions(device))
    shapes = DRY_SHAPES if args.cpu_dry_run else {s: SHAPES[s] for s in args.shapes.split(",")}
    seq = 32 if args.cpu_dry_run else args.seq
    rows = []
    print(f"{'shape':9} {'tp':>2} {'mb':>2} {'gemm f/b (ms)':>15} {'TFLOP/s f/b':>13} {'attn f/b (ms)':>15} "
          f"{'layer f/b (ms)':>15} {'recompute +':>11} {'held (MiB)':>11}")
    for name, shape in shapes.items():
        for tp in map(int, args.tp.split(",")):
            for micro in map(int, args.micro.split(",")):
                r = fused_attention(lambda: measure(name, shape, tp, micro, seq, device, dtype, args.repeats), device)
                rows.append(r)
                print(f"{name:9} {tp:2d} {micro:2d} {r['gemm_fwd_s'] * 1e3:7.2f}/{r['gemm_bwd_s'] * 1e3:7.2f} "
                      f"{r['gemm_fwd_tflops']:6.0f}/{r['gemm_bwd_tflops']:6.0f} "
                      f"{r['attn_fwd_s'] * 1e3:7.2f}/{r['attn_bwd_s'] * 1e3:7.2f} "
                      f"{r['layer_fwd_s'] * 1e3:7.2f}/{r['layer_bwd_s'] * 1e3:7.2f} {r['recompute_overhead']:+11.1%} "
                      f"{r['held_bytes'] / 2**20:11.0f}", flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if args.json:  # after each row: a later row's failure keeps what was measured
                    args.json.write_text(json.dumps({"versions": versions(device), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
