"""Exactness of chunk prefill and fused prefill against HF transformers' own forward.

Oracles:
- every row recomputed             == HF forward of the whole prompt
- exact in-context caches + sparse == HF forward (exercises scatter, re-rotation, sparse attention)
- nothing recomputed (naive)       == an independent reference: HF's own caches of each chunk,
                                      moved by HF's rotary, fed to HF's forward of the suffix
- re-rotation                      == rotating at the target position directly
All in fp32.
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import qcfuse_kernels as K
from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.ingest.prefill import prefill_alone
from qcfuse_core.model.adapter import ModelAdapter, cache_kwarg
from qcfuse_core.model.fusion import FusedPrompt, KVCache, Segment, fused_prefill
from qcfuse_core.model.testing import TINY_CONFIGS, tiny_model
from qcfuse_core.types import ChunkKey, KVChunk
from tests.qc_fixtures import WHOLE_MODEL_BACKENDS, prompt_of, report

# Whole tiny models run on the references (fast tier) and through Triton's interpreter (slow
# tier: WHOLE_MODEL_BACKENDS); the tests of one kernel op carry `kernels` (the interpreter).

ATOL = 2e-5  # fp32; logits of order 1-10
ARCHS = list(TINY_CONFIGS)


def _segments_lens(vocab: int, lens: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


KINDS = ["prefix", "chunk", "text", "chunk", "chunk", "suffix"]
LENS = [7, 23, 2, 31, 17, 9]


@pytest.mark.parametrize("backend", WHOLE_MODEL_BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_full_recompute_equals_hf(arch, backend):
    m = tiny_model(arch)
    prompt = prompt_of(m, _segments_lens(m.shape.vocab_size, LENS), KINDS)
    ref, _ = m.hf_forward(prompt.token_ids, keep=None)
    out = fused_prefill(m, prompt, torch.arange(prompt.num_tokens), logits_last=None)
    assert torch.allclose(out.logits, ref, atol=ATOL, rtol=0), report(out.logits, ref)


@pytest.mark.parametrize("backend", WHOLE_MODEL_BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_exact_caches_with_sparse_rows_equal_hf(arch, backend):
    """Caches holding the true in-context K/V make any row set exact."""
    m = tiny_model(arch)
    parts = _segments_lens(m.shape.vocab_size, LENS, seed=1)
    whole = FusedPrompt([Segment("suffix", torch.cat(parts))])
    T = whole.num_tokens
    cap = KVCache(m, T)
    k_pre = fused_prefill(m, whole, torch.arange(T), kv_out=cap, capture_pre_rope=True).k_pre  # (L, T, Hkv, D)
    v = cap.v[:, :T]
    segs, pos = [], 0
    for ids, kind in zip(parts, KINDS):
        n = len(ids)
        chunk = None
        if kind in ("prefix", "chunk"):
            chunk = KVChunk(ChunkKey.for_tokens("0" * 16, ids), ids, k_pre[:, pos : pos + n].clone(), v[:, pos : pos + n].clone())
        segs.append(Segment(kind, ids, chunk))
        pos += n
    prompt = FusedPrompt(segs)
    ref, _ = m.hf_forward(prompt.token_ids)
    g = torch.Generator().manual_seed(2)
    for share in (0.0, 0.3, 1.0):
        pick = torch.rand(T, generator=g) < share
        pick |= prompt.uncached_mask()
        pick[0] |= share == 1.0  # include the very first row in the all-rows case
        rows = torch.nonzero(pick).flatten()
        out = fused_prefill(m, prompt, rows)
        assert torch.allclose(out.logits, ref, atol=ATOL, rtol=0), f"share={share}: {report(out.logits, ref)}"


def _hf_rope(m: ModelAdapter, layer: int, positions: torch.Tensor):
    """HF's own cos, sin for layer `layer` (Gemma 3: the layer type's RoPE)."""
    probe = torch.empty(0)
    if m.gemma:
        return m.model.model.rotary_emb(probe, positions, m.model.config.layer_types[layer])
    return m.model.model.rotary_emb(probe, positions)


def _naive_reference(m: ModelAdapter, parts, kinds) -> torch.Tensor:
    """HF caches each cached segment alone, rotates its keys by its offset with HF's rotary,
    and runs HF's forward over the uncached tail with that cache."""
    n_cached = next(i for i, k in enumerate(kinds) if k not in ("prefix", "chunk"))
    assert all(k not in ("prefix", "chunk") for k in kinds[n_cached:]), "cached segments must come first"
    layers_k: list[list[torch.Tensor]] = [[] for _ in range(m.num_layers)]
    layers_v: list[list[torch.Tensor]] = [[] for _ in range(m.num_layers)]
    offset = 0
    for kind, ids in zip(kinds, parts):
        if kind not in ("prefix", "chunk"):
            break
        _, kv = m.hf_forward(ids)  # keys post-RoPE at local positions 0..n-1
        for layer, (k, v) in enumerate(kv):
            cos, sin = _hf_rope(m, layer, torch.full((1, len(ids)), offset))  # rotate by `offset`
            k_moved, _ = apply_rotary_pos_emb(k.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
            layers_k[layer].append(k_moved)
            layers_v[layer].append(v.transpose(0, 1)[None])
        offset += len(ids)
    cache = DynamicCache()
    for layer in range(m.num_layers):
        cache.update(torch.cat(layers_k[layer], dim=2), torch.cat(layers_v[layer], dim=2), layer)
    tail = torch.cat([ids for kind, ids in zip(kinds, parts) if kind not in ("prefix", "chunk")])
    pos = torch.arange(offset, offset + len(tail))[None]
    out = m.model(input_ids=tail[None], position_ids=pos, use_cache=True, **{cache_kwarg(m.model): cache})
    return out.logits[0, -1:].float()


@pytest.mark.parametrize("backend", WHOLE_MODEL_BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_naive_equals_independent_reference(arch, backend):
    m = tiny_model(arch)
    kinds = ["prefix", "chunk", "chunk", "chunk", "suffix"]
    parts = _segments_lens(m.shape.vocab_size, [5, 19, 33, 11, 8], seed=3)
    prompt = prompt_of(m, parts, kinds)
    rows = torch.nonzero(prompt.uncached_mask()).flatten()
    out = fused_prefill(m, prompt, rows)
    ref = _naive_reference(m, parts, kinds)
    assert torch.allclose(out.logits, ref, atol=1e-4, rtol=0), report(out.logits, ref)
    full, _ = m.hf_forward(prompt.token_ids)
    assert (out.logits - full).abs().max() > 1e-3, "naive should differ from full prefill on random chunks"


@pytest.mark.kernels
@pytest.mark.parametrize("arch", ["llama", "llama3-rope", "qwen3", "gemma3"])
def test_rerotation_matches_direct_rotation(arch):
    m = tiny_model(arch)
    T, Hkv, D = 40, m.shape.num_kv_heads, m.shape.head_dim
    k_pre = torch.randn(T, Hkv, D)
    positions = torch.arange(1000, 1000 + T)
    for layer in range(m.num_layers):
        cos, sin = m.rope(positions, layer)
        ours, _ = K.rerotate_scatter(k_pre, torch.zeros_like(k_pre), torch.empty(0, dtype=torch.int64),
                                     k_pre[:0], k_pre[:0], cos, sin)
        hf_cos, hf_sin = _hf_rope(m, layer, positions[None])
        direct, _ = apply_rotary_pos_emb(k_pre.transpose(0, 1)[None], k_pre.transpose(0, 1)[None], hf_cos, hf_sin)
        assert torch.allclose(ours, direct[0].transpose(0, 1), atol=1e-5), report(ours, direct[0].transpose(0, 1))


@pytest.mark.kernels
def test_gemma3_rope_bases_differ_by_layer_type():
    """Gemma 3's sliding layers rotate with the local base, its full layers with the global one."""
    m = tiny_model("gemma3")
    pos = torch.arange(5, 9)
    local, glob = m.rope(pos, 0), m.rope(pos, 1)
    assert m.rope_keys == ["sliding_attention", "full_attention", "sliding_attention"]
    assert not torch.allclose(local[0], glob[0])
    assert torch.equal(m.rope(pos)[0], glob[0])  # no layer: a full layer's RoPE
    assert torch.equal(m.rope(pos, 2)[0], local[0])


@pytest.mark.kernels
@pytest.mark.parametrize("arch", ARCHS)
def test_rope_table_equals_hf_rotary(arch):
    """The cached cos/sin table (on by default on CUDA) gives HF's rotary values bit for bit,
    for host positions, for device positions with their bound, across its growth; without
    a bound device positions go through HF's forward."""
    m = tiny_model(arch)
    m.rope_tables = True
    g = torch.Generator().manual_seed(0)
    for hi in (100, 9000):  # 9000 grows the table past its first 4096 entries
        pos = torch.randint(0, hi, (333,), generator=g)
        for layer in range(m.num_layers):
            key = m.rope_keys[layer] if m.gemma else None
            want = m._rope_hf(pos, key)
            for got in (m.rope(pos, layer), m.rope(pos.clone(), layer, max_position=int(pos.max()))):
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (arch, hi, layer)
    assert max(t[0].shape[0] for t in m._rope_tab.values()) == 16384
    m2 = tiny_model(arch)
    m2.rope_tables = False
    assert torch.equal(m2.rope(pos, 0)[0], m.rope(pos, 0)[0]) and not m2._rope_tab


@pytest.mark.kernels
def test_rope_table_not_used_for_dynamic_rope():
    """A RoPE that rescales with the sequence length (dynamic, longrope) is never tabled."""
    m = tiny_model("llama")
    m.rope_tables = True
    m.model.model.rotary_emb.rope_type = "dynamic"
    assert not m._use_rope_table(None)
    m.rope(torch.arange(5), 0)
    assert not m._rope_tab


@pytest.mark.kernels
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "mistral-swa"])
def test_chunk_prefill_rotated_to_offset_matches_hf_at_offset(arch):
    """A chunk's stored pre-RoPE keys, rotated to offset o, equal HF's keys for the same chunk run
    alone at positions o..o+n-1 (RoPE attention depends on relative positions only)."""
    m = tiny_model(arch)
    ids = _segments_lens(m.shape.vocab_size, [25], seed=4)[0]
    k_pre, v = prefill_alone(m, ids)
    offset = 300
    pos = torch.arange(offset, offset + len(ids))[None]
    out = m.model(input_ids=ids[None], position_ids=pos, use_cache=True, **{cache_kwarg(m.model): DynamicCache()})
    cache = getattr(out, "cache", None) or out.past_key_values
    for layer in range(m.num_layers):
        cos, sin = m.rope(torch.arange(offset, offset + len(ids)), layer)
        ours = K.apply_rope(k_pre[layer], cos, sin)
        hf = cache.layers[layer].keys[0].transpose(0, 1)
        assert torch.allclose(ours, hf, atol=1e-4), f"layer {layer}: {report(ours, hf)}"
        assert torch.allclose(v[layer], cache.layers[layer].values[0].transpose(0, 1), atol=1e-4)


def test_embedded_model_full_recompute_equals_hf(smol):
    eng = QCFuseEngine(smol)
    pieces = eng.frame.rag_pieces("Who founded the Zephyr Institute?", [
        "The Zephyr Institute was founded in 1987 by the marine biologist Ada Ferreira.",
        "Port Halden is known for its lantern festival, held every October since 1952.",
    ])
    prompt, _, misses = eng._steps.fuse_pieces(pieces)
    assert misses == 2
    ref, _ = smol.hf_forward(prompt.token_ids, keep=None)
    out = fused_prefill(smol, prompt, torch.arange(prompt.num_tokens), logits_last=None)
    assert torch.allclose(out.logits, ref, atol=1e-3, rtol=1e-5), report(out.logits, ref)
    # recompute everything except the (exact) prefix: same logits at the last row
    rows = torch.nonzero(~prompt.mask("prefix")).flatten()
    out2 = fused_prefill(smol, prompt, rows)
    assert torch.allclose(out2.logits, ref[-1:], atol=1e-3, rtol=1e-5), report(out2.logits, ref[-1:])


@pytest.mark.kernels
def test_rows_validation_errors():
    m = tiny_model("llama")
    prompt = prompt_of(m, _segments_lens(256, [5, 10, 4]), ["prefix", "chunk", "suffix"])
    with pytest.raises(ValueError, match="uncached"):
        fused_prefill(m, prompt, torch.tensor([18]))
    with pytest.raises(ValueError, match="sorted"):
        fused_prefill(m, prompt, torch.tensor([16, 15, 17, 18]))
    with pytest.raises(ValueError, match="last position"):
        fused_prefill(m, prompt, torch.tensor([15, 16, 17]))
    with pytest.raises(ValueError, match="suffix"):
        FusedPrompt([Segment("chunk", torch.arange(3))])
    with pytest.raises(ValueError, match="valid"):
        Segment("middle", torch.arange(3))


@pytest.mark.kernels
def test_unsupported_architecture_names_supported_ones():
    import transformers as tf

    cfg = tf.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32)
    with pytest.raises(ValueError, match="LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM.*Gemma3ForCausalLM"):
        ModelAdapter(tf.GPT2LMHeadModel(cfg))


@pytest.mark.kernels
def test_row_blocked_attention_equals_the_dense_reference(monkeypatch):
    """The torch path splits rows into blocks that read keys only up to their last row; any
    block size gives the dense reference's output (fp32, atol 1e-6)."""
    from qcfuse_core.model import fusion
    from qcfuse_kernels.reference import sparse_attention_ref

    g = torch.Generator().manual_seed(3)
    T, H, Hkv, D = 700, 4, 2, 16
    rows = torch.sort(torch.randperm(T, generator=g)[:300]).values
    rows[-1] = T - 1
    q, k, v = (torch.randn(n, h, D, generator=g) for n, h in ((300, H), (T, Hkv), (T, Hkv)))
    want = sparse_attention_ref(q, k, v, rows, 0.25)
    monkeypatch.setattr(K, "backend", lambda: "torch")
    for block in (1, 7, 64, 256, 1024):
        monkeypatch.setattr(fusion, "ROW_BLOCK", block)
        got = fusion.attend(q, k, v, rows, 0.25)
        assert torch.allclose(got, want, atol=1e-6), f"block {block}: {(got - want).abs().max():.2e}"


@pytest.mark.kernels
def test_logits_of_the_last_rows_only():
    m = tiny_model("llama")
    ids = torch.randint(0, m.shape.vocab_size, (30,), generator=torch.Generator().manual_seed(1))
    ref, _ = m.hf_forward(ids, keep=None)
    last, _ = m.hf_forward(ids, keep=5)
    assert last.shape[0] == 5 and torch.allclose(last, ref[-5:], atol=1e-5)
    out = fused_prefill(m, FusedPrompt([Segment("suffix", ids)]), torch.arange(30), logits_last=5)
    assert out.logits.shape[0] == 5 and torch.allclose(out.logits, ref[-5:], atol=1e-4)
    with pytest.raises(ValueError, match="logits_last"):
        fused_prefill(m, FusedPrompt([Segment("suffix", ids)]), torch.arange(30), logits_last=0)
    with pytest.raises(ValueError, match="keep"):
        m.hf_forward(ids, keep=0)
