"""Shared toy prompts for the selection tests: a tiny random model, caches built alone
(`chunk_alone`: one chunk's, as an engine builds it); `hold_worker`, which holds an engine's scheduler inside its next request; and
`engine_config`, an EngineConfig from the fields a test varies."""

from __future__ import annotations

import threading
from dataclasses import fields
from typing import Any

import pytest
import torch

from qcfuse_core import CacheConfig, EngineConfig, FrameConfig, SchedulerConfig
from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.model.fusion import FusedPrompt, KVCache, Segment, fused_prefill
from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.types import ChunkKey, KVChunk

# A whole tiny model through each backend: the PyTorch references in the fast tier, Triton's
# interpreter in the slow tier (40-80x slower on a CPU). Each kernel is compared with its
# reference on tiny shapes in the fast tier (test_kernels*.py, test_graph_decode.py).
WHOLE_MODEL_BACKENDS = [
    pytest.param("reference", id="ref"),
    pytest.param("interpreter", id="interp", marks=[pytest.mark.kernels, pytest.mark.slow]),
]

KINDS = ["prefix", "chunk", "text", "chunk", "chunk", "suffix"]
LENS = [6, 20, 2, 24, 16, 7]


def parts(adapter: ModelAdapter, lens=LENS, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, adapter.shape.vocab_size, (n,), generator=g) for n in lens]


def chunk_alone(engine: QCFuseEngine, ids: torch.Tensor) -> KVChunk:
    """The cache of a chunk's exact tokens as `engine` builds it (alone at positions 0..n-1,
    with its anchors), built and stored now."""
    key = ChunkKey.for_tokens(engine.caches.fingerprint, ids)
    return engine.builder.build({key: ids}, keep=True)[key]


def prompt_alone(adapter: ModelAdapter, lens=LENS, kinds=KINDS, seed: int = 0) -> FusedPrompt:
    """Prefix and chunks cached alone (positions 0..n-1); glue and suffix uncached."""
    eng = QCFuseEngine(adapter)
    segs = []
    for ids, kind in zip(parts(adapter, lens, seed), kinds):
        if kind in ("prefix", "chunk"):
            segs.append(Segment(kind, ids, chunk_alone(eng, ids)))
        else:
            segs.append(Segment(kind, ids))
    return FusedPrompt(segs)


def prompt_exact(adapter: ModelAdapter, lens=LENS, kinds=KINDS, seed: int = 0) -> tuple[FusedPrompt, KVCache]:
    """Every cached segment holds its true in-context K/V (from a full prefill); also the
    full prefill's rotated cache (L, T, Hkv, D)."""
    ids = parts(adapter, lens, seed)
    whole = FusedPrompt([Segment("suffix", torch.cat(ids))])
    T = whole.num_tokens
    cache = KVCache(adapter, T)
    out = fused_prefill(adapter, whole, torch.arange(T), kv_out=cache, capture_pre_rope=True)
    segs, pos = [], 0
    fp = "0" * 16
    for x, kind in zip(ids, kinds):
        n = len(x)
        if kind in ("prefix", "chunk"):
            k = out.k_pre[:, pos : pos + n].clone()
            v = cache.v[:, pos : pos + n].clone()
            segs.append(Segment(kind, x, KVChunk(ChunkKey.for_tokens(fp, x), x, k, v)))
        else:
            segs.append(Segment(kind, x))
        pos += n
    return FusedPrompt(segs), cache


def hold_worker(engine: QCFuseEngine, timeout: float = 30.0) -> threading.Event:
    """Hold `engine`'s scheduler worker inside the next request it admits, at the start of its
    lookup (the request counts as running), until the returned gate is set: requests
    submitted meanwhile wait in the queue, and the step that goes on admits them too. The
    requests themselves stay data; only the engine's chunk lookup is wrapped, once."""
    gate = threading.Event()
    lookup = engine.lookup
    real = lookup.find

    def find(*args, **kwargs):
        del lookup.find  # only this one lookup waits
        gate.wait(timeout)
        return real(*args, **kwargs)

    lookup.find = find  # type: ignore[method-assign]
    return gate


def engine_config(**kw: Any) -> EngineConfig:
    """An EngineConfig from keywords naming fields of it or of its sub-configs (frame,
    scheduler, cache): `engine_config(max_running=1, kv_cache_bytes=4096)`."""
    parts = {"frame": FrameConfig, "scheduler": SchedulerConfig, "cache": CacheConfig}
    sub = {name: {f.name: kw.pop(f.name) for f in fields(kind) if f.name in kw} for name, kind in parts.items()}
    return EngineConfig(**kw, **{name: parts[name](**given) for name, given in sub.items() if given})
