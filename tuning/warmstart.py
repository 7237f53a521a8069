"""Multi-fidelity tuning: the simulator ranks the space first, real runs then measure.

`enqueue_simulated` puts the simulator's top-k configs for this machine at the front of a real
study; `predicted_tokens_per_s` is recorded next to the measured value of every trial.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import optuna

from engine.config import RunConfig, replace
from engine.errors import ConfigError
from profilers.store import default_home
from tuning.space import SearchSpace

MAX_CANDIDATES = 2000


def local_profile(world: int, home: str | Path | None = None):
    """The calibrated profile of this machine for `world` ranks (`workbench calibrate --world`), or None."""
    from tuning.hardware import load_cluster

    path = (Path(home) if home else default_home()) / "hardware" / f"cpu-local-{world}.yaml"
    return load_cluster(path) if path.is_file() else None


def predict_tokens_per_s(cfg: RunConfig, cluster) -> float | None:
    from tuning.calibration import predict_run

    try:
        return float(predict_run(cfg, cluster).tokens_per_s)
    except ValueError:  # a config the simulator cannot price
        return None


def rank_space(space: SearchSpace, base: RunConfig, cluster, *, seed: int = 0) -> list[tuple[float, dict[str, Any]]]:
    """(predicted tokens/s, params) for valid combinations of the space, best first."""
    combos = space.grid()
    if len(combos) > MAX_CANDIDATES:
        combos = random.Random(seed).sample(combos, MAX_CANDIDATES)
    ranked = []
    for params in combos:
        try:
            cfg = replace(base, space.to_overrides(params, base))
        except ConfigError:
            continue
        value = predict_tokens_per_s(cfg, cluster)
        if value is not None:
            ranked.append((value, params))
    return sorted(ranked, key=lambda item: -item[0])


def enqueue_simulated(study: optuna.Study, space: SearchSpace, base: RunConfig, *, top: int,
                      home: str | Path | None = None) -> list[dict[str, Any]]:
    """Enqueue the simulator's best `top` configs; needs a calibrated profile of this machine."""
    world = space.world_size or base.world_size
    cluster = local_profile(world, home)
    if cluster is None:
        raise ConfigError("--warm-start", top, f"needs this machine's hardware profile: run "
                          f"`workbench calibrate --world {world}` first")
    chosen = [params for _, params in rank_space(space, base, cluster)[:top]]
    for params in chosen:
        study.enqueue_trial(params, skip_if_exists=True)
    return chosen
