"""Sub-spans of stored chunk caches (qcfuse_core/cache/subspans.py): a re-rendered text (truncated,
other whitespace) served from the stored cache of the text it renders."""

from __future__ import annotations

import pytest
import torch

from qcfuse_core.cache import subspans
from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.ingest.prefill import prefill_alone
from qcfuse_core.model.fusion import fused_prefill
from qcfuse_core.types import ChunkKey, Piece

# the embedded model through the shared per-process model cache: fast tier (tests/README.md)

STORED = ("Port Halden is a small harbour town on the north coast of Veloria, known for its red lighthouse "
          "and its narrow streets.\n\nEvery autumn the Lantern Festival fills the harbour of Port Halden with "
          "floating paper lanterns, and the fishing boats stay in port for three days of music and food.")
TRUNCATED = STORED[:150]  # a formatter cutting page_content: ends inside a word
NORMALISED = " ".join(STORED.split())  # a formatter normalising whitespace
QUESTION = "When is the Lantern Festival?"


@pytest.fixture(scope="module")
def engine(smol):
    eng = QCFuseEngine(smol)
    eng.build_chunks([STORED], ["doc-1"])
    return eng


def pieces(engine, rendering, source=STORED):
    chunk = Piece("chunk", rendering, "doc-1", source=source)
    return engine.frame.completion_pieces(f"Context:\n{rendering}\n\nQuestion: {QUESTION}", [chunk])


def test_a_prefix_slice_is_the_alone_cache_of_its_tokens(engine):
    stored = engine.caches.store.get(engine.caches.chunk_tokens(STORED)[1])
    for n in (5, 17, stored.num_tokens - 3):
        piece = subspans.slice_chunk(stored, 0, n, engine.caches.fingerprint)
        k, v = prefill_alone(engine.adapter, stored.token_ids[:n])
        assert torch.equal(piece.token_ids, stored.token_ids[:n]) and piece.exact
        assert torch.allclose(piece.k, k, atol=1e-4) and torch.allclose(piece.v, v, atol=1e-4)
        assert piece.key == ChunkKey.for_tokens(engine.caches.fingerprint, stored.token_ids[:n])  # what it is
    inner = subspans.slice_chunk(stored, 7, 20, engine.caches.fingerprint)
    k, _ = prefill_alone(engine.adapter, stored.token_ids[7:27])
    assert not torch.allclose(inner.k, k, atol=1e-2)  # an inner slice is not its tokens' alone-cache ...
    assert inner.key not in (stored.key, ChunkKey.for_tokens(engine.caches.fingerprint, inner.token_ids))  # ... nor keyed so
    with pytest.raises(ValueError, match="outside a chunk"):
        subspans.slice_chunk(stored, stored.num_tokens - 2, 5, engine.caches.fingerprint)


@pytest.mark.parametrize("rendering", [TRUNCATED, NORMALISED], ids=["truncated", "normalised"])
def test_a_rendering_is_served_from_the_stored_chunk_at_its_own_tokens(engine, rendering):
    entries = len(list(engine.caches.store.keys()))
    looked = engine._steps.lookup(pieces(engine, rendering), "qcfuse", streaming=False)
    plain = engine._steps.lookup(engine.frame.completion_pieces(f"Context:\n{rendering}\n\nQuestion: {QUESTION}", []), "full")
    stored = engine.caches.store.get(engine.caches.chunk_tokens(STORED)[1])
    own = engine.caches.chunk_tokens(rendering)[0]
    # the prompt's tokens are those of the rendering, whatever was served
    assert torch.equal(torch.cat([p.ids for p in looked.parts]), torch.cat([p.ids for p in plain.parts]))
    pos = next(i for i, p in enumerate(looked.parts) if p.kind == "chunk")
    at = 0
    served = [p for p in looked.parts if isinstance(p.chunk, subspans.SliceChunk)]
    assert served and served[0].chunk.exact  # the rendering starts like the stored text
    for p in looked.parts[pos:]:
        if p.kind == "suffix":
            break
        n = int(p.ids.numel())
        assert torch.equal(p.ids, own[at:at + n])  # each part is the rendering's tokens at its place
        if isinstance(p.chunk, subspans.SliceChunk):  # and a slice holds exactly the tokens it serves
            c = p.chunk
            assert p.hit and torch.equal(c.token_ids, p.ids) and c.source == stored.key
            assert torch.equal(stored.token_ids[c.start:c.start + n], p.ids)
            assert torch.equal(c.k, stored.k[:, c.start:c.start + n])
        at += n
    assert at == own.numel()
    if rendering is TRUNCATED:  # one exact prefix and the cut word computed
        assert len(served) == 1 and own.numel() - served[0].ids.numel() <= 2
    else:  # the first paragraph exactly, the second from inside the stored chunk
        assert len(served) == 2 and not served[1].chunk.exact
    assert looked.misses == 0  # nothing built, no slice stored (the only new entry is the prompt's prefix)
    assert not engine.caches.store.contains(engine.caches.chunk_tokens(rendering)[1])
    assert all(not engine.caches.store.contains(p.key) for p in served) and len(list(engine.caches.store.keys())) <= entries + 1


@pytest.mark.parametrize("rendering", [TRUNCATED, NORMALISED], ids=["truncated", "normalised"])
def test_fused_prefill_with_every_row_recomputed_equals_hf_on_a_served_prompt(engine, smol, rendering):
    prompt, hits, misses = engine._steps.fuse_pieces(pieces(engine, rendering))
    assert hits >= 1 and misses == 0 and subspans.served_tokens(prompt.segments) > 0
    ref, _ = smol.hf_forward(prompt.token_ids, keep=None)
    out = fused_prefill(smol, prompt, torch.arange(prompt.num_tokens), logits_last=None)
    assert torch.allclose(out.logits, ref, atol=1e-3, rtol=1e-5)


def test_answers_count_the_served_tokens_and_fall_back_without_a_source(engine):
    got = engine.complete(f"Context:\n{TRUNCATED}\n\nQuestion: {QUESTION}",
                          [Piece("chunk", TRUNCATED, "doc-1", source=STORED)], max_new_tokens=2)
    n = engine.caches.chunk_tokens(TRUNCATED)[0].numel()
    assert got.cache_hits == 1 and got.cache_misses == 0 and n - 2 <= got.subspan_tokens < n
    assert got.to_dict()["subspan_tokens"] == got.subspan_tokens
    other = TRUNCATED.replace("Port Halden", "Port Haldne")
    plain = engine.complete(f"Context:\n{other}\n\nQuestion: {QUESTION}",
                            [Piece("chunk", other, "doc-2", source="a text that was never stored, so no cache")],
                            max_new_tokens=2)
    assert plain.cache_misses == 1 and plain.subspan_tokens == 0  # computed whole, as without a source
    assert engine.caches.store.contains(engine.caches.chunk_tokens(other)[1])


def test_runs_obey_their_minimum_lengths(monkeypatch):
    src = torch.arange(40)
    ids = torch.cat([src[:5], torch.tensor([99]), src[10:30]])  # a 5-token prefix, a 20-token inner run
    assert subspans.runs(ids, src) == [(0, 0, 5), (6, 10, 20)]
    assert subspans.runs(ids, src, min_prefix=6) == [(6, 10, 20)]
    monkeypatch.setattr(subspans, "MIN_RUN", 41)  # prefixes only
    assert subspans.runs(ids, src) == [(0, 0, 5)]


def test_a_text_served_in_several_runs_counts_as_one_chunk(engine):
    """NORMALISED is served in two runs (its paragraphs); the statistics count one chunk, a hit."""
    looked = engine._steps.lookup(pieces(engine, NORMALISED), "qcfuse", streaming=False)
    assert sum(isinstance(p.chunk, subspans.SliceChunk) for p in looked.parts) == 2
    assert (looked.hits, looked.misses) == (1, 0)
    got = engine.complete(f"Context:\n{NORMALISED}\n\nQuestion: {QUESTION}",
                          [Piece("chunk", NORMALISED, "doc-1", source=STORED)], max_new_tokens=2)
    assert got.chunks == 1 and got.cache_hits == 1 and got.cache_misses == 0 and got.subspan_tokens > 0
