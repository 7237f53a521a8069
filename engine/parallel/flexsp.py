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

Ours: the paper's solver (SCIP) takes a balanced initial solution; scipy's milp takes no start
point, so the balanced plan bounds M from above and is the answer when HiGHS finds nothing within
the limit; a memory-aware greedy (LPT) plan is the fallback when neither is feasible. Slots of one size are
ordered (m[p] >= m[p+1]) to cut symmetric branches, and group size 1 is allowed (their code skips it).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds of one sequence of s tokens in a group of g ranks: (a1 s^2 + a2 s)/g + a2a[g] s/g + bias."""

    a1: float  # attention: seconds per token^2
    a2: float  # everything linear in tokens: seconds per token
    a2a: dict[int, float] = field(default_factory=dict)  # group size -> all-to-all seconds per token (size 1: 0)
    bias: float = 0.0  # per-group constant per step (the paper's beta1)

    def seq_time(self, s: float, g: int) -> float:
        return (self.a1 * s * s + self.a2 * s + self.a2a.get(g, 0.0) * s) / g

    def group_time(self, lengths: list[int], g: int) -> float:
        return sum(self.seq_time(s, g) for s in lengths) + self.bias if lengths else 0.0


@dataclass(slots=True)
class Plan:
    """Groups of the step: their sizes and the indices of their sequences (plans are data)."""

    sizes: list[int]
    members: list[list[int]]  # sequence indices per group
    predicted_s: float  # the slowest group's modelled time
    solver: str  # milp | balanced | greedy
    solve_s: float = 0.0
    status: str = ""

    def describe(self, lengths: list[int]) -> list[dict]:
        return [{"size": g, "sequences": len(m), "tokens": int(sum(lengths[i] for i in m))}
                for g, m in zip(self.sizes, self.members)]


def powers_of_two(n: int) -> list[int]:
    return [1 << i for i in range(int(math.log2(n)) + 1)] if n >= 1 else []


def min_group_size(length: int, cap: int, n: int) -> int:
    """The smallest power-of-two group whose per-rank share of `length` tokens fits `cap`."""
    for g in powers_of_two(n):
        if length <= cap * g:
            return g
    raise ValueError(f"a sequence of {length} tokens exceeds the memory of all {n} ranks ({cap} tokens each)")


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


def balanced_plan(lengths: list[int], *, n: int, cap: int, cost: CostModel, buckets: int) -> Plan | None:
    """FlexSP's balanced start: for each uniform group size, each bucket's sequences spread evenly
    (round robin) over the n/g groups; the best feasible one, or None."""
    best: Plan | None = None
    for g in powers_of_two(n):
        members: list[list[int]] = [[] for _ in range(n // g)]
        turn = 0
        for _, idx in buckets_for(lengths, buckets=buckets, n=n, cap=cap):
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
    for g in powers_of_two(n):
        plan = uniform_plan(lengths, n=n, g=g, cap=cap, cost=cost)
        if plan is not None:
            return plan
    raise ValueError(f"the step's {sum(lengths)} tokens exceed the memory of all {n} ranks ({cap} tokens each)")


def _milp(lengths: list[int], *, n: int, cap: int, cost: CostModel, buckets: int, time_limit_s: float,
          upper: float | None):
    """Build and solve the MILP; returns (sizes, members, status) or (None, None, status)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    bks = buckets_for(lengths, buckets=buckets, n=n, cap=cap)
    slots = [g for g in powers_of_two(n) for _ in range(n // g)]
    K, P = len(bks), len(slots)
    nv = K * P + P + 1  # A[k,p] (k-major), m[p], M
    a = lambda k, p: k * P + p  # noqa: E731
    mi, Mi = K * P, K * P + P
    total = len(lengths)
    rows, lo, hi = lil_matrix((K + 4 * P + 1 + P, nv)), [], []
    r = 0

    def row(lb: float, ub: float) -> int:
        nonlocal r
        lo.append(lb)
        hi.append(ub)
        r += 1
        return r - 1

    for k, (_, idx) in enumerate(bks):
        i = row(len(idx), len(idx))
        for p in range(P):
            rows[i, a(k, p)] = 1
    for p, g in enumerate(slots):
        mem, tim, atl, atm = row(-np.inf, 0), row(-np.inf, 0), row(0, np.inf), row(-np.inf, 0)
        for k, (bound, _) in enumerate(bks):
            rows[mem, a(k, p)] = bound
            rows[tim, a(k, p)] = cost.seq_time(bound, g)
            rows[atl, a(k, p)] = 1
            rows[atm, a(k, p)] = 1
        rows[mem, mi + p], rows[tim, mi + p], rows[tim, Mi] = -cap * g, cost.bias, -1
        rows[atl, mi + p], rows[atm, mi + p] = -1, -total
    dev = row(n, n)
    for p, g in enumerate(slots):
        rows[dev, mi + p] = g
    for p in range(P - 1):
        if slots[p] == slots[p + 1]:  # ours: identical slots used in order (symmetry breaking)
            i = row(0, np.inf)
            rows[i, mi + p], rows[i, mi + p + 1] = 1, -1
    ub = np.full(nv, np.inf)
    for k, (bound, idx) in enumerate(bks):
        for p, g in enumerate(slots):
            ub[a(k, p)] = 0 if bound > cap * g else len(idx)
    ub[mi:Mi] = 1
    ub[Mi] = upper if upper is not None else np.inf
    c = np.zeros(nv)
    c[Mi] = 1
    integrality = np.ones(nv)
    integrality[Mi] = 0
    res = milp(c, integrality=integrality, bounds=Bounds(np.zeros(nv), ub),
               constraints=LinearConstraint(rows[:r].tocsr(), lo, hi),
               options={"time_limit": time_limit_s, "disp": False})
    if res.x is None:
        return None, None, res.message
    x = np.rint(res.x).astype(int)
    used = [p for p in range(P) if x[mi + p] == 1]
    members: list[list[int]] = [[] for _ in used]
    for k, (_, idx) in enumerate(bks):
        queue = sorted(idx, key=lambda i: -lengths[i])
        for j, p in enumerate(used):
            take, queue = queue[:x[a(k, p)]], queue[x[a(k, p)]:]
            members[j].extend(take)
    return [slots[p] for p in used], members, "optimal" if res.status == 0 else res.message


def solve(lengths: list[int], *, n: int, cap: int, cost: CostModel, buckets: int = 8,
          time_limit_s: float = 0.5) -> Plan:
    """The step's plan: the fastest (on the real lengths) of the MILP's answer, the balanced start
    and the greedy plan; the latter two stand in when HiGHS finds nothing within the time limit."""
    t0 = time.perf_counter()
    for s in lengths:
        min_group_size(s, cap, n)  # raises with the reason when a sequence fits nowhere
    start = balanced_plan(lengths, n=n, cap=cap, cost=cost, buckets=buckets)
    upper = None
    if start is not None:  # the start's time with bucket boundaries: the MILP's own measure of it
        bounded = [0] * len(lengths)
        for bound, idx in buckets_for(lengths, buckets=buckets, n=n, cap=cap):
            for i in idx:
                bounded[i] = bound
        upper = evaluate(start.sizes, start.members, bounded, cost) * (1 + 1e-6)
    sizes, members, status = _milp(lengths, n=n, cap=cap, cost=cost, buckets=buckets, time_limit_s=time_limit_s,
                                   upper=upper)
    candidates = [start]
    if sizes is not None and _fits(sizes, members, lengths, cap):
        candidates.append(Plan(sizes, members, evaluate(sizes, members, lengths, cost), "milp"))
    try:
        candidates.append(greedy_plan(lengths, n=n, cap=cap, cost=cost))
    except ValueError:
        pass
    # the MILP optimises bucket upper bounds: on the real lengths another candidate can be faster
    plan = min((c for c in candidates if c is not None), key=lambda c: c.predicted_s, default=None)
    if plan is None:
        raise ValueError(f"no plan fits {sum(lengths)} tokens into {n} ranks of {cap} tokens each")
    plan.status = str(status)
    plan.solve_s = time.perf_counter() - t0
    return plan
