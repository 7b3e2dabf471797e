"""Chunk stores: the interface (`ChunkStore`) and its implementations."""

from qcfuse_core.store.base import ChunkStore, StoreStats
from qcfuse_core.store.memory import MemoryStore

__all__ = ["ChunkStore", "MemoryStore", "StoreStats"]
