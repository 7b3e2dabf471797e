"""An in-memory chunk store (tests, ephemeral sessions)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from qcfuse_core.store.base import ChunkStore, StoreStats
from qcfuse_core.types import ChunkKey, KVChunk, NodeId


class MemoryStore(ChunkStore):
    def __init__(self) -> None:
        self._chunks: dict[ChunkKey, KVChunk] = {}
        self._nodes: dict[NodeId, ChunkKey] = {}
        self._stats = StoreStats()

    def get(self, key: ChunkKey) -> KVChunk | None:
        chunk = self._chunks.get(key)
        if chunk is None:
            self._stats.misses += 1
        else:
            self._stats.hits += 1
            self._stats.bytes_read += chunk.nbytes
        return chunk

    def put(
        self,
        chunk: KVChunk,
        *,
        anchors: dict[str, torch.Tensor] | None = None,
        layer_keys: dict[int, torch.Tensor] | None = None,
        bulk: bool = False,
    ) -> None:
        """Keep the chunk (its anchors merged in); layer keys and `bulk` mean nothing here."""
        if anchors:
            chunk.anchors.update(anchors)
        if chunk.key not in self._chunks:
            self._chunks[chunk.key] = chunk
            self._stats.puts += 1
            self._stats.bytes_written += chunk.nbytes

    def contains(self, key: ChunkKey) -> bool:
        return key in self._chunks

    def stored_bytes(self, key: ChunkKey) -> int:
        chunk = self._chunks.get(key)
        return chunk.nbytes if chunk is not None else 0

    def delete(self, key: ChunkKey) -> bool:
        return self._chunks.pop(key, None) is not None

    def link(self, node_id: NodeId, key: ChunkKey) -> None:
        self._nodes[node_id] = key

    def resolve(self, node_id: NodeId) -> ChunkKey | None:
        return self._nodes.get(node_id)

    def keys(self) -> Iterator[ChunkKey]:
        return iter(list(self._chunks))

    def stats(self) -> dict:
        return {"backend": "memory", "entries": len(self._chunks), **self._stats.as_dict()}
