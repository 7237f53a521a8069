"""LSH-MoE token compression (Nie et al., NeurIPS 2024): before the dispatch all_to_all, the tokens
routed to each expert are clustered by cross-polytope locality-sensitive hashing (Andoni et al.
2015) and only the cluster centroids are sent; on combine, each token gets its centroid's
expert output plus its residual to the centroid (the residual-based error compensation).

Cross-polytope hash of x: project with a Gaussian matrix (d x m; Andoni et al.'s random rotation,
ours: an unnormalised Gaussian projection, which has the same argmax distribution), take the
index of the largest entry of [xA, -xA]: one of 2m = `buckets` codes. `hashes` independent
projections are combined into one code (buckets**hashes clusters at most per expert). The
projections are fixed per layer (seeded), so similar tokens share clusters across steps.
What is sent is the centroids tensor itself: the profiler records its real size.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def cross_polytope_codes(x: torch.Tensor, projections: torch.Tensor) -> torch.Tensor:
    """(n, d) tokens, (hashes, d, m) projections -> (n,) int64 codes in [0, (2m)**hashes)."""
    p = torch.einsum("nd,hdm->hnm", x.detach().float(), projections)
    per_hash = torch.cat([p, -p], dim=-1).argmax(dim=-1)  # (hashes, n)
    buckets = 2 * projections.shape[-1]
    code = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    for h in range(projections.shape[0]):
        code = code * buckets + per_hash[h]
    return code


class LSHCompressor:
    """Clusters each expert's tokens and sends centroids; `restore` adds the residuals back."""

    def __init__(self, d_model: int, *, buckets: int, hashes: int, seed: int) -> None:
        if buckets < 2 or buckets % 2:
            raise ValueError(f"comm.lsh_buckets={buckets} must be an even number >= 2")
        g = torch.Generator().manual_seed(seed)
        self.projections = torch.randn(hashes, d_model, buckets // 2, generator=g)
        self.codes_per_expert = buckets ** hashes

    def compress(self, tokens: torch.Tensor, expert: torch.Tensor, counts: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """Tokens sorted by `expert` -> (centroids sorted by expert, centroids per expert, restore)."""
        if self.projections.device != tokens.device:
            self.projections = self.projections.to(tokens.device)
        key = expert * self.codes_per_expert + cross_polytope_codes(tokens, self.projections)
        clusters, member = torch.unique(key, sorted=True, return_inverse=True)  # sorted: by expert first
        sizes = torch.bincount(member, minlength=clusters.numel()).to(tokens.dtype)
        sums = torch.zeros(clusters.numel(), tokens.shape[1], dtype=tokens.dtype, device=tokens.device)
        centroids = sums.index_add(0, member, tokens) / sizes.unsqueeze(1)
        new_counts = torch.bincount(clusters // self.codes_per_expert, minlength=counts.numel())
        residual = tokens - centroids[member]

        def restore(y: torch.Tensor) -> torch.Tensor:
            return y[member] + residual

        return centroids, new_counts, restore
