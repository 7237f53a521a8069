"""Every rule a run config must satisfy, checked before any process starts.

Each rule yields a ConfigError naming the field, the value and the rule (with a fix where one
exists). `validate()` raises them all at once so a user fixes a config in one pass.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import ConfigError, ConfigErrors

if TYPE_CHECKING:
    from engine.config import RunConfig

MAX_WORLD_SIZE = 65536
MAX_TIMEOUT_S = 365 * 24 * 3600  # datetime.timedelta (the process-group timeout) overflows far above this
# the names the engine implements, defined here (torch-free) and imported by their implementations:
# engine/comm/compress.py keys its hooks by COMPRESSORS, engine/parallel/pipeline.py its schedules
COMPRESSORS = ("none", "fp16", "bf16", "int8", "topk", "randk", "powersgd")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
CO2_PENALTIES = ("constant", "relative_gap")  # the paper's constant lambda | our relative-gap variant


def divisors(n: int) -> list[int]:
    """The positive divisors of n in increasing order (O(sqrt n)); [] for n < 1."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0] if n >= 1 else []
    return sorted(set(small + [n // d for d in small]))


def _try(n: int) -> str:
    ds = [str(d) for d in divisors(n)] if 0 < n <= 100000 else []
    if len(ds) > 8:
        ds = ds[:7] + ["…", ds[-1]]
    return f"; try {', '.join(ds)}" if ds else ""


def _positive(field: str, value: float, *, allow_zero: bool = False) -> Iterator[ConfigError]:
    if isinstance(value, float) and not math.isfinite(value):  # nan passes every comparison below
        yield ConfigError(field, value, "must be a finite number")
    elif value < 0 or (value == 0 and not allow_zero):
        yield ConfigError(field, value, "must be >= 0" if allow_zero else "must be > 0")


def _choice(field: str, value: str, choices: tuple[str, ...]) -> Iterator[ConfigError]:
    if value not in choices:
        yield ConfigError(field, value, f"must be one of {', '.join(choices)}")


def _model_rules(cfg: RunConfig) -> Iterator[ConfigError]:
    m = cfg.model
    for name in ("layers", "d_model", "heads", "seq_len", "mlp_ratio"):
        yield from _positive(f"model.{name}", getattr(m, name))
    if m.vocab < 2:
        yield ConfigError("model.vocab", m.vocab, "must be >= 2")
    if not 0.0 <= m.dropout < 1.0:
        yield ConfigError("model.dropout", m.dropout, "must be in [0, 1)")
    if m.heads > 0 and m.d_model > 0 and m.d_model % m.heads:
        yield ConfigError("model.d_model", m.d_model, f"must be divisible by model.heads={m.heads}")
    if m.entry is not None and not re.fullmatch(r"[\w.]+:\w+", m.entry):
        yield ConfigError("model.entry", m.entry, "must look like 'package.module:function'")
    if m.entry is not None and (cfg.parallel.tp > 1 or cfg.parallel.pp > 1):
        yield ConfigError("model.entry", m.entry, "a user model runs with data parallel and ZeRO only: "
                          "set parallel.tp=1 and parallel.pp=1")
    if m.entry is not None and cfg.train.activation_checkpointing:
        yield ConfigError("train.activation_checkpointing", True, "applies to the built-in GPT only, not model.entry")
    if cfg.data.source in ("text", "files") and m.entry is None and 0 < m.vocab < 256:
        yield ConfigError("model.vocab", m.vocab, f"must be >= 256 for byte-level data.source={cfg.data.source}")


def _data_rules(cfg: RunConfig) -> Iterator[ConfigError]:
    d = cfg.data
    yield from _choice("data.source", d.source, ("text", "synthetic", "files"))
    yield from _choice("data.split", d.split, ("train", "val"))
    if d.source == "files" and not d.path:
        yield ConfigError("data.path", d.path, "must name a file or folder when data.source=files")
    if not 0.0 < d.val_fraction <= 0.5:
        yield ConfigError("data.val_fraction", d.val_fraction, "must be in (0, 0.5]")


def _degree_rules(cfg: RunConfig) -> Iterator[ConfigError]:
    p, m = cfg.parallel, cfg.model
    for name in ("dp", "tp", "pp", "virtual"):
        yield from _positive(f"parallel.{name}", getattr(p, name))
    if min(p.dp, p.tp, p.pp) < 1:
        return
    if cfg.world_size > MAX_WORLD_SIZE:
        yield ConfigError("parallel", f"dp*tp*pp={p.dp}*{p.tp}*{p.pp}={cfg.world_size}",
                          f"world size must be <= {MAX_WORLD_SIZE}")
    if not 0 <= p.zero <= 3:
        yield ConfigError("parallel.zero", p.zero, "ZeRO stage must be 0, 1, 2 or 3")
    if m.heads > 0 and m.heads % p.tp:
        yield ConfigError("parallel.tp", p.tp, f"must divide model.heads={m.heads}{_try(m.heads)}")
    elif m.d_model > 0 and m.d_model % p.tp:
        yield ConfigError("parallel.tp", p.tp, f"must divide model.d_model={m.d_model}{_try(m.d_model)}")
    if p.sequence_parallel and p.tp == 1:
        yield ConfigError("parallel.sequence_parallel", True, "needs parallel.tp > 1 (it shards over tp)")
    if p.sequence_parallel and m.seq_len % p.tp:
        yield ConfigError("model.seq_len", m.seq_len, f"must be divisible by parallel.tp={p.tp} with sequence_parallel")


def _pipeline_rules(cfg: RunConfig) -> Iterator[ConfigError]:
    p, m = cfg.parallel, cfg.model
    yield from _choice("parallel.schedule", p.schedule, SCHEDULES)
    if p.virtual > 1 and p.schedule != "interleaved":
        yield ConfigError("parallel.virtual", p.virtual, "needs parallel.schedule=interleaved")
    if p.schedule == "interleaved" and p.pp > 1 and p.virtual < 2:
        yield ConfigError("parallel.virtual", p.virtual, "must be >= 2 for the interleaved schedule")
    chunks = p.pp * max(p.virtual, 1)
    if p.layer_split is not None:
        if len(p.layer_split) != chunks:
            yield ConfigError("parallel.layer_split", p.layer_split,
                              f"needs pp*virtual = {p.pp}*{p.virtual} = {chunks} entries")
        elif sum(p.layer_split) != m.layers or min(p.layer_split) < 1:
            yield ConfigError("parallel.layer_split", p.layer_split,
                              f"entries must be >= 1 and sum to model.layers={m.layers}")
    elif m.layers > 0 and p.pp > 0 and m.layers % chunks:
        yield ConfigError("model.layers", m.layers,
                          f"must be divisible by pp*virtual = {p.pp}*{p.virtual} = {chunks} "
                          "(or give parallel.layer_split)")
    if p.pp > 1 and cfg.batch.micro > 0 and p.dp > 0 and cfg.batch.global_ % (p.dp * cfg.batch.micro) == 0:
        n_micro = cfg.grad_accum
        if p.schedule in ("1f1b", "interleaved") and n_micro < p.pp:
            yield ConfigError("batch.global", cfg.batch.global_,
                              f"gives {n_micro} micro-batches per pipeline, fewer than parallel.pp={p.pp} "
                              f"that {p.schedule} needs (global >= dp*micro*pp = {p.dp * cfg.batch.micro * p.pp})")
        if p.schedule == "interleaved" and n_micro % p.pp:
            yield ConfigError("batch.global", cfg.batch.global_,
                              f"gives {n_micro} micro-batches, not a multiple of parallel.pp={p.pp} (interleaved)")


def _batch_rules(cfg: RunConfig) -> Iterator[ConfigError]:
    b, p = cfg.batch, cfg.parallel
    yield from _positive("batch.global", b.global_)
    yield from _positive("batch.micro", b.micro)
    if b.global_ > 0 and b.micro > 0 and p.dp > 0 and b.global_ % (p.dp * b.micro):
        yield ConfigError("batch.global", b.global_,
                          f"is not divisible by dp*micro = {p.dp}*{b.micro}; "
                          f"try a multiple of {p.dp * b.micro}")


def _train_rules(cfg: RunConfig) -> Iterator[ConfigError]:
    t = cfg.train
    yield from _positive("train.steps", t.steps)
    yield from _positive("train.lr", t.lr)
    yield from _positive("train.timeout_s", t.timeout_s)
    if math.isfinite(t.timeout_s) and t.timeout_s > MAX_TIMEOUT_S:
        yield ConfigError("train.timeout_s", t.timeout_s, f"must be <= {MAX_TIMEOUT_S} (one year)")
    for name in ("seed", "warmup_steps", "weight_decay", "grad_clip", "eval_interval", "checkpoint_interval"):
        yield from _positive(f"train.{name}", getattr(t, name), allow_zero=True)
    yield from _positive("train.eval_batches", t.eval_batches)
    yield from _choice("train.schedule", t.schedule, ("cosine", "constant", "linear"))
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        yield ConfigError("train.min_lr_ratio", t.min_lr_ratio, "must be in [0, 1]")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(t, name) < 1.0:
            yield ConfigError(f"train.{name}", getattr(t, name), "must be in [0, 1)")


def _comm_rules(cfg: RunConfig) -> Iterator[ConfigError]:
    c, o, p = cfg.comm, cfg.co2, cfg.parallel
    yield from _choice("comm.compressor", c.compressor, COMPRESSORS)
    if not 0.0 < c.density <= 1.0:
        yield ConfigError("comm.density", c.density, "must be in (0, 1]")
    yield from _positive("comm.rank", c.rank)
    yield from _positive("comm.error_budget", c.error_budget)
    yield from _positive("comm.adaptive_interval", c.adaptive_interval)
    if c.adaptive and c.compressor != "topk":
        yield ConfigError("comm.adaptive", True, "needs comm.compressor=topk (L-GreCo over Top-k densities)")
    if c.compressor != "none" and (p.tp > 1 or p.pp > 1):
        yield ConfigError("comm.compressor", c.compressor, "needs parallel.tp=1 and parallel.pp=1 "
                          "(compressors are DDP comm hooks; DP over TP/PP does not use DDP)")
    if p.zero == 1 and p.pp > 1:
        yield ConfigError("parallel.zero", 1, "use ZeRO stage 2 or 3 with parallel.pp > 1 (stage 1 shards a DDP optimizer)")
    if c.compressor != "none" and p.zero > 0:
        yield ConfigError("comm.compressor", c.compressor, "needs parallel.zero=0 (compressors are DDP comm hooks)")
    yield from _positive("co2.tau", o.tau)
    yield from _positive("co2.outer_lr", o.outer_lr)
    yield from _positive("co2.clip", o.clip, allow_zero=True)
    if not 0.0 <= o.outer_momentum < 1.0:
        yield ConfigError("co2.outer_momentum", o.outer_momentum, "must be in [0, 1)")
    if o.enabled and (p.zero > 0 or c.compressor != "none"):
        yield ConfigError("co2.enabled", True, "needs parallel.zero=0 and comm.compressor=none")
    if o.enabled and p.pp > 1:
        yield ConfigError("co2.enabled", True, "needs parallel.pp=1")
    yield from _choice("co2.penalty", o.penalty, CO2_PENALTIES)
    yield from _positive("co2.gap_penalty", o.gap_penalty)
    resume = cfg.train.resume_from
    if resume and not (Path(resume) / ".metadata").is_file():
        # engine/checkpoint.py checks the saved layout (a CO2 checkpoint needs the same dp and tp)
        yield ConfigError("train.resume_from", resume, "must be a checkpoint folder (stepNNNNNN/ holding "
                          "a .metadata file) written by train.checkpoint_interval")
    yield from _positive("link.gbps", cfg.link.gbps, allow_zero=True)
    yield from _positive("link.latency_us", cfg.link.latency_us, allow_zero=True)
    d = cfg.ddp
    yield from _positive("ddp.bucket_cap_mb", d.bucket_cap_mb)
    if d.static_graph and cfg.batch.micro > 0 and p.dp > 0 and cfg.batch.global_ % (p.dp * cfg.batch.micro) == 0 \
            and cfg.grad_accum > 1:
        # torch: static_graph with no_sync() before the first step trips an internal assert
        yield ConfigError("ddp.static_graph", True, f"cannot be combined with gradient accumulation ({cfg.grad_accum} micro-batches)")


def _run_rules(cfg: RunConfig) -> Iterator[ConfigError]:
    yield from _choice("precision", cfg.precision, ("fp32", "bf16"))
    yield from _choice("backend", cfg.backend, ("auto", "gloo", "nccl"))
    if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", cfg.name):
        yield ConfigError("name", cfg.name, "must be 1-64 letters, digits, '_', '.' or '-'")
    yield from _positive("live.every", cfg.live.every, allow_zero=True)
    yield from _positive("live.wait_s", cfg.live.wait_s)
    pr = cfg.profile
    yield from _positive("profile.nvml_interval_s", pr.nvml_interval_s, allow_zero=True)
    yield from _positive("profile.host_interval_s", pr.host_interval_s, allow_zero=True)
    yield from _positive("profile.warmup_steps", pr.warmup_steps, allow_zero=True)
    if pr.trace_steps is not None and (len(pr.trace_steps) != 2 or not 0 <= pr.trace_steps[0] <= pr.trace_steps[1]):
        yield ConfigError("profile.trace_steps", pr.trace_steps, "must be [a, b] with 0 <= a <= b")


RULES = (_model_rules, _data_rules, _degree_rules, _pipeline_rules, _batch_rules, _train_rules,
         _comm_rules, _run_rules)


def check(cfg: RunConfig) -> list[ConfigError]:
    """Every rule the config breaks (empty when valid)."""
    return [err for rule in RULES for err in rule(cfg)]


def validate(cfg: RunConfig) -> RunConfig:
    """Raise ConfigErrors listing every broken rule; return the config when valid."""
    errors = check(cfg)
    if errors:
        raise ConfigErrors(errors) if len(errors) > 1 else errors[0]
    return cfg
