"""Pipeline schedules as data: per-rank lists of torch's pipelining `_Action`s.

`schedule_actions(schedule=..., pp=..., n_microbatches=..., virtual=...)` gives, for every
schedule name in `engine.config.validate.SCHEDULES` except "skip", the compute-only action list of each
pp rank in execution order (`0F1`: stage 0 forward of micro-batch 1; `B` full backward, `I`
backward for inputs, `W` backward for weights, `OVERLAP_F_B` a DualPipeV forward+backward pair).
The engine loads these lists into torch's `_PipelineScheduleRuntime` (which adds the send/recv,
unshard/reshard and grad-reduce actions), the simulator (tuning/sim/schedule.py) prices them
action by action, and the dashboard draws what the engine executed. Pure: no processes.

The orders of gpipe, 1f1b, interleaved, looped_bfs and the zero-bubble schedules are torch's own
(their `_calculate_single_rank_operations`, called on a stand-in object holding the few fields
they read, so no stage or process group is needed). `modular` is ours after Lamy-Poirier 2021:
round-robin layer placement (layer i on rank i mod pp, so v = layers / pp chunks of one layer
each) run in the depth-first (interleaved 1F1B) order. "skip" (SkipPipe) routes micro-batches
over paths and has its own executor (engine/parallel/skippipe.py).
"""
from __future__ import annotations

from types import SimpleNamespace

from torch.distributed.pipelining.schedules import (
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from engine.torch_compat import (
    _Action,
    _add_send_recv,
    _ComputationType,
    add_bubbles_to_actions,
    generate_stage_to_rank_mapping,
    rank_operations,
)

from engine.config.validate import SCHEDULES, V_SCHEDULES

F, B = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
I, W = _ComputationType.BACKWARD_INPUT, _ComputationType.BACKWARD_WEIGHT
OVERLAP = _ComputationType.OVERLAP_F_B


def chunks_per_rank(schedule: str, virtual: int = 1, *, layers: int | None = None, pp: int = 1) -> int:
    """Model chunks (stages) each rank holds: layers/pp for modular, 2 for the V schedules,
    `virtual` for interleaved / looped_bfs / zero_bubble, else 1."""
    _check(schedule)
    if schedule == "modular":
        if layers is None or layers % pp:
            raise ValueError(f"modular needs model.layers divisible by pp; got layers={layers}, pp={pp}")
        return layers // pp
    if schedule in V_SCHEDULES:
        return 2
    if schedule in ("interleaved", "looped_bfs", "zero_bubble"):
        return max(1, virtual)
    return 1


def stage_to_rank(schedule: str, pp: int, num_stages: int) -> dict[int, int]:
    """Which pp rank runs each stage: V-shaped for zbv / dualpipev (rank r holds stages r and
    2pp-1-r), looped otherwise (stage s on rank s mod pp)."""
    style = "v" if schedule in V_SCHEDULES else "loop"
    return generate_stage_to_rank_mapping(pp, num_stages, style=style)


def schedule_actions(*, schedule: str, pp: int, n_microbatches: int, virtual: int = 1,
                     layers: int | None = None) -> dict[int, list[_Action]]:
    """The compute-only actions of every pp rank, in execution order (no None padding)."""
    _check(schedule)
    if schedule == "skip":
        raise ValueError("schedule 'skip' has per-step paths: use engine.parallel.skippipe.skip_actions")
    if pp < 1 or n_microbatches < 1:
        raise ValueError(f"need pp, n_microbatches >= 1; got {pp=}, {n_microbatches=}")
    v = chunks_per_rank(schedule, virtual, layers=layers, pp=pp)
    orders = {rank: _rank_order(schedule, rank, pp, n_microbatches, v) for rank in range(pp)}
    if schedule == "zero_bubble":
        # torch pads ZB1P with bubbles from the other ranks' orders; keep only the actions
        fake = _fake(pp, n_microbatches, v)
        fake.pipeline_order = orders
        orders = add_bubbles_to_actions(fake, pp * v)
    return {rank: [a for a in order if a is not None] for rank, order in orders.items()}


def _rank_order(schedule: str, rank: int, pp: int, m: int, v: int) -> list[_Action | None]:
    if schedule in ("gpipe", "1f1b"):
        return _single_stage_order(schedule, rank, pp, m)
    fake = _fake(pp, m, v)
    if schedule in ("interleaved", "modular"):
        return rank_operations(ScheduleInterleaved1F1B, fake, rank)
    if schedule == "looped_bfs":
        return rank_operations(ScheduleLoopedBFS, fake, rank)
    if schedule == "zero_bubble":
        return rank_operations(ScheduleInterleavedZeroBubble, fake, rank)
    if schedule == "zbv":
        return rank_operations(ScheduleZBVZeroBubble, fake, rank)
    return rank_operations(ScheduleDualPipeV, fake, rank)


def _fake(pp: int, m: int, v: int) -> SimpleNamespace:
    """The fields torch's `_calculate_single_rank_operations` read, without stages."""
    rounds = max(1, m // pp)
    return SimpleNamespace(pp_group_size=pp, n_local_stages=v, _n_microbatches=m, number_of_rounds=rounds,
                           microbatches_per_round=m // rounds, num_stages=pp * v, _num_stages=pp * v,
                           _stages=[None] * v, stage_index_to_group_rank=stage_to_rank("", pp, pp * v))


def _single_stage_order(schedule: str, stage: int, pp: int, m: int) -> list[_Action]:
    """GPipe: all forwards then all backwards; 1F1B: pp-1-stage warm-up forwards, then F/B pairs
    (torch's ScheduleGPipe / Schedule1F1B orders)."""
    fwd = [_Action(stage, F, i) for i in range(m)]
    bwd = [_Action(stage, B, i) for i in range(m)]
    if schedule == "gpipe":
        return fwd + bwd
    warmup = min(pp - 1 - stage, m)
    order = fwd[:warmup]
    for i in range(m - warmup):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[m - warmup:]


def compute_actions(action: _Action) -> list[_Action]:
    """The single compute actions inside `action` (an OVERLAP_F_B holds a forward and a backward)."""
    return list(action.sub_actions) if action.sub_actions else [action]


def with_comms(actions: dict[int, list[_Action]], stage_rank: dict[int, int]) -> dict[int, list[_Action]]:
    """`actions` with the SEND / RECV actions torch's runtime inserts (`_add_send_recv`, the lowering
    `_prepare_schedule_with_comms` runs): a send right after the action computing it (after both
    halves of an OVERLAP_F_B), a receive where the sender's progress puts it in the receiver's list."""
    lists = {rank: list(order) for rank, order in actions.items() if order}
    lowered = _add_send_recv(lists, stage_to_rank=lambda s: stage_rank[s], num_stages=len(stage_rank))
    return {rank: lowered.get(rank, []) for rank in actions}


def _check(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.schedule={schedule!r} must be one of {', '.join(SCHEDULES)}")
