"""Eviction policies: each is one priority function; the entry with the smallest priority goes.

Ticks are a per-tier logical clock (one tick per insert or access), not wall time, so the
order is exact and testable. Ties break on the insert tick, so every order is total.

    lru   least recently used           (last_access,)
    lfu   least frequently used         (hits, last_access)
    fifo  first in, first out           (inserted,)
    size  largest first                 (-nbytes, last_access)
    slru  segmented LRU (the default)   entries used once (probation) go first, least
                                        recently used first; entries used again (protected)
                                        only while they hold more than PROTECTED_SHARE of
                                        the bytes, or nothing else is left

slru keeps a hot set against a long tail: under Zipf-like reuse a chunk seen once, the bulk
of the traffic, cannot push out one that keeps coming back; a protected segment capped below
the whole tier leaves newcomers room to earn their second use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from qcfuse_core.types import ChunkKey


@dataclass
class EntryMeta:
    key: ChunkKey
    nbytes: int
    inserted: int  # tick of insertion
    last_access: int  # tick of the last hit (or the insertion)
    hits: int = 0


@dataclass(frozen=True)
class EvictionPolicy:
    name: str
    priority: Callable[[EntryMeta], tuple]

    def victim(self, metas: list[EntryMeta]) -> EntryMeta:
        """The entry to evict next (smallest priority, then oldest insert)."""
        return min(metas, key=lambda m: (*self.priority(m), m.inserted))


PROTECTED_SHARE = 0.8  # slru: the most of a tier's held bytes entries used again keep


@dataclass(frozen=True)
class SegmentedLRU(EvictionPolicy):
    """slru (see the module docstring). `priority` alone orders probation before protection
    (what a caller ranking entries one by one gets); `victim` also demotes the protected
    segment's least recently used entry while that segment is over its share."""

    def victim(self, metas: list[EntryMeta]) -> EntryMeta:
        protected = [m for m in metas if m.hits > 0]
        probation = [m for m in metas if m.hits == 0]
        total = sum(m.nbytes for m in metas)
        over = sum(m.nbytes for m in protected) > PROTECTED_SHARE * total
        pick = protected if (over or not probation) else probation
        return min(pick, key=lambda m: (m.last_access, m.inserted))


POLICIES: dict[str, EvictionPolicy] = {
    p.name: p
    for p in (
        EvictionPolicy("lru", lambda m: (m.last_access,)),
        EvictionPolicy("lfu", lambda m: (m.hits, m.last_access)),
        EvictionPolicy("fifo", lambda m: (m.inserted,)),
        EvictionPolicy("size", lambda m: (-m.nbytes, m.last_access)),
        SegmentedLRU("slru", lambda m: (min(m.hits, 1), m.last_access)),
    )
}


def get_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; valid: {sorted(POLICIES)}") from None
