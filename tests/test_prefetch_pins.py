"""Pins in the memory tiers: an entry a load session streams from is never evicted until the
session closes (also after an error); a tier's pins are reference counts, one per holder."""

import pytest
import torch
from store_fixtures import entry_bytes, host_charge, make_chunk

from qcfuse_core.cache.prefetch import LoadSession, PrefetchConfig, Prefetcher
from qcfuse_core.model.fusion import FusedPrompt, Segment
from qcfuse_core.model.testing import cache_alone
from qcfuse_core.store import get_policy, open_store
from qcfuse_core.store.entry import encode_chunk
from qcfuse_core.store.tier import MemoryTier
from tests.qc_fixtures import _store, adapter  # noqa: F401  (fixtures)

# prompt -> its segments: P the in-memory prefix, S the shared chunk, O its own chunk, G glue
LAYOUTS = (("P", "S", "G", "O"), ("O", "G", "S"), ("P", "S", "O"))
SHARED, OWN = 17, (9, 12, 6)  # chunk lengths
GLUE, SUFFIX = (3, 2, 0), (4, 5, 3)


@pytest.fixture(scope="module")
def pin_parts(adapter):  # noqa: F811
    """ids and in-memory caches: prefix, the shared chunk, each prompt's own chunk."""
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


def _prompts(pf, bp, layouts=LAYOUTS):
    """[(reference prompt over in-memory caches, lazy prompt over views)] per layout."""
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
            lazy.append(Segment("chunk", ids, pf.view(c.key, ids)))
        ref.append(Segment("suffix", bp["suffix"][m]))
        lazy.append(Segment("suffix", bp["suffix"][m]))
        out.append((FusedPrompt(ref), FusedPrompt(lazy)))
    return out


def _like(adapter, device="cpu"):  # noqa: F811
    return torch.empty((0, adapter.shape.num_kv_heads, adapter.shape.head_dim), dtype=adapter.dtype, device=device)


def _lockstep(sessions, refs, adapter, like):  # noqa: F811
    """Every session asks for layer l, then every one for l + 1, ...; each equals its reference."""
    for l in range(adapter.num_layers):
        for m, (s, ref) in enumerate(zip(sessions, refs)):
            k, v = s.layer(l, like)
            rk, rv = ref.layer(l, like)
            assert torch.equal(k, rk) and torch.equal(v, rv), (m, l)


def test_pinned_entries_are_never_evicted(adapter, pin_parts, tmp_path):  # noqa: F811
    """A small host tier filled while two sessions stream from it: eviction takes what is not
    pinned, a put that only pinned entries could make room for is refused (counted), and
    after the sessions close the same entries can go again. Pins count holders: the chunk
    both sessions read is pinned twice."""
    used = [pin_parts["shared"][1], pin_parts["own"][0][1], pin_parts["own"][1][1]]
    g = torch.Generator().manual_seed(11)
    fillers = [cache_alone(adapter, torch.randint(0, 256, (20,), generator=g)) for _ in range(2)]
    big = cache_alone(adapter, torch.randint(0, 256, (40,), generator=g))
    cap = sum(host_charge(entry_bytes(c)) for c in [*used, fillers[0]])  # the four fill the tier exactly
    store = open_store(tmp_path, memory_bytes=cap, gpu_bytes=0, use_cuda=False)
    for c in [*used, fillers[0]]:
        store.put(c)
    assert store.host.bytes_used == cap
    pf = Prefetcher(adapter, store, PrefetchConfig(threaded=False))
    pairs = _prompts(pf, pin_parts, (("S", "O"), ("O", "G", "S")))
    sessions = [pf.start(lazy) for _, lazy in pairs]
    assert [store.host.pins(c.key) for c in used] == [2, 1, 1]
    store.put(fillers[1])  # needs room: only the unpinned filler can give it
    assert fillers[0].key not in store.host and fillers[1].key in store.host
    assert all(c.key in store.host for c in used)
    store.put(big)  # larger than everything unpinned: not admitted, nothing evicted
    assert big.key not in store.host and fillers[1].key in store.host
    assert store.host.stats.refused_pinned == 1 and store.host.bytes_used <= cap
    assert store.contains(big.key)  # still stored on disk
    _lockstep(sessions, [ref for ref, _ in pairs], adapter, _like(adapter))
    for s in sessions:
        s.finish()
    assert all(store.host.pins(c.key) == 0 for c in used)
    assert store.promote(big.key)  # the sessions closed: their entries can be evicted again
    assert big.key in store.host and not all(c.key in store.host for c in used)
    assert store.host.bytes_used <= cap
    store.close()


def test_lone_sessions_pin_until_closed_also_on_errors(adapter, pin_parts, tmp_path, monkeypatch):  # noqa: F811
    store = _store(tmp_path, "host")
    _fill(store, pin_parts)
    key = pin_parts["shared"][1].key
    pf = Prefetcher(adapter, store, PrefetchConfig(threaded=False))
    ((_, lazy),) = _prompts(pf, pin_parts, LAYOUTS[:1])
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
