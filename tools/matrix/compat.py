"""The compatibility matrix as data: features, the cells they form, and each cell's derived verdict.

A feature is a named fragment of config knobs on one tiny base config (`BASE`, the parity model of
tests/parallel_harness.py). A cell is a feature alone, a pair, or one of the `TRIPLES` people use.
Its verdict is derived, never written by hand:

- `exclusive`: two of its features set one knob to different values (the knob is named);
- `refused`: `engine.config.validate.check()` refuses the merged config (its first line is the reason);
- `pending`: a feature has no fragment yet (named why);
- `accepted`: then it needs a recorded run (docs/data/matrix.json, tests/matrix_runner.py) of its
  current plan and code (tools/matrix/compat_results.py): `verified` when parity with a reference in a *different*
  layout and both resumes hold, `no reference` when the resumes hold but the cell has no other
  layout to compare with (counted apart), `failed` when a check does not hold, `stale` when the
  result is of another plan or code, `not run` otherwise.

Merging: parallel degrees (`DEGREES`) take the larger value; `set` knobs must agree; `default`
knobs yield to another feature's `set` (a modifier such as comm.bidirectional defaults to Top-k
but composes with Rand-k). Each feature says what its parity reference is (`Reference`).
Torch-free: `python -m tools.matrix --write docs/compatibility.md` renders the document.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.mesh import world_size
from engine.config.validate import COMPRESSORS, CP_IMPLS, FSDP_COMPRESSORS, SCHEDULES, V_SCHEDULES, VIRTUAL_SCHEDULES

PARITY_TOL = 1e-4  # the loss of every step within this of the reference (issue 36)
RESUME_TOL = 1e-6  # a resumed run's losses within this of the uninterrupted run
BF16_TOL = 2e-2  # bf16 autocast: 8 mantissa bits, a loss near 5.5 rounds at ~2e-2 (module docstring)
STEPS, CHECKPOINT_STEP = 4, 2  # parity over 4 steps; resume from the step-2 checkpoint (steps 2, 3)
DROPOUT = 0.1  # the same-layout resume runs with dropout where validate() allows it (RNG restored)
DEGREES = ("parallel.dp", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep")
# knobs that place the computation without changing it: removed to build the one-process reference
LAYOUT_PREFIXES = ("parallel.", "link.", "comm.moe_hierarchical", "train.activation_checkpointing")
GROUPS_SENTINEL = "@two-groups"  # link.groups: two link groups, even and odd ranks (expanded per world)
TOKENS_SENTINEL = "@token-file"  # data.path: a small uint16 token file written once (matrix_token_file)
MATRIX_TOKENS = 1 << 16  # tokens in it: 4 steps x 8 rows x 16 tokens read in order, many times over
ENTRY = "matrix_runner:tiny_entry"
# ZeRO-2/3 compress each reduce-scatter shard (engine/comm/fsdp_compress.py), DDP each bucket: another
# selection, so a compressor's reference under ZeRO-2/3 is the compressor at this stage, dp2
FSDP_COMPRESSION_STAGE = 2  # model.entry: a GPT and token windows (tests/matrix_runner.py)

BASE: dict[str, Any] = {
    "model.layers": 4, "model.d_model": 32, "model.heads": 4, "model.seq_len": 16, "model.vocab": 256,
    "model.dropout": 0.0, "train.steps": STEPS, "train.lr": 0.003, "train.warmup_steps": 0,
    "train.weight_decay": 0.1, "train.grad_clip": 0.5, "train.timeout_s": 90.0,
    "train.eval_interval": STEPS,  # one evaluation in every run, after its last step (issue 52)
    "batch.global": 8, "batch.micro": 1, "profile.host_interval_s": 0.0, "profile.nvml_interval_s": 0.0,
}
# live knobs the runner offers at every step from step 1 on; engine.train.live.inert_knobs drops those that
# cannot act in a run (the runner applies the rest, and the same ones to the reference)
# model.hf: a tiny Llama-family config (engine/model/hf.py), shaped like BASE's GPT (4 layers, hidden 32, 4 heads)
HF_LLAMA: dict[str, Any] = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
LIVE_CANDIDATES: dict[str, Any] = {"train.lr": 0.002, "batch.micro": 2, "comm.density": 0.05, "comm.rank": 2,
                                   "co2.tau": 1}


@dataclass(frozen=True, slots=True)
class Reference:
    """What a feature's parity is measured against.

    `layout` (the default): the feature only places the computation; the cell must follow one
    process running the same model (its layout knobs removed). `replay`: the feature changes the
    numbers in a way one process reproduces (bf16, live knobs, model.entry): kept in that process.
    `own`: the feature changes the numbers by design and exists only on several ranks (lossy
    compression, CO2, LSH-MoE, SkipPipe, FlexSP's per-document steps): the reference is the feature
    in its own minimal layout, so (topk, zero1) must follow topk at dp2. A cell whose reference
    would be its own layout (topk alone, bf16 alone) has none: its resumes still run, and it is
    counted apart from the verified cells.
    """

    kind: str = "layout"  # layout | replay | own
    why: str = ""  # own/replay: why one process cannot run the cell as is
    tol: float = PARITY_TOL
    checked_by: str = ""  # own: the tests that check the feature alone against its definition


LAYOUT, REPLAY, OWN = "layout", "replay", "own"


@dataclass(frozen=True, slots=True)
class Feature:
    """One feature: the knobs that turn it on, at the smallest layout where it acts."""

    name: str  # short id used in cell ids (`dp+tp`)
    title: str
    set: Mapping[str, Any] = field(default_factory=dict)  # knobs it needs at exactly these values
    degrees: Mapping[str, int] = field(default_factory=dict)  # parallel degrees it needs at least
    default: Mapping[str, Any] = field(default_factory=dict)  # knobs it needs unless another feature sets them
    reference: Reference = Reference()
    pending: str = ""  # why there is no fragment yet (the feature lands with another change)
    same_layout_only: str = ""  # why its checkpoints resume only in the layout that wrote them


def _schedule_feature(s: str) -> Feature:
    """pp with schedule `s`: pp2 (virtual 2 where the schedule takes chunks); SkipPipe pp3 over 6 layers."""
    if s == "skip":
        return Feature("pp-skip", "pp3, SkipPipe (skip_ratio 0.5)", degrees={"parallel.pp": 3},
                       set={"parallel.schedule": s, "parallel.skip_ratio": 0.5, "model.layers": 6},
                       reference=Reference(OWN, "micro-batches skip middle stages: another model per path",
                                           checked_by="tests/test_schedules.py"))
    virtual = {"parallel.virtual": 2} if s in VIRTUAL_SCHEDULES else {}
    chunks = "2 chunks per rank" if s in VIRTUAL_SCHEDULES or s in V_SCHEDULES else "1 chunk per rank"
    return Feature(f"pp-{s}", f"pp2, schedule {s} ({chunks})", degrees={"parallel.pp": 2},
                   set={"parallel.schedule": s, **virtual})


def _compressor_feature(c: str) -> Feature:
    """Gradient compression at dp2; named `c-<compressor>` (the bf16 compressor is not precision=bf16)."""
    return Feature(f"c-{c}", f"gradient compressor {c}", degrees={"parallel.dp": 2}, set={"comm.compressor": c},
                   reference=Reference(OWN, "lossy gradient compression", checked_by="tests/test_compress.py"))


def _features() -> tuple[Feature, ...]:
    moe = {"model.experts": 4}
    groups = {"link.groups": GROUPS_SENTINEL, "link.inter_gbps": 10.0}
    tokens = {"data.source": "tokens", "data.path": TOKENS_SENTINEL}
    return (
        Feature("dp", "data parallel (DDP), dp2", degrees={"parallel.dp": 2}),
        *(Feature(f"zero{k}", f"ZeRO-{k}, dp2", degrees={"parallel.dp": 2}, set={"parallel.zero": k}) for k in (1, 2, 3)),
        Feature("tp", "tensor parallel, tp2", degrees={"parallel.tp": 2}),
        Feature("sp", "sequence parallel over tp2", degrees={"parallel.tp": 2}, set={"parallel.sequence_parallel": True}),
        *(_schedule_feature(s) for s in SCHEDULES),
        *(Feature(f"cp-{impl}", f"context parallel cp2, {impl}", degrees={"parallel.cp": 2},
                  set={"parallel.cp_impl": impl}) for impl in CP_IMPLS),
        Feature("adaptive-sp", "adaptive SP (FlexSP), dp2", degrees={"parallel.dp": 2}, set={"parallel.adaptive_sp": True},
                reference=Reference(OWN, "each document is its own sequence (no padding rows), a data path one process "
                              "does not take", checked_by="tests/test_adaptive_sp.py (one process per document)")),
        # the GPT's 4 experts unless a Hugging Face MoE (hf-moe) brings its own (model.experts=0)
        Feature("ep", "expert parallel ep2 (MoE, 4 experts)", degrees={"parallel.dp": 2, "parallel.ep": 2}, default=moe),
        Feature("moe-hier", "hierarchical all_to_all, ep4 over 2 nodes", degrees={"parallel.dp": 4, "parallel.ep": 4},
                set={**moe, "comm.moe_hierarchical": True, "link.ranks_per_node": 2}),
        Feature("lsh-moe", "LSH-MoE compressed all_to_all, ep2", degrees={"parallel.dp": 2, "parallel.ep": 2},
                set={**moe, "comm.moe_compression": "lsh"},
                reference=Reference(OWN, "experts see bucket centroids instead of tokens", checked_by="tests/test_moe.py")),
        *(_compressor_feature(c) for c in COMPRESSORS if c != "none"),
        Feature("bidirectional", "bidirectional compression (default topk)", degrees={"parallel.dp": 2},
                set={"comm.bidirectional": True}, default={"comm.compressor": "topk"},
                reference=Reference(OWN, "lossy compression of both legs", checked_by="tests/test_bidirectional.py")),
        Feature("lgreco", "L-GreCo adaptive levels (default topk)", degrees={"parallel.dp": 2},
                set={"comm.adaptive": True, "comm.adaptive_interval": 2}, default={"comm.compressor": "topk"},
                reference=Reference(OWN, "lossy compression at solved levels", checked_by="tests/test_adaptive.py")),
        Feature("co2", "CO2 local steps (tau 2), dp2", degrees={"parallel.dp": 2}, set={"co2.enabled": True, "co2.tau": 2},
                reference=Reference(OWN, "local steps and a stale outer step", checked_by="tests/test_co2.py"),
                same_layout_only="a CO2 checkpoint holds one replica per dp rank: it resumes as CO2 with the same "
                                 "dp and tp only (engine/train/checkpoint.py)"),
        Feature("link-groups", "link.groups: two emulated link groups, dp2", degrees={"parallel.dp": 2}, set=groups),
        Feature("holmes", "Holmes placement over two link groups, dp2", degrees={"parallel.dp": 2},
                set={**groups, "parallel.placement": "holmes"}),
        Feature("split-auto", "layer_split auto, pp2", degrees={"parallel.pp": 2}, set={"parallel.layer_split": "auto"}),
        Feature("ac", "activation checkpointing", set={"train.activation_checkpointing": True}),
        Feature("bf16", "precision bf16 (autocast)", set={"precision": "bf16"},
                reference=Reference(REPLAY, "bf16 rounding: one process in bf16, within BF16_TOL", BF16_TOL)),
        Feature("live", "live knobs every step from step 1", set={"live.every": 1},
                reference=Reference(REPLAY, "the same knobs applied at the same steps in one process")),
        Feature("entry", "model.entry (a user's model and dataset)", set={"model.entry": ENTRY},
                reference=Reference(REPLAY, "the user's model in one process")),
        Feature("hf", "Hugging Face Llama (model.hf, GQA 4/2 heads, SwiGLU, untied)",
                set={"model.hf": HF_LLAMA, "model.experts": 0}),
        Feature("hf-moe", "Hugging Face Mixtral (model.hf, 4 fused experts, top-2)",
                set={"model.hf": {**HF_LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
                     "model.experts": 0}),
        # transformers' sliding-window mask (engine/model/hf.py) and Mixtral's router aux loss in the loss
        Feature("hf-swa", "Hugging Face Mistral, sliding window 4 at seq 16 (model.hf)",
                set={"model.hf": {**HF_LLAMA, "model_type": "mistral", "sliding_window": 4}, "model.experts": 0}),
        Feature("hf-aux", "Hugging Face Mixtral with its router aux loss (output_router_logits, coef 0.1)",
                set={"model.hf": {**HF_LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
                                  "output_router_logits": True, "router_aux_loss_coef": 0.1}, "model.experts": 0}),
        Feature("tokens", "a token file read in order (data.source=tokens, position checkpointed)", set=tokens),
        Feature("pack", "packed documents of a token file (data.pack, document masks)",
                set={**tokens, "data.pack": True, "data.eos_id": 0}),
    )


FEATURES: dict[str, Feature] = {f.name: f for f in _features()}
# the triples people use (issue 36): dp x tp x pp for each schedule, ep x tp x placement, cp x tp x dp;
# zero x compressor and pp x zero x schedule are pairs here (a pp feature carries its schedule)
TRIPLES: tuple[tuple[str, ...], ...] = (
    *(("dp", "tp", f"pp-{s}") for s in SCHEDULES),
    ("ep", "tp", "holmes"), ("ep", "tp", "link-groups"),
    *(("dp", "tp", f"cp-{impl}") for impl in CP_IMPLS),
)


@dataclass(frozen=True, slots=True)
class Cell:
    """A set of features; its id joins their names with '+' in FEATURES order."""

    features: tuple[str, ...]

    @property
    def id(self) -> str:
        return "+".join(self.features)

    @staticmethod
    def parse(cell_id: str) -> Cell:
        names = cell_id.split("+")
        unknown = [n for n in names if n not in FEATURES]
        if unknown:
            raise ValueError(f"unknown feature(s) {unknown} in cell {cell_id!r}; features: {', '.join(FEATURES)}")
        order = list(FEATURES)
        return Cell(tuple(sorted(set(names), key=order.index)))


def cells() -> list[Cell]:
    """Every feature alone, every pair, and the TRIPLES."""
    names = list(FEATURES)
    out = [Cell((n,)) for n in names] + [Cell(p) for p in itertools.combinations(names, 2)]
    return out + [Cell.parse("+".join(t)) for t in TRIPLES]


# ---------------------------------------------------------------- merging and configs

@dataclass(frozen=True, slots=True)
class Merged:
    """The knobs of a set of features, or the knob two of them disagree on."""

    knobs: dict[str, Any]
    conflict: str = ""  # "knob: a=value, b=value" when exclusive


def merge(names: Iterable[str]) -> Merged:
    """Merge the features' fragments: degrees take the larger, `set` must agree, `default` yields."""
    knobs: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for name in names:
        f = FEATURES[name]
        for key, value in f.degrees.items():
            knobs[key] = max(knobs.get(key, 1), value)
        for key, value in f.set.items():
            if key in owner and knobs[key] != value:
                return Merged({}, f"{key}: {owner[key]} sets {knobs[key]!r}, {name} sets {value!r}")
            knobs[key], owner[key] = value, name
    for name in names:  # defaults only where no feature set the knob
        for key, value in FEATURES[name].default.items():
            if key not in owner:
                knobs.setdefault(key, value)
    return Merged(knobs)


def world_of(knobs: Mapping[str, Any]) -> int:
    """The ranks a config of these knobs runs on (dp*tp*pp*cp)."""
    return world_size(**{axis: knobs.get(f"parallel.{axis}", 1) for axis in ("dp", "tp", "pp", "cp")})


def overrides(knobs: Mapping[str, Any]) -> dict[str, Any]:
    """The whole override set of a run: BASE, then the knobs, with the link-group sentinel expanded."""
    out = {**BASE, **knobs}
    if out.get("link.groups") == GROUPS_SENTINEL:
        world = world_of(out)
        out["link.groups"] = [{"name": f"g{i}", "ranks": list(range(i, world, 2)), "gbps": 100.0} for i in (0, 1)]
    if out.get("data.path") == TOKENS_SENTINEL:
        out["data.path"] = matrix_token_file()
    return out


@functools.lru_cache(maxsize=None)
def matrix_token_file() -> str:
    """A uint16 token file of BASE's vocabulary, the same bytes on every machine (id 0 ends a document
    every 37 tokens), in this user's private folder of the temporary directory (`_private_dir`). Its
    bytes are checked once per process and rewritten when they differ; a write goes through a
    `tempfile.mkstemp` file renamed into place (atomic: ranks and workers may write it at once)."""
    import array

    ids = array.array("H", [0 if i % 37 == 36 else 1 + (i * 7919 + i // 13) % (BASE["model.vocab"] - 1)
                            for i in range(MATRIX_TOKENS)])
    folder = _private_dir()
    path = os.path.join(folder, "tokens-v1.bin")
    try:
        with open(path, "rb") as f:
            if f.read() == ids.tobytes():
                return path
    except FileNotFoundError:
        pass
    replace_atomically(Path(path), ids.tobytes())
    return path


def replace_atomically(path: Path, data: bytes) -> None:
    """Write `data` to a `tempfile.mkstemp` file beside `path` and rename it into place: a reader sees the
    old bytes or the new, never a part (ranks, workers and matrix runs may write at once)."""
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _private_dir() -> str:
    """`<tmp>/workbench-matrix-<uid>`, mode 0700, refused unless a folder of this user (not a link):
    another user cannot plant the token file the matrix reads."""
    import stat
    import tempfile

    folder = os.path.join(tempfile.gettempdir(), f"workbench-matrix-{os.getuid()}")
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RuntimeError(f"{folder}: must be a folder of user {os.getuid()} with mode 0700 (the matrix's "
                           "token file); remove it")
    return folder


def nested(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted keys -> the nested mapping engine.config.schema.from_dict reads."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *head, last = key.split(".")
        for part in head:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def refusal(flat: Mapping[str, Any], prefer: Iterable[str] = ()) -> str:
    """validate()'s line for these overrides ('' when accepted), with the count of the others: the
    first error naming a knob in `prefer` (the cell's own knobs), else the first error."""
    from engine.config.schema import from_dict
    from engine.errors import ConfigError
    from engine.config.validate import check

    try:
        errors = check(from_dict(nested(flat)))
    except ConfigError as exc:
        errors = [exc]
    if not errors:
        return ""
    own = [e for e in errors if e.field in set(prefer)]
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return str((own or errors)[0]).splitlines()[0] + more


def is_layout_knob(key: str) -> bool:
    return key.startswith(LAYOUT_PREFIXES)


@functools.lru_cache(maxsize=None)
def _default(key: str) -> Any:
    from engine.config.schema import RunConfig

    node: Any = RunConfig()
    for part in key.split("."):
        node = getattr(node, part, _default)  # a key the config lacks: never equal to a value
    return node


def layout_of(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The layout knobs of an override set that differ from the engine's defaults: writing out
    `parallel.dp: 1` (or any default) is no layout."""
    return {k: v for k, v in sorted(flat.items()) if is_layout_knob(k) and v != _default(k)}


def dims_of(flat: Mapping[str, Any]) -> tuple[int, ...]:
    """The parallel degrees (dp, tp, pp, cp, ep) of an override set."""
    return tuple(int(flat.get(k, 1)) for k in DEGREES)


def layout_text(knobs: Mapping[str, Any]) -> str:
    """The layout knobs in words: `dp=2, zero=1` (defaults left out; link groups counted); `one process`
    when none."""
    return ", ".join(f"{k.split('.')[-1]}={f'{len(v)} groups' if isinstance(v, list) else v}"
                     for k, v in layout_of(knobs).items()) or "one process"


def dims_text(flat: Mapping[str, Any]) -> str:
    """The degrees above 1 in words: `dp=2, ep=2`, or `1 rank`."""
    return ", ".join(f"{k.split('.')[-1]}={d}" for k, d in zip(DEGREES, dims_of(flat)) if d > 1) or "1 rank"


# ---------------------------------------------------------------- verdicts and run plans

@dataclass(frozen=True, slots=True)
class Verdict:
    kind: str  # exclusive | refused | pending | accepted
    reason: str = ""


@functools.lru_cache(maxsize=None)
def verdict(cell: Cell) -> Verdict:
    """The cell's verdict before any run (accepted cells then need a recorded result)."""
    pending = [f"{n}: {FEATURES[n].pending}" for n in cell.features if FEATURES[n].pending]
    if pending:
        return Verdict("pending", "; ".join(pending))
    merged = merge(cell.features)
    if merged.conflict:
        return Verdict("exclusive", merged.conflict)
    why = refusal(overrides(merged.knobs), prefer=merged.knobs)
    return Verdict("refused", why) if why else Verdict("accepted")


@dataclass(frozen=True, slots=True)
class Plan:
    """What the runner does for an accepted cell (all overrides are whole, BASE included)."""

    cell: str
    world: int
    config: dict[str, Any]  # the cell's run: parity (dropout 0) and the uninterrupted run of resume_other
    reference: dict[str, Any] | None  # the parity reference's run, in another layout; None: there is none
    reference_kind: str  # "one process" | "own: <features>" | "none"
    reference_note: str  # the reference's layout in words, or why the cell has no other layout
    tol: float
    other_tol: float  # the other-layout resume: RESUME_TOL, or bf16's tolerance (another layout rounds otherwise)
    dropout_config: dict[str, Any]  # the same-layout resume chain (dropout on where validate allows)
    dropout_note: str  # why dropout stays off, or ""
    other: dict[str, Any] | None  # the other layout (other dims) resumed from the cell's checkpoint
    other_note: str  # the other layout in words, or why there is none
    live: bool  # offer LIVE_CANDIDATES at every step from step 1
    key: str  # hash of everything above: a recorded result is stale once it changes


def _own(cell: Cell) -> list[str]:
    """The cell's features that are their own reference (`Reference`)."""
    return [n for n in cell.features if FEATURES[n].reference.kind == OWN]


def _reference_knobs(cell: Cell, knobs: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The reference's knobs and kind: the cell with its layout knobs removed (one process of the same
    model and data), its `own` features kept in their minimal layout."""
    own = _own(cell)
    ref = {k: v for k, v in knobs.items() if not is_layout_knob(k)}
    ref.update(merge(own).knobs)
    kind = f"own: {'+'.join(own)}" if own else "one process"
    if knobs.get("parallel.zero", 0) >= FSDP_COMPRESSION_STAGE and ref.get("comm.compressor") in FSDP_COMPRESSORS:
        ref["parallel.zero"] = FSDP_COMPRESSION_STAGE
        kind += f" at ZeRO-{FSDP_COMPRESSION_STAGE}"
    return ref, kind


def _no_reference(cell: Cell) -> str:
    """Why a cell whose reference would be its own layout has none."""
    own = _own(cell)
    if not own:
        return "the cell is one process with no layout knob: it is the one-process reference itself"
    f = FEATURES[own[0]]
    return (f"the cell is the minimal layout of {'+'.join(own)} ({f.reference.why}): no other layout computes "
            f"its numbers; {f.reference.checked_by} checks it alone")


def _fills(world: int) -> list[tuple[int, dict[str, int]]]:
    """(ranks, degrees) of the other layouts tried in order: dp=W, ZeRO-1 dp=W, tp=W, dp=W/2 x tp2,
    dp=W/2 x pp2 on the cell's W ranks; dp2 and tp2 on 2 ranks for a one-process cell."""
    half = max(world // 2, 1)
    if world == 1:
        return [(2, {"parallel.dp": 2}), (2, {"parallel.tp": 2})]
    return [(world, fill) for fill in ({"parallel.dp": world}, {"parallel.dp": world, "parallel.zero": 1},
                                       {"parallel.tp": world}, {"parallel.dp": half, "parallel.tp": 2},
                                       {"parallel.dp": half, "parallel.pp": 2})]


def _other_layout(cell: Cell, ref: dict[str, Any], knobs: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The first layout of `_fills`, over the reference's non-layout knobs and its own features (their
    degrees only grow), with other dims than the cell's and accepted by validate(); else the reference's
    own layout when its dims differ (SkipPipe's pp3 for dp2 x pp3)."""
    tried, dims, world = [], dims_of(knobs), world_of(knobs)
    for ranks, fill in _fills(world):
        cand = dict(ref)
        for key, value in fill.items():
            cand[key] = max(cand.get(key, 1), value)
        if world_of(cand) != ranks or dims_of(cand) == dims:
            continue
        why = refusal(overrides(cand))
        if not why:
            return cand, layout_text(overrides(cand))
        tried.append(why)
    if dims_of(ref) != dims and not refusal(overrides(ref)):
        return ref, layout_text(overrides(ref))
    ranks = 2 if world == 1 else world
    return None, (f"no layout of {ranks} ranks with other dims than {dims_text(knobs)} keeps the cell's features"
                  f"{_held(cell)} and is accepted" + (f" (e.g. {tried[0]})" if tried else ""))


def _held(cell: Cell) -> str:
    """` (c-topk holds dp=2)`: the cell's own features, whose minimal layout every other layout keeps, or ''."""
    own = _own(cell)
    return f" ({'+'.join(own)} holds {dims_text(merge(own).knobs)})" if own else ""


@functools.lru_cache(maxsize=None)
def plan(cell: Cell) -> Plan:
    """The runs of an accepted cell (ValueError for any other verdict)."""
    v = verdict(cell)
    if v.kind != "accepted":
        raise ValueError(f"cell {cell.id} is {v.kind}: {v.reason}")
    knobs = merge(cell.features).knobs
    world = world_of(knobs)
    base, kind = _reference_knobs(cell, knobs)
    ref, ref_note = base, layout_text(overrides(base))
    if layout_of(overrides(base)) == layout_of(overrides(knobs)):
        ref, kind, ref_note = None, "none", _no_reference(cell)
    tol = max(FEATURES[n].reference.tol for n in cell.features)
    dropped = {**knobs, "model.dropout": DROPOUT}
    note = refusal(overrides(dropped))
    pinned = [FEATURES[n].same_layout_only for n in cell.features if FEATURES[n].same_layout_only]
    other, other_note = (None, pinned[0]) if pinned else _other_layout(cell, base, knobs)
    fields = dict(cell=cell.id, world=world, config=overrides(knobs),
                  reference=overrides(ref) if ref is not None else None, reference_kind=kind, reference_note=ref_note,
                  tol=tol, other_tol=max(RESUME_TOL, tol if tol > PARITY_TOL else 0.0),
                  dropout_config=overrides(knobs if note else dropped), dropout_note=note,
                  other=overrides(other) if other is not None else None, other_note=other_note,
                  live="live" in cell.features)
    text = json.dumps([fields, LIVE_CANDIDATES, RESUME_TOL, CHECKPOINT_STEP], sort_keys=True, default=str)
    # the token file's path is per user and machine: the key names its bytes instead
    tokens = f"{TOKENS_SENTINEL}:{hashlib.sha256(Path(matrix_token_file()).read_bytes()).hexdigest()[:12]}"
    key = hashlib.sha256(text.replace(matrix_token_file(), tokens).encode()).hexdigest()[:16]
    return Plan(**fields, key=key)


