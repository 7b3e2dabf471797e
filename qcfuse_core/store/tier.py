"""A memory tier: entry images on one device under a byte capacity, evicted by policy.

Invariant: `bytes_used <= capacity_bytes` after every call (an image larger than the whole
capacity is not admitted). Bytes are charged as allocated (`charge`), not as payload. The
tier never talks to disk; the tiered store decides what enters (promotion on hit,
write-through on put). This class holds one allocation per image (the GPU tier); the host
tier is `host_tier.HostTier`, whose images share the slabs of one arena (store/arena.py).

Pins (eviction holds, reference counted; nothing to do with page-locked host memory): a
load session streaming layers out of an image pins its key for as long as it is open
(`pin` ... `unpin`), so the bytes it reads stay charged to the tier and the policy never
picks them:

    put(image)   fits beside what is held ───────────────────────────────> admitted
                 fits once unpinned entries go ──> evict them, by policy ─> admitted
                 does not fit even then ──> not admitted, nothing evicted, counted
                                            (`stats.refused_pinned`; never raises)

- a pinned entry is never evicted; `remove` (an explicit delete) still drops it from the
  tier (the session keeps its reference to the image, so its reads stay valid);
- pins count per key, independently of presence: `unpin` of a key that was removed, or
  never pinned, does nothing; a key pinned, removed and admitted again is pinned until the
  holder lets go.

A capacity that moves (the GPU tier, whose room is what the running requests' KV caches
leave of the engine's GPU budget; cache/budget.py): `resize` sets it, evicting unpinned
entries by policy down to it, and refuses (changing nothing) when pinned entries and claims
alone exceed it. Claims: room charged for an image being filled in place (a load session
copies a chunk to the GPU as it streams it, cache/prefetch.py): `claim` charges it now
(evicting unpinned entries as a put would), `admit` turns it into an entry without a copy,
`unclaim` gives it back. Claimed bytes, like pinned entries, are never evicted.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

import torch

from qcfuse_core.store.entry import EntryImage
from qcfuse_core.store.eviction import EntryMeta, EvictionPolicy
from qcfuse_core.types import ChunkKey


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0  # bytes served from this tier
    bytes_written: int = 0  # bytes admitted into this tier
    evictions: int = 0
    refused_pinned: int = 0  # puts not admitted: every entry that could have made room was pinned
    corrupt: int = 0
    write_failures: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TierPin:
    """One open pin: the memory tier that holds it and the image pinned there (what a load
    session reads from). Given back with the store's `unpin`."""

    tier: str  # gpu | host
    image: EntryImage

    @property
    def key(self) -> ChunkKey:
        return self.image.key


def charge(image: EntryImage) -> int:
    """Bytes an image really occupies (`charge_bytes`)."""
    return charge_bytes(image.nbytes, image.device.type, image.data.is_pinned())


def charge_bytes(n: int, device_type: str, pinned: bool) -> int:
    """Bytes n bytes of image really occupy as an allocation of its own: torch's pinned host
    allocator rounds blocks up to a power of two, the CUDA caching allocator large blocks to
    2 MiB; plain memory is exact. (The host tier's images are extents of its arena instead:
    `HostTier.charge`.)"""
    if device_type == "cuda":
        return -(-n // (2 << 20)) * (2 << 20)
    if pinned:
        return 1 << (n - 1).bit_length()
    return n


class MemoryTier:
    def __init__(
        self,
        name: str,
        device: torch.device | str,
        capacity_bytes: int,
        policy: EvictionPolicy,
        *,
        pin: bool = False,
    ) -> None:
        """pin: hold the images in page-locked host memory (CUDA hosts), not an eviction pin."""
        if capacity_bytes < 0:
            raise ValueError(f"{name} tier capacity must be >= 0, got {capacity_bytes}")
        self.name = name
        self.device = torch.device(device)
        self.capacity_bytes = int(capacity_bytes)
        self.policy = policy
        self.pin_memory = pin
        self.stats = TierStats()
        self._images: dict[ChunkKey, EntryImage] = {}
        self._meta: dict[ChunkKey, EntryMeta] = {}
        self._bytes = 0
        self._tick = 0
        self._pins: dict[ChunkKey, int] = {}  # key -> open holders (eviction pins)
        self._claimed = 0  # bytes of open claims (counted in _bytes)
        self._lock = threading.RLock()

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._images)

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._images

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._images)

    def has_room(self, nbytes: int) -> bool:
        """An image of `nbytes` fits beside what the tier holds, evicting nothing."""
        n = charge_bytes(nbytes, self.device.type, self.pin_memory)
        with self._lock:
            return self._bytes + n <= self.capacity_bytes

    def get(self, key: ChunkKey, *, count: bool = True) -> EntryImage | None:
        """The image (a hit touches it for the policy); None on a miss."""
        with self._lock:
            image = self._images.get(key)
            if image is None:
                self.stats.misses += count
                return None
            self._tick += 1
            meta = self._meta[key]
            meta.last_access = self._tick
            meta.hits += 1
            if count:
                self.stats.hits += 1
                self.stats.bytes_read += image.nbytes
            return image

    def pin(self, key: ChunkKey, *, count: bool = True) -> EntryImage | None:
        """Hold `key` against eviction until `unpin` -> its image (a load session's read of it:
        touched for the policy, a hit or miss counted unless `count` is False); None on a miss
        (nothing is held then)."""
        with self._lock:
            image = self.get(key, count=count)
            if image is not None:
                self._pins[key] = self._pins.get(key, 0) + 1
            return image

    def unpin(self, key: ChunkKey) -> None:
        """Let go of one `pin` of `key` (a key not pinned: nothing happens; never raises)."""
        with self._lock:
            n = self._pins.get(key, 0)
            if n > 1:
                self._pins[key] = n - 1
            else:
                self._pins.pop(key, None)

    def pins(self, key: ChunkKey) -> int:
        """Open pins of `key`."""
        with self._lock:
            return self._pins.get(key, 0)

    def put(self, image: EntryImage) -> list[ChunkKey]:
        """Admit `image` (copied to this tier's device), evicting unpinned entries as needed.
        Returns evicted keys. When even evicting every unpinned entry would not make room it
        is not admitted and nothing is evicted (`stats.refused_pinned`)."""
        with self._lock:
            if image.key in self._images or image.nbytes > self.capacity_bytes:
                return []
        local = image.to(self.device, pin=self.pin_memory)  # copy outside the lock
        n = charge(local)
        with self._lock:
            if n > self.capacity_bytes:
                return []
            if image.key in self._images:
                return []
            evicted = self._make_room(n)
            if evicted is None:  # pinned entries and claims leave no room for it
                self.stats.refused_pinned += 1
                return []
            self._tick += 1
            self._images[image.key] = local
            self._meta[image.key] = EntryMeta(image.key, n, self._tick, self._tick)
            self._bytes += n
            self.stats.bytes_written += n
            return evicted

    def held_bytes(self) -> int:
        """Bytes eviction cannot free now: pinned entries and open claims."""
        with self._lock:
            return self._claimed + sum(m.nbytes for k, m in self._meta.items() if k in self._pins)

    def _make_room(self, n: int) -> list[ChunkKey] | None:
        """Evict unpinned entries by policy until `n` more bytes fit (lock held) -> the evicted
        keys; None, evicting nothing, when even evicting every unpinned entry would not do."""
        if self.held_bytes() + n > self.capacity_bytes:
            return None
        evicted = []
        while self._bytes + n > self.capacity_bytes:
            victim = self.policy.victim([m for k, m in self._meta.items() if k not in self._pins])
            self._drop(victim.key)
            evicted.append(victim.key)
        self.stats.evictions += len(evicted)
        return evicted

    def resize(self, capacity_bytes: int) -> list[ChunkKey] | None:
        """Set the capacity, evicting unpinned entries by policy until what is held fits ->
        the evicted keys; None, changing nothing, when pinned entries and claims alone hold
        more than `capacity_bytes`."""
        if capacity_bytes < 0:
            raise ValueError(f"{self.name} tier capacity must be >= 0, got {capacity_bytes}")
        with self._lock:
            if self.held_bytes() > capacity_bytes:
                return None
            old, self.capacity_bytes = self.capacity_bytes, int(capacity_bytes)
            evicted = self._make_room(0)
            if evicted is None:  # cannot happen: checked above under the same lock
                self.capacity_bytes = old
            return evicted

    def claim(self, nbytes: int) -> int | None:
        """Charge room for an image of `nbytes` that its holder fills in place, evicting
        unpinned entries by policy as `put` would -> the bytes charged (give them to `admit`
        or `unclaim`); None, evicting nothing, when there is no such room."""
        n = charge_bytes(nbytes, self.device.type, self.pin_memory)
        with self._lock:
            if self._make_room(n) is None:
                return None
            self._claimed += n
            self._bytes += n
            return n

    def unclaim(self, charged: int) -> None:
        """Give back a claim that will not be admitted."""
        with self._lock:
            self._claimed -= charged
            self._bytes -= charged

    def admit(self, charged: int, image: EntryImage) -> bool:
        """Turn a claim into an entry holding `image` (on this tier's device, not copied) ->
        True; False when the key is already held (the claim is given back either way)."""
        if image.device.type != self.device.type:
            raise ValueError(f"{self.name} tier holds images on {self.device}, not {image.device}")
        with self._lock:
            self._claimed -= charged
            if image.key in self._images:
                self._bytes -= charged
                return False
            self._tick += 1
            self._images[image.key] = image
            self._meta[image.key] = EntryMeta(image.key, charged, self._tick, self._tick)
            self.stats.bytes_written += charged
            return True

    def remove(self, key: ChunkKey) -> bool:
        with self._lock:
            return self._drop(key)

    def clear(self) -> None:
        with self._lock:
            self._images.clear()
            self._meta.clear()
            self._bytes = self._claimed

    def _drop(self, key: ChunkKey) -> bool:
        image = self._images.pop(key, None)
        if image is None:
            return False
        self._bytes -= self._meta.pop(key).nbytes
        return True

    def summary(self) -> dict:
        with self._lock:
            return {
                "device": str(self.device),
                "pinned": self.pin_memory,
                "pinned_entries": len(self._pins),
                "claimed_bytes": self._claimed,
                "policy": self.policy.name,
                "entries": len(self._images),
                "bytes_used": self._bytes,
                "capacity_bytes": self.capacity_bytes,
                **self.stats.as_dict(),
            }
