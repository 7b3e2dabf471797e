"""QCFuseEmbedding: LlamaIndex embeddings from the offline MiniLM (all-MiniLM-L6-v2, 384 dims).

One model per process (`get_embedder()`); vectors are unit length, so cosine and dot
product agree. Async methods run the model in a worker thread.
"""

from __future__ import annotations

import asyncio
from typing import List

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import Field

from qcfuse_core import EMBEDDING_DIMENSIONS, get_embedder, require_sequence


class QCFuseEmbedding(BaseEmbedding):
    """Offline sentence embeddings; nothing is downloaded."""

    model_name: str = Field(default="all-MiniLM-L6-v2", description="The embedding model (fixed: the offline MiniLM).")
    dimensions: int = Field(default=EMBEDDING_DIMENSIONS, description="Vector length.", frozen=True)

    @classmethod
    def class_name(cls) -> str:
        return "QCFuseEmbedding"

    def _get_query_embedding(self, query: str) -> List[float]:
        return get_embedder().embed_one(query)

    def _get_text_embedding(self, text: str) -> List[float]:
        return get_embedder().embed_one(text)

    def _get_text_embeddings(self, texts: List[str]) -> List[List[float]]:
        texts = require_sequence(texts, "texts", one="use get_text_embedding for one")
        return get_embedder().embed(texts)

    async def _aget_query_embedding(self, query: str) -> List[float]:
        return await asyncio.to_thread(self._get_query_embedding, query)

    async def _aget_text_embedding(self, text: str) -> List[float]:
        return await asyncio.to_thread(self._get_text_embedding, text)

    async def _aget_text_embeddings(self, texts: List[str]) -> List[List[float]]:
        return await asyncio.to_thread(self._get_text_embeddings, texts)
