"""Pointwise layer kernels (rms_norm, silu_mul, apply_rope) against their PyTorch references,
and the model adapter built on them against HF's own modules.

CPU: Triton's interpreter on small shapes (tests/conftest.py sets TRITON_INTERPRET=1).
GPU: compiled kernels on an 8B model's shapes (run with TRITON_INTERPRET=0 on a CUDA host).
Tolerances are those of tests/test_kernels.py (fp32 2e-5 / 1e-5, bf16 2e-2 / 2e-2: the
interpreter truncates fp32 -> bf16 where CUDA rounds, so bf16 may differ by an ulp).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest
import torch

from qcfuse_kernels import ops
from qcfuse_kernels import reference as ref
from tests.qc_fixtures import DTYPES, TOL, assert_close, needs_cuda, needs_interpreter, use_backend  # noqa: F401

pytestmark = pytest.mark.kernels


def _rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# ---------------------------------------------------------------- interpreter (CPU)


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 48), (1, 576), (2, 100)], ids=str)
def test_rms_norm_matches_reference(use_backend, dtype, shape):
    x = _rand(*shape, dtype=dtype, scale=3.0)
    w = _rand(shape[-1], dtype=dtype, seed=1)
    out = ops.rms_norm(x, w, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, ref.rms_norm_ref(x, w, 1e-5), **TOL[dtype], what=f"rms_norm {dtype} {shape}")


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 96), (3, 1000), (1, 1)], ids=str)
def test_silu_mul_matches_reference(use_backend, dtype, shape):
    g, u = _rand(*shape, dtype=dtype, scale=4.0), _rand(*shape, dtype=dtype, seed=1)
    out = ops.silu_mul(g, u)
    assert out.dtype == dtype and out.shape == g.shape
    assert_close(out, ref.silu_mul_ref(g, u), **TOL[dtype], what=f"silu_mul {dtype} {shape}")


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,H,D", [(9, 4, 64), (13, 3, 48), (1, 1, 2)], ids=str)
def test_apply_rope_matches_reference(use_backend, dtype, T, H, D):
    x = _rand(T, H, D, dtype=dtype)
    ang = torch.arange(T)[:, None] * torch.rand(D // 2, generator=torch.Generator().manual_seed(2))[None]
    cos, sin = torch.cat([ang.cos()] * 2, 1), torch.cat([ang.sin()] * 2, 1)  # (T, D) fp32, HF layout
    out = ops.apply_rope(x, cos, sin)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, ref.apply_rope(x, cos, sin), **TOL[dtype], what=f"rope {dtype} {(T, H, D)}")


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
def test_pointwise_accept_views_and_empty(use_backend):
    x = _rand(6, 4, 32)[:, ::2]  # non-contiguous (6, 2, 32)
    cos, sin = torch.ones(6, 32), torch.zeros(6, 32)
    assert torch.equal(ops.apply_rope(x, cos, sin), x)  # angle 0: identity
    h = _rand(8, 16).t()  # (16, 8) non-contiguous
    assert_close(ops.rms_norm(h, torch.ones(8), 1e-6), ref.rms_norm_ref(h, torch.ones(8), 1e-6), **TOL[torch.float32], what="view")
    assert ops.rms_norm(torch.empty(0, 8), torch.ones(8), 1e-6).shape == (0, 8)
    assert ops.silu_mul(torch.empty(0, 3), torch.empty(0, 3)).shape == (0, 3)
    assert ops.apply_rope(torch.empty(0, 2, 4), torch.empty(0, 4), torch.empty(0, 4)).shape == (0, 2, 4)


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
def test_rms_norm_mixed_dtypes_follow_torch_promotion(use_backend):
    """fp32 weight with bf16 input (not a kernel case): the reference, with torch's promotion."""
    x, w = _rand(3, 16, dtype=torch.bfloat16), _rand(16, seed=1)
    out = ops.rms_norm(x, w, 1e-6)
    assert out.dtype == torch.float32 and torch.equal(out, ref.rms_norm_ref(x, w, 1e-6))


def test_rms_norm_reference_is_hf_module():
    """The reference computes exactly what HF's RMSNorm module computes (bitwise)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for dtype in (torch.float32, torch.bfloat16):
        m = LlamaRMSNorm(48, eps=1e-5).to(dtype)
        with torch.no_grad():
            m.weight.copy_(_rand(48, seed=3))
        x = _rand(5, 48, dtype=dtype, scale=2.0)
        assert torch.equal(ref.rms_norm_ref(x, m.weight, m.variance_epsilon), m(x))


@pytest.mark.parametrize("bad, exc, match", [
    (lambda: ops.rms_norm(torch.ones(2, 8), torch.ones(7), 1e-6), ValueError, "must be \\(N,\\)"),
    (lambda: ops.rms_norm(torch.ones(2, 8), torch.ones(8), float("nan")), TypeError, "finite"),
    (lambda: ops.rms_norm([1.0], torch.ones(1), 1e-6), TypeError, "torch.Tensors"),
    (lambda: ops.silu_mul(torch.ones(2, 8), torch.ones(2, 7)), ValueError, "must match"),
    (lambda: ops.silu_mul(torch.ones(2), torch.ones(2, dtype=torch.float64)), ValueError, "must match"),
    (lambda: ops.apply_rope(torch.ones(3, 2, 8), torch.ones(2, 8), torch.ones(2, 8)), ValueError, "must be \\(T, D\\)"),
    (lambda: ops.apply_rope(torch.ones(3, 2, 7), torch.ones(3, 7), torch.ones(3, 7)), ValueError, "even"),
    (lambda: ops.apply_rope(torch.ones(3, 8), torch.ones(3, 8), torch.ones(3, 8)), ValueError, "3-D"),
    (lambda: ops.apply_rope(torch.ones(3, 2, 8), torch.ones(3, 8), None), TypeError, "sin must be"),
], ids=["norm-weight", "norm-eps", "norm-type", "silu-shape", "silu-dtype", "rope-T", "rope-odd", "rope-ndim", "rope-type"])
def test_pointwise_reject_bad_inputs(bad, exc, match):
    with pytest.raises(exc, match=match):
        bad()


# ---------------------------------------------------------------- the adapter on these kernels


def _tiny(arch="llama"):
    from qcfuse_core.model.testing import tiny_model

    return tiny_model(arch, seed=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_adapter_steps_equal_hf_modules_on_torch_backend(arch):
    """On the reference backend the adapter's norm / MLP / final norm are HF's modules, bitwise."""
    ops.set_backend("torch")
    try:
        ad = _tiny(arch)
        assert ad.fused_norm and ad.fused_mlp
        h = _rand(6, ad.shape.hidden_size, scale=2.0)
        lyr = ad.layers[1]
        with torch.no_grad():
            assert torch.equal(ad.attn_norm(1, h), lyr.input_layernorm(h))
            assert torch.equal(ad.mlp(1, h), h + lyr.mlp(lyr.post_attention_layernorm(h)))
            assert torch.equal(ad.logits(h), ad.model.lm_head(ad.model.model.norm(h)).float())
            q, k, _ = ad.qkv(1, ad.attn_norm(1, h))
            a = lyr.self_attn
            q_hf = a.q_proj(ad.attn_norm(1, h)).view(6, -1, ad.shape.head_dim)
            if ad.has_qk_norm:
                q_hf = a.q_norm(q_hf)
            assert torch.equal(q, q_hf)
    finally:
        ops.set_backend(None)


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
def test_adapter_steps_on_kernels_match_hf_modules(use_backend):
    ad = _tiny()
    h = _rand(5, ad.shape.hidden_size, scale=2.0)
    lyr = ad.layers[0]
    with torch.no_grad():
        assert_close(ad.attn_norm(0, h), lyr.input_layernorm(h), **TOL[torch.float32], what="attn_norm")
        assert_close(ad.mlp(0, h), h + lyr.mlp(lyr.post_attention_layernorm(h)), **TOL[torch.float32], what="mlp")


def test_adapter_falls_back_to_hf_modules_for_other_norms_and_activations():
    ad = _tiny()
    ad.model.config.hidden_act = "gelu"
    lyr = ad.layers[0]
    lyr.input_layernorm = torch.nn.LayerNorm(ad.shape.hidden_size)
    from qcfuse_core.model.adapter import ModelAdapter

    ad2 = ModelAdapter(ad.model, ad.tokenizer)
    assert not ad2.fused_norm and not ad2.fused_mlp
    h = _rand(3, ad.shape.hidden_size)
    with torch.no_grad():
        assert torch.equal(ad2.attn_norm(0, h), lyr.input_layernorm(h))
        assert torch.equal(ad2.mlp(0, h), h + lyr.mlp(lyr.post_attention_layernorm(h)))


# ---------------------------------------------------------------- GPU (an 8B model's shapes)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("use_backend", ["triton"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_pointwise_kernels(use_backend, dtype):
    R, hidden, inter, H, D = 1568, 4096, 14336, 32, 128
    x, w = _rand(R, hidden, dtype=dtype, scale=3.0).cuda(), _rand(hidden, dtype=dtype, seed=1).cuda()
    assert_close(ops.rms_norm(x, w, 1e-5), ref.rms_norm_ref(x, w, 1e-5), **TOL[dtype], what="gpu rms_norm")
    g, u = _rand(R, inter, dtype=dtype, scale=4.0).cuda(), _rand(R, inter, dtype=dtype, seed=2).cuda()
    assert_close(ops.silu_mul(g, u), ref.silu_mul_ref(g, u), **TOL[dtype], what="gpu silu_mul")
    q = _rand(R, H, D, dtype=dtype).cuda()
    ang = torch.arange(R)[:, None] * (10000.0 ** (-torch.arange(D // 2) / (D // 2)))[None]
    cos, sin = torch.cat([ang.cos()] * 2, 1).cuda(), torch.cat([ang.sin()] * 2, 1).cuda()
    assert_close(ops.apply_rope(q, cos, sin), ref.apply_rope(q, cos, sin), **TOL[dtype], what="gpu rope")


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
def test_interpreted_launches_from_several_threads(use_backend):
    """The interpreter swaps triton.language's functions for each launch, process-wide:
    launches from several threads at once (the scheduler's worker, a background build and
    the caller) run one at a time and give the reference's results."""
    import threading

    x = _rand(6, 64, scale=3.0)
    w = _rand(64, seed=1)
    want = ref.rms_norm_ref(x, w, 1e-5)
    errors: list[BaseException] = []

    def work():
        try:
            for _ in range(15):
                torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), want, **TOL[torch.float32])
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
