"""The bilinear saddle-point problem of MASHA (Beznosikov et al., NeurIPS 2022) as a `model.entry`
workload, trained with MASHA1's extragradient over dp ranks:

    min_x max_y  f(x, y) = 1/M sum_m [x^T A_m y + b_m^T x + c_m^T y] + lam/2 |x|^2 - lam/2 |y|^2

Rank m of the M = dp ranks holds the piece (A_m, b_m, c_m) (the paper's distributed setting:
each worker its own operator). The operator F(z) = (grad_x f, -grad_y f) is the gradient of the
model's output with the gradient of y reversed, so DDP averages F over the ranks through the
configured comm hook (dense, or compressed on one or both legs). The step is MASHA1's
extragradient with a reference point (`masha_step`): only F_m(z_half) - F_m(w) is compressed,
which vanishes at the solution, so the method converges with unbiased and contractive compressors.

The reported "loss" is |z_k - z*|^2 / |z_0 - z*|^2, the squared distance to the exact saddle
point z* (solved from the 2d x 2d linear system of the mean operator); it should decrease to
~0 with every compressor. `lam` > 0 makes the problem strongly monotone (the regularised form).

Run (from the repository root, which must be importable by the ranks):
`PYTHONPATH=. workbench run examples/minmax.yaml --set comm.compressor=topk --set comm.bidirectional=true`.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn

DIM, LAM, SEED, SAMPLES = 32, 0.5, 0, 64
TAU = 0.75  # MASHA1's tau: the reference point w moves with probability 1 - tau per step


class _ReverseGrad(torch.autograd.Function):
    """Identity forward, negated gradient backward: descent on y becomes ascent."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return -grad


def problem(dim: int, pieces: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A (pieces, dim, dim), b (pieces, dim), c (pieces, dim)) drawn from `seed`: equal on every rank."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(pieces, dim, dim, generator=gen) / math.sqrt(dim)
    return a, torch.randn(pieces, dim, generator=gen), torch.randn(pieces, dim, generator=gen)


def saddle_point(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, lam: float) -> torch.Tensor:
    """z* = (x*, y*) of the mean problem: A y + b + lam x = 0 and A^T x + c - lam y = 0."""
    a, b, c = a.mean(0).double(), b.mean(0).double(), c.mean(0).double()
    d = a.shape[0]
    eye = torch.eye(d, dtype=torch.float64)
    system = torch.cat([torch.cat([lam * eye, a], 1), torch.cat([a.T, -lam * eye], 1)], 0)
    return torch.linalg.solve(system, -torch.cat([b, c])).float()


class Bilinear(nn.Module):
    """f_m(x, y) of this rank's piece m; forward ignores its input (the operator is deterministic)."""

    def __init__(self, dim: int = DIM, lam: float = LAM, seed: int = SEED) -> None:
        super().__init__()
        pieces = dist.get_world_size() if dist.is_initialized() else 1
        m = dist.get_rank() if dist.is_initialized() else 0
        a, b, c = problem(dim, pieces, seed)
        self.lam, self.piece = lam, m
        # every piece on every rank: DDP broadcasts rank 0's buffers at wrap time
        self.register_buffer("a", a)
        self.register_buffer("b", b)
        self.register_buffer("c", c)
        self.register_buffer("solution", saddle_point(a, b, c, lam))
        self.x = nn.Parameter(torch.zeros(dim))
        self.y = nn.Parameter(torch.zeros(dim))
        self.start_sq = float(self.solution.square().sum())  # |z_0 - z*|^2 with z_0 = 0
        # MASHA1's state (masha_step): reference point w, F(w) (dp mean) and this rank's F_m(w)
        self.w: torch.Tensor | None = None
        self.f_w = self.f_w_local = self.shift = None
        self.refresh, self.steps = False, 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x, y = self.x, _ReverseGrad.apply(self.y)
        m = self.piece
        out = (x @ self.a[m] @ y + self.b[m] @ x + self.c[m] @ y
               + 0.5 * self.lam * x.square().sum() - 0.5 * self.lam * y.square().sum())
        if self.shift is not None:  # gradient F_m(z) - shift (y not reversed: -shift_y is its share)
            d = self.x.numel()
            out = out - self.shift[:d] @ self.x - self.shift[d:] @ self.y
        return out

    def distance(self) -> torch.Tensor:
        """|z - z*|^2 / |z_0 - z*|^2."""
        z = torch.cat([self.x.detach(), self.y.detach()])
        return (z - self.solution).square().sum() / self.start_sq


def _flat(params: list[torch.Tensor], grads: bool = False) -> torch.Tensor:
    return torch.cat([(p.grad if grads else p).detach().reshape(-1) for p in params])


def _load(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    with torch.no_grad():
        offset = 0
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def _operator(model: nn.Module, inputs: torch.Tensor, params: list[nn.Parameter], *, sync: bool) -> torch.Tensor:
    """F at the current parameters: this rank's piece (sync=False) or the dp mean through the
    comm hook (sync=True), minus the module's `shift`."""
    for p in params:
        p.grad = None
    no_sync = getattr(model, "no_sync", None)
    with (no_sync() if not sync and no_sync is not None else contextlib.nullcontext()):
        model(inputs).backward()
    return _flat(params, grads=True)


def masha_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, lr: float) -> torch.Tensor:
    """One step of MASHA1 (Beznosikov et al. 2022, Algorithm 1, Z = R^d, h = 0), the compression
    being whatever comm hook the DDP `model` carries (dense, Rand-k, Top-k, one or both legs):

        z_bar    = tau z_k + (1 - tau) w_k
        z_half   = z_bar - lr F(w_k)
        g_k      = mean_m Q(F_m(z_half) - F_m(w_k))          <- the only compressed exchange
        z_{k+1}  = z_bar - lr (F(w_k) + g_k)
        w_{k+1}  = z_{k+1} with probability 1 - tau (a coin every rank draws alike), else w_k

    F(w) is averaged dense (an uncompressed all_reduce) only when w moves. The difference is
    compressed because the forward subtracts <z, F_m(w)>, so the hook sees F_m(z) - F_m(w).
    With Top-k the hooks' error memories play MASHA2's error feedback (ours: EF on the
    unscaled difference, not on lr x difference; equal up to the constant lr).
    Returns |z_{k+1} - z*|^2 / |z_0 - z*|^2.
    """
    net = getattr(model, "module", model)
    params = [net.x, net.y]
    z = _flat(params)
    if net.w is None or net.refresh:  # a new reference point: F(w) exactly, dense
        net.w, net.shift = z.clone(), None
        net.f_w_local = _operator(model, inputs, params, sync=False)
        net.f_w = net.f_w_local.clone()
        if dist.is_initialized():
            dist.all_reduce(net.f_w)
            net.f_w /= dist.get_world_size()
    z_bar = TAU * z + (1 - TAU) * net.w
    _load(params, z_bar - lr * net.f_w)
    net.shift = net.f_w_local
    g = _operator(model, inputs, params, sync=True)
    net.shift = None
    _load(params, z_bar - lr * (net.f_w + g))
    net.steps += 1
    coin = torch.rand(1, generator=torch.Generator().manual_seed(SEED * 100_003 + net.steps))
    net.refresh = bool(coin < 1 - TAU)
    return net.distance()


def build():
    """model.entry: (model, dataset, step function)."""
    dummy = [(torch.zeros(1), torch.zeros((), dtype=torch.long)) for _ in range(SAMPLES)]
    return Bilinear(), dummy, masha_step
