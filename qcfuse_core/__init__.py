"""QCFuse: query-aware KV-cache fusion for fast RAG.

    from qcfuse_core import open_engine
    engine = open_engine("./store")                # the embedded model over a chunk store
    engine.build_chunks(texts)                     # each chunk's KV cache, computed once
    print(engine.answer(question, texts).text)     # fused caches, the query's tokens recomputed

The public API is the names below; they are imported on first use, so that importing a
sub-package (the store tools, say) does not load the model stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qcfuse_core.engine.api import QCFuseEngine as QCFuseEngine
    from qcfuse_core.engine.api import open_engine as open_engine
    from qcfuse_core.engine.config import EngineConfig as EngineConfig
    from qcfuse_core.engine.generation import GenerationConfig as GenerationConfig
    from qcfuse_core.engine.scheduler import EngineBusy as EngineBusy
    from qcfuse_core.engine.scheduler import KVBudgetError as KVBudgetError
    from qcfuse_core.engine.streams import AsyncTokenStream as AsyncTokenStream
    from qcfuse_core.engine.streams import TokenStream as TokenStream
    from qcfuse_core.selection.options import QCFuseOptions as QCFuseOptions
    from qcfuse_core.types import ChunkKey as ChunkKey
    from qcfuse_core.types import FusionResult as FusionResult
    from qcfuse_core.types import NodeId as NodeId
    from qcfuse_core.types import Piece as Piece

_PUBLIC = {
    "open_engine": "qcfuse_core.engine.api",
    "QCFuseEngine": "qcfuse_core.engine.api",
    "TokenStream": "qcfuse_core.engine.streams",
    "AsyncTokenStream": "qcfuse_core.engine.streams",
    "EngineBusy": "qcfuse_core.engine.scheduler",
    "KVBudgetError": "qcfuse_core.engine.scheduler",
    "EngineConfig": "qcfuse_core.engine.config",
    "GenerationConfig": "qcfuse_core.engine.generation",
    "QCFuseOptions": "qcfuse_core.selection.options",
    "FusionResult": "qcfuse_core.types",
    "ChunkKey": "qcfuse_core.types",
    "NodeId": "qcfuse_core.types",
    "Piece": "qcfuse_core.types",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'qcfuse_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
