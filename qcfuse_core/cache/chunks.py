"""The chunk-cache manager: what every request of one engine shares about chunk caches.

    lookup        a request's pieces -> what is cached and where, misses built now
                  (`ChunkCaches.lookup` -> `LookedUp`, cache/lookup.py)
    store, texts  the chunk store and the chunk-text index (which registered chunk texts a
                  rendered prompt holds: `texts.find`, what `engine.complete` serves from)
    token cache   chunk text -> (token ids, ChunkKey), tokenised and hashed once (LRU)
    links         node id -> key, written to the store once per process
    prefixes      prompt-template caches kept on the compute device (exact for every request)
    KV pool       fused-prompt caches of finished requests, reused on CUDA
    GPU budget    one budget for the running requests' KV caches and the store's GPU chunk
                  tier: a request is admitted with a `Reservation` (`reserve`), released
                  when it ends; what the reservations (and the idle KV pool) leave is the
                  chunk tier's capacity, so chunk entries give way the moment a request
                  needs their room
    building      caches of chunks not stored yet: prefilled many per forward pass
                  (`ingest.prefill_alone_batch`), anchors and probe sidecars added, written
                  to the store off the compute thread
    views         a stored chunk's probe sidecar + its layers streamed by the prefetcher

It holds no state of any one request; its dictionaries are guarded by one lock (dict
updates only, never held across model or store work).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from qcfuse_core.cache import subspans
from qcfuse_core.cache.lookup import GLUE_CHARS, LookedUp, Part, check_context
from qcfuse_core.cache.prefetch import ChunkView, PrefetchConfig, Prefetcher, ensure_sidecar, probe_sidecar
from qcfuse_core.ingest import prefill as ingest
from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.model.fusion import KVCache
from qcfuse_core.retrieval.texts import ChunkTextIndex
from qcfuse_core.selection import profiles
from qcfuse_core.selection.anchors import ensure_anchors
from qcfuse_core.selection.options import QCFuseOptions
from qcfuse_core.store import ChunkStore
from qcfuse_core.store.sizing import gpu_budget_bytes
from qcfuse_core.types import ChunkKey, KVChunk, NodeId, Piece

log = logging.getLogger(__name__)

TOKEN_CACHE = 8192  # chunk texts whose token ids and keys are kept (about 8 KB each at 1K tokens)
PREFIX_CACHE = 8  # prefix caches kept on the compute device (prompt templates)
KV_POOL = 1  # fused-prompt caches kept for the next request (CUDA)
WRITERS = 8  # store-writer threads of ingestion on CUDA (a write is mostly waiting: pinning, copies, file)


class KVBudgetError(ValueError):
    """A request's KV cache (its prompt plus max_new_tokens) is larger than the engine's whole
    KV budget (`CacheConfig.kv_cache_bytes` / `kv_memory_share`): it could never be admitted.
    Shorten the prompt or max_new_tokens, or raise the budget."""


@dataclass(eq=False)
class Reservation:
    """KV cache bytes one running request holds within the engine's KV budget, from
    `ChunkCaches.reserve` until `ChunkCaches.release`."""

    nbytes: int


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


class ChunkCaches:
    """The store, the chunk-text index, token ids, keys, prefix caches, the KV pool and cache
    building of one engine (`engine.caches`).

    `options` returns the engine's current selection options (anchors and critical layers
    of the probe sidecars follow them); `sink`: token ids chunks are cached after
    (`CacheConfig.chunk_sink`), or None. kv_cache_bytes / kv_memory_share: the KV budget
    (`CacheConfig`'s; see `reserve`). texts: the chunk-text index (default: one in memory).
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        store: ChunkStore,
        options: Callable[[], QCFuseOptions],
        sink: torch.Tensor | None = None,
        prefetch: PrefetchConfig | None = None,
        *,
        kv_cache_bytes: int | None = None,
        kv_memory_share: float = 0.8,
        texts: ChunkTextIndex | None = None,
    ) -> None:
        self.adapter, self.store, self._options, self.sink = adapter, store, options, sink
        self.texts = texts if texts is not None else ChunkTextIndex()
        self.kv_cache_bytes, self.kv_memory_share = kv_cache_bytes, kv_memory_share
        # layer-wise loading needs a store that keeps probe sidecars (the tiered store)
        self.prefetcher = Prefetcher(adapter, store, prefetch or PrefetchConfig()) if store.streams_layers else None
        # the namespace of the chunk keys: the model's, or its own for sink caches
        self.fingerprint = (
            adapter.fingerprint()
            if sink is None
            else hashlib.sha256(f"{adapter.fingerprint()}|sink={sink.tolist()}".encode()).hexdigest()[:16]
        )
        self._profile: profiles.Profile | None = None  # resolved on first use
        self._lock = threading.Lock()
        self._tokens: OrderedDict[str, tuple[torch.Tensor, ChunkKey | None]] = OrderedDict()
        self._prefixes: OrderedDict[ChunkKey, KVChunk] = OrderedDict()  # on the compute device
        self._linked: OrderedDict[tuple[str, ChunkKey], None] = OrderedDict()
        self._pool: list[KVCache] = []
        self._kv_budget: int | None = None  # bytes (0: no limit); sized at the first reservation
        self._reserved: list[Reservation] = []  # those of the running requests
        self._budget_lock = threading.Lock()  # reserve / release resize the chunk tier in turn

    # ------------------------------------------------------------------ a request's lookup
    def lookup(self, pieces: Sequence[Piece], *, fused: bool, streaming: bool | None = None) -> LookedUp:
        """What of `pieces` is cached, and where: token ids per piece (tokenised once per chunk
        text), the chunk keys, the tier or in-memory cache of each chunk; the misses are
        built and stored now (cache/lookup.py). Raises ValueError for a prompt longer than
        the model's positions, before anything is built.

        fused: the request fuses chunk caches (else only tokens are looked up: full
        prefill). streaming (default: a store that streams layers, and fused): chunks stay
        in the store, streamed by the prefetcher; otherwise they come back in memory."""
        streaming = (self.prefetcher is not None and fused) if streaming is None else streaming
        parts: list[Part] = []
        on_disk: list[ChunkKey] = []  # chunks held only by the disk tier
        for p in pieces:
            cached = fused and p.kind in ("prefix", "chunk")
            if p.kind in ("prefix", "chunk"):
                ids, key = self.chunk_tokens(p.text)
            elif p.kind == "text" and len(p.text) <= GLUE_CHARS:  # glue between chunks repeats request to request
                ids, key = self.chunk_tokens(p.text)[0], None
            else:
                ids, key = self.tokenize(p.text), None
            if ids.numel() == 0:
                continue
            if not cached or key is None:
                parts.append(Part(p.kind, ids, p.node_id))
                continue
            if p.kind != "chunk" or p.source is None:
                self.link(p.node_id, key)
            if p.kind == "prefix":
                chunk, hit = self.prefix(key, ids)
                parts.append(Part("prefix", ids, p.node_id, key, None, chunk, hit))
            elif streaming:
                assert self.prefetcher is not None
                note_use = getattr(self.store, "note_use", None)
                if note_use is not None:  # admission into faster tiers goes by use
                    note_use(key)
                tier = self.prefetcher.tier_of(key)
                parts.append(Part("chunk", ids, p.node_id, key, tier, None, tier is not None))
                if tier == "disk":
                    on_disk.append(key)
            else:
                got = self.store.get(key)
                parts.append(
                    Part("chunk", ids, p.node_id, key, "host" if got is not None else None, got, got is not None)
                )
            if p.kind == "chunk" and p.source is not None:  # a re-rendered text: its runs from the source
                served = None if parts[-1].hit else self._subspans(parts[-1], p.source)
                if served:
                    parts[-1:] = served
                else:
                    self.link(p.node_id, key)
        check_context(self.adapter.max_positions, sum(int(p.ids.numel()) for p in parts))  # before building
        if on_disk:
            self._promote(on_disk)
        missing = {p.key: p.ids for p in parts if p.kind == "chunk" and p.key is not None and not p.hit}
        built = self.build(missing, keep=True)
        parts = [
            replace(p, chunk=built[p.key], tier="host") if p.key in built and p.kind == "chunk" else p for p in parts
        ]
        hits, n = subspans.count_chunks([p for p in parts if p.kind != "chunk" or p.key is not None], lambda p: p.hit)
        return LookedUp(tuple(parts), hits, n - hits)

    def _promote(self, keys: list[ChunkKey]) -> None:
        """Chunks a request uses that only the disk tier holds: with `promote_disk_reads`, those
        the store admits (from their second use, `StoreConfig.admission`) are copied into
        memory in the background, whether this request loads them from disk or the planner
        recomputes them (a disk slower than recompute would otherwise keep a hot chunk there
        for good)."""
        assert self.prefetcher is not None
        if not self.prefetcher.config.promote_disk_reads:
            return
        admits = getattr(self.store, "admits", lambda key: True)
        keys = [k for k in dict.fromkeys(keys) if admits(k)]
        if keys:
            self.prefetcher.promote(keys)

    # ------------------------------------------------------------------ tokens and keys
    def tokenize(self, text: str) -> torch.Tensor:
        if self.adapter.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids to the low-level fusion API")
        return torch.tensor(self.adapter.tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.int64)

    def chunk_tokens(self, text: str) -> tuple[torch.Tensor, ChunkKey | None]:
        """Token ids and cache key of a chunk (or prefix) text, tokenised and hashed once
        (the key is None for a text of no tokens)."""
        with self._lock:
            got = self._tokens.get(text)
            if got is not None:
                self._tokens.move_to_end(text)
                return got
        ids = self.tokenize(text)
        got = (ids, ChunkKey.for_tokens(self.fingerprint, ids)) if ids.numel() else (ids, None)
        with self._lock:
            self._tokens[text] = got
            while len(self._tokens) > TOKEN_CACHE:
                self._tokens.popitem(last=False)
        return got

    def is_stored(self, text: str) -> bool:
        """Whether the store holds the cache of a chunk text (never for a text of no tokens)."""
        key = self.chunk_tokens(text)[1]
        return key is not None and self.store.contains(key)

    def link(self, node_id: str | None, key: ChunkKey) -> None:
        """Link a node id to a key once per process (a manifest write, not per request)."""
        if node_id is None:
            return
        with self._lock:
            if (node_id, key) in self._linked:
                return
        self.store.link(NodeId(node_id), key)
        with self._lock:
            self._linked[(node_id, key)] = None
            while len(self._linked) > TOKEN_CACHE:
                self._linked.popitem(last=False)

    # ------------------------------------------------------------------ the probe's needs
    @property
    def critical_layers(self) -> list[int]:
        """The layers the probe reads: the selection options', else the model profile's
        (looked up once: the lookup reads files)."""
        opts = self._options()
        if opts.critical_layers:
            return list(opts.critical_layers)
        return self.profile().layers

    def profile(self) -> profiles.Profile:
        if self._profile is None:
            self._profile = profiles.resolve(self.adapter)
        return self._profile

    def add_anchors(self, chunk: KVChunk) -> None:
        """Ingestion-time anchors for qcfuse (chunk.anchors[method], layers 0..max critical)."""
        opts = self._options()
        if opts.anchor_method == "repeat" and self.adapter.tokenizer is None:
            return  # repeat anchors need a tokenizer; the selector reports it if asked for
        ensure_anchors(self.adapter, chunk, max(self.critical_layers) + 1, opts.anchors)

    def view(self, key: ChunkKey, ids: torch.Tensor, depth: int) -> ChunkView:
        """A stored chunk as the prefetcher streams it (its probe sidecar read now)."""
        assert self.prefetcher is not None
        crit, anchors = self.critical_layers, self._options().anchors
        try:
            return self.prefetcher.view(key, ids, depth=depth, critical=crit, anchors=anchors)
        except KeyError:  # stored before sidecars existed (or the sidecar was damaged): make it once
            ensure_sidecar(self.store, self.adapter, key, max(crit) + 1, crit, anchors)
            return self.prefetcher.view(key, ids, depth=depth, critical=crit, anchors=anchors)

    # ------------------------------------------------------------------ building caches
    def prefill_alone(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A segment alone at positions 0..n-1 -> pre-RoPE k, v (L, n, Hkv, D): the one
        definition of a cache (`ingest.prefill_alone`), used by ingestion too."""
        return ingest.prefill_alone(self.adapter, ids)

    def build(self, todo: dict[ChunkKey, torch.Tensor], *, keep: bool = False) -> dict[ChunkKey, KVChunk]:
        """Prefill and store the chunks in `todo` (key -> ids); keep: return them (with their
        anchors) for this request, else only store them (ingestion holds no batch longer
        than the writer's queue)."""
        if not todo:
            return {}
        keys, ids = list(todo), list(todo.values())
        dev = self.adapter.device
        self.critical_layers  # resolve the profile here, not on the writer thread
        built: dict[ChunkKey, KVChunk] = {}
        cuda = dev.type == "cuda"
        if cuda and not keep:
            sh = self.adapter.shape
            self.store.prepare_bulk(
                [
                    self.store.entry_bytes(
                        k, self.adapter.dtype, sh.num_layers, int(i.numel()), sh.num_kv_heads, sh.head_dim
                    )
                    for k, i in zip(keys, ids)
                ],
                WRITERS,
            )
        with ingest.StoreWriter(device=dev, synchronous=not cuda, workers=WRITERS, max_pending=2 * WRITERS) as writer:
            for batch in ingest.plan_batches([len(i) for i in ids], ingest.default_batch_tokens(dev)):
                kvs = ingest.prefill_alone_batch(self.adapter, [ids[j] for j in batch], sink=self.sink)
                chunks = [KVChunk(keys[j], ids[j].clone(), k, v) for j, (k, v) in zip(batch, kvs)]
                if keep:
                    for c in chunks:
                        self.add_anchors(c)
                        built[c.key] = c
                for c in chunks:  # one job per chunk: the writers share a batch
                    writer.submit(self._store_chunk, c, not keep)
        return built

    def _store_chunk(self, chunk: KVChunk, bulk: bool = False) -> None:
        """Anchors, cache and probe sidecar of a freshly built chunk (on a writer): the
        sidecar is written once, with the entry. bulk: ingestion (`TieredStore.put`)."""
        self.add_anchors(chunk)
        if self.prefetcher is None:
            self.store.put(chunk)
            return
        crit = self.critical_layers
        anchors, layer_keys = probe_sidecar(self.adapter, chunk, max(crit) + 1, crit, self._options().anchors)
        self.store.put(chunk, anchors=anchors, layer_keys=layer_keys, bulk=bulk)

    def build_texts(self, texts: Sequence[str], node_ids: Sequence[str | None]) -> list[ChunkKey]:
        """Ingestion of many chunk texts: the caches of those not stored yet are built; every
        text is linked to its node id."""
        toks = [self.chunk_tokens(t) for t in texts]
        keys: list[ChunkKey] = []
        todo: dict[ChunkKey, torch.Tensor] = {}
        for t, (ids, key) in zip(texts, toks):
            if key is None:
                raise ValueError(f"cannot cache an empty chunk (text {t[:40]!r})")
            keys.append(key)
            if key not in todo and not self.store.contains(key):
                todo[key] = ids
        self.build(todo)
        for nid, key in zip(node_ids, keys):
            self.link(nid, key)
        return keys

    def chunk_cache(self, ids: torch.Tensor, node_id: str | None = None) -> tuple[KVChunk, bool]:
        """The in-memory cache of a chunk's exact tokens: (chunk, hit). A miss computes and stores it."""
        if ids.numel() == 0:
            raise ValueError("cannot cache an empty chunk")
        key = ChunkKey.for_tokens(self.fingerprint, ids)
        self.link(node_id, key)
        chunk = self.store.get(key)
        if chunk is not None:
            return chunk, True
        return self.build({key: ids}, keep=True)[key], False

    def prefix(self, key: ChunkKey, ids: torch.Tensor) -> tuple[KVChunk, bool]:
        """The prefix's cache, kept on the compute device between requests (it is exact and
        the same for every request of a prompt template)."""
        with self._lock:
            chunk = self._prefixes.get(key)
            if chunk is not None:
                self._prefixes.move_to_end(key)
                return chunk, True
        chunk = self.store.get(key)
        hit = chunk is not None
        if chunk is None:
            k, v = self.prefill_alone(ids)
            chunk = KVChunk(key, ids.clone(), k, v)
            self.store.put(chunk)
        dev, dt = self.adapter.device, self.adapter.dtype
        chunk = KVChunk(key, chunk.token_ids, chunk.k.to(dev, dt), chunk.v.to(dev, dt))
        with self._lock:
            self._prefixes[key] = chunk
            while len(self._prefixes) > PREFIX_CACHE:
                self._prefixes.popitem(last=False)
        return chunk, hit

    def _subspans(self, part: Part, source: str) -> list[Part] | None:
        """The parts serving a chunk's token runs from the stored cache of the text it
        re-renders (subspans.py); None when that is not stored or shares no run."""
        _, src_key = self.chunk_tokens(source)
        stored = self.store.get(src_key) if src_key is not None else None
        served = subspans.serve(part.ids, part.node_id, stored, self.fingerprint) if stored is not None else None
        for p in served or ():
            if p.chunk is not None:
                self.add_anchors(p.chunk)
        return served

    # ------------------------------------------------------------------ the KV pool
    def take_kv(self, n: int) -> KVCache:
        """A fused-prompt cache with room for `n` tokens: the one a finished request gave back
        when it fits (allocating gigabytes per request costs the allocator's time)."""
        with self._lock:
            for i, c in enumerate(self._pool):
                if n <= c.capacity <= 2 * n:
                    c.length = 0
                    return self._pool.pop(i)
        return KVCache(self.adapter, n)

    def pooled_kv_bytes(self) -> int:
        """Bytes held by the idle caches of the pool."""
        with self._lock:
            return sum(c.k.nbytes + c.v.nbytes for c in self._pool)

    def drop_pooled_kv(self) -> None:
        """Free the pool's idle caches (the scheduler needs their memory for a new request)."""
        with self._lock:
            self._pool = []

    def give_kv(self, cache: KVCache | None) -> None:
        if cache is None or self.adapter.device.type != "cuda":  # on a CPU the allocator is cheap
            return
        with self._lock:
            self._pool = [cache] + self._pool[: KV_POOL - 1]

    def close(self) -> None:
        """Release the store (its memory tiers, files and manifest) and the chunk-text index."""
        self.drop_pooled_kv()
        self.store.close()
        self.texts.close()

    def forget_unreadable(self, key: ChunkKey) -> None:
        """A stored cache could not be read: delete it (the next lookup builds it again)."""
        self.store.delete(key)
        if self.prefetcher is not None:
            self.prefetcher.forget_sidecars()

    # ------------------------------------------------------------------ the GPU budget
    def reserve(self, tokens: int) -> Reservation | None:
        """Room for a request's KV cache of `tokens` tokens (prompt + max_new_tokens) beside the
        running requests' -> its Reservation (give it back with `release` when the request
        ends), or None while the running requests hold the room (or chunk entries a load is
        reading from, briefly): the request waits. Raises KVBudgetError for a cache larger than
        the whole budget.

        The budget is `kv_cache_bytes`, else on a CUDA device `kv_memory_share` of the memory
        free at the first reservation (idle pooled caches and the chunk tier counted as
        free), else (a CPU) no limit. It is shared: the store's GPU chunk tier holds what the
        reservations and the idle pool leave (at most `StoreConfig.gpu_bytes`). Idle pooled
        caches give way to a request that needs their room, then chunk entries, by the
        tier's policy; a chunk entry never makes a request wait longer than a load reading
        from it."""
        shape, dtype = self.adapter.shape, self.adapter.dtype
        need = 2 * tokens * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype.itemsize
        with self._budget_lock:
            budget = self._budget()
            if budget:
                if need > budget:
                    raise KVBudgetError(
                        f"the request's KV cache ({tokens} tokens, {_size(need)}) exceeds the engine's KV budget "
                        f"({_size(budget)}: CacheConfig.kv_cache_bytes / kv_memory_share)"
                    )
                held = self.reserved_kv_bytes()
                if held + self.pooled_kv_bytes() + need > budget:
                    self.drop_pooled_kv()  # idle buffers give way first
                if held + need > budget:
                    return None
                if not self._fit_tier(budget - held - need - self.pooled_kv_bytes()):
                    return None  # chunk entries being read hold the room until their loads end
            reservation = Reservation(need)
            with self._lock:
                self._reserved.append(reservation)
            return reservation

    def hold(self, reservation: Reservation, cache: KVCache) -> None:
        """The reservation now counts what the request's cache holds (a pooled cache may be
        larger than asked)."""
        with self._budget_lock:
            reservation.nbytes = cache.k.nbytes + cache.v.nbytes
            budget = self._budget()
            if budget:  # a larger pooled cache: the tier gives up the difference if it can
                self._fit_tier(budget - self.reserved_kv_bytes() - self.pooled_kv_bytes())

    def release(self, reservation: Reservation | None) -> None:
        """The request of `reservation` has ended: its room is free (the chunk tier's)."""
        with self._budget_lock:
            with self._lock:
                self._reserved = [r for r in self._reserved if r is not reservation]
            budget = self._budget()
            if budget:
                self._fit_tier(budget - self.reserved_kv_bytes() - self.pooled_kv_bytes())

    def reserved_kv_bytes(self) -> int:
        """Bytes the running requests' reservations hold."""
        with self._lock:
            return sum(r.nbytes for r in self._reserved)

    def device_tier(self):
        """The store's chunk tier on the compute device (`TieredStore.gpu`), or None."""
        tier = getattr(self.store, "gpu", None)
        return tier if tier is not None and tier.device.type == self.adapter.device.type else None

    def _fit_tier(self, room: int) -> bool:
        """Size the chunk tier to `room` (at most its cap), evicting by policy -> False when
        entries being read (pinned) or filled (claimed) hold more than that."""
        tier = self.device_tier()
        if tier is None:
            return True
        cap = getattr(self.store, "gpu_cap", None)
        return tier.resize(max(0, room if cap is None else min(cap, room))) is not None

    def _budget(self) -> int:
        if self._kv_budget is None:
            tier = self.device_tier()
            cached = tier.bytes_used if tier is not None else 0
            if self.kv_cache_bytes is not None:
                self._kv_budget = self.kv_cache_bytes
            elif self.adapter.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.adapter.device)
                self._kv_budget = gpu_budget_bytes(free, self.kv_memory_share, self.pooled_kv_bytes() + cached)
            else:
                self._kv_budget = 0  # no limit
            if self._kv_budget:  # the chunk tier starts with all of it
                self._fit_tier(self._kv_budget - self.reserved_kv_bytes() - self.pooled_kv_bytes())
        return self._kv_budget

    def size_budget(self) -> int:
        """Size the budget now (bytes; 0: no limit): the chunk tier has its room from here on,
        before the first request (the engine calls this once its model is loaded)."""
        with self._budget_lock:
            return self._budget()
