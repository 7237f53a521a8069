"""DDP's bucket order, kept across a resume.

DDP rebuilds its gradient buckets after the first step, in the order the gradients became ready
(the tied embedding last, ...), so the flat layout of a bucket in step 0 differs from every later
step. A compressor's memory (Top-k and int8 residuals, PowerSGD's Q and error, bidirectional shards)
and Rand-k's seeded positions are tied to that flat layout; a run resumed from a checkpoint would
meet the initial layout in its first step where the uninterrupted run met the rebuilt one.
`BucketOrder` records each bucket's parameter order at every call, and once a checkpoint's order
is loaded, hands the compression hook a bucket in that order (a permuted copy) until DDP's own
rebuild matches it again.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist


class _OrderedBucket:
    """A `dist.GradBucket` look-alike over a permuted copy of a bucket's buffer (what the hooks call)."""

    def __init__(self, bucket: dist.GradBucket, buffer: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
        self._index, self._last, self._buffer, self._params = bucket.index(), bucket.is_last(), buffer, params

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        out, offset = [], 0
        for p in self._params:
            out.append(self._buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out


class BucketOrder:
    """Each bucket's parameter names in the order of its flat buffer: `seen` (the latest call) and
    `target` (a checkpoint's, loaded by `load`)."""

    def __init__(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
        self.names = {id(p): name for name, p in named_parameters}
        self.seen: dict[int, list[str]] = {}
        self.target: dict[int, list[str]] = {}

    def state(self) -> dict[str, list[str]]:
        return {str(i): order for i, order in self.seen.items()}

    def load(self, saved: dict[str, list[str]]) -> None:
        self.target = {int(i): list(order) for i, order in saved.items()}

    def wrap(self, hook: Callable) -> Callable:
        """The compression hook, called with each bucket in the loaded order where it differs."""

        def ordered_hook(state, bucket):  # no annotations: DDP rejects a string-typed `bucket`
            params = list(bucket.parameters())
            order = [self.names[id(p)] for p in params]
            self.seen[bucket.index()] = order
            want = self.target.get(bucket.index())
            if want is None or want == order:
                return hook(state, bucket)
            if sorted(want) != sorted(order):  # other parameters in this bucket: nothing to map
                self.target.pop(bucket.index())
                return hook(state, bucket)
            return _permuted(hook, state, bucket, params, order, want)

        return ordered_hook


def _permuted(hook: Callable, state: Any, bucket: dist.GradBucket, params: list[torch.nn.Parameter],
              order: list[str], want: list[str]) -> torch.futures.Future:
    buf = bucket.buffer()
    base = buf.data_ptr()
    where = {name: ((g.data_ptr() - base) // buf.element_size(), g.numel())
             for name, g in zip(order, bucket.gradients())}
    perm = torch.cat([torch.arange(where[n][0], where[n][0] + where[n][1], device=buf.device) for n in want])
    by_name = dict(zip(order, params))
    fut = hook(state, _OrderedBucket(bucket, buf[perm], [by_name[n] for n in want]))

    def back(f: torch.futures.Future) -> torch.Tensor:
        buf.index_copy_(0, perm, f.value())
        return buf

    return fut.then(back)
