"""One QCFuseEngine per (store folder, model, dtype, device) per process, and its lock.

LlamaIndex constructs its components independently (the LLM, the ingestion step, the
postprocessor), often several times. They must share one engine per store: the engine's
content index (`ChunkTextIndex`) caches its lookup table in memory and only sees texts
added through the same instance, and loading a model per component would waste memory.

    EngineSpec(store_dir, model, dtype, device) --engine_for--> QCFuseEngine  (cached)
    QCFuseEngine --lock_for--> threading.RLock                                 (one per engine)

The engine is not thread-safe (one KV cache and model at a time); every caller that runs
it - sync decode, the async decode worker thread, the cache builder - holds `lock_for(engine)`.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

from qcfuse_core.engine import QCFuseEngine


@dataclass(frozen=True)
class EngineSpec:
    """Where an engine's caches live and which model fills them.

    store_dir None means the default store (`<cache dir>/store`); model None means the
    embedded default model. The folder is resolved to an absolute path so two spellings of
    one folder share an engine.
    """

    store_dir: str | None = None
    model: str | None = None
    dtype: str | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.device:
            raise ValueError("device must be a non-empty string such as 'cpu' or 'cuda:0'")
        if self.store_dir is not None:
            object.__setattr__(self, "store_dir", str(Path(self.store_dir).expanduser().resolve()))


_ENGINES: dict[EngineSpec, QCFuseEngine] = {}
_REGISTRY_LOCK = threading.Lock()
_LOCKS: "weakref.WeakKeyDictionary[QCFuseEngine, threading.RLock]" = weakref.WeakKeyDictionary()


def engine_for(spec: EngineSpec) -> QCFuseEngine:
    """The process-wide engine for `spec`, opened on first use (model load + store open)."""
    from qcfuse_core.engine import open_engine

    with _REGISTRY_LOCK:
        engine = _ENGINES.get(spec)
        if engine is None:
            engine = open_engine(spec.store_dir, model=spec.model, dtype=spec.dtype, device=spec.device)
            _ENGINES[spec] = engine
        return engine


def lock_for(engine: QCFuseEngine) -> threading.RLock:
    """The lock every user of `engine` holds while running it."""
    with _REGISTRY_LOCK:
        lock = _LOCKS.get(engine)
        if lock is None:
            lock = _LOCKS[engine] = threading.RLock()
        return lock


def forget_engines() -> None:
    """Drop the cached engines (tests; a long-lived process that deleted a store folder)."""
    with _REGISTRY_LOCK:
        for engine in _ENGINES.values():
            engine.store.close()
            engine.texts.close()
        _ENGINES.clear()
