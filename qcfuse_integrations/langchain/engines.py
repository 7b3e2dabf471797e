"""One engine per (store folder, model) per process, and one generation at a time per engine.

LangChain builds LLM and transformer objects freely (per chain, per request, on copy), so
they must not each load a model or open a store. `shared_engine` hands every caller asking
for the same store folder and model the same `QCFuseEngine`; `engine_lock` serialises
generations on one engine, since sync calls, `batch` and the async worker threads may all
reach it at once.
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path

from qcfuse_core.engine import QCFuseEngine, open_engine

_ENGINES: dict[tuple[str, str, str, str], QCFuseEngine] = {}
_LOCKS: "weakref.WeakKeyDictionary[QCFuseEngine, threading.Lock]" = weakref.WeakKeyDictionary()
_REGISTRY_LOCK = threading.Lock()


def _store_root(store_dir: str | Path | None) -> Path:
    if store_dir is not None:
        return Path(store_dir).expanduser().resolve()
    from qcfuse_core.model import cache_dir

    return (cache_dir() / "store").resolve()


def shared_engine(
    store_dir: str | Path | None = None, *, model: str | None = None, dtype: str | None = None, device: str = "cpu",
) -> QCFuseEngine:
    """The process-wide engine for this store folder and model (opened on first use).

    store_dir None means `<cache dir>/store`, the same default as `open_engine`.
    """
    root = _store_root(store_dir)
    key = (str(root), str(model), str(dtype), device)
    with _REGISTRY_LOCK:
        if key not in _ENGINES:
            _ENGINES[key] = open_engine(root, model=model, dtype=dtype, device=device)
        return _ENGINES[key]


def engine_lock(engine: QCFuseEngine) -> threading.Lock:
    """The lock held for the whole of one generation (lookup, fuse, decode) on `engine`."""
    with _REGISTRY_LOCK:
        lock = _LOCKS.get(engine)
        if lock is None:
            lock = _LOCKS[engine] = threading.Lock()
        return lock
