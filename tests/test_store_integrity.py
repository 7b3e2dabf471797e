"""Nothing wrong is ever served: keys, damaged files, foreign formats, a full disk."""

from __future__ import annotations

import errno
import logging
import os
import sqlite3

import pytest
import torch
from store_fixtures import FP_OTHER, entry_file, make_chunk, store_at

import qcfuse_core.store.atomic as atomic
import qcfuse_core.store.disk as disk_mod
import qcfuse_core.store.entry as entry_mod
import qcfuse_core.store.tiered as tiered_mod
from qcfuse_core.types import ChunkKey, NodeId


def _cold(tmp_path, **kw):
    """A fresh handle: empty memory tiers, so reads go to disk."""
    return store_at(tmp_path, **kw)


def test_dedup_across_node_ids(tmp_path):
    chunk = make_chunk(1)
    with store_at(tmp_path) as s:
        for node in ("doc-1", "doc-2"):
            s.put(chunk)
            s.link(NodeId(node), chunk.key)
    with _cold(tmp_path) as s:
        assert s.resolve(NodeId("doc-1")) == s.resolve(NodeId("doc-2")) == chunk.key
        assert s.resolve(NodeId("doc-3")) is None
        assert s.stats()["entries"] == 1
        files = [p for p in (tmp_path / "data").rglob("*.safetensors")]
        assert len(files) == 1


def test_fingerprint_mismatch_never_reused(tmp_path):
    chunk = make_chunk(2)
    foreign = ChunkKey.for_tokens(FP_OTHER, chunk.token_ids)
    with store_at(tmp_path) as s:
        s.put(chunk)
        s.link(NodeId("n"), chunk.key)
        assert not s.contains(foreign) and s.get(foreign) is None
        assert s.get_layer(foreign, 0) is None
        assert s.resolve(NodeId("n"), FP_OTHER) is None
        assert s.resolve(NodeId("n"), chunk.key.fingerprint) == chunk.key


def test_file_of_another_key_is_rejected(tmp_path):
    a, b = make_chunk(3), make_chunk(4)
    with store_at(tmp_path) as s:
        s.put(a)
        s.put(b)
        fa, fb = entry_file(s, a.key), entry_file(s, b.key)
    os.replace(fb, fa)  # a's row now names b's bytes
    with _cold(tmp_path) as s:
        assert s.get(a.key) is None
        assert s.stats()["corrupt"] == 1


def test_format_version_mismatch_not_reused(tmp_path, monkeypatch):
    chunk = make_chunk(5)
    with store_at(tmp_path) as s:
        s.put(chunk)
    for mod in (entry_mod, disk_mod, tiered_mod):
        monkeypatch.setattr(mod, "FORMAT_VERSION", 2)
    with _cold(tmp_path) as s:  # a newer build: the v1 entry is invisible
        assert not s.contains(chunk.key) and s.get(chunk.key) is None
        s.put(chunk)
        assert s.get(chunk.key) is not None
    monkeypatch.undo()
    with _cold(tmp_path) as s:  # the v1 build still sees only its own entry
        assert torch.equal(s.get(chunk.key).k, chunk.k)
        assert s.disk.manifest.count_and_bytes()[0] == 2
    with sqlite3.connect(tmp_path / "manifest.sqlite") as db:  # a row claiming v1 for v2 bytes
        db.execute("DELETE FROM entries WHERE format_version = 1")
        db.execute("UPDATE entries SET format_version = 1")
    with _cold(tmp_path) as s:
        assert s.get(chunk.key) is None and s.stats()["corrupt"] == 1


def test_storage_dtype_is_part_of_validity(tmp_path):
    chunk = make_chunk(6)
    with store_at(tmp_path, storage_dtype="bf16") as s:
        s.put(chunk)
    with _cold(tmp_path, storage_dtype="fp8") as s:
        assert s.get(chunk.key) is None
    with _cold(tmp_path, storage_dtype="auto") as s:
        assert s.get(chunk.key) is None


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


DAMAGE = {
    "flip-layer": lambda p, lay: _flip(p, lay.layer_spans[1][0] + 5),
    "flip-header": lambda p, lay: _flip(p, 40),
    "flip-token-ids": lambda p, lay: _flip(p, lay.token_span[0] + 3),
    "truncate": lambda p, lay: os.truncate(p, lay.file_bytes - 100),
    "truncate-to-zero": lambda p, lay: os.truncate(p, 0),
    "delete": lambda p, lay: p.unlink(),
    "append": lambda p, lay: open(p, "ab").write(b"x"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_entry_is_a_counted_miss_then_recomputed(tmp_path, damage, caplog):
    chunk, other = make_chunk(7, L=3), make_chunk(8)
    with store_at(tmp_path) as s:
        s.put(chunk)
        s.put(other)
        path, layout = entry_file(s, chunk.key), s.disk.layout(chunk.key)
    DAMAGE[damage](path, layout)
    with caplog.at_level(logging.WARNING, logger="qcfuse_core.store.disk"), _cold(tmp_path) as s:
        assert s.get(chunk.key) is None  # never raises, never wrong
        assert "unusable" in caplog.text
        st = s.stats()
        assert st["corrupt"] == 1 and st["misses"] == 1
        assert not s.contains(chunk.key)  # the bad row is gone; the engine recomputes
        assert torch.equal(s.get(other.key).k, other.k)  # neighbours untouched
        s.put(chunk)
        assert torch.equal(s.get(chunk.key).k, chunk.k)
    with _cold(tmp_path) as s:
        assert torch.equal(s.get(chunk.key).v, chunk.v)


@pytest.mark.parametrize("damage", ["flip-layer", "truncate", "delete"])
def test_damaged_layer_reads_miss(tmp_path, damage):
    chunk = make_chunk(9, L=3)
    with store_at(tmp_path) as s:
        s.put(chunk)
        path, layout = entry_file(s, chunk.key), s.disk.layout(chunk.key)
    with _cold(tmp_path, memory_bytes=0) as s:
        assert s.get_layer(chunk.key, 0) is not None  # header located and cached
        DAMAGE[damage](path, layout)
        assert s.get_layer(chunk.key, 1) is None
        assert s.stats()["corrupt"] == 1
        batch = s.read_layer_batch([chunk.key], 1)
        assert batch.found == [False]


def test_damaged_sidecar_drops_anchors_only(tmp_path):
    chunk = make_chunk(10)
    chunk.anchors = {"keynorm": torch.tensor([[0, 1, 2]])}
    with store_at(tmp_path, sidecar_layers=(1,)) as s:
        s.put(chunk)
        side = s.get_sidecar(chunk.key)
        assert torch.equal(side.layer_keys[1], chunk.k[1]) and torch.equal(side.anchors["keynorm"], chunk.anchors["keynorm"])
    with _cold(tmp_path) as s:
        assert torch.equal(s.get(chunk.key).anchors["keynorm"], chunk.anchors["keynorm"])
    side_file = next((tmp_path / "data").rglob("*.sidecar.safetensors"))
    _flip(side_file, side_file.stat().st_size - 1)
    with _cold(tmp_path) as s:
        got = s.get(chunk.key)
        assert got is not None and got.anchors == {} and s.get_sidecar(chunk.key) is None
        assert s.stats()["tiers"]["disk"]["corrupt"] == 1


def test_unreadable_manifest_is_set_aside(tmp_path, caplog):
    chunk = make_chunk(11)
    with store_at(tmp_path) as s:
        s.put(chunk)
    (tmp_path / "manifest.sqlite").write_bytes(b"this is not a database" * 100)
    with caplog.at_level(logging.WARNING), _cold(tmp_path) as s:
        assert s.get(chunk.key) is None
        assert "unusable" in caplog.text
        s.put(chunk)
        assert s.get(chunk.key) is not None
    assert list(tmp_path.glob("manifest.sqlite.bad-*"))


def test_disk_full_degrades_to_memory_and_compute(tmp_path, monkeypatch, caplog):
    stored, a, b = make_chunk(12), make_chunk(13), make_chunk(14)
    with store_at(tmp_path) as s:
        s.put(stored)

        def full(fd, buffers):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(atomic, "write_all", full)
        with caplog.at_level(logging.WARNING, logger="qcfuse_core.store.disk"):
            s.put(a)  # no exception
            s.put(b)
            s.link(NodeId("n"), b.key)
        assert caplog.text.count("disk full") == 1  # warned once
        st = s.stats()
        assert st["degraded"] and st["write_failures"] == 2 and st["puts"] == 3
        assert not list(tmp_path.rglob(".tmp-*"))  # no leftovers
        assert torch.equal(s.get(a.key).k, a.k)  # still served (host tier)
        assert torch.equal(s.get(stored.key).k, stored.k)  # disk reads continue
        assert s.resolve(NodeId("n")) == b.key
    monkeypatch.undo()
    with _cold(tmp_path) as s:
        assert s.get(a.key) is None and s.get(stored.key) is not None


def test_sqlite_disk_full_degrades(tmp_path, monkeypatch):
    chunk = make_chunk(15)
    with store_at(tmp_path) as s:
        def full(*a, **k):
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(s.disk.manifest, "commit_entry", full)
        s.put(chunk)
        assert s.stats()["degraded"] and s.get(chunk.key) is not None
    assert not list(tmp_path.rglob(".tmp-*"))


def test_other_write_errors_propagate(tmp_path, monkeypatch):
    def broken(fd, buffers):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(atomic, "write_all", broken)
    with store_at(tmp_path) as s, pytest.raises(OSError, match="Input/output"):
        s.put(make_chunk(16))


def test_refused_write_turns_the_store_read_only(tmp_path, monkeypatch, caplog):
    stored, new = make_chunk(16), make_chunk(19)
    with store_at(tmp_path) as s:
        s.put(stored)

        def denied(fd, buffers):
            raise OSError(errno.EACCES, "Permission denied")

        monkeypatch.setattr(atomic, "write_all", denied)
        with caplog.at_level(logging.WARNING, logger="qcfuse_core.store.disk"):
            s.put(new)  # no exception: kept in memory, nothing written
            s.put(make_chunk(20))
        assert caplog.text.count("not writable") == 1
        assert s.stats()["read_only"] and s.stats()["write_failures"] == 0
        assert torch.equal(s.get(new.key).k, new.k) and torch.equal(s.get(stored.key).k, stored.k)
        s.delete(stored.key)  # read-only: dropped from memory and hidden here, never deleted on disk
        assert s.get(stored.key) is None
    monkeypatch.undo()
    with _cold(tmp_path) as s:
        assert s.get(stored.key) is not None and s.get(new.key) is None


def test_sidecar_lifecycle_follows_the_entry(tmp_path):
    chunk, other = make_chunk(17), make_chunk(18)
    with store_at(tmp_path) as a, store_at(tmp_path) as b:
        a.put(chunk)
        a.put(other)
        assert a.get_sidecar(chunk.key) is None  # not cached as absent ...
        b.put_sidecar(chunk.key, anchors={"m": torch.tensor([[1, 2]])})
        assert torch.equal(a.get_sidecar(chunk.key).anchors["m"], torch.tensor([[1, 2]]))  # ... so seen
        b.put_sidecar(other.key, layer_keys={0: other.k[0]})
        assert len(list((tmp_path / "data").rglob("*.sidecar.safetensors"))) == 2
        assert a.delete(chunk.key) and a.get_sidecar(chunk.key) is None  # delete takes the sidecar
        assert len(list((tmp_path / "data").rglob("*.sidecar.safetensors"))) == 1
    from qcfuse_core.store.maintenance import gc

    with store_at(tmp_path) as s:
        rep = gc(s.disk, 0, grace_s=0)  # evicts `other`, then its now-orphaned sidecar
        assert rep.removed_entries == 1 and rep.removed_orphans == 1
        assert not list((tmp_path / "data").rglob("*.safetensors"))
