"""Loads shared across a batch (cache/batch.py) and pins in the memory tiers: every member
reads exactly what a lone session over its prompt would; a chunk several members use
crosses once per layer (exact byte counts); an entry a session streams from is never
evicted until the session closes; members close independently."""

import pytest
import torch
from store_fixtures import entry_bytes, entry_file, host_charge, make_chunk
from test_prefetch import _assert_layers_match, _store, adapter, parts  # noqa: F401  (fixtures)

from qcfuse_core.cache.batch import BatchSession, start_batch
from qcfuse_core.cache.prefetch import LoadSession, PrefetchConfig, Prefetcher
from qcfuse_core.model.fusion import FusedPrompt, Segment
from qcfuse_core.model.testing import cache_alone, tiny_model
from qcfuse_core.store import get_policy, open_store
from qcfuse_core.store.entry import encode_chunk
from qcfuse_core.store.tier import MemoryTier

# member -> its segments: P the in-memory prefix, S the shared chunk, O its own chunk, G glue
LAYOUTS = (("P", "S", "G", "O"), ("O", "G", "S"), ("P", "S", "O"))
SHARED, OWN = 17, (9, 12, 6)  # chunk lengths
GLUE, SUFFIX = (3, 2, 0), (4, 5, 3)


@pytest.fixture(scope="module")
def batch_parts(adapter):  # noqa: F811
    """ids and in-memory caches: prefix, the shared chunk, each member's own chunk."""
    g = torch.Generator().manual_seed(7)
    ids = lambda n: torch.randint(0, 256, (n,), generator=g)  # noqa: E731
    prefix, shared = ids(5), ids(SHARED)
    own = [ids(n) for n in OWN]
    return {
        "prefix": (prefix, cache_alone(adapter, prefix)),
        "shared": (shared, cache_alone(adapter, shared)),
        "own": [(o, cache_alone(adapter, o)) for o in own],
        "glue": [ids(n) for n in GLUE],
        "suffix": [ids(n) for n in SUFFIX],
    }


def _fill(store, bp) -> None:
    for _, c in [bp["shared"], *bp["own"]]:
        store.put(c)


def _batch(pf, bp, layouts=LAYOUTS, views=True):
    """[(reference prompt over in-memory caches, lazy prompt over views)] per member."""
    out = []
    for m, layout in enumerate(layouts):
        ref, lazy = [], []
        for part in layout:
            if part == "G":
                ref.append(Segment("text", bp["glue"][m]))
                lazy.append(Segment("text", bp["glue"][m]))
                continue
            if part == "P":
                ids, c = bp["prefix"]
                ref.append(Segment("prefix", ids, c))
                lazy.append(Segment("prefix", ids, c))  # the same in-memory object in every prompt
                continue
            ids, c = bp["shared"] if part == "S" else bp["own"][m]
            ref.append(Segment("chunk", ids, c))
            lazy.append(Segment("chunk", ids, pf.view(c.key, ids) if views else c))
        ref.append(Segment("suffix", bp["suffix"][m]))
        lazy.append(Segment("suffix", bp["suffix"][m]))
        out.append((FusedPrompt(ref), FusedPrompt(lazy)))
    return out


def _like(adapter, device="cpu"):  # noqa: F811
    return torch.empty((0, adapter.shape.num_kv_heads, adapter.shape.head_dim), dtype=adapter.dtype, device=device)


def _row_bytes(adapter) -> int:  # noqa: F811
    return 2 * adapter.shape.num_kv_heads * adapter.shape.head_dim * adapter.dtype.itemsize


def _lockstep(members, refs, adapter, like, skip=()):  # noqa: F811
    """Every open member asks for layer l, then every one for l + 1, ...; each equals its reference."""
    for l in range(adapter.num_layers):
        for m, (s, ref) in enumerate(zip(members, refs)):
            if m in skip:
                continue
            k, v = s.layer(l, like)
            rk, rv = ref.layer(l, like)
            assert torch.equal(k, rk) and torch.equal(v, rv), (m, l)


@pytest.mark.parametrize("tier", ["host", "disk", "tensor"])
@pytest.mark.parametrize("threaded", [True, False])
def test_members_read_their_layers_and_shared_chunks_load_once(adapter, batch_parts, tmp_path, tier, threaded):  # noqa: F811
    store = None
    if tier != "tensor":
        store = _store(tmp_path, tier)
        _fill(store, batch_parts)
    pf = Prefetcher(adapter, store, PrefetchConfig(threaded=threaded))
    pairs = _batch(pf, batch_parts, views=tier != "tensor")
    members = start_batch(pf, [lazy for _, lazy in pairs])
    assert all(isinstance(s, BatchSession) for s in members)
    _lockstep(members, [ref for ref, _ in pairs], adapter, _like(adapter))
    reps = [s.finish() for s in members]

    L, rb, P = adapter.num_layers, _row_bytes(adapter), len(batch_parts["prefix"][0])
    # member 0 brings the prefix, the shared chunk and its own; the others only their own
    assert [r.bytes_loaded for r in reps] == [L * rb * n for n in (P + SHARED + OWN[0], OWN[1], OWN[2])]
    assert [r.bytes_shared for r in reps] == [0, L * rb * SHARED, L * rb * (P + SHARED)]
    kind = tier if tier != "tensor" else "tensor"
    assert reps[1].bytes_by_source == {kind: L * rb * OWN[1]}
    batch = {(r.batch_size, r.batch_bytes_loaded, r.batch_bytes_separate) for r in reps}
    assert len(batch) == 1  # the same batch figures on every member
    _, loaded, separate = batch.pop()
    assert loaded == sum(r.bytes_loaded for r in reps)
    assert separate - loaded == L * rb * (2 * SHARED + P)  # two extra copies of S, one of the prefix
    # every member's counts and sources are what a lone session over its prompt reports
    for (_, lazy), rep in zip(pairs, reps):
        with pf.start(lazy) as lone:
            for l in range(L):
                lone.layer(l, _like(adapter))
            want = lone.finish()
        assert rep.bytes_loaded + rep.bytes_shared == want.bytes_loaded
        assert rep.sources == want.sources and rep.failed == [] and len(rep.wait_ms) == L
        assert rep.order[-L:] == [f"layer:{l}" for l in range(L)]
    d = reps[2].to_dict()
    assert d["bytes_shared"] == reps[2].bytes_shared and d["batch_bytes_separate"] == separate
    assert len(pf._free) == 1  # the shared buffers went back once, when the last member finished
    if store is not None:
        assert all(t.pins(k) == 0 for t in store.memory_tiers for k in t.keys())
        store.close()


def test_a_batch_of_one_is_start(adapter, batch_parts, tmp_path):  # noqa: F811
    store = _store(tmp_path, "host")
    _fill(store, batch_parts)
    pf = Prefetcher(adapter, store, PrefetchConfig(threaded=False))
    (ref, lazy), = _batch(pf, batch_parts, LAYOUTS[:1])
    (one,) = start_batch(pf, [lazy])
    assert isinstance(one, LoadSession)
    _assert_layers_match(one, ref, adapter.num_layers, _like(adapter), "one")
    got = one.finish()
    want = pf.start(lazy)
    _assert_layers_match(want, ref, adapter.num_layers, _like(adapter), "start")
    want = want.finish()
    keys = ("sources", "bytes_loaded", "bytes_by_source", "bytes_shared", "batch_size", "failed")
    assert {k: getattr(got, k) for k in keys} == {k: getattr(want, k) for k in keys}
    assert got.batch_bytes_loaded == got.batch_bytes_separate == got.bytes_loaded > 0
    assert start_batch(pf, []) == []


def test_member_closed_early_the_others_go_on(adapter, batch_parts, tmp_path):  # noqa: F811
    store = _store(tmp_path, "host")
    _fill(store, batch_parts)
    pf = Prefetcher(adapter, store, PrefetchConfig(threaded=False))
    pairs = _batch(pf, batch_parts)
    refs = [ref for ref, _ in pairs]
    members = start_batch(pf, [lazy for _, lazy in pairs])
    like = _like(adapter)
    shared_key = batch_parts["shared"][1].key
    assert store.host.pins(shared_key) == 1  # the shared load pins each unique entry once
    for s, ref in zip(members, refs):  # layer 0 for everyone
        k, v = s.layer(0, like)
        assert torch.equal(k, ref.layer(0, like)[0])
    members[0].close()  # member 0 (the one that brought the shared chunk) fails
    members[0].close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        members[0].layer(1, like)
    for l in range(1, adapter.num_layers):
        for s, ref in zip(members[1:], refs[1:]):
            k, v = s.layer(l, like)
            rk, rv = ref.layer(l, like)
            assert torch.equal(k, rk) and torch.equal(v, rv), l
    assert store.host.pins(shared_key) == 1 and pf._free == []  # still held for members 1 and 2
    members[1].finish()
    members[2].close()  # the last one leaves by close: pins and buffers go back
    members[2].close()
    assert store.host.pins(shared_key) == 0 and len(pf._free) == 1
    assert all(store.host.pins(k) == 0 for k in store.host.keys())
    again = start_batch(pf, [lazy for _, lazy in pairs])
    with pytest.raises(ValueError, match="in order"):
        again[1].layer(2, like)
    for s in again:
        s.close()
    assert all(store.host.pins(k) == 0 for k in store.host.keys()) and len(pf._free) == 1
    store.close()


def test_pinned_entries_are_never_evicted(adapter, batch_parts, tmp_path):  # noqa: F811
    """A small host tier filled while a batch streams from it: eviction takes what is not
    pinned, a put that only pinned entries could make room for is refused (counted), and
    after the batch closes the same entries can go again."""
    used = [batch_parts["shared"][1], batch_parts["own"][0][1], batch_parts["own"][1][1]]
    g = torch.Generator().manual_seed(11)
    fillers = [cache_alone(adapter, torch.randint(0, 256, (20,), generator=g)) for _ in range(2)]
    big = cache_alone(adapter, torch.randint(0, 256, (40,), generator=g))
    cap = sum(host_charge(entry_bytes(c)) for c in [*used, fillers[0]])  # the four fill the tier exactly
    store = open_store(tmp_path, memory_bytes=cap, gpu_bytes=0, use_cuda=False)
    for c in [*used, fillers[0]]:
        store.put(c)
    assert store.host.bytes_used == cap
    pf = Prefetcher(adapter, store, PrefetchConfig(threaded=False))
    pairs = _batch(pf, batch_parts, (("S", "O"), ("O", "G", "S")))
    members = start_batch(pf, [lazy for _, lazy in pairs])
    assert all(store.host.pins(c.key) == 1 for c in used)
    store.put(fillers[1])  # needs room: only the unpinned filler can give it
    assert fillers[0].key not in store.host and fillers[1].key in store.host
    assert all(c.key in store.host for c in used)
    store.put(big)  # larger than everything unpinned: not admitted, nothing evicted
    assert big.key not in store.host and fillers[1].key in store.host
    assert store.host.stats.refused_pinned == 1 and store.host.bytes_used <= cap
    assert store.contains(big.key)  # still stored on disk
    _lockstep(members, [ref for ref, _ in pairs], adapter, _like(adapter))
    for s in members:
        s.finish()
    assert all(store.host.pins(c.key) == 0 for c in used)
    assert store.promote(big.key)  # the batch closed: its entries can be evicted again
    assert big.key in store.host and not all(c.key in store.host for c in used)
    assert store.host.bytes_used <= cap
    store.close()


def test_lone_sessions_pin_until_closed_also_on_errors(adapter, batch_parts, tmp_path, monkeypatch):  # noqa: F811
    store = _store(tmp_path, "host")
    _fill(store, batch_parts)
    key = batch_parts["shared"][1].key
    pf = Prefetcher(adapter, store, PrefetchConfig(threaded=False))
    (_, lazy), = _batch(pf, batch_parts, LAYOUTS[:1])
    s = pf.start(lazy)
    assert store.host.pins(key) == 1
    s.close()
    s.close()
    assert store.host.pins(key) == 0

    def broken(self, layer):
        raise OSError("copy failed")

    monkeypatch.setattr(LoadSession, "_load", broken)
    s = pf.start(lazy)
    with pytest.raises(RuntimeError, match="prefetch failed"):
        s.layer(0, _like(adapter))
    assert store.host.pins(key) == 1
    with pytest.raises(RuntimeError, match="prefetch failed"):
        s.finish()
    assert store.host.pins(key) == 0

    def no_buffers(self, T, disk_T):
        raise MemoryError("no room for the buffers")

    monkeypatch.setattr(Prefetcher, "_take_buffers", no_buffers)
    with pytest.raises(MemoryError):
        pf.start(lazy)
    assert store.host.pins(key) == 0  # a session that never started holds nothing
    store.close()


def test_a_load_error_reaches_every_member(adapter, batch_parts, tmp_path, monkeypatch):  # noqa: F811
    store = _store(tmp_path, "host")
    _fill(store, batch_parts)
    pf = Prefetcher(adapter, store, PrefetchConfig(threaded=False))
    members = start_batch(pf, [lazy for _, lazy in _batch(pf, batch_parts)])

    def broken(self, layer):
        raise OSError("copy failed")

    monkeypatch.setattr(LoadSession, "_load", broken)
    for s in members:
        with pytest.raises(RuntimeError, match="prefetch failed"):
            s.layer(0, _like(adapter))
    for s in members:
        with pytest.raises(RuntimeError, match="prefetch failed"):
            s.finish()
    assert all(store.host.pins(k) == 0 for k in store.host.keys()) and len(pf._free) == 1
    store.close()


@pytest.mark.parametrize("threaded", [True, False])
def test_unreadable_disk_layer_fails_on_every_member_using_it(adapter, batch_parts, tmp_path, threaded):  # noqa: F811
    """Layer 1 of the shared chunk is damaged on disk: each member using it lists its own
    segment index of that chunk in `failed`, its rows there are zeros, all else is exact."""
    store = _store(tmp_path, "disk")
    _fill(store, batch_parts)
    key = batch_parts["shared"][1].key
    start, end = store.disk.layout(key).layer_spans[1]
    path = entry_file(store, key)
    raw = bytearray(path.read_bytes())
    raw[(start + end) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    pf = Prefetcher(adapter, store, PrefetchConfig(threaded=threaded))
    layouts = (("P", "S", "G", "O"), ("O", "G", "S"), ("P", "O"))  # member 2 does not use S
    pairs = _batch(pf, batch_parts, layouts)
    members = start_batch(pf, [lazy for _, lazy in pairs])
    like = _like(adapter)
    for l in range(adapter.num_layers):
        for m, (s, (ref, _)) in enumerate(zip(members, pairs)):
            k, v = s.layer(l, like)
            rk, rv = ref.layer(l, like)
            at = layouts[m].index("S") if "S" in layouts[m] else None
            keep = torch.ones(ref.num_tokens, dtype=torch.bool)
            if at is not None and l >= 1:  # the shared chunk's rows: zeros from layer 1 on, or exact
                a = ref.starts[at]
                rows = slice(a, a + SHARED)
                assert torch.equal(k[rows], torch.zeros_like(k[rows])) or l > 1
                keep[rows] = False
            assert torch.equal(k[keep], rk[keep]) and torch.equal(v[keep], rv[keep]), (m, l)
    reps = [s.finish() for s in members]
    assert [r.failed for r in reps] == [[1], [2], []]
    assert reps[0].sources == {"tensor": 1, "disk": 2, "none": 2}
    store.close()


def test_tier_pins_are_reference_counted():
    images = [encode_chunk(make_chunk(i), "auto") for i in range(4)]
    n = images[0].nbytes
    tier = MemoryTier("host", "cpu", 2 * n, get_policy("lru"))
    a, b, c, d = images
    tier.put(a)
    tier.put(b)
    assert tier.pin(a.key) is not None and tier.pin(a.key) is not None  # two holders
    assert tier.pin(c.key) is None and tier.pins(c.key) == 0  # a miss pins nothing
    assert tier.put(c) == [b.key]  # a is the least recently used, but pinned
    tier.unpin(a.key)
    assert tier.put(d) == [c.key]  # still one holder of a
    tier.unpin(a.key)
    tier.unpin(a.key)  # one too many: nothing happens
    assert tier.pins(a.key) == 0
    assert tier.put(b) == [a.key]
    tier.pin(b.key)
    tier.pin(d.key)
    assert tier.put(a) == [] and a.key not in tier and tier.stats.refused_pinned == 1
    assert tier.summary()["pinned_entries"] == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eager", [True, False])
def test_batch_on_the_gpu_from_pinned_host_images(tmp_path, eager):
    """On CUDA (side stream; eager issue or a loader thread) every member equals its
    reference, the shared chunk crosses once per layer, and waits come from events."""
    adapter = tiny_model("llama")
    adapter.model.to("cuda")
    g = torch.Generator().manual_seed(5)
    bp = {
        "prefix": (p := torch.randint(0, 256, (5,), generator=g), cache_alone(adapter, p)),
        "shared": (s := torch.randint(0, 256, (SHARED,), generator=g), cache_alone(adapter, s)),
        "own": [(o, cache_alone(adapter, o)) for o in (torch.randint(0, 256, (n,), generator=g) for n in OWN)],
        "glue": [torch.randint(0, 256, (n,), generator=g) for n in GLUE],
        "suffix": [torch.randint(0, 256, (n,), generator=g) for n in SUFFIX],
    }
    store = open_store(tmp_path, memory_bytes=64 << 20, gpu_bytes=0, use_cuda=True)
    _fill(store, bp)
    pf = Prefetcher(adapter, store, PrefetchConfig(threaded=True, eager_memory=eager))
    pairs = _batch(pf, bp)
    members = start_batch(pf, [lazy for _, lazy in pairs])
    like = _like(adapter, "cuda")
    _lockstep(members, [ref for ref, _ in pairs], adapter, like)
    reps = [m.finish() for m in members]
    L, rb = adapter.num_layers, _row_bytes(adapter)
    assert reps[0].batch_bytes_separate - reps[0].batch_bytes_loaded == L * rb * (2 * SHARED + 5)
    assert all(len(r.wait_ms) == L and len(r.compute_ms) == L - 1 for r in reps)
    assert store.host.pins(bp["shared"][1].key) == 0
    store.close()
