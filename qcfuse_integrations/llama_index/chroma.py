"""Chroma under LlamaIndex: a ChromaVectorStore on a persistent, telemetry-off client.

LlamaIndex passes its own vectors (from QCFuseEmbedding), so Chroma's embedding function
is never called on this path; the collection still carries the offline MiniLM function so
nothing tries to download Chroma's default model.
"""

from __future__ import annotations

from pathlib import Path

from qcfuse_core import open_chroma_collection

CHROMA_VS_PIP = "pip install 'qcfuse[llama-index]'  (llama-index-vector-stores-chroma)"


def chroma_vector_store(path: str | Path, collection: str = "qcfuse"):
    """A `ChromaVectorStore` over collection `collection` of the persistent client at `path`."""
    try:
        from llama_index.vector_stores.chroma import ChromaVectorStore
    except ImportError as e:
        raise ImportError(f"the Chroma vector store for LlamaIndex is not installed: {CHROMA_VS_PIP}") from e
    return ChromaVectorStore(chroma_collection=open_chroma_collection(path, collection))
