"""The studio's run-history numbers (qcfuse_core/studio/quality.py) and the why-recomputed
explanation (details.why_recomputed) on hand-made results: exact values, toy sizes, CPU."""

from __future__ import annotations

import pytest
import torch

from qcfuse_core.eval.metrics import kl_divergence
from qcfuse_core.studio.details import START_WINDOW, why_recomputed
from qcfuse_core.studio.quality import (
    decode_rate,
    drop_logits,
    lcs_length,
    quality,
    representative,
    speed,
    token_match,
)
from qcfuse_core.types import FusionResult


def result(ttft: float, total: float, ids: list[int], text: str = "", logits: list[float] | None = None) -> FusionResult:
    return FusionResult(text=text, token_ids=ids, ttft_ms=ttft, total_ms=total,
                        first_logits=None if logits is None else torch.tensor(logits))


def test_lcs_and_token_match_count_tokens_in_order():
    assert lcs_length([1, 2, 3, 4], [1, 3, 4]) == 3
    assert lcs_length([], [1]) == 0
    assert token_match([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert token_match([1, 9, 3, 4], [1, 2, 3, 4]) == 0.75  # one token differs, the rest line up
    assert token_match([5, 1, 2, 3], [1, 2, 3]) == 0.75  # shifted by one: 3 of the longer 4
    assert token_match([4, 3, 2, 1], [1, 2, 3, 4]) == 0.25
    assert token_match([], []) == 1.0 and token_match([], [1, 2]) == 0.0


def test_speed_is_the_median_repeat_and_its_decode_rate():
    reps = [result(30.0, 130.0, [1, 2, 3]), result(10.0, 60.0, [1, 2, 3]), result(20.0, 120.0, [1, 2, 3])]
    assert representative(reps) is reps[2]
    sp = speed(reps)
    assert (sp.repeats, sp.ttft_ms, sp.total_ms) == (3, 20.0, 120.0)
    assert sp.ttft_all_ms == (30.0, 10.0, 20.0)
    assert sp.decode_tok_s == 20.0  # rates 20, 40, 20 tok/s (2 tokens after the first)
    assert decode_rate(reps[1]) == 40.0
    even = [result(40.0, 50.0, [1]), result(10.0, 20.0, [1])]
    assert representative(even) is even[1] and speed(even).ttft_ms == 10.0  # the lower middle: one repeat's own
    assert speed(even).decode_tok_s is None  # one token: nothing decoded after the first
    with pytest.raises(ValueError, match="at least one repeat"):
        speed([])
    with pytest.raises(ValueError, match="no repeats"):
        representative([])


def test_quality_against_full_prefill():
    full = result(50.0, 90.0, [1, 2, 3, 4], "Paris is big.", [2.0, 0.0, -1.0])
    same = result(20.0, 60.0, [1, 2, 3, 4], " Paris  is big.", [1.9, 0.1, -1.0])
    q = quality([same], full)
    assert q.kl_first_token == pytest.approx(kl_divergence(full.first_logits, same.first_logits), abs=1e-6)
    assert q.kl_first_token > 0 and q.token_match == 1.0 and q.answer_matches and q.repeats_agree
    assert quality([full], full).kl_first_token == 0.0
    other = result(20.0, 60.0, [1, 9, 3, 4], "Paris was big.", [0.0, 2.0, -1.0])
    q = quality([other, same], full)
    assert q.token_match == 0.75 and not q.answer_matches and not q.repeats_agree
    with pytest.raises(ValueError, match="first-token logits"):
        quality([result(1.0, 2.0, [1])], full)
    with pytest.raises(ValueError, match="different vocabularies"):
        quality([result(1.0, 2.0, [1], "", [0.0, 1.0])], full)
    assert drop_logits(full).first_logits is None and drop_logits(full).token_ids == full.token_ids


def test_why_recomputed_counts_stale_starts_and_filler_per_chunk():
    """Two chunks of 6 tokens and one glue token; qcfuse recomputed 4 chunk rows: the first
    chunk's position 0 ('The') and position 4 (','), the second chunk's positions 1 ('.')
    and 5 ('Oslo')."""
    L = 4
    segments = [{"index": 0, "kind": "chunk", "start": 0, "end": 6, "node_id": "a", "cache_hit": True},
                {"index": 1, "kind": "text", "start": 6, "end": 7, "node_id": None, "cache_hit": False},
                {"index": 2, "kind": "chunk", "start": 7, "end": 13, "node_id": "b", "cache_hit": True}]
    texts = ["The", " port", " of", " Halden", ",", " built", "\n", " It", ".", " is", " in", " the", " Oslo"]
    rec = {0, 4, 6, 8, 12}
    seg_of = [0] * 6 + [1] + [2] * 6
    tokens = [{"pos": p, "text": t, "seg": seg_of[p], "depth": L if p in rec else 0, "score": 1.0 if p < 6 else 3.0,
               "anchor": p in (0, 1, 7)} for p, t in enumerate(texts)]
    ex = why_recomputed("qcfuse", "attention mass", [2, 1], segments, tokens, L)
    assert START_WINDOW == 4
    a, b = ex["chunks"]
    assert (a["recomputed"], a["recomputed_at_start"], a["recomputed_filler"], a["anchors"]) == (2, 1, 2, 2)
    assert (b["recomputed"], b["recomputed_at_start"], b["recomputed_filler"], b["anchors"]) == (2, 1, 1, 1)
    assert a["score_share"] == pytest.approx(6 / (6 + 1 * 3 + 18), abs=1e-4) and b["score_share"] == pytest.approx(18 / 27, abs=1e-4)
    assert (ex["recomputed_chunk_tokens"], ex["recomputed_at_start"], ex["recomputed_filler"], ex["glue_tokens"]) == (4, 2, 3, 1)
    text = " ".join(ex["text"])
    assert "layers 1, 2" in text and "3 anchor tokens" in text
    assert "2 of the 4 recomputed chunk tokens are among a chunk's first 4 positions" in text
    assert "3 of them are punctuation" in text and "The 1 glue token between chunks has no cache" in text
    full = why_recomputed("full", None, [], segments, [{**t, "depth": L} for t in tokens], L)
    assert full["text"][0].startswith("Full prefill computes every token") and full["chunks"][0]["score_share"] is None
