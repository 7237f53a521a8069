"""Which blocks each pipeline chunk holds: pure arithmetic, no torch, so the memory fit check of
the New-run form (engine/train/memory.py) can use it without importing the pipeline runtime."""
from __future__ import annotations


def stage_layers(layers: int, pp: int, virtual: int = 1, layer_split: list[int] | None = None) -> list[list[int]]:
    """The block indices held by each of the pp * virtual chunks, in stage-index order.

    Chunk s runs on pp rank s % pp. An even split needs pp * virtual to divide `layers`;
    `layer_split` gives the number of blocks per chunk explicitly (pp * virtual entries).
    """
    chunks = pp * virtual
    if layer_split is None:
        if layers % chunks:
            raise ValueError(f"model.layers={layers} is not divisible by pp*virtual = {pp}*{virtual} = {chunks}; "
                             "give parallel.layer_split")
        layer_split = [layers // chunks] * chunks
    if len(layer_split) != chunks or sum(layer_split) != layers or min(layer_split) < 1:
        raise ValueError(f"parallel.layer_split={layer_split} needs {chunks} entries >= 1 summing to "
                         f"model.layers={layers}")
    starts = [sum(layer_split[:i]) for i in range(chunks)]
    return [list(range(start, start + n)) for start, n in zip(starts, layer_split)]
