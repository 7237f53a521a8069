"""The checks of `model.hf` and `model.hf_weights` that need transformers, run by validate() before any
rank starts: the config as transformers' own config class validates it, and a safetensors folder against
the model that config builds, through transformers' own loader on the meta device (its key renames, tied
weights and ignore lists apply; no tensor is read). Results are cached per file and modification time,
since the tuner validates every draw."""
from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from engine.errors import ConfigError
from engine.model.shapes import read_hf_config

SHOWN_KEYS = 3  # tensor names quoted in a refusal; the rest are counted


def config_errors(spec: str | Mapping[str, Any]) -> Iterator[ConfigError]:
    """transformers' refusal of the config (e.g. a hidden size its heads do not divide), as one line."""
    label = spec if isinstance(spec, str) else dict(spec).get("model_type", "(inline)")
    problem = _config_problem(*_cache_key(spec)) if isinstance(spec, str) else _config_problem_of(dict(spec))
    if problem:
        yield ConfigError("model.hf", label, f"transformers refuses this config: {problem}")


def weight_errors(weights: str, spec: str | Mapping[str, Any]) -> Iterator[ConfigError]:
    """Tensors of `weights` that are missing, unexpected or of another shape than the model `spec` builds."""
    if isinstance(spec, Mapping):
        spec = _frozen(spec)
    report = _weight_report(*_cache_key(weights), spec)
    if report:
        yield ConfigError("model.hf_weights", weights, f"does not match model.hf: {report}")


def _cache_key(path: str) -> tuple[str, float]:
    p = Path(path)
    stamps = [f.stat().st_mtime for f in ([p] if p.is_file() else sorted(p.glob("*")) if p.is_dir() else [])]
    return path, max(stamps, default=0.0)


@functools.lru_cache(maxsize=64)
def _config_problem(path: str, _mtime: float) -> str:
    return _config_problem_of(read_hf_config(path))


def _config_problem_of(data: dict[str, Any]) -> str:
    try:
        transformers_config(data)
    except ConfigError:
        raise
    except Exception as exc:  # transformers' validators raise ValueError or huggingface_hub's own errors
        return _last_line(exc)
    return ""


def transformers_config(spec: str | Mapping[str, Any]) -> Any:
    """transformers' config object for `model.hf` (a config.json path or folder, or a mapping)."""
    from transformers import AutoConfig

    data = read_hf_config(spec)
    kwargs = {k: v for k, v in data.items()
              if k not in ("model_type", "transformers_version", "architectures", "torch_dtype", "dtype")}
    return AutoConfig.for_model(data["model_type"], **kwargs)


class _frozen(dict):  # an inline config as an lru_cache key
    def __hash__(self) -> int:  # type: ignore[override]
        return hash(repr(sorted(self.items(), key=str)))


@functools.lru_cache(maxsize=16)
def _weight_report(weights: str, _mtime: float, spec: Any) -> str:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    level = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()  # its load report is what this function returns
    try:
        _, info = AutoModelForCausalLM.from_pretrained(  # safetensors only: a pickled .bin is never opened here
            weights, config=transformers_config(spec), device_map="meta", ignore_mismatched_sizes=True,
            output_loading_info=True, local_files_only=True, use_safetensors=True)
    except (OSError, ValueError) as exc:  # no safetensors in the folder, an unreadable or damaged file
        return _last_line(exc)
    finally:
        transformers.utils.logging.set_verbosity(level)
    return _describe(info)


def _describe(info: dict[str, Any]) -> str:
    parts = [f"{name} is {list(ckpt)} in the checkpoint, {list(model)} in the model"
             for name, ckpt, model in sorted(info.get("mismatched_keys", []))[:SHOWN_KEYS]]
    if len(info.get("mismatched_keys", [])) > SHOWN_KEYS:
        parts.append(f"{len(info['mismatched_keys']) - SHOWN_KEYS} more of another shape")
    for kind, why in (("missing_keys", "missing (they would start random)"), ("unexpected_keys", "not in the model")):
        names = sorted(info.get(kind, []))
        if names:
            shown = ", ".join(names[:SHOWN_KEYS]) + (", ..." if len(names) > SHOWN_KEYS else "")
            parts.append(f"{len(names)} tensor(s) {why}: {shown}")
    return "; ".join(parts)


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[-1] if lines else type(exc).__name__
    return text.removeprefix("ValueError: ")
