"""CacheConfig.chunk_sink: chunks cached after the tokenizer's BOS token (dropped), under
their own fingerprint; with every row recomputed the answer is still full prefill's."""

from __future__ import annotations

import re

import pytest
import torch

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.engine.config import CacheConfig, EngineConfig
from qcfuse_core.ingest.prefill import prefill_alone
from qcfuse_core.store import MemoryStore
from qcfuse_core.model.testing import tiny_model

DOCS = ["The mill on the river was built in 1820 by Anna Berg.", "The bridge is made of grey stone and iron."]
Q = "Who built the mill?"


def _model(arch: str = "gemma3", bos: bool = True):
    m = tiny_model(arch, tokenizer=True)
    if bos:
        m.tokenizer.bos_token = m.tokenizer.convert_ids_to_tokens(1)
        assert m.tokenizer.bos_token_id == 1
    return m


def test_chunk_sink_needs_a_bool_and_a_bos_token():
    with pytest.raises(ValueError, match="chunk_sink must be True or False"):
        CacheConfig(chunk_sink="bos")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="BOS token"):
        QCFuseEngine(_model(bos=False), config=EngineConfig(cache=CacheConfig(chunk_sink=True)))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_sink_caches_are_the_chunk_after_bos_under_their_own_fingerprint(arch):
    m = _model(arch)
    store = MemoryStore()
    plain = QCFuseEngine(m, store=store)
    sink = QCFuseEngine(m, store=store, config=EngineConfig(cache=CacheConfig(chunk_sink=True)))
    assert re.fullmatch(r"[0-9a-f]{16}", sink.caches.fingerprint) and sink.caches.fingerprint != plain.caches.fingerprint
    key, = sink.build_chunks([DOCS[0]])
    assert key.fingerprint == sink.caches.fingerprint
    ids = sink.caches.chunk_tokens(DOCS[0])[0]
    k_ref, v_ref = prefill_alone(m, torch.cat([torch.tensor([1]), ids]))
    chunk = store.get(key)
    assert torch.allclose(chunk.k, k_ref[:, 1:], atol=1e-5, rtol=0)
    assert torch.allclose(chunk.v, v_ref[:, 1:], atol=1e-5, rtol=0)
    assert torch.equal(chunk.token_ids, ids)
    # one store, two cache formats: neither engine is served the other's caches
    r = plain.answer(Q, DOCS, method="naive", max_new_tokens=2)
    assert (r.cache_hits, r.cache_misses) == (0, 2)
    r = sink.answer(Q, DOCS, method="naive", max_new_tokens=2)
    assert (r.cache_hits, r.cache_misses) == (1, 1)  # DOCS[0] was built above with the sink


def test_sink_caches_with_every_row_recomputed_answer_like_full_prefill():
    eng = QCFuseEngine(_model("gemma3"), config=EngineConfig(cache=CacheConfig(chunk_sink=True)))
    full = eng.answer(Q, DOCS, method="full", max_new_tokens=8)
    fused = eng.answer(Q, DOCS, method="random", ratio=1.0, max_new_tokens=8)
    assert fused.recomputed_tokens == fused.context_tokens
    assert fused.token_ids == full.token_ids and len(full.token_ids) == 8
