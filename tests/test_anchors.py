"""Anchor extraction: exact picks on toy tensors, the stored format, the repeat-prompt method."""

import pytest
import torch

from qcfuse_core.selection.anchors import (AnchorConfig, anchor_count, ensure_anchors, extract_anchors, has_anchors,
                                 top_with_sinks)
from qcfuse_core.model.testing import tiny_model
from qcfuse_core.types import ChunkKey, KVChunk
from tests.qc_fixtures import chunk_alone


def _chunk(k: torch.Tensor) -> KVChunk:
    T = k.shape[1]
    ids = torch.arange(T)
    return KVChunk(ChunkKey.for_tokens("0" * 16, ids), ids, k, torch.zeros_like(k))


def test_anchor_count():
    assert anchor_count(100, 0.125, 4) == 4 + 13
    assert anchor_count(3, 0.5, 4) == 3  # never more than the chunk
    assert anchor_count(10, 0.0, 4) == 4


def test_top_with_sinks_keeps_the_first_tokens_then_the_best_with_stable_ties():
    scores = torch.tensor([[9.0, 9, 0, 5, 1, 5, 7, 0],
                           [0.0, 0, 8, 1, 8, 2, 3, 9]])
    got = top_with_sinks(scores, count=4, sinks=2)
    # layer 0: sinks 0,1; rest [0,5,1,5,7,0] at 2..7 -> 6 (7), then 3 (5, earlier of the tie)
    # layer 1: sinks 0,1; rest -> 7 (9), then 2 (8, earlier of the tie with 4)
    assert got.tolist() == [[0, 1, 3, 6], [0, 1, 2, 7]]
    assert got.dtype == torch.int64


def test_keynorm_picks_the_largest_keys_per_layer():
    L, T, Hkv, D = 2, 12, 2, 4
    k = torch.ones(L, T, Hkv, D) * 0.1
    k[0, 9] *= 50
    k[0, 5] *= 20
    k[1, 7] *= 30
    k[1, 0] *= 99  # a sink anyway
    a = extract_anchors(tiny_model("llama"), _chunk(k), 2, AnchorConfig("keynorm", share=0.125, sinks=4))
    assert a.shape == (2, 4 + 2)  # ceil(0.125 * 12) = 2
    assert a[0].tolist() == [0, 1, 2, 3, 5, 9]
    assert a[1].tolist() == [0, 1, 2, 3, 4, 7]  # 7, then the earliest of the ties (4)


def test_repeat_anchors_on_a_tiny_model():
    m = tiny_model("llama")
    from qcfuse_core.engine.api import QCFuseEngine

    ids = torch.randint(0, m.shape.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    chunk = chunk_alone(QCFuseEngine(m), ids)
    cfg = AnchorConfig("repeat", share=0.1, sinks=4)
    a = extract_anchors(m, chunk, 3, cfg, repeat_ids=torch.tensor([5, 6, 7, 8]))
    assert a.shape == (3, 8)
    assert (a[:, :4] == torch.arange(4)).all()
    assert bool((a[:, 1:] > a[:, :-1]).all())  # sorted, unique
    with pytest.raises(ValueError, match="tokenizer"):
        extract_anchors(m, chunk, 3, cfg)  # tiny models have no tokenizer


def test_ensure_anchors_stores_in_the_chunk_and_recomputes_stale_ones():
    k = torch.randn(3, 16, 2, 4, generator=torch.Generator().manual_seed(0))
    chunk = _chunk(k)
    m = tiny_model("llama")
    cfg = AnchorConfig()
    a, fresh = ensure_anchors(m, chunk, 2, cfg)
    assert fresh and chunk.anchors["keynorm"] is a and a.shape == (2, 4 + 2)
    assert ensure_anchors(m, chunk, 2, cfg) == (a, False)
    assert not has_anchors(chunk, 3, cfg)  # needs a deeper layer -> recomputed
    b, fresh = ensure_anchors(m, chunk, 3, cfg)
    assert fresh and b.shape == (3, 6) and torch.equal(b[:2], a)


def test_anchor_config_rejects_bad_values():
    with pytest.raises(ValueError, match="keynorm, repeat"):
        AnchorConfig("bogus")
    with pytest.raises(ValueError, match="share"):
        AnchorConfig(share=1.5)
