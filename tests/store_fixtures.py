"""Synthetic chunks and store helpers shared by the store tests (toy sizes, CPU)."""

from __future__ import annotations

from pathlib import Path

import torch

from qcfuse_core.store import open_store
from qcfuse_core.types import ChunkKey, KVChunk

FP = "0123456789abcdef"
FP_OTHER = "fedcba9876543210"


def make_chunk(seed: int, *, T: int = 24, L: int = 3, Hkv: int = 2, D: int = 8,
               dtype: torch.dtype = torch.bfloat16, fingerprint: str = FP) -> KVChunk:
    """A deterministic chunk: token ids and K/V drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50_000, (T,), generator=g)
    k = torch.randn(L, T, Hkv, D, generator=g).to(dtype)  # (L, T, Hkv, D)
    v = torch.randn(L, T, Hkv, D, generator=g).to(dtype)
    return KVChunk(ChunkKey.for_tokens(fingerprint, ids), ids, k, v)


def entry_bytes(chunk: KVChunk, storage: str = "auto") -> int:
    from qcfuse_core.store.entry import plan_layout

    L, T, Hkv, D = chunk.k.shape
    return plan_layout(chunk.key, storage, chunk.k.dtype, L, T, Hkv, D)[0].file_bytes


def host_charge(nbytes: int) -> int:
    """Bytes the host tier charges an image of `nbytes` (its arena extent: 64-byte multiples)."""
    from qcfuse_core.store.arena import ALIGN

    return -(-nbytes // ALIGN) * ALIGN


def store_at(path: Path, **kw):
    kw.setdefault("memory_bytes", 64 << 20)
    kw.setdefault("use_cuda", False)
    return open_store(path, **kw)


def entry_file(store, key: ChunkKey) -> Path:
    from qcfuse_core.store.entry import FORMAT_VERSION

    row = store.disk.manifest.lookup(key.to_string(), FORMAT_VERSION, store.config.storage_dtype)
    assert row is not None, f"no manifest row for {key}"
    return store.disk.root / row.path
