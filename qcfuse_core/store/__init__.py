"""Chunk stores: the interface (`ChunkStore`) and its implementations.

`open_store(kv_dir(root))` gives the tiered store (GPU -> host -> disk); `MemoryStore` is the
in-memory store for tests and ephemeral sessions.
"""

from qcfuse_core.store.base import ChunkStore, ReadOnlyStoreError, StoreError, StoreStats
from qcfuse_core.store.disk import DiskTier
from qcfuse_core.store.entry import FORMAT_VERSION
from qcfuse_core.store.eviction import POLICIES, get_policy
from qcfuse_core.store.memory import MemoryStore
from qcfuse_core.store.sidecar import Sidecar
from qcfuse_core.store.tier import TierPin
from qcfuse_core.store.tiered import LayerBatch, StoreConfig, TieredStore, kv_dir, open_store, writable

STORE_FORMAT_VERSION = FORMAT_VERSION

__all__ = [
    "ChunkStore",
    "DiskTier",
    "LayerBatch",
    "MemoryStore",
    "POLICIES",
    "ReadOnlyStoreError",
    "STORE_FORMAT_VERSION",
    "Sidecar",
    "StoreConfig",
    "StoreError",
    "StoreStats",
    "TierPin",
    "TieredStore",
    "get_policy",
    "kv_dir",
    "open_store",
    "writable",
]
