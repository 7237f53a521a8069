"""Search spaces: which knobs to tune, read from YAML, sampled define-by-run through Optuna.

```yaml
world_size: 4                      # dp*tp*pp of every trial (for parallel.layout)
params:
  parallel.layout: {layouts: [dp, tp, pp]}   # every (dp, tp, pp) whose product is world_size
  batch.micro: {choices: [1, 2, 4]}
  batch.accum: {choices: [1, 2, 4]}          # sets batch.micro = global / (dp * accum)
  comm.compressor: {choices: [none, topk, powersgd]}
  comm.density: {low: 0.001, high: 0.1, log: true, when: {comm.compressor: [topk, randk]}}
  comm.rank: {low: 1, high: 8, when: {comm.compressor: [powersgd]}}
fixed: {train.steps: 8}            # applied to every trial
base: tiny.yaml                    # optional: the run config it modifies, next to this file (--base wins)
```
Pipeline schedules are searchable like any key (`SCHEDULE_PARAMS` below is a ready-made set):
`parallel.schedule`, `parallel.virtual` when the schedule takes virtual stages, and
`parallel.skip_ratio` when it is SkipPipe.
A param is `choices: [...]`, or `low/high` (int when both are ints, `log`, `step`), or
`layouts`. `when` makes it conditional on earlier params. Unknown keys are errors that name
the param, like config errors.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.config.schema import LIVE_KNOBS, RunConfig, apply_overrides, from_dict, replace
from engine.errors import ConfigError
from engine.config.validate import MAX_WORLD_SIZE, divisors as _divisors

SCHEDULE_PARAMS: dict[str, Any] = {  # schedule, virtual stages and skip ratio (engine.config.validate names)
    "parallel.schedule": {"choices": ["gpipe", "1f1b", "interleaved", "looped_bfs", "modular", "zero_bubble",
                                      "zbv", "dualpipev", "skip"]},
    "parallel.virtual": {"choices": [2, 4], "when": {"parallel.schedule": ["interleaved", "looped_bfs", "zero_bubble"]}},
    "parallel.skip_ratio": {"choices": [0.33, 0.5], "when": {"parallel.schedule": ["skip"]}},
}
_SPEC_KEYS = {"choices", "low", "high", "log", "step", "layouts", "when"}
LIVE_KEYS = (*LIVE_KNOBS, "batch.accum")  # batch.accum sets batch.micro


def layouts(world_size: int, *, cp: bool = False) -> list[str]:
    """Every dp*tp*pp factorisation of world_size, as 'dp2-tp1-pp2' strings; with `cp`, every
    dp*tp*pp*cp one as 'dp1-tp1-pp1-cp4' (layouts: [dp, tp, pp, cp])."""
    out = []
    for dp in _divisors(world_size):  # divisors, not every (dp, tp) pair: O(d(n)^2), not O(n^2)
        for tp in _divisors(world_size // dp):
            rest = world_size // (dp * tp)
            if not cp:
                out.append(f"dp{dp}-tp{tp}-pp{rest}")
                continue
            for pp in _divisors(rest):
                out.append(f"dp{dp}-tp{tp}-pp{pp}-cp{rest // pp}")
    return out


def parse_layout(name: str) -> dict[str, int]:
    match = re.fullmatch(r"dp(\d+)-tp(\d+)-pp(\d+)(?:-cp(\d+))?", str(name))
    if not match:
        raise ConfigError("parallel.layout", name, "must look like 'dp2-tp1-pp1' or 'dp1-tp1-pp1-cp4' "
                          "(or use layouts: [dp, tp, pp] / [dp, tp, pp, cp])")
    dp, tp, pp = (int(g) for g in match.groups()[:3])
    out = {"parallel.dp": dp, "parallel.tp": tp, "parallel.pp": pp}
    if match.group(4) is not None:
        out["parallel.cp"] = int(match.group(4))
    return out


@dataclass(slots=True)
class Param:
    key: str
    choices: list[Any] | None = None
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    when: dict[str, list[Any]] = field(default_factory=dict)

    def active(self, chosen: dict[str, Any]) -> bool:
        return all(chosen.get(k) in v for k, v in self.when.items())

    def suggest(self, trial) -> Any:
        if self.choices is not None:
            return trial.suggest_categorical(self.key, self.choices)
        if isinstance(self.low, int) and isinstance(self.high, int) and not isinstance(self.step, float):
            return trial.suggest_int(self.key, self.low, self.high, log=self.log, step=int(self.step or 1))
        return trial.suggest_float(self.key, float(self.low), float(self.high), log=self.log,
                                   step=None if self.log else self.step)

    def grid(self) -> list[Any]:
        if self.choices is not None:
            return list(self.choices)
        if isinstance(self.low, int) and isinstance(self.high, int):
            return list(range(self.low, self.high + 1, int(self.step or 1)))
        raise ConfigError(f"params.{self.key}", f"{self.low}..{self.high}", "a grid needs choices or an int range")


@dataclass(slots=True)
class SearchSpace:
    params: list[Param]
    fixed: dict[str, Any] = field(default_factory=dict)
    world_size: int | None = None
    raw: dict[str, Any] = field(default_factory=dict)
    base: str | None = None  # the run config the space modifies (`base:`, relative to the space file); --base wins

    @classmethod
    def from_yaml(cls, source: str | Path) -> SearchSpace:
        """From a YAML file path or YAML text."""
        if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source and Path(source).is_dir()):
            if Path(source).is_dir():
                raise ConfigError("space", str(source), "is a folder; give a search space YAML file in it, "
                                  "e.g. examples/space.yaml")
            if not Path(source).is_file():
                raise ConfigError("space", str(source), "file not found")
        text = Path(source).read_text() if isinstance(source, Path) or (
            isinstance(source, str) and "\n" not in source and Path(source).is_file()) else str(source)
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError("space", str(source)[:60], f"is not valid YAML: {exc}".replace("\n", " ")) from None
        space = cls.from_dict(data)
        if space.base is not None and isinstance(source, (str, Path)) and "\n" not in str(source):
            space.base = str(Path(source).parent / space.base)  # next to the space file, wherever tune runs
        return space

    @classmethod
    def from_dict(cls, data: Any) -> SearchSpace:
        if not isinstance(data, dict):
            raise ConfigError("space", data, "must be a mapping with 'params'")
        unknown = set(data) - {"params", "fixed", "world_size", "base"}
        if unknown:
            raise ConfigError(f"space.{sorted(unknown)[0]}", "…", "unknown key; known: params, fixed, world_size, base")
        base = data.get("base")
        if base is not None and not isinstance(base, str):
            raise ConfigError("space.base", base, "must be the path of a run config YAML (relative to the space file)")
        world = data.get("world_size")
        if world is not None and (not isinstance(world, int) or isinstance(world, bool) or not 1 <= world <= MAX_WORLD_SIZE):
            raise ConfigError("space.world_size", world, f"must be a positive integer <= {MAX_WORLD_SIZE}")
        raw_params = data.get("params") or {}
        if not isinstance(raw_params, dict):
            raise ConfigError("space.params", raw_params, "must be a mapping of config keys to specs")
        if not raw_params:  # every trial would run the same config
            raise ConfigError("space.params", raw_params, "must name at least one knob to tune, e.g. "
                              "{batch.micro: {choices: [1, 2, 4]}}")
        params = [_param(k, v, world) for k, v in raw_params.items()]
        fixed = data.get("fixed") or {}
        if not isinstance(fixed, dict):
            raise ConfigError("space.fixed", fixed, "must be a mapping of config keys to values")
        space = cls(params=params, fixed=dict(fixed), world_size=world, raw=data, base=base)
        space._check_keys()
        return space

    def _check_keys(self) -> None:
        """Every tuned or fixed key must be a config key (checked against the defaults)."""
        probe = {k: v for k, v in self.fixed.items()}
        for p in self.params:
            if p.key in ("parallel.layout", "batch.accum"):
                continue
            probe.setdefault(p.key, p.grid()[0] if p.choices else p.low)
        try:
            from_dict(apply_overrides({}, [f"{k}={_yaml(v)}" for k, v in probe.items()]))
        except ConfigError as exc:
            if "unknown key" in exc.rule or "must be" in exc.rule and "mapping" in exc.rule:
                raise ConfigError(f"space: {exc.field}", exc.value, exc.rule) from None

    def suggest(self, trial) -> dict[str, Any]:
        """Sample this trial's overrides (dotted config keys), conditionals included."""
        chosen: dict[str, Any] = {}
        for p in self.params:
            if p.active(chosen):
                try:
                    chosen[p.key] = p.suggest(trial)
                except ConfigError:
                    raise
                except (ValueError, TypeError, ArithmeticError) as exc:  # Optuna refused the range
                    raise ConfigError(f"params.{p.key}", p.choices if p.choices is not None else
                                      f"{p.low}..{p.high} step {p.step}", f"cannot be sampled: {exc}") from None
        return chosen

    def to_overrides(self, chosen: dict[str, Any], base: RunConfig) -> dict[str, Any]:
        """Turn sampled values (with pseudo-keys) into config overrides."""
        out = dict(self.fixed)
        for key, value in chosen.items():
            if key == "parallel.layout":
                out.update(parse_layout(value))
            elif key != "batch.accum":
                out[key] = value
        if "batch.accum" in chosen:
            dp = out.get("parallel.dp", base.parallel.dp)
            glob = out.get("batch.global", base.batch.global_)
            accum = chosen["batch.accum"]
            if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (dp, glob, accum)):
                raise ConfigError("batch.accum", accum, f"needs positive integers batch.global={glob!r}, "
                                  f"parallel.dp={dp!r} and batch.accum")
            if glob % (dp * accum):
                raise ConfigError("batch.accum", accum, f"batch.global={glob} is not divisible by dp*accum = {dp}*{accum}")
            out["batch.micro"] = glob // (dp * accum)
        return out

    def grid(self) -> list[dict[str, Any]]:
        """Every combination (conditionals respected), for exhaustive search."""
        combos: list[dict[str, Any]] = [{}]
        for p in self.params:
            nxt = []
            for c in combos:
                nxt += [{**c, p.key: v} for v in p.grid()] if p.active(c) else [c]
            combos = nxt
        return combos

    def narrow_layouts(self, base: RunConfig, limit: int = 64) -> list[str]:
        """Drop the parallel.layout choices that no probed point makes valid on `base` (e.g. tp=2 on a
        model with 3 key/value heads); returns one line per dropped layout, with the rule it breaks."""
        param = next((p for p in self.params if p.key == "parallel.layout" and p.choices), None)
        if param is None:
            return []
        dropped: dict[str, str] = {}
        for layout in param.choices:
            first: ConfigError | None = None
            for point in _probe_points(self.params, limit):
                try:
                    replace(base, self.to_overrides({**point, "parallel.layout": layout}, base))
                    break
                except ConfigError as exc:
                    first = first or getattr(exc, "errors", [exc])[0]
            else:
                dropped[layout] = str(first)
        kept = [c for c in param.choices if c not in dropped]
        if kept and dropped:
            param.choices = kept
            spec = {k: v for k, v in (self.raw.get("params", {}).get("parallel.layout") or {}).items()
                    if k != "layouts"}
            self.raw.setdefault("params", {})["parallel.layout"] = {**spec, "choices": kept}
        return [f"parallel.layout: {layout} left out of the space: {why}" for layout, why in dropped.items()] \
            if kept else []

    def check_against(self, base: RunConfig, limit: int = 512) -> None:
        """Refuse a space that cannot work on `base`, before any trial starts: a choice (or range end)
        that is invalid on its own, or a space none of whose points validates (up to `limit` tried)."""
        for p in self.params:
            if p.key in ("parallel.layout", "batch.accum"):
                continue
            values = p.choices if p.choices is not None else [p.low, p.high]
            for where, value in zip(_value_names(p), values):
                error = _own_error(base, self.fixed, p.key, value)
                if (error is not None and _own_error(RunConfig(), {}, p.key, value) is not None
                        and self._wrong_wherever_it_applies(base, p, value)):
                    allowed = "" if p.choices is None else f" (choices were {', '.join(map(str, p.choices))})"
                    raise ConfigError(where, value, f"is not a valid {p.key}: {error.rule}{allowed}")
        tried, first = 0, None
        for point in _probe_points(self.params, limit):
            tried += 1
            try:
                replace(base, self.to_overrides(point, base))
                return
            except ConfigError as exc:
                first = first or (point, exc)
        if first is not None:
            point, exc = first
            errors = getattr(exc, "errors", [exc])
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            error = ConfigError("space", point, f"no point of the space gives a valid config on the base config "
                                f"({tried} tried); this one breaks {errors[0]}{more}")
            error.breaks = errors[0]  # the rule broken, whose value the caller can trace to its origin
            raise error

    def _wrong_wherever_it_applies(self, base: RunConfig, p: Param, value: Any, limit: int = 64) -> bool:
        """True when `p.key=value` earns an error naming p.key at every probed point where p applies
        (its `when` holds): a conditional value is judged with the values it comes with."""
        if not p.when:
            return True
        for point in _probe_points(self.params, limit):
            if p.key not in point:
                continue
            try:
                overrides = self.to_overrides({**point, p.key: value}, base)
            except ConfigError:
                continue
            if _own_error(base, overrides, p.key, value) is None:
                return False
        return True

    def check_live(self, base: RunConfig, *, loss_aware: bool) -> None:
        """Refuse, before a live run starts, a knob it cannot change, one that cannot act in a run
        started as `base` (engine.train.live.inert_knobs), or an lr-like knob under a throughput-only
        objective (its effect is on the loss, not the speed)."""
        from engine.train.live import LR_LIKE, inert_knobs

        keys = [p.key for p in self.params]
        not_live = [k for k in keys if k not in LIVE_KEYS]
        if not_live:
            raise ConfigError("space.params", not_live, f"need a restart; live knobs are {', '.join(LIVE_KEYS)}")
        for key in keys:
            if key in LR_LIKE and not loss_aware:
                raise ConfigError(f"params.{key}", "…", "changes what the model learns, not its speed: "
                                  "tune it live only with objective throughput+val_loss")
        current = {k: _lookup(base.to_dict(), k) for k in keys}
        for key, why in inert_knobs(base, current).items():
            raise ConfigError(f"params.{key}", "…", f"cannot act in this run: {why}")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.raw, sort_keys=False)


def _lookup(data: dict[str, Any], key: str) -> Any:
    """The value of dotted `key` in a nested config dict (None when absent, e.g. batch.accum)."""
    for part in key.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def _value_names(p: Param) -> list[str]:
    if p.choices is not None:
        return [f"params.{p.key}.choices[{i}]" for i in range(len(p.choices))]
    return [f"params.{p.key}.low", f"params.{p.key}.high"]


def _own_error(base: RunConfig, fixed: dict[str, Any], key: str, value: Any) -> ConfigError | None:
    """The error `key=value` earns on `base` (with `fixed`) that names `key` itself, if any."""
    try:
        replace(base, {**fixed, key: value})
    except ConfigError as exc:
        return next((e for e in getattr(exc, "errors", [exc]) if e.field == key), None)
    return None


def _candidates(p: Param) -> list[Any]:
    if p.choices is not None:
        return list(p.choices)
    low, high = p.low, p.high
    if isinstance(low, int) and isinstance(high, int):
        return sorted({low, high, (low + high) // 2})
    mid = math.sqrt(low * high) if p.log else (low + high) / 2
    return [float(low), mid, float(high)]


def _probe_points(params: list[Param], limit: int) -> Iterator[dict[str, Any]]:
    """Points of the space (conditionals respected): all of them when few, else `limit` random ones."""
    import random

    options = [(p, _candidates(p)) for p in params]
    if math.prod(len(c) for _, c in options) <= limit:
        combos: list[dict[str, Any]] = [{}]
        for p, values in options:
            combos = [new for c in combos for new in ([{**c, p.key: v} for v in values] if p.active(c) else [c])]
        yield from combos
        return
    rng = random.Random(0)
    for _ in range(limit):
        point: dict[str, Any] = {}
        for p, values in options:
            if p.active(point):
                point[p.key] = rng.choice(values)
        yield point


def _yaml(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _param(key: str, spec: Any, world: int | None) -> Param:
    where = f"params.{key}"
    if not isinstance(spec, dict):
        raise ConfigError(where, spec, "must be a mapping like {choices: [...]} or {low: .., high: ..}")
    unknown = set(spec) - _SPEC_KEYS
    if unknown:
        raise ConfigError(f"{where}.{sorted(unknown)[0]}", "…", f"unknown key; known: {', '.join(sorted(_SPEC_KEYS))}")
    when = spec.get("when") or {}
    if not isinstance(when, dict) or not all(isinstance(v, list) for v in when.values()):
        raise ConfigError(f"{where}.when", when, "must map earlier params to lists of values")
    if "layouts" in spec:
        if world is None:
            raise ConfigError(where, spec, "layouts needs space.world_size")
        dims = spec["layouts"]
        if dims not in (["dp", "tp", "pp"], ["dp", "tp", "pp", "cp"]):
            raise ConfigError(f"{where}.layouts", dims, "must be [dp, tp, pp] or [dp, tp, pp, cp]")
        return Param(key, choices=layouts(world, cp="cp" in dims), when=when)
    if "choices" in spec:
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise ConfigError(f"{where}.choices", choices, "must be a non-empty list")
        if key == "parallel.layout":
            for choice in choices:
                parse_layout(choice)
        return Param(key, choices=choices, when=when)
    low, high, step = spec.get("low"), spec.get("high"), spec.get("step")
    for name, v in (("low", low), ("high", high)):
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ConfigError(f"{where}.{name}", v, "must be a number (or give choices)")
        if not _is_number(v):
            raise ConfigError(f"{where}.{name}", v, "must be a finite number")
    if low > high:
        raise ConfigError(f"{where}.low", low, f"must be <= high={high}")
    log = bool(spec.get("log", False))
    if log and low <= 0:
        raise ConfigError(f"{where}.low", low, "must be > 0 with log: true")
    if step is not None and (not _is_number(step) or step <= 0):
        raise ConfigError(f"{where}.step", step, "must be > 0 (or be left out)")
    if step is not None and log:  # Optuna samples a log range without a step
        raise ConfigError(f"{where}.step", step, "cannot be combined with log: true")
    return Param(key, low=low, high=high, log=log, step=step, when=when)


def _is_number(v: Any) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and math.isfinite(v))
