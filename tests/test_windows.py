"""Sliding-window layers: where a chunk's alone-cache is exact (windows.py), decoding under a
window, and the selectors leaving exact tokens out. Tiny random models, fp32."""

from __future__ import annotations

import pytest
import torch

from qcfuse_core.model.fusion import FusedPrompt, KVCache, Segment, decode_step, fused_prefill
from qcfuse_core.selection.options import QCFuseOptions
from qcfuse_core.selection.base import SelectionContext, get_selector
from qcfuse_core.model.testing import tiny_model
from qcfuse_core.model.windows import exact_from, exact_rows
from tests.qc_fixtures import prompt_alone

pytestmark = pytest.mark.kernels

ATOL = 2e-5


def _in_context_kv(m, prompt: FusedPrompt):
    """The true in-context pre-RoPE K and V (L, T, Hkv, D) of a prompt, from a full prefill."""
    T = prompt.num_tokens
    cache = KVCache(m, T)
    whole = FusedPrompt([Segment("suffix", prompt.token_ids)])
    k_pre = fused_prefill(m, whole, torch.arange(T), kv_out=cache, capture_pre_rope=True).k_pre
    return k_pre, cache.v[:, :T]


def test_exact_from_adds_window_reach_and_stops_at_full_attention():
    g = tiny_model("gemma3")  # windows [12, None, 12]
    assert [exact_from(g, layer) for layer in range(3)] == [0, 11, None]
    s = tiny_model("mistral-swa")  # windows [10, 10, 10]
    assert [exact_from(s, layer) for layer in range(3)] == [0, 9, 18]
    assert [exact_from(tiny_model("llama"), layer) for layer in range(3)] == [0, None, None]
    with pytest.raises(ValueError, match="layer"):
        exact_from(s, 3)


@pytest.mark.parametrize("arch", ["gemma3", "mistral-swa"])
def test_alone_cache_is_exact_exactly_where_windows_say(arch):
    """Chunk K/V computed alone equal the in-context ones from `exact_from` on, and differ just
    before it (and everywhere past a full-attention layer)."""
    m = tiny_model(arch)
    prompt = prompt_alone(m)
    k_ctx, v_ctx = _in_context_kv(m, prompt)
    for seg, start in zip(prompt.segments, prompt.starts):
        if seg.kind != "chunk":
            continue
        n = len(seg)
        for layer in range(m.num_layers):
            off = exact_from(m, layer)
            k_alone, v_alone = seg.chunk.k[layer], seg.chunk.v[layer]
            dk = (k_alone - k_ctx[layer, start : start + n]).abs().amax(dim=(1, 2))  # (n,) per offset
            dv = (v_alone - v_ctx[layer, start : start + n]).abs().amax(dim=(1, 2))
            if off is None:
                assert (dk > 1e-4).all() and (dv > 1e-4).all(), f"layer {layer}: no token can be exact"
                continue
            assert (dk[off:] <= ATOL).all() and (dv[off:] <= ATOL).all(), f"layer {layer} offset {off}"
            if 0 < off < n:
                assert dk[off - 1] > 1e-4, f"layer {layer}: offset {off - 1} should deviate"


def test_recomputing_all_but_exact_rows_equals_hf():
    """All-windowed model: every chunk token except the exact tail recomputed from alone caches
    gives HF's logits - the exact tokens need no recompute."""
    m = tiny_model("mistral-swa")
    prompt = prompt_alone(m)
    exact = exact_rows(m, prompt)
    assert int(exact.sum()) == (20 - 18) + (24 - 18)  # the tails of the 20- and 24-token chunks (16: none)
    rows = torch.nonzero(~exact & ~prompt.mask("prefix")).flatten()
    ref, _ = m.hf_forward(prompt.token_ids)
    out = fused_prefill(m, prompt, rows)
    assert torch.allclose(out.logits, ref, atol=ATOL, rtol=0), f"{(out.logits - ref).abs().max():.3e}"
    naive = fused_prefill(m, prompt, torch.nonzero(prompt.uncached_mask()).flatten())
    assert (naive.logits - ref).abs().max() > 1e-3  # the deviating rows did matter
    assert not exact_rows(tiny_model("gemma3"), prompt_alone(tiny_model("gemma3"))).any()


def test_selector_never_spends_budget_on_exact_rows():
    m = tiny_model("mistral-swa")
    prompt = prompt_alone(m)
    exact = exact_rows(m, prompt)
    mass = torch.zeros(prompt.num_tokens)
    mass[exact] = 10.0  # the highest scores sit on exact tokens
    mass[torch.tensor([7, 9, 30])] = 1.0
    sel = get_selector("qcfuse").choose(SelectionContext(m, prompt, 3 / 62), QCFuseOptions(), mass, {})
    chosen = set(sel.details["positions"].tolist())
    assert chosen == {7, 9, 30}
    for method in ("qcfuse", "qclast"):
        rows = get_selector(method).select(SelectionContext(m, prompt, 0.3)).rows
        assert not (exact[rows]).any(), method


@pytest.mark.parametrize("arch", ["gemma3", "mistral-swa"])
def test_query_aware_selection_runs_on_windowed_models(arch):
    m = tiny_model(arch)
    prompt = prompt_alone(m)
    for method in ("qcfuse", "qclast"):
        sel = get_selector(method).select(SelectionContext(m, prompt, 0.25, options={"critical_layers": [1, 2]}))
        assert sel.rows[-1] == prompt.num_tokens - 1 and torch.isfinite(sel.scores).all()


@pytest.mark.parametrize("arch", ["gemma3", "mistral-swa"])
def test_decode_under_a_window_equals_hf(arch):
    """Greedy decode from the fused cache past the window equals HF's forward of the longer sequence."""
    m = tiny_model(arch)
    ids = torch.randint(0, m.shape.vocab_size, (20,), generator=torch.Generator().manual_seed(5))
    cache = KVCache(m, 40)
    out = fused_prefill(m, FusedPrompt([Segment("suffix", ids)]), torch.arange(20), kv_out=cache)
    seq = ids.tolist()
    token = int(out.logits[-1].argmax())
    for _ in range(8):
        seq.append(token)
        logits = decode_step(m, cache, token)
        ref, _ = m.hf_forward(torch.tensor(seq))
        assert torch.allclose(logits, ref[-1], atol=1e-4, rtol=0), f"{(logits - ref[-1]).abs().max():.3e}"
        token = int(logits.argmax())
