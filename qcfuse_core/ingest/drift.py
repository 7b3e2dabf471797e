"""Drift: stored chunk caches recomputed and compared bit for bit (`qcfuse store verify --deep`).

A chunk's cache is a pure function of its tokens and the model (`ingest.prefill_alone`), so
a stored entry recomputed today must give the same bytes. When it does not, something
changed under the same key: the model's weights or code path, the torch/BLAS build, the
device, or the entry itself (a bit flip that its checksums missed cannot pass this check).
The recomputed cache is encoded with the entry's own storage format and compared byte for
byte with what is stored; the report also gives the largest difference of the decoded K/V.

Entries of other models (another fingerprint; `chunk_sink` caches have their own) are
skipped and counted: they can only be recomputed with their own model.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from qcfuse_core.ingest.prefill import prefill_alone
from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.store.disk import DiskTier
from qcfuse_core.store.entry import encode_chunk
from qcfuse_core.types import ChunkKey, KVChunk


@dataclass
class DriftReport:
    """What `check_drift` found: entries recomputed, identical, drifted, skipped."""

    model_fingerprint: str
    entries: int = 0  # rows of this model in the manifest
    checked: int = 0  # recomputed (the sample)
    identical: int = 0
    drifted: list[tuple[str, float]] = field(default_factory=list)  # key, max |stored - recomputed|
    unreadable: list[str] = field(default_factory=list)
    other_models: int = 0

    @property
    def ok(self) -> bool:
        return not self.drifted and not self.unreadable

    def as_dict(self) -> dict[str, Any]:
        return {
            "model_fingerprint": self.model_fingerprint,
            "entries": self.entries,
            "checked": self.checked,
            "identical": self.identical,
            "drifted": [{"key": k, "max_abs_diff": d} for k, d in self.drifted],
            "unreadable": self.unreadable,
            "other_models": self.other_models,
        }


def check_drift(
    disk: DiskTier,
    adapter: ModelAdapter,
    *,
    sample: int | None = None,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> DriftReport:
    """Recompute `sample` of this model's stored entries (all when None; a seeded random
    choice otherwise) and compare each with what is stored. progress(done, total) after each."""
    if sample is not None and sample < 1:
        raise ValueError(f"sample must be >= 1, got {sample}")
    fp = adapter.fingerprint()
    rep = DriftReport(fp)
    rows = []
    for row in disk.manifest.entries():
        try:
            key = ChunkKey.from_string(row.chunk_key)
        except ValueError:
            continue  # `store verify` reports malformed keys
        if key.fingerprint != fp:
            rep.other_models += 1
        else:
            rows.append((key, row))
    rep.entries = len(rows)
    if sample is not None and sample < len(rows):
        rows = random.Random(seed).sample(rows, sample)
    for i, (key, row) in enumerate(rows):
        image, _ = disk.read_row(key, row)
        rep.checked += 1
        if image is None:
            rep.unreadable.append(key.to_string())
        else:
            stored = image.decode()
            k, v = prefill_alone(adapter, stored.token_ids)
            fresh = encode_chunk(KVChunk(key, stored.token_ids, k.cpu(), v.cpu()), row.storage)
            if _same_bytes(fresh.layers_kv(), image.layers_kv()) and _same_scales(fresh, image):
                rep.identical += 1
            else:
                again = fresh.decode()
                diff = max(
                    float((again.k.float() - stored.k.float()).abs().max()),
                    float((again.v.float() - stored.v.float()).abs().max()),
                )
                rep.drifted.append((key.to_string(), diff))
        if progress is not None:
            progress(i + 1, len(rows))
    return rep


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and signed zeros included)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _same_scales(a: Any, b: Any) -> bool:
    if a.layout.scale_span is None or b.layout.scale_span is None:
        return a.layout.scale_span is None and b.layout.scale_span is None
    return all(_same_bytes(a.scale(layer), b.scale(layer)) for layer in range(a.layout.num_layers))
