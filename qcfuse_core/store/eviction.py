"""Eviction policies: each is one priority function; the entry with the smallest priority goes.

Ticks are a per-tier logical clock (one tick per insert or access), not wall time, so the
order is exact and testable. Ties break on the insert tick, so every order is total.

    lru   least recently used           (last_access,)
    lfu   least frequently used         (hits, last_access)
    fifo  first in, first out           (inserted,)
    size  largest first                 (-nbytes, last_access)
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


POLICIES: dict[str, EvictionPolicy] = {
    p.name: p
    for p in (
        EvictionPolicy("lru", lambda m: (m.last_access,)),
        EvictionPolicy("lfu", lambda m: (m.hits, m.last_access)),
        EvictionPolicy("fifo", lambda m: (m.inserted,)),
        EvictionPolicy("size", lambda m: (-m.nbytes, m.last_access)),
    )
}


def get_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; valid: {sorted(POLICIES)}") from None
