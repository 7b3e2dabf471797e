"""A host-memory arena: a few large allocations (slabs) carved into extents, so an entry
image occupies its own size (rounded up to ALIGN), not the power of two torch's pinned
allocator gives each block (a 600-token chunk took the room of 1,024).

    slab 0 (SLAB_BYTES)  | ext | ext |  hole  | ext |       hole        |
    slab 1 (SLAB_BYTES)  | ext |              hole                      |
    capacity             | slab 0     | slab 1     | .... unreserved .... |

What must hold:
- slabs are allocated lazily, as extents need room: SLAB_BYTES each, an extent larger than
  that gets a slab of its own size (its rest, once freed, is room for others), the last one
  what the capacity leaves; the slabs' bytes never exceed `capacity`;
- each slab is tiled exactly by its extents and holes, in address order; no two holes touch
  (a freed extent coalesces with both neighbours); `used` is the extents' bytes;
- allocation is best fit over every hole (smallest hole that fits, then the lowest slab and
  offset): O(holes), and holes are fewer than extents + slabs;
- a freed extent is *retired*, not reused, until `reclaim` finds (1) no tensor view of it
  alive anywhere (a reader may still hold an image: each `Extent.tensor()` keeps the
  extent's buffer object alive, counted by CPython's reference count) and then, when the
  extent was handed to readers (`expose`) and a fence is set (under CUDA: a device
  synchronisation), (2) the fence passed: an async host-to-device copy enqueued from it
  has finished. Retired extents stay in `used` until reclaimed.

Page-locking (pin=True, CUDA hosts): each slab is plain memory registered with
cudaHostRegister at its exact size (torch's pinned allocator would round it up to a power
of two); the pages are touched first, by torch's threads, and unregistered when the slab is
released or collected.

Thread safety: none of its own. The owner (`host_tier.HostTier`) calls it under its lock;
an extent's tensor is read and written outside the lock only by whoever holds the extent.
"""

from __future__ import annotations

import bisect
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

ALIGN = 64  # extent offsets and sizes: a cache line; the entry layout pads its header to 64 too
SLAB_BYTES = 1 << 30


def _align_up(n: int, a: int) -> int:
    return -(-n // a) * a


class Extent:
    """`nbytes` bytes at `offset` in a slab, charged `size` (nbytes rounded up to the
    arena's alignment). `tag` is the owner's (the host tier keeps the entry's key there)."""

    __slots__ = ("slab", "offset", "size", "nbytes", "tag", "exposed", "_buf", "_refs")

    def __init__(self, slab: "Slab", offset: int, size: int, nbytes: int) -> None:
        self.slab = slab
        self.offset = offset
        self.size = size
        self.nbytes = nbytes
        self.tag: object = None
        self.exposed = False  # handed to readers: its reuse waits for the fence
        self._buf: np.ndarray | None = slab.buf[offset : offset + nbytes]
        self._refs = sys.getrefcount(self._buf)

    @property
    def nbytes_charged(self) -> int:
        return self.size

    def tensor(self) -> torch.Tensor:  # (nbytes,) uint8
        """A uint8 view of exactly `nbytes` bytes; while it (or any view of it) lives, the
        extent is not reused, even after `HostArena.free`."""
        if self._buf is None:
            raise ValueError("extent was reclaimed")
        return torch.from_numpy(self._buf)

    def in_use(self) -> bool:
        """A tensor view of this extent is alive somewhere."""
        return self._buf is not None and sys.getrefcount(self._buf) > self._refs


class Slab:
    """One allocation: `buf` (a numpy view of `data`, what extents slice), its holes
    (offset -> size, `starts` sorted) and extents (offset -> Extent)."""

    def __init__(self, index: int, data: torch.Tensor) -> None:
        self.index = index
        self.data = data  # (size,) uint8
        self.size = data.numel()
        self.buf = data.numpy()
        self.holes: dict[int, int] = {0: self.size}
        self.starts: list[int] = [0]
        self.extents: dict[int, Extent] = {}
        self.release: Callable[[], None] | None = None  # unregisters page-locked memory

    def empty(self) -> bool:
        return not self.extents

    def add_hole(self, offset: int, size: int) -> None:
        """Free [offset, offset+size), coalescing with the holes on either side."""
        i = bisect.bisect_left(self.starts, offset)
        end = offset + size
        if end in self.holes:  # the next hole
            size += self.holes.pop(end)
            self.starts.pop(i)
        if i > 0:
            prev = self.starts[i - 1]
            if prev + self.holes[prev] == offset:
                self.holes[prev] += size
                return
        self.holes[offset] = size
        self.starts.insert(i, offset)

    def take(self, offset: int, size: int) -> None:
        """Allocate the first `size` bytes of the hole at `offset`."""
        hole = self.holes.pop(offset)
        i = bisect.bisect_left(self.starts, offset)
        self.starts.pop(i)
        if hole > size:
            self.holes[offset + size] = hole - size
            self.starts.insert(i, offset + size)

    def segments(self) -> list[tuple[int, int, Extent | None]]:
        """(offset, size, extent or None for a hole) in address order."""
        segs: list[tuple[int, int, Extent | None]] = [(o, s, None) for o, s in self.holes.items()]
        segs += [(o, e.size, e) for o, e in self.extents.items()]
        segs.sort(key=lambda s: s[0])
        return segs


@dataclass(frozen=True)
class ArenaPlan:
    """Owned extents whose freeing makes room for an allocation (`HostArena.plan`)."""

    victims: tuple[Extent, ...]
    bytes: int  # the victims' charged bytes


class _Room:
    """What counts as room during a `plan` walk: holes, retired extents nobody reads, and the
    victims added so far; per slab, how many extents must still stay."""

    def __init__(self, arena: "HostArena", size: int) -> None:
        self.arena = arena
        self.size = size
        self.free = {id(e) for e in arena._retired if not e.in_use()}
        self.retired = {id(e) for e in arena._retired}
        self.staying = {s.index: sum(id(e) not in self.free for e in s.extents.values()) for s in arena.slabs}

    def add(self, ext: Extent) -> None:
        self.free.add(id(ext))
        self.staying[ext.slab.index] -= 1

    def victims_in(self, slab: Slab) -> list[Extent]:
        return [e for e in slab.extents.values() if id(e) not in self.retired]

    def victim_bytes(self, slab: Slab) -> int:
        return sum(e.size for e in self.victims_in(slab))

    def releasable(self) -> list[Slab]:
        return [s for s in self.arena.slabs if self.staying[s.index] == 0]

    def best(self, slabs: list[Slab]) -> tuple[int, list[Extent]] | None:
        """The candidate with the fewest victim bytes: windows in `slabs`, or slabs given back."""
        size, best = self.size, None

        def offer(victims: list[Extent]) -> None:
            nonlocal best
            b = sum(e.size for e in victims)
            if best is None or b < best[0]:
                best = (b, victims)

        for slab in slabs:
            if slab.size < size:
                continue
            runs: list[list[tuple[int, Extent | None]]] = [[]]  # segments between ones that stay
            for _, n, ext in slab.segments():
                if ext is None or id(ext) in self.free:
                    runs[-1].append((n, ext))
                else:
                    runs.append([])
            for run in runs:  # the minimal window from each start
                j, span = 0, 0
                for i in range(len(run)):
                    while j < len(run) and span < size:
                        span += run[j][0]
                        j += 1
                    if span < size:
                        break
                    offer([e for _, e in run[i:j] if e is not None and id(e) not in self.retired])
                    span -= run[i][0]
        arena = self.arena
        room = arena.capacity - arena.reserved
        if arena._slab_size(size, room) is not None:
            offer([])
        else:
            chosen: list[Extent] = []
            for slab in sorted(self.releasable(), key=self.victim_bytes):
                room += slab.size
                chosen += self.victims_in(slab)
                if arena._slab_size(size, room) is not None:
                    offer(chosen)
                    break
        return best


def page_locked(nbytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
    """`nbytes` of host memory page-locked with cudaHostRegister -> (tensor, unregister)."""
    data = torch.empty(nbytes, dtype=torch.uint8)
    data.zero_()  # fault the pages in on torch's threads (registration alone does it on one)
    cudart = torch.cuda.cudart()
    ptr = data.data_ptr()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if err != cudart.cudaError.success:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {err}")
    return data, weakref.finalize(data, cudart.cudaHostUnregister, ptr)


class HostArena:
    """Extents carved out of slabs of host memory under a byte `capacity` (module docstring).

    pin: page-lock the slabs (CUDA hosts). fence: called before reusing extents that were
    exposed to readers (under CUDA: `torch.cuda.synchronize`, so async copies out of them
    are done). slab_bytes: a slab's size (larger extents get their own); align: extents'
    offsets and sizes are multiples of it (a power of two)."""

    def __init__(
        self,
        capacity: int,
        *,
        pin: bool = False,
        slab_bytes: int = SLAB_BYTES,
        align: int = ALIGN,
        fence: Callable[[], None] | None = None,
    ) -> None:
        if capacity < 0:
            raise ValueError(f"arena capacity must be >= 0, got {capacity}")
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        if slab_bytes < align or slab_bytes % align:
            raise ValueError(f"slab_bytes must be a positive multiple of align ({align}), got {slab_bytes}")
        self.capacity = int(capacity)
        self.pin = pin
        self.slab_bytes = slab_bytes
        self.align = align
        self.fence = fence
        self.slabs: list[Slab] = []
        self.used = 0  # bytes of extents (live and retired)
        self.reserved = 0  # bytes of slabs
        self.fences = 0  # fences run (tests, stats)
        self._retired: list[Extent] = []
        self._next_index = 0

    # -- sizes --------------------------------------------------------------------------------
    def charge(self, nbytes: int) -> int:
        """Bytes an extent of `nbytes` occupies."""
        return _align_up(max(1, nbytes), self.align)

    def fits_ever(self, nbytes: int) -> bool:
        """An extent of `nbytes` fits an empty arena."""
        return self.charge(nbytes) <= self.capacity - self.capacity % self.align

    def _slab_size(self, size: int, room: int) -> int | None:
        """The slab to allocate for an extent of `size` with `room` unreserved bytes, or None."""
        want = max(self.slab_bytes, size)
        if want <= room:
            return want
        got = room - room % self.align
        return got if got >= size else None

    @property
    def retired_bytes(self) -> int:
        return sum(e.size for e in self._retired)

    def largest_free(self) -> int:
        """The largest extent `alloc` would place now without reclaiming anything."""
        hole = max((s for slab in self.slabs for s in slab.holes.values()), default=0)
        room = self.capacity - self.reserved
        return max(hole, room - room % self.align)

    def fragmentation(self) -> float:
        """1 - largest free extent / free bytes (0: the free room is one extent)."""
        free = self.capacity - self.used
        return 0.0 if free <= 0 else 1.0 - self.largest_free() / free

    # -- allocation ---------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> Extent | None:
        """An extent of `nbytes` (best fit; a new slab when no hole fits and the capacity
        allows; reclaiming retired extents, then releasing empty slabs, when not) -> None
        when there is no room without freeing owned extents."""
        if nbytes <= 0:
            raise ValueError(f"an extent needs at least one byte, got {nbytes}")
        size = self.charge(nbytes)
        if size > self.capacity:
            return None
        ext = self._take(size, nbytes)
        if ext is None and self._grow(size):
            ext = self._take(size, nbytes)
        if ext is None and self._retired:
            self.reclaim()
            ext = self._take(size, nbytes)
        if ext is None and self._grow(size, release=True):
            ext = self._take(size, nbytes)
        return ext

    def has_room(self, nbytes: int) -> bool:
        """`alloc(nbytes)` would succeed without freeing owned extents (reclaims retired ones
        to tell)."""
        size = self.charge(nbytes)
        if self._fits_now(size):
            return True
        if self._retired:
            self.reclaim()
        return (
            self._fits_now(size)
            or self._slab_size(size, self.capacity - self.reserved + self._empty_bytes()) is not None
        )

    def reserve(self, nbytes: int) -> int:
        """Allocate slabs until their free room is at least `nbytes` (or the capacity allows
        no more) -> the free bytes in the slabs."""
        while self.reserved - self.used < nbytes and self._grow(self.align):
            pass
        return self.reserved - self.used

    def _fits_now(self, size: int) -> bool:
        if any(s >= size for slab in self.slabs for s in slab.holes.values()):
            return True
        return self._slab_size(size, self.capacity - self.reserved) is not None

    def _empty_bytes(self) -> int:
        return sum(s.size for s in self.slabs if s.empty())

    def _take(self, size: int, nbytes: int) -> Extent | None:
        best: tuple[int, int, int, Slab] | None = None
        for slab in self.slabs:
            for off, hs in slab.holes.items():
                if hs >= size and (best is None or (hs, slab.index, off) < best[:3]):
                    best = (hs, slab.index, off, slab)
        if best is None:
            return None
        _, _, off, slab = best
        slab.take(off, size)
        ext = Extent(slab, off, size, nbytes)
        slab.extents[off] = ext
        self.used += size
        return ext

    def _grow(self, size: int, *, release: bool = False) -> bool:
        """Allocate a slab that fits `size` (release: empty slabs first give back their bytes
        while that is what stands in the way) -> False when the capacity does not allow."""
        n = self._slab_size(size, self.capacity - self.reserved)
        if n is None and release:
            for slab in sorted((s for s in self.slabs if s.empty()), key=lambda s: s.size):
                self._release(slab)
                n = self._slab_size(size, self.capacity - self.reserved)
                if n is not None:
                    break
        if n is None:
            return False
        if self.pin:
            data, unregister = page_locked(n)
        else:
            data, unregister = torch.empty(n, dtype=torch.uint8), None
        slab = Slab(self._next_index, data)
        slab.release = unregister
        self._next_index += 1
        self.slabs.append(slab)
        self.reserved += n
        return True

    def _release(self, slab: Slab) -> None:
        assert slab.empty(), "only an empty slab is released"
        self.slabs.remove(slab)
        self.reserved -= slab.size
        if slab.release is not None:
            slab.release()

    def release_empty(self) -> int:
        """Give back every empty slab (reclaiming first) -> bytes released."""
        self.reclaim()
        empty = [s for s in self.slabs if s.empty()]
        for slab in empty:
            self._release(slab)
        return sum(s.size for s in empty)

    # -- freeing ------------------------------------------------------------------------------
    def free(self, ext: Extent) -> None:
        """Retire `ext`: its bytes become room once `reclaim` finds nobody reading them."""
        if ext.slab.extents.get(ext.offset) is not ext or ext in self._retired:
            raise ValueError("extent is not live in this arena")
        self._retired.append(ext)

    def reclaim(self) -> int:
        """Turn retired extents that nobody reads any more into holes (running the fence
        first when one of them was exposed) -> bytes reclaimed."""
        ready = [e for e in self._retired if not e.in_use()]
        if not ready:
            return 0
        if self.fence is not None and any(e.exposed for e in ready):
            self.fence()
            self.fences += 1
        for ext in ready:
            self._retired.remove(ext)
            slab = ext.slab
            del slab.extents[ext.offset]
            slab.add_hole(ext.offset, ext.size)
            ext._buf = None
            self.used -= ext.size
        return sum(e.size for e in ready)

    # -- eviction planning --------------------------------------------------------------------
    def plan(self, nbytes: int, order: Iterable[Extent]) -> ArenaPlan | None:
        """Owned extents to free so that an extent of `nbytes` fits, or None (nothing to
        free) when freeing every extent `order` yields would not do.

        order: the owner's live extents that may go, in its policy's eviction order (pinned
        ones and ones being filled never appear). Room is holes, retired extents nobody
        reads, and the victims walked so far. The walk stops at the first victim after which
        contiguous room exists - a window of adjacent segments in one slab, or whole slabs
        that can be given back so that a new slab fits - and frees the candidate with the
        fewest bytes. So the policy decides how far it goes (it never frees an entry the
        policy would have kept while evicting until room formed) and contiguity what it
        frees, usually far less than everything walked."""
        size = self.charge(nbytes)
        if size > self.capacity:
            return None
        room = _Room(self, size)
        best = room.best(self.slabs)
        if best is None:
            for ext in order:
                room.add(ext)
                best = room.best([ext.slab])
                if best is not None:
                    break
        return None if best is None else ArenaPlan(tuple(best[1]), best[0])

    def shrink_plan(self, capacity: int, order: Iterable[Extent]) -> list[Extent] | None:
        """Owned extents to free so that whole slabs can be given back until the slabs fit
        `capacity` (walking `order` as `plan` does, then the slabs with the fewest victim
        bytes), or None when freeing every extent `order` yields would not do."""
        need = self.reserved - capacity
        if need <= 0:
            return []
        room = _Room(self, 0)
        it = iter(order)
        while sum(s.size for s in room.releasable()) < need:
            ext = next(it, None)
            if ext is None:
                return None
            room.add(ext)
        victims: list[Extent] = []
        for slab in sorted(room.releasable(), key=room.victim_bytes):
            if need <= 0:
                break
            need -= slab.size
            victims += room.victims_in(slab)
        return victims

    def shrink(self, capacity: int) -> bool:
        """Set a capacity no larger than now: gives back empty slabs until the slabs fit ->
        False, changing nothing, when they do not."""
        if capacity >= self.reserved:
            self.capacity = capacity
            return True
        self.reclaim()
        empty = sorted((s for s in self.slabs if s.empty()), key=lambda s: -s.size)
        need, drop = self.reserved - capacity, []
        for slab in empty:
            if need <= 0:
                break
            drop.append(slab)
            need -= slab.size
        if need > 0:
            return False
        for slab in drop:
            self._release(slab)
        self.capacity = capacity
        return True

    # -- inspection ---------------------------------------------------------------------------
    def segments(self) -> Iterator[tuple[int, int, int, Extent | None]]:
        """(slab index, offset, size, extent or None for a hole), slab by slab in address order."""
        for slab in self.slabs:
            for off, size, ext in slab.segments():
                yield slab.index, off, size, ext

    def summary(self) -> dict:
        return {
            "arena_slabs": len(self.slabs),
            "arena_bytes_allocated": self.reserved,
            "arena_retired_bytes": self.retired_bytes,
            "largest_free_bytes": self.largest_free(),
            "fragmentation": round(self.fragmentation(), 4),
        }
