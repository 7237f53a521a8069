"""Pricing a search once per group of rows that price alike, then spreading the results onto every row.

A search's rows repeat a few distinct values of the columns a term depends on: GEMM shapes depend on
(micro, tp, ...) only (`tuning.sim.compute.per_unique`), what ZeRO does not change on the layout only
(`tuning.sim.core.ZERO_FREE_GROUP`). Each such term is priced on one row of each group (`take_rows`) and
gathered back through each row's group (`spread`); `row_groups` finds the groups.
"""
from __future__ import annotations

from typing import Any

import numpy as np


def row_groups(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a row of each distinct key, in ascending key order; each row's group): `np.unique`'s index and
    inverse, by a table instead of a sort where the keys are small non-negative integers (a search's)."""
    top = int(key.max())
    if key.min() < 0 or top > 4 * key.size + 4096:
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        return first, inverse
    present = np.zeros(top + 1, dtype=bool)
    present[key] = True
    inverse = (np.cumsum(present) - 1)[key]
    first = np.empty(int(np.count_nonzero(present)), dtype=np.int64)
    first[inverse] = np.arange(key.size)  # any row of a group: its rows agree on every key column
    return first, inverse


def take_rows(c: dict[str, Any], rows: Any, n: int) -> dict[str, Any]:
    """The columns of `c` at `rows`: each column of `n` rows indexed, scalars (settings every row shares) kept."""
    return {k: (v[rows] if np.ndim(v) and np.size(v) == n else v) for k, v in c.items()}


def spread(value: Any, inverse: np.ndarray) -> Any:
    """`value` (one entry per group: an array, or a dict or tuple of them) on every row; scalars stay scalars."""
    if isinstance(value, dict):
        return {k: spread(v, inverse) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(spread(v, inverse) for v in value)
    return np.asarray(value)[inverse] if np.ndim(value) else value
