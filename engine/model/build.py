"""build_model(cfg, seed=, device=): the model a ModelConfig names, the one entry above the two families
(the built-in GPT / MoE of engine/model/gpt.py, a Hugging Face causal LM of engine/model/hf.py), so neither imports
the other and engine/model/meta_init.py's recorder stays below both."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def build_model(cfg: Any, *, seed: int, device: torch.device | str = "meta") -> nn.Module:
    """The model `cfg` (an engine ModelConfig) names: a Hugging Face causal LM (`cfg.hf`,
    engine/model/hf.py) or the built-in GPT / MoE (engine/model/gpt.py), seeded with `seed`. On meta (the
    default) nothing is allocated: apply the layout, then `materialize()` this rank's parts (the
    same values as a `device="cpu"` build)."""
    if cfg.hf is not None:
        from engine.model.hf import build_hf_model

        return build_hf_model(cfg, seed=seed, device=device)
    from engine.model.gpt import build_model as build_gpt

    return build_gpt(cfg, seed=seed, device=device)
