"""Prefetcher: same layers as the prompt's in-memory caches from every source, in order;
ChunkViews serve the qcfuse probe from sidecars exactly as full chunks would."""

import pytest
import torch

from qcfuse_core.cache.prefetch import ChunkView, PrefetchConfig, Prefetcher, ensure_sidecar
from qcfuse_core.model.fusion import FusedPrompt, Segment, fused_prefill
from qcfuse_core.model.testing import cache_alone, tiny_model
from qcfuse_core.selection.base import SelectionContext, get_selector
from qcfuse_core.store import open_store
from tests.qc_fixtures import (  # noqa: F401  (fixtures)
    _store,
    adapter,
)

CRITICAL = [1]  # tiny models have 3 layers; probe depth 2


def _assert_layers_match(session, ref, num_layers, like, tag, on_cuda=False):
    """Every layer the session streams equals the reference prompt's (bitwise)."""
    for l in range(num_layers):
        k, v = session.layer(l, like)
        rk, rv = ref.layer(l, like)
        assert (k.is_cuda or not on_cuda) and torch.equal(k, rk) and torch.equal(v, rv), (tag, l)



@pytest.fixture(scope="module")
def parts(adapter):
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, 256, (n,), generator=g)  # noqa: E731
    prefix = ids(5)
    chunks = [ids(n) for n in (17, 9, 12)]
    return prefix, cache_alone(adapter, prefix), chunks, [cache_alone(adapter, c) for c in chunks], ids(3), ids(4)



def _prompts(pf, parts, recompute=(), views=True, depth=0):
    """(reference prompt over in-memory chunks, prompt over views) with glue between chunks 0 and 1."""
    prefix, pchunk, chunk_ids, chunks, glue, suffix = parts
    ref, lazy = [Segment("prefix", prefix, pchunk)], [Segment("prefix", prefix, pchunk)]
    for i, (ids, c) in enumerate(zip(chunk_ids, chunks)):
        if i == 1:
            ref.append(Segment("text", glue))
            lazy.append(Segment("text", glue))
        keep = i not in recompute
        ref.append(Segment("chunk", ids, c if keep else None))
        src = (pf.view(c.key, ids, depth=depth, critical=CRITICAL) if views else c) if keep else None
        lazy.append(Segment("chunk", ids, src))
    ref.append(Segment("suffix", suffix))
    lazy.append(Segment("suffix", suffix))
    return FusedPrompt(ref), FusedPrompt(lazy)


@pytest.mark.parametrize("tier", ["host", "disk", "tensor"])
@pytest.mark.parametrize("threaded", [True, False])
def test_layers_equal_default_source(adapter, parts, tmp_path, tier, threaded):
    store = None
    if tier != "tensor":
        store = _store(tmp_path, tier)
        for c in parts[3]:
            store.put(c)
    pf = Prefetcher(adapter, store, PrefetchConfig(threaded=threaded))
    for recompute in ((), (1,)):
        ref, lazy = _prompts(pf, parts, recompute, views=tier != "tensor")
        s = pf.start(lazy)
        like = torch.empty((0, adapter.shape.num_kv_heads, adapter.shape.head_dim), dtype=adapter.dtype)
        _assert_layers_match(s, ref, adapter.num_layers, like, (tier, recompute))
        rep = s.finish()
        expect = {"host": "host", "disk": "disk", "tensor": "tensor"}[tier]
        assert rep.sources[expect] == (4 if tier == "tensor" else 3) - len(recompute)
        assert rep.sources["none"] == 2 + len(recompute)  # glue + suffix (+ recomputed chunk)
        assert len(rep.wait_ms) == adapter.num_layers and rep.failed == []
    if store is not None:
        assert tier != "disk" or store.disk.stats.bytes_read > 0


@pytest.mark.parametrize("storage", ["auto", "fp8"])
def test_host_images_plain_and_fp8_mixed_with_tensors(adapter, parts, tmp_path, storage):
    """Plain host images go through the request's copy plan, fp8 ones are decoded per layer;
    a prompt mixing them with in-memory chunks reads what the store decodes, and every
    loaded byte is counted."""
    store = open_store(tmp_path / storage, memory_bytes=64 << 20, gpu_bytes=0, use_cuda=False, storage_dtype=storage)
    for c in parts[3][:2]:
        store.put(c)
    pf = Prefetcher(adapter, store, PrefetchConfig(threaded=True))
    prefix, pchunk, chunk_ids, chunks, glue, suffix = parts
    segs = [Segment("prefix", prefix, pchunk)]
    segs += [Segment("chunk", ids, pf.view(c.key, ids)) for ids, c in zip(chunk_ids[:2], chunks[:2])]
    segs += [Segment("chunk", chunk_ids[2], chunks[2]), Segment("suffix", suffix)]
    decoded = [pchunk] + [store.get(c.key) for c in chunks[:2]] + [chunks[2]]
    ref = FusedPrompt([Segment(s.kind, s.token_ids, d) for s, d in zip(segs, decoded)] + [segs[-1]])
    s = pf.start(FusedPrompt(segs))
    like = torch.empty((0, adapter.shape.num_kv_heads, adapter.shape.head_dim), dtype=adapter.dtype)
    _assert_layers_match(s, ref, adapter.num_layers, like, storage)
    rep = s.finish()
    assert rep.sources == {"tensor": 2, "host": 2, "none": 1}
    cached = sum(len(s) for s in segs[:-1])
    assert rep.bytes_loaded == adapter.num_layers * cached * 2 * adapter.shape.num_kv_heads * adapter.shape.head_dim * adapter.dtype.itemsize
    if storage == "fp8":
        assert not torch.equal(decoded[1].k, chunks[0].k)  # really quantised: the test reads the decode


def test_fused_prefill_through_prefetcher(adapter, parts, tmp_path):
    store = _store(tmp_path, "disk")
    for c in parts[3]:
        store.put(c)
    pf = Prefetcher(adapter, store)
    ref, lazy = _prompts(pf, parts, recompute=(2,))
    sel = get_selector("epic").select(SelectionContext(adapter, ref, 0.3))
    want = fused_prefill(adapter, ref, sel.rows, logits_last=None)
    s = pf.start(lazy)
    got = fused_prefill(adapter, lazy, sel.rows, logits_last=None, source=s)
    s.finish()
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)


def test_order_sidecars_then_layers(adapter, parts, tmp_path):
    store = _store(tmp_path, "host")
    for c in parts[3]:
        store.put(c)
        ensure_sidecar(store, adapter, c.key, max(CRITICAL) + 1, CRITICAL)
    pf = Prefetcher(adapter, store, PrefetchConfig(threaded=False))
    _, lazy = _prompts(pf, parts, depth=2)
    s = pf.start(lazy)
    like = torch.empty((0, adapter.shape.num_kv_heads, adapter.shape.head_dim))
    with pytest.raises(ValueError, match="in order"):
        s.layer(1, like)
    for l in range(adapter.num_layers):
        s.layer(l, like)
    rep = s.finish()
    assert rep.order == [f"sidecar:{c.key.token_hash[:8]}" for c in parts[3]] + [f"layer:{l}" for l in range(3)]


def test_qcfuse_selects_the_same_from_sidecars(adapter, parts, tmp_path):
    """The probe on ChunkViews (anchors + critical K from the sidecar) picks what it picks on full chunks."""
    store = _store(tmp_path, "disk")
    for c in parts[3]:
        store.put(c)
        assert ensure_sidecar(store, adapter, c.key, 2, CRITICAL)
        assert not ensure_sidecar(store, adapter, c.key, 2, CRITICAL)  # stored once
    pf = Prefetcher(adapter, store)
    ref, lazy = _prompts(pf, parts, depth=2)
    assert all(isinstance(s.chunk, ChunkView) for s in lazy.segments if s.kind == "chunk")
    opts = {"critical_layers": CRITICAL}
    a = get_selector("qcfuse").select(SelectionContext(adapter, ref, 0.3, options=opts))
    b = get_selector("qcfuse").select(SelectionContext(adapter, lazy, 0.3, options=opts))
    assert torch.equal(a.rows, b.rows)
    torch.testing.assert_close(a.scores, b.scores)
    assert sum(s.chunk.sync_layer_loads for s in lazy.segments if s.kind == "chunk") == 0


def test_view_without_sidecar_raises(adapter, parts, tmp_path):
    store = _store(tmp_path, "host")
    store.put(parts[3][0])
    with pytest.raises(KeyError, match="ensure_sidecar"):
        Prefetcher(adapter, store).view(parts[3][0].key, parts[2][0], depth=2, critical=CRITICAL)


def _started_with_window_1(adapter, parts, tmp_path):
    """A threaded prefetcher's session over disk-tier chunks, one layer ahead at most (a CPU
    request from memory tiers has no loader thread: see the test below)."""
    store = _store(tmp_path, "disk")
    for c in parts[3]:
        store.put(c)
    pf = Prefetcher(adapter, store, PrefetchConfig(threaded=True, window=1))
    _, lazy = _prompts(pf, parts)
    return pf.start(lazy)


def test_loader_stays_within_its_window(adapter, parts, tmp_path):
    """The loader thread runs at most `window` layers ahead of the consumer (it must not
    compete with the probe for the interpreter lock and the copy engines)."""
    import time

    s = _started_with_window_1(adapter, parts, tmp_path)
    time.sleep(0.3)  # plenty for an unthrottled loader to load all 3 layers
    assert [o for o in s.report.order if o.startswith("layer:")] == ["layer:0"]
    like = torch.empty((0, adapter.shape.num_kv_heads, adapter.shape.head_dim), dtype=adapter.dtype)
    for l in range(adapter.num_layers):
        s.layer(l, like)
    rep = s.finish()
    assert [o for o in rep.order if o.startswith("layer:")] == [f"layer:{l}" for l in range(adapter.num_layers)]
    with pytest.raises(ValueError, match="window"):
        PrefetchConfig(window=0)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_cpu_loader_thread_only_for_disk_sources(adapter, parts, tmp_path, tier):
    """On a CPU a request from memory tiers copies each layer in its own thread when asked (a
    loader thread beside the compute team slowed the probe ~40% on 2 cores); disk reads keep
    the loader, which waits on I/O. The layers are the same either way."""
    store = _store(tmp_path, tier)
    for c in parts[3]:
        store.put(c)
    pf = Prefetcher(adapter, store, PrefetchConfig(threaded=True))
    ref, lazy = _prompts(pf, parts)
    s = pf.start(lazy)
    assert (s._thread is not None) == (tier == "disk")
    like = torch.empty((0, adapter.shape.num_kv_heads, adapter.shape.head_dim), dtype=adapter.dtype)
    _assert_layers_match(s, ref, adapter.num_layers, like, tier)
    rep = s.finish()
    assert [o for o in rep.order if o.startswith("layer:")] == [f"layer:{l}" for l in range(adapter.num_layers)]


def test_finish_releases_a_loader_left_waiting(adapter, parts, tmp_path):
    s = _started_with_window_1(adapter, parts, tmp_path)
    s.finish()  # the consumer gave up before layer 0: must not hang


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("storage", ["auto", "fp8"])
def test_pinned_host_images_stream_to_the_gpu_like_their_decode(tmp_path, storage):
    """On a GPU the host tier's pinned bytes travel and fp8 is decoded on the device (half of
    bf16's bytes cross the bus): every layer equals the store's own decode of the entry."""
    adapter = tiny_model("llama")
    adapter.model.to("cuda")
    g = torch.Generator().manual_seed(3)
    chunk_ids = [torch.randint(0, 256, (n,), generator=g) for n in (17, 9, 12)]
    chunks = [cache_alone(adapter, c) for c in chunk_ids]
    store = open_store(tmp_path, memory_bytes=64 << 20, gpu_bytes=0, use_cuda=True, storage_dtype=storage)
    for c in chunks:
        store.put(c)
    assert all(store.host.get(c.key, count=False).data.is_pinned() for c in chunks)
    pf = Prefetcher(adapter, store, PrefetchConfig(threaded=True))
    suffix = Segment("suffix", torch.randint(0, 256, (4,), generator=g))
    lazy = FusedPrompt([Segment("chunk", ids, pf.view(c.key, ids)) for ids, c in zip(chunk_ids, chunks)] + [suffix])
    ref = FusedPrompt([Segment("chunk", ids, store.get(c.key)) for ids, c in zip(chunk_ids, chunks)] + [suffix])
    s = pf.start(lazy)
    like = torch.empty((0, adapter.shape.num_kv_heads, adapter.shape.head_dim), dtype=adapter.dtype, device="cuda")
    _assert_layers_match(s, ref, adapter.num_layers, like, storage, on_cuda=True)
    rep = s.finish()
    assert rep.sources == {"host": 3, "none": 1}
    if storage == "fp8":
        assert not torch.equal(ref.layer(0, like)[0][:17], chunks[0].k[0].to(like))  # really quantised
    store.close()


@pytest.mark.parametrize("threaded", [True, False])
def test_fp8_entries_stream_from_disk_like_their_decode(adapter, parts, tmp_path, threaded):
    """fp8 entries read from disk are decoded on the store's I/O threads into the session's
    (inference-mode) buffers: every layer equals the store's own decode."""
    store = open_store(tmp_path, memory_bytes=0, gpu_bytes=0, use_cuda=False, storage_dtype="fp8")
    chunk_ids, chunks = parts[2], parts[3]
    for c in chunks:
        store.put(c)
    pf = Prefetcher(adapter, store, PrefetchConfig(threaded=threaded))
    suffix = Segment("suffix", parts[5])
    lazy = FusedPrompt([Segment("chunk", ids, pf.view(c.key, ids)) for ids, c in zip(chunk_ids, chunks)] + [suffix])
    ref = FusedPrompt([Segment("chunk", ids, store.get(c.key)) for ids, c in zip(chunk_ids, chunks)] + [suffix])
    s = pf.start(lazy)
    like = torch.empty((0, adapter.shape.num_kv_heads, adapter.shape.head_dim), dtype=adapter.dtype)
    _assert_layers_match(s, ref, adapter.num_layers, like, "fp8 disk")
    assert s.finish().sources == {"disk": 3, "none": 1}
    assert not torch.equal(ref.layer(0, like)[0][: len(chunk_ids[0])], chunks[0].k[0])  # really quantised
    store.close()


def test_segment_sources_and_dropped_buffers(adapter, parts, tmp_path):
    """The report names each prompt segment's source in order (a chunk the plan recomputes:
    none); a finished session's layer buffers serve the next one until `drop_buffers`."""
    store = _store(tmp_path, "host")
    for c in parts[3]:
        store.put(c)
    pf = Prefetcher(adapter, store, PrefetchConfig(threaded=False))
    like = torch.empty((0, adapter.shape.num_kv_heads, adapter.shape.head_dim), dtype=adapter.dtype)
    _, lazy = _prompts(pf, parts, recompute=(1,))
    s = pf.start(lazy)
    first = s._bufs
    for layer in range(adapter.num_layers):
        s.layer(layer, like)
    rep = s.finish()
    s.close()
    assert rep.segment_sources == ["tensor", "host", "none", "none", "host", "none"]
    assert rep.sources == {"tensor": 1, "host": 2, "none": 3}
    again = pf.start(lazy)
    assert again._bufs is first  # given back by the finished session, reused
    again.close()
    pf.drop_buffers()
    fresh = pf.start(lazy)
    assert fresh._bufs is not first  # dropped: allocated anew
    fresh.close()
    store.close()
