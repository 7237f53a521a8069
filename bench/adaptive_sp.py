"""Adaptive sequence parallelism (FlexSP) vs every static sequence-parallel degree, world 4.

The same long-tail documents each step, the same execution (engine/parallel/adaptive_sp.py: each
group packs its documents into one row with document masks and runs Ulysses over its ranks), only
the plan differs: the solver's per-step groups, or n/g groups of g ranks for a static degree g
(sequences longest first to the least-loaded group with room). Strategies are interleaved within
each step (rotating order) and medians reported. A static degree whose groups cannot hold the
step's longest document under the token cap is infeasible and left out.

The adaptive plans are solved one step ahead (engine/parallel/adaptive_sp.py `PlanAhead`, as
FlexSP overlaps planning with training): rank 0 starts step t+1's solve in a thread when adaptive
step t starts, and adaptive step t ends only when that solve has ended too (training would start
step t+1 right away), so whatever the overlap does not hide is in the adaptive step time and in
the exposed solver time. `--inline` solves at the start of each step instead (no overlap).

Prints, side by side: median step time per strategy (the adaptive one includes its solver),
adaptive / best static (goal <= 0.8), the exposed solver time as a share of the adaptive step
(goal < 5%) next to the whole solve time, the MILP's size, and the largest tokens per rank
against the cap; the load average before and after (the machine may be shared).

    python bench/adaptive_sp.py [--world 4] [--steps 8] [--seq-len 1024] [--cap 640] [--inline]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from common import run_world


def _measure(rank: int, world: int, args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    from engine.config.schema import ModelConfig
    from engine.data.corpus import SYNTHETIC_TOKENS
    from engine.data.lengths import budget_documents
    from engine.model.gpt import build_model
    from engine.parallel.adaptive_sp import GroupCache, PlanAhead, calibrate, run_step, sum_gradients
    from engine.parallel.flexsp import powers_of_two, solve, uniform_plan

    cfg = ModelConfig(layers=args.layers, d_model=args.d_model, heads=args.heads, seq_len=args.seq_len, vocab=256)
    model = build_model(cfg, seed=0)
    groups = GroupCache(600.0)
    cost = calibrate(model, world=world, groups=groups, seq_len=cfg.seq_len, device=torch.device("cpu"))
    for sizes in ([world >> i] * (1 << i) for i in range(world.bit_length())):
        groups.pattern(sizes)  # every group of every aligned layout exists before timing (once, all ranks)
    tokens = torch.randint(0, 256, (SYNTHETIC_TOKENS,), generator=torch.Generator().manual_seed(0))

    def docs_of(step: int) -> list:
        return budget_documents(tokens, budget=args.budget, kind="lognormal", mean=args.median, sigma=args.sigma,
                                max_len=cfg.seq_len, seed=1, step=step)

    ahead = PlanAhead(lambda lengths: solve(lengths, n=world, cap=args.cap, cost=cost, buckets=args.buckets,
                                            time_limit_s=args.time_limit), rank=rank)
    names = ["adaptive"] + [f"static-{g}" for g in powers_of_two(world)]
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    solve_s, exposed_s, milp_s, solve_cpu, statuses, sizes_seen = [], [], [], [], [], set()
    peak, predicted, measured, shapes = {n: 0 for n in names}, [], [], []
    for step in range(args.steps + 1):  # step 0 warms up (allocator, first solve)
        docs = docs_of(step)
        lengths = [d.numel() - 1 for d in docs]
        order = names[step % len(names):] + names[:step % len(names)]
        for name in order:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            waited = 0.0
            if name == "adaptive":
                plan = ahead.take(step, lengths)
                if rank == 0 and not args.inline and step < args.steps:
                    ahead.submit(step + 1, [d.numel() - 1 for d in docs_of(step + 1)])
            else:
                g = int(name.split("-")[1])
                plan = uniform_plan(lengths, n=world, g=g, cap=args.cap, cost=cost)
                if plan is None:  # this degree cannot hold the step's documents
                    times[name].append(float("inf"))
                    cpu[name].append(float("inf"))
                    continue
            _, report = run_step(model, docs, plan, groups, rank=rank, total_tokens=sum(lengths), cost=cost,
                                 device=torch.device("cpu"))
            sum_gradients(model)
            model.zero_grad(set_to_none=True)
            if name == "adaptive":
                waited = ahead.wait(step + 1)  # the next step needs its plan: what the overlap did not hide
            used = time.process_time() - c0  # this rank's CPU seconds (rank 0: its solver thread included)
            dist.barrier()
            elapsed = time.perf_counter() - t0
            if step == 0:
                continue
            times[name].append(elapsed)
            cpu[name].append(used)
            peak[name] = max(peak[name], report.max_tokens_per_rank)
            if name == "adaptive":
                solve_s.append(plan.solve_s)
                exposed_s.append(plan.exposed_s + waited)
                milp_s.append(plan.milp_s)
                solve_cpu.append(plan.cpu_s)
                statuses.append(plan.status.split(".")[0])
                sizes_seen.add(tuple(plan.milp_size))
                predicted.append(max(report.predicted_group_s))
                measured.append(max(report.measured_group_s))
                shapes.append({"step": step, "groups": [len(r) for r in report.group_ranks],
                               "tokens": [d["tokens"] for d in plan.describe(lengths)], "longest": max(lengths),
                               "predicted_ms": round(max(report.predicted_group_s) * 1000, 1),
                               "measured_ms": [round(t * 1000, 1) for t in report.measured_group_s]})
    # a static degree that cannot hold some step's documents cannot train this data at all
    ahead.close()
    every = [None] * world
    dist.all_gather_object(every, cpu)
    cpu_all = {n: statistics.median(sum(c[n][i] for c in every) for i in range(len(v))) for n, v in cpu.items() if v}
    med = {n: (float("inf") if float("inf") in v else statistics.median(v)) for n, v in times.items() if v}
    return {"median_s": med, "times": times, "shapes": shapes, "cpu_s": cpu_all, "solve_s": statistics.median(solve_s), "exposed_s": statistics.median(exposed_s),
            "milp_s": statistics.median(milp_s), "solve_cpu_s": statistics.median(solve_cpu),
            "statuses": {t: statuses.count(t) for t in set(statuses)}, "milp_sizes": sorted(sizes_seen), "peak_tokens": peak,
            "cap": args.cap, "predicted_s": statistics.median(predicted), "measured_s": statistics.median(measured),
            "cost": {"a1": cost.a1, "a2": cost.a2, "bias": cost.bias, "a2a": cost.a2a, "group_bias": cost.group_bias,
                     "per_seq": cost.per_seq}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024, help="longest document")
    ap.add_argument("--cap", type=int, default=640, help="memory cap, tokens per rank")
    ap.add_argument("--budget", type=int, default=2048, help="real tokens per step")
    ap.add_argument("--median", type=float, default=0.08, help="median document length / seq-len")
    ap.add_argument("--sigma", type=float, default=1.2, help="lognormal sigma")
    ap.add_argument("--buckets", type=int, default=8)
    ap.add_argument("--time-limit", type=float, default=0.2, help="MILP time limit per step (s)")
    ap.add_argument("--inline", action="store_true", help="solve each plan at its step's start (no overlap)")
    args = ap.parse_args()
    load0 = os.getloadavg()
    r = run_world(_measure, args.world, args)
    load1 = os.getloadavg()
    med = r["median_s"]
    static = {n: t for n, t in med.items() if n != "adaptive" and t != float("inf")}
    best = min(static, key=static.get)
    for i, sh in enumerate(r["shapes"]):
        others = "  ".join(f"{n} {r['times'][n][i] * 1000:.0f} ms" for n in static)
        print(f"step {sh['step']:2d} longest {sh['longest']:4d}: adaptive groups {sh['groups']} tokens {sh['tokens']} "
              f"{r['times']['adaptive'][i] * 1000:.0f} ms (predicted slowest group {sh['predicted_ms']} ms, measured "
              f"{sh['measured_ms']})  {others}")
    print(f"world {args.world}, {args.steps} steps, ~{args.budget} tokens/step, lognormal lengths "
          f"(median {args.median * args.seq_len:.0f}, sigma {args.sigma}, max {args.seq_len}), cap {args.cap} tokens/rank")
    print(f"cost model (calibrated): {r['cost']}")
    for n, t in med.items():
        shown = "infeasible (a step's tokens over the cap)" if t == float("inf") else f"{t * 1000:8.1f} ms"
        print(f"  {n:10s} median step {shown}   max tokens/rank {r['peak_tokens'][n]}")
    paired = statistics.median(a / b for a, b in zip(r["times"]["adaptive"], r["times"][best]))
    print(f"adaptive / best static ({best}): {med['adaptive'] / static[best]:.3f}  (goal <= 0.8); "
          f"median of the per-step ratios {paired:.3f}")
    print("CPU seconds per step, all ranks together (median; on fewer cores than ranks the step time "
          "follows this sum, not the slowest group): " + ", ".join(
              f"{n} {t * 1000:.0f} ms" for n, t in r["cpu_s"].items() if t != float("inf")))
    how = "solved in line" if args.inline else "solved one step ahead"
    print(f"solver ({how}): exposed {r['exposed_s'] * 1000:.1f} ms per step = "
          f"{100 * r['exposed_s'] / med['adaptive']:.1f}% of the adaptive step (goal < 5%); whole solve "
          f"{r['solve_s'] * 1000:.1f} ms ({100 * r['solve_s'] / med['adaptive']:.1f}%), of it HiGHS {r['milp_s'] * 1000:.1f} ms; "
          f"CPU {r['solve_cpu_s'] * 1000:.1f} ms; MILP (variables, constraints): {r['milp_sizes']}; "
          f"outcomes {r['statuses']}")
    print(f"adaptive predicted vs measured slowest group: {r['predicted_s'] * 1000:.1f} ms vs {r['measured_s'] * 1000:.1f} ms")
    print(f"max tokens per rank (adaptive) {r['peak_tokens']['adaptive']} vs cap {r['cap']}")
    print(f"load average (1, 5, 15 min) before {tuple(round(x, 2) for x in load0)}, "
          f"after {tuple(round(x, 2) for x in load1)} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
