"""The store's write path: fsync only when durable, one sidecar write per ingested chunk,
and entries written without fsync still read back exactly (or are caught when damaged)."""

from __future__ import annotations

import os

import pytest
import torch

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.cache.prefetch import _sidecar_ok
from qcfuse_core.store import kv_dir, open_store
from qcfuse_core.store.disk import DiskTier
from qcfuse_core.model.testing import tiny_model
from store_fixtures import entry_file, make_chunk, store_at

DOCS = [f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(12)) for i in range(3)]


@pytest.fixture
def fsyncs(monkeypatch):
    calls: list[int] = []
    real = os.fsync

    def counting(fd):
        calls.append(fd)
        return real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    return calls


@pytest.mark.parametrize("durable", [False, True])
def test_fsync_only_when_durable(tmp_path, fsyncs, durable):
    s = store_at(tmp_path / "kv", durable=durable)
    before = len(fsyncs)
    c = make_chunk(0)
    s.put(c)
    s.link("n0", c.key)
    wrote = len(fsyncs) - before
    assert (wrote > 0) == durable, wrote
    assert s.disk.durable is durable
    s.close()
    with store_at(tmp_path / "kv") as again:  # a fresh process's view: from the disk
        got = again.disk.read(c.key)
        assert got is not None and torch.equal(got.decode().k, c.k) and torch.equal(got.decode().v, c.v)


def _cut_short(data: bytes) -> bytes:
    return data[: len(data) // 2]  # the file is shorter than its manifest row


def _lost_page(data: bytes) -> bytes:
    return data[:-64] + bytes(64)  # the last page never reached the disk: zeros


@pytest.mark.parametrize("damage", [_cut_short, _lost_page])
def test_what_a_lost_writeback_leaves_is_a_miss_not_a_wrong_answer(tmp_path, damage):
    """Without fsync, a power loss can leave a published entry short or with lost pages:
    size and checksum checks turn either into a miss."""
    s = store_at(tmp_path / "kv")
    c = make_chunk(1)
    s.put(c)
    s.close()
    path = entry_file(store_at(tmp_path / "kv"), c.key)
    path.write_bytes(damage(path.read_bytes()))
    with store_at(tmp_path / "kv") as again:
        assert again.get(c.key) is None


def test_ingestion_writes_each_sidecar_once_and_it_serves_the_probe(tmp_path, monkeypatch):
    tiny = tiny_model("llama", tokenizer=True)
    eng = QCFuseEngine(tiny, store=open_store(kv_dir(tmp_path), use_cuda=False))
    writes: list = []
    real = DiskTier.write_sidecar

    def counting(self, key, sidecar):
        writes.append(key)
        return real(self, key, sidecar)

    monkeypatch.setattr(DiskTier, "write_sidecar", counting)
    keys = eng.build_chunks(DOCS, [f"n{i}" for i in range(len(DOCS))])
    assert sorted(map(str, writes)) == sorted(map(str, keys))  # one write per chunk
    crit = eng.builder.critical_layers
    depth = max(crit) + 1
    method = eng.config.selection.anchor_method
    for key in keys:
        side = eng.caches.store.disk.read_sidecar(key)
        assert _sidecar_ok(side, depth, crit, method)
    r = eng.answer("Which document mentions word1x3?", DOCS, method="qcfuse", ratio=0.3, max_new_tokens=2)
    assert r.cache_hits == len(DOCS) and r.cache_misses == 0
    eng.caches.store.close()


def test_bulk_puts_fill_the_host_tier_but_never_evict(tmp_path):
    from store_fixtures import entry_bytes

    chunks = [make_chunk(10 + i) for i in range(5)]
    room = 2 * entry_bytes(chunks[0])  # two entries fit
    s = store_at(tmp_path / "kv", memory_bytes=room)
    for c in chunks[:2]:
        s.put(c)  # request-time puts: hot
    for c in chunks[2:]:
        s.put(c, bulk=True)  # an ingestion after them: the tier is full
    assert [c.key in s.host for c in chunks] == [True, True, False, False, False]
    for c in chunks:  # every chunk is stored and reads back exactly
        got = s.get(c.key)
        assert got is not None and torch.equal(got.k, c.k) and torch.equal(got.v, c.v)
    s.close()
    s = store_at(tmp_path / "kv2", memory_bytes=room)
    for c in chunks[:2]:
        s.put(c, bulk=True)  # an empty tier takes bulk chunks while it has room
    s.put(chunks[2])  # a request-time put still evicts as before
    assert [c.key in s.host for c in chunks[:3]] == [False, True, True]
    s.close()


def test_ingestion_is_bulk_and_a_request_miss_is_not(tmp_path):
    tiny = tiny_model("llama", tokenizer=True)
    store = open_store(kv_dir(tmp_path), use_cuda=False, memory_bytes=0)
    eng = QCFuseEngine(tiny, store=store)
    seen: list[bool] = []
    real = type(store).put

    def recording(self, chunk, **kw):
        seen.append(kw.get("bulk", False))
        return real(self, chunk, **kw)

    type(store).put = recording
    try:
        eng.build_chunks(DOCS[:2])
        assert seen == [True, True]
        seen.clear()
        eng.answer("Which document mentions word2x3?", DOCS, method="qcfuse", ratio=0.3, max_new_tokens=1)
        # the third document (and the prompt's prefix) missed: built for this request, not bulk
        assert len(seen) >= 1 and not any(seen), seen
    finally:
        type(store).put = real
        store.close()


def test_prepare_bulk_is_a_no_op_without_cuda(tmp_path):
    s = store_at(tmp_path / "kv")
    c = make_chunk(3)
    L, T, Hkv, D = c.k.shape
    n = s.entry_bytes(c.key, c.k.dtype, L, T, Hkv, D)
    from store_fixtures import entry_bytes

    assert n == entry_bytes(c)
    assert s.prepare_bulk([n] * 4, writers=2) == 0
    s.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locks host memory through CUDA")
def test_prepare_bulk_counts_writers_plus_the_host_tiers_room(tmp_path):
    s = store_at(tmp_path / "kv", use_cuda=True, memory_bytes=4 << 20, gpu_bytes=0)
    n = (1 << 20) + 10  # a 1 MiB + 64 B extent each in the host tier's arena: room for three
    assert s.prepare_bulk([n] * 10, writers=3) == 6
    assert s.host.arena.reserved == 4 << 20  # its slab page-locked before the compute
    assert s.prepare_bulk([n] * 2, writers=3) == 2  # never more than the chunks
    s.close()
