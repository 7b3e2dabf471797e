"""QCFuseEmbeddings: LangChain `Embeddings` over the offline MiniLM (384 dimensions, unit norm).

The model is loaded once per process (`get_embedder()`), on first use, so constructing
this object is free. The async methods run the model in a worker thread.
"""

from __future__ import annotations

from langchain_core.embeddings import Embeddings
from langchain_core.runnables.config import run_in_executor
from pydantic import BaseModel, ConfigDict

from qcfuse_core import EMBEDDING_DIMENSIONS, get_embedder


class QCFuseEmbeddings(BaseModel, Embeddings):
    """all-MiniLM-L6-v2, offline: mean-pooled, L2-normalised vectors of 384 floats."""

    model_config = ConfigDict(frozen=True)

    @property
    def dimensions(self) -> int:
        return EMBEDDING_DIMENSIONS

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        if isinstance(texts, str):
            raise TypeError("embed_documents takes a list of strings; use embed_query for one")
        return get_embedder().embed(list(texts)) if texts else []

    def embed_query(self, text: str) -> list[float]:
        if not isinstance(text, str):
            raise TypeError(f"embed_query takes a string, got {type(text).__name__}")
        return get_embedder().embed_one(text)

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        return await run_in_executor(None, self.embed_documents, texts)

    async def aembed_query(self, text: str) -> list[float]:
        return await run_in_executor(None, self.embed_query, text)
