"""The simulator's tables kept between processes (pricing and fitting the published rows takes seconds to
minutes on a busy 2-core host, for each `workbench simulate`): keyed by the data file, the data the code
reads (tuning/data/**/*.yaml) and every project module the tables' code imports (`simulator_modules`: a walk
of the import statements from `ENTRY_MODULES`, those inside functions included), so any change recomputes.
One process computes a table at a time (a lock file beside it, profilers/locks.py): the others wait and read
what it wrote, where each computed the same table on the same cores before (three suite workers at once on a fresh
machine). Each writer writes its own temporary file and renames it into place (`os.replace`, atomic on one file
system): two processes filling the same table never interleave their bytes.

Values the code computes by calling torch's (a pipeline schedule's walked bubble) are kept the same way, one JSON
object per code version (`code_cache_path`: those modules and the installed torch's version), so a process that
finds them there never imports torch for them (`read_values`, `add_values`)."""
from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
# the modules whose functions compute the cached tables (validation.loso, domain's validated table)
ENTRY_MODULES = ("tuning.sim.validation", "tuning.sim.domain")


def _module_file(name: str, root: Path) -> Path | None:
    """The project file of module `name` (a package's __init__.py), None where it is not the project's."""
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported(path: Path, name: str, root: Path) -> set[str]:
    """Project modules `path` (module `name`) imports anywhere in its body, with their parent packages."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".") if package else []
            head = ".".join(parts[:len(parts) - node.level + 1] if node.level else [])
            target = ".".join(x for x in (head, node.module or "") if x)
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # `from pkg import module`
    parents = {".".join(m.split(".")[:i]) for m in found for i in range(1, m.count(".") + 1)}
    return {m for m in found | parents if _module_file(m, root) is not None}


@functools.lru_cache(maxsize=4)
def simulator_modules(entries: tuple[str, ...] = ENTRY_MODULES, root: Path = ROOT) -> tuple[Path, ...]:
    """Every project file reachable from `entries` through import statements (sorted)."""
    seen: dict[str, Path] = {}
    todo = [m for e in entries for m in [".".join(e.split(".")[:i]) for i in range(1, e.count(".") + 2)]]
    while todo:
        name = todo.pop()
        path = _module_file(name, root)
        if name in seen or path is None:
            continue
        seen[name] = path
        todo.extend(_imported(path, name, root) - set(seen))
    return tuple(sorted(seen.values()))


def cache_path(kind: str, data: str | Path) -> Path:
    """Where the `kind` table of `data` is kept for the code as it is."""
    digest = hashlib.sha256(Path(data).read_bytes())
    sources = simulator_modules() + tuple(sorted((ROOT / "tuning" / "data").rglob("*.yaml")))
    return _home() / f"{kind}-{_hex_of(digest, sources)}.csv"


def _home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "workbench"


def _hex_of(digest: Any, sources: tuple[Path, ...]) -> str:
    """`digest` fed each source's path (from the checkout's root) and content: the first 16 hex digits."""
    for source in sources:
        digest.update(str(source.relative_to(ROOT)).encode() + b"\0" + _read(source))
    return digest.hexdigest()[:16]


def code_cache_path(kind: str, entries: tuple[str, ...]) -> Path:
    """Where the `kind` values computed by the project modules reachable from `entries` are kept: keyed by those
    modules' content and the installed torch's version (the code calls torch's), read without importing torch."""
    return _home() / f"{kind}-{_code_digest(entries)}.json"


@functools.lru_cache(maxsize=8)
def _code_digest(entries: tuple[str, ...]) -> str:
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "none"
    return _hex_of(hashlib.sha256(f"torch {torch_version}".encode()), simulator_modules(entries))


def read_values(path: Path) -> dict[str, float]:
    """The values kept at `path`; none where it is missing or unreadable (they are computed again)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def add_values(path: Path, values: dict[str, float]) -> None:
    """`values` added to those kept at `path`, renamed into place from a file of this writer's own (best effort: two
    writers at once may each keep only their own additions, which the next process computes again)."""
    merged = {**read_values(path), **values}
    _replace(path, lambda tmp: Path(tmp).write_text(json.dumps(merged)))


def _read(path: Path) -> bytes:
    return path.read_bytes()


def cached_frame(cache: Path, compute: Callable[[], pd.DataFrame]) -> pd.DataFrame:
    """The table kept at `cache`, else `compute()` written there, by one process at a time (`_computing`: another
    that wants the same table waits, then reads it) through a temporary file of this writer's own (best effort: a
    read-only home only costs the next process the work again)."""
    if cache.is_file():
        return pd.read_csv(cache)
    with _computing(cache):
        if cache.is_file():  # another process computed it while this one waited
            return pd.read_csv(cache)
        table = compute()
        write_table(cache, table)
    return table


@contextlib.contextmanager
def _computing(cache: Path) -> Iterator[None]:
    """Held while this process computes and writes `cache`: profilers.locks.file_lock on `<cache>.lock` (the kernel
    releases it if the process dies; nothing is held where the folder cannot be written)."""
    from profilers.locks import file_lock

    with contextlib.suppress(OSError):
        cache.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(cache):
        yield


def write_table(cache: Path, table: pd.DataFrame) -> None:
    """`table` renamed into place at `cache` from a temporary file of this writer's own (best effort)."""
    _replace(cache, lambda tmp: table.to_csv(tmp, index=False))


def _replace(path: Path, write: Callable[[str], object]) -> None:
    """`write(tmp)` into a temporary file of this writer's own beside `path`, then renamed into place (`os.replace`,
    atomic on one file system); best effort: a folder that cannot be written keeps nothing."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp")
        os.close(fd)
        try:
            write(tmp)
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
    except OSError:
        pass
