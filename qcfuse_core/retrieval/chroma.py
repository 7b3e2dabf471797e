"""Chroma, offline: a persistent client with telemetry off and our own embeddings.

Chroma's default embedding function downloads a model; we never let it run. Vectors are
always computed by `get_embedder()` and passed explicitly (`embeddings=`,
`query_embeddings=`), and collections carry `MiniLMEmbeddingFunction` so a text query
through Chroma's own API also works offline.
"""

from __future__ import annotations

from pathlib import Path

CHROMA_PIP = "pip install chromadb==1.5.9"


def _chromadb():
    try:
        import chromadb
        from chromadb.config import Settings
    except ImportError as e:  # pragma: no cover - exercised by the missing-extra test
        raise ImportError(f"Chroma is not installed: {CHROMA_PIP}  (or pip install 'qcfuse[chroma]')") from e
    return chromadb, Settings


def persistent_client(path: str | Path):
    chromadb, Settings = _chromadb()
    Path(path).mkdir(parents=True, exist_ok=True)
    return chromadb.PersistentClient(path=str(path), settings=Settings(anonymized_telemetry=False))


def embedding_function():
    """A Chroma embedding function backed by the offline MiniLM (registered once)."""
    from chromadb.api.types import EmbeddingFunction
    from chromadb.utils.embedding_functions import register_embedding_function

    global _EF_CLASS
    if _EF_CLASS is None:

        @register_embedding_function
        class MiniLMEmbeddingFunction(EmbeddingFunction):
            def __init__(self) -> None:
                pass

            def __call__(self, input):
                import numpy as np

                from qcfuse_core.retrieval.embedder import get_embedder

                return [np.asarray(v, dtype=np.float32) for v in get_embedder().embed(list(input))]

            @staticmethod
            def name() -> str:
                return "qcfuse-minilm"

            def get_config(self) -> dict:
                return {}

            @staticmethod
            def build_from_config(config: dict) -> "MiniLMEmbeddingFunction":
                return MiniLMEmbeddingFunction()

        _EF_CLASS = MiniLMEmbeddingFunction
    return _EF_CLASS()


_EF_CLASS = None


def open_collection(path: str | Path, name: str = "qcfuse"):
    """A persistent Chroma collection under `path` using the offline embedder.

    The folder's files are checked first (`qcfuse_core.retrieval.vector_index.quick_problem`):
    damaged HNSW files, which Chroma's native code would crash on, or a graph that lacks
    rows raise StoreError naming `qcfuse store verify --repair` instead of being opened."""
    from qcfuse_core.retrieval.vector_index import CHROMA, CHROMA_DB, mark_vector_index, quick_problem
    from qcfuse_core.store import StoreError

    if (Path(path) / CHROMA_DB).is_file():
        why = quick_problem(Path(path))
        if why:
            raise StoreError(
                f"the vector index at {path} is unusable: {why}; rebuild it with "
                f"`qcfuse store verify --repair --store {Path(path).parent}`"
            )
    client = persistent_client(path)
    collection = client.get_or_create_collection(
        name=name, embedding_function=embedding_function(), metadata={"hnsw:space": "cosine"}
    )
    if Path(path).name == CHROMA:  # a store root's vector index (not a copy, nor a rebuild in progress)
        mark_vector_index(Path(path).parent)
    return collection
