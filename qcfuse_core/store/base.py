"""The chunk store interface the engine talks to.

A store maps ChunkKey -> KVChunk (content-addressed), plus an index NodeId -> ChunkKey so a
framework's node id finds its cache. Implementations: `MemoryStore` (tests, ephemeral use)
and the tiered disk store. Contract:

- `get` never returns a damaged or foreign cache: a missing, corrupt or mismatched entry is
  a miss (None), counted in `stats()`.
- `put` is idempotent; putting the same key twice stores it once.
- Per-layer reads (`get_layer`) exist so the engine can stream layer l+1 while computing l;
  the default reads the whole chunk, fast backends override it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

import torch

from qcfuse_core.types import ChunkKey, KVChunk, NodeId


class StoreError(Exception):
    """A store problem the user can fix; the message is one line naming the fix."""


class ReadOnlyStoreError(StoreError):
    """A write was needed but the store (or one of its files) is not writable."""


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    corrupt: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    write_failures: int = 0  # puts that could not reach durable storage (e.g. disk full)

    def as_dict(self) -> dict:
        return asdict(self)


class ChunkStore(ABC):
    @abstractmethod
    def get(self, key: ChunkKey) -> KVChunk | None: ...

    @abstractmethod
    def put(self, chunk: KVChunk) -> None: ...

    @abstractmethod
    def contains(self, key: ChunkKey) -> bool: ...

    @abstractmethod
    def delete(self, key: ChunkKey) -> bool: ...

    @abstractmethod
    def link(self, node_id: NodeId, key: ChunkKey) -> None:
        """Record that `node_id` renders to the chunk stored under `key`."""

    @abstractmethod
    def resolve(self, node_id: NodeId) -> ChunkKey | None: ...

    @abstractmethod
    def keys(self) -> Iterator[ChunkKey]: ...

    @abstractmethod
    def stats(self) -> dict: ...

    # Batched and per-layer defaults; fast backends override.
    def get_many(self, keys: Iterable[ChunkKey]) -> list[KVChunk | None]:
        return [self.get(k) for k in keys]

    def get_layer(self, key: ChunkKey, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k, v) of one layer, each (T, Hkv, D), or None on a miss."""
        chunk = self.get(key)
        return None if chunk is None else (chunk.k[layer], chunk.v[layer])

    def close(self) -> None:
        pass

    def __enter__(self) -> "ChunkStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
