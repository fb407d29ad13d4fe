"""Where the engine keeps what it builds once and reuses: converted models
(:mod:`engine.model.loader`) and compiled CPU kernels (:mod:`engine.cpu.kernels`)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache: ``$ITERSERVE_CACHE``, default ``~/.cache/iterserve``."""
    return Path(os.environ.get("ITERSERVE_CACHE", Path.home() / ".cache" / "iterserve"))
