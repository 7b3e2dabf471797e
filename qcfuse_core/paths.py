"""Where QCFuse keeps what it makes: converted models, the default store, profiles."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of QCFuse's caches (converted models, default store): $QCFUSE_CACHE_DIR or ~/.cache/qcfuse."""
    return Path(os.environ.get("QCFUSE_CACHE_DIR") or Path.home() / ".cache" / "qcfuse")
