"""The chunk lookup: what every request of one engine shares about finding chunk caches.

    find          a request's pieces -> what is cached and where, misses built now
                  (`ChunkLookup.find` -> `LookedUp`, cache/lookup.py; building: cache/builder.py)
    token cache   chunk text -> (token ids, ChunkKey), tokenised and hashed once (LRU)
    links         node id -> key, written to the store once per process
    prefixes      prompt-template caches kept on the compute device (exact for every request)
    views         a stored chunk's probe sidecar + its layers streamed by the prefetcher; a
                  chunk stored without a readable sidecar gets one made once (`view`), one
                  unreadable altogether is deleted and built again (`rebuild`)

`ChunkCaches` is what callers read of it (`engine.caches`): the store, the chunk-text index
and a text's token ids and key. The engine's other parts are the builder (cache/builder.py)
and the KV budget (cache/budget.py).

It holds no state of any one request; its dictionaries are guarded by one lock (dict
updates only, never held across model or store work).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace

import torch

from qcfuse_core.cache import subspans
from qcfuse_core.cache.builder import ChunkBuilder
from qcfuse_core.cache.lookup import GLUE_CHARS, LookedUp, Part, check_context
from qcfuse_core.cache.prefetch import ChunkView, PrefetchConfig, Prefetcher, ensure_sidecar
from qcfuse_core.ingest import prefill as ingest
from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.retrieval.texts import ChunkTextIndex
from qcfuse_core.store import ChunkStore
from qcfuse_core.types import ChunkKey, KVChunk, NodeId, Piece

TOKEN_CACHE = 8192  # chunk texts whose token ids and keys are kept (about 8 KB each at 1K tokens)
PREFIX_CACHE = 8  # prefix caches kept on the compute device (prompt templates)


def salted(key: ChunkKey | None, salt: str | None) -> ChunkKey | None:
    """`key` in a tenant's own namespace (its fingerprint hashed with `salt`, as
    `CacheConfig.chunk_sink` gets one of its own): the same tokens under another salt, or
    none, are another cache. None or "": the shared key."""
    if key is None or not salt:
        return key
    fingerprint = hashlib.sha256(f"{key.fingerprint}|salt={salt}".encode()).hexdigest()[:16]
    return ChunkKey(fingerprint, key.token_hash)


class ChunkLookup:
    """Token ids, keys, links, prefix caches and views of one engine's chunks, and a
    request's lookup (`engine.lookup`; the module docstring).

    builder: builds the misses (and the anchors of sub-span caches); `sink`: token ids
    chunks are cached after (`CacheConfig.chunk_sink`), or None - the keys' namespace."""

    def __init__(
        self,
        adapter: ModelAdapter,
        store: ChunkStore,
        builder: ChunkBuilder,
        sink: torch.Tensor | None = None,
        prefetch: PrefetchConfig | None = None,
    ) -> None:
        self.adapter, self.store, self.builder = adapter, store, builder
        # layer-wise loading needs a store that keeps probe sidecars (the tiered store)
        self.prefetcher = Prefetcher(adapter, store, prefetch or PrefetchConfig()) if store.streams_layers else None
        # the namespace of the chunk keys: the model's, or its own for sink caches
        self.fingerprint = (
            adapter.fingerprint()
            if sink is None
            else hashlib.sha256(f"{adapter.fingerprint()}|sink={sink.tolist()}".encode()).hexdigest()[:16]
        )
        self._lock = threading.Lock()
        self._tokens: OrderedDict[str, tuple[torch.Tensor, ChunkKey | None]] = OrderedDict()
        self._prefixes: OrderedDict[ChunkKey, KVChunk] = OrderedDict()  # on the compute device
        self._linked: OrderedDict[tuple[str, ChunkKey], None] = OrderedDict()

    # ------------------------------------------------------------------ a request's lookup
    def find(self, pieces: Sequence[Piece], *, fused: bool, streaming: bool | None = None) -> LookedUp:
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
                key = salted(key, p.salt)
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
                self.store.note_use(key)  # admission into faster tiers goes by use
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
        built = self.builder.build(missing, keep=True)
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
        keys = [k for k in dict.fromkeys(keys) if self.store.admits(k)]
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

    # ------------------------------------------------------------------ caches of a prompt
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
            k, v = ingest.prefill_alone(self.adapter, ids)
            chunk = KVChunk(key, ids.clone(), k, v)
            self.store.put(chunk)
        dev, dt = self.adapter.device, self.adapter.dtype
        chunk = KVChunk(key, chunk.token_ids, chunk.k.to(dev, dt), chunk.v.to(dev, dt))
        with self._lock:
            self._prefixes[key] = chunk
            while len(self._prefixes) > PREFIX_CACHE:
                self._prefixes.popitem(last=False)
        return chunk, hit

    def view(self, key: ChunkKey, ids: torch.Tensor, depth: int) -> ChunkView:
        """A stored chunk as the prefetcher streams it (its probe sidecar read now; one stored
        before sidecars existed, or whose sidecar was damaged, gets one made once). Raises
        KeyError when the chunk cannot be read at all (`rebuild` it)."""
        assert self.prefetcher is not None
        crit, anchors = self.builder.critical_layers, self.builder.anchors
        try:
            return self.prefetcher.view(key, ids, depth=depth, critical=crit, anchors=anchors)
        except KeyError:
            ensure_sidecar(self.store, self.adapter, key, max(crit) + 1, crit, anchors)
            return self.prefetcher.view(key, ids, depth=depth, critical=crit, anchors=anchors)

    def rebuild(self, key: ChunkKey, ids: torch.Tensor) -> KVChunk:
        """A stored chunk that `view` could not read: deleted, built again and stored -> its
        cache in memory (a miss of this request)."""
        self.store.delete(key)
        return self.builder.build({key: ids}, keep=True)[key]

    def forget_unreadable(self, key: ChunkKey) -> None:
        """A stored cache could not be read mid-request: delete it (the next lookup builds it
        again) and the sidecars the prefetcher kept."""
        self.store.delete(key)
        if self.prefetcher is not None:
            self.prefetcher.forget_sidecars()

    def _subspans(self, part: Part, source: str) -> list[Part] | None:
        """The parts serving a chunk's token runs from the stored cache of the text it
        re-renders (subspans.py); None when that is not stored or shares no run."""
        _, src_key = self.chunk_tokens(source)
        stored = self.store.get(src_key) if src_key is not None else None
        served = subspans.serve(part.ids, part.node_id, stored, self.fingerprint) if stored is not None else None
        for p in served or ():
            if p.chunk is not None:
                self.builder.add_anchors(p.chunk)
        return served


class ChunkCaches:
    """What callers read of an engine's chunk caches (`engine.caches`): the store, the
    chunk-text index (which registered chunk texts a rendered prompt holds: `texts.find`,
    what `engine.complete` serves from), and a text's token ids and key. Read-only."""

    __slots__ = ("_lookup", "_texts")

    def __init__(self, lookup: ChunkLookup, texts: ChunkTextIndex) -> None:
        self._lookup, self._texts = lookup, texts

    @property
    def store(self) -> ChunkStore:
        """The chunk store (ChunkKey -> KVChunk, node id -> key)."""
        return self._lookup.store

    @property
    def texts(self) -> ChunkTextIndex:
        """The chunk-text index: registered chunk texts, found by content in a prompt."""
        return self._texts

    @property
    def fingerprint(self) -> str:
        """The chunk keys' namespace: the model's fingerprint (its own with `chunk_sink`)."""
        return self._lookup.fingerprint

    def tokenize(self, text: str) -> torch.Tensor:
        """The token ids of `text` (no special tokens)."""
        return self._lookup.tokenize(text)

    def chunk_tokens(self, text: str) -> tuple[torch.Tensor, ChunkKey | None]:
        """Token ids and cache key of a chunk text, tokenised and hashed once (the key is None
        for a text of no tokens)."""
        return self._lookup.chunk_tokens(text)

    def is_stored(self, text: str) -> bool:
        """Whether the store holds the cache of a chunk text."""
        return self._lookup.is_stored(text)
