"""Chunked prefill: a prompt's prefill split into slices of positions run over several
scheduler steps (model/fusion.py `FuseItem.span`, `prefill_slices`; engine/scheduler.py).

Oracles: the same prefill unsliced (fp32, tiny random models: logits and every layer's
K/V to float tolerance, answers token for token); the same request alone in deterministic
mode (bit for bit); and the scheduler's own steps - a request decoding gets its token in
every step while a long prompt's prefill spans several."""

from __future__ import annotations

import pytest
import torch

from qcfuse_core.model.fusion import FusedPrompt, FuseItem, KVCache, Segment, fused_prefill_batch, prefill_slices
from qcfuse_core.model.testing import tiny_model
from tests.test_fusion_exact import KINDS, LENS, _prompt_alone, _report, _segments_lens

ATOL = 2e-5  # fp32


def test_prefill_slices_split_the_rows_end_to_end():
    rows = torch.tensor([0, 1, 5, 6, 7, 20, 21, 29])
    assert prefill_slices(rows, 3) == [(0, 6), (6, 21), (21, 30)]
    assert prefill_slices(rows, 8) == [(0, 30)]
    assert prefill_slices(torch.arange(10), 4) == [(0, 4), (4, 8), (8, 10)]


def _sliced(m, prompt: FusedPrompt, rows: torch.Tensor, size: int, exact: bool = False):
    """The prompt's fused prefill slice by slice into one cache -> (last logits, cache)."""
    cache = KVCache(m, prompt.num_tokens + 2)
    spans = prefill_slices(rows, size)
    assert len(spans) > 1
    for a, b in spans:
        part = rows[(rows >= a) & (rows < b)]
        out = fused_prefill_batch(m, [FuseItem(prompt, part, kv_out=cache, span=(a, b))], exact=exact)[0]
        assert out.logits.numel() == 0 if b < prompt.num_tokens else out.logits.shape[0] == 1
        assert cache.length == b
    return out.logits, cache


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mistral-swa"])
@pytest.mark.parametrize("share", [1.0, 0.3])
def test_a_sliced_prefill_equals_the_whole(arch, share):
    """Every row (full prefill) or a sparse row set over cached chunks, in slices of 5 and 16
    rows: the last logits and every layer's K/V are the unsliced prefill's (windows: gemma3's
    and mistral-swa's sliding layers; both GQA)."""
    m = tiny_model(arch)
    prompt = _prompt_alone(m, _segments_lens(m.shape.vocab_size, LENS, seed=3), KINDS)
    T = prompt.num_tokens
    g = torch.Generator().manual_seed(4)
    rows = torch.nonzero((torch.rand(T, generator=g) < share) | prompt.uncached_mask()).flatten()
    whole = KVCache(m, T + 2)
    ref = fused_prefill_batch(m, [FuseItem(prompt, rows, kv_out=whole)])[0].logits
    for size in (5, 16):
        logits, cache = _sliced(m, prompt, rows, size)
        assert torch.allclose(logits, ref, atol=ATOL, rtol=0), _report(logits, ref)
        for got, want in ((cache.k, whole.k), (cache.v, whole.v)):
            assert torch.allclose(got[:, :T], want[:, :T], atol=ATOL, rtol=0), _report(got[:, :T], want[:, :T])


def test_a_slice_checks_its_rows_and_span():
    m = tiny_model("llama")
    prompt = FusedPrompt([Segment("suffix", torch.arange(1, 11))])
    cache = KVCache(m, 10)
    with pytest.raises(ValueError, match="uncached"):  # position 3 of the span has no cache
        fused_prefill_batch(m, [FuseItem(prompt, torch.tensor([0, 1, 2, 4]), kv_out=cache, span=(0, 5))])
    with pytest.raises(ValueError, match="within"):
        fused_prefill_batch(m, [FuseItem(prompt, torch.arange(10), kv_out=cache, span=(0, 11))])
    with pytest.raises(ValueError, match="kv_out"):
        fused_prefill_batch(m, [FuseItem(prompt, torch.arange(5), span=(0, 5))])
