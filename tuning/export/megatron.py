"""The Megatron-LM export: a `pretrain_gpt.py` launch whose flags build the run's model in megatron-core
(SwiGLU, RMSNorm, rotary base and llama3 scaling, query groups, head size, biases, untied embeddings,
q/k norms, experts), with the layout, batch, lr schedule, tokenizer and data, and the knobs it cannot
take named beside it.

Checked by megatron-core itself (tests/test_export_megatron.py): the flags parsed the way Megatron-LM
core_v0.16.1 derives them from megatron-core's `TransformerConfig`, mapped as its
`core_transformer_config_from_args` and `gpt_builder` do, build a `GPTModel` whose parameter count is
transformers' for Llama-3.1-8B, Qwen3 and Mixtral-8x7B; with MEGATRON_PATH set, Megatron-LM's own
`parse_args` + `validate_args` read the launch (tests/test_export.py).
"""
from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

from engine.config.schema import RunConfig
from tuning.export.common import engine_only, knob, rope_of, tokenizer_folder

# megatron-core's llama3 rope scaling has these fixed (RotaryEmbedding._apply_scaling's defaults)
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# the factor Megatron-LM's gpt_builder builds with: it passes --use-rope-scaling, not --rope-scaling-factor
_BUILDER_ROPE_FACTOR = 8.0


def _num(x: float) -> str:
    """A number as people write it: 12 significant digits, so 3e-3 * 0.1 prints 0.0003, not float noise."""
    return f"{x:.12g}"


def _flags(pairs: list[tuple[str, Any]]) -> list[str]:
    return [tok for flag, value in pairs for tok in (flag, _num(value) if isinstance(value, float) else str(value))]


def _rope_flags(data: dict[str, Any]) -> tuple[list[str], list[str]]:
    rope, notes = rope_of(data), []
    theta = float(rope["rope_theta"])
    args = ["--position-embedding-type", "rope", "--rotary-base", str(int(theta))]
    if theta != int(theta):
        notes.append(f"rope_theta={theta} (Megatron-LM's --rotary-base is an integer: {int(theta)})")
    kind = rope["rope_type"]
    if kind == "llama3":
        factor = float(rope.get("factor", _BUILDER_ROPE_FACTOR))
        args += ["--use-rope-scaling", "--rope-scaling-factor", _num(factor)]
        fixed = [k for k, v in _LLAMA3_ROPE.items() if float(rope.get(k, v)) != v]
        if fixed:
            notes.append(f"rope_scaling {', '.join(f'{k}={rope[k]}' for k in fixed)} (megatron-core's llama3 "
                         f"scaling fixes {', '.join(f'{k}={_LLAMA3_ROPE[k]:g}' for k in fixed)})")
        if factor != _BUILDER_ROPE_FACTOR:
            notes.append(f"rope_scaling factor={factor:g}: Megatron-LM's gpt_builder (core_v0.16.1) does not pass "
                         f"--rope-scaling-factor to GPTModel, which scales by {_BUILDER_ROPE_FACTOR:g}; pass it in "
                         "your model provider")
    elif kind != "default":
        notes.append(f"rope_scaling rope_type={kind} (Megatron-LM's GPT takes llama3 scaling, or YaRN through "
                     "--position-embedding-type yarn in later versions): exported without it")
    return args, notes


def _bias_flags(shape: Any) -> tuple[list[str], list[str]]:
    """megatron-core has one switch for every linear bias and one for q/k/v: what the family needs."""
    if shape.mlp_bias and shape.o_bias:
        return (["--add-qkv-bias"] if shape.qkv_bias else []), []
    args = ["--disable-bias-linear"] + (["--add-qkv-bias"] if shape.qkv_bias else [])
    if shape.mlp_bias or shape.o_bias:
        which = "mlp_bias" if shape.mlp_bias else "attention output bias"
        return args, [f"{which} (megatron-core adds biases to every linear layer or to none): exported without"]
    return args, []


def _window_flags(data: dict[str, Any], seq_len: int) -> list[str]:
    """The sliding window as megatron-core takes it: --window-size LEFT,0 (transformers lets a token see itself and
    the window - 1 before it) and, where only some layers slide, --window-attn-skip-freq's pattern (1: sliding).
    Nothing where no window is shorter than the sequence (it masks nothing)."""
    from engine.config.hf_fields import sliding_windows

    windows = sliding_windows(data)
    sizes = {w for w in windows if w is not None}
    if not sizes or min(sizes) >= seq_len:
        return []
    args = ["--window-size", f"{min(sizes) - 1},0"]
    if None in windows:
        args += ["--window-attn-skip-freq", str([int(w is not None) for w in windows]).replace(" ", "")]
    return args


def _moe_flags(cfg: RunConfig, shape: Any, data: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Experts, top-k, expert size, shared expert, router and its aux loss, the MoE layer pattern, ep."""
    if not shape.experts:
        return [], []
    if data:
        coeff = float(data.get("router_aux_loss_coef", 0.0) or 0.0)
        # megatron-core routes top-k then softmaxes (= softmax then renormalised top-k, Mixtral's rule);
        # without the renormalisation (qwen2_moe, norm_topk_prob false) it softmaxes first
        pre_softmax = data.get("model_type") != "mixtral" and not data.get("norm_topk_prob", False)
    else:
        coeff, pre_softmax = cfg.model.aux_loss_coef, False
    args = _flags([("--num-experts", shape.experts), ("--moe-router-topk", shape.top_k),
                   ("--moe-ffn-hidden-size", shape.moe_ffn_hidden), ("--moe-aux-loss-coeff", coeff),
                   ("--moe-router-load-balancing-type", "aux_loss" if coeff else "none"),
                   ("--expert-model-parallel-size", cfg.parallel.ep)])
    if len(shape.moe_layers) != shape.layers:
        pattern = [1 if i in shape.moe_layers else 0 for i in range(shape.layers)]
        args += ["--moe-layer-freq", str(pattern).replace(" ", "")]
    if shape.shared_ffn_hidden:
        args += ["--moe-shared-expert-intermediate-size", str(shape.shared_ffn_hidden), "--moe-shared-expert-gate"]
    if pre_softmax:
        args.append("--moe-router-pre-softmax")
    # megatron-core's recipes for Mixtral / Qwen-MoE: grouped GEMM experts, all-to-all token dispatch (its default,
    # allgather, gathers every token on every expert rank)
    args += ["--moe-grouped-gemm", "--moe-token-dispatcher-type", knob(cfg, "moe_dispatcher", "alltoall")]
    if not data and cfg.model.capacity_factor:  # the workbench GPT's experts drop tokens past their capacity
        args += ["--moe-expert-capacity-factor", _num(cfg.model.capacity_factor)]
    return args, []


def model_flags(cfg: RunConfig) -> tuple[list[str], list[str]]:
    """The flags of the model's architecture (megatron-core builds the same parameters), and what differs."""
    from engine.model.shapes import from_gpt, from_hf_config, read_hf_config

    m, p = cfg.model, cfg.parallel
    data = read_hf_config(m.hf) if m.hf is not None else {}
    shape = from_hf_config(data) if data else from_gpt(layers=m.layers, d_model=m.d_model, heads=m.heads,
                                                        seq_len=m.seq_len, vocab=m.vocab, mlp_ratio=m.mlp_ratio,
                                                        experts=m.experts, top_k=m.top_k, moe_every=m.moe_every)
    args = _flags([("--num-layers", shape.layers), ("--hidden-size", shape.hidden),
                   ("--ffn-hidden-size", shape.ffn_hidden), ("--num-attention-heads", shape.heads),
                   ("--kv-channels", shape.head_dim), ("--seq-length", m.seq_len)])
    notes: list[str] = []
    if shape.kv_heads != shape.heads:
        args += ["--group-query-attention", "--num-query-groups", str(shape.kv_heads)]
    if data:
        max_pos = max(m.seq_len, int(data.get("max_position_embeddings") or m.seq_len))
        args += _flags([("--max-position-embeddings", max_pos), ("--normalization", "RMSNorm"),
                        ("--norm-epsilon", float(data.get("rms_norm_eps", 1e-6))),
                        ("--init-method-std", float(data.get("initializer_range", 0.02)))])
        args.append("--swiglu")
        rope, note = _rope_flags(data)
        args += rope + _window_flags(data, m.seq_len)
        notes += note
        if shape.qk_norm:
            args.append("--qk-layernorm")
    else:  # the workbench GPT: learned positions, LayerNorm, GELU (Megatron's defaults)
        args += _flags([("--max-position-embeddings", m.seq_len), ("--position-embedding-type", "learned_absolute")])
    bias, note = _bias_flags(shape)
    args += bias
    notes += note
    if not shape.tied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    moe, note = _moe_flags(cfg, shape, data)
    args += moe
    notes += note
    if shape.vocab % p.tp:
        notes.append(f"vocab_size={shape.vocab} is not divisible by parallel.tp={p.tp}: Megatron-LM pads the "
                     "embedding to a multiple of 128 * tp")
    else:  # the model's own vocabulary rows, not the tokenizer's length padded to 128 * tp
        args += ["--padded-vocab-size", str(shape.vocab)]
    return args, notes


def _data_flags(cfg: RunConfig) -> tuple[list[str], list[str], list[str]]:
    """(flags, shell lines to run first, notes): the tokenizer, --data-path and --split."""
    d, m = cfg.data, cfg.model
    tok = tokenizer_folder(cfg)
    args = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok] if tok else \
        ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(m.vocab - 1)]  # + its end-of-document id
    notes = [] if tok else [f"tokenizer: none given (data.tokenizer); a null tokenizer of {m.vocab} ids"]
    val = max(1, round(100 * d.val_fraction))
    split = ["--split", f"{100 - val},{val},0"]
    if d.source == "megatron":
        path = os.path.abspath(d.path or "")
        prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
        notes.append("data order: Megatron-LM shuffles the documents of --data-path (its GPTDataset index); "
                     "the workbench reads them in order")
        return args + ["--data-path", str(prefix)] + split, [], notes
    if d.source == "hf" and d.path and tok:
        prefix = str(Path(os.path.abspath(d.path)).with_suffix("")) + "_megatron"
        convert = shlex.join(["python", "tools/preprocess_data.py", "--input", os.path.abspath(d.path),
                              "--output-prefix", prefix,
                              "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok, "--json-keys",
                              d.text_field, "--append-eod", "--workers", "8"])
        first = [f"[ -f {shlex.quote(prefix + '_' + d.text_field + '_document.bin')} ] || {convert}"]
        notes.append(f"data.source=hf ({d.path}): converted once to a Megatron indexed dataset by Megatron-LM's "
                     "tools/preprocess_data.py (first line of the script); Megatron-LM shuffles its documents")
        return args + ["--data-path", f"{prefix}_{d.text_field}_document"] + split, first, notes
    if d.source in ("tokens", "hf", "files"):
        notes.append(f"data.source={d.source} (Megatron-LM reads indexed .bin/.idx datasets: convert "
                     f"{d.path or 'the data'} with its tools/preprocess_data.py; exported with --mock-data)")
    else:
        notes.append(f"data.source={d.source} (the workbench's own data; exported with --mock-data)")
    return args + ["--mock-data"], [], notes


def _schedule_flags(cfg: RunConfig) -> tuple[list[str], list[str]]:
    t = cfg.train
    args = _flags([("--train-iters", t.steps), ("--lr", t.lr), ("--min-lr", t.lr * t.min_lr_ratio),
                   ("--lr-warmup-iters", t.warmup_steps), ("--lr-decay-style", t.schedule),
                   ("--weight-decay", t.weight_decay), ("--adam-beta1", t.beta1), ("--adam-beta2", t.beta2),
                   ("--clip-grad", t.grad_clip), ("--seed", t.seed)])
    notes = []
    if t.warmup_steps:  # OptimizerParamScheduler: lr * iteration / warmup, the run lr * (step + 1) / warmup
        notes.append(f"lr warm-up: Megatron-LM starts at 0 and reaches the peak one step after the run; the "
                     f"{t.schedule} decay matches from step {t.warmup_steps}")
    if cfg.model.hf_weights:
        notes.append(f"model.hf_weights={cfg.model.hf_weights}: Megatron-LM loads its own checkpoints; convert "
                     "with its tools/checkpoint/convert.py (--loader llama_mistral --saver core), then --load DIR "
                     "--finetune")
    return args, notes


def _layout_flags(cfg: RunConfig) -> tuple[list[str], list[str]]:
    p, t, b, m = cfg.parallel, cfg.train, cfg.batch, cfg.model
    args = _flags([("--tensor-model-parallel-size", p.tp), ("--pipeline-model-parallel-size", p.pp),
                   ("--micro-batch-size", b.micro), ("--global-batch-size", b.global_),
                   ("--attention-dropout", m.dropout), ("--hidden-dropout", m.dropout)])
    if p.cp > 1:
        args += ["--context-parallel-size", str(p.cp)]
    if p.sequence_parallel:
        args.append("--sequence-parallel")
    if p.virtual > 1:
        args += ["--num-layers-per-virtual-pipeline-stage", str(m.layers // (p.pp * p.virtual))]
    if t.activation_checkpointing:
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if cfg.precision == "bf16":
        args.append("--bf16")
    if p.zero >= 1:
        args.append("--use-distributed-optimizer")  # Megatron's ZeRO-1 equivalent
    if t.eval_interval:
        args += ["--eval-interval", str(t.eval_interval)]
    notes = []
    if p.zero >= 2:
        notes.append(f"parallel.zero={p.zero} (Megatron shards optimizer state only: ZeRO-1)")
    if p.pp > 1 and p.schedule not in ("1f1b", "interleaved"):
        notes.append(f"parallel.schedule={p.schedule} (Megatron runs 1F1B, interleaved with virtual stages)")
    if p.cp > 1 and p.cp_impl == "ulysses":
        notes.append("parallel.cp_impl=ulysses (Megatron's context parallelism is a ring: --cp-comm-type p2p)")
    return args, notes


# Megatron-LM's --attention-backend for the plan's attention kernel (AttnBackend: fused is Transformer Engine's
# cuDNN attention, flash is FlashAttention-2, unfused the materialised softmax)
ATTENTION_BACKENDS = {"cudnn": "fused", "fa2": "flash", "unfused": "unfused"}


def knob_flags(knobs: dict[str, Any] | None) -> list[str]:
    """The flags of what a plan priced a layout with beyond its run config (tuning/plan.py plan_knobs): the
    attention kernel, tp communication under the GEMMs, selective recompute, the fused loss, the distributed
    optimizer's overlapped reductions and gathers, FP8 through Transformer Engine."""
    if not knobs:
        return []
    args = ["--attention-backend", ATTENTION_BACKENDS[knobs["attention"]]] if knobs.get("attention") else []
    if knobs.get("recompute") == "selective":
        args += ["--recompute-granularity", "selective"]
    if knobs.get("tp_comm_overlap"):
        args.append("--tp-comm-overlap")
    if knobs.get("fused_loss"):
        args.append("--cross-entropy-loss-fusion")
    if knobs.get("overlap_param_gather"):
        args += ["--overlap-grad-reduce", "--overlap-param-gather"]
    if knobs.get("precision") == "fp8":
        args += ["--fp8-format", "hybrid"]
    return args


def megatron_args(cfg: RunConfig, knobs: dict[str, Any] | None = None) -> tuple[list[str], list[str]]:
    """Megatron-LM pretrain_gpt.py arguments (one token each), and what the export does not carry; `knobs`: what a
    plan priced the layout with (`knob_flags`)."""
    args, notes = [], []
    for part in (model_flags, _layout_flags, _schedule_flags):
        a, n = part(cfg)
        args += a
        notes += n
    data, _, note = _data_flags(cfg)
    return args + knob_flags(knobs) + data, notes + note + engine_only(cfg, "Megatron-LM")


def megatron_command(cfg: RunConfig, knobs: dict[str, Any] | None = None) -> list[str]:
    """The full launch: torchrun with WORLD_SIZE = dp*tp*pp*cp, then pretrain_gpt.py and its args."""
    # Megatron asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with tensor parallelism before Blackwell; its examples set it
    nodes = max(1, cfg.cluster.nodes)
    where = ["--nnodes=1", "--standalone"] if nodes == 1 else \
        [f"--nnodes={nodes}", "--node-rank=$NODE_RANK", "--rdzv-backend=c10d", "--rdzv-endpoint=$MASTER_ADDR:29500"]
    launcher = ["CUDA_DEVICE_MAX_CONNECTIONS=1", "torchrun", f"--nproc-per-node={cfg.world_size // nodes}", *where,
                "pretrain_gpt.py"]
    return launcher + megatron_args(cfg, knobs)[0]


def megatron_script(cfg: RunConfig, knobs: dict[str, Any] | None = None) -> str:
    """The Megatron-LM launch as a shell script (run from a Megatron-LM checkout), unmapped knobs as comments."""
    args, unmapped = megatron_args(cfg, knobs)
    note = "".join(f"# not mapped: {u}\n" for u in unmapped)
    nodes = max(1, cfg.cluster.nodes)
    multi = (f"# on N nodes: --nproc-per-node={cfg.world_size}/N --nnodes=N --node-rank=I "
             "--rdzv-backend=c10d --rdzv-endpoint=HOST:PORT instead of --nnodes=1 --standalone\n") if nodes == 1 else \
        f"# on each of the {nodes} nodes, with NODE_RANK (0..{nodes - 1}) and MASTER_ADDR (node 0) set\n"
    first = "".join(line + "\n" for line in _data_flags(cfg)[1])
    cmd = megatron_command(cfg, knobs)
    i = cmd.index("pretrain_gpt.py") + 1
    lines = [" ".join(cmd[:i])]  # VAR=1 must stay unquoted to be an assignment; $NODE_RANK expands
    while i < len(cmd):  # one flag and its value per line
        j = i + 1 if i + 1 == len(cmd) or cmd[i + 1].startswith("--") else i + 2
        lines.append(shlex.join(cmd[i:j]))
        i = j
    return note + multi + first + " \\\n  ".join(lines) + "\n"
