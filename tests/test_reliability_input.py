"""Bad input never crashes the workbench: random configs, `--set` strings, YAML text and search
spaces either validate or raise ConfigError naming field, value and rule; the CLI exits non-zero
with the message and no traceback; and the security defaults hold (localhost dashboard, no
eval/exec, safe YAML, weights-only checkpoints, user code imported only when named).

The hypothesis properties count the examples they really tried; `docs/reliability.md` quotes
the counts (run with `-s` to see them printed).
"""
from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config.schema import RunConfig, apply_overrides, from_dict, load_config, load_yaml, replace
from engine.errors import ConfigError, ConfigErrors, shown_value
from engine.config.validate import MAX_WORLD_SIZE, validate
from tuning.space import SearchSpace

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "profilers", "tuning", "workbench")
CONFIG_EXAMPLES = 2500
SPACE_EXAMPLES = 1500
OVERRIDE_EXAMPLES = 800
YAML_EXAMPLES = 400
PROPERTY = settings(deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])

# ---------------------------------------------------------------- the message contract


def assert_named(exc: BaseException) -> list[ConfigError]:
    """A ConfigError (or several) whose every line reads `field=value: rule`."""
    assert isinstance(exc, ConfigError), f"{type(exc).__name__}: {exc}"
    errors = exc.errors if isinstance(exc, ConfigErrors) else [exc]
    assert errors
    for e in errors:
        # the field is the dotted key; only an unknown key spelled "" leaves it empty
        assert isinstance(e.field, str) and (e.field or e.rule.startswith("unknown key")), e
        assert isinstance(e.rule, str) and e.rule.strip(), e
        assert str(e) == f"{e.field}={shown_value(e.value)}: {e.rule}"  # repr, shortened past 1,000 chars
    assert str(exc) == "\n".join(str(e) for e in errors)
    return errors


def _numbers(value: Any) -> list[float]:
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def assert_sane(cfg: RunConfig) -> None:
    """What passing validation promises: finite numbers, a bounded world, a lossless round trip."""
    data = cfg.to_dict()
    assert all(math.isfinite(n) for n in _numbers(data)), data
    assert 1 <= cfg.world_size <= MAX_WORLD_SIZE
    assert cfg.batch.global_ % (cfg.parallel.dp * cfg.batch.micro) == 0
    assert from_dict(json.loads(json.dumps(data))) == cfg


# ---------------------------------------------------------------- strategies

DEFAULTS = RunConfig().to_dict()
CHOICES = {"source": ["text", "synthetic", "files"], "split": ["train", "val"], "schedule": ["gpipe", "1f1b",
           "interleaved", "cosine", "constant", "linear"], "compressor": ["none", "fp16", "bf16", "int8", "topk",
           "randk", "powersgd"], "precision": ["fp32", "bf16"], "backend": ["auto", "gloo", "nccl"],
           "entry": ["tests.some_module:build", "not a module", "os:system"], "name": ["run", "a b", ""]}
HUGE = st.sampled_from([10**6, 2**31, 10**12, 10**18, 10**300, -(10**300)])
JUNK = st.one_of(st.text(max_size=12), st.none(), st.booleans(), st.lists(st.integers(-3, 3), max_size=3),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
                 st.floats(allow_nan=True, allow_infinity=True), HUGE)


def _plausible(key: str, default: Any) -> st.SearchStrategy:
    """A value of the right type, small and often valid."""
    if key in CHOICES:
        return st.sampled_from(CHOICES[key])
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, int):
        return st.integers(-2, 16) | st.sampled_from([32, 64, 256])
    if isinstance(default, float):
        return st.floats(-0.5, 2.0, allow_nan=False) | st.sampled_from([0.0, 1e-3, 0.5, 1.0, 1e30])
    if key in ("layer_split", "trace_steps"):
        return st.none() | st.lists(st.integers(-1, 4), max_size=4)
    return st.none() | st.text(max_size=8)


def _value(key: str, default: Any) -> st.SearchStrategy:
    return st.one_of(_plausible(key, default), _plausible(key, default), _plausible(key, default), JUNK)


def _section(defaults: dict[str, Any]) -> st.SearchStrategy:
    known = st.fixed_dictionaries({}, optional={k: _value(k, v) for k, v in defaults.items()})
    unknown = st.dictionaries(st.text(min_size=1, max_size=8), JUNK, max_size=1)
    return st.builds(lambda a, b, add: {**a, **b} if add else a, known, unknown,
                     st.integers(0, 9).map(lambda n: n == 0))


def config_dicts() -> st.SearchStrategy:
    """Random nested configs: known keys with plausible or junk values, unknown keys, wrong shapes,
    absurd parallel degrees."""
    optional: dict[str, st.SearchStrategy] = {}
    for key, default in DEFAULTS.items():
        optional[key] = (_section(default) | JUNK) if isinstance(default, dict) else _value(key, default)
    degrees = st.fixed_dictionaries({}, optional={k: st.integers(1, 4) | HUGE | st.integers(-2, 0)
                                                  for k in ("dp", "tp", "pp")})
    top = st.fixed_dictionaries({}, optional=optional)
    extra = st.dictionaries(st.text(max_size=8), JUNK, max_size=1)
    return st.builds(_merge, top, degrees, extra, st.integers(0, 9))


def _merge(top: dict, degrees: dict, extra: dict, dice: int) -> dict:
    out = dict(top)
    if dice < 3 and isinstance(out.get("parallel", {}), dict):
        out["parallel"] = {**out.get("parallel", {}), **degrees}
    if dice == 9:
        out.update(extra)
    return out


CONFIG_KEYS = [f"{s}.{k}" for s, sec in DEFAULTS.items() if isinstance(sec, dict) for k in sec]
SPACE_KEYS = CONFIG_KEYS + ["parallel.layout", "batch.accum"]
NUMBER = st.one_of(st.integers(-4, 64), st.floats(-1.0, 100.0, allow_nan=False),
                   st.sampled_from([0, 1e-6, 10**12, float("nan"), float("inf")]))


def _spec() -> st.SearchStrategy:
    """Well-formed specs (choices, ranges, layouts, conditionals) with plausible or junk values, and junk."""
    value = st.one_of(st.integers(-2, 16), st.sampled_from(["none", "topk", "powersgd", "dp1-tp1-pp2", "dp2-tp1-pp1",
                                                            "dp9", "x", True, None]), st.floats(0, 1))
    when = st.dictionaries(st.sampled_from(["comm.compressor", "batch.micro", "parallel.layout", "x"]),
                           st.lists(value, max_size=3) | JUNK, max_size=1)
    choices = st.fixed_dictionaries({"choices": st.lists(value, max_size=4) | JUNK}, optional={"when": when})
    ranged = st.fixed_dictionaries({"low": NUMBER | JUNK, "high": NUMBER | JUNK},
                                   optional={"log": st.booleans() | JUNK, "step": NUMBER | JUNK, "when": when})
    layout = st.fixed_dictionaries({"layouts": st.just(["dp", "tp", "pp"])}, optional={"when": when})
    anything = st.fixed_dictionaries({}, optional={k: JUNK for k in ("choices", "low", "high", "log", "step",
                                                                     "layouts", "when", "bogus")})
    kinds = [choices, choices, choices, ranged, ranged, ranged, layout, anything, JUNK]
    return st.integers(0, len(kinds) - 1).flatmap(lambda i: kinds[i])


TUNED_KEYS = ["batch.micro", "batch.accum", "parallel.layout", "train.lr", "comm.compressor", "comm.density",
              "model.layers", "ddp.bucket_cap_mb", "parallel.dp", "batch.global"]


def space_dicts() -> st.SearchStrategy:
    """Random search spaces: known and unknown keys, junk specs, absurd world sizes, junk fixed."""
    key = st.one_of(st.sampled_from(TUNED_KEYS), st.sampled_from(TUNED_KEYS), st.sampled_from(SPACE_KEYS),
                    st.text(max_size=10))
    # params: {} is refused by rule; well-formed choices keep enough spaces building to sample from
    value = st.one_of(st.integers(1, 16), st.sampled_from(["none", "topk", "powersgd", "dp1-tp1-pp2", "x"]))
    plain = st.dictionaries(st.sampled_from(TUNED_KEYS), st.fixed_dictionaries(
        {"choices": st.lists(value, min_size=1, max_size=3)}), min_size=1, max_size=3)
    params = st.one_of(st.dictionaries(key, _spec(), min_size=1, max_size=4), plain)
    fixed = st.dictionaries(st.sampled_from(CONFIG_KEYS) | st.text(max_size=6),
                            st.one_of(st.integers(-2, 16), JUNK), max_size=2)
    world = _often(st.integers(1, 8), 4).flatmap(lambda w: st.just(w) if isinstance(w, int) and not
                                                 isinstance(w, bool) and w > 0 else st.one_of(HUGE, st.integers(-2, 0)))
    space = st.fixed_dictionaries({"params": _often(params)},
                                  optional={"fixed": _often(fixed), "world_size": _often(world)})
    return _often(st.builds(lambda d, junk, add: {**d, "junk": junk} if add else d, space, JUNK,
                            st.integers(0, 19).map(lambda n: n == 19)))


def _often(good: st.SearchStrategy, one_in: int = 10) -> st.SearchStrategy:
    """`good`, and junk once in `one_in` draws (st.one_of does not weight its branches)."""
    # hypothesis draws small integers most often, so the rare branch is the largest number
    return st.integers(0, one_in - 1).flatmap(lambda n: JUNK if n == one_in - 1 else good)


# ---------------------------------------------------------------- properties


def test_random_configs_validate_or_name_field_value_and_rule():
    counts: Counter[str] = Counter()

    @settings(PROPERTY, max_examples=CONFIG_EXAMPLES)
    @given(config_dicts())
    def prop(data: dict) -> None:
        counts["tried"] += 1
        try:
            cfg = validate(from_dict(data))
        except Exception as exc:  # noqa: BLE001 - the property: nothing but ConfigError
            errors = assert_named(exc)
            counts["rejected"] += 1
            counts["errors"] += len(errors)
            return
        assert_sane(cfg)
        counts["valid"] += 1

    prop()
    print(f"\nrandom configs: {dict(counts)}")
    assert counts["tried"] >= CONFIG_EXAMPLES
    # the generator must really reach both outcomes, else the property says little
    assert counts["valid"] >= CONFIG_EXAMPLES // 50 and counts["rejected"] >= CONFIG_EXAMPLES // 2


def test_random_set_overrides_validate_or_name_the_rule():
    counts: Counter[str] = Counter()
    key = st.sampled_from(CONFIG_KEYS) | st.text(max_size=12)
    raw = st.one_of(st.sampled_from(["4", "-1", "0", "1e400", ".nan", ".inf", "[1, 2", "{a: 1}", "true",
                                     "", "'x'", "1e309", "99999999999999999999"]), st.text(max_size=10))
    item = st.builds(lambda k, v, sep: f"{k}{sep}{v}", key, raw, st.sampled_from(["=", "=", "=", " ", "=="]))

    @settings(PROPERTY, max_examples=OVERRIDE_EXAMPLES)
    @given(st.lists(item, max_size=4))
    def prop(overrides: list[str]) -> None:
        counts["tried"] += 1
        try:
            cfg = load_config(None, overrides)
        except Exception as exc:  # noqa: BLE001
            assert_named(exc)
            counts["rejected"] += 1
            return
        assert_sane(cfg)
        counts["valid"] += 1

    prop()
    print(f"\nrandom --set lists: {dict(counts)}")
    assert counts["tried"] >= OVERRIDE_EXAMPLES and counts["valid"] and counts["rejected"]


def test_random_yaml_text_validates_or_names_the_rule(tmp_path):
    counts: Counter[str] = Counter()
    path = tmp_path / "cfg.yaml"
    fragments = st.sampled_from(["model:", "  layers: 2", "  layers: -3", "parallel: {dp: 1000000}", "batch:",
                                 "  global: 8", "- a", "{", "]", "train: [1, 2]", ":", "\t", "name: x",
                                 "lr: 1e-3", "? [a]: 1", "!!python/object:os.system {}", "&a [*a]",
                                 "model: {layers: .nan}", "%YAML 9.9", "---", "...", "'unterminated",
                                 "train: {steps: 3}"])  # an empty file is refused now: keep valid ones drawn
    text = st.one_of(st.lists(fragments, max_size=6).map("\n".join), st.text(max_size=40))

    @settings(PROPERTY, max_examples=YAML_EXAMPLES)
    @given(text)
    def prop(body: str) -> None:
        counts["tried"] += 1
        path.write_bytes(body.encode("utf-8", errors="replace"))
        try:
            cfg = load_config(path)
        except Exception as exc:  # noqa: BLE001
            assert_named(exc)
            counts["rejected"] += 1
            return
        assert_sane(cfg)
        counts["valid"] += 1

    prop()
    print(f"\nrandom YAML files: {dict(counts)}")
    assert counts["tried"] >= YAML_EXAMPLES and counts["rejected"] and counts["valid"]


BASE = load_config(None, ["model.layers=2", "model.d_model=32", "model.heads=4", "batch.global=8",
                          "batch.micro=2", "parallel.dp=2"])


def test_random_search_spaces_build_and_sample_or_name_the_rule():
    """Every space either fails to build with a ConfigError, or every trial sampled from it yields a
    valid config or a ConfigError (which the objective turns into a PRUNED trial)."""
    counts: Counter[str] = Counter()
    optuna.logging.set_verbosity(optuna.logging.ERROR)

    @settings(PROPERTY, max_examples=SPACE_EXAMPLES)
    @given(space_dicts(), st.integers(0, 2**16))
    def prop(data: Any, seed: int) -> None:
        counts["tried"] += 1
        try:
            space = SearchSpace.from_dict(data)
        except Exception as exc:  # noqa: BLE001
            assert_named(exc)
            counts["rejected"] += 1
            return
        counts["built"] += 1
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
        for _ in range(2):
            trial = study.ask()
            try:
                replace(BASE, space.to_overrides(space.suggest(trial), BASE))
                counts["trial_valid"] += 1
            except Exception as exc:  # noqa: BLE001
                assert_named(exc)
                counts["trial_invalid"] += 1
            study.tell(trial, 1.0)

    prop()
    print(f"\nrandom search spaces: {dict(counts)}")
    assert counts["tried"] >= SPACE_EXAMPLES
    assert counts["built"] >= SPACE_EXAMPLES // 20 and counts["rejected"] >= SPACE_EXAMPLES // 4
    assert counts["trial_valid"] and counts["trial_invalid"]


# ---------------------------------------------------------------- named bad inputs


@pytest.mark.parametrize("text,pattern", [
    ("model: {layers: 2\n", r"^config='.*cfg.yaml': is not valid YAML: "),
    ("model:\n  layers: 2\n layers: 3\n", r"is not valid YAML"),
    ("- 1\n- 2\n", r"^config='.*': must hold a mapping at the top level$"),
    ("!!python/object/apply:os.system ['echo pwned']\n", r"is not valid YAML: could not determine a constructor"),
    ("model: 3\n", r"^model=3: must be a mapping of keys to values$"),
])
def test_malformed_yaml_is_named(tmp_path, text, pattern):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=pattern) as info:
        load_config(path)
    assert_named(info.value)


@pytest.mark.parametrize("data,pattern", [
    ({"model": {"layers": "two"}}, r"^model.layers='two': must be an integer$"),
    ({"model": {"layers": 2.5}}, r"^model.layers=2.5: must be an integer$"),
    ({"train": {"lr": "fast"}}, r"^train.lr='fast': must be a number$"),
    ({"parallel": {"sequence_parallel": "yes"}}, r"^parallel.sequence_parallel='yes': must be true or false$"),
    ({"parallel": {"layer_split": [1, "a"]}}, r"^parallel.layer_split\[1\]='a': must be an integer$"),
    ({"batch": {"micro": None}}, r"^batch.micro=None: must be an integer$"),
    ({"train": {"steps": True}}, r"^train.steps=True: must be an integer$"),
])
def test_wrong_types_are_named(data, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        validate(from_dict(data))
    assert_named(info.value)


@pytest.mark.parametrize("overrides,pattern", [
    (["batch.micro=-4"], r"^batch.micro=-4: must be > 0$"),
    (["model.d_model=-64"], r"model.d_model=-64: must be > 0"),
    (["train.steps=0"], r"^train.steps=0: must be > 0$"),
    (["train.lr=.nan"], r"^train.lr=nan: must be a finite number$"),
    (["train.timeout_s=.inf"], r"^train.timeout_s=inf: must be a finite number$"),
    (["train.timeout_s=1.0e+12"], r"^train.timeout_s=1000000000000.0: must be <= 31536000 \(one year\)$"),
])
def test_negative_zero_and_non_finite_sizes_are_named(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        load_config(None, overrides)
    assert_named(info.value)


def test_unknown_keys_are_named_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"^batch.mikro='…': unknown key; did you mean 'micro'\?$"):
        load_config(None, ["batch.mikro=4"])
    with pytest.raises(ConfigError, match=r"^zzz='…': unknown key; known keys: backend, batch, "):
        from_dict({"zzz": 1})
    with pytest.raises(ConfigError, match=r"^--set='batch.micro4': must look like key.sub=value$"):
        apply_overrides({}, ["batch.micro4"])


@pytest.mark.parametrize("degrees", [(10**6, 1, 1), (256, 256, 2), (2**31, 2**31, 2**31), (10**300, 1, 1)])
def test_absurd_world_sizes_are_named(degrees):
    dp, tp, pp = degrees
    world = dp * tp * pp
    with pytest.raises(ConfigError) as info:
        validate(from_dict({"parallel": {"dp": dp, "tp": tp, "pp": pp},
                            "model": {"heads": 1, "layers": 1, "d_model": 8}}))
    fields = {e.field: e for e in assert_named(info.value)}
    assert fields["parallel"].value == f"dp*tp*pp={dp}*{tp}*{pp}={world}"
    assert fields["parallel"].rule == f"world size must be <= {MAX_WORLD_SIZE}"


def test_absurd_world_size_in_a_space_is_refused_at_once():
    with pytest.raises(ConfigError, match=rf"^space.world_size=1000000: must be a positive integer <= {MAX_WORLD_SIZE}"):
        SearchSpace.from_dict({"world_size": 10**6, "params": {"parallel.layout": {"layouts": ["dp", "tp", "pp"]}}})
    space = SearchSpace.from_dict({"world_size": MAX_WORLD_SIZE,
                                   "params": {"parallel.layout": {"layouts": ["dp", "tp", "pp"]}}})
    # 65536 = 2^16 has C(18, 2) = 153 ordered factorisations into dp*tp*pp
    assert len(space.params[0].choices) == 153


@pytest.mark.parametrize("data,pattern", [
    ({"params": ["batch.micro"]}, r"^space.params=\['batch.micro'\]: must be a mapping of config keys to specs$"),
    ({"params": {"train.lr": {"low": float("nan"), "high": 1.0}}}, r"^params.train.lr.low=nan: must be a finite"),
    ({"params": {"train.lr": {"low": 1e-4, "high": 1.0, "step": -1}}}, r"^params.train.lr.step=-1: must be > 0"),
    ({"params": {"batch.micro": {"low": 1, "high": 8, "log": True, "step": 2}}},
     r"^params.batch.micro.step=2: cannot be combined with log: true"),
    ({"params": {"parallel.layout": {"choices": ["dp2tp1"]}}},
     r"^parallel.layout='dp2tp1': must look like 'dp2-tp1-pp1'"),
])
def test_bad_space_entries_are_named(data, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        SearchSpace.from_dict(data)
    assert_named(info.value)


@pytest.mark.parametrize("params,pattern", [
    ({"batch.accum": {"choices": [0]}}, r"^batch.accum=0: needs positive integers batch.global=8"),
    ({"batch.accum": {"choices": ["x"]}}, r"^batch.accum='x': needs positive integers"),
    ({"batch.accum": {"choices": [2]}, "parallel.dp": {"choices": ["a"]}}, r"parallel.dp='a' and batch.accum"),
    ({"train.lr": {"low": 0, "high": 1e308, "step": 1e-300}}, r"^params.train.lr='0..1e\+308 step 1e-300': "
                                                               r"cannot be sampled: "),
])
def test_bad_samples_are_config_errors_so_the_trial_is_pruned(params, pattern):
    space = SearchSpace.from_dict({"params": params})
    trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)).ask()
    with pytest.raises(ConfigError, match=pattern) as info:
        replace(BASE, space.to_overrides(space.suggest(trial), BASE))
    assert_named(info.value)


def test_a_space_with_no_params_is_refused():
    """`params: {}` ran the base config N times."""
    for data in ({"params": {}}, {"fixed": {"train.steps": 2}}):
        with pytest.raises(ConfigError, match=r"^space.params=\{\}: must name at least one knob") as info:
            SearchSpace.from_dict(data)
        assert_named(info.value)


@pytest.mark.parametrize("params,pattern", [
    # a typo in choices: named with the param, the bad choice and the allowed values
    ({"comm.compressor": {"choices": ["none", "topkk"]}},
     r"^params.comm.compressor.choices\[1\]='topkk': is not a valid comm.compressor: must be one of none, fp16, "
     r"bf16, int8, topk, randk, powersgd \(choices were none, topkk\)$"),
    ({"batch.micro": {"choices": [2, "four"]}}, r"^params.batch.micro.choices\[1\]='four': .*must be an integer"),
    ({"comm.density": {"low": 0.0, "high": 0.5}}, r"^params.comm.density.low=0.0: .*must be in \(0, 1\]"),
    # every point invalid on the base: refused with an example and its reason
    ({"parallel.layout": {"choices": ["dp1-tp1-pp3", "dp3-tp1-pp1"]}},
     r"^space=\{'parallel.layout': 'dp1-tp1-pp3'\}: no point of the space gives a valid config .*\(2 tried\); "
     r"this one breaks model.layers=2: must be divisible by pp\*virtual"),
    ({"batch.micro": {"choices": [3, 5]}}, r"^space=.*this one breaks batch.global=8: is not divisible by dp\*micro"),
])
def test_spaces_that_cannot_work_are_refused_before_the_study(params, pattern):
    space = SearchSpace.from_dict({"params": params})
    with pytest.raises(ConfigError, match=pattern) as info:
        space.check_against(BASE)
    assert_named(info.value)


def test_a_choice_invalid_only_with_other_settings_is_kept():
    """topk needs tp=1: with the base's tp=2 that choice alone fails, but it is no typo, and other
    points of the space (tp=1) work; and a large space is probed by sampling, quickly."""
    base = load_config(None, ["model.layers=2", "model.d_model=32", "model.heads=4", "parallel.tp=2"])
    space = SearchSpace.from_dict({"params": {"parallel.tp": {"choices": [1, 2]},
                                              "comm.compressor": {"choices": ["none", "topk"]}}})
    space.check_against(base)
    big = SearchSpace.from_dict({"params": {f"train.{k}": {"low": 0.1, "high": 0.5} for k in
                                            ("lr", "weight_decay", "grad_clip", "min_lr_ratio", "beta1", "beta2")}})
    big.check_against(BASE)  # 3^6 = 729 points > the 512 probe limit: sampled


def test_huge_integer_for_a_float_key_is_named():
    """A 400-digit number overflows float(): it must be a ConfigError, not an OverflowError."""
    with pytest.raises(ConfigError, match=r"^train.lr=1000000\d+: must be a number"):
        from_dict({"train": {"lr": 10**400}})


def test_number_beyond_the_int_digit_limit_in_yaml_is_named(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("train: {lr: 1" + "0" * 5000 + "}\n")
    with pytest.raises(ConfigError, match=r"^config='.*cfg.yaml': "):
        load_yaml(path)


# ---------------------------------------------------------------- the CLI


def _cli_cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model: {layers: 2\n")
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({"model": {"layers": 2}}))
    bad_space = tmp_path / "space.yaml"
    bad_space.write_text(yaml.safe_dump({"params": {"batch.mikro": {"choices": [1, 2]}}}))
    storage = f"sqlite:///{tmp_path}/studies.db"
    return {
        "malformed yaml": (["run", str(bad_yaml)], "is not valid YAML"),
        "missing file": (["run", str(tmp_path / "nope.yaml")], "file not found"),
        "--set typo": (["run", str(good), "--set", "batch.mikro=4"], "unknown key; did you mean 'micro'?"),
        "--set no '='": (["run", "--set", "batch.micro4"], "must look like key.sub=value"),
        "absurd world": (["run", "--set", "parallel.dp=1000000"], "world size must be <= 65536"),
        "bad space": (["tune", str(bad_space), "--trials", "1", "--storage", storage], "unknown key"),
        "missing study": (["export", "no-such-study", "--storage", storage], "no such study"),
        "missing run": (["show", "no-such-run"], "no such run"),
    }


def test_cli_user_errors_exit_nonzero_without_traceback(tmp_path):
    env = {**os.environ, "WORKBENCH_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1", "COLUMNS": "400"}
    procs = {name: (subprocess.Popen([sys.executable, "-m", "workbench.cli", *args], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), expected)
             for name, (args, expected) in _cli_cases(tmp_path).items()}
    for name, (proc, expected) in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode not in (0, None), (name, out, err)
        assert expected in " ".join(err.split()), (name, err)
        assert "Traceback" not in err and "Traceback" not in out, (name, err)
    assert not (tmp_path / "home" / "runs").exists()  # no user error started a run


def _issue15_cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """Bad inputs that used to crash, hang or be silently accepted (issue 15), with the line expected."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing here\n")
    spaces = {"noparams": {"params": {}}, "typo": {"params": {"comm.compressor": {"choices": ["none", "topkk"]}}},
              "nolayout": {"world_size": 3, "params": {"parallel.layout": {"layouts": ["dp", "tp", "pp"]}},
                           "fixed": {"model.layers": 2}},
              "ok": {"params": {"batch.micro": {"choices": [2, 4]}}}}
    for name, data in spaces.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(data))
    ok = str(tmp_path / "ok.yaml")
    tune = ["tune", ok, "--storage", f"sqlite:///{tmp_path}/studies.db"]
    sim = ["simulate", "--model", "22b", "--search"]
    return {
        "huge model": (["run", "--set", "model.d_model=1000000000"],
                       "model.d_model=1000000000: the run needs an estimated"),
        "commbench --max-mb -1": (["commbench", "--max-mb", "-1"], "--max-mb=-1.0: must be >= 1/1024 (1 KB"),
        "commbench --iters 0": (["commbench", "--iters", "0"], "--iters=0: must be >= 1"),
        "empty yaml": (["run", str(empty)], "is empty; give at least one key"),
        "params {}": (["tune", str(tmp_path / "noparams.yaml")], "space.params={}: must name at least one knob"),
        "typo in choices": (["tune", str(tmp_path / "typo.yaml")],
                            "params.comm.compressor.choices[1]='topkk': is not a valid comm.compressor: must be one of"),
        "no valid layout": (["tune", str(tmp_path / "nolayout.yaml")], "no point of the space gives a valid config"),
        "simulate --gpus 0": ([*sim, "--gpus", "0"], "--gpus=0: must be >= 1"),
        "simulate --global-batch 0": ([*sim, "--gpus", "8", "--global-batch", "0"], "--global-batch=0: must be >= 1"),
        "simulate --top 0": ([*sim, "--gpus", "8", "--top", "0"], "--top=0: must be >= 1"),
        "simulate --config dp=0": (["simulate", "--gpus", "8", "--model", "22b", "--config", "tp=1,dp=0"],
                                   "--config: dp=0 must be >= 1"),
        "simulate --model layers=0": (["simulate", "--gpus", "8", "--model",
                                       "layers=0,hidden=64,heads=4,seq=64,vocab=256", "--search"],
                                      "--model: layers=0 must be >= 1"),
        "simulate --config tp=x": (["simulate", "--gpus", "8", "--model", "22b", "--config", "tp=x"],
                                   "--config: tp='x' must be int"),
        "run --timeout -1": (["run", "--timeout", "-1"], "--timeout=-1.0: must be > 0"),
        "run --nnodes 0": (["run", "--nnodes", "0"], "--nnodes=0: must be >= 1"),
        "tune --timeout -1": ([*tune, "--timeout", "-1"], "--timeout=-1.0: must be > 0"),
        "tune --trials 0": ([*tune, "--trials", "0"], "--trials=0: must be >= 1"),
        "tune --total-trials 0": ([*tune, "--total-trials", "0"], "--total-trials=0: must be >= 1"),
        "tune both counts": ([*tune, "--trials", "2", "--total-trials", "3"], "give one of them"),
        "tune --jobs 0": ([*tune, "--jobs", "0"], "--jobs=0: must be >= 1"),
        "tune --trial-timeout nan": ([*tune, "--trial-timeout", "nan"], "--trial-timeout=nan: must be a finite number"),
        "tune --segment-steps 0": ([*tune, "--segment-steps", "0"], "--segment-steps=0: must be >= 1"),
        "tune --warm-start -1": ([*tune, "--warm-start", "-1"], "--warm-start=-1: must be >= 0"),
        "tune --remeasure -1": ([*tune, "--remeasure", "-1"], "--remeasure=-1: must be >= 0"),
        "tune --warmup -1": ([*tune, "--warmup", "-1"], "--warmup=-1: must be >= 0"),
        "tune --memory-limit-gb 0": ([*tune, "--memory-limit-gb", "0"], "--memory-limit-gb=0.0: must be > 0"),
        "runs --limit 0": (["runs", "--limit", "0"], "--limit=0: must be >= 1"),
        "calibrate --world 0": (["calibrate", "--world", "0"], "--world=0: must be >= 1"),
        "app --port 0": (["app", "--port", "0"], "--port=0: must be >= 1"),
    }


SUBPROCESS_CASES = ("huge model", "tune --trials 0", "simulate --gpus 0")  # the rest in-process (imports once)


def _cli_in_process(args: list[str], monkeypatch: pytest.MonkeyPatch,
                    capsys: pytest.CaptureFixture) -> subprocess.CompletedProcess:
    """`workbench.cli.run_command()` (all `main()` does but end the process) with `args` in this interpreter: exit
    code, stdout, stderr."""
    from workbench import cli

    monkeypatch.setattr(sys, "argv", ["workbench", *args])
    code = cli.run_command()
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


@pytest.mark.slow
def test_issue15_bad_inputs_get_one_line_and_exit_2_before_anything_starts(tmp_path, monkeypatch, capsys):
    """Each: exit 2, one line `error: field=value: rule` at 80 columns, no traceback, no run, no study.
    Three cases run as real processes; the others call the CLI's `run_command()` here (29 interpreters
    importing torch took 80 s of the suite)."""
    from concurrent.futures import ThreadPoolExecutor

    home = tmp_path / "home"
    env = {**os.environ, "WORKBENCH_HOME": str(home), "OMP_NUM_THREADS": "1", "COLUMNS": "80"}

    def one(args: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "workbench.cli", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)

    cases = _issue15_cases(tmp_path)
    with ThreadPoolExecutor(max_workers=3) as pool:
        outs = dict(zip(SUBPROCESS_CASES, pool.map(one, [cases[name][0] for name in SUBPROCESS_CASES])))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for name, (args, _) in cases.items():
        if name not in outs:
            outs[name] = _cli_in_process(args, monkeypatch, capsys)
    for name, (_, expected) in cases.items():
        out = outs[name]
        assert out.returncode == 2, (name, out.returncode, out.stderr[-1500:])
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, out.stderr)
        assert expected in lines[0], (name, lines[0])
        assert "Traceback" not in out.stderr + out.stdout
    assert not (home / "runs").exists()  # no run was registered, so no rank started
    assert not (tmp_path / "studies.db").exists() or optuna.get_all_study_names(f"sqlite:///{tmp_path}/studies.db") == []


# ---------------------------------------------------------------- security defaults


def _sources() -> list[Path]:
    extra = [ROOT / "app.py"] if (ROOT / "app.py").is_file() else []  # the Streamlit entry point
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")) + extra


def _call_name(node: ast.Call) -> str:
    func = node.func
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


def _function_at(tree: ast.AST, target: ast.AST) -> str:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(n is target for n in ast.walk(node)):
            return node.name
    return "<module>"


def test_no_eval_exec_pickle_or_unsafe_yaml_in_the_source():
    offenders, yaml_loads, torch_loads, dynamic_imports = [], 0, [], []
    for path in _sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name, where = _call_name(node), f"{path.relative_to(ROOT)}:{node.lineno}"
            kwargs = {k.arg: k.value for k in node.keywords}
            if name in ("eval", "exec", "compile", "pickle.loads", "pickle.load", "marshal.loads",
                        "yaml.unsafe_load", "yaml.full_load", "dill.loads"):
                offenders.append(f"{where} {name}()")
            if name in ("__import__", "importlib.import_module") and not (
                    node.args and isinstance(node.args[0], ast.Constant)):
                dynamic_imports.append(f"{path.relative_to(ROOT)}:{_function_at(tree, node)}")
            if name in ("yaml.load", "yaml.load_all"):
                loader = kwargs.get("Loader")
                if not (isinstance(loader, ast.Attribute) and loader.attr in ("SafeLoader", "CSafeLoader")):
                    offenders.append(f"{where} {name}() without SafeLoader")
            if name in ("yaml.safe_load", "yaml.safe_load_all"):
                yaml_loads += 1
            if name == "torch.load":
                torch_loads.append(where)
                wo = kwargs.get("weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    offenders.append(f"{where} torch.load() without weights_only=True")
    assert offenders == []
    # the one import of a name that comes from user text: model.entry, through engine.data.corpus.load_entry;
    # engine/torch_compat.py:_private imports torch's private modules, each named by a literal below
    assert dynamic_imports == ["engine/data/corpus.py:load_entry", "engine/torch_compat.py:_private"]
    compat = ast.parse((ROOT / "engine" / "torch_compat.py").read_text())
    literals = {t.id for node in compat.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                for t in node.targets if isinstance(t, ast.Name)}
    private_calls = [node for node in ast.walk(compat)
                     if isinstance(node, ast.Call) and _call_name(node) == "_private"]
    assert private_calls and all(isinstance(c.args[0], ast.Constant) and c.args[0].value.startswith("torch")
                                 or isinstance(c.args[0], ast.Name) and c.args[0].id in literals
                                 for c in private_calls)
    # the scan really saw the loaders it checks; checkpoints no longer call torch.load (DCP reads
    # tensors with weights_only=True, its metadata through engine/train/checkpoint.py's allow-list)
    assert yaml_loads >= 2


def test_dashboard_binds_localhost_by_default():
    from typer.main import get_command

    from workbench import cli

    command = get_command(cli.app).commands["app"]  # defined in cli.py itself, no _register() needed
    host = next(p for p in command.params if p.name == "host")
    assert host.default == "127.0.0.1"
    config = ROOT / ".streamlit" / "config.toml"
    if config.is_file():
        text = config.read_text()
        assert "0.0.0.0" not in text
    for path in _sources():  # no literal "0.0.0.0" (every interface) anywhere: not as a default, not as a value
        tree = ast.parse(path.read_text())
        assert not [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value == "0.0.0.0"], path


_IMPORT_PROBE = """
import sys, json
from engine.config.schema import load_config
report = {}
for overrides in ([], ["model.entry=usermodel_probe_pkg.model:build", "data.source=synthetic"]):
    before = set(sys.modules)
    cfg = load_config(None, overrides)
    import engine.data.corpus, engine.model.gpt, engine.train.trainer, engine.launch.worker, engine.launch.local, tuning.objective
    report[str(cfg.model.entry)] = sorted(set(sys.modules) - before)
print(json.dumps(report))
"""


def test_user_entry_point_is_imported_only_when_named(tmp_path):
    """Validating a config (with or without model.entry) and importing the engine imports no user
    module; `load_entry` imports exactly the named one, and only when called."""
    pkg = tmp_path / "usermodel_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text("raise SystemExit('imported!')\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    out = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report) == {"None", "usermodel_probe_pkg.model:build"}
    assert len(report["None"]) > 10  # the probe really imported the engine
    assert [m for new in report.values() for m in new if m.startswith("usermodel_probe_pkg")] == []
    from engine.data.corpus import load_entry

    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(SystemExit, match="imported!"):  # named explicitly: imported, and only then
            load_entry("usermodel_probe_pkg.model:build")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("usermodel_probe_pkg", None)


def test_a_conditional_value_is_judged_where_it_applies():
    """virtual=2 is wrong on its own (the default schedule takes no virtual stages), but every point
    where it applies (layout pp2) has schedule interleaved: the space is accepted. A value that no
    point where it applies can take is still refused."""
    when = {"parallel.layout": ["dp1-tp1-pp2"]}
    data = {"world_size": 2, "params": {
        "parallel.layout": {"choices": ["dp2-tp1-pp1", "dp1-tp1-pp2"]},
        "parallel.schedule": {"choices": ["interleaved"], "when": when},
        "parallel.virtual": {"choices": [2], "when": when}}}
    base = load_config(None, ["model.layers=4", "model.d_model=32", "model.heads=4", "batch.global=8",
                              "batch.micro=2", "parallel.dp=2"])
    SearchSpace.from_dict(data).check_against(base)
    data["params"]["parallel.schedule"]["choices"] = ["1f1b"]
    with pytest.raises(ConfigError, match=r"^params.parallel.virtual.choices\[0\]=2: is not a valid parallel.virtual"):
        SearchSpace.from_dict(data).check_against(base)
