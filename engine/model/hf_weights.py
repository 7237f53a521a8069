"""`model.hf_weights` read slice by slice: each rank reads from the safetensors files only the part of
each tensor it holds (`safe_open(...).get_slice`), never a whole checkpoint or a whole tensor it shards.

Names: the engine's parameter (`layers.3.self_attn.q_proj.weight`) is the transformers model's
(`model.layers.3.self_attn.q_proj.weight`); an expert (`layers.0.mlp.experts.gate_up.5`, one per
expert: engine/parallel/expert_fused.py) is row 5 of transformers' fused `experts.gate_up_proj`,
or, as `save_pretrained` writes Mixtral, `w1` stacked on `w3` of `block_sparse_moe.experts.5`.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

_EXPERT = re.compile(r"^(?P<parent>.*)\.experts\.(?P<kind>gate_up|down)\.(?P<e>\d+)$")
# transformers' own save format of fused experts per family (its conversion_mapping, reversed)
_LEGACY = {"gate_up": (("w1", "w3"), ("gate_proj", "up_proj")), "down": (("w2",), ("down_proj",))}
_RENAMES = ((".mlp.", ".block_sparse_moe."),)


def _key_files(folder: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it (headers only)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            out.update(dict.fromkeys(f.keys(), path))
    return out


class _Checkpoint:
    """The safetensors files of a folder, opened lazily; tensors read by name and box."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.files = folder, _key_files(folder)
        self._handles: dict[Path, object] = {}

    def _slice(self, key: str):
        from safetensors import safe_open

        path = self.files[key]
        if path not in self._handles:
            self._handles[path] = safe_open(path, "pt")
        return self._handles[path].get_slice(key)

    def read(self, key: str, box: tuple[slice, ...]) -> torch.Tensor:
        return self._slice(key)[box].to(torch.float32)

    def rows(self, key: str) -> int:
        return self._slice(key).get_shape()[0]


def checkpoint_reader(folder: str | Path, model: nn.Module, paths: dict[str, str]
                      ) -> Callable[[str, tuple[slice, ...]], torch.Tensor | None]:
    """`read(name, box)`: the `box` of the engine parameter `name` from the checkpoint in `folder`
    (fp32), None when the checkpoint has no such tensor (a buffer, or a tied head saved once).
    `paths` maps the engine's module names to transformers' (`tok_emb` -> `model.embed_tokens`)."""
    ckpt = _Checkpoint(Path(folder))

    def read(name: str, box: tuple[slice, ...]) -> torch.Tensor | None:
        hf = _hf_name(name, paths)
        for candidate in (hf, *[hf.replace(a, b) for a, b in _RENAMES]):
            if candidate in ckpt.files:
                return ckpt.read(candidate, box)
            got = _expert(candidate, box, ckpt)
            if got is not None:
                return got
        return None

    return read


def _hf_name(name: str, paths: dict[str, str]) -> str:
    """The transformers name of engine parameter `name`: its longest known module prefix mapped."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:cut])
        if prefix in paths:
            return ".".join(p for p in (paths[prefix], *parts[cut:]) if p)
    return name


def _expert(name: str, box: tuple[slice, ...], ckpt: _Checkpoint) -> torch.Tensor | None:
    """Expert e's (2F, H) gate_up or (H, F) down from a fused (E, ...) tensor or per-expert tensors."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    parent, kind, e = m["parent"], m["kind"], int(m["e"])
    fused = f"{parent}.experts.{kind}_proj"
    if fused in ckpt.files:
        return ckpt.read(fused, (slice(e, e + 1), *box))[0]
    for names in _LEGACY[kind]:
        keys = [f"{parent}.experts.{e}.{n}.weight" for n in names]
        if all(k in ckpt.files for k in keys):
            return _stacked(keys, box, ckpt)
    return None


def _stacked(keys: list[str], box: tuple[slice, ...], ckpt: _Checkpoint) -> torch.Tensor:
    """Rows `box[0]` of the row-wise concatenation of `keys` (gate on top of up), columns `box[1:]`."""
    rows, rest = box[0], box[1:]
    parts, start = [], 0
    for key in keys:
        n = ckpt.rows(key)
        lo, hi = max(rows.start, start), min(rows.stop, start + n)
        if lo < hi:
            parts.append(ckpt.read(key, (slice(lo - start, hi - start), *rest)))
        start += n
    return torch.cat(parts) if parts else ckpt.read(keys[0], (slice(0, 0), *rest))
