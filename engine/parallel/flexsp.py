"""FlexSP's per-step plan (Wang et al. 2025, "Data-Centric and Heterogeneity-Adaptive Sequence
Parallelism for Efficient LLM Training"; code: PKU-DAIR/Hetu-Galvatron, branch flexsp): pure logic.

Each step, the batch's sequences are bucketed by length and a MILP assigns them to
sequence-parallel groups whose sizes are powers of two and together use all N devices:

    minimise M
    s.t.  sum_p A[k,p] = n_k                              every sequence of bucket k placed
          A[k,p] = 0 where size_p < min_size_k           a sequence fits its group's memory
          sum_k L_k A[k,p] <= cap * size_p * m[p]        tokens per device under the cap
          sum_k T(L_k, size_p) A[k,p] + b m[p] <= M      the slowest group's time
          m[p] <= sum_k A[k,p] <= n m[p]                 a used slot holds a sequence
          sum_p size_p m[p] = N                          all devices used

with slots p = N/g candidate groups of each size g, A integer, m binary, L_k the bucket's longest
length and T(s, g) = (a1 s^2 + a2 s)/g + c_g s/g (attention and MLP split over g, plus the
Ulysses all-to-all). Solved with scipy.optimize.milp (HiGHS) under a time limit.

As in their code (`get_sp_options_prune`), the slots are pruned: when the longest sequences need
groups of sp_max ranks, cnt_max of them, smaller sizes get only the slots left by cnt_max such groups.

Ours: the paper's solver (SCIP) takes a balanced initial solution; scipy's milp takes no start
point, so the balanced plan bounds M from above and is the answer when HiGHS finds nothing within
the limit; a memory-aware greedy (LPT) plan is the fallback when neither is feasible. Slots of one size are
ordered (m[p] >= m[p+1]) to cut symmetric branches, and group size 1 is allowed (their code skips it).
More of ours: a per-size constant `group_bias[g]` (Ulysses runs a fixed number of all-to-alls
per layer whatever the tokens; their a2a term is per token only), a per-sequence constant `per_seq`
that is not split over the group (packed documents run attention one document at a time here, on
every rank of the group, where their GPUs run one varlen kernel) with a per-token cost of packing
`pack_a2` (a 512-token packed row cost 12 us/token against 9 us for a lone sequence), and the valid cut
sum_p g_p T_p <= N M (the device-seconds of the plan fit N devices for M seconds) that gives the LP
relaxation the work bound, so HiGHS proves (near-)optimality in far fewer nodes; HiGHS stops at
a relative gap `gap` (default 5%: below the error of bucket boundaries, and it ends most
searches that a 1% gap sends to the time limit). And before any MILP, the best of the balanced and
greedy plans is compared with a lower bound of every plan (`lower_bound`); within the gap of it,
HiGHS is not started at all (scipy's milp takes no incumbent, so HiGHS cannot prune with it).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds of one sequence of s tokens in a group of g ranks: (a1 s^2 + (a2 + pack_a2) s)/g + a2a[g] s/g
    + per_seq; a used group adds bias + group_bias[g]."""

    a1: float  # attention: seconds per token^2
    a2: float  # everything linear in tokens: seconds per token
    a2a: dict[int, float] = field(default_factory=dict)  # group size -> all-to-all seconds per token (size 1: 0)
    bias: float = 0.0  # per-group constant per step (the paper's beta1)
    group_bias: dict[int, float] = field(default_factory=dict)  # group size -> extra constant (ours: collective latency)
    per_seq: float = 0.0  # ours: seconds per packed sequence that every rank of its group pays (not split over g)
    pack_a2: float = 0.0  # ours: seconds per token of a packed row beyond a lone sequence's a2 (document masks)
    sizes: tuple[int, ...] = ()
    """The group sizes this model prices (calibrated ones); a plan uses no other, and pricing another
    raises instead of counting its all-to-all as free. Empty: every size, as given (hand-made models)."""

    def group_sizes(self, n: int) -> list[int]:
        """The powers of two up to n that this model prices."""
        return [g for g in powers_of_two(n) if not self.sizes or g in self.sizes]

    def _check(self, g: int) -> None:
        if self.sizes and g not in self.sizes:
            raise ValueError(f"adaptive SP group size {g} was not calibrated (calibrated: "
                             f"{', '.join(map(str, self.sizes))}); it is refused, not priced as free communication")

    def seq_time(self, s: float, g: int) -> float:
        self._check(g)
        return (self.a1 * s * s + (self.a2 + self.pack_a2 + self.a2a.get(g, 0.0)) * s) / g + self.per_seq

    def fixed(self, g: int) -> float:
        """A used group's constant seconds per step."""
        self._check(g)
        return self.bias + self.group_bias.get(g, 0.0)

    def group_time(self, lengths: list[int], g: int) -> float:
        return sum(self.seq_time(s, g) for s in lengths) + self.fixed(g) if lengths else 0.0


# who made a step's plan; records store the index (engine/train/trainer.py), the Run page shows the name
SOLVERS = ("milp", "balanced", "greedy")


@dataclass(slots=True)
class Plan:
    """Groups of the step: their sizes and the indices of their sequences (plans are data)."""

    sizes: list[int]
    members: list[list[int]]  # sequence indices per group
    predicted_s: float  # the slowest group's modelled time
    solver: str  # one of SOLVERS
    solve_s: float = 0.0
    status: str = ""
    milp_size: tuple[int, int] = (0, 0)  # (variables, constraints) of the step's MILP
    milp_s: float = 0.0  # seconds inside HiGHS
    exposed_s: float = 0.0  # seconds the step waited for this plan (solved ahead: what the overlap left)
    cpu_s: float = 0.0  # CPU seconds of the solve (its thread's)

    def describe(self, lengths: list[int]) -> list[dict]:
        return [{"size": g, "sequences": len(m), "tokens": int(sum(lengths[i] for i in m))}
                for g, m in zip(self.sizes, self.members)]


def powers_of_two(n: int) -> list[int]:
    return [1 << i for i in range(int(math.log2(n)) + 1)] if n >= 1 else []


def min_group_size(length: int, cap: int, n: int, sizes: list[int] | None = None) -> int:
    """The smallest power-of-two group (of `sizes`, default all up to n) whose per-rank share of
    `length` tokens fits `cap`."""
    sizes = powers_of_two(n) if sizes is None else sizes
    for g in sizes:
        if length <= cap * g:
            return g
    if max(sizes, default=0) == n:
        raise ValueError(f"a sequence of {length} tokens exceeds the memory of all {n} ranks ({cap} tokens each)")
    raise ValueError(f"a sequence of {length} tokens exceeds the memory of the largest usable (calibrated) group "
                     f"({max(sizes, default=0)} of {n} ranks, {cap} tokens each)")


def _bucket_table(srt: np.ndarray, max_buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """Dynamic program over sorted lengths: best[k, j] = least padding of the first j lengths in
    k buckets (a bucket's padding: sum of boundary - length), cut[k, j] = where the last one starts."""
    n = len(srt)
    prefix = np.concatenate([[0.0], np.cumsum(srt)])
    i, j = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")  # bucket = sorted[i:j]
    pad = np.where(i < j, (j - i) * srt[np.maximum(j - 1, 0)] - (prefix[j] - prefix[i]), np.inf)
    best = np.full((max_buckets + 1, n + 1), np.inf)
    cut = np.zeros((max_buckets + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for k in range(1, max_buckets + 1):
        total = best[k - 1][:, None] + pad
        cut[k] = np.argmin(total, axis=0)
        best[k] = total[cut[k], np.arange(n + 1)]
    return best, cut


def _read_buckets(order: list[int], lengths: list[int], cut: np.ndarray, k: int) -> list[tuple[int, list[int]]]:
    parts, j = [], len(order)
    for kk in range(k, 0, -1):
        i = int(cut[kk, j])
        parts.append(order[i:j])
        j = i
    return [(lengths[p[-1]], [int(x) for x in p]) for p in reversed(parts) if p]


def bucketize(lengths: list[int], buckets: int) -> list[tuple[int, list[int]]]:
    """(boundary, sequence indices) per bucket: contiguous runs of the sorted lengths chosen by
    dynamic programming to minimise the padding; the boundary is the bucket's longest sequence,
    so costs and memory are upper bounds."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    k = max(1, min(buckets, len(lengths)))
    _, cut = _bucket_table(np.array([lengths[i] for i in order], dtype=float), k)
    return _read_buckets(order, lengths, cut, k)


def buckets_for(lengths: list[int], *, buckets: int, n: int, cap: int) -> list[tuple[int, list[int]]]:
    """FlexSP's rule: more buckets until the bucketed tokens are at most halfway between the real
    tokens and the cluster's capacity (n * cap), so bucketing alone never makes the step infeasible."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    limit = (sum(lengths) + n * cap) / 2
    best, cut = _bucket_table(np.array([lengths[i] for i in order], dtype=float), len(lengths))
    real = float(sum(lengths))
    k = max(1, min(buckets, len(lengths)))
    while k < len(lengths) and real + best[k, len(lengths)] > limit:
        k += 1
    return _read_buckets(order, lengths, cut, k)


def evaluate(plan_sizes: list[int], members: list[list[int]], lengths: list[int], cost: CostModel) -> float:
    """The slowest group's modelled time."""
    return max(cost.group_time([lengths[i] for i in m], g) for g, m in zip(plan_sizes, members))


def _fits(sizes: list[int], members: list[list[int]], lengths: list[int], cap: int) -> bool:
    return all(sum(lengths[i] for i in m) <= cap * g and (not m or max(lengths[i] for i in m) <= cap * g)
               for g, m in zip(sizes, members))


def balanced_plan(lengths: list[int], *, n: int, cap: int, cost: CostModel, buckets: int,
                  bks: list[tuple[int, list[int]]] | None = None) -> Plan | None:
    """FlexSP's balanced start: for each uniform group size, each bucket's sequences spread evenly
    (round robin) over the n/g groups; the best feasible one, or None. `bks`: the buckets, when known."""
    best: Plan | None = None
    bks = bks if bks is not None else buckets_for(lengths, buckets=buckets, n=n, cap=cap)
    for g in cost.group_sizes(n):
        members: list[list[int]] = [[] for _ in range(n // g)]
        turn = 0
        for _, idx in bks:
            for i in idx:
                members[turn % len(members)].append(i)
                turn += 1
        if not _fits([g] * len(members), members, lengths, cap):
            continue
        t = evaluate([g] * len(members), members, lengths, cost)
        if best is None or t < best.predicted_s:
            best = Plan([g] * len(members), members, t, "balanced")
    return best


def uniform_plan(lengths: list[int], *, n: int, g: int, cap: int, cost: CostModel) -> Plan | None:
    """n/g groups of g ranks (a static sequence-parallel degree g), sequences longest first to the
    least-loaded group with room (LPT); None when memory does not allow it."""
    members: list[list[int]] = [[] for _ in range(n // g)]
    load, tokens = [0.0] * len(members), [0] * len(members)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        room = [j for j in range(len(members)) if tokens[j] + lengths[i] <= cap * g]
        if not room:
            return None
        j = min(room, key=lambda j: load[j])
        members[j].append(i)
        load[j] += cost.seq_time(lengths[i], g)
        tokens[j] += lengths[i]
    return Plan([g] * len(members), members, evaluate([g] * len(members), members, lengths, cost), "greedy")


def greedy_plan(lengths: list[int], *, n: int, cap: int, cost: CostModel) -> Plan:
    """Fallback: the uniform plan of the smallest group size that fits memory; raises when not
    even one group of all n ranks holds the batch."""
    for g in cost.group_sizes(n):
        plan = uniform_plan(lengths, n=n, g=g, cap=cap, cost=cost)
        if plan is not None:
            return plan
    raise ValueError(f"the step's {sum(lengths)} tokens exceed the memory of all {n} ranks ({cap} tokens each)")


def slot_sizes(min_sizes: list[int], n: int, sizes: list[int] | None = None) -> list[int]:
    """The candidate groups (FlexSP's `get_sp_options_prune`): n/g slots of each size g, except that
    sizes below sp_max (the largest size a sequence needs) share only the ranks left by cnt_max
    groups of sp_max (cnt_max: how many sequences need sp_max)."""
    sp_max = max(min_sizes, default=1)
    cnt_max = min_sizes.count(sp_max)
    left = max(0, n - sp_max * cnt_max)
    return [g for g in (powers_of_two(n) if sizes is None else sizes) for _ in range((left if g < sp_max else n) // g)]


@dataclass(slots=True)
class Milp:
    """The step's MILP in scipy's form: minimise c @ x over integer x (but M) in [0, ub], lo <= A x <= hi."""

    c: np.ndarray
    A: object  # scipy.sparse csr
    lo: np.ndarray
    hi: np.ndarray
    ub: np.ndarray
    integrality: np.ndarray
    slots: list[int]
    buckets: list[tuple[int, list[int]]]

    @property
    def size(self) -> tuple[int, int]:
        return len(self.c), self.A.shape[0]


def build_milp(bks: list[tuple[int, list[int]]], *, n: int, cap: int, cost: CostModel,
               upper: float | None) -> Milp:
    """The constraints of the module docstring over buckets `bks`, plus the work cut (ours)."""
    from scipy.sparse import coo_matrix

    usable = cost.group_sizes(n)
    slots = slot_sizes([min_group_size(b, cap, n, usable) for b, _ in bks], n, usable)
    K, P = len(bks), len(slots)
    nv, mi, Mi = K * P + P + 1, K * P, K * P + P  # A[k,p] (k-major), m[p], M
    total = sum(len(idx) for _, idx in bks)
    ri, ci, val, lo, hi = [], [], [], [], []

    def row(lb: float, ub: float, entries: list[tuple[int, float]]) -> None:
        for col, v in entries:
            ri.append(len(lo)), ci.append(col), val.append(v)
        lo.append(lb), hi.append(ub)

    for k, (_, idx) in enumerate(bks):  # every sequence placed
        row(len(idx), len(idx), [(k * P + p, 1.0) for p in range(P)])
    work = []
    for p, g in enumerate(slots):
        a = [k * P + p for k in range(K)]
        row(-np.inf, 0, [*((a[k], float(b)) for k, (b, _) in enumerate(bks)), (mi + p, -cap * g)])  # memory
        times = [cost.seq_time(b, g) for b, _ in bks]
        row(-np.inf, 0, [*zip(a, times), (mi + p, cost.fixed(g)), (Mi, -1.0)])  # slowest group
        row(0, np.inf, [*((c, 1.0) for c in a), (mi + p, -1.0)])  # a used slot holds a sequence
        row(-np.inf, 0, [*((c, 1.0) for c in a), (mi + p, -float(total))])  # ... and only a used one
        work += [*((c, g * t) for c, t in zip(a, times)), (mi + p, g * cost.fixed(g))]
    row(n, n, [(mi + p, float(g)) for p, g in enumerate(slots)])  # all devices used
    row(-np.inf, 0, [*work, (Mi, -float(n))])  # ours: device-seconds fit N devices for M seconds
    for p in range(P - 1):
        if slots[p] == slots[p + 1]:  # ours: identical slots used in order (symmetry breaking)
            row(0, np.inf, [(mi + p, 1.0), (mi + p + 1, -1.0)])
    ub = np.full(nv, np.inf)
    for k, (bound, idx) in enumerate(bks):
        for p, g in enumerate(slots):
            ub[k * P + p] = 0 if bound > cap * g else len(idx)
    ub[mi:Mi] = 1
    ub[Mi] = upper if upper is not None else np.inf
    c = np.zeros(nv)
    c[Mi] = 1
    integrality = np.ones(nv)
    integrality[Mi] = 0
    A = coo_matrix((val, (ri, ci)), shape=(len(lo), nv)).tocsr()
    return Milp(c, A, np.array(lo), np.array(hi), ub, integrality, slots, bks)


def _read_plan(model: Milp, x: np.ndarray, lengths: list[int]) -> tuple[list[int], list[list[int]]]:
    """Sizes and member sequences of the used slots (each bucket's sequences dealt longest first)."""
    K, P = len(model.buckets), len(model.slots)
    x = np.rint(x).astype(int)
    used = [p for p in range(P) if x[K * P + p] == 1]
    members: list[list[int]] = [[] for _ in used]
    for k, (_, idx) in enumerate(model.buckets):
        queue = sorted(idx, key=lambda i: -lengths[i])
        for j, p in enumerate(used):
            take, queue = queue[:x[k * P + p]], queue[x[k * P + p]:]
            members[j].extend(take)
    return [model.slots[p] for p in used], members


def _milp(lengths: list[int], *, n: int, cap: int, cost: CostModel, bks: list[tuple[int, list[int]]],
          time_limit_s: float, gap: float, upper: float | None):
    """Build and solve the MILP; returns (sizes, members, status, model size, seconds in HiGHS),
    sizes and members None when HiGHS found nothing."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    model = build_milp(bks, n=n, cap=cap, cost=cost, upper=upper)
    t0 = time.perf_counter()
    res = milp(model.c, integrality=model.integrality, bounds=Bounds(np.zeros(len(model.c)), model.ub),
               constraints=LinearConstraint(model.A, model.lo, model.hi),
               options={"time_limit": time_limit_s, "disp": False, "mip_rel_gap": gap})
    took = time.perf_counter() - t0
    if res.x is None:
        return None, None, res.message, model.size, took
    sizes, members = _read_plan(model, res.x, lengths)
    return sizes, members, "optimal" if res.status == 0 else res.message, model.size, took


def lower_bound(lengths: list[int], *, n: int, cap: int, cost: CostModel) -> float:
    """No plan's slowest group is faster than this: the longest sequence alone in its best feasible
    group, or the least device-seconds of all sequences (each in its cheapest feasible group size,
    plus every rank's share of a group constant) spread over the n devices."""
    sizes = cost.group_sizes(n)
    feasible = [[g for g in sizes if s <= cap * g] for s in lengths]
    longest = max(min(cost.seq_time(s, g) + cost.fixed(g) for g in gs) for s, gs in zip(lengths, feasible))
    work = sum(min(g * cost.seq_time(s, g) for g in gs) for s, gs in zip(lengths, feasible)) / n
    return max(longest, work + min(cost.fixed(g) for g in sizes))


def solve(lengths: list[int], *, n: int, cap: int, cost: CostModel, buckets: int = 8,
          time_limit_s: float = 0.5, gap: float = 0.05) -> Plan:
    """The step's plan: the fastest (on the real lengths) of the MILP's answer, the balanced start
    and the greedy plan; the latter two stand in when HiGHS finds nothing within the time limit,
    and the MILP is skipped when one of them is within `gap` of `lower_bound`."""
    t0, c0 = time.perf_counter(), time.thread_time()
    for s in lengths:
        min_group_size(s, cap, n, cost.group_sizes(n))  # raises with the reason when a sequence fits nowhere
    bks = buckets_for(lengths, buckets=buckets, n=n, cap=cap)
    start = balanced_plan(lengths, n=n, cap=cap, cost=cost, buckets=buckets, bks=bks)
    candidates = [start]
    try:
        candidates.append(greedy_plan(lengths, n=n, cap=cap, cost=cost))
    except ValueError:
        pass
    best = min((c for c in candidates if c is not None), key=lambda c: c.predicted_s, default=None)
    if best is not None and best.predicted_s <= lower_bound(lengths, n=n, cap=cap, cost=cost) * (1 + gap):
        best.status, best.solve_s, best.cpu_s = "within gap of the lower bound", *_since(t0, c0)
        return best
    upper = None
    if start is not None:  # the start's time with bucket boundaries: the MILP's own measure of it
        bounded = [0] * len(lengths)
        for bound, idx in bks:
            for i in idx:
                bounded[i] = bound
        upper = evaluate(start.sizes, start.members, bounded, cost) * (1 + 1e-6)
    sizes, members, status, size, milp_s = _milp(lengths, n=n, cap=cap, cost=cost, bks=bks,
                                                 time_limit_s=time_limit_s, gap=gap, upper=upper)
    if sizes is not None and _fits(sizes, members, lengths, cap):
        candidates.append(Plan(sizes, members, evaluate(sizes, members, lengths, cost), "milp"))
    # the MILP optimises bucket upper bounds: on the real lengths another candidate can be faster
    plan = min((c for c in candidates if c is not None), key=lambda c: c.predicted_s, default=None)
    if plan is None:
        raise ValueError(f"no plan fits {sum(lengths)} tokens into {n} ranks of {cap} tokens each")
    plan.status, plan.milp_size, plan.milp_s = str(status), size, milp_s
    plan.solve_s, plan.cpu_s = _since(t0, c0)
    return plan


def _since(t0: float, c0: float) -> tuple[float, float]:
    return time.perf_counter() - t0, time.thread_time() - c0
