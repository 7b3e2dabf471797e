"""One QCFuseEngine per (store folder, model, dtype, device) per process.

Frameworks construct their components freely (LlamaIndex's LLM, ingestion step and
postprocessor; LangChain's LLM and transformer, per chain, per request, on copy). They must
share one engine per store: loading a model per component wastes memory, and one engine
keeps one view of the store and the content index.

    shared_engine(store_dir, model, dtype, device) -> QCFuseEngine   (cached per process)

The engine serves concurrent callers without a lock around a generation: everything of one
request (its KV cache, load session, sampler) lives in its `Request`, and the engine's shared
caches guard their own updates.
"""

from __future__ import annotations

import threading
from pathlib import Path

from qcfuse_core import QCFuseEngine, open_engine

_ENGINES: dict[tuple[str, str, str, str], QCFuseEngine] = {}
_REGISTRY_LOCK = threading.Lock()


def _store_root(store_dir: str | Path | None) -> Path:
    if store_dir is not None:
        return Path(store_dir).expanduser().resolve()
    from qcfuse_core import cache_dir

    return (cache_dir() / "store").resolve()


def shared_engine(
    store_dir: str | Path | None = None,
    *,
    model: str | None = None,
    dtype: str | None = None,
    device: str = "cpu",
) -> QCFuseEngine:
    """The process-wide engine for this store folder and model, opened on first use.

    store_dir None means `<cache dir>/store` (as `open_engine`); model None means the
    embedded default. Two spellings of one folder share an engine.
    """
    if not device:
        raise ValueError("device must be a non-empty string such as 'cpu' or 'cuda:0'")
    root = _store_root(store_dir)
    key = (str(root), str(model), str(dtype), device)
    with _REGISTRY_LOCK:
        if key not in _ENGINES:
            _ENGINES[key] = open_engine(root, model=model, dtype=dtype, device=device)
        return _ENGINES[key]


def forget_engines() -> None:
    """Close and drop the cached engines (tests; a process that deleted a store folder)."""
    from qcfuse_integrations.learning import forget_learners

    forget_learners()  # their background builds finish first
    with _REGISTRY_LOCK:
        for engine in _ENGINES.values():
            engine.close()
        _ENGINES.clear()
