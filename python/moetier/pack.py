"""Writes an expert store (the format and the writer live in the C++ core: csrc/moetier-store.*)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tqdm import tqdm

from . import _core
from .config import PackConfig
from .errors import ConfigError, StoreError
from .model import check_gguf


def pack(
    model: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None = None,
    config: PackConfig | None = None,
    *,
    progress: bool | None = None,
) -> Path:
    """Packs the experts of `model` into `out_dir` (default: MODEL.experts next to the model).
    progress: show a bar (default: when stderr is a terminal)."""
    cfg = config or PackConfig()
    if not isinstance(cfg, PackConfig):
        msg = f"pack: config {cfg!r} must be a PackConfig (e.g. PackConfig(low_type='q4_0'))"
        raise ConfigError(msg)
    src = check_gguf(model)
    dst = Path(out_dir) if out_dir is not None else src.with_suffix(".experts")
    if not dst.absolute().parent.is_dir():
        # the store is written beside it first (DIR.pack-tmp), so the parent must exist
        msg = f"{dst}: {dst.absolute().parent} is not a directory; create it first"
        raise StoreError(msg)
    show = sys.stderr.isatty() if progress is None else progress
    with tqdm(total=0, unit="B", unit_scale=True, desc=f"pack {src.name}", disable=not show) as bar:

        def on_progress(done: int, total: int) -> bool:
            bar.total = total
            bar.update(done - bar.n)
            return True

        _core.pack(str(src), str(dst), cfg.low_type, on_progress)  # raises StoreError
    return dst
