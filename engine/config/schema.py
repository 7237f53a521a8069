"""The run configuration: typed dataclasses, YAML loading, `--set` overrides and validation.

Key names are a contract shared by docs, tests, the tuner, the simulator and exported configs:
`model.{layers,d_model,heads,seq_len,vocab}`, `parallel.{dp,tp,pp,zero}`, `batch.{global,micro}`,
`train.{steps,lr,seed}`, `precision`, `backend`, `comm.*`, `co2.*`, `link.*`.
The number of processes is the product of the parallel degrees, never a key of its own.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.errors import ConfigError
from engine.mesh import world_size


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """A GPT-style decoder-only transformer, or a user model named by `entry`."""

    layers: int = 2  # transformer blocks
    d_model: int = 64  # hidden size
    heads: int = 4  # attention heads
    seq_len: int = 64  # tokens per sample
    vocab: int = 256  # vocabulary size (256 = bytes)
    dropout: float = 0.0  # dropout probability
    mlp_ratio: int = 4  # MLP hidden = mlp_ratio * d_model
    entry: str | None = None  # "module:function" returning (model, train_dataset); imported only when set
    experts: int = 0  # Mixture-of-Experts: experts per MoE block; 0 = dense MLPs (engine/model/moe.py)
    moe_every: int = 1  # every moe_every-th block is MoE (1 = all, 2 = every other, as GShard)
    top_k: int = 2  # experts each token is routed to
    capacity_factor: float = 1.25  # expert capacity = factor * tokens * top_k / experts; 0 = no dropping
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss (Switch Transformer)
    hf: str | dict[str, Any] | None = None  # a Hugging Face causal LM (engine/model/hf.py): a config.json path (or
    # folder) or an inline mapping with model_type; then layers/d_model/heads/vocab are read from it
    hf_weights: str | None = None  # a local folder of safetensors to load into model.hf (random init when unset)
    # (model, train_dataset, step_fn) also works: step_fn(model, inputs, targets, lr) -> loss tensor runs
    # the whole optimizer step itself (examples/minmax.py: extragradient); the engine's AdamW is not stepped


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where tokens come from."""

    source: str = "text"  # text (byte-level stdlib corpus) | synthetic (random tokens) | files | tokens | megatron | hf
    # files: a file or folder of text read as bytes; tokens: a flat uint16/uint32 token file (nanoGPT
    # train.bin); megatron: the prefix of an indexed dataset (prefix.bin + prefix.idx); hf: a jsonl / json /
    # parquet / arrow / txt file or folder (engine/data/sources.py)
    path: str | None = None
    dtype: str = "uint16"  # tokens: the id type of the file, uint16 | uint32
    tokenizer: str | None = None  # hf: a tokenizer.json or a tokenizer folder (read offline)
    text_field: str = "text"  # hf: the record field holding the text
    eos_id: int = -1  # tokens: the id that ends a document; hf: appended to each document; -1: none
    pack: bool = False  # tokens | megatron | hf: attention stays inside each document, positions restart
    val_fraction: float = 0.05  # share of the corpus held out for validation
    split: str = "train"  # which split training reads (train | val)
    lengths: str = "fixed"  # fixed (every sample seq_len) | lognormal | pareto (long tail) | a file of lengths
    length_mean: float = 0.25  # lognormal: median length as a fraction of seq_len; pareto: the minimum
    length_sigma: float = 1.0  # lognormal sigma (spread); pareto: the shape alpha (smaller = longer tail)
    length_max: int = 0  # longest document in tokens; 0 = model.seq_len


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Parallel degrees and layout. World size = dp * tp * pp * cp."""

    dp: int = 1  # data-parallel degree
    tp: int = 1  # tensor-parallel degree
    pp: int = 1  # pipeline-parallel degree
    zero: int = 0  # ZeRO stage 0-3 (sharded data parallel)
    sequence_parallel: bool = False  # shard norms/dropout over tp
    schedule: str = "1f1b"  # pipeline schedule: one of engine.config.validate.SCHEDULES
    virtual: int = 1  # virtual stages (model chunks) per pipeline rank: interleaved, looped_bfs, zero_bubble
    layer_split: list[int] | str | None = None  # layers per pipeline stage; even split when unset;
    # "auto": split by the measured speed of each stage's rank group (Holmes' self-adapting partition)
    reshard_after_forward: bool = True  # ZeRO-3: free gathered params after forward
    ep: int = 1  # expert-parallel degree: experts sharded over ep ranks carved out of dp (ep divides dp)
    cp: int = 1  # context-parallel degree: each sequence sharded over cp ranks (world = dp*tp*pp*cp)
    cp_impl: str = "ulysses"  # ulysses (all-to-all seq<->heads) | ring (K/V blocks around the cp ring)
    adaptive_sp: bool = False  # FlexSP: per step, sequences go to SP groups of solver-chosen sizes
    adaptive_time_limit_s: float = 0.5  # FlexSP MILP time limit per step
    adaptive_buckets: int = 8  # FlexSP length buckets per step
    adaptive_token_cap: int = 0  # FlexSP memory cap in tokens per rank; 0 = twice an even share of the step
    placement: str = "naive"  # naive: rank order | holmes: pp spans link.groups, tp (and dp where it fits) inside one
    skip_ratio: float = 0.0  # schedule=skip (SkipPipe): fraction of the middle stages a micro-batch skips


@dataclass(kw_only=True, slots=True)
class BatchConfig:
    """Global batch in samples; accumulation = global / (dp * micro) is derived, never set."""

    global_: int = 8  # samples per optimizer step across all dp ranks (YAML key: global)
    micro: int = 4  # samples per forward/backward on one rank


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The training loop."""

    steps: int = 10  # optimizer steps
    lr: float = 1e-3  # peak learning rate
    seed: int = 0  # seeds model init, data order and dropout
    warmup_steps: int = 0  # linear warmup steps
    schedule: str = "cosine"  # lr schedule after warmup: cosine | constant | linear
    min_lr_ratio: float = 0.1  # final lr as a fraction of lr
    weight_decay: float = 0.0  # AdamW weight decay
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    activation_checkpointing: bool = False  # recompute each block in backward
    eval_interval: int = 0  # steps between val-loss evaluations; 0 disables
    eval_batches: int = 2  # micro-batches per evaluation
    checkpoint_interval: int = 0  # steps between checkpoints; 0 disables
    checkpoint_dir: str | None = None  # where checkpoints go (default: the run folder)
    resume_from: str | None = None  # checkpoint file to resume from
    timeout_s: float = 120.0  # process-group timeout: a hung collective fails after this


@dataclass(kw_only=True, slots=True)
class DDPConfig:
    """DistributedDataParallel overlap settings."""

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    find_unused_parameters: bool = False
    broadcast_buffers: bool = False


@dataclass(kw_only=True, slots=True)
class CommConfig:
    """Gradient compression (DDP communication hooks)."""

    compressor: str = "none"  # none | fp16 | bf16 | int8 | topk | randk | powersgd
    density: float = 0.01  # kept fraction for topk / randk
    rank: int = 4  # PowerSGD rank
    adaptive: bool = False  # layer-wise adaptive levels (L-GreCo)
    error_budget: float = 1.0  # adaptive: total error allowed, relative to the uniform level
    adaptive_interval: int = 50  # adaptive: steps between re-solving levels
    moe_hierarchical: bool = False  # MoE all_to_all inside a node first, then across nodes (SE-MoE, DeepSpeed-MoE)
    moe_compression: str = "none"  # none | lsh: LSH-MoE centroids of similar tokens instead of the tokens
    lsh_buckets: int = 16  # lsh: cross-polytope buckets per hash (2 x projection width)
    lsh_hashes: int = 1  # lsh: independent cross-polytope hashes combined into one code
    bidirectional: bool = False  # randk | topk: compress the reduce and the broadcast leg (MASHA, engine/comm/bidirectional.py)


@dataclass(kw_only=True, slots=True)
class CO2Config:
    """CO2: local steps with an asynchronous, fully overlapped outer all-reduce (engine/comm/co2.py).

    The authors' defaults (fairscale-CO2): outer_momentum 0.5, outer_lr 1.0, tau 48 (20-48 in
    the paper), gap penalty 1.0, clip threshold 1.0. Our tau default is 4 because our runs are
    tens of steps, not tens of thousands.
    """

    enabled: bool = False
    tau: int = 4  # local steps between outer synchronisations (the paper's outer frequency)
    outer_lr: float = 1.0  # outer step size
    outer_momentum: float = 0.5  # beta of the outer momentum (the authors' library default)
    clip: float = 1.0  # element-wise clip of the outer momentum to [-clip, clip] (phi); 0 disables
    penalty: str = "constant"  # constant: the paper's 1/gap_penalty | relative_gap: ours, see co2.py
    gap_penalty: float = 1.0  # lambda of the constant penalty: momentum += avg_delta / lambda


@dataclass(kw_only=True, slots=True)
class LinkGroupConfig:
    """Ranks sharing one NIC type (e.g. an InfiniBand island) and their intra-group link."""

    name: str = "group"  # label (ib, roce, eth, ...)
    ranks: list[int] = field(default_factory=list)  # global ranks in this group
    gbps: float = 0.0  # intra-group bandwidth, Gbit/s (> 0)
    latency_us: float = 0.0  # intra-group latency per collective, microseconds


@dataclass(kw_only=True, slots=True)
class LinkConfig:
    """An emulated slower link (alpha-beta model); gbps=0 leaves the real link alone.

    Heterogeneous: `groups` names rank groups with their own link and `inter_gbps` /
    `inter_latency_us` the link joining them (engine/comm/link.py LinkTopology); each
    collective and send then pays the links it crosses, and `gbps` must stay 0.
    """

    gbps: float = 0.0
    latency_us: float = 0.0
    ranks_per_node: int = 1  # ranks sharing a node (MoE all_to_all): traffic between nodes crosses the emulated link
    # (with link.groups set, the groups are the nodes)
    groups: list[LinkGroupConfig] | None = None  # rank groups, each with its own link
    inter_gbps: float = 0.0  # link between groups, Gbit/s (needed with groups)
    inter_latency_us: float = 0.0  # latency of the inter-group link, microseconds


@dataclass(kw_only=True, slots=True)
class ProfileConfig:
    """What the profilers record."""

    enabled: bool = True  # step breakdown, collectives, memory
    nvml_interval_s: float = 1.0  # GPU sampler period; 0 disables
    host_interval_s: float = 1.0  # host sampler period; 0 disables
    trace_steps: list[int] | None = None  # [a, b]: torch.profiler trace of steps a..b
    warmup_steps: int = 1  # steps excluded from steady-state throughput


@dataclass(kw_only=True, slots=True)
class LiveConfig:
    """Live in-job tuning: every `every` steps rank 0 takes new knob values from the tuner."""

    every: int = 0  # steps per segment; 0 = off
    wait_s: float = 120.0  # how long rank 0 waits for the tuner's next knobs at a boundary


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """Where `--launcher slurm` runs a config: one Slurm job of nodes x gpus_per_node ranks (engine/launch/slurm.py).

    Unused by the local launcher. Each string goes into the batch script as `#SBATCH --key=value`."""

    partition: str | None = None  # --partition; the site's default partition when unset
    account: str | None = None  # --account to charge
    time: str | None = None  # --time limit in Slurm's format: MM, HH:MM:SS, D-HH:MM:SS (site default when unset)
    constraint: str | None = None  # --constraint, node features, e.g. "h100&ib"
    nodes: int = 1  # nodes per run; must divide the world size dp*tp*pp(*cp)
    gpus_per_node: int = 0  # GPUs (= ranks) per node; 0: CPU ranks, world_size / nodes per node, no GPU request
    cpus_per_rank: int = 1  # CPU cores asked per rank (--cpus-per-task = ranks per node * this)
    sbatch: list[str] | None = None  # extra #SBATCH options, e.g. ["--qos=high", "--exclusive"]
    setup: list[str] | None = None  # shell lines run before srun, e.g. ["module load cuda/12.4"]
    telemetry_host: str | None = None  # the name compute nodes reach the launcher by (default: its host name)
    signal_s: int = 90  # SIGUSR1 this many seconds before the time limit: ranks checkpoint, the job requeues
    # itself and resumes from that checkpoint (engine/launch/preempt.py); 0: no signal, no requeue


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """One training run."""

    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    co2: CO2Config = field(default_factory=CO2Config)
    link: LinkConfig = field(default_factory=LinkConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    live: LiveConfig = field(default_factory=LiveConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # the Slurm job a run becomes (--launcher slurm)
    precision: str = "fp32"  # fp32 | bf16 (autocast)
    backend: str = "auto"  # auto | gloo | nccl

    @property
    def world_size(self) -> int:
        p = self.parallel
        return world_size(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp)

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step on one dp rank."""
        return self.batch.global_ // (self.parallel.dp * self.batch.micro)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


# ---------------------------------------------------------------- dict <-> dataclass

# knobs the engine can change at a step boundary without a restart (live in-job tuning)
LIVE_KNOBS = ("comm.density", "comm.rank", "co2.tau", "co2.outer_lr", "link.gbps", "link.latency_us",
              "batch.micro", "train.lr")

_RENAMED = {"global_": "global"}  # Python keyword -> YAML key
_UNRENAMED = {v: k for k, v in _RENAMED.items()}


def to_dict(obj: Any) -> dict[str, Any]:
    """A plain nested dict with the YAML key names."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        elif isinstance(value, list):
            value = [to_dict(v) if dataclasses.is_dataclass(v) else v for v in value]
        out[_RENAMED.get(f.name, f.name)] = value
    return out


def _type_name(tp: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    if tp in names:
        return names[tp]
    if tp is dict or typing.get_origin(tp) is dict:
        return "a mapping"
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0]).split(' ', 1)[-1]}s"
    if args:
        return _type_name(args[0]) + " or null"
    return str(tp)


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotated type; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):  # a section inside a list (link.groups entries)
        return _build(tp, value, f"{path}.")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        lists = [a for a in inner if typing.get_origin(a) is list]
        if isinstance(value, list) and lists:  # a list names its wrong element (layer_split[1])
            return _coerce(path, value, lists[0])
        for option in inner[:-1]:  # e.g. layer_split: a list of integers or the string "auto"
            try:
                return _coerce(path, value, option)
            except ConfigError:
                pass
        try:
            return _coerce(path, value, inner[-1])
        except ConfigError:
            if len(inner) == 1:
                raise
            raise ConfigError(path, value, "must be " + " or ".join(_type_name(a) for a in inner)) from None
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return value
        raise ConfigError(path, value, "must be a mapping")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(path, value, f"must be {_type_name(tp)}")
        return [_coerce(f"{path}[{i}]", v, typing.get_args(tp)[0]) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                raise ConfigError(path, value, "must be a number in floating-point range") from None
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(path, value, f"must be {_type_name(tp)}")


def _unknown_key(path: str, key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(sorted(known))}"
    return ConfigError(f"{path}{key}", "…", f"unknown key{hint}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(prefix.rstrip(".") or "config", data, "must be a mapping of keys to values")
    hints = typing.get_type_hints(cls)
    fields = {_RENAMED.get(f.name, f.name): f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        key = str(key)
        if key not in fields:
            raise _unknown_key(prefix, key, list(fields))
        f = fields[key]
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, value, f"{prefix}{key}.")
        else:
            kwargs[f.name] = _coerce(f"{prefix}{key}", value, tp)
    return cls(**kwargs)


def from_dict(data: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from a nested dict; unknown keys and wrong types raise ConfigError.

    With `model.hf`, the shape keys layers, d_model, heads and vocab are the Hugging Face config's
    (one fact, read from one place: engine/model/shapes.py)."""
    cfg = _build(RunConfig, data or {}, "")
    if cfg.model.hf is not None:
        from engine.model.shapes import from_hf_config

        shape = from_hf_config(cfg.model.hf)
        m = cfg.model
        hf_values = {"layers": (shape.layers, "num_hidden_layers"), "d_model": (shape.hidden, "hidden_size"),
                     "heads": (shape.heads, "num_attention_heads"), "vocab": (shape.vocab, "vocab_size")}
        for key, (value, hf_key) in hf_values.items():  # a shape key beside model.hf would be silently ignored
            given = (data.get("model") or {}).get(key)
            if given is not None and given != value:
                raise ConfigError(f"model.{key}", given, f"is read from model.hf ({hf_key}={value}) and cannot be "
                                  f"set beside it; drop model.{key} or change the Hugging Face config")
        m.layers, m.d_model, m.heads, m.vocab = shape.layers, shape.hidden, shape.heads, shape.vocab
    return cfg


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML file with safe loading; errors name the file and the problem."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError("config", str(path), "is a folder; give a run config YAML file in it, e.g. examples/tiny.yaml")
    if not p.is_file():
        raise ConfigError("config", str(path), "file not found")
    try:
        data = yaml.safe_load(p.read_text())
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: an int beyond Python's digit limit
        raise ConfigError("config", str(path), f"is not valid YAML: {exc}".replace("\n", " ")) from None
    if data is None:  # an empty file (or only comments) would silently train the defaults
        raise ConfigError("config", str(path), "is empty; give at least one key, or leave the file out "
                          "to train the defaults")
    if not isinstance(data, dict):
        raise ConfigError("config", str(path), "must hold a mapping at the top level")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key.sub=value` strings; the value is parsed as YAML (`4`, `true`, `[2, 2]`)."""
    out = _deep_copy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError("--set", item, "must look like key.sub=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(key, item, f"'{part}' is not a section")
            node = child
        node[parts[-1]] = value
    return out


def _deep_copy(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in d.items()}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *,
                check: bool = True) -> RunConfig:
    """Load YAML (or defaults), apply overrides, build and validate (check=False: a template, e.g. a
    search space's base, which only its points must make valid)."""
    data = load_yaml(path) if path else {}
    cfg = from_dict(apply_overrides(data, overrides or []))
    if check:
        validate(cfg)
    return cfg


def replace(cfg: RunConfig, overrides: dict[str, Any]) -> RunConfig:
    """A copy of `cfg` with dotted-key overrides applied (e.g. {'batch.micro': 2}); validated."""
    data = cfg.to_dict()
    for key, value in overrides.items():
        node = data
        *head, last = key.split(".")
        for part in head:
            node = node.setdefault(part, {})
        node[last] = value
    new = from_dict(data)
    validate(new)
    return new


# validation lives in its own module; re-exported here so callers import one place
from engine.config.validate import validate  # noqa: E402
