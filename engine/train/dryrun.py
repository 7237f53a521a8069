"""A dry run: one training step of the real program at the real world size, in one CPU process.

`dry_run(cfg)` plays one rank of the config's world on torch's `fake` process-group backend (every
collective returns at once, nothing is sent) and under `FakeTensorMode` (tensors have shapes and
dtypes, no storage): the engine's own Trainer builds the model and lays it out with the real
`parallelize()` (FSDP2, TP, pipeline stages over the real mesh), then runs its own `train_step`. What
comes back per rank role is what that step would hold and send:

- memory by category at the rank's peak, from torch's own trackers (`FSDPMemTracker` when the rank
  holds one FSDP2 root, else `MemTracker`): parameters (sharded / unsharded), gradients, optimizer
  states, activations, temporaries, FSDP2's all-gather and reduce-scatter buffers;
- every collective of the step per mesh axis with its bytes (the Trainer's `CollectiveProfiler`:
  c10d calls, DTensor's functional collectives and the pipeline's send/recv), in nccl-tests sizes.

Ranks of one pipeline stage hold equal shards (validate() requires even dp/tp/cp splits), so one
rank per pp stage is run: rank 0 without pipelining. Without pipelining a step of more than
`PLAYED_MICRO_BATCHES` micro-batches is played with that many (`played_config`): the first, one
from the middle and the last; every middle one holds and sends what the one played does (the
same no_sync / keep_gathered state, the same gradients already accumulated), so the peak is the
full step's (but for the token ids of the micro-batches left out: 8 bytes a token) and the middle
one's collectives count once per middle micro-batch. The build allocates this rank's parameters under
the step's fake mode (engine/model/meta_init.py `allocating_under`): no wrapper copies real storage.
An MoE layer's tokens per expert are a balanced router's (`_balanced_counts`). DDP is played as an in-place
all-reduce of each gradient (engine/parallel/parallelize.py `_dry_data_parallel`: its reducer needs real storage). Nothing here imports
the simulator (`tuning/sim/dryrun.py` sets its figures beside these).
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from engine.config.schema import RunConfig, replace, validate
from engine.errors import ConfigError
from engine.mesh import ParallelDims
from engine.torch_compat import LOCAL_SCALAR_DENSE, TorchDispatchMode
from engine.train.memory import device_memory_target

logger = logging.getLogger(__name__)

GIB = 2**30
PLAYED_MICRO_BATCHES = 3  # without pipelining: the first, a middle one (repeated) and the last

# torch's tracker categories, grouped as the simulator prices memory (params, grads, optimizer,
# activations); FSDP2's collective buffers and module buffers have no simulator term
GROUPS = {"Sharded Param": "params", "Unsharded Param": "params", "Parameter": "params",
          "Sharded Grad": "grads", "Unsharded Grad": "grads", "Gradient": "grads",
          "OptState": "optimizer", "Optstate": "optimizer",
          "Activation": "activations", "Temp": "activations", "Inputs": "activations",
          "All Gather": "comm buffers", "Reduce Scatter": "comm buffers",
          "Buffer": "other", "Other": "other"}


@dataclass(slots=True)
class RoleResult:
    """One rank's step: peak memory by tracker category (bytes) and collectives per axis."""

    rank: int
    coords: dict[str, int]
    memory: dict[str, float]  # tracker category -> bytes held at this rank's peak
    peak: float  # bytes: the sum of `memory`
    tracker: str  # FSDPMemTracker | MemTracker
    collectives: dict[str, dict[str, float]]  # "axis:op" -> {count, bytes} of one step
    seconds: float  # wall time of this role's dry run

    def grouped(self) -> dict[str, float]:
        """`memory` summed into params, grads, optimizer, activations, comm buffers, other."""
        out: dict[str, float] = {}
        for category, value in self.memory.items():
            out[GROUPS.get(category, "other")] = out.get(GROUPS.get(category, "other"), 0.0) + value
        return out

    def dominant(self) -> tuple[str, float]:
        """The tracker category holding the most bytes at the peak."""
        return max(self.memory.items(), key=lambda kv: kv[1])

    def axis_bytes(self) -> dict[str, float]:
        """Collective bytes this rank issued in the step per mesh axis ("" for a group outside the
        mesh), receives left out: a recv is the bytes of its peer's send."""
        out: dict[str, float] = {}
        for key, agg in self.collectives.items():
            axis, _, op = key.rpartition(":")
            if op != "recv":
                out[axis] = out.get(axis, 0.0) + agg["bytes"]
        return out


@dataclass(slots=True)
class DryRun:
    """The dry run of a config: its layout and one `RoleResult` per rank role run."""

    world: int
    layout: dict[str, int]
    roles: list[RoleResult] = field(default_factory=list)

    def peak_role(self) -> RoleResult:
        """The role with the largest peak."""
        return max(self.roles, key=lambda r: r.peak)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (`workbench dryrun --json`, the launcher's pre-flight)."""
        return {"world": self.world, "layout": self.layout,
                "roles": [{name: getattr(r, name) for name in r.__slots__} for r in self.roles]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DryRun:
        return cls(world=data["world"], layout=data["layout"], roles=[RoleResult(**r) for r in data["roles"]])


def at_world(cfg: RunConfig, world: int | None) -> RunConfig:
    """`cfg` at `world` ranks, validated: dp takes what tp * pp * cp leaves (the other degrees are the
    layout). `cfg` may be unvalidated (a YAML's dp with another layout's tp/pp)."""
    if world is None or world == cfg.world_size:
        validate(cfg)
        return cfg
    p = cfg.parallel
    rest = p.tp * p.pp * p.cp
    if world < 1 or world % rest:
        raise ConfigError("--world", world, f"must be a multiple of tp({p.tp}) * pp({p.pp}) * cp({p.cp}) = {rest}; "
                          "dp takes the rest")
    return replace(cfg, {"parallel.dp": world // rest})


def role_ranks(cfg: RunConfig) -> list[int]:
    """One rank per pipeline stage (the one at dp = tp = cp = 0): the distinct roles of the world."""
    p = cfg.parallel
    grid = ParallelDims(p.dp, p.tp, p.pp, cfg.world_size, cp=p.cp).rank_grid()
    return [int(grid[(stage,) + (0,) * (grid.dim() - 1)]) for stage in range(p.pp)]


def dry_run(cfg: RunConfig, *, world: int | None = None, ranks: list[int] | None = None) -> DryRun:
    """Dry-run `cfg` (at `world` ranks, dp rescaled) for each rank of `ranks` (default: one per
    pipeline stage). Needs a process without a process group (it starts and ends fake ones)."""
    cfg = _dry_config(at_world(cfg, world))
    check_playable(cfg)
    out = DryRun(world=cfg.world_size, layout=ParallelDims(cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp,
                                                          cfg.world_size, cp=cfg.parallel.cp).describe())
    played = played_config(cfg)
    for rank in ranks if ranks is not None else role_ranks(cfg):
        out.roles.append(run_role(played, rank, micro_batches=cfg.grad_accum))
    return out


def played_config(cfg: RunConfig) -> RunConfig:
    """`cfg` with at most PLAYED_MICRO_BATCHES micro-batches per step, without pipelining (the module
    docstring; a pipeline schedule's peak depends on its micro-batch count: played whole)."""
    if cfg.parallel.pp > 1 or cfg.grad_accum <= PLAYED_MICRO_BATCHES:
        return cfg
    return replace(cfg, {"batch.global": cfg.parallel.dp * cfg.batch.micro * PLAYED_MICRO_BATCHES})


def check_playable(cfg: RunConfig) -> None:
    """One line for a layout a fake step cannot play (each needs real values or real storage)."""
    p = cfg.parallel
    ddp = p.pp == 1 and p.dp * p.cp > 1 and p.zero < 2 and p.tp == 1 and not cfg.co2.enabled
    if ddp and cfg.comm.compressor != "none":
        raise ConfigError("comm.compressor", cfg.comm.compressor, "the dry run plays DDP's gradient all-reduce "
                          "without its comm hooks (engine/parallel/parallelize.py); dry-run comm.compressor=none")
    if p.adaptive_sp:
        raise ConfigError("parallel.adaptive_sp", True, "the dry run cannot play FlexSP: it times real steps to plan")
    if cfg.model.entry is not None:
        raise ConfigError("model.entry", cfg.model.entry, "the dry run builds the engine's own models (model.hf or "
                          "the GPT), not a user's")
    if cfg.model.hf is None and cfg.model.experts > 0 and cfg.model.capacity_factor > 0:
        raise ConfigError("model.capacity_factor", cfg.model.capacity_factor, "the dry run cannot play the GPT's "
                          "token dropping (which assignments an expert drops depends on the router's values); "
                          "dry-run model.capacity_factor=0 (dropless)")


def _dry_config(cfg: RunConfig) -> RunConfig:
    """What a dry step needs of the config: profiling on (its collectives are the report), no
    resume, no trace, no evaluation, no live tuning; everything else as given."""
    return replace(cfg, {"profile.enabled": True, "profile.trace_steps": None, "train.resume_from": None,
                         "train.eval_interval": 0, "live.every": 0, "train.checkpoint_interval": 0})


def run_role(cfg: RunConfig, rank: int, *, micro_batches: int | None = None) -> RoleResult:
    """One training step of global rank `rank` of `cfg`'s world (see the module docstring). `micro_batches`:
    the real step's count where `cfg` plays fewer (`played_config`): the collectives of the middle one
    played count once per middle micro-batch left out."""
    from engine.model.meta_init import allocating_under
    from engine.torch_compat import fake_tensor_mode, own_sharding_fake_mode
    from engine.train.trainer import Trainer

    start = time.perf_counter()
    with _fake_world(cfg.world_size, rank), warnings.catch_warnings():
        # the engine's saved-activation counter keys parameters by address; fake ones have none (harmless)
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        # the real program's build (engine/train/compose.py): on meta, laid out, then only this rank's parts
        # allocated, without values (nothing drawn, no hf_weights read)
        fake = fake_tensor_mode()(allow_non_fake_inputs=True)
        with allocating_under(fake):
            trainer = Trainer(cfg, device=torch.device("cpu"), init_values=False)
        try:
            x, y = trainer._local_batch(0)  # real token ids, read before the fake mode
            trainer._local_batch = lambda step: (x, y)
            with fake, own_sharding_fake_mode(), _ScalarReads():
                _materialize(trainer)
                if trainer.par.pipeline is not None:
                    _static_stage_meta(trainer, x)
                _optimizer_states(trainer.par)
                trainer.collectives.drain()  # the build's (TP's distribute_tensor, stage shapes): not the step's
                tracker, name = _tracker(trainer.par)
                chunks: list[list[dict[str, Any]]] = []  # the collectives before each micro-batch's forward

                def drain() -> None:
                    chunks.append(trainer.collectives.drain())

                with _per_micro_batch(tracker, trainer.par.modules, drain), tracker:
                    # a step after the first: the first also samples model state at every gradient
                    # (ModelStatePeak, quadratic in parameter tensors: 250 of 280 s for Llama-3-8B here)
                    trainer.train_step(trainer.start_step + 1)
                snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
            events = [e for chunk in chunks for e in chunk] + trainer._step_events
            if micro_batches is not None and micro_batches > cfg.grad_accum:
                events += chunks[2] * (micro_batches - cfg.grad_accum)  # chunks[2]: the second micro-batch's
        finally:
            trainer.collectives.disable()
    from profilers.bandwidth import aggregate

    memory = {getattr(k, "value", str(k)): float(v) for k, v in snapshot.items() if k != "Total"}
    return RoleResult(rank=rank, coords=trainer.coords, memory=memory, peak=sum(memory.values()), tracker=name,
                      collectives={k: {"count": a["count"], "bytes": a["bytes"]} for k, a in aggregate(events).items()},
                      seconds=time.perf_counter() - start)


@contextlib.contextmanager
def _fake_world(world: int, rank: int) -> Iterator[None]:
    """torch's `fake` backend playing `rank` of `world` in this process (with the world as host group)."""
    from engine.device import init_host_group
    from engine.torch_compat import fake_store

    if dist.is_initialized():
        raise RuntimeError("dry_run needs a process without a process group: it plays one rank of a fake world")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world)
    try:
        init_host_group(side=False)  # host objects go over the (fake) world group
        yield
    finally:
        dist.destroy_process_group()


def _materialize(trainer: Any) -> None:
    """Swap this rank's parameters and buffers (allocated by the build, never written: no memory
    touched) for fake ones of the same shapes, then build the optimizer over them (fused or not as
    on a real CPU run): the step's autograd leaves must be the fake mode's own tensors. Not
    `Module._apply`: a plain tensor the fake mode has seen carries a weakref (swap refuses)."""
    from torch.distributed.tensor import DTensor

    from engine.train.comm_setup import build_optimizer

    par, memo = trainer.par, {}
    for module in par.modules:
        for sub in module.modules():
            for name, tensor in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]:
                if id(tensor) in memo:
                    setattr(sub, name, memo[id(tensor)])  # a tied weight: one tensor for both
                elif isinstance(tensor, DTensor):
                    memo[id(tensor)] = tensor
                    torch.utils.swap_tensors(tensor, nn.Parameter(torch.empty_like(tensor, device="cpu"),
                                                                  requires_grad=tensor.requires_grad))
                else:
                    new = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
                    memo[id(tensor)] = nn.Parameter(new, requires_grad=tensor.requires_grad) \
                        if isinstance(tensor, nn.Parameter) else new
                    setattr(sub, name, memo[id(tensor)])
    par.optimizer = build_optimizer(par, trainer.cfg, trainer.mesh)


def _static_stage_meta(trainer: Any, x: torch.Tensor) -> None:
    """Each local pipeline stage's input and output shapes, from a no-grad forward of its chunk
    (a middle stage receives the (micro, seq, d_model) hidden state: fp32 under autocast, FSDP2's
    bf16 under its mixed precision), handed to the stage: torch's schedule would otherwise ask its
    neighbours, which a fake backend cannot answer."""
    from torch.distributed.fsdp import FSDPModule

    from engine.parallel.parallelize import fsdp_mp_policy
    from engine.torch_compat import set_static_stage_meta

    cfg, micro = trainer.cfg, trainer.cfg.batch.micro
    for stage in trainer.par.pipeline.stages:
        policy = fsdp_mp_policy(cfg) if isinstance(stage.submod, FSDPModule) else None
        hidden = policy.param_dtype if policy is not None else torch.float32
        inp = x[:micro].contiguous() if stage.is_first else torch.empty(micro, x.shape[1], cfg.model.d_model,
                                                                         dtype=hidden)
        with torch.no_grad(), trainer._autocast():
            out = stage.submod(inp)
        if not stage.is_last and (out.shape != inp.shape[:2] + (cfg.model.d_model,) or out.dtype != hidden):
            raise ConfigError("parallel.pp", cfg.parallel.pp, f"the dry run passes (micro, seq, d_model) {hidden} "
                              f"hidden states between stages; stage {stage.stage_index} returns {tuple(out.shape)} "
                              f"{out.dtype}")
        # received activations and the outputs are differentiable: their gradients travel back
        set_static_stage_meta(stage, (inp if stage.is_first else inp.requires_grad_(),), (out.requires_grad_(),))
        for module in stage.submod.modules():
            if isinstance(module, FSDPModule):
                module.reshard()  # as before any step: the schedule unshards each stage itself


def _optimizer_states(par: Any) -> None:
    """Create the optimizer's states as an earlier step would have (AdamW makes them in its first
    step): the step measured is a steady-state one, whose peak holds them."""
    for p in par.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    par.optimizer.step()
    par.optimizer.zero_grad(set_to_none=True)


def _tracker(par: Any) -> tuple[Any, str]:
    """FSDPMemTracker for one FSDP2 root (its categories name FSDP2's buffers), else MemTracker."""
    from torch.distributed.fsdp import FSDPModule

    from engine.torch_compat import memory_trackers

    mem_tracker, fsdp_tracker = memory_trackers()
    # ZeroRedundancyOptimizer and DTensorZeroOptimizer keep this rank's states in their inner `.optim`
    optimizer = getattr(par.optimizer, "optim", par.optimizer)
    if len(par.modules) == 1 and isinstance(par.modules[0], FSDPModule):
        return fsdp_tracker(par.modules[0], optimizer), "FSDPMemTracker"
    tracker = mem_tracker()
    tracker.track_external(*par.modules, optimizer)
    return tracker, "MemTracker"


@contextlib.contextmanager
def _per_micro_batch(tracker: Any, roots: list[nn.Module], before: Any = None) -> Iterator[None]:
    """Let the tracker see a root module run once per micro-batch (accumulation, pipeline schedules):
    its per-module stats are reset before each root forward outside backward, as the trackers ask
    (`reset_mod_stats`); the peak snapshot spans the whole step. `before()` is called there too. A
    global hook, registered before the tracker's own, so it runs first."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    from engine.torch_compat import tracker_in_backward

    ids = {id(m) for m in roots}

    def reset(module: nn.Module, args: Any) -> None:
        if id(module) in ids and not tracker_in_backward(tracker):
            tracker.reset_mod_stats()
            if before is not None:
                before()

    handle = register_module_forward_pre_hook(reset)
    try:
        yield
    finally:
        handle.remove()


class _ScalarReads(TorchDispatchMode):
    """Answers every host read of a tensor's value (`.item()`, `float(t)`) with 1: fake tensors hold
    none. The step reads values only for the loss it logs, the grad-norm clip coefficient (a norm
    of 1 clips nothing), the pipeline schedule's warm-up vote (1: every stage has static shapes,
    which `_static_stage_meta` gave them) and an MoE layer's tokens per expert (`_balanced_counts`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is LOCAL_SCALAR_DENSE:
            return True if args[0].dtype == torch.bool else 1 if not args[0].is_floating_point() else 1.0
        if func is BINCOUNT and _is_fake(args[0]):
            return _balanced_counts(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


BINCOUNT = torch.ops.aten.bincount.default


def _is_fake(tensor: torch.Tensor) -> bool:
    from engine.torch_compat import is_fake

    return is_fake(tensor)


def _balanced_counts(ids: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0) -> torch.Tensor:
    """`torch.bincount` of an MoE layer's expert ids (engine/parallel/expert_fused.py, engine/model/moe.py)
    under the fake mode, whose output shape depends on values it has not got: the counts of a balanced
    router, every one of the `minlength` experts given len(ids) / minlength assignments (the first ones
    one more where it does not divide), as a real tensor, so the split that reads them gets Python ints.
    A real run's router is rarely balanced; a dropless layer still runs the same len(ids) rows through
    its experts, so the bytes its experts keep are the same; only one expert's transient buffers, sized
    by its own rows, differ."""
    from engine.torch_compat import unset_fake_temporarily

    if weights is not None or minlength < 1:
        raise ConfigError("model.hf", "an MoE model", "the dry run answers bincount of expert ids only "
                          f"(minlength the expert count; got minlength={minlength}, weights={weights is not None})")
    base, extra = divmod(ids.numel(), minlength)
    with unset_fake_temporarily():
        return torch.tensor([base + (e < extra) for e in range(minlength)], dtype=torch.long)


# ------------------------------------------------------------------ the launcher's pre-flight
# the knob behind each category, for the one-line refusal
_REMEDY = {"params": ("parallel.zero", "shard the model state (parallel.zero=3, more dp) or add tp/pp"),
           "grads": ("parallel.zero", "shard the model state (parallel.zero=2 or 3, more dp) or add tp/pp"),
           "optimizer": ("parallel.zero", "shard the optimizer states (parallel.zero>=1, more dp) or add tp/pp"),
           "activations": ("batch.micro", "lower batch.micro or model.seq_len, set train.activation_checkpointing, "
                                          "or add tp/pp/cp"),
           "comm buffers": ("parallel.zero", "add tp/pp (FSDP2 gathers whole blocks)"),
           "other": ("batch.micro", "lower batch.micro or add tp/pp")}


def fits_error(dry: DryRun, *, limit_bytes: float, limit_name: str, cfg: RunConfig) -> ConfigError | None:
    """The one-line refusal of a dry run whose busiest rank peaks above `limit_bytes` (None: it fits).
    It names the rank, its peak, the category holding the most and the knob behind it."""
    role = dry.peak_role()
    if role.peak <= limit_bytes:
        return None
    category, held = max(role.grouped().items(), key=lambda kv: kv[1])
    field, fix = _REMEDY[category]
    value = cfg.batch.micro if field == "batch.micro" else cfg.parallel.zero
    where = ", ".join(f"{k} {v}" for k, v in role.coords.items())
    return ConfigError(field, value, f"the dry run of rank {role.rank} ({where}) peaks at {role.peak / GIB:.3g} GiB, "
                       f"{category} {held / GIB:.3g} GiB the largest, more than the {limit_bytes / GIB:.3g} GiB "
                       f"{limit_name}; {fix}")


def preflight(cfg: RunConfig, *, device_memory_gib: float | None = None) -> DryRun | None:
    """Before any rank starts: dry-run `cfg` in a process of its own and raise ConfigError when its
    busiest rank would not fit the target device memory (`device_memory_target`). Skipped (None)
    when no target is known (a CPU run without --device-memory), or when the analytic estimate
    (engine/train/memory.py) is under half the target: a dry run costs seconds (tiny) to minutes (8B)."""
    from engine.train.memory import estimate_memory

    target = device_memory_target(cfg, device_memory_gib)
    if target is None or cfg.model.entry is not None:
        return None
    limit, name = target
    if sum(estimate_memory(cfg).values()) < 0.5 * limit:
        return None
    try:
        check_playable(cfg)
        dry = dry_run_subprocess(cfg)
    except (ConfigError, RuntimeError) as exc:  # a layout the dry run cannot play: the analytic estimate judges
        logger.warning("pre-flight: %s; judging by the analytic memory estimate instead", str(exc).splitlines()[0])
        from engine.train.memory import memory_error

        error = memory_error(cfg, limit_bytes=limit, ranks_sharing=1, limit_name=name)
        if error is not None:
            raise error from None
        return None
    error = fits_error(dry, limit_bytes=limit, limit_name=name, cfg=cfg)
    if error is not None:
        raise error
    return dry


def dry_run_subprocess(cfg: RunConfig) -> DryRun:
    """`dry_run(cfg)` in a fresh Python process (the fake process group and the meta build stay out
    of the caller's); a failure comes back as RuntimeError with the dry run's last lines."""
    with DryRunProcess() as run:
        return run(cfg)


class DryRunProcess:
    """Dry runs in a Python process of their own, one after another: `run = DryRunProcess(); run(cfg)`
    per config, `close()` (or `with`) at the end. The process starts at the first call and pays the imports
    once (torch and the model's library: about 5 of a tiny model's 7 s here); each dry run still starts and
    ends its own fake process groups. A failure is a RuntimeError with the dry run's last lines; a dry run
    that ends the process is one too, and the next call starts another process."""

    def __init__(self) -> None:
        self._proc: Any = None
        self._stderr: Any = None

    def __enter__(self) -> DryRunProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(self, cfg: RunConfig) -> DryRun:
        import json

        if self._proc is None or self._proc.poll() is not None:  # not started, or ended since the last call
            self.close()
            self._start()
        try:
            self._proc.stdin.write(json.dumps(cfg.to_dict()) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:  # the process ended: what it said last is the reason
            self._stderr.seek(0)
            said = self._stderr.read().decode(errors="replace").strip()[-2000:]
            self.close()
            raise RuntimeError(f"the dry run failed: {said or 'its process ended without a word'}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the dry run failed: {answer['error']}")
        return DryRun.from_dict(answer["result"])

    def _start(self) -> None:
        import os
        import subprocess
        import sys
        import tempfile

        self._stderr = tempfile.TemporaryFile()  # a file, not a pipe: a dry run's warnings never block it
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "engine.train.dryrun", "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr, text=True,
            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})

    def close(self) -> None:
        """End the process (it exits when its input closes) and drop what it said."""
        import subprocess

        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


def _dry_run_dict(data: dict[str, Any], ranks: list[int] | None = None) -> dict[str, Any]:
    """A saved run config (its dict) validated and dry-run: the dry run as a dict (what both entries print)."""
    from engine.config.schema import from_dict, validate

    cfg = from_dict(data)
    validate(cfg)
    return dry_run(cfg, ranks=ranks).to_dict()


def _serve() -> None:
    """`python -m engine.train.dryrun --serve`: one run config (JSON) per input line, one answer per output
    line, {"result": the dry run} or {"error": its traceback's last lines}; anything else printed goes to stderr."""
    import json
    import sys
    import traceback

    answers, sys.stdout = sys.stdout, sys.stderr
    for line in sys.stdin:
        try:
            answer: dict[str, Any] = {"result": _dry_run_dict(json.loads(line))}
        except Exception:  # noqa: BLE001 - the caller raises it, with these lines
            answer = {"error": traceback.format_exc().strip()[-2000:]}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def main(argv: list[str] | None = None) -> None:
    """`python -m engine.train.dryrun CONFIG.json [RANK ...]`: the dry run of a saved run config as JSON on
    stdout; `--serve`: dry runs of configs read from stdin, one per line (`DryRunProcess`)."""
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    if args == ["--serve"]:
        _serve()
        return
    with open(args[0]) as f:
        data = json.load(f)
    sys.stdout.write(json.dumps(_dry_run_dict(data, [int(r) for r in args[1:]] or None)) + "\n")


if __name__ == "__main__":
    from engine.quick_exit import quick_exit

    main()
    quick_exit(0)  # the caller waits for this process to end: not for the teardown of torch and the model's library
