"""The decode step's fused launches against their references: RoPE with the cache write
(`rope_append_ptrs`), the residual add with the next norm (`add_rms_norm`), the gated MLP's
activation on one packed product (`silu_mul_packed`); the attention's key ranges per batch
size (`decode_splits`); the adapter's packed projections (views, the same values); and the
graph's step body on packed projections against the adapter's own steps.

CPU: Triton's interpreter on small shapes (tests/conftest.py sets TRITON_INTERPRET=1).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest
import torch

import qcfuse_kernels as K
from qcfuse_core.model.graphs import decode_rows, layer_addresses
from qcfuse_core.model.testing import tiny_model
from qcfuse_kernels import reference as ref
from tests.qc_fixtures import TOL, _caches, _copy, assert_close, needs_cuda, needs_interpreter, use_backend  # noqa: F401, F811

pytestmark = pytest.mark.kernels


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _trig(B, D, seed=3):
    """cos/sin (B, D) of random positions, HF's layout (the half-dim angles repeated)."""
    ang = _rand(B, D // 2, seed=seed) * 3
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=str)
def test_rope_append_matches_rope_then_append(use_backend, dtype, heads):
    """Rotated queries as `apply_rope` gives them and the reference; each row's rotated key and
    its value at its own position of its own cache, every other cache entry untouched."""
    H, Hkv = heads
    B, D = 3, 16
    qkv = _rand(B, (H + 2 * Hkv) * D, dtype=dtype, seed=1)
    cos, sin = _trig(B, D)
    caps, pos = [7, 3, 12], torch.tensor([6, 0, 5])
    ks = [_rand(c, Hkv, D, dtype=dtype, seed=20 + b) for b, c in enumerate(caps)]
    vs = [_rand(c, Hkv, D, dtype=dtype, seed=40 + b) for b, c in enumerate(caps)]
    want_k, want_v = [c.clone() for c in ks], [c.clone() for c in vs]
    want_q = ref.rope_append_ref(qkv, cos, sin, want_k, want_v, pos, H, Hkv)
    q = K.rope_append_ptrs(
        qkv, cos, sin, K.cache_addresses(ks), K.cache_addresses(vs), pos, num_heads=H, num_kv_heads=Hkv
    )
    assert q.shape == (B, H, D) and q.dtype == dtype
    assert_close(q, want_q, what="queries", **TOL[dtype])
    assert torch.equal(q, K.apply_rope(qkv.view(B, -1, D)[:, :H].contiguous(), cos, sin))
    for b in range(B):
        p = int(pos[b])
        assert_close(ks[b][p], want_k[b][p], what="key written", **TOL[dtype])
        assert torch.equal(vs[b][p], want_v[b][p])
        others = torch.arange(caps[b]) != p
        assert torch.equal(ks[b][others], want_k[b][others]) and torch.equal(vs[b][others], want_v[b][others])


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_add_rms_norm_is_the_add_then_the_norm(use_backend, dtype):
    x, d, w = _rand(5, 40, dtype=dtype), _rand(5, 40, dtype=dtype, seed=1), _rand(40, dtype=dtype, seed=2)
    h, y = K.add_rms_norm(x, d, w, 1e-5)
    if dtype == torch.float32:
        assert torch.equal(h, x + d)
    else:  # the interpreter rounds fp32 to bf16 towards zero (a GPU and torch: to nearest)
        assert_close(h, x + d, what="sum", **TOL[dtype])
    assert torch.equal(y, K.rms_norm(h, w, 1e-5))
    assert_close(y, ref.rms_norm_ref(x + d, w, 1e-5), what="norm", **TOL[dtype])


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_mul_packed_is_silu_mul_of_the_halves(use_backend, dtype):
    gu = _rand(3, 2 * 300, dtype=dtype)  # 300: a partial last block
    out = K.silu_mul_packed(gu)
    assert out.shape == (3, 300)
    assert torch.equal(out, K.silu_mul(gu[:, :300].contiguous(), gu[:, 300:].contiguous()))
    assert_close(out, ref.silu_mul_packed_ref(gu), what="activation", **TOL[dtype])


@pytest.mark.parametrize("use_backend", ["torch"], indirect=True)
def test_fused_steps_refuse_bad_input(use_backend):
    with pytest.raises(ValueError, match="one \\(rows, N\\) shape"):
        K.add_rms_norm(torch.zeros(2, 4), torch.zeros(2, 5), torch.zeros(4), 1e-5)
    with pytest.raises(ValueError, match="\\(rows, 2I\\)"):
        K.silu_mul_packed(torch.zeros(2, 5))
    with pytest.raises(RuntimeError, match="kernel backend"):
        K.rope_append_ptrs(
            torch.zeros(1, 48),
            torch.zeros(1, 8),
            torch.zeros(1, 8),
            torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64),
            num_heads=4,
            num_kv_heads=1,
        )


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("use_backend", ["triton"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_steps_compiled_on_cuda(use_backend, dtype):
    """The compiled kernels: the sum and the activation as torch rounds them, the norm as the
    plain kernel gives it, RoPE and the cache write as the reference (Llama's 32/8 heads of 128)."""
    dev = "cuda"
    x, d = _rand(4, 4096, dtype=dtype).to(dev), _rand(4, 4096, dtype=dtype, seed=1).to(dev)
    w = _rand(4096, dtype=dtype, seed=2).to(dev)
    h, y = K.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(h, x + d) and torch.equal(y, K.rms_norm(x + d, w, 1e-5))
    gu = _rand(4, 2 * 14336, dtype=dtype, seed=3).to(dev)
    assert torch.equal(K.silu_mul_packed(gu), K.silu_mul(gu[:, :14336].contiguous(), gu[:, 14336:].contiguous()))
    B, H, Hkv, D = 3, 32, 8, 128
    qkv = _rand(B, (H + 2 * Hkv) * D, dtype=dtype, seed=4).to(dev)
    cos, sin = (t.to(dev) for t in _trig(B, D))
    ks = [_rand(20, Hkv, D, dtype=dtype, seed=5 + b).to(dev) for b in range(B)]
    vs = [_rand(20, Hkv, D, dtype=dtype, seed=9 + b).to(dev) for b in range(B)]
    pos = torch.tensor([19, 0, 7], device=dev)
    want_k, want_v = [c.clone() for c in ks], [c.clone() for c in vs]
    want_q = ref.rope_append_ref(qkv, cos, sin, want_k, want_v, pos, H, Hkv)
    q = K.rope_append_ptrs(
        qkv, cos, sin, K.cache_addresses(ks).to(dev), K.cache_addresses(vs).to(dev), pos, num_heads=H, num_kv_heads=Hkv
    )
    assert_close(q, want_q, what="queries", **TOL[dtype])
    for a, b in zip(ks + vs, want_k + want_v):
        assert_close(a, b, what="caches", **TOL[dtype])


def test_decode_splits_fill_the_gpu_by_batch_size():
    """One sequence of 8 KV heads: 64 key ranges (512 programs); 8 sequences: 8; 32 or more: 4;
    always a power of two in [4, 64], never more for a larger batch."""
    got = [K.decode_splits(b, 8) for b in (1, 2, 4, 8, 16, 32, 64)]
    assert got == [64, 32, 16, 8, 4, 4, 4]
    assert K.decode_splits(1, 1) == 64 and K.decode_splits(3, 8) == 32
    for b in range(1, 70):
        s = K.decode_splits(b, 4)
        assert 4 <= s <= 64 and s & (s - 1) == 0 and s <= K.decode_splits(max(1, b - 1), 4)
    with pytest.raises(ValueError, match="positive"):
        K.decode_splits(0, 8)


def test_packed_projections_are_views_with_the_same_values():
    """q/k/v and gate/up as one matrix each (biases too): the modules' weights become row views
    of it, so no second copy, and HF's forward gives the same logits bit for bit."""
    m = tiny_model("qwen2")  # q/k/v biases
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        before = m.hf_forward(ids, keep=None)[0]
    packed = m.packed_projections()
    assert packed is not None and len(packed) == m.num_layers and m.packed_projections() is packed
    for lyr, p in zip(m.layers, packed):
        a, mlp = lyr.self_attn, lyr.mlp
        assert p.qkv.shape[0] == sum(x.weight.shape[0] for x in (a.q_proj, a.k_proj, a.v_proj))
        assert a.q_proj.weight.data_ptr() == p.qkv.data_ptr()
        assert a.k_proj.weight.data_ptr() == p.qkv[a.q_proj.weight.shape[0]].data_ptr()
        assert a.v_proj.bias.data_ptr() == p.qkv_bias[-a.v_proj.bias.shape[0]].data_ptr()
        assert mlp.gate_proj.weight.data_ptr() == p.gate_up.data_ptr()
        assert mlp.up_proj.weight.data_ptr() == p.gate_up[mlp.gate_proj.weight.shape[0]].data_ptr()
        assert p.gate_up_bias is None
    with torch.inference_mode():
        assert torch.equal(m.hf_forward(ids, keep=None)[0], before)
    assert tiny_model("qwen3").packed_projections() is None  # q/k norms: the adapter's own steps
    assert tiny_model("gemma3").packed_projections() is None


def _step(m, caches, tokens, packed):
    pos = torch.tensor([c.length for c in caches])
    kp, vp = layer_addresses([c.k for c in caches]), layer_addresses([c.v for c in caches])
    original = m.packed_projections
    if not packed:
        m.packed_projections = lambda: None  # the adapter's own steps
    try:
        out = decode_rows(m, torch.tensor(tokens), pos, pos + 1, kp, vp)
    finally:
        m.packed_projections = original
    for c in caches:
        c.length += 1
    return out


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize("arch", ["qwen2", "mistral-swa"])
def test_packed_step_matches_the_adapters_steps(use_backend, arch):
    """Three sequences, three steps: logits, greedy tokens and the caches written on packed
    projections match the adapter's own per-module steps (fp32; products over other shapes)."""
    m = tiny_model(arch)
    with torch.inference_mode():
        caches = _caches(m, (5, 23, 14), room=5)
        mine, theirs = [_copy(c) for c in caches], [_copy(c) for c in caches]
        for tokens in ([3, 100, 7], [50, 2, 255], [9, 9, 9]):
            a, b = _step(m, mine, tokens, True), _step(m, theirs, tokens, False)
            assert_close(a, b, 2e-5, 1e-5, f"{arch} logits")
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        for x, y in zip(mine, theirs):
            assert_close(x.k[:, : x.length], y.k[:, : y.length], 1e-5, 1e-5, "keys written")
            assert_close(x.v[:, : x.length], y.v[:, : y.length], 1e-5, 1e-5, "values written")
