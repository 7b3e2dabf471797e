"""QCFuseCacheBuilder: the ingestion step between the text splitter and the vector store.

    loader -> splitter -> QCFuseCacheBuilder -> Chroma.add_documents

Text splitters drop `Document.id`, so every split document gets a deterministic id

    document_id = sha256(source \\0 index \\0 text)[:32]     index: n-th split of that source

(the same corpus split the same way gets the same ids, so re-ingesting upserts instead of
duplicating), and the cache of its text - exactly as the chain will paste it into the
prompt - is computed and stored under that id. Idempotent: a text already stored is not
recomputed. Ids already set are kept unless `overwrite_ids`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.documents import BaseDocumentTransformer, Document

from qcfuse_core import QCFuseEngine, require_sequence
from qcfuse_integrations.engines import shared_engine

log = logging.getLogger(__name__)

CHUNK_KEY_FIELD = "qcfuse_chunk_key"


def document_id(source: str, index: int, text: str) -> str:
    """32 hex chars naming the `index`-th split of `source` with this exact text."""
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    return hashlib.sha256(f"{source}\0{index}\0{text}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class BuildReport:
    """What one transform_documents call did: caches computed vs. found already stored."""

    documents: int = 0
    built: int = 0
    reused: int = 0


class QCFuseCacheBuilder(BaseDocumentTransformer):
    """Assign deterministic ids to split documents and build their chunk caches.

    engine: an engine (e.g. `llm.engine`), or None to use the shared one for
    (store_dir, model, dtype, device). render: the text the chain's formatter puts into
    the prompt for one document (default: its page_content).
    """

    def __init__(
        self,
        engine: QCFuseEngine | None = None,
        *,
        store_dir: str | None = None,
        model: str | None = None,
        dtype: str | None = None,
        device: str = "cpu",
        render: Callable[[Document], str] | None = None,
        source_key: str = "source",
        overwrite_ids: bool = False,
    ) -> None:
        self._engine = engine
        self._engine_args: dict[str, Any] = dict(store_dir=store_dir, model=model, dtype=dtype, device=device)
        self.render = render or (lambda doc: doc.page_content)
        self.source_key = source_key
        self.overwrite_ids = overwrite_ids
        self.last_build = BuildReport()

    @property
    def engine(self) -> QCFuseEngine:
        if self._engine is None:
            args = self._engine_args
            self._engine = shared_engine(
                args["store_dir"], model=args["model"], dtype=args["dtype"], device=args["device"]
            )
        return self._engine

    def transform_documents(self, documents: Sequence[Document], **kwargs: Any) -> Sequence[Document]:
        """Copies of `documents` with ids and `metadata["qcfuse_chunk_key"]`; caches built."""
        if kwargs:
            raise TypeError(f"QCFuseCacheBuilder.transform_documents takes no options, got {sorted(kwargs)}")
        documents = require_sequence(documents, "documents", Document, one="for one, pass [document]")
        engine = self.engine
        per_source: dict[str, int] = {}
        ids, texts = [], []
        for doc in documents:
            source = str(doc.metadata.get(self.source_key, ""))
            index = per_source[source] = per_source.get(source, -1) + 1
            doc_id = doc.id if doc.id and not self.overwrite_ids else document_id(source, index, doc.page_content)
            text = self.render(doc)
            if not isinstance(text, str) or not text:
                raise ValueError(f"render() gave no text for document {doc_id!r}")
            ids.append(doc_id)
            texts.append(text)
        new = {t for t in texts if not engine.caches.is_stored(t)}
        keys = engine.build_chunks(texts, ids)  # many chunks per forward pass
        built, reused = len(new), len(texts) - len(new)  # a repeated text is built once
        out = [
            Document(
                page_content=doc.page_content, id=doc_id, metadata={**doc.metadata, CHUNK_KEY_FIELD: key.to_string()}
            )
            for doc, doc_id, key in zip(documents, ids, keys)
        ]
        self.last_build = BuildReport(len(out), built, reused)
        log.info("chunk caches: %d documents, %d built, %d already stored", len(out), built, reused)
        return out
