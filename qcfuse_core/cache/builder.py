"""Building chunk caches: a chunk not stored yet is prefilled alone, many per forward pass
(`ingest.prefill_alone_batch`), given its anchors and probe sidecar, and written to the store
off the compute thread (`ingest.StoreWriter`).

    ingestion    `QCFuseEngine.build_chunks` -> `build(todo)`: stored only (bulk writes)
    a lookup     a request's misses -> `build(todo, keep=True)`: stored, and returned in
                 memory with their anchors for this request

The probe reads anchors and sidecar layers of the critical layers (`critical_layers`: the
selection options', else the model profile's); the builder writes what it will read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qcfuse_core.cache.prefetch import probe_sidecar
from qcfuse_core.ingest import prefill as ingest
from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.selection import profiles
from qcfuse_core.selection.anchors import AnchorConfig, ensure_anchors
from qcfuse_core.selection.options import QCFuseOptions
from qcfuse_core.store import ChunkStore
from qcfuse_core.types import ChunkKey, KVChunk

WRITERS = 8  # store-writer threads of ingestion on CUDA (a write is mostly waiting: pinning, copies, file)


class ChunkBuilder:
    """Builds and stores the caches of chunks of one engine (`engine.builder`).

    `options` returns the engine's current selection options (anchors and critical layers
    of the probe sidecars follow them); `sink`: token ids chunks are cached after
    (`CacheConfig.chunk_sink`), or None. It holds no state of any one request."""

    def __init__(
        self,
        adapter: ModelAdapter,
        store: ChunkStore,
        options: Callable[[], QCFuseOptions],
        sink: torch.Tensor | None = None,
    ) -> None:
        self.adapter, self.store, self._options, self.sink = adapter, store, options, sink
        self._profile: profiles.Profile | None = None  # resolved on first use

    # ------------------------------------------------------------------ the probe's needs
    @property
    def critical_layers(self) -> list[int]:
        """The layers the probe reads: the selection options', else the model profile's
        (looked up once: the lookup reads files)."""
        opts = self._options()
        if opts.critical_layers:
            return list(opts.critical_layers)
        return self.profile().layers

    @property
    def anchors(self) -> AnchorConfig:
        """The selection options' anchor settings (what `add_anchors` writes, a view reads)."""
        return self._options().anchors

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

    # ------------------------------------------------------------------ building
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
        sidecar is written once, with the entry, in a store that keeps sidecars. bulk:
        ingestion (`ChunkStore.put`)."""
        self.add_anchors(chunk)
        if not self.store.streams_layers:
            self.store.put(chunk)
            return
        crit = self.critical_layers
        anchors, layer_keys = probe_sidecar(self.adapter, chunk, max(crit) + 1, crit, self.anchors)
        self.store.put(chunk, anchors=anchors, layer_keys=layer_keys, bulk=bulk)
