"""Every rule a run config must satisfy, checked before any process starts.

Each rule yields a ConfigError naming the field, the value and the rule (with a fix where one
exists). `validate()` raises them all at once so a user fixes a config in one pass.

The rules are pure: what the files a config names hold (a checkpoint folder, a lengths file, token
files, tokenizers, model.hf's config.json and weights) is read first by engine/config/validate_files.py,
and the rules take those values (`check(cfg, files)`). `RunConfig` (engine/config/schema.py) is named in
annotations only: config imports this module to validate what it loads, so this module does not
import config (no import circle).
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterator

from engine.errors import ConfigError, ConfigErrors
from engine.mesh import divisor_hint as _try, divisors, world_product  # noqa: F401  (divisors: tuning's import)
from engine.config.placement import PLACEMENTS, pipeline_out_of_order, rank_order
from engine.config.validate_data import DATA_SOURCES, STREAM_SOURCES, stream_rules
from engine.config.validate_hf import HF_TRAINABLE, hf_rules  # noqa: F401  (HF_TRAINABLE: read by the docs test)

MAX_WORLD_SIZE = 65536
MAX_TIMEOUT_S = 365 * 24 * 3600  # datetime.timedelta (the process-group timeout) overflows far above this
# the names the engine implements, defined here (torch-free) and imported by their implementations:
# engine/comm/compress.py keys its hooks by COMPRESSORS, engine/parallel/pipeline.py its schedules
COMPRESSORS = ("none", "fp16", "bf16", "int8", "topk", "randk", "powersgd")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "looped_bfs", "modular", "zero_bubble", "zbv", "dualpipev", "skip")
V_SCHEDULES = ("zbv", "dualpipev")  # stage ids V-shaped: rank r holds stages r and 2pp-1-r
ZERO_BUBBLE_SCHEDULES = ("zero_bubble", "zbv", "dualpipev")  # split backward: input (I) then weight (W)
VIRTUAL_SCHEDULES = ("interleaved", "looped_bfs", "zero_bubble")  # take parallel.virtual chunks per rank
BIDIRECTIONAL_COMPRESSORS = ("randk", "topk")  # engine/comm/bidirectional.py compresses both legs of these
FSDP_COMPRESSORS = ("randk", "topk")  # engine/comm/fsdp_compress.py: FSDP2's custom reduce-scatter (ZeRO-2/3)
CO2_PENALTIES = ("constant", "relative_gap")  # the paper's constant lambda | our relative-gap variant
MOE_COMPRESSIONS = ("none", "lsh")  # comm.moe_compression: engine/comm/lsh.py
CP_IMPLS = ("ulysses", "ring")  # engine/parallel/context.py
LENGTH_KINDS = ("fixed", "lognormal", "pareto")  # engine/data/lengths.py; any other value names a file


def _positive(field: str, value: float, *, allow_zero: bool = False) -> Iterator[ConfigError]:
    if isinstance(value, float) and not math.isfinite(value):  # nan passes every comparison below
        yield ConfigError(field, value, "must be a finite number")
    elif value < 0 or (value == 0 and not allow_zero):
        yield ConfigError(field, value, "must be >= 0" if allow_zero else "must be > 0")


def _choice(field: str, value: str, choices: tuple[str, ...]) -> Iterator[ConfigError]:
    if value not in choices:
        yield ConfigError(field, value, f"must be one of {', '.join(choices)}")


def _model_rules(cfg: RunConfig, files: Files) -> Iterator[ConfigError]:
    m = cfg.model
    for name in ("layers", "d_model", "heads", "seq_len", "mlp_ratio"):
        yield from _positive(f"model.{name}", getattr(m, name))
    if m.vocab < 2:
        yield ConfigError("model.vocab", m.vocab, "must be >= 2")
    if not 0.0 <= m.dropout < 1.0:
        yield ConfigError("model.dropout", m.dropout, "must be in [0, 1)")
    if m.hf is None and m.heads > 0 and m.d_model > 0 and m.d_model % m.heads:
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


def _data_rules(cfg: RunConfig, files: Files) -> Iterator[ConfigError]:
    d = cfg.data
    yield from _choice("data.source", d.source, DATA_SOURCES)
    yield from _choice("data.split", d.split, ("train", "val"))
    if d.source == "files" and not d.path:
        yield ConfigError("data.path", d.path, "must name a file or folder when data.source=files")
    if not 0.0 < d.val_fraction <= 0.5:
        yield ConfigError("data.val_fraction", d.val_fraction, "must be in (0, 0.5]")
    if d.source in STREAM_SOURCES:
        yield from stream_rules(cfg, files)
    elif d.pack:
        yield ConfigError("data.pack", True, f"needs data.source one of {', '.join(STREAM_SOURCES)} (document "
                          "boundaries come from the data); data.lengths draws packed documents for the others")


def _degree_rules(cfg: RunConfig, files: Files) -> Iterator[ConfigError]:
    p, m = cfg.parallel, cfg.model
    for name in ("dp", "tp", "pp", "virtual"):
        yield from _positive(f"parallel.{name}", getattr(p, name))
    if min(p.dp, p.tp, p.pp) < 1:
        return
    if cfg.world_size > MAX_WORLD_SIZE:
        factors = (p.dp, p.tp, p.pp, p.cp) if p.cp > 1 else (p.dp, p.tp, p.pp)
        degrees = f"{world_product(p.cp)}={'*'.join(map(str, factors))}"
        yield ConfigError("parallel", f"{degrees}={cfg.world_size}",
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


def _pipeline_rules(cfg: RunConfig, files: Files) -> Iterator[ConfigError]:
    p, m = cfg.parallel, cfg.model
    yield from _choice("parallel.schedule", p.schedule, SCHEDULES)
    if p.virtual > 1 and p.schedule not in VIRTUAL_SCHEDULES:
        yield ConfigError("parallel.virtual", p.virtual, f"needs parallel.schedule in {', '.join(VIRTUAL_SCHEDULES)}")
    if p.schedule == "interleaved" and p.pp > 1 and p.virtual < 2:
        yield ConfigError("parallel.virtual", p.virtual, "must be >= 2 for the interleaved schedule")
    yield from _new_schedule_rules(cfg)
    virtual = 2 if p.schedule in V_SCHEDULES else max(p.virtual, 1)  # a V schedule holds 2 chunks per rank
    chunks = p.pp * virtual
    if isinstance(p.layer_split, list):
        if len(p.layer_split) != chunks:
            yield ConfigError("parallel.layer_split", p.layer_split,
                              f"needs pp*virtual = {p.pp}*{virtual} = {chunks} entries")
        elif sum(p.layer_split) != m.layers or min(p.layer_split) < 1:
            yield ConfigError("parallel.layer_split", p.layer_split,
                              f"entries must be >= 1 and sum to model.layers={m.layers}")
    elif p.layer_split is None and m.layers > 0 and p.pp > 0 and m.layers % chunks:
        yield ConfigError("model.layers", m.layers,
                          f"must be divisible by pp*virtual = {p.pp}*{virtual} = {chunks} "
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
        yield from _microbatch_rules(cfg, n_micro)


def _new_schedule_rules(cfg: RunConfig) -> Iterator[ConfigError]:
    """looped_bfs, modular, zero_bubble, zbv, dualpipev and skip (engine/parallel/schedules.py, skippipe.py)."""
    p = cfg.parallel
    if p.schedule in ("modular", "skip") and p.layer_split is not None:
        yield ConfigError("parallel.layer_split", p.layer_split, f"is not used by schedule={p.schedule} (even split); leave it unset")
    if p.schedule in ZERO_BUBBLE_SCHEDULES and p.zero > 0:
        # measured: dp=2 x pp=2 ZeRO-3 zbv drifted 0.04 from the single-process loss by step 3
        yield ConfigError("parallel.zero", p.zero, f"is not supported with schedule={p.schedule} (split I/W backward); use zero=0")
    if not 0.0 <= p.skip_ratio < 1.0:
        yield ConfigError("parallel.skip_ratio", p.skip_ratio, "must be in [0, 1)")
    elif p.skip_ratio > 0 and p.schedule != "skip":
        yield ConfigError("parallel.skip_ratio", p.skip_ratio, "needs parallel.schedule=skip")
    if p.schedule == "skip":
        if p.pp < 3:
            yield ConfigError("parallel.pp", p.pp, "must be >= 3 for schedule=skip (only middle stages are skipped)")
        for name, value in (("tp", p.tp), ("virtual", p.virtual)):
            if value != 1:
                yield ConfigError(f"parallel.{name}", value, "must be 1 with schedule=skip")
        if p.zero > 0:
            yield ConfigError("parallel.zero", p.zero, "must be 0 with schedule=skip (stages are not sharded)")


def _microbatch_rules(cfg: RunConfig, n_micro: int) -> Iterator[ConfigError]:
    p = cfg.parallel
    need = 2 * p.pp if p.schedule == "dualpipev" else p.pp
    if p.schedule in ("modular", "zero_bubble", "zbv", "dualpipev", "looped_bfs", "skip") and n_micro < need:
        yield ConfigError("batch.global", cfg.batch.global_,
                          f"gives {n_micro} micro-batches per pipeline, fewer than the {need} that {p.schedule} "
                          f"needs (global >= dp*micro*{need} = {p.dp * cfg.batch.micro * need})")
    elif p.schedule in ("modular", "zero_bubble") and n_micro % p.pp:
        yield ConfigError("batch.global", cfg.batch.global_,
                          f"gives {n_micro} micro-batches, not a multiple of parallel.pp={p.pp} ({p.schedule})")


def _batch_rules(cfg: RunConfig, files: Files) -> Iterator[ConfigError]:
    b, p = cfg.batch, cfg.parallel
    yield from _positive("batch.global", b.global_)
    yield from _positive("batch.micro", b.micro)
    if b.global_ > 0 and b.micro > 0 and p.dp > 0 and b.global_ % (p.dp * b.micro):
        yield ConfigError("batch.global", b.global_,
                          f"is not divisible by dp*micro = {p.dp}*{b.micro}; "
                          f"try a multiple of {p.dp * b.micro}")


def _train_rules(cfg: RunConfig, files: Files) -> Iterator[ConfigError]:
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


def _comm_rules(cfg: RunConfig, files: Files) -> Iterator[ConfigError]:
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
    if c.compressor not in ("none",) + FSDP_COMPRESSORS and p.zero > 1:
        yield ConfigError("comm.compressor", c.compressor, f"needs parallel.zero=0 or 1 (or randk/topk) with "
                          f"parallel.zero={p.zero}: ZeRO-2/3 run on FSDP2, whose gradient hook "
                          "(set_custom_reduce_scatter) gets a flat buffer of many parameters' shards without their "
                          "shapes (PowerSGD needs each matrix); fp16/bf16 there is FSDP2's MixedPrecisionPolicy, and "
                          "an int8 reduce-scatter is not written")
    if c.bidirectional and p.zero > 1:
        yield ConfigError("comm.bidirectional", True, f"needs parallel.zero=0 or 1, not {p.zero}: under FSDP2 only "
                          "the reduce-scatter carries gradients (compressed with comm.bidirectional=false); the other "
                          "leg all-gathers parameters")
    if c.adaptive and p.zero > 1:
        yield ConfigError("comm.adaptive", True, "needs parallel.zero=0 or 1 (L-GreCo is a DDP comm hook)")
    if c.bidirectional and c.compressor not in BIDIRECTIONAL_COMPRESSORS:
        yield ConfigError("comm.bidirectional", True, f"needs comm.compressor in {', '.join(BIDIRECTIONAL_COMPRESSORS)} "
                          f"(got {c.compressor})")
    if c.bidirectional and c.adaptive:
        yield ConfigError("comm.bidirectional", True, "cannot be combined with comm.adaptive (L-GreCo compresses one leg)")
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
    if resume and not files.resume_is_checkpoint:
        # engine/train/checkpoint.py checks the saved layout (a CO2 checkpoint needs the same dp and tp)
        yield ConfigError("train.resume_from", resume, "must be a checkpoint folder (stepNNNNNN/ holding "
                          "a .metadata file) written by train.checkpoint_interval")
    yield from _positive("link.gbps", cfg.link.gbps, allow_zero=True)
    yield from _positive("link.latency_us", cfg.link.latency_us, allow_zero=True)
    yield from _link_group_rules(cfg)
    d = cfg.ddp
    yield from _positive("ddp.bucket_cap_mb", d.bucket_cap_mb)
    if d.static_graph and cfg.batch.micro > 0 and p.dp > 0 and cfg.batch.global_ % (p.dp * cfg.batch.micro) == 0 \
            and cfg.grad_accum > 1:
        # torch: static_graph with no_sync() before the first step trips an internal assert
        yield ConfigError("ddp.static_graph", True, f"cannot be combined with gradient accumulation ({cfg.grad_accum} micro-batches)")


# a run's or a study's name: it becomes part of run ids, folder names and command lines ("..", "-x" would not do)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")


def name_error(field: str, value: object) -> ConfigError | None:
    """The ConfigError for a run or study name that breaks NAME's rule, else None."""
    if isinstance(value, str) and NAME.fullmatch(value):
        return None
    return ConfigError(field, value, "must be 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit")


def _run_rules(cfg: RunConfig, files: Files) -> Iterator[ConfigError]:
    yield from _choice("precision", cfg.precision, ("fp32", "bf16"))
    yield from _choice("backend", cfg.backend, ("auto", "gloo", "nccl"))
    if (error := name_error("name", cfg.name)) is not None:
        yield error
    yield from _positive("live.every", cfg.live.every, allow_zero=True)
    yield from _positive("live.wait_s", cfg.live.wait_s)
    pr = cfg.profile
    yield from _positive("profile.nvml_interval_s", pr.nvml_interval_s, allow_zero=True)
    yield from _positive("profile.host_interval_s", pr.host_interval_s, allow_zero=True)
    yield from _positive("profile.warmup_steps", pr.warmup_steps, allow_zero=True)
    if pr.trace_steps is not None and (len(pr.trace_steps) != 2 or not 0 <= pr.trace_steps[0] <= pr.trace_steps[1]):
        yield ConfigError("profile.trace_steps", pr.trace_steps, "must be [a, b] with 0 <= a <= b")


SLURM_TIME = re.compile(r"(\d+|\d+:\d+|\d+:\d+:\d+|\d+-\d+|\d+-\d+:\d+|\d+-\d+:\d+:\d+|UNLIMITED|INFINITE)")
LAUNCHERS = ("local", "slurm")  # engine/launch/local.py (torchrun on this machine) | engine/launch/slurm.py (one job per run)


def _cluster_rules(cfg: RunConfig, files: Files) -> Iterator[ConfigError]:
    c, world = cfg.cluster, world_product(cfg.parallel.cp)
    yield from _positive("cluster.nodes", c.nodes)
    yield from _positive("cluster.gpus_per_node", c.gpus_per_node, allow_zero=True)
    yield from _positive("cluster.cpus_per_rank", c.cpus_per_rank)
    yield from _positive("cluster.signal_s", c.signal_s, allow_zero=True)
    if c.nodes > 0 and cfg.world_size % c.nodes:
        yield ConfigError("cluster.nodes", c.nodes, f"must divide the world size {world} = {cfg.world_size}"
                          f"{_try(cfg.world_size)}")
    elif c.nodes > 0 and c.gpus_per_node > 0 and c.nodes * c.gpus_per_node != cfg.world_size:
        yield ConfigError("cluster.gpus_per_node", c.gpus_per_node, f"nodes*gpus_per_node = {c.nodes}*{c.gpus_per_node} "
                          f"= {c.nodes * c.gpus_per_node} must equal the world size {world} = {cfg.world_size} "
                          "(one rank per GPU)")
    if c.time is not None and not SLURM_TIME.fullmatch(c.time):
        yield ConfigError("cluster.time", c.time, "must be a Slurm time limit: MM, MM:SS, HH:MM:SS, D-HH, "
                          "D-HH:MM or D-HH:MM:SS")
    for name in ("partition", "account", "constraint", "telemetry_host"):
        value = getattr(c, name)
        if value is not None and not re.fullmatch(r"[^\s'\"\\#]+", value):
            yield ConfigError(f"cluster.{name}", value, "must be one word: no spaces, quotes, '#' or backslashes")
    for i, line in enumerate(c.sbatch or []):
        if not re.fullmatch(r"--?[A-Za-z][\w-]*(=[^\n]*)?", line):
            yield ConfigError(f"cluster.sbatch[{i}]", line, "must be one sbatch option like --qos=high "
                              "(the '#SBATCH ' prefix is added)")
    for i, line in enumerate(c.setup or []):
        if "\n" in line or "\r" in line:
            yield ConfigError(f"cluster.setup[{i}]", line, "must be one shell line (no line breaks)")


def _moe_rules(cfg: RunConfig, files: Files) -> Iterator[ConfigError]:
    """Mixture-of-Experts and expert parallelism (engine/model/moe.py, engine/parallel/expert.py)."""
    m, p, c = cfg.model, cfg.parallel, cfg.comm
    yield from _positive("model.experts", m.experts, allow_zero=True)
    yield from _positive("model.moe_every", m.moe_every)
    yield from _positive("model.capacity_factor", m.capacity_factor, allow_zero=True)
    yield from _positive("model.aux_loss_coef", m.aux_loss_coef, allow_zero=True)
    yield from _positive("parallel.ep", p.ep)
    yield from _choice("comm.moe_compression", c.moe_compression, MOE_COMPRESSIONS)
    yield from _positive("comm.lsh_hashes", c.lsh_hashes)
    yield from _positive("link.ranks_per_node", cfg.link.ranks_per_node)
    if c.lsh_buckets < 2 or c.lsh_buckets % 2:
        yield ConfigError("comm.lsh_buckets", c.lsh_buckets, "must be an even number >= 2 (2 x the projection width)")
    if m.experts > 0 and not 1 <= m.top_k <= m.experts:
        yield ConfigError("model.top_k", m.top_k, f"must be in [1, model.experts={m.experts}]")
    if m.experts > 0 and m.entry is not None:
        yield ConfigError("model.experts", m.experts, "applies to the built-in GPT only, not model.entry")
    if m.experts > 0 and p.pp > 1:
        yield ConfigError("model.experts", m.experts, "needs parallel.pp=1 (the pipeline schedule's loss "
                          "does not carry the MoE load-balancing loss)")
    if m.experts > 0 and p.sequence_parallel:
        yield ConfigError("parallel.sequence_parallel", True, "is not supported with model.experts > 0 "
                          "(MoE blocks keep experts replicated over tp)")
    if m.experts > 0 and cfg.train.activation_checkpointing:
        yield ConfigError("train.activation_checkpointing", True, "is not supported with model.experts > 0 "
                          "(recomputing a block would route and exchange its tokens again)")
    if p.ep > 1:
        if m.experts == 0 and m.hf is None:
            yield ConfigError("parallel.ep", p.ep, "needs model.experts > 0 (it shards experts)")
        elif m.experts % p.ep:
            yield ConfigError("parallel.ep", p.ep, f"must divide model.experts={m.experts}{_try(m.experts)}")
        if p.dp > 0 and p.dp % p.ep:
            yield ConfigError("parallel.ep", p.ep, f"must divide parallel.dp={p.dp} (ep ranks are carved "
                              f"out of the dp ranks){_try(p.dp)}")
        if p.zero > 0:
            yield ConfigError("parallel.ep", p.ep, "needs parallel.zero=0 (ZeRO would shard expert "
                              "parameters over dp ranks that hold different experts)")
        if c.compressor != "none":
            yield ConfigError("parallel.ep", p.ep, "needs comm.compressor=none (DDP compression hooks would "
                              "see only the dense gradients; experts reduce separately)")
        if cfg.co2.enabled:
            yield ConfigError("parallel.ep", p.ep, "needs co2.enabled=false (CO2 averages every parameter over dp)")
    if c.moe_compression != "none" and p.ep < 2:
        yield ConfigError("comm.moe_compression", c.moe_compression, "needs parallel.ep > 1 (it compresses "
                          "the expert all_to_all)")
    if c.moe_hierarchical:
        if p.ep < 2:
            yield ConfigError("comm.moe_hierarchical", True, "needs parallel.ep > 1")
        elif p.tp > 1:
            yield ConfigError("comm.moe_hierarchical", True, "needs parallel.tp=1 (nodes are split by rank)")
        elif cfg.link.ranks_per_node > 0 and p.ep % cfg.link.ranks_per_node and cfg.link.ranks_per_node % p.ep:
            yield ConfigError("link.ranks_per_node", cfg.link.ranks_per_node,
                              f"must divide parallel.ep={p.ep} for comm.moe_hierarchical{_try(p.ep)}")


def _lengths_rules(cfg: RunConfig, files: Files) -> Iterator[ConfigError]:
    d, p, m = cfg.data, cfg.parallel, cfg.model
    if d.lengths not in LENGTH_KINDS and not files.lengths_is_file:
        yield ConfigError("data.lengths", d.lengths, f"must be one of {', '.join(LENGTH_KINDS)} or a file of lengths")
    yield from _positive("data.length_mean", d.length_mean)
    yield from _positive("data.length_sigma", d.length_sigma)
    if d.length_max < 0 or d.length_max > m.seq_len:
        yield ConfigError("data.length_max", d.length_max, f"must be in [0, model.seq_len={m.seq_len}] "
                          "(positions restart per document; 0 means seq_len)")
    if d.lengths == "fixed":
        return
    if m.entry is not None:
        yield ConfigError("data.lengths", d.lengths, "applies to the built-in GPT, not model.entry")
    if p.pp > 1 or p.sequence_parallel:
        yield ConfigError("data.lengths", d.lengths, "packed documents need parallel.pp=1 and no "
                          "sequence_parallel (their document ids do not cross stage or SP boundaries)")


def _context_rules(cfg: RunConfig, files: Files) -> Iterator[ConfigError]:
    p, m = cfg.parallel, cfg.model
    yield from _positive("parallel.cp", p.cp)
    yield from _choice("parallel.cp_impl", p.cp_impl, CP_IMPLS)
    yield from _positive("parallel.adaptive_time_limit_s", p.adaptive_time_limit_s)
    yield from _positive("parallel.adaptive_buckets", p.adaptive_buckets)
    yield from _positive("parallel.adaptive_token_cap", p.adaptive_token_cap, allow_zero=True)
    if p.cp < 1 or p.tp < 1:
        return
    if p.cp > 1:
        if p.cp_impl == "ulysses" and m.heads > 0 and m.heads % (p.tp * p.cp):
            yield ConfigError("parallel.cp", p.cp, f"with cp_impl=ulysses, tp*cp = {p.tp}*{p.cp} must divide "
                              f"model.heads={m.heads} (each rank attends with heads/(tp*cp) heads){_try(m.heads // p.tp)}")
        if m.seq_len > 0 and m.seq_len % p.cp:
            yield ConfigError("model.seq_len", m.seq_len, f"must be divisible by parallel.cp={p.cp} (equal chunks)")
        # not wired: pipeline stages pass hidden states without their chunk's positions; CO2 and the
        # compression hooks reduce over the dp axis only, while cp gradients need dp x cp (ZeRO shards
        # over dp x cp: engine/parallel/parallelize.py grad_axis)
        for on, name in ((p.pp > 1, "parallel.pp > 1"),
                         (cfg.co2.enabled, "co2.enabled"), (cfg.comm.compressor != "none", "comm.compressor"),
                         (m.entry is not None, "model.entry"), (p.sequence_parallel, "parallel.sequence_parallel"),
                         (m.experts > 0, "model.experts > 0")):
            if on:
                yield ConfigError("parallel.cp", p.cp, f"context parallelism does not combine with {name} here")
        if p.cp_impl == "ring" and (cfg.data.lengths != "fixed" or cfg.data.pack or m.dropout > 0):
            yield ConfigError("parallel.cp_impl", "ring", "has no packed-document masks or attention dropout "
                              "here; use cp_impl=ulysses (or data.lengths=fixed, model.dropout=0)")
    if p.adaptive_sp:
        yield from _adaptive_rules(cfg)


def _adaptive_rules(cfg: RunConfig) -> Iterator[ConfigError]:
    p, m = cfg.parallel, cfg.model
    world = p.dp * p.cp
    if p.tp > 1 or p.pp > 1 or p.zero > 0 or cfg.co2.enabled or cfg.comm.compressor != "none" or m.entry or m.experts:
        yield ConfigError("parallel.adaptive_sp", True, "needs tp=1, pp=1, zero=0, no co2, no compressor and the "
                          "dense built-in GPT (its SP groups replicate the model over all dp*cp ranks)")
    if world & (world - 1):
        yield ConfigError("parallel.adaptive_sp", True, f"needs dp*cp = {world} to be a power of two (FlexSP "
                          "group sizes are powers of two that use every rank)")
    elif m.heads > 0 and m.heads % world:
        yield ConfigError("parallel.adaptive_sp", True, f"needs dp*cp = {world} to divide model.heads={m.heads} "
                          "(a group may span every rank with Ulysses)")
    if p.cp_impl != "ulysses":
        yield ConfigError("parallel.cp_impl", p.cp_impl, "adaptive_sp runs its groups with ulysses")
    if cfg.batch.global_ > 0 and cfg.batch.global_ % world:
        yield ConfigError("batch.global", cfg.batch.global_, f"must be divisible by dp*cp = {world} with adaptive_sp "
                          "(every rank evaluates an equal share of the validation rows, each row whole)")
    if 0 < m.seq_len < 2 * world:
        yield ConfigError("model.seq_len", m.seq_len, f"must be >= 2 * dp*cp = {2 * world} with adaptive_sp "
                          "(each group size is calibrated at two lengths that are multiples of it)")
def _link_group_rules(cfg: RunConfig) -> Iterator[ConfigError]:
    """link.groups (heterogeneous link emulation), parallel.placement and layer_split=auto."""
    ln, p = cfg.link, cfg.parallel
    yield from _choice("parallel.placement", p.placement, PLACEMENTS)
    if isinstance(p.layer_split, str) and p.layer_split != "auto":
        yield ConfigError("parallel.layer_split", p.layer_split, "must be a list of layers per stage or 'auto'")
    if p.layer_split == "auto" and p.pp < 2:
        yield ConfigError("parallel.layer_split", "auto", "needs parallel.pp > 1 (it splits layers across stages)")
    if p.layer_split == "auto" and 0 < cfg.model.layers < p.pp:
        yield ConfigError("parallel.layer_split", "auto", f"needs model.layers={cfg.model.layers} >= parallel.pp={p.pp} "
                          "(every stage keeps a layer)")
    if p.layer_split == "auto" and p.virtual > 1:
        yield ConfigError("parallel.layer_split", "auto", "needs parallel.virtual=1 (one chunk per stage)")
    if p.layer_split == "auto" and p.schedule not in ("gpipe", "1f1b"):
        yield ConfigError("parallel.layer_split", "auto", f"needs parallel.schedule gpipe or 1f1b, not {p.schedule} "
                          "(one chunk per stage, adjacent stages)")
    if p.placement != "naive" and (p.cp > 1 or p.adaptive_sp):
        yield ConfigError("parallel.placement", p.placement, "needs parallel.cp=1 and no adaptive_sp (placement "
                          "orders the (pp, dp, tp) mesh; the cp mesh axis is not placed)")
    if not ln.groups:
        if p.placement == "holmes":
            yield ConfigError("parallel.placement", "holmes", "needs link.groups (it places ranks by group)")
        if ln.inter_gbps or ln.inter_latency_us:
            yield ConfigError("link.inter_gbps", ln.inter_gbps, "applies only with link.groups")
        return
    if ln.gbps > 0:
        yield ConfigError("link.gbps", ln.gbps, "must be 0 with link.groups (each group gives its own gbps)")
    yield from _positive("link.inter_gbps", ln.inter_gbps)
    yield from _positive("link.inter_latency_us", ln.inter_latency_us, allow_zero=True)
    seen: dict[int, str] = {}
    for i, g in enumerate(ln.groups):
        yield from _positive(f"link.groups[{i}].gbps", g.gbps)
        yield from _positive(f"link.groups[{i}].latency_us", g.latency_us, allow_zero=True)
        if not g.ranks:
            yield ConfigError(f"link.groups[{i}].ranks", g.ranks, "must list at least one rank")
        for r in g.ranks:
            if not 0 <= r < cfg.world_size:
                yield ConfigError(f"link.groups[{i}].ranks", g.ranks, f"rank {r} is outside 0..{cfg.world_size - 1}")
            elif r in seen:
                yield ConfigError(f"link.groups[{i}].ranks", g.ranks, f"rank {r} is already in group '{seen[r]}'")
            seen[r] = g.name
    missing = sorted(set(range(cfg.world_size)) - set(seen))
    if missing:
        yield ConfigError("link.groups", [g.name for g in ln.groups], f"must place every rank; {missing} are in no group")
    rpn = ln.ranks_per_node
    blocks = [list(range(s, min(s + rpn, cfg.world_size))) for s in range(0, cfg.world_size, max(rpn, 1))]
    if rpn > 1 and sorted(sorted(g.ranks) for g in ln.groups) != blocks:
        yield ConfigError("link.ranks_per_node", rpn, f"disagrees with link.groups {[list(g.ranks) for g in ln.groups]} "
                          f"(with both set, each group must be {rpn} consecutive ranks); leave ranks_per_node=1 and "
                          "the groups are the nodes")
    if p.placement == "holmes":
        for i, g in enumerate(ln.groups):
            if g.ranks and len(g.ranks) % p.tp:
                yield ConfigError(f"link.groups[{i}].ranks", g.ranks,
                                  f"holmes placement keeps each tp group of parallel.tp={p.tp} ranks in one link "
                                  f"group: the group size {len(g.ranks)} must be a multiple of {p.tp}")
        yield from _holmes_pipelines(cfg)


def _holmes_pipelines(cfg: RunConfig) -> Iterator[ConfigError]:
    """Holmes' pipelines must visit their ranks in increasing order (engine/config/placement.py: torch
    numbers a group's ranks sorted, and stage i runs on the rank numbered i)."""
    p, groups = cfg.parallel, [list(g.ranks) for g in cfg.link.groups]
    if sorted(r for g in groups for r in g) != list(range(cfg.world_size)) or cfg.world_size % (p.pp * p.tp):
        return  # the rules above name these
    order = rank_order(cfg.world_size, placement="holmes", groups=groups, pp=p.pp, tp=p.tp)
    chain = pipeline_out_of_order(order, pp=p.pp, dp=cfg.world_size // (p.pp * p.tp), tp=p.tp)
    if chain:
        yield ConfigError("link.groups", groups, f"holmes placement would run a pipeline's stages on ranks {chain}, "
                          "not in increasing order (torch numbers a group's ranks sorted, so stages would land on "
                          "the wrong ranks): list the link groups in increasing rank order")


RULES = (_model_rules, hf_rules, _data_rules, _degree_rules, _pipeline_rules, _batch_rules, _train_rules,
         _comm_rules, _run_rules, _cluster_rules, _moe_rules, _lengths_rules, _context_rules)


def check(cfg: RunConfig, files: Files | None = None) -> list[ConfigError]:
    """Every rule the config breaks (empty when valid); `files`: what the files it names hold (read
    here by engine/config/validate_files.py when not given)."""
    if files is None:
        from engine.config.validate_files import read_files

        files = read_files(cfg)
    return [err for rule in RULES for err in rule(cfg, files)]


def validate(cfg: RunConfig) -> RunConfig:
    """Raise ConfigErrors listing every broken rule; return the config when valid."""
    errors = check(cfg)
    if errors:
        raise ConfigErrors(errors) if len(errors) > 1 else errors[0]
    return cfg
