"""The simulator's tables kept between processes (pricing and fitting the published rows takes seconds to
minutes on a busy 2-core host, for each `workbench simulate`): keyed by the data file and by every source
file that prices or fits them (tuning/, its data, engine/model/shapes.py), so any change recomputes."""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]


def cache_path(kind: str, data: str | Path) -> Path:
    """Where the `kind` table of `data` is kept for the code as it is."""
    digest = hashlib.sha256(Path(data).read_bytes())
    sources = sorted((ROOT / "tuning").rglob("*.py")) + sorted((ROOT / "tuning" / "data").glob("*.yaml"))
    for source in sources + [ROOT / "engine" / "model" / "shapes.py"]:
        digest.update(source.read_bytes())
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "workbench"
    return home / f"{kind}-{digest.hexdigest()[:16]}.csv"


def cached_frame(cache: Path, compute: Callable[[], pd.DataFrame]) -> pd.DataFrame:
    """The table kept at `cache`, else `compute()` written there (best effort: a read-only home only costs the
    next process the work again)."""
    if cache.is_file():
        return pd.read_csv(cache)
    table = compute()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(cache.with_suffix(".tmp"), index=False)
        cache.with_suffix(".tmp").replace(cache)
    except OSError:
        pass
    return table
