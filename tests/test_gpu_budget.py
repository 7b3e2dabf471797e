"""One GPU budget for the running requests' KV caches and the store's GPU chunk tier
(cache/budget.py `KVBudget.reserve`, store/tier.py `resize`/`claim`, the prefetcher's fills),
tier sizes from the machine (store/sizing.py) and a policy that keeps a hot set (slru).

On the CPU the "GPU" tier is a stand-in on the compute device (`chunk_device="cpu"`): the same
code sizes it, fills it while a request streams a chunk and evicts from it when a request
needs the room. Tiny random model; answers compared token for token."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from qcfuse_core import CacheConfig, EngineConfig, SchedulerConfig
from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.model.testing import tiny_model
from qcfuse_core.retrieval.texts import ChunkTextIndex
from qcfuse_core.store import open_store, sizing
from qcfuse_core.store.entry import encode_chunk
from qcfuse_core.store.eviction import get_policy
from qcfuse_core.store.tier import MemoryTier
from qcfuse_core.types import ChunkKey, KVChunk

DOCS = [f"Passage {i}: " + " ".join(f"word{i}x{j}" for j in range(20)) for i in range(6)]
QUESTION = "Which passage mentions word3x7?"


@pytest.fixture(scope="module")
def adapter():
    return tiny_model("llama", tokenizer=True)


def kv_bytes(adapter, tokens: int) -> int:
    sh = adapter.shape
    return 2 * tokens * sh.num_layers * sh.num_kv_heads * sh.head_dim * adapter.dtype.itemsize


def engine(adapter, root, budget: int | None, *, device_tier: bool = True, gpu_bytes=None) -> QCFuseEngine:
    store = open_store(
        root,
        memory_bytes=64 << 20,
        gpu_bytes=gpu_bytes,
        use_cuda=False,
        chunk_device="cpu" if device_tier else None,
    )
    cfg = EngineConfig(cache=CacheConfig(kv_cache_bytes=budget))
    return QCFuseEngine(adapter, store=store, config=cfg, text_index=ChunkTextIndex())


def test_a_chunk_used_twice_crosses_the_bus_once(adapter, tmp_path):
    eng = engine(adapter, tmp_path / "kv", budget=64 << 20)
    eng.build_chunks(DOCS[:3])
    tier = eng.caches.store.gpu
    assert tier is not None and len(tier) == 0
    first = eng.answer(QUESTION, DOCS[:3], max_new_tokens=6)
    assert first.load["bytes_by_source"].get("host", 0) > 0  # streamed from the host tier ...
    assert all(eng.caches.chunk_tokens(d)[1] in tier for d in DOCS[:3])  # ... and kept on the device
    second = eng.answer(QUESTION, DOCS[2::-1], max_new_tokens=6)  # the same chunks, another order
    assert second.load["bytes_by_source"].get("host", 0) == 0  # nothing crossed the bus again
    assert second.load["bytes_by_source"]["gpu"] == first.load["bytes_by_source"]["host"]
    again = eng.answer(QUESTION, DOCS[:3], max_new_tokens=6)
    assert again.token_ids == first.token_ids  # a device copy serves the same bytes
    assert tier.stats.hits >= 6 and tier.summary()["claimed_bytes"] == 0
    eng.close()


def test_answers_do_not_depend_on_the_device_tier(adapter, tmp_path):
    ref = engine(adapter, tmp_path / "ref", budget=None, device_tier=False)
    eng = engine(adapter, tmp_path / "kv", budget=64 << 20)
    for e in (ref, eng):
        e.build_chunks(DOCS)
    for docs in (DOCS[:4], DOCS[2:], DOCS[:4][::-1]):
        want = ref.answer(QUESTION, docs, max_new_tokens=8).token_ids
        assert eng.answer(QUESTION, docs, max_new_tokens=8).token_ids == want
    ref.close()
    eng.close()


def test_a_burst_that_needs_every_byte_gets_it_and_chunk_entries_give_way(adapter, tmp_path):
    probe = engine(adapter, tmp_path / "probe", budget=None, device_tier=False)
    prompt_tokens = max(r.prompt_tokens for r in (probe.answer(QUESTION, DOCS[i : i + 3]) for i in range(3)))
    probe.close()
    new = 8
    per_request = kv_bytes(adapter, prompt_tokens + new)
    budget = 3 * per_request + per_request // 4  # three requests fill it; the chunk tier had it all
    eng = engine(adapter, tmp_path / "kv", budget=budget)
    eng.build_chunks(DOCS)
    ref = engine(adapter, tmp_path / "ref", budget=None, device_tier=False)
    ref.build_chunks(DOCS)
    for i in range(4):  # warm: every chunk on the device tier, the tier as large as the budget
        eng.answer(QUESTION, DOCS[i : i + 3], max_new_tokens=2)
    tier = eng.caches.store.gpu
    assert tier.capacity_bytes == budget and tier.bytes_used > budget - 3 * per_request  # it holds room a burst needs
    evictions = tier.stats.evictions
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            results[i] = eng.answer(QUESTION, DOCS[i : i + 3], max_new_tokens=new).token_ids
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and sorted(results) == [0, 1, 2]
    for i in range(3):
        assert results[i] == ref.answer(QUESTION, DOCS[i : i + 3], max_new_tokens=new).token_ids
    assert tier.stats.evictions > evictions  # the chunk entries gave way
    assert eng.kv_budget.reserved_bytes() == 0
    assert tier.capacity_bytes == budget  # and the room came back to the tier
    eng.close()
    ref.close()


def test_reserve_waits_only_while_a_load_reads_the_entries_in_the_way(adapter, tmp_path):
    eng = engine(adapter, tmp_path / "kv", budget=64 << 20)
    eng.build_chunks(DOCS[:3])
    eng.answer(QUESTION, DOCS[:3], max_new_tokens=2)
    store, caches, budget = eng.caches.store, eng.caches, eng.kv_budget
    tier = store.gpu
    held = tier.bytes_used
    assert held > 0
    keys = [caches.chunk_tokens(d)[1] for d in DOCS[:3]]
    pins = [store.pin(k) for k in keys]  # a load session streaming them
    assert all(p is not None and p.tier == "gpu" for p in pins)
    per_token = kv_bytes(adapter, 1)
    fits_beside = ((64 << 20) - held) // per_token
    r = budget.reserve(fits_beside)
    assert r is not None  # room beside the pinned entries: admitted, nothing waits
    budget.release(r)
    assert budget.reserve(fits_beside + 1) is None  # only the pinned entries are in the way: it waits
    for p in pins:
        store.unpin(p)
    r = budget.reserve((64 << 20) // per_token)  # the whole budget: every entry gives way
    assert r is not None and tier.bytes_used == 0 and tier.capacity_bytes < per_token  # what is left
    budget.release(r)
    assert tier.capacity_bytes == 64 << 20
    with pytest.raises(ValueError, match="exceeds the engine's KV budget"):
        budget.reserve((64 << 20) // per_token + 1)  # larger than the budget: refused at once, as before
    eng.close()


def test_a_cap_bounds_the_device_tier_below_the_budget(adapter, tmp_path):
    eng = engine(adapter, tmp_path / "kv", budget=64 << 20, gpu_bytes=1 << 20)
    per_token = kv_bytes(adapter, 1)
    r = eng.kv_budget.reserve(1)  # sizes the budget: the tier gets what is left, up to its cap
    assert r is not None and eng.caches.store.gpu.capacity_bytes == 1 << 20
    eng.kv_budget.release(r)
    assert eng.caches.store.gpu.capacity_bytes == 1 << 20
    r = eng.kv_budget.reserve((64 << 20) // per_token)  # the budget is 64 MiB all the same
    assert r is not None and eng.caches.store.gpu.capacity_bytes < per_token
    eng.kv_budget.release(r)
    eng.close()
    with open_store(tmp_path / "alone", memory_bytes=1 << 20, use_cuda=False, chunk_device="cpu") as st:
        assert st.gpu is not None and st.gpu.capacity_bytes == 0  # no engine, no budget: nothing on the device


def test_default_sizes_come_from_the_machine(monkeypatch, tmp_path):
    GiB = 1 << 30
    assert sizing.host_tier_bytes(available=128 * GiB) == 64 * GiB  # half of what is available
    assert sizing.host_tier_bytes(available=100 * GiB, share=0.25) == 25 * GiB  # each of 2 replicas: 1/4
    assert sizing.host_tier_bytes(available=1 << 20) == sizing.HOST_MIN_BYTES
    monkeypatch.setattr(sizing, "available_ram", lambda: None)
    assert sizing.host_tier_bytes() == sizing.HOST_FALLBACK_BYTES
    monkeypatch.setattr(sizing, "available_ram", lambda: 24 * GiB)
    with open_store(tmp_path / "kv", use_cuda=False) as st:
        assert st.host.capacity_bytes == 12 * GiB
    # the GPU: 0.8 of what is free at start on an H200 (139 GB, 16 GB of weights loaded),
    # with the chunk tier's and the pool's bytes counted as free
    assert sizing.gpu_budget_bytes(123 * 10**9, 0.8) == int(0.8 * 123e9)
    assert sizing.gpu_budget_bytes(100 * 10**9, 0.8, idle=23 * 10**9) == int(0.8 * 123e9)


def _images(n: int):
    out = []
    for i in range(n):
        ids = torch.tensor([i], dtype=torch.int64)
        k = torch.zeros(1, 1, 1, 4)
        out.append(encode_chunk(KVChunk(ChunkKey.for_tokens("0123456789abcdef", ids), ids, k, k.clone()), "auto"))
    return out


def _zipf_hit_rate(policy: str, images, capacity: int, steps: int = 6000) -> tuple[float, MemoryTier]:
    rng = random.Random(0)
    weights = [1 / (r + 1) for r in range(len(images))]
    tier = MemoryTier("gpu", "cpu", capacity * images[0].nbytes, get_policy(policy))
    hits = total = 0
    for step in range(steps):
        image = images[rng.choices(range(len(images)), weights)[0]]
        got = tier.get(image.key)
        if step >= 1000:  # after the warm-up
            total += 1
            hits += got is not None
        if got is None:
            tier.put(image)
    return hits / total, tier


def test_slru_keeps_a_zipf_hot_set():
    images = _images(400)
    ideal = sum(1 / (r + 1) for r in range(100)) / sum(1 / (r + 1) for r in range(400))  # the top 100 held
    lru, _ = _zipf_hit_rate("lru", images, 100)
    slru, tier = _zipf_hit_rate("slru", images, 100)
    assert slru >= lru + 0.03  # a tail seen once does not push out what comes back
    assert slru >= 0.9 * ideal
    assert all(im.key in tier for im in images[:20])  # the hottest stay


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_pinned_host_chunk_fills_the_gpu_tier_and_answers_do_not_change(tmp_path):
    m = tiny_model("llama", tokenizer=True)
    m.model.to("cuda")
    cfg = EngineConfig(cache=CacheConfig(kv_cache_bytes=256 << 20), scheduler=SchedulerConfig(cuda_graphs=False))
    ref = QCFuseEngine(
        m,
        store=open_store(tmp_path / "ref", memory_bytes=64 << 20, gpu_bytes=0),
        config=cfg,
        text_index=ChunkTextIndex(),
    )
    eng = QCFuseEngine(
        m, store=open_store(tmp_path / "kv", memory_bytes=64 << 20), config=cfg, text_index=ChunkTextIndex()
    )
    for e in (ref, eng):
        e.build_chunks(DOCS)
    tier = eng.caches.store.gpu
    assert tier is not None and tier.device.type == "cuda"
    first = eng.answer(QUESTION, DOCS[:4], max_new_tokens=6)
    assert first.load["bytes_by_source"].get("host", 0) > 0
    second = eng.answer(QUESTION, DOCS[:4][::-1], max_new_tokens=6)
    assert second.load["bytes_by_source"].get("host", 0) == 0 and second.load["bytes_by_source"]["gpu"] > 0
    for docs in (DOCS[:4], DOCS[:4][::-1]):
        assert (
            eng.answer(QUESTION, docs, max_new_tokens=6).token_ids
            == ref.answer(QUESTION, docs, max_new_tokens=6).token_ids
        )
    r = eng.kv_budget.reserve((256 << 20) // kv_bytes(m, 1))  # the whole budget: the chunk entries give way
    assert r is not None and tier.bytes_used == 0
    eng.kv_budget.release(r)
    ref.close()
    eng.close()


def test_the_host_tier_lets_go_first_of_chunks_the_gpu_tier_holds(tmp_path):
    ids = [torch.arange(i * 8, i * 8 + 8) for i in range(4)]
    chunks = [
        KVChunk(ChunkKey.for_tokens("0123456789abcdef", t), t, torch.randn(2, 8, 1, 4), torch.randn(2, 8, 1, 4))
        for t in ids
    ]
    images = [encode_chunk(c, "auto") for c in chunks]
    room = 3 * images[0].nbytes + 64 * 3  # three images (the arena rounds each up to 64 bytes)
    with open_store(tmp_path, memory_bytes=room, gpu_bytes=1 << 20, use_cuda=False, chunk_device="cpu") as st:
        for im in images[:3]:
            st.host.put(im)
        st.gpu.put(images[0])  # chunk 0 is on the "GPU" too
        st.host.get(images[0].key)  # and the most recently used on the host
        st.host.put(images[3])
        assert images[0].key not in st.host  # its host copy went first, not the least recently used
        assert all(im.key in st.host for im in images[1:])
        assert images[0].key in st.gpu
