"""Pipeline parallelism: stages from a layer split, run by `torch.distributed.pipelining` schedules.

`build_pipeline` cuts a `GPT` (usually still on meta: engine/model/meta_init.py) into stage chunks the
torchtitan way (a copy per chunk of only the blocks it owns, `tok_emb`/`pos_emb` None except on the
first chunk and `ln_f`/`head` None except on the last), wraps each chunk in a
`PipelineStage` and runs the schedule's action list (engine/parallel/schedules.py) on torch's
`_PipelineScheduleRuntime`. Rank r of the pp group holds chunks r, r + pp, r + 2 pp, ...
(Narayanan et al. 2021, section 2.2); under zbv / dualpipev chunks r and 2pp-1-r (V shape).

Tied embeddings across stages follow Megatron-LM's embedding group: the first stage owns
`tok_emb.weight`, the last stage owns `head.weight`, two Parameters initialised identically;
after backward their gradients are summed over a group of exactly those two ranks, so both
apply the same update and stay identical.
"""
from __future__ import annotations

import copy
import time
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B
from torch.nn.parallel import DistributedDataParallel

from engine.device import host_group
from engine.torch_compat import (
    _Action,
    _ComputationType,
    _format_pipeline_order,
    _PipelineScheduleRuntime,
    prepare_schedule_with_comms,
    rank_operations,
)
from engine.model.gpt import GPT
from engine.parallel.schedules import (
    _single_stage_order,
    chunks_per_rank,
    compute_actions,
    schedule_actions,
    stage_to_rank,
    with_comms,
)
from engine.parallel.stages import stage_layers  # torch-free home, still importable from here
from engine.config.validate import SCHEDULES


def _contiguous(batch: torch.Tensor | None) -> torch.Tensor | None:
    """`batch` laid out densely: older torch's stages (2.11 here) check micro-batch strides against the
    (dense) example inputs, and `tokens[:, :-1]` has the stride of seq + 1."""
    return None if batch is None else batch.contiguous()


def bubble_fraction(schedule: str, pp: int, n_microbatches: int, virtual: int = 1) -> float:
    """Idle fraction of a pipeline step relative to its ideal compute time.

    (p-1)/m for GPipe and 1F1B, (p-1)/(v m) for interleaved 1F1B with v chunks per rank
    (Narayanan et al. 2021, section 2.2; formulas.md "Pipeline bubble").
    """
    _check_schedule(schedule)
    if pp < 1 or n_microbatches < 1 or virtual < 1:
        raise ValueError(f"need pp, n_microbatches, virtual >= 1; got {pp=}, {n_microbatches=}, {virtual=}")
    chunks = virtual if schedule == "interleaved" else 1
    return (pp - 1) / (chunks * n_microbatches)


def describe_schedule(schedule: str, pp: int, n_microbatches: int, virtual: int = 1) -> str:
    """The schedule as torch's step x rank grid of `_Action`s (`1F0`: stage 1 forward of micro-batch 0).

    Each rank runs its actions in the order the schedule executes them; an action is placed at
    the first unit time step where the rank is free and its inputs are ready (forward after the
    previous stage's forward, backward after the next stage's backward), so empty cells are
    the bubble. Computed without processes.
    """
    _check_schedule(schedule)
    num_stages = pp * (virtual if schedule == "interleaved" else 1)
    if schedule == "interleaved":
        rounds = max(1, n_microbatches // pp)
        fake = SimpleNamespace(n_local_stages=virtual, pp_group_size=pp, _n_microbatches=n_microbatches,
                               microbatches_per_round=n_microbatches // rounds)
        orders = {r: [a for a in rank_operations(ScheduleInterleaved1F1B, fake, r) if a]
                  for r in range(pp)}
    else:
        orders = {r: _single_stage_order(schedule, r, pp, n_microbatches) for r in range(pp)}
    return _format_pipeline_order(_unit_time_grid(orders, num_stages))


def _unit_time_grid(orders: dict[int, list[_Action]], num_stages: int) -> dict[int, list[_Action | None]]:
    finished: dict[tuple[int, str, int | None], int] = {}
    grid: dict[int, list[_Action | None]] = {r: [] for r in orders}
    position = dict.fromkeys(orders, 0)
    step = 0
    while any(position[r] < len(orders[r]) for r in orders):
        placed = []
        for rank, actions in orders.items():
            action = actions[position[rank]] if position[rank] < len(actions) else None
            ready = action is not None and all(finished.get(dep, step) < step for dep in _deps(action, num_stages))
            grid[rank].append(action if ready else None)
            if ready:
                placed.append(action)
                position[rank] += 1
        if not placed:
            raise RuntimeError(f"schedule deadlocks at step {step}: {_format_pipeline_order(grid)}")
        finished.update({(a.stage_index, a.computation_type.value, a.microbatch_index): step for a in placed})
        step += 1
    return grid


def _deps(action: _Action, num_stages: int) -> list[tuple[int, str, int | None]]:
    s, mb = action.stage_index, action.microbatch_index
    forward = _ComputationType.FORWARD.value
    if action.computation_type == _ComputationType.FORWARD:
        return [(s - 1, forward, mb)] if s > 0 else []
    later = [(s + 1, _ComputationType.FULL_BACKWARD.value, mb)] if s < num_stages - 1 else []
    return [(s, forward, mb)] + later


class _Clock:
    """Spans of this rank's own stage compute in the current step, as (start, end, backward) marks.

    On CUDA a mark is a CUDA event recorded on the current (compute) stream, read only after
    the step's work is done: host time around asynchronous kernel launches would measure the
    launches, not the compute. On CPU a mark is `time.perf_counter()`.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
        self.spans: list[tuple[Any, Any, bool]] = []
        self.actions: list[tuple[str, Any, Any]] = []  # (torch action string, start, end) as executed
        # activation bytes autograd saved in each (stage, micro-batch) forward, held until its
        # backward (B, or W after a split I) frees them; `peak_saved` is this step's most held at once
        self.saved: dict[tuple[int, int], int] = {}
        self.peak_saved = 0

    def mark(self) -> Any:
        """Now, on this clock."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two marks (on CUDA, once both events completed)."""
        return start.elapsed_time(end) / 1000.0 if self.cuda else end - start

    def timed(self, fn: Callable[..., Any], *args: Any, backward: bool = False, **kwargs: Any) -> Any:
        start = self.mark()
        try:
            return fn(*args, **kwargs)
        finally:
            self.spans.append((start, self.mark(), backward))

    def resolve(self, spans: list[tuple[Any, Any, bool]]) -> tuple[float, float]:
        """(compute, backward) seconds of `spans`."""
        compute = backward = 0.0
        for start, end, is_backward in spans:
            seconds = self.seconds(start, end)
            compute += seconds
            backward += seconds if is_backward else 0.0
        return compute, backward


class _TimedStage(PipelineStage):
    """A PipelineStage that times its forward and backward calls (the compute of this rank)."""

    def __init__(self, *args: Any, clock: _Clock, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._clock = clock

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        return self._clock.timed(super().forward_maybe_with_nosync, *args, **kwargs)

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        # older torch (2.11 here) warms up each neighbour stage by p2p, also one on this very rank (V
        # schedules: zbv, dualpipev), and gloo has no pair to itself; newer torch skips those
        me = dist.get_rank(self.group)
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != me]

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        return self._clock.timed(super().backward_maybe_with_nosync, backward_type, bwd_kwargs,
                                 last_backward=last_backward, backward=True)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        return self._recorded("F", fwd_chunk_id, super().forward_one_chunk, fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> Any:
        return self._recorded("B" if full_backward else "I", bwd_chunk_id, super().backward_one_chunk, bwd_chunk_id,
                              loss=loss, full_backward=full_backward, last_backward=last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> Any:
        return self._recorded("W", bwd_chunk_id, super().backward_weight_one_chunk, bwd_chunk_id,
                              last_backward=last_backward)

    def _recorded(self, kind: str, mb: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = self._clock.mark()
        try:
            if kind != "F":
                return fn(*args, **kwargs)
            with torch.autograd.graph.saved_tensors_hooks(self._count_saved(mb), lambda t: t):
                return fn(*args, **kwargs)
        finally:
            self._clock.actions.append((f"{self.stage_index}{kind}{mb}", start, self._clock.mark()))
            if kind in ("B", "W"):
                self._clock.saved.pop((self.stage_index, mb), None)

    def _count_saved(self, mb: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """A pack hook adding the bytes of each tensor autograd saves (not the weights; a tensor
        saved twice counts once) to this forward's activations, and updating the step's peak."""
        clock, key = self._clock, (self.stage_index, mb)
        seen = {(p.data_ptr(), p.numel()) for p in self.submod.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            ident = (t.data_ptr(), t.numel()) if type(t) is torch.Tensor else None  # plain tensors only
            if ident is not None and ident not in seen:
                seen.add(ident)
                clock.saved[key] = clock.saved.get(key, 0) + t.numel() * t.element_size()
                clock.peak_saved = max(clock.peak_saved, sum(clock.saved.values()))
            return t

        return pack

    def _compute_outputs(self, *args: torch.Tensor, module: nn.Module, **kwargs: Any) -> Any:
        # shape inference only: through DDP's forward it would arm the reducer outside no_sync,
        # which then records every parameter twice and fails its bucket rebuild (torch 2.13)
        if isinstance(module, DistributedDataParallel):
            module = module.module
        return super()._compute_outputs(*args, module=module, **kwargs)


class Pipeline:
    """This rank's pipeline stages and schedule.

    Timing (`last_timing`): `total_s` is the wall time of the schedule step; `compute_s` is the
    time spent inside this rank's stage forward calls (`forward_maybe_with_nosync`), backward
    calls (`backward_maybe_with_nosync`, i.e. the autograd pass of the stage, including DDP's
    reduction on the last micro-batch when a stage is DDP-wrapped) and the loss on the last
    stage, measured by subclassing `PipelineStage`; `bubble_s = total_s - compute_s` is the
    time this rank waited on its neighbours (pipeline fill/drain plus exposed p2p transfers).
    Stage-module hooks are not used because shape inference also runs the module (a forward
    and backward on placeholder tensors, on the first step and after switching between
    `step` and `evaluate`); that one-off pass counts as bubble in the step it happens.
    """

    def __init__(self, *, stages: list[_TimedStage], schedule: Any, n_microbatches: int,
                 clock: _Clock, embedding_group: dist.ProcessGroup | None,
                 actions: dict[int, list[_Action]] | None = None, name: str = "",
                 eval_order: dict[int, list[_Action]] | None = None) -> None:
        self.stages = stages
        self.name = name
        self.actions = actions or {}  # the planned compute actions of every pp rank (schedules.py)
        self._eval_order = eval_order  # the forward-only lowered order `evaluate` runs (forward_only)
        self.schedule = schedule
        self.n_microbatches = n_microbatches
        self.modules: list[nn.Module] = [s.submod for s in stages]
        self.is_first = any(s.is_first for s in stages)
        self.is_last = any(s.is_last for s in stages)
        self._clock = clock
        self._embedding_group = embedding_group
        self._tied_synced = True
        self._step_marks: tuple[Any, Any, list[tuple[Any, Any, bool]]] | None = None
        self._step_actions: list[tuple[str, Any, Any]] = []
        self._peak_saved = 0
        self._wall_start = 0.0

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor | None:
        """Forward + backward of all micro-batches of this rank's local batch; then the tied-grad sync.

        `inputs` is read on the first stage and `targets` on the last (others may pass None).
        Returns, on the last stage, the mean over micro-batches of the mean token loss (equal to
        the full-batch mean loss); None elsewhere. Gradients are those of that mean loss.
        """
        losses: list[torch.Tensor] | None = [] if self.is_last else None
        inputs, targets = _contiguous(inputs), _contiguous(targets)
        args = (inputs,) if self.is_first else ()
        self._clock.spans, self._clock.actions = [], []
        self._clock.saved, self._clock.peak_saved = {}, 0
        self._wall_start = time.time()
        start = self._clock.mark()
        self.schedule.step(*args, target=targets if self.is_last else None, losses=losses, return_outputs=False)
        self._step_marks = (start, self._clock.mark(), list(self._clock.spans))  # evaluate() adds more
        self._step_actions = list(self._clock.actions)
        self._peak_saved = self._clock.peak_saved
        self._tied_synced = False
        self.sync_tied_grads()
        return torch.stack(losses).sum().detach() if losses else None

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor | None:
        """Forward-only pass over the micro-batches; the mean loss on the last stage, else None."""
        losses: list[torch.Tensor] | None = [] if self.is_last else None
        inputs, targets = _contiguous(inputs), _contiguous(targets)
        args = (inputs,) if self.is_first else ()
        train_order = self.schedule.pipeline_order_with_comms
        if self._eval_order is not None:
            self.schedule.pipeline_order_with_comms = self._eval_order
        try:
            self.schedule.eval(*args, target=targets if self.is_last else None, losses=losses)
        finally:
            self.schedule.pipeline_order_with_comms = train_order
        return torch.stack(losses).sum().detach() if losses else None

    def sync_tied_grads(self) -> None:
        """Sum the tok_emb / head weight gradients over the first and last stage ranks.

        `step` calls it; a second call in the same step does nothing (summing twice would
        double the gradient). Must run on every rank of the embedding group.
        """
        if self._tied_synced:
            return
        self._tied_synced = True
        tied = self._tied_weights()
        if len(tied) == 2 and tied[0] is not tied[1]:  # V schedules: the first and the last stage live on this rank
            total = sum(w.grad if w.grad is not None else torch.zeros_like(w) for w in tied)
            for weight in tied:
                weight.grad = total.clone()
            return
        if self._embedding_group is None:
            return
        for weight in tied:
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            dist.all_reduce(_local(weight.grad), group=self._embedding_group)

    def _tied_weights(self) -> list[nn.Parameter]:
        weights = []
        for module in self.modules:
            gpt = _unwrap(module)
            if not getattr(gpt, "tied", True):  # an untied head (most Hugging Face models) syncs nothing
                continue
            if gpt.tok_emb is not None:
                weights.append(gpt.tok_emb.weight)
            if gpt.head is not None:
                weights.append(gpt.head.weight)
        return weights

    @property
    def last_actions(self) -> dict[str, Any]:
        """The compute actions this rank executed in the last `step`, in order, with seconds from
        the step's start: {"wall_start": epoch seconds of the start, "actions": [[action, start_s,
        end_s], ...], "total_s": ..., "peak_act_bytes": most activation bytes autograd held at once
        for this rank's stages (saved-tensor hooks; weights excluded)}. Shape inference on a first
        step is not an action."""
        if self._step_marks is None:
            return {"wall_start": 0.0, "actions": [], "total_s": 0.0, "peak_act_bytes": 0}
        start, end, _ = self._step_marks
        rows = [[name, self._clock.seconds(start, a), self._clock.seconds(start, b)]
                for name, a, b in self._step_actions]
        return {"wall_start": self._wall_start, "actions": rows, "total_s": self._clock.seconds(start, end),
                "peak_act_bytes": self._peak_saved}

    @property
    def last_timing(self) -> dict[str, float]:
        """Seconds of the last `step` (see the class docstring); on CUDA read it after the step's
        work completed (the StepTimer resolves it after its one synchronise)."""
        if self._step_marks is None:
            return {"compute_s": 0.0, "bubble_s": 0.0, "total_s": 0.0, "backward_s": 0.0}
        start, end, spans = self._step_marks
        total = self._clock.seconds(start, end)
        compute, backward = self._clock.resolve(spans)
        compute = min(compute, total)
        return {"compute_s": compute, "bubble_s": total - compute, "total_s": total,
                "backward_s": min(backward, compute)}


def build_pipeline(model: GPT, pp_mesh: Any, *, schedule: str, virtual: int = 1,
                   layer_split: list[int] | None = None, n_microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   device: torch.device | str = "cpu",
                   parallelize: Callable[[nn.Module], nn.Module] | None = None,
                   materialize: Callable[..., None] | None = None) -> Pipeline:
    """Split `model` into this rank's stage chunks and build the schedule over the pp axis.

    `pp_mesh` is the 1-D pp submesh of this rank (`mesh["pp"]`). `parallelize(chunk)`, if
    given, is applied to each chunk before its stage is built (tensor parallel first, then
    DDP/FSDP, as torchtitan applies its parallelize_fn per model part), so the stage calls the
    wrapped module. `materialize(*chunks)` then gets this rank's chunks of a meta-built model
    together (engine/model/meta_init.py: one replay of the init for all of them). Must be called on
    every rank of the world (it creates the embedding groups).
    """
    _check_schedule(schedule)
    if schedule == "skip":
        raise ValueError("parallel.schedule='skip' runs on engine.parallel.skippipe.build_skip_pipeline")
    group = pp_mesh.get_group()
    pp, pp_rank = dist.get_world_size(group), dist.get_rank(group)
    per_rank = chunks_per_rank(schedule, virtual, layers=model.cfg.layers, pp=pp)
    plan = stage_layers(model.cfg.layers, pp, per_rank, layer_split if schedule != "modular" else None)
    num_stages, clock = len(plan), _Clock(device)
    placement = stage_to_rank(schedule, pp, num_stages)
    chunks = {}
    for stage_index in sorted(s for s, r in placement.items() if r == pp_rank):
        chunk = _build_chunk(model, plan[stage_index], first=stage_index == 0, last=stage_index == num_stages - 1)
        chunks[stage_index] = parallelize(chunk) if parallelize is not None else chunk
    if materialize is not None:
        materialize(*chunks.values())
    stages = [_TimedStage(chunk, stage_index, num_stages, torch.device(device), group=group, clock=clock)
              for stage_index, chunk in chunks.items()]

    def scaled_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # schedules sum micro-batch gradients; 1/m makes them those of the mean loss
        return clock.timed(loss_fn, output, target) / n_microbatches

    actions = schedule_actions(schedule=schedule, pp=pp, n_microbatches=n_microbatches, virtual=virtual,
                               layers=model.cfg.layers)
    # torch's runtime executes any compute-only action list (it adds send/recv, unshard/reshard)
    runner = _PipelineScheduleRuntime(stages, n_microbatches, loss_fn=scaled_loss, scale_grads=False)
    runner.pipeline_order = dict(actions)
    prepare_schedule_with_comms(runner, actions)
    return Pipeline(stages=stages, schedule=runner, n_microbatches=n_microbatches, clock=clock,
                    embedding_group=_embedding_group(group) if pp > 1 and placement[num_stages - 1] != 0 else None,
                    actions=actions, name=schedule, eval_order=with_comms(forward_only(actions), placement))


def forward_only(actions: dict[int, list[_Action]]) -> dict[int, list[_Action]]:
    """The forwards of a training order, in its order (an OVERLAP_F_B gives its forward), each
    rank's stages unsharded before them and resharded after (FSDP stages; a no-op otherwise):
    what `evaluate` runs. torch's `eval()` runs the training order with backwards as no-ops, and
    under zbv / dualpipev a backward hands its input gradient to the stage beside it on the same
    rank, which fails without a backward ("can't steal_bwd_input if this stage doesn't have
    backward"). Lowered by `with_comms`: torch's own lowering checks every stage has its backwards."""
    ct = _ComputationType
    out = {}
    for rank, order in actions.items():
        forwards = [a for action in order for a in compute_actions(action) if a.computation_type == ct.FORWARD]
        stages = list(dict.fromkeys(a.stage_index for a in forwards))
        out[rank] = [*(_Action(s, ct.UNSHARD, None) for s in stages), *forwards,
                     *(_Action(s, ct.RESHARD, None) for s in stages)]
    return out


@torch.no_grad()
def allreduce_grads(modules: list[nn.Module], dp_group: dist.ProcessGroup | None) -> None:
    """Average the gradients of the stage modules over the dp group (one flat all_reduce).

    The explicit alternative to wrapping each stage in DDP through `parallelize` (which
    `PipelineStage` supports: `no_sync` until the last micro-batch); use one or the other.
    DTensor (tensor-parallel) gradients are averaged through their local shards.
    """
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        return
    grads = [_local(p.grad) for m in modules for p in m.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    # AVG is a gloo-supported op; PREMUL_SUM is not (platform.md)
    dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=dp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (shares storage with it), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _build_chunk(model: GPT, layer_ids: list[int], *, first: bool, last: bool) -> GPT:
    """A copy of `model` holding only `layer_ids` (block names kept) and the ends it owns: the
    other blocks and ends are never copied (on a meta model nothing is allocated either way). A
    tied head on a last stage that is not the first is a Parameter of its own (Megatron's embedding
    group keeps the two equal)."""
    keep = {str(i) for i in layer_ids}
    dropped = [b for name, b in model.layers.items() if name not in keep]
    if not first:
        dropped += [model.tok_emb, model.pos_emb]
    if not last:
        dropped += [model.ln_f, model.head]
    memo: dict[int, Any] = {id(m): None for m in dropped if m is not None}  # deepcopy: None instead
    chunk = copy.deepcopy(model, memo)
    for name in [n for n, b in chunk.layers._modules.items() if b is None]:
        del chunk.layers[name]
    return chunk


def _embedding_group(pp_group: dist.ProcessGroup) -> dist.ProcessGroup | None:
    """Megatron's embedding group: this pipeline's first and last stage ranks.

    Every rank learns every pipeline's (first, last) pair, then all ranks create all groups in
    the same order, as `dist.new_group` requires; a rank gets back the group it belongs to.
    """
    ranks = dist.get_process_group_ranks(pp_group)
    pairs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pairs, (ranks[0], ranks[-1]), group=host_group())  # host objects
    mine = None
    for pair in sorted(set(pairs)):
        group = dist.new_group(list(pair))
        if dist.get_rank() in pair:
            mine = group
    return mine


def _unwrap(module: nn.Module) -> GPT:
    """The GPT chunk inside a DDP wrapper (FSDP2 and TP modify the module in place)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.schedule={schedule!r} must be one of {', '.join(SCHEDULES)}")
