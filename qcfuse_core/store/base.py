"""The chunk store interface the engine talks to.

A store maps ChunkKey -> KVChunk (content-addressed), plus an index NodeId -> ChunkKey so a
framework's node id finds its cache. Implementations: `MemoryStore` (tests, ephemeral use)
and the tiered disk store. Contract:

- `get` never returns a damaged or foreign cache: a missing, corrupt or mismatched entry is
  a miss (None), counted in `stats()`.
- `put` is idempotent; putting the same key twice stores it once.
- Per-layer reads (`get_layer`) exist so the engine can stream layer l+1 while computing l;
  the default reads the whole chunk, fast backends override it.
- `pin` holds a memory-tier entry against eviction while a load session streams from it;
  every `pin` that returned a `TierPin` is given back with `unpin` exactly once (a store
  without memory tiers pins nothing: `pin` returns None).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Self

import torch

from qcfuse_core.types import ChunkKey, KVChunk, NodeId

if TYPE_CHECKING:
    from qcfuse_core.store.tier import MemoryTier, TierPin


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
    def put(
        self,
        chunk: KVChunk,
        *,
        anchors: dict[str, torch.Tensor] | None = None,
        layer_keys: dict[int, torch.Tensor] | None = None,
        bulk: bool = False,
    ) -> None:
        """Store a chunk (idempotent). anchors / layer_keys: its probe sidecar, for stores that
        keep one (`streams_layers`); bulk: an ingestion write, which a store with memory tiers
        may keep out of them."""

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

    streams_layers = False
    """True for a store that keeps probe sidecars and serves layer-wise reads to the engine's
    prefetcher (the tiered store); the engine then streams chunks instead of reading them whole."""

    # Batched and per-layer defaults; fast backends override.
    def counters(self) -> dict:
        """What `stats` counts in this process, cheap enough to read per answer."""
        return self.stats()

    def entry_bytes(self, key: ChunkKey, dtype: torch.dtype, L: int, T: int, Hkv: int, D: int) -> int:
        """Bytes a chunk of this shape takes in the store (0: the store does not say)."""
        return 0

    def stored_bytes(self, key: ChunkKey) -> int:
        """Bytes the store keeps for the chunk of `key` (0: none, or the store does not say)."""
        return 0

    def disk_capacity(self) -> int | None:
        """The most bytes the store keeps on disk (None: no disk, or no limit)."""
        return None

    def evict_first(self, expendable: Callable[[str], bool] | None) -> None:
        """Past a bounded tier's capacity, the entries whose key string `expendable` accepts
        leave before any other, and writing one of them evicts only such entries (None: no
        entry is expendable). A store without bounded tiers has nothing to evict."""

    def prepare_bulk(self, sizes: list[int], writers: int) -> int:
        """Get ready for a bulk load of entries of these sizes (bytes); -> blocks prepared."""
        return 0

    def get_many(self, keys: Iterable[ChunkKey]) -> list[KVChunk | None]:
        return [self.get(k) for k in keys]

    def get_layer(self, key: ChunkKey, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k, v) of one layer, each (T, Hkv, D), or None on a miss."""
        chunk = self.get(key)
        return None if chunk is None else (chunk.k[layer], chunk.v[layer])

    def in_memory(self, key: ChunkKey) -> bool:
        """Held in memory (a read costs no disk I/O); a store without tiers: whether it holds it."""
        return self.contains(key)

    def promote(self, key: ChunkKey) -> bool:
        """Copy a chunk read from a slower tier into memory -> True when it was admitted
        (a store without tiers has nothing to promote)."""
        return False

    def pin(self, key: ChunkKey) -> "TierPin | None":
        """Hold the chunk's image in the fastest memory tier that has it against eviction ->
        the pin (with the image to read), or None when no memory tier holds it."""
        return None

    def unpin(self, pin: "TierPin") -> None:
        """Give back a pin from `pin` (never raises)."""

    # Tiers by use and the compute device's chunk tier; a store without tiers has neither.
    def note_use(self, key: ChunkKey) -> int:
        """Count a request's use of `key` (admission into faster tiers goes by use) -> its uses
        so far; 0: the store does not count them."""
        return 0

    def admits(self, key: ChunkKey) -> bool:
        """Whether `key`, read from a slower tier, may enter a faster one now."""
        return True

    def device_tier(self, device: torch.device) -> "MemoryTier | None":
        """The chunk tier in the memory of `device`'s kind (the tiered store's "gpu" tier), or
        None: what the engine's KV budget sizes and a load session fills."""
        return None

    def fit_device_tier(self, device: torch.device, room: int) -> bool:
        """Size the chunk tier of `device` to `room` bytes (at most the store's own cap for it),
        evicting by policy -> False, changing nothing, when entries being read (pinned) or
        filled (claimed) hold more than that. True without such a tier."""
        tier = self.device_tier(device)
        return tier is None or tier.resize(max(0, room)) is not None

    def close(self) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
