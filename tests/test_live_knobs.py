"""Live knobs that cannot act are refused (issue 14): by the live tuner before the run starts or
as a pruned segment with the reason, and by the engine if one reaches it; lr-like knobs need a
loss-aware objective."""
from __future__ import annotations

import uuid

import optuna
import pytest
from optuna.trial import TrialState

from engine.config.schema import load_config
from engine.errors import ConfigError
from tuning.space import SearchSpace

BASE = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=32", "parallel.dp=2",
        "batch.global=8", "batch.micro=4"]


def _tuner(tmp_path, params: dict, extra: list[str], objective: str = "throughput"):
    from tuning.live import LiveTuner

    study = optuna.create_study(study_name=f"s-{uuid.uuid4().hex[:6]}",
                                directions=["maximize", "minimize"] if "+" in objective else ["maximize"])
    kw = {"objective": objective} if objective != "throughput" else {}  # the default
    return LiveTuner(study, SearchSpace.from_dict({"params": params}), load_config(None, BASE + extra),
                     segments=2, segment_steps=3, home=tmp_path, **kw)


REFUSED = [
    ({"link.gbps": {"choices": [1.0, 10.0]}}, [], r"params\.link\.gbps.*link\.gbps=0 at start"),
    ({"link.latency_us": {"choices": [0.0, 50.0]}}, ["link.gbps=1", "parallel.zero=2"],
     r"params\.link\.latency_us.*DDP comm hook"),
    ({"comm.density": {"low": 0.01, "high": 0.1}}, [], r"params\.comm\.density.*compressor=none has no density"),
    ({"comm.rank": {"low": 1, "high": 4}}, ["comm.compressor=topk"], r"compressor=topk has no rank"),
    ({"co2.tau": {"low": 2, "high": 8}}, [], r"params\.co2\.tau.*needs CO2 running"),
    ({"batch.micro": {"choices": [1, 2]}}, ["parallel.dp=1", "parallel.pp=2", "model.layers=2"],
     r"params\.batch\.micro.*pipeline fixes its micro-batch count"),
    ({"train.lr": {"low": 1e-4, "high": 1e-2, "log": True}}, [], r"params\.train\.lr.*throughput\+val_loss"),
    ({"co2.outer_lr": {"low": 0.1, "high": 1.0}}, ["co2.enabled=true"], r"params\.co2\.outer_lr.*throughput\+val_loss"),
]


@pytest.mark.parametrize("params,extra,match", REFUSED, ids=[next(iter(p)) for p, _, _ in REFUSED])
def test_live_tuner_refuses_a_knob_that_cannot_act_or_be_scored(tmp_path, params, extra, match):
    with pytest.raises(ConfigError, match=match):
        _tuner(tmp_path, params, extra)


def test_live_tuner_accepts_lr_with_a_loss_aware_objective(tmp_path):
    tuner = _tuner(tmp_path, {"train.lr": {"low": 1e-4, "high": 1e-2, "log": True}}, [],
                   objective="throughput+val_loss")
    assert tuner.cfg.train.eval_interval == 3  # every segment ends with an evaluation


def test_live_tuner_prunes_a_segment_whose_combination_makes_a_knob_inert(tmp_path):
    tuner = _tuner(tmp_path, {"link.gbps": {"choices": [0.0, 1.0]}, "link.latency_us": {"choices": [0.0, 50.0]}},
                   ["link.gbps=1"])
    tuner.study.enqueue_trial({"link.gbps": 0.0, "link.latency_us": 50.0})
    tuner.study.enqueue_trial({"link.gbps": 1.0, "link.latency_us": 50.0})
    knobs = tuner._next_knobs(0)
    assert knobs == {"link.gbps": 1.0, "link.latency_us": 50.0}
    pruned = tuner.study.get_trials()[0]
    assert pruned.state == TrialState.PRUNED
    assert "link.latency_us does nothing while link.gbps=0" in pruned.user_attrs["reason"]


def test_engine_refuses_a_live_knob_that_cannot_act():
    from engine.train.comm_setup import apply_live_knobs

    cfg = load_config(None, BASE)
    with pytest.raises(ValueError, match=r"comm\.density=0\.05 cannot act: comm\.compressor=none has no density"):
        apply_live_knobs({"comm.density": 0.05}, start=cfg, now=cfg, comm=None)
    now = apply_live_knobs({"train.lr": 0.002}, start=cfg, now=cfg, comm=None)  # a knob that acts is applied
    assert now.train.lr == 0.002
