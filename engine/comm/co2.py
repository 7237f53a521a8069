"""CO2: local steps with an asynchronous, fully overlapped outer all-reduce (Sun et al., ICLR 2024).

Each rank runs `tau` steps of its inner optimizer from the shared start point x_r. At the end
of round r it launches the all-reduce of its delta d_r = x_r - x_local (the pseudo-gradient)
and applies the outer step with the average of the PREVIOUS round's deltas, D_{r-1}, whose
all-reduce ran during this round's local steps (one-step staleness). The outer step is the
authors' (weigao266/fairscale-CO2, `CO2DistributedDataParallel._perform_local_optimization`):

    m <- beta m + D_{r-1} / lambda           (lambda: `gap_penalty`, a constant, default 1.0)
    m <- clamp(m, -phi, phi)                  (element-wise; phi: `clip`, 0 turns it off)
    x_{r+1} = x_r - outer_lr * m,  every rank restarts from x_{r+1}

(Their `_co2_clip` computes torch.clamp and drops the result, so their clip never acts; ours
does. Their library turns the clip on with a separate `co2_clip` flag, off by default.) Their
defaults: outer_momentum 0.5, outer_lr 1.0, outer frequency tau 48 (20-48 in the paper), gap
penalty 1.0, clip threshold 1.0. `nesterov` (update D/lambda + beta m) is ours.

`penalty="relative_gap"` is OUR variant, not the paper's: D_{r-1} was measured at x_{r-1} but
is applied at x_r, so each parameter tensor's slice of it is scaled by
1 / (1 + ||x_r - x_{r-1}|| / ||x_{r-1}||), the relative gap between the current and the stale
start point, instead of by 1 / lambda; the element-wise clip applies to both. With tau=1, no
async, outer_lr=1, outer_momentum=0, lambda=1 and no clip this is synchronous data parallel
SGD exactly.

With tensor parallelism CO2 works on each rank's local shards (DTensor.to_local()) and
all-reduces over the dp group only: the ranks of one dp group hold the same shard. (The
relative_gap variant then measures its gap per local shard.)
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from engine.comm.link import LinkEmulator, bus_factor
from engine.config.validate import CO2_PENALTIES as PENALTIES

OnBytes = Callable[[int, int], None]
_EPS = 1e-12


class CO2:
    """Outer loop of CO2 around a plain (not DDP-wrapped) model and its inner optimizer."""

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        process_group: dist.ProcessGroup | None = None,
        tau: int = 8,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.5,
        nesterov: bool = False,
        clip: float = 1.0,
        penalty: str = "constant",
        gap_penalty: float = 1.0,
        async_op: bool = True,
        link: LinkEmulator | None = None,
        on_bytes: OnBytes | None = None,
    ) -> None:
        """Broadcast dp rank 0's parameters so every rank starts from the same point.

        `process_group` is the dp group. clip <= 0 turns clipping off. `penalty` is "constant"
        (the paper's 1/gap_penalty) or "relative_gap" (ours, see the module docstring). `link`
        makes each outer all-reduce last at least as long as it would on that link (the wait
        overlaps with the next round's local steps).
        """
        if penalty not in PENALTIES:
            raise ValueError(f"co2.penalty={penalty!r} must be one of {', '.join(PENALTIES)}")
        if gap_penalty <= 0:
            raise ValueError(f"co2.gap_penalty={gap_penalty} must be > 0; e.g. 1.0")
        self.inner_optimizer = inner_optimizer
        # tensor-parallel parameters: the local shard, shared with the DTensor (in-place updates reach it)
        with torch.no_grad():
            self.params = [_local(p) for p in model.parameters() if p.requires_grad]
        self.process_group = process_group
        self.group_size = dist.get_world_size(process_group)
        self.async_op, self.penalty, self.gap_penalty, self.nesterov = async_op, penalty, gap_penalty, nesterov
        self.link, self.on_bytes = link, on_bytes
        self.tau, self.outer_lr, self.outer_momentum, self.clip = 1, 1.0, 0.0, 1.0
        self.set_knobs(tau=tau, outer_lr=outer_lr, outer_momentum=outer_momentum, clip=clip)
        src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        with torch.no_grad():
            for p in self.params:
                dist.broadcast(p, src=src, group=process_group)
            self.anchor = parameters_to_vector(self.params).detach().clone()
        self.momentum = torch.zeros_like(self.anchor)
        self.slices = _slices(self.params)
        self.pending: tuple[dist.Work, torch.Tensor, torch.Tensor, float] | None = None
        self.local_steps = 0
        self.rounds = 0
        self.wire_bytes = 0
        self.dense_bytes = 0
        self.last_penalty: list[float] = []

    def set_knobs(
        self,
        *,
        tau: int | None = None,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        clip: float | None = None,
    ) -> None:
        """Change knobs between steps; a new tau counts from the current round's start."""
        if tau is not None:
            if tau < 1:
                raise ValueError(f"co2.tau={tau} must be >= 1; e.g. 8")
            self.tau = tau
        if outer_lr is not None:
            if outer_lr <= 0:
                raise ValueError(f"co2.outer_lr={outer_lr} must be > 0; e.g. 0.7")
            self.outer_lr = outer_lr
        if outer_momentum is not None:
            if not 0.0 <= outer_momentum < 1.0:
                raise ValueError(f"co2.outer_momentum={outer_momentum} must be in [0, 1); e.g. 0.5")
            self.outer_momentum = outer_momentum
        if clip is not None:
            self.clip = clip

    def step(self, step: int) -> bool:
        """inner_optimizer.step() then after_inner_step(step)."""
        self.inner_optimizer.step()
        return self.after_inner_step(step)

    @torch.no_grad()
    def after_inner_step(self, step: int) -> bool:
        """Count a local step; at the end of a round run the outer step. True if it did."""
        self.local_steps += 1
        dense = self._ring_bytes(self.anchor)
        self.dense_bytes += dense  # what synchronous DP would have sent for this step
        if self.local_steps < self.tau:
            self._report(0, dense)
            return False
        self.local_steps = 0
        delta = self.anchor - parameters_to_vector(self.params)
        launched = self._launch(delta)
        self._report(self._ring_bytes(delta), dense)
        if self.async_op:
            stale, self.pending = self.pending, launched
        else:
            stale = launched
        if stale is not None:
            self._outer_update(self._finish(stale))
        self.rounds += 1
        self._load_anchor()
        return True

    @torch.no_grad()
    def flush(self) -> None:
        """Wait for the in-flight all-reduce and apply it (call once after the last step)."""
        if self.pending is not None:
            stale, self.pending = self.pending, None
            self._outer_update(self._finish(stale))
            self._load_anchor()

    def _load_anchor(self) -> None:
        # copy, not torch's vector_to_parameters, which would make the params views of the anchor
        for p, sl in zip(self.params, self.slices):
            p.copy_(self.anchor[sl].view_as(p))

    def _launch(self, delta: torch.Tensor) -> tuple[dist.Work, torch.Tensor, torch.Tensor, float]:
        work = dist.all_reduce(delta, group=self.process_group, async_op=True)
        return work, delta, self.anchor.clone(), time.perf_counter()

    def _finish(
        self, launched: tuple[dist.Work, torch.Tensor, torch.Tensor, float]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        work, delta, stale_anchor, started = launched
        if self.link is None:
            work.wait()
        else:
            nbytes = delta.numel() * delta.element_size()
            self.link.emulated(
                work, op="all_reduce", nbytes=nbytes, group_size=self.group_size, started_at=started
            )
        return delta.div_(self.group_size), stale_anchor

    def _outer_update(self, reduced: tuple[torch.Tensor, torch.Tensor]) -> None:
        avg_delta, stale_anchor = reduced
        self.last_penalty = []
        for sl in self.slices:
            if self.penalty == "relative_gap":
                gap = float((self.anchor[sl] - stale_anchor[sl]).norm())
                factor = 1.0 / (1.0 + gap / (float(stale_anchor[sl].norm()) + _EPS))
            else:
                factor = 1.0 / self.gap_penalty
            avg_delta[sl].mul_(factor)
            self.last_penalty.append(factor)
        self.momentum.mul_(self.outer_momentum).add_(avg_delta)
        if self.clip > 0:
            self.momentum.clamp_(-self.clip, self.clip)  # element-wise, as the paper's co2_clip_threshold
        update = avg_delta.add(self.momentum, alpha=self.outer_momentum) if self.nesterov else self.momentum
        self.anchor.add_(update, alpha=-self.outer_lr)

    # ------------------------------------------------------------------ checkpoint
    @torch.no_grad()
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Anchor, outer momentum, round position and the in-flight round (waited for, not applied).

        Waiting changes no number: the same average is applied at the same round end after a
        resume. The parameters and the inner optimizer are the trainer's to save.
        """
        pending = torch.zeros_like(self.anchor), torch.zeros_like(self.anchor)
        if self.pending is not None:
            work, delta, stale_anchor, _ = self.pending
            work.wait()  # the reduced SUM; _finish divides it by the group size when applied
            pending = delta, stale_anchor
        return {"anchor": self.anchor, "momentum": self.momentum, "pending_delta": pending[0],
                "pending_anchor": pending[1], "has_pending": torch.tensor(int(self.pending is not None)),
                "local_steps": torch.tensor(self.local_steps), "rounds": torch.tensor(self.rounds)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what `state_dict()` returned (same dp and tp layout)."""
        self.anchor.copy_(state["anchor"])
        self.momentum.copy_(state["momentum"])
        self.local_steps, self.rounds = int(state["local_steps"]), int(state["rounds"])
        self.pending = None
        if int(state["has_pending"]):
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(None)
            self.pending = (done, state["pending_delta"].clone(), state["pending_anchor"].clone(),
                            time.perf_counter())

    @torch.no_grad()
    def reset_anchor(self) -> None:
        """Start a fresh round from the current (e.g. just loaded) parameters."""
        self.anchor.copy_(parameters_to_vector(self.params))
        self.momentum.zero_()
        self.pending, self.local_steps = None, 0

    def _ring_bytes(self, flat: torch.Tensor) -> int:
        return int(flat.numel() * flat.element_size() * bus_factor("all_reduce", self.group_size))

    def _report(self, wire: int, dense: int) -> None:
        self.wire_bytes += wire
        if self.on_bytes is not None:
            self.on_bytes(wire, dense)


def _local(p: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (sharing its storage); a plain tensor as is."""
    from engine.parallel.data import is_dtensor

    return p.to_local() if is_dtensor(p) else p


def _slices(params: list[torch.Tensor]) -> list[slice]:
    out, start = [], 0
    for p in params:
        out.append(slice(start, start + p.numel()))
        start += p.numel()
    return out
