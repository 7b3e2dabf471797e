"""QCFuseNodePostprocessor: hand the final retrieved nodes to QCFuseLLM and prefetch their caches.

Place it **last** in `node_postprocessors`: it sees the nodes in the order the response
synthesizer will render them. It records `{rendered text: node id}` in a ContextVar that
`QCFuseLLM` reads when it is called for the same query:

    query engine:  retrieve -> postprocessors (... , QCFuseNodePostprocessor) -> synthesize -> LLM
                                                  |  sets RETRIEVED                 reads it  |
                                                  +--> prefetch thread: store.prefetch / get

Async queries: the base class runs `_postprocess_nodes` in a worker thread
(`asyncio.to_thread`), which runs in a *copy* of the context, so a ContextVar set there
never reaches the LLM. `_apostprocess_nodes` is overridden to record in the query's own task.

The ids are hints, never trusted alone: the LLM uses a node only where its rendered text
occurs verbatim in the prompt. A node whose cache was never built is found this way too
(the content index does not know it yet); the LLM computes, stores and registers it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any, List, Optional

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle

from qcfuse_core import MemoryStore, NodeId, QCFuseEngine
from qcfuse_integrations.engines import shared_engine
from qcfuse_integrations.llama_index.builder import render_for_prompt

log = logging.getLogger(__name__)

_RETRIEVED: ContextVar[Mapping[str, str] | None] = ContextVar("qcfuse_retrieved_nodes", default=None)


def retrieved_nodes() -> Mapping[str, str]:
    """{rendered node text: node id} recorded by the postprocessor in this context (maybe empty)."""
    return _RETRIEVED.get() or {}


def set_retrieved_nodes(mapping: Mapping[str, str] | None) -> None:
    """Record (or clear, with None) the nodes of the current query in this context."""
    _RETRIEVED.set(MappingProxyType(dict(mapping)) if mapping else None)


class QCFuseNodePostprocessor(BaseNodePostprocessor):
    """Pass retrieved node ids to QCFuseLLM and start loading their caches. Nodes pass unchanged."""

    store_dir: Optional[str] = Field(default=None, description="Store folder shared with QCFuseLLM (None: default).")
    model: Optional[str] = Field(
        default=None,
        description="Packaged model name (smollm2-135m, gemma3-270m) or a local model folder (None: the embedded default).",
    )
    dtype: Optional[str] = Field(default=None, description="Model dtype, e.g. 'bfloat16' (None: default).")
    device: str = Field(default="cpu", description="Device the model runs on.")
    prefetch: bool = Field(default=True, description="Start loading the nodes' caches in the background.")

    _engine: Optional[QCFuseEngine] = PrivateAttr(default=None)

    def __init__(self, *, engine: QCFuseEngine | None = None, **data: Any) -> None:
        super().__init__(**data)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "QCFuseNodePostprocessor"

    @classmethod
    def from_llm(cls, llm: Any, **data: Any) -> "QCFuseNodePostprocessor":
        """A postprocessor over the same engine (store, model) as `llm` (a QCFuseLLM)."""
        return cls(
            engine=llm.engine, store_dir=llm.store_dir, model=llm.model, dtype=llm.dtype, device=llm.device, **data
        )

    @property
    def engine(self) -> QCFuseEngine:
        if self._engine is None:
            self._engine = shared_engine(self.store_dir, model=self.model, dtype=self.dtype, device=self.device)
        return self._engine

    def _postprocess_nodes(
        self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle] = None
    ) -> List[NodeWithScore]:
        self._record(nodes)
        return nodes

    async def _apostprocess_nodes(
        self, nodes: List[NodeWithScore], query_bundle: Optional[QueryBundle] = None
    ) -> List[NodeWithScore]:
        # Not the base class's to_thread: the ContextVar must be set in the query's own task.
        self._record(nodes)
        return nodes

    # ------------------------------------------------------------------ internals
    def _record(self, nodes: List[NodeWithScore]) -> None:
        mapping: dict[str, str] = {}
        for n in nodes:
            text = render_for_prompt(n.node)
            if text:
                mapping.setdefault(text, n.node.node_id)
        set_retrieved_nodes(mapping)
        if self.prefetch and mapping:
            ids = list(mapping.values())
            threading.Thread(target=self._prefetch, args=(ids,), name="qcfuse-prefetch", daemon=True).start()

    def _prefetch(self, node_ids: list[str]) -> None:
        """Resolve node ids to chunk keys and warm the store (its own `prefetch` if it has one)."""
        engine = self.engine
        store = engine.caches.store
        keys = [k for k in (store.resolve(NodeId(i)) for i in node_ids) if k is not None]
        keys = [k for k in keys if k.fingerprint == engine.caches.fingerprint]  # another model's cache is useless
        log.debug("prefetch: %d of %d nodes have a stored cache", len(keys), len(node_ids))
        if not keys or isinstance(store, MemoryStore):  # nothing to load: already in memory
            return
        prefetch = getattr(store, "prefetch", None)
        if callable(prefetch):
            prefetch(keys)
        else:
            store.get_many(keys)
