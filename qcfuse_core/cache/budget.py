"""The engine's KV budget: room for the running requests' KV caches, the pool of idle KV
buffers, and the size of the store's chunk tier on the compute device - one budget.

    budget = kv_cache_bytes, else on CUDA kv_memory_share x the memory free at the first
             reservation (idle pooled buffers and the chunk tier counted as free), else
             (a CPU) no limit

    |<----------------------------- budget ----------------------------->|
    | reservation | reservation | ... | idle pool |   device chunk tier  |
      (running requests, each its KV      (CUDA)    what is left (at most
       buffer: prompt + max_new_tokens)             its own cap)

`reserve(tokens)` admits a request's KV cache -> a `Reservation`, or None while the running
requests hold the room (or chunk entries a load is reading from, briefly): the request waits.
Idle pooled buffers give way first, then chunk entries by the tier's policy; the tier is
resized at each reservation and each `release`. `Reservation.kv()` is the request's buffer:
a pooled one chosen at `reserve`, or allocated at its first call. A reservation counts the
bytes of the buffer it hands out, so what the running requests hold never exceeds the budget.

Thread-safe: `reserve` and `release` resize the chunk tier in turn under one lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.model.fusion import KVCache, check_kv_dtype
from qcfuse_core.store import ChunkStore
from qcfuse_core.store.sizing import gpu_budget_bytes

KV_POOL = 1  # idle KV buffers kept for the next request (CUDA)


class KVBudgetError(ValueError):
    """A request's KV cache (its prompt plus max_new_tokens) is larger than the engine's whole
    KV budget (`CacheConfig.kv_cache_bytes` / `kv_memory_share`): it could never be admitted.
    Shorten the prompt or max_new_tokens, or raise the budget."""


@dataclass(eq=False)
class Reservation:
    """The room one running request holds in the engine's KV budget, from `KVBudget.reserve`
    until `KVBudget.release`: `nbytes`, exactly the bytes of the buffer `kv()` hands out
    (room for at least `tokens` tokens)."""

    tokens: int
    nbytes: int
    _adapter: ModelAdapter = field(repr=False)
    _cache: KVCache | None = field(default=None, repr=False)
    kv_dtype: str = "auto"  # the buffer's (`CacheConfig.kv_dtype`)
    _released: bool = field(default=False, repr=False)

    def kv(self) -> KVCache:
        """The request's KV buffer: a pooled one (emptied when reserved) or, at the first call,
        a new one of `tokens` rows; the same object on later calls (a prefill run again
        writes into it from row 0)."""
        if self._released:
            raise RuntimeError("this reservation was released: its KV buffer is no longer the request's")
        if self._cache is None:
            self._cache = KVCache(self._adapter, self.tokens, self.kv_dtype)
        return self._cache


def _nbytes(cache: KVCache) -> int:
    return cache.nbytes


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


class KVBudget:
    """Reservations, the idle KV pool and the device chunk tier's size of one engine
    (`engine.kv_budget`; the module docstring).

    store: its chunk tier on the adapter's device is sized here (`ChunkStore.device_tier`,
    `fit_device_tier`). kv_cache_bytes / kv_memory_share / kv_dtype: `CacheConfig`'s (fp8:
    a request's buffer is e4m3 codes and their scales, about half of bf16's). pool: idle
    buffers kept for reuse (default: KV_POOL on CUDA; none on a CPU, whose allocator is
    cheap)."""

    def __init__(
        self,
        adapter: ModelAdapter,
        store: ChunkStore,
        *,
        kv_cache_bytes: int | None = None,
        kv_memory_share: float = 0.8,
        pool: int | None = None,
        kv_dtype: str = "auto",
    ) -> None:
        if pool is not None and pool < 0:
            raise ValueError(f"pool must be >= 0 idle buffers, got {pool}")
        self.adapter, self.store = adapter, store
        self.pool_size = pool if pool is not None else KV_POOL if adapter.device.type == "cuda" else 0
        self.kv_cache_bytes, self.kv_memory_share = kv_cache_bytes, kv_memory_share
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self._total: int | None = None  # bytes (0: no limit); sized at the first reservation
        self._reserved: list[Reservation] = []  # those of the running requests
        self._pool: list[KVCache] = []  # idle buffers, the most recently given back first
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ requests
    def reserve(self, tokens: int) -> Reservation | None:
        """Room for a request's KV cache of `tokens` tokens (prompt + max_new_tokens) beside the
        running requests' -> its Reservation (give it back with `release` when the request
        ends), or None while the running requests (or chunk entries being read) hold the
        room: the request waits. Raises KVBudgetError for a cache larger than the whole
        budget. A pooled buffer of `tokens` to 2 x `tokens` rows is reused where its bytes
        fit (the reservation then counts them); else the reservation counts `tokens` rows."""
        if tokens <= 0:
            raise ValueError(f"a KV reservation needs a positive token count, got {tokens}")
        need = KVCache.bytes_for(self.adapter, tokens, self.kv_dtype)
        with self._lock:
            total = self._size()
            if total and need > total:
                raise KVBudgetError(
                    f"the request's KV cache ({tokens} tokens, {_size(need)}) exceeds the engine's KV budget "
                    f"({_size(total)}: CacheConfig.kv_cache_bytes / kv_memory_share)"
                )
            held = self._held()
            cache = self._from_pool(tokens)
            nbytes = need if cache is None else _nbytes(cache)
            if total:
                if held + self._pooled() + nbytes > total:
                    self._pool = []  # idle buffers give way first
                if held + nbytes > total or not self._fit_tier(total - held - nbytes - self._pooled()):
                    self._give_back(cache)  # the running requests, or chunk entries being read, hold the room
                    return None
            if cache is not None:
                cache.length = 0
            reservation = Reservation(tokens, nbytes, self.adapter, cache, kv_dtype=self.kv_dtype)
            self._reserved.append(reservation)
            return reservation

    def release(self, reservation: Reservation | None) -> None:
        """The request of `reservation` has ended: its buffer goes to the pool (where one is
        kept) and its room to the chunk tier. Idempotent; None is allowed."""
        if reservation is None:
            return
        with self._lock:
            if reservation._released:
                return
            self._reserved = [r for r in self._reserved if r is not reservation]
            cache, reservation._cache, reservation._released = reservation._cache, None, True
            self._give_back(cache)
            total = self._size()
            if total:
                self._fit_tier(total - self._held() - self._pooled())

    # ------------------------------------------------------------------ counts
    def reserved_bytes(self) -> int:
        """Bytes the running requests' reservations hold."""
        with self._lock:
            return self._held()

    def pooled_bytes(self) -> int:
        """Bytes held by the idle buffers of the pool."""
        with self._lock:
            return self._pooled()

    def drop_pool(self) -> None:
        """Free the pool's idle buffers (an idle engine keeps nothing on the device)."""
        with self._lock:
            self._pool = []

    # ------------------------------------------------------------------ under the lock
    def _held(self) -> int:
        return sum(r.nbytes for r in self._reserved)

    def _pooled(self) -> int:
        return sum(_nbytes(c) for c in self._pool)

    def _from_pool(self, tokens: int) -> KVCache | None:
        """An idle buffer of `tokens` to 2 x `tokens` rows, taken out of the pool (allocating
        gigabytes per request costs the allocator's time). It fits the budget: reserved and
        pooled bytes never exceed it together, as a buffer enters the pool only from a
        reservation."""
        for i, c in enumerate(self._pool):
            if tokens <= c.capacity <= 2 * tokens:
                return self._pool.pop(i)
        return None

    def _give_back(self, cache: KVCache | None) -> None:
        if cache is not None and self.pool_size:
            self._pool = [cache] + self._pool[: self.pool_size - 1]

    def _fit_tier(self, room: int) -> bool:
        """Size the device chunk tier to `room` -> False when entries being read (pinned) or
        filled (claimed) hold more than that."""
        return self.store.fit_device_tier(self.adapter.device, room)

    def _size(self) -> int:
        """The budget in bytes (0: no limit), sized once; the chunk tier starts with all of it."""
        if self._total is None:
            dev = self.adapter.device
            tier = self.store.device_tier(dev)
            if self.kv_cache_bytes is not None:
                self._total = self.kv_cache_bytes
            elif dev.type == "cuda":
                free, _ = torch.cuda.mem_get_info(dev)
                cached = tier.bytes_used if tier is not None else 0
                self._total = gpu_budget_bytes(free, self.kv_memory_share, self._pooled() + cached)
            else:
                self._total = 0
            if self._total:
                self._fit_tier(self._total - self._held() - self._pooled())
        return self._total
