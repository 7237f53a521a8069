"""Layer-wise adaptive compression after L-GreCo (Markov et al., MLSys 2024; formulas.md).

Per layer l and level c: error e(l, c) (squared L2 norm of the compression residual, so the
errors of layers add up to the error of the whole gradient) and size s(l, c) (bytes sent). A
dynamic program over a discretised error budget picks one level per layer minimising total
bytes subject to total error <= budget; the budget defaults to the error of the uniform default
level times `error_budget`. `AdaptiveCompressor` applies the chosen Top-k densities per
parameter tensor inside a DDP comm hook and re-solves every `interval` steps.
"""

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from engine.comm.compress import Wire, densify, error_feedback, gather_sparse, k_for

OnBytes = Callable[[int, int], None]
TOPK_LEVELS = (0.001, 0.003, 0.01, 0.03, 0.1)
_INDEX_BYTES = 4  # int32 index next to each fp32 value


@dataclass(kw_only=True, slots=True)
class LevelTable:
    """e(l, c) and s(l, c) for layers `names` (rows) and candidate `levels` (columns)."""

    names: list[str]
    levels: list[float]
    errors: list[list[float]]
    """Squared L2 norm of the compression residual."""
    sizes: list[list[int]]
    """Bytes this layer sends at that level (before bus factors)."""


def topk_errors(tensor: torch.Tensor, densities: Sequence[float]) -> tuple[list[float], list[int]]:
    """Squared residual norm and bytes of Top-k at each density, from one sort."""
    flat = tensor.detach().reshape(-1).double()
    ks = [k_for(flat.numel(), d) for d in densities]
    top = torch.topk(flat.abs(), max(ks), sorted=True).values
    kept = torch.cumsum(top.square(), dim=0)
    total = float(flat.square().sum())
    errors = [max(0.0, total - float(kept[k - 1])) for k in ks]
    return errors, [k * (4 + _INDEX_BYTES) for k in ks]


def lowrank_errors(tensor: torch.Tensor, ranks: Sequence[int]) -> tuple[list[float], list[int]]:
    """Best rank-r error (sum of the squared singular values beyond r) and PowerSGD's bytes.

    1-D tensors and matrices not worth compressing (torch's rule: (n + m) r x 2 >= n m) are
    sent dense with no error, as torch's PowerSGD hook does.
    """
    if tensor.dim() <= 1:
        return [0.0] * len(ranks), [tensor.numel() * 4] * len(ranks)
    matrix = tensor.detach().reshape(tensor.shape[0], -1).double()
    n, m = matrix.shape
    sq = torch.linalg.svdvals(matrix).square()
    errors, sizes = [], []
    for r in ranks:
        r = min(r, n, m)
        if (n + m) * r * 2 < n * m:
            errors.append(float(sq[r:].sum()))
            sizes.append((n + m) * r * 4)
        else:
            errors.append(0.0)
            sizes.append(n * m * 4)
    return errors, sizes


def measure_errors(
    grads: dict[str, torch.Tensor], levels: Sequence[float], *, method: str = "topk"
) -> LevelTable:
    """e(l, c), s(l, c) for each named gradient at each level (Top-k densities or PowerSGD ranks)."""
    if method not in ("topk", "powersgd"):
        raise ValueError(f"method={method!r} must be 'topk' or 'powersgd'")
    measure = topk_errors if method == "topk" else lowrank_errors
    table = LevelTable(names=list(grads), levels=list(levels), errors=[], sizes=[])
    for name in table.names:
        errors, sizes = measure(grads[name], levels)  # type: ignore[arg-type]
        table.errors.append(errors)
        table.sizes.append(sizes)
    return table


def solve_levels(
    errors: Sequence[Sequence[float]],
    sizes: Sequence[Sequence[int]],
    budget: float,
    *,
    bins: int = 1000,
) -> list[int]:
    """Level index per layer minimising sum of sizes subject to sum of errors <= budget.

    Dynamic program over the budget cut into `bins` units; each error is rounded UP to whole
    units, so the answer always meets the true budget and is optimal among assignments whose
    rounded errors fit (at most one unit per layer is lost to rounding). O(layers x levels x bins).
    """
    if bins < 1:
        raise ValueError(f"bins={bins} must be >= 1")
    units = [[_units(e, budget, bins) for e in row] for row in errors]
    best = torch.zeros(bins + 1, dtype=torch.float64)  # best[b]: min bytes with <= b units
    choices: list[torch.Tensor] = []
    for row_units, row_sizes in zip(units, sizes):
        new = torch.full((bins + 1,), math.inf, dtype=torch.float64)
        pick = torch.zeros(bins + 1, dtype=torch.long)
        for c, (u, s) in enumerate(zip(row_units, row_sizes)):
            if u > bins:
                continue
            cand = torch.full((bins + 1,), math.inf, dtype=torch.float64)
            cand[u:] = best[: bins + 1 - u] + s
            better = cand < new
            new = torch.where(better, cand, new)
            pick = torch.where(better, torch.full_like(pick, c), pick)
        best = new
        choices.append(pick)
    if math.isinf(float(best[bins])):
        least = sum(min(row) for row in errors)
        raise ValueError(
            f"no assignment fits error budget {budget:.4g}; the least total error is {least:.4g}"
        )
    out, b = [], bins
    for layer in range(len(choices) - 1, -1, -1):
        c = int(choices[layer][b])
        out.append(c)
        b -= units[layer][c]
    return out[::-1]


def _units(error: float, budget: float, bins: int) -> int:
    if error <= 0:
        return 0
    if budget <= 0:
        return bins + 1
    # relative slack so that an error of exactly j budget/bins counts as j units, not j + 1
    return math.ceil(error * bins / budget * (1 - 1e-12))


class AdaptiveCompressor:
    """Per-parameter Top-k with error feedback whose densities L-GreCo re-solves every `interval` steps.

    Register with `ddp_model.register_comm_hook(compressor, adaptive_hook)` (or `apply_adaptive`).
    Every rank solves the same problem: the error table is averaged over ranks first, so all
    ranks choose the same k per tensor and their all_gathers match.
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        *,
        process_group: dist.ProcessGroup | None = None,
        levels: Sequence[float] = TOPK_LEVELS,
        default_level: float = 0.01,
        error_budget: float = 1.0,
        interval: int = 100,
        bins: int = 1000,
        on_bytes: OnBytes | None = None,
    ) -> None:
        """`error_budget` multiplies the error of the uniform `default_level` to give the budget."""
        if interval < 1:
            raise ValueError(f"interval={interval} must be >= 1")
        self.names = {id(p): name for name, p in named_parameters if p.requires_grad}
        self.levels = sorted(set(levels) | {default_level})
        self.default_level, self.error_budget = default_level, error_budget
        self.interval, self.bins = interval, bins
        self.process_group, self.on_bytes = process_group, on_bytes
        self.density: dict[str, float] = {name: default_level for name in self.names.values()}
        self.residuals: dict[str, torch.Tensor] = {}
        self.step = 0
        self.solves = 0
        self.last_budget = self.last_error = 0.0
        self.last_bytes = self.last_uniform_bytes = 0
        self.wire_bytes = 0
        self.dense_bytes = 0
        self._rows: dict[str, tuple[list[float], list[int]]] = {}

    def set_default_level(self, level: float) -> None:
        """Change the uniform level the budget is measured against (live `comm.density`).

        The level joins the candidate levels (the solver looks it up there), and every layer
        uses it until the next solve, so the change acts from the next step on.
        """
        if not 0.0 < level <= 1.0:
            raise ValueError(f"comm.density={level} must be in (0, 1]; e.g. 0.01")
        self.default_level = level
        self.levels = sorted(set(self.levels) | {level})
        self.density = {name: level for name in self.density}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Residuals per parameter, the chosen densities, the levels and the step count: this rank's,
        for engine/train/checkpoint.py."""
        out = {f"residual.{name}": t for name, t in self.residuals.items()}
        out["density"] = torch.tensor([self.density[n] for n in sorted(self.density)], dtype=torch.float64)
        out["levels"] = torch.tensor([self.default_level, *self.levels], dtype=torch.float64)
        out["counters"] = torch.tensor([self.step, self.solves], dtype=torch.int64)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what `state_dict` returned."""
        self.residuals = {k[len("residual."):]: v for k, v in state.items() if k.startswith("residual.")}
        self.density = dict(zip(sorted(self.density), state["density"].tolist()))
        self.default_level, *self.levels = state["levels"].tolist()
        self.step, self.solves = state["counters"].tolist()

    @property
    def chosen_levels(self) -> dict[str, float]:
        """Current Top-k density per parameter name (telemetry)."""
        return dict(self.density)

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Compress one bucket tensor by tensor; all_gather the union; mean into the bucket."""
        buf = bucket.buffer()
        n = dist.get_world_size(self.process_group)
        measuring = self.step % self.interval == 0
        values, indices, offset = [], [], 0
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            name = self.names[id(param)]
            acc = grad.reshape(-1) + self.residuals[name] if name in self.residuals else grad.reshape(-1)
            if measuring:
                self._rows[name] = topk_errors(acc, self.levels)
            v, i, self.residuals[name] = error_feedback(acc, None, k_for(acc.numel(), self.density[name]))
            values.append(v)
            indices.append(i + offset)
            offset += acc.numel()
        fut = gather_sparse(torch.cat(values), torch.cat(indices), self.process_group, n, numel=buf.numel())
        self._record(buf, 2 * sum(v.numel() for v in values) * 4, n)
        if bucket.is_last():
            self.step += 1
            if measuring:
                self._resolve(buf.device)

        def decompress(f: torch.futures.Future) -> torch.Tensor:
            all_values, all_indices = f.value()
            buf.copy_(densify(all_values, all_indices, buf.numel()).div_(n))
            return buf

        return fut.then(decompress)

    def _resolve(self, device: torch.device) -> None:
        """Average the error table over ranks and re-solve; `device` is the gradients' (the group's)."""
        names = sorted(self._rows)
        table = torch.tensor([self._rows[k][0] for k in names], dtype=torch.float64, device=device)
        dist.all_reduce(table, group=self.process_group)  # tiny; same table on every rank
        # a host sync every `interval` steps: the dynamic program runs on the host
        errors = table.cpu() / dist.get_world_size(self.process_group)
        sizes = [self._rows[k][1] for k in names]
        default = self.levels.index(self.default_level)
        budget = self.error_budget * float(errors[:, default].sum())
        uniform = [default] * len(names)
        try:
            picked = solve_levels(errors.tolist(), sizes, budget, bins=self.bins)
        except ValueError:
            picked = uniform  # rounding made even the uniform level miss the budget
        if sum(s[c] for s, c in zip(sizes, picked)) > sum(s[default] for s in sizes):
            picked = uniform
        for name, c in zip(names, picked):
            self.density[name] = self.levels[c]
        self.last_budget = budget
        self.last_error = float(sum(errors[i, c] for i, c in enumerate(picked)))
        self.last_bytes = sum(s[c] for s, c in zip(sizes, picked))
        self.last_uniform_bytes = sum(s[default] for s in sizes)
        self._rows.clear()
        self.solves += 1

    def _record(self, buf: torch.Tensor, payload: int, n: int) -> None:
        wire = int(Wire("all_gather", payload).on_wire(n))
        dense = int(Wire("all_reduce", buf.numel() * 4).on_wire(n))
        self.wire_bytes += wire
        self.dense_bytes += dense
        if self.on_bytes is not None:
            self.on_bytes(wire, dense)


def adaptive_hook(
    state: AdaptiveCompressor, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook entry: `ddp.register_comm_hook(compressor, adaptive_hook)`."""
    return state.hook(bucket)


def apply_adaptive(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    *,
    process_group: dist.ProcessGroup | None = None,
    levels: Sequence[float] = TOPK_LEVELS,
    default_level: float = 0.01,
    error_budget: float = 1.0,
    interval: int = 100,
    bins: int = 1000,
    on_bytes: OnBytes | None = None,
) -> AdaptiveCompressor:
    """Build an AdaptiveCompressor for the wrapped module and register its hook."""
    compressor = AdaptiveCompressor(
        ddp_model.module.named_parameters(),
        process_group=process_group,
        levels=levels,
        default_level=default_level,
        error_budget=error_budget,
        interval=interval,
        bins=bins,
        on_bytes=on_bytes,
    )
    ddp_model.register_comm_hook(compressor, adaptive_hook)
    return compressor
