"""SkipPipe partial pipelines (gensyn-ai/skippipe; Blagoev et al. 2025), ours on one pipeline.

Each micro-batch follows a path of stages that always starts at the first stage and ends at the
last, skipping `round(skip_ratio * (pp - 2))` of the middle stages. Pure part:

- `skip_paths(pp=, n_microbatches=, skip_ratio=, step=)`: which middle stages each micro-batch
  skips. Over a batch every middle stage is visited equally often when n_microbatches is a
  multiple of the number of middle stages (skip sets rotate); consecutive micro-batches skip
  different stages, so their visits spread over the stages (ours: rotation instead of the
  paper's conflict-based search over many nodes per stage, which one node per stage does not
  need). The rotation starts at `step`, so the paths change from step to step.
- `skip_actions(paths, pp=, mem_cap=)`: the per-rank action lists, from a unit-time list
  scheduler over the paths: a rank runs a ready backward first (1F1B), a forward only while its
  stage holds fewer than `mem_cap` micro-batches' activations (the collision rule: never more
  micro-batches on a stage at once than its memory allows), so no stage exceeds its cap.

Process part: `build_skip_pipeline` cuts the model into pp stage chunks (one per rank) and
`SkipPipeline.step` runs the action list with point-to-point isend / blocking recv to the
stage before / after on each micro-batch's path (torch's runtime sends only to the adjacent
stage, so the path hops are explicit here). Deadlock-free: every rank follows one global
timeline, so each recv's matching send was issued earlier on it.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from engine.model.gpt import GPT
from engine.torch_compat import _Action, _ComputationType

F, B = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD


def skipped_per_microbatch(pp: int, skip_ratio: float) -> int:
    """Middle stages a micro-batch skips: round(skip_ratio * (pp - 2)) (the first and the last
    stage are always visited)."""
    return min(max(pp - 2, 0), round(skip_ratio * max(pp - 2, 0)))


def skip_paths(*, pp: int, n_microbatches: int, skip_ratio: float, step: int = 0) -> dict[int, list[int]]:
    """The stages each micro-batch visits, in order (see the module docstring)."""
    middle = list(range(1, pp - 1))
    k = skipped_per_microbatch(pp, skip_ratio)
    paths = {}
    for mb in range(n_microbatches):
        offset = (step * k + mb * k) % len(middle) if middle else 0
        skipped = {middle[(offset + j) % len(middle)] for j in range(k)}
        paths[mb] = [0] + [s for s in middle if s not in skipped] + ([pp - 1] if pp > 1 else [])
    return paths


def skip_actions(paths: dict[int, list[int]], *, pp: int, mem_cap: int | None = None) -> dict[int, list[_Action]]:
    """Per rank (= stage), its forwards and backwards in execution order, from a unit-time list
    scheduler: at each time step every rank runs one ready action, a backward before a forward,
    and a forward only while fewer than `mem_cap` (default pp) micro-batches are in flight on it."""
    cap = mem_cap or pp
    pos = {mb: 0 for mb in paths}  # forward progress: index on the path of the next stage to run
    fwd_done: dict[tuple[int, int], int] = {}
    bwd_done: dict[tuple[int, int], int] = {}
    in_flight = {s: set() for s in range(pp)}
    orders: dict[int, list[_Action]] = {s: [] for s in range(pp)}
    total = sum(2 * len(p) for p in paths.values())
    t = 0
    while sum(len(o) for o in orders.values()) < total:
        ran = []
        for stage in range(pp):
            action = _pick(stage, t, paths, pos, fwd_done, bwd_done, in_flight, cap)
            if action is not None:
                ran.append(action)
        for action in ran:
            s, mb = action.stage_index, action.microbatch_index
            orders[s].append(action)
            if action.computation_type == F:
                fwd_done[(s, mb)] = t
                in_flight[s].add(mb)
                pos[mb] += 1
            else:
                bwd_done[(s, mb)] = t
                in_flight[s].discard(mb)
        if not ran and t > 4 * total:
            raise RuntimeError(f"skip schedule stalls at t={t} (mem_cap={cap})")
        t += 1
    return orders


def _pick(stage: int, t: int, paths, pos, fwd_done, bwd_done, in_flight, cap) -> _Action | None:
    for mb in sorted(in_flight[stage]):  # backward first, oldest micro-batch first
        path = paths[mb]
        i = path.index(stage)
        after = path[i + 1] if i + 1 < len(path) else None
        own = fwd_done.get((stage, mb))
        ready = own is not None and own < t and (after is None or bwd_done.get((after, mb), t) < t)
        if ready and (stage, mb) not in bwd_done:
            return _Action(stage, B, mb)
    if len(in_flight[stage]) >= cap:
        return None
    for mb, path in paths.items():  # lowest micro-batch whose path reaches this stage now
        if pos[mb] < len(path) and path[pos[mb]] == stage:
            before = path[pos[mb] - 1] if pos[mb] else None
            if before is None or fwd_done.get((before, mb), t) < t:
                return _Action(stage, F, mb)
    return None


class SkipPipeline:
    """This rank's SkipPipe stage; the interface of `engine.parallel.pipeline.Pipeline`
    (step, evaluate, modules, is_first, is_last, last_timing, last_actions, sync_tied_grads),
    plus `last_paths` (the micro-batch paths of the last step) and `actions` (its action lists)."""

    def __init__(self, *, chunk: nn.Module, stage: int, pp: int, group: dist.ProcessGroup, n_microbatches: int,
                 skip_ratio: float, loss_fn: Callable, hidden_shape: tuple[int, ...], device: torch.device,
                 embedding_group: dist.ProcessGroup | None, mem_cap: int | None = None) -> None:
        from engine.parallel.pipeline import Pipeline, _Clock

        self.modules = [chunk]
        self.name, self.stage, self.pp, self.group = "skip", stage, pp, group
        self.is_first, self.is_last = stage == 0, stage == pp - 1
        self.n_microbatches, self.skip_ratio, self.mem_cap = n_microbatches, skip_ratio, mem_cap
        self._loss_fn, self._shape, self._device = loss_fn, hidden_shape, torch.device(device)
        self._clock = _Clock(device)
        self._embedding_group = embedding_group
        self._tied_synced = True
        self._sync = Pipeline.sync_tied_grads
        self._tied = Pipeline._tied_weights
        self._steps = 0
        self.last_paths: dict[int, list[int]] = {}
        self.actions: dict[int, list[_Action]] = {}
        self._record: dict[str, Any] = {"wall_start": 0.0, "actions": [], "total_s": 0.0}
        self._timing = {"compute_s": 0.0, "bubble_s": 0.0, "total_s": 0.0, "backward_s": 0.0}

    def _tied_weights(self) -> list[nn.Parameter]:
        return self._tied(self)

    def sync_tied_grads(self) -> None:
        self._sync(self)

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor | None:
        """Forward + backward of the micro-batches along this step's paths; the mean loss on the last stage."""
        m = self.n_microbatches
        self.last_paths = skip_paths(pp=self.pp, n_microbatches=m, skip_ratio=self.skip_ratio, step=self._steps)
        self.actions = skip_actions(self.last_paths, pp=self.pp, mem_cap=self.mem_cap)
        self._steps += 1
        x_mbs = inputs.chunk(m) if inputs is not None else [None] * m
        y_mbs = targets.chunk(m) if targets is not None else [None] * m
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        losses, sends, rows = [], [], []
        compute = backward = 0.0
        wall, start = time.time(), time.perf_counter()
        for action in self.actions[self.stage]:
            mb, path = action.microbatch_index, self.last_paths[action.microbatch_index]
            i = path.index(self.stage)
            if action.computation_type == F:
                x = x_mbs[mb] if self.is_first else self._recv(path[i - 1], mb, 0)
                t0 = time.perf_counter()
                out = self.modules[0](x)
                if self.is_last:
                    out = self._loss_fn(out, y_mbs[mb]) / m
                    losses.append(out.detach())
                t1 = time.perf_counter()
                if not self.is_last:
                    sends.append(self._send(out.detach(), path[i + 1], mb, 0))
                saved[mb] = (None if self.is_first else x, out)
            else:
                grad = None if self.is_last else self._recv(path[i + 1], mb, 1)
                x, out = saved.pop(mb)
                t0 = time.perf_counter()
                torch.autograd.backward(out, grad)
                t1 = time.perf_counter()
                backward += t1 - t0
                if x is not None:
                    sends.append(self._send(x.grad, path[i - 1], mb, 1))
            compute += t1 - t0
            rows.append([str(action), t0 - start, t1 - start])
        for work in sends:
            work.wait()
        total = time.perf_counter() - start
        self._record = {"wall_start": wall, "actions": rows, "total_s": total}
        self._timing = {"compute_s": min(compute, total), "bubble_s": total - min(compute, total), "total_s": total,
                        "backward_s": min(backward, compute)}
        self._tied_synced = False
        self.sync_tied_grads()
        return torch.stack(losses).sum().detach() if losses else None

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor | None:
        """Forward-only over the full pipeline (no stage skipped); the mean loss on the last stage."""
        m, losses = self.n_microbatches, []
        x_mbs = inputs.chunk(m) if inputs is not None else [None] * m
        y_mbs = targets.chunk(m) if targets is not None else [None] * m
        for mb in range(m):
            x = x_mbs[mb] if self.is_first else self._recv(self.stage - 1, mb, 0)
            out = self.modules[0](x)
            if self.is_last:
                losses.append(self._loss_fn(out, y_mbs[mb]) / m)
            else:
                self._send(out, self.stage + 1, mb, 0).wait()
        return torch.stack(losses).sum() if losses else None

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage)

    def _recv(self, stage: int, mb: int, direction: int) -> torch.Tensor:
        buf = torch.empty(self._shape, device=self._device)
        dist.recv(buf, src=self._peer(stage), group=self.group, tag=2 * mb + direction)
        return buf.requires_grad_(direction == 0)

    def _send(self, tensor: torch.Tensor, stage: int, mb: int, direction: int) -> Any:
        return dist.isend(tensor.contiguous(), dst=self._peer(stage), group=self.group, tag=2 * mb + direction)

    @property
    def last_actions(self) -> dict[str, Any]:
        return self._record

    @property
    def last_timing(self) -> dict[str, float]:
        return self._timing


def build_skip_pipeline(model: GPT, pp_mesh: Any, *, skip_ratio: float, n_microbatches: int, micro: int,
                        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                        device: torch.device | str = "cpu", mem_cap: int | None = None) -> SkipPipeline:
    """This rank's SkipPipe stage over the pp axis (one stage per rank, even layer split).
    Must be called on every rank of the world (it creates the embedding groups)."""
    from engine.parallel.pipeline import _build_chunk, _embedding_group, stage_layers

    group = pp_mesh.get_group()
    pp, rank = dist.get_world_size(group), dist.get_rank(group)
    plan = stage_layers(model.cfg.layers, pp)
    chunk = _build_chunk(model, plan[rank], first=rank == 0, last=rank == pp - 1).to(device)
    return SkipPipeline(chunk=chunk, stage=rank, pp=pp, group=group, n_microbatches=n_microbatches,
                        skip_ratio=skip_ratio, loss_fn=loss_fn, device=torch.device(device),
                        hidden_shape=(micro, model.cfg.seq_len, model.cfg.d_model),
                        embedding_group=_embedding_group(group) if pp > 1 else None, mem_cap=mem_cap)
