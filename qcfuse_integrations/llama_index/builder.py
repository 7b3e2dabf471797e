"""QCFuseCacheBuilder: an IngestionPipeline step that builds each node's chunk cache.

What is cached must be byte-for-byte what the response synthesizer pastes into the prompt,
or content matching never finds it. In llama-index-core 0.14 the compact / refine
synthesizers render each node as

    node.get_content(metadata_mode=MetadataMode.LLM)        (metadata lines + "\\n\\n" + text)

then `PromptHelper.repack` strips each rendering and joins them with "\\n\\n" into the
template's `{context_str}`:

    "Context information is below.\\n---------------------\\n"
    [node 1 rendered, stripped] "\\n\\n" [node 2 rendered, stripped] ...
    "\\n---------------------\\n...Query: {query_str}\\nAnswer: "

so `render_for_prompt` = the LLM rendering, stripped. Place the builder after the splitter
and any metadata extractors (anything that changes text or LLM-visible metadata after it
makes its caches unreachable), e.g.
`IngestionPipeline(transformations=[SentenceSplitter(), QCFuseCacheBuilder(...), QCFuseEmbedding()])`.

Idempotent: a node whose cache is already stored is only linked and registered again
(the pipeline's own cache may also skip this step entirely; QCFuseLLM then computes the
missing caches at query time). Nodes come back unchanged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, Optional

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.schema import BaseNode, MetadataMode, TransformComponent
from llama_index.core.utils import get_tqdm_iterable

from qcfuse_core import MIN_CHUNK_CHARS, QCFuseEngine, require_sequence
from qcfuse_integrations.engines import shared_engine

log = logging.getLogger(__name__)


def render_for_prompt(node: BaseNode) -> str:
    """The exact text the compact / refine synthesizers put into the prompt for `node`."""
    return node.get_content(metadata_mode=MetadataMode.LLM).strip()


BUILD_BATCH = 64  # nodes per engine.build_chunks call (the progress bar's step)


class QCFuseCacheBuilder(TransformComponent):
    """Compute and store the chunk cache of every node, as it will be rendered into prompts."""

    store_dir: Optional[str] = Field(default=None, description="Store folder shared with QCFuseLLM (None: default).")
    model: Optional[str] = Field(
        default=None,
        description="Packaged model name (smollm2-135m, gemma3-270m) or a local model folder (None: the embedded default).",
    )
    dtype: Optional[str] = Field(default=None, description="Model dtype, e.g. 'bfloat16' (None: default).")
    device: str = Field(default="cpu", description="Device the model runs on.")

    _engine: Optional[QCFuseEngine] = PrivateAttr(default=None)

    def __init__(self, *, engine: QCFuseEngine | None = None, **data: Any) -> None:
        super().__init__(**data)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "QCFuseCacheBuilder"

    @classmethod
    def from_llm(cls, llm: Any, **data: Any) -> "QCFuseCacheBuilder":
        """A builder over the same engine (store, model) as `llm` (a QCFuseLLM)."""
        return cls(
            engine=llm.engine, store_dir=llm.store_dir, model=llm.model, dtype=llm.dtype, device=llm.device, **data
        )

    @property
    def engine(self) -> QCFuseEngine:
        if self._engine is None:
            self._engine = shared_engine(self.store_dir, model=self.model, dtype=self.dtype, device=self.device)
        return self._engine

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        checked = require_sequence(nodes, "nodes", BaseNode, one="for one, pass [node]")
        engine = self.engine
        todo = [(render_for_prompt(n), n.node_id) for n in checked]
        short = sum(len(t) < MIN_CHUNK_CHARS for t, _ in todo)  # too short for the content index to find
        todo = [(t, i) for t, i in todo if len(t) >= MIN_CHUNK_CHARS]
        built = reused = 0
        batches = [todo[i : i + BUILD_BATCH] for i in range(0, len(todo), BUILD_BATCH)]
        for batch in get_tqdm_iterable(batches, kwargs.get("show_progress", False), "Building QCFuse chunk caches"):
            texts, ids = [t for t, _ in batch], [i for _, i in batch]
            new = {t for t in texts if not engine.caches.is_stored(t)}
            engine.build_chunks(texts, ids)  # many chunks per forward pass; the stored ones are linked
            built, reused = built + len(new), reused + len(texts) - len(new)  # a repeated text is built once
        log.info("chunk caches: %d built, %d already stored, %d too short to cache", built, reused, short)
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        return await asyncio.to_thread(self.__call__, nodes, **kwargs)
