"""Memory tiers: exact eviction order per policy, capacities never exceeded, promotion on
hit, write-through to disk, and the configuration errors."""

from __future__ import annotations

import random

import pytest
import torch
from store_fixtures import entry_bytes, make_chunk, store_at

from qcfuse_core.store import StoreConfig, get_policy, open_store
from qcfuse_core.store.entry import encode_chunk
from qcfuse_core.store.tier import MemoryTier

# put a, b, c; get a, a, b, c, a; put d; get d; put e; put f   (capacity: 3 equal entries)
EXPECTED_VICTIMS = {"lru": "bca", "lfu": "bce", "fifo": "abc", "size": "bca"}


@pytest.mark.parametrize("policy", sorted(EXPECTED_VICTIMS))
def test_eviction_order_exact(policy):
    images = {n: encode_chunk(make_chunk(i), "auto") for i, n in enumerate("abcdef")}
    n = images["a"].nbytes
    assert all(im.nbytes == n for im in images.values())
    tier = MemoryTier("host", "cpu", 3 * n, get_policy(policy))
    name = {im.key: k for k, im in images.items()}
    evicted = []
    for op in "+a +b +c ?a ?a ?b ?c ?a +d ?d +e +f".split():
        kind, which = op
        if kind == "+":
            evicted += [name[k] for k in tier.put(images[which])]
        else:
            assert tier.get(images[which].key) is not None
    assert "".join(evicted) == EXPECTED_VICTIMS[policy]
    assert tier.stats.evictions == 3 and len(tier) == 3


def test_size_policy_evicts_largest_first():
    small, big, mid = (encode_chunk(make_chunk(i, T=t), "auto") for i, t in ((0, 4), (1, 40), (2, 20)))
    tier = MemoryTier("host", "cpu", small.nbytes + big.nbytes + mid.nbytes, get_policy("size"))
    for im in (small, big, mid):
        tier.put(im)
    assert tier.put(encode_chunk(make_chunk(3, T=4), "auto")) == [big.key]


def test_unknown_policy_lists_valid_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown eviction policy 'mru'; valid: \['fifo', 'lfu', 'lru', 'size', 'slru'\]"):
        open_store(tmp_path, policy="mru")


@pytest.mark.parametrize("kw", [dict(memory_bytes=-1), dict(gpu_bytes=-1), dict(disk_bytes=-5),
                                dict(storage_dtype="int8"), dict(sidecar_layers=(-1,))])
def test_config_validation(kw):
    with pytest.raises(ValueError, match="valid|must be"):
        StoreConfig(**kw)


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "size"])
def test_capacity_never_exceeded(tmp_path, policy):
    rng = random.Random(policy)
    chunks = [make_chunk(i, T=rng.randint(1, 48), L=2) for i in range(30)]
    cap = 5 * entry_bytes(chunks[0])
    s = store_at(tmp_path, memory_bytes=cap, policy=policy, disk_bytes=3 * cap)
    for _ in range(200):
        c = rng.choice(chunks)
        if rng.random() < 0.5:
            s.put(c)
        else:
            got = s.get(c.key)
            assert got is None or torch.equal(got.k, c.k)
        assert s.host.bytes_used <= cap
        assert s.disk.manifest.count_and_bytes()[1] <= 3 * cap
    st = s.stats()
    assert st["tiers"]["host"]["bytes_used"] <= cap and st["evictions"] > 0
    s.close()


def test_oversized_entry_not_admitted(tmp_path):
    big = make_chunk(0, T=64)
    with store_at(tmp_path, memory_bytes=entry_bytes(big) - 1) as s:
        s.put(big)
        assert big.key not in s.host and s.host.bytes_used == 0
        assert torch.equal(s.get(big.key).k, big.k)  # still served from disk


def test_write_through_and_promotion(tmp_path):
    chunk = make_chunk(1)
    with store_at(tmp_path) as s:
        s.put(chunk)
        assert chunk.key in s.host
        with store_at(tmp_path) as other:  # another handle sees it on disk at once
            assert other.contains(chunk.key) and chunk.key not in other.host
    with store_at(tmp_path) as s:
        s.gpu = MemoryTier("gpu", "cpu", 1 << 20, get_policy("lru"))  # stand-in for the GPU tier
        assert s.get(chunk.key) is not None  # disk hit -> host and gpu
        assert chunk.key in s.host and chunk.key in s.gpu
        s.gpu.remove(chunk.key)
        assert s.get(chunk.key) is not None  # host hit -> promoted to gpu again
        assert chunk.key in s.gpu
        assert s.get(chunk.key) is not None  # gpu hit
        st = s.stats()
        assert st["tiers"]["disk"]["hits"] == 1
        assert st["tiers"]["host"]["hits"] == 1 and st["tiers"]["gpu"]["hits"] == 1
        assert st["hits"] == 3 and st["misses"] == 0


def test_stats_count_hits_misses_bytes(tmp_path):
    chunk = make_chunk(2)
    with store_at(tmp_path) as s:
        assert s.get(chunk.key) is None
        s.put(chunk)
        s.put(chunk)  # idempotent
        s.get(chunk.key)
        st = s.stats()
    n = entry_bytes(chunk)
    assert (st["hits"], st["misses"], st["puts"], st["entries"]) == (1, 1, 1, 1)
    assert st["bytes_written"] == n and st["bytes_read"] == n
    assert st["tiers"]["host"]["bytes_used"] == n and st["tiers"]["disk"]["bytes_used"] == n


def test_tiers_charge_allocated_bytes():
    from types import SimpleNamespace

    from qcfuse_core.store.tier import charge

    def image(n, device="cpu", pinned=False):
        return SimpleNamespace(nbytes=n, device=torch.device(device), data=SimpleNamespace(is_pinned=lambda: pinned))

    assert charge(image(1000)) == 1000  # plain host memory: exact
    assert charge(image((128 << 20) + 8192, pinned=True)) == 256 << 20  # pinned: power of two
    assert charge(image(128 << 20, pinned=True)) == 128 << 20
    assert charge(image((4 << 20) + 1, device="cuda")) == 6 << 20  # CUDA: 2 MiB blocks


def test_expendable_entries_leave_the_disk_first_and_push_out_only_their_kind(tmp_path):
    """Past the disk tier's capacity, entries the store is told are expendable (the server's
    learned caches, qcfuse_core/learn.py) leave first; writing one of them evicts only
    expendable entries - itself included, when no other is left - never a registered one."""
    chunks = [make_chunk(i) for i in range(6)]
    n = entry_bytes(chunks[0])
    assert all(entry_bytes(c) == n for c in chunks)
    learned = {c.key.to_string() for c in chunks[3:]}
    with store_at(tmp_path, disk_bytes=3 * n) as s:
        s.evict_first(learned.__contains__)
        s.put(chunks[0])  # registered
        s.put(chunks[3])  # learned
        s.put(chunks[1])  # registered
        s.put(chunks[2])  # registered: over the capacity - the learned entry leaves, not chunk 0
        assert [s.disk.contains(c.key) for c in chunks] == [True, True, True, False, False, False]
        s.put(chunks[4])  # learned, into a disk full of registered entries: only itself can leave
        assert [s.disk.contains(c.key) for c in chunks[:5]] == [True, True, True, False, False]
        assert s.stored_bytes(chunks[0].key) == n and s.stored_bytes(chunks[4].key) == 0
        s.evict_first(None)  # nothing expendable: plain least recently used
        s.put(chunks[5])
        assert not s.disk.contains(chunks[0].key) and s.disk.contains(chunks[5].key)


def test_the_disk_tier_is_bounded_by_default(tmp_path, monkeypatch):
    """Without disk_bytes the disk tier takes DISK_SHARE of what the store holds plus the free
    space when it opens, never less than it holds; a disk that does not say leaves it unbounded."""
    from qcfuse_core.store import sizing

    monkeypatch.setattr(sizing, "free_disk", lambda path: 1 << 20)
    with store_at(tmp_path) as s:
        assert s.disk_capacity() == int(sizing.DISK_SHARE * (1 << 20))
        for i in range(3):
            s.put(make_chunk(i))
        held = s.stats()["tiers"]["disk"]["bytes_used"]
    monkeypatch.setattr(sizing, "free_disk", lambda path: 0)
    with store_at(tmp_path) as s:
        assert s.disk_capacity() == held  # a full disk: what it holds
    with store_at(tmp_path, disk_bytes=7) as s:
        assert s.disk_capacity() == 7
    monkeypatch.setattr(sizing, "free_disk", lambda path: None)
    with store_at(tmp_path) as s:
        assert s.disk_capacity() is None
    with pytest.raises(ValueError, match="share"):
        sizing.disk_tier_bytes(tmp_path, 0, share=0)
