"""The host tier: a memory tier whose images live in a `HostArena` (store/arena.py), charged
the bytes of their extents (the image rounded up to 64 B), not a power-of-two block each.

    put(image)   an extent fits (a hole, or a new slab) ──────────────────> copy in, admitted
                 room forms once unpinned entries go ──> evict them ──────> copy in, admitted
                 (walking the policy's order, it stops at the first victim after which a
                 contiguous extent can form, and evicts only the entries inside the cheapest
                 window of adjacent extents and holes - or the slabs it gives back)
                 no room even then ──> not admitted, nothing evicted (`stats.refused_pinned`)

What must hold, beside `tier.MemoryTier`'s invariants:
- `bytes_used` is the arena's: every extent's bytes - entries, entries removed while pinned,
  extents being filled, extents retired but still read - and never exceeds the capacity;
- an entry removed (`remove`, `clear`) while pinned keeps its extent until the last `unpin`;
  an evicted or removed entry's bytes are reused only once no tensor view of them is alive
  and, under CUDA, after a device synchronisation (`HostArena.reclaim`): an image a reader
  still holds, or an async copy still reads, is never overwritten;
- images leave the tier only through `get` and `pin` (they mark the extent exposed, so its
  reuse waits for the fence).

Thread safety: the tier's lock guards the arena; the copy into a new extent runs outside it
(the extent is not an entry until the copy is done, so nothing evicts or reads it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import torch

from qcfuse_core.store.arena import SLAB_BYTES, Extent, HostArena
from qcfuse_core.store.entry import EntryImage
from qcfuse_core.store.eviction import EntryMeta, EvictionPolicy
from qcfuse_core.store.tier import MemoryTier
from qcfuse_core.types import ChunkKey


class HostTier(MemoryTier):
    def __init__(
        self,
        name: str,
        capacity_bytes: int,
        policy: EvictionPolicy,
        *,
        pin: bool = False,
        slab_bytes: int = SLAB_BYTES,
    ) -> None:
        """pin: page-lock the arena's slabs (CUDA hosts). slab_bytes: the arena's slab size."""
        super().__init__(name, "cpu", capacity_bytes, policy, pin=pin)
        self.arena = HostArena(
            self.capacity_bytes, pin=pin, slab_bytes=slab_bytes, fence=torch.cuda.synchronize if pin else None
        )
        self._extents: dict[ChunkKey, Extent] = {}
        # keys a faster tier holds too (the store sets it): evicted before the policy's order
        self.shadowed: Callable[[ChunkKey], bool] | None = None
        self._held: dict[ChunkKey, list[Extent]] = {}  # removed while pinned: freed at the last unpin

    @property
    def bytes_used(self) -> int:
        return self.arena.used

    def charge(self, nbytes: int) -> int:
        """Bytes an image of `nbytes` is charged here."""
        return self.arena.charge(nbytes)

    def has_room(self, nbytes: int) -> bool:
        with self._lock:
            return self.arena.has_room(nbytes)

    def prepare(self, sizes: list[int]) -> int:
        """Allocate (page-lock) the slabs that images of these sizes, put in this order, would
        need beside what the tier holds, evicting nothing -> how many of them the free room
        in the slabs then holds (fragmentation aside)."""
        with self._lock:
            charges = [self.arena.charge(n) for n in sizes]
            room = self.arena.reserve(sum(charges))
            kept = 0
            for c in charges:
                if c > room:
                    break
                room -= c
                kept += 1
            return kept

    def get(self, key: ChunkKey, *, count: bool = True) -> EntryImage | None:
        with self._lock:
            image = super().get(key, count=count)
            if image is not None:
                self._extents[key].exposed = True
            return image

    def unpin(self, key: ChunkKey) -> None:
        with self._lock:
            super().unpin(key)
            if key not in self._pins:
                for ext in self._held.pop(key, []):
                    self.arena.free(ext)

    def held_bytes(self) -> int:
        """Bytes eviction cannot free now: all but the unpinned entries'."""
        with self._lock:
            movable = sum(m.nbytes for k, m in self._meta.items() if k not in self._pins)
            return self.arena.used - movable

    def put(self, image: EntryImage) -> list[ChunkKey]:
        """Admit a copy of `image` in an extent, evicting unpinned entries as needed (module
        docstring) -> the evicted keys."""
        key = image.key
        with self._lock:
            if key in self._images or not self.arena.fits_ever(image.nbytes):
                return []
            ext = self.arena.alloc(image.nbytes)
            evicted: list[ChunkKey] = []
            if ext is None:
                plan = self.arena.plan(image.nbytes, self._order())
                if plan is not None:
                    for victim in plan.victims:
                        assert isinstance(victim.tag, ChunkKey)  # only entries' extents are in the order
                        self._drop(victim.tag)
                        evicted.append(victim.tag)
                    self.stats.evictions += len(evicted)
                    ext = self.arena.alloc(image.nbytes)  # None only if a reader holds a victim's bytes
            if ext is None:
                self.stats.refused_pinned += 1
                return evicted
        data = ext.tensor()
        data.copy_(image.data)  # outside the lock: the extent is nobody else's yet
        with self._lock:
            if key in self._images:  # another put of the same key won
                self.arena.free(ext)
                return evicted
            ext.tag = key
            self._tick += 1
            self._images[key] = EntryImage(image.layout, data)
            self._extents[key] = ext
            self._meta[key] = EntryMeta(key, ext.size, self._tick, self._tick)
            self.stats.bytes_written += ext.size
            return evicted

    def _order(self) -> Iterator[Extent]:
        """Unpinned entries' extents in the policy's eviction order (lock held), lazily. An
        entry whose image object someone outside the tier still holds stays too: its bytes
        could not be reused anyway (`HostArena.reclaim`)."""
        metas = [m for k, m in self._meta.items() if k not in self._pins and sys.getrefcount(self._images[k]) <= 2]
        # entries a faster tier also holds go first, least recently used first: their copy
        # here only saves a request once that tier lets them go, so the room holds more chunks
        shadowed = self.shadowed
        if shadowed is not None:
            first = sorted((m for m in metas if shadowed(m.key)), key=lambda m: (m.last_access, m.inserted))
            yield from (self._extents[m.key] for m in first)
            metas = [m for m in metas if not shadowed(m.key)]
        if type(self.policy).victim is EvictionPolicy.victim:  # a plain priority: one sort
            metas.sort(key=lambda m: (*self.policy.priority(m), m.inserted))
            yield from (self._extents[m.key] for m in metas)
            return
        while metas:  # a policy whose victim depends on what is left (slru): one pick at a time
            victim = self.policy.victim(metas)
            metas.remove(victim)
            yield self._extents[victim.key]

    def _make_room(self, n: int) -> list[ChunkKey] | None:
        raise NotImplementedError("the host tier makes room in its arena (put)")

    def resize(self, capacity_bytes: int) -> list[ChunkKey] | None:
        """Set the capacity; shrinking gives back whole slabs, evicting the entries in them
        (the cheapest slabs by the policy's order) -> the evicted keys; None, changing
        nothing, when slabs holding pinned entries alone exceed `capacity_bytes`."""
        if capacity_bytes < 0:
            raise ValueError(f"{self.name} tier capacity must be >= 0, got {capacity_bytes}")
        with self._lock:
            victims = self.arena.shrink_plan(capacity_bytes, self._order())
            if victims is None:
                return None
            evicted = []
            for victim in victims:
                assert isinstance(victim.tag, ChunkKey)
                self._drop(victim.tag)
                evicted.append(victim.tag)
            self.stats.evictions += len(evicted)
            if not self.arena.shrink(capacity_bytes):  # a reader still holds a victim's bytes
                return None
            self.capacity_bytes = int(capacity_bytes)
            return evicted

    def claim(self, nbytes: int) -> int | None:
        raise TypeError("the host tier copies images into its arena: use put, not claim/admit")

    def admit(self, charged: int, image: EntryImage) -> bool:
        raise TypeError("the host tier copies images into its arena: use put, not claim/admit")

    def unclaim(self, charged: int) -> None:
        raise TypeError("the host tier copies images into its arena: use put, not claim/admit")

    def remove(self, key: ChunkKey) -> bool:
        with self._lock:
            return self._drop(key)

    def clear(self) -> None:
        """Drop every entry (pinned ones keep their extents until unpinned) and give back the
        slabs nothing holds any more."""
        with self._lock:
            for key in list(self._images):
                self._drop(key)
            self.arena.release_empty()

    def _drop(self, key: ChunkKey) -> bool:
        if self._images.pop(key, None) is None:
            return False
        del self._meta[key]
        ext = self._extents.pop(key)
        if self._pins.get(key):
            self._held.setdefault(key, []).append(ext)
        else:
            self.arena.free(ext)
        return True

    def summary(self) -> dict:
        with self._lock:
            held = sum(e.size for exts in self._held.values() for e in exts)
            return {
                **super().summary(),
                "bytes_used": self.arena.used,
                "bytes_held_removed": held,
                **self.arena.summary(),
            }
