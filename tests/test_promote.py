"""Disk reads promoted into memory (`CacheConfig.promote_disk_reads`, `TieredStore.promote`):
after a request streamed chunks from the disk tier, they are copied into the host tier in the
background - from their first use with `admission="always"`, from their second with the
default `"second"` - so the next request reads memory; the answers do not change. Off, the
disk tier is read every time. Tiny random model on the CPU; every wait is bounded."""

from __future__ import annotations

import time

import pytest

from qcfuse_core import CacheConfig, EngineConfig
from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.model.testing import tiny_model
from qcfuse_core.retrieval.texts import ChunkTextIndex
from qcfuse_core.store import open_store

DOCS = [f"Passage {i}: " + " ".join(f"token{i}w{j}" for j in range(12)) for i in range(3)]


@pytest.fixture(scope="module")
def adapter():
    return tiny_model("llama", tokenizer=True)


def _store(root, memory_bytes=64 << 20, admission="always"):
    return open_store(root, memory_bytes=memory_bytes, gpu_bytes=0, use_cuda=False, admission=admission)


TEXTS = ChunkTextIndex()  # the registered chunk texts, shared by every engine here


def _built(adapter, root):
    """The chunks' caches on disk only: built through one store, reopened with empty memory."""
    st = _store(root)
    eng = QCFuseEngine(adapter, store=st, text_index=TEXTS)
    eng.build_chunks(DOCS)
    st.close()
    return [eng.caches.chunk_tokens(d)[1] for d in DOCS]


def _in_memory(engine, keys) -> list[bool]:
    return [engine.caches.store.in_memory(k) for k in keys]


def _wait(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def _prompt(docs):
    return "Context:\n" + "\n\n".join(docs) + "\n\nQuestion: which passage mentions token1w3?\nAnswer:"


@pytest.mark.parametrize("promote", [True, False])
def test_a_disk_read_is_promoted_into_memory_only_when_asked(adapter, tmp_path, promote):
    keys = _built(adapter, tmp_path)
    cfg = EngineConfig(cache=CacheConfig(promote_disk_reads=promote))
    eng = QCFuseEngine(adapter, store=_store(tmp_path), config=cfg, text_index=TEXTS)
    assert _in_memory(eng, keys) == [False] * 3
    asked: list = []  # the promotions handed to the background thread (from the request's own thread)
    real = eng.lookup.prefetcher.promote
    eng.lookup.prefetcher.promote = lambda ks: (asked.append(list(ks)), real(ks))[1]  # type: ignore[method-assign]
    first = eng.complete(_prompt(DOCS[:2]), max_new_tokens=6)
    assert (first.cache_hits, first.cache_misses) == (2, 0)
    if promote:
        _wait(lambda: _in_memory(eng, keys) == [True, True, False])  # only the chunks this request read
    else:  # nothing was handed over, so nothing can arrive later
        assert asked == [] and _in_memory(eng, keys) == [False] * 3
    disk_reads = eng.caches.store.disk.stats.bytes_read
    second = eng.complete(_prompt(DOCS[:2]), max_new_tokens=6)
    assert second.token_ids == first.token_ids  # memory or disk: the same bytes, the same answer
    assert (eng.caches.store.disk.stats.bytes_read > disk_reads) == (not promote)
    eng.caches.store.close()


def test_by_default_a_chunk_is_promoted_from_its_second_use(adapter, tmp_path):
    keys = _built(adapter, tmp_path)
    eng = QCFuseEngine(adapter, store=_store(tmp_path, admission="second"), text_index=TEXTS)
    assert eng.config.cache.promote_disk_reads is True  # on by default
    asked: list = []
    real = eng.lookup.prefetcher.promote
    eng.lookup.prefetcher.promote = lambda ks: (asked.append(list(ks)), real(ks))[1]  # type: ignore[method-assign]
    first = eng.complete(_prompt(DOCS[:2]), max_new_tokens=6)
    assert asked == [] and _in_memory(eng, keys) == [False] * 3  # a first use: the disk is read, nothing admitted
    second = eng.complete(_prompt(DOCS[1:]), max_new_tokens=6)  # DOCS[1] for the second time, DOCS[2] the first
    assert second.cache_hits == 2
    _wait(lambda: _in_memory(eng, keys) == [False, True, False])
    assert asked == [[keys[1]]]
    disk_reads = eng.caches.store.disk.stats.bytes_read
    third = eng.complete(_prompt(DOCS[:2]), max_new_tokens=6)
    assert third.token_ids == first.token_ids
    assert eng.caches.store.disk.stats.bytes_read > disk_reads  # DOCS[0] was on disk only: read (and promoted)
    _wait(lambda: _in_memory(eng, keys) == [True, True, False])
    eng.caches.store.close()


def test_promote_reads_only_what_is_on_disk_and_not_in_memory(adapter, tmp_path):
    keys = _built(adapter, tmp_path)
    st = _store(tmp_path)
    assert st.promote(keys[0]) is True and keys[0] in st.memory_tiers[-1]
    assert st.promote(keys[0]) is False  # already in memory: nothing read
    st.delete(keys[1])
    assert st.promote(keys[1]) is False  # not stored anywhere
    small = _store(tmp_path / "x", memory_bytes=1)
    assert small.promote(keys[2]) is False  # nothing on this store's disk either
    st.close()
    small.close()
