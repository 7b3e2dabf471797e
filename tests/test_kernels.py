"""Kernel tests: Triton (interpreter on CPU, compiled on CUDA) against the PyTorch references.

CPU: tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported, so the Triton
kernels run in the interpreter on tiny shapes. GPU: run with TRITON_INTERPRET=0 on a CUDA
host; the interpreter tests then skip and the realistic-shape tests run compiled kernels.

Tolerances (max abs error vs the fp32-internal reference, output in the input dtype):
    fp32   atol 2e-5  rtol 1e-5   (exact fp32 products; only summation order differs)
    fp16   atol 4e-3  rtol 4e-3   (softmax weights rounded to fp16 before P @ V)
    bf16   atol 2e-2  rtol 2e-2   (bf16 P @ V; the interpreter truncates fp32->bf16)
Attention mass is fp32 from both: atol 1e-6, rtol 1e-3 (values ~1/T), sum == 1 to 1e-4.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest
import torch

from qcfuse_kernels import ops
from qcfuse_kernels import reference as ref
from tests.qc_fixtures import (  # noqa: F401  (fixtures)
    DTYPES,
    TOL,
    _triton_mode,
    assert_close,
    needs_cuda,
    needs_interpreter,
    use_backend,
)

pytestmark = pytest.mark.kernels  # the detected backend: interpreter on CPU, Triton on GPU

MASS_TOL = dict(atol=1e-6, rtol=1e-3)

def make_attention(R, T, H, Hkv, D, dtype, device="cpu", seed=0, positions=None):
    """Random q/k/v and sorted unique positions that include 0 and T-1 (when R >= 2)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(R, H, D, generator=g).to(dtype)
    k = torch.randn(T, Hkv, D, generator=g).to(dtype)
    v = torch.randn(T, Hkv, D, generator=g).to(dtype)
    if positions is None:
        inner = torch.randperm(T - 2, generator=g)[: max(R - 2, 0)] + 1
        positions = torch.cat([torch.tensor([0, T - 1])[: min(R, 2)], inner])
        positions = torch.sort(positions).values
    q_pos = torch.as_tensor(positions, dtype=torch.int64)
    return [x.to(device) for x in (q, k, v, q_pos)]


# (R, T, H, Hkv, D): ragged sizes, GQA ratios 1 / 2 / 4, non-power-of-two head dim
SHAPES = [
    (37, 300, 4, 2, 64),
    (24, 256, 4, 4, 32),
    (19, 173, 8, 2, 64),
    (5, 40, 2, 1, 48),
]


# ---------------------------------------------------------------- interpreter (CPU)


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_sparse_attention_matches_reference(use_backend, dtype, shape):
    R, T, H, Hkv, D = shape
    q, k, v, q_pos = make_attention(R, T, H, Hkv, D, dtype)
    scale = D**-0.5
    out = ops.sparse_attention(q, k, v, q_pos, scale)
    assert out.dtype == dtype
    assert_close(out, ref.sparse_attention_ref(q, k, v, q_pos, scale), **TOL[dtype], what=f"attn {dtype} {shape}")


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize(
    "case",
    ["first_only", "last_only", "suffix_block", "unsorted", "int32_positions", "repeated_positions"],
)
def test_sparse_attention_position_edge_cases(use_backend, case):
    T, H, Hkv, D = 150, 4, 2, 32
    positions = {
        "first_only": [0],
        "last_only": [T - 1],
        "suffix_block": list(range(T - 21, T)),  # every row of the suffix (dense causal tail)
        "unsorted": [149, 3, 77, 0, 120, 64, 5, 148, 33],  # correct, just slower
        "int32_positions": [0, 31, 32, 33, 95, 149],
        "repeated_positions": [7, 7, 90, 90, 149],
    }[case]
    q, k, v, q_pos = make_attention(len(positions), T, H, Hkv, D, torch.float32, positions=positions)
    if case == "int32_positions":
        q_pos = q_pos.to(torch.int32)
    out = ops.sparse_attention(q, k, v, q_pos, 0.3)
    assert_close(out, ref.sparse_attention_ref(q, k, v, q_pos, 0.3), **TOL[torch.float32], what=case)


# Sliding windows against the reference: the interpreter's tile is 16 query vectors x 32 keys,
# so windows of 1, 31/32/33 and 64 keys put window starts on, just before and just after key
# block edges; row sets are ragged (random gaps), dense runs (a tile whose rows all see a common
# unmasked stretch) and rows on block boundaries.
WINDOW_ROWS = {
    "ragged": lambda T, g: torch.sort(torch.randperm(T, generator=g)[:23]).values,
    "dense_run": lambda T, g: torch.arange(T - 40, T),
    "block_edges": lambda T, g: torch.tensor([0, 31, 32, 33, 63, 64, 95, 96, 127, 128, T - 1]),
    "one_row": lambda T, g: torch.tensor([T - 1]),
}


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize("window", [1, 31, 32, 33, 64])
@pytest.mark.parametrize("rows", list(WINDOW_ROWS))
def test_sparse_attention_window_matches_reference(use_backend, window, rows):
    T, H, Hkv, D = 170, 4, 2, 32
    positions = WINDOW_ROWS[rows](T, torch.Generator().manual_seed(window))
    q, k, v, q_pos = make_attention(len(positions), T, H, Hkv, D, torch.float32, positions=positions)
    out = ops.sparse_attention(q, k, v, q_pos, 0.3, window=window)
    want = ref.sparse_attention_ref(q, k, v, q_pos, 0.3, window)
    assert_close(out, want, **TOL[torch.float32], what=f"window {window} rows {rows}")
    if window < T // 2:  # the window changes the result (keys outside it were dropped)
        assert (out - ops.sparse_attention(q, k, v, q_pos, 0.3)).abs().max() > 1e-3


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_sparse_attention_window_half_precision_and_gqa(use_backend, dtype):
    T, H, Hkv, D = 150, 8, 2, 48  # GQA 4, head dim below its power-of-two tile
    positions = torch.tensor([2, 9, 40, 41, 42, 77, 100, 101, 130, 149])
    q, k, v, q_pos = make_attention(len(positions), T, H, Hkv, D, dtype, positions=positions)
    out = ops.sparse_attention(q, k, v, q_pos, D ** -0.5, window=20)
    assert_close(out, ref.sparse_attention_ref(q, k, v, q_pos, D ** -0.5, 20), **TOL[dtype], what=f"window {dtype}")


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
def test_sparse_attention_window_skips_key_blocks_before_it(use_backend):
    """Keys in blocks wholly before every row's window are never read: NaN there changes nothing."""
    T, H, Hkv, D, W = 200, 4, 2, 32, 40
    positions = torch.tensor([130, 140, 151, 170, 199])
    q, k, v, q_pos = make_attention(len(positions), T, H, Hkv, D, torch.float32, positions=positions)
    want = ref.sparse_attention_ref(q, k, v, q_pos, 0.3, W)
    floor = (130 - W + 1) // 32 * 32  # first key block any row's window reaches
    k[:floor], v[:floor] = float("nan"), float("nan")
    assert_close(ops.sparse_attention(q, k, v, q_pos, 0.3, window=W), want, **TOL[torch.float32], what="skip")


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
def test_sparse_attention_window_wider_than_prompt_is_full_attention(use_backend):
    q, k, v, q_pos = make_attention(9, 90, 4, 2, 32, torch.float32)
    assert torch.equal(ops.sparse_attention(q, k, v, q_pos, 0.3, window=90), ops.sparse_attention(q, k, v, q_pos, 0.3))
    with pytest.raises(ValueError, match="window"):
        ops.sparse_attention(q, k, v, q_pos, 0.3, window=0)


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
def test_sparse_attention_no_rows(use_backend):
    q, k, v, _ = make_attention(3, 50, 4, 2, 32, torch.float16)
    out = ops.sparse_attention(q[:0].contiguous(), k, v, torch.zeros(0, dtype=torch.int64), 0.2)
    assert out.shape == (0, 4, 32) and out.dtype == torch.float16


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(6, 300, 4, 2, 64), (9, 173, 8, 2, 48), (3, 64, 2, 2, 32)], ids=str)
def test_attention_mass_matches_reference(use_backend, dtype, shape):
    R, T, H, Hkv, D = shape
    q, k, _, _ = make_attention(R, T, H, Hkv, D, dtype)
    q_pos = torch.sort(torch.randperm(T)[:R]).values  # probe rows anywhere, not only the end
    q_pos[-1] = T - 1
    scale = D**-0.5
    mass = ops.attention_mass(q, k, q_pos, scale)
    expected = ref.attention_mass_ref(q, k, q_pos, scale)
    assert mass.dtype == torch.float32 and mass.shape == (T,)
    assert_close(mass, expected, **MASS_TOL, what=f"mass {dtype} {shape}")
    assert abs(mass.sum().item() - 1.0) < 1e-4
    assert (mass[q_pos.max() + 1 :] == 0).all()


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
def test_attention_mass_keys_beyond_probes_get_nothing(use_backend):
    q, k, _, _ = make_attention(4, 120, 4, 1, 32, torch.float32)
    q_pos = torch.tensor([0, 10, 11, 40])
    mass = ops.attention_mass(q, k, q_pos, 0.2)
    assert_close(mass, ref.attention_mass_ref(q, k, q_pos, 0.2), **MASS_TOL, what="early probes")
    assert (mass[41:] == 0).all() and mass[0] > 0.25  # row at position 0 puts all its mass on key 0


def make_rerotate(T, Hkv, D, rows, dtype, trig_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.as_tensor(rows, dtype=torch.int64)
    k_pre = torch.randn(T, Hkv, D, generator=g).to(dtype)
    v = torch.randn(T, Hkv, D, generator=g).to(dtype)
    k_new = torch.randn(len(rows), Hkv, D, generator=g).to(dtype)
    v_new = torch.randn(len(rows), Hkv, D, generator=g).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = torch.arange(T).float()[:, None] * inv_freq[None, :]
    ang = torch.cat([ang, ang], dim=-1)  # (T, D) HF layout: halves repeated
    return k_pre, v, rows, k_new, v_new, ang.cos().to(trig_dtype), ang.sin().to(trig_dtype)


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "T,Hkv,D,rows",
    [
        (50, 2, 64, [0, 3, 17, 49]),  # first and last position
        (37, 3, 32, []),  # nothing recomputed: pure re-rotation
        (13, 1, 48, list(range(13))),  # every row fresh; non-power-of-two D
        (64, 4, 16, [63, 5, 40, 0]),  # unsorted rows
    ],
)
def test_rerotate_scatter_matches_reference(use_backend, dtype, T, Hkv, D, rows):
    args = make_rerotate(T, Hkv, D, rows, dtype)
    k_rot, v_out = ops.rerotate_scatter(*args)
    k_exp, v_exp = ref.rerotate_scatter_ref(*args)
    assert k_rot.dtype == dtype and v_out.dtype == dtype
    assert_close(k_rot, k_exp, **TOL[dtype], what=f"k_rot {dtype} T={T} rows={rows}")
    assert torch.equal(v_out, v_exp), "v_out must be a bit-exact scatter"


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
def test_rerotate_scatter_arbitrary_bf16_trig_and_int32_rows(use_backend):
    k_pre, v, rows, k_new, v_new, _, _ = make_rerotate(30, 2, 32, [2, 29], torch.float16)
    # halves not repeated: the kernel must use cos/sin column by column, as the reference does
    cos, sin = torch.randn(2, 30, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    rows32 = rows.to(torch.int32)
    k_rot, v_out = ops.rerotate_scatter(k_pre, v, rows32, k_new, v_new, cos, sin)
    k_exp, v_exp = ref.rerotate_scatter_ref(k_pre, v, rows, k_new, v_new, cos, sin)
    assert_close(k_rot, k_exp, **TOL[torch.float16], what="bf16 trig")
    assert torch.equal(v_out, v_exp)


# ---------------------------------------------------------------- backends and dispatch


def test_backend_choice_and_override():
    ops.set_backend(None)
    expected = {"interpreted": "interpret", None: "torch"}.get(
        _triton_mode(), "triton" if torch.cuda.is_available() else "torch"
    )
    assert ops.backend() == expected
    with pytest.raises(ValueError, match="valid: triton, interpret, torch"):
        ops.set_backend("cuda")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            ops.set_backend("triton")
    if _triton_mode() != "interpreted":
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            ops.set_backend("interpret")
    ops.set_backend(None)


@pytest.mark.parametrize("use_backend", ["torch"], indirect=True)
def test_torch_backend_is_the_reference(use_backend):
    q, k, v, q_pos = make_attention(7, 60, 4, 2, 16, torch.float32)
    assert torch.equal(ops.sparse_attention(q, k, v, q_pos, 0.25), ref.sparse_attention_ref(q, k, v, q_pos, 0.25))
    assert torch.equal(ops.attention_mass(q, k, q_pos, 0.25), ref.attention_mass_ref(q, k, q_pos, 0.25))
    args = make_rerotate(20, 2, 16, [1, 19], torch.float32)
    for a, b in zip(ops.rerotate_scatter(*args), ref.rerotate_scatter_ref(*args)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- validation errors


def _attn():
    return make_attention(6, 40, 4, 2, 16, torch.float32)


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda q, k, v, p: (q.double(), k, v, p), TypeError, "q has dtype torch.float64; valid"),
        (lambda q, k, v, p: (q, k.half(), v, p), TypeError, "k has dtype torch.float16 but q"),
        (lambda q, k, v, p: (q, k, v.half(), p), TypeError, "v has dtype"),
        (lambda q, k, v, p: (q, k, v, p.float()), TypeError, "q_pos has dtype"),
        (lambda q, k, v, p: (q.tolist(), k, v, p), TypeError, "q must be a torch.Tensor"),
        (lambda q, k, v, p: (q.transpose(0, 1).contiguous().transpose(0, 1), k, v, p), ValueError, "contiguous"),
        (lambda q, k, v, p: (q, k[::2], v[::2], p), ValueError, "k must be contiguous"),
        (lambda q, k, v, p: (q[:, :3].contiguous(), k, v, p), ValueError, "multiple of KV heads"),
        (lambda q, k, v, p: (q[..., :8].contiguous(), k, v, p), ValueError, "head dim mismatch"),
        (lambda q, k, v, p: (q, k, v[:-1].contiguous(), p), ValueError, "v shape"),
        (lambda q, k, v, p: (q, k, v, p[:-1]), ValueError, "q_pos has 5 entries"),
        (lambda q, k, v, p: (q[0], k, v, p), ValueError, "q must be 3-D"),
        (lambda q, k, v, p: (q, k, v, p + 1), ValueError, r"q_pos must lie in \[0, 40\)"),
        (lambda q, k, v, p: (q, k, v.to("meta"), p), ValueError, "one device"),
    ],
)
def test_sparse_attention_rejects_bad_inputs(mutate, exc, match):
    q, k, v, p = mutate(*_attn())
    with pytest.raises(exc, match=match):
        ops.sparse_attention(q, k, v, p, 0.25)


def test_sparse_attention_rejects_bad_scale():
    q, k, v, p = _attn()
    with pytest.raises(TypeError, match="scale"):
        ops.sparse_attention(q, k, v, p, float("nan"))
    with pytest.raises(TypeError, match="scale"):
        ops.sparse_attention(q, k, v, p, torch.tensor(0.25))


def test_attention_mass_rejects_bad_inputs():
    q, k, _, p = _attn()
    with pytest.raises(ValueError, match="at least one query row"):
        ops.attention_mass(q[:0].contiguous(), k, p[:0], 0.25)
    with pytest.raises(TypeError, match="k has dtype"):
        ops.attention_mass(q, k.bfloat16(), p, 0.25)
    with pytest.raises(ValueError, match="one device"):
        ops.attention_mass(q, k.to("meta"), p, 0.25)
    with pytest.raises(ValueError, match="q_pos must lie"):
        ops.attention_mass(q, k, p - 1, 0.25)


@pytest.mark.parametrize(
    "which,exc,match",
    [
        ("dup_rows", ValueError, "unique"),
        ("row_out_of_range", ValueError, r"rows must lie in \[0, 20\)"),
        ("odd_dim", ValueError, "even"),
        ("cos_shape", ValueError, "cos"),
        ("new_dtype", TypeError, "k_new_pre has dtype"),
        ("v_new_dtype", TypeError, "v_new has dtype"),
        ("rows_float", TypeError, "rows has dtype"),
        ("new_shape", ValueError, "len\\(rows\\)"),
        ("noncontig", ValueError, "v must be contiguous"),
        ("device", ValueError, "one device"),
    ],
)
def test_rerotate_scatter_rejects_bad_inputs(which, exc, match):
    k_pre, v, rows, k_new, v_new, cos, sin = make_rerotate(20, 2, 16, [1, 5], torch.float32)
    if which == "dup_rows":
        rows = torch.tensor([5, 5])
    elif which == "row_out_of_range":
        rows = torch.tensor([1, 20])
    elif which == "odd_dim":
        k_pre, v, k_new, v_new = (x[..., :15].contiguous() for x in (k_pre, v, k_new, v_new))
        cos, sin = cos[:, :15].contiguous(), sin[:, :15].contiguous()
    elif which == "cos_shape":
        cos = cos[:-1].contiguous()
    elif which == "new_dtype":
        k_new = k_new.half()
    elif which == "v_new_dtype":
        v_new = v_new.bfloat16()
    elif which == "rows_float":
        rows = rows.float()
    elif which == "new_shape":
        k_new = k_new[:1].contiguous()
    elif which == "noncontig":
        v = v.transpose(1, 2).contiguous().transpose(1, 2)
    elif which == "device":
        sin = sin.to("meta")
    with pytest.raises(exc, match=match):
        ops.rerotate_scatter(k_pre, v, rows, k_new, v_new, cos, sin)


# ---------------------------------------------------------------- GPU (realistic shapes)

GPU_SHAPE = dict(T=10_000, H=32, Hkv=8, D=128)
GPU_DTYPES = [torch.bfloat16, torch.float16]


def _gpu_attention(R, dtype, seed=0):
    T, H, Hkv, D = GPU_SHAPE["T"], GPU_SHAPE["H"], GPU_SHAPE["Hkv"], GPU_SHAPE["D"]
    return make_attention(R, T, H, Hkv, D, dtype, device="cuda", seed=seed)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("use_backend", ["triton"], indirect=True)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1500, 3000])
def test_gpu_sparse_attention(use_backend, dtype, rows):
    q, k, v, q_pos = _gpu_attention(rows, dtype)
    scale = GPU_SHAPE["D"] ** -0.5
    out = ops.sparse_attention(q, k, v, q_pos, scale)
    assert_close(out, ref.sparse_attention_ref(q, k, v, q_pos, scale), **TOL[dtype], what=f"gpu attn {dtype} R={rows}")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("use_backend", ["triton"], indirect=True)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("window", [512, 1000])
def test_gpu_sparse_attention_window(use_backend, dtype, window):
    """Gemma-3's sliding window (512) and one off every tile size, on the autotuned tiles."""
    q, k, v, q_pos = _gpu_attention(1500, dtype)
    scale = GPU_SHAPE["D"] ** -0.5
    out = ops.sparse_attention(q, k, v, q_pos, scale, window=window)
    want = ref.sparse_attention_ref(q, k, v, q_pos, scale, window)
    assert_close(out, want, **TOL[dtype], what=f"gpu attn window {window} {dtype}")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("use_backend", ["triton"], indirect=True)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 1, 256), (32, 32, 128)], ids=str)
def test_gpu_sparse_attention_other_model_shapes(use_backend, dtype, H, Hkv, D):
    """SmolLM2 (GQA 3, D 64), Gemma-3 (1 KV head, D 256), no GQA: other autotune tile lists."""
    q, k, v, q_pos = make_attention(300, 2000, H, Hkv, D, dtype, device="cuda")
    out = ops.sparse_attention(q, k, v, q_pos, D**-0.5)
    expected = ref.sparse_attention_ref(q, k, v, q_pos, D**-0.5)
    assert_close(out, expected, **TOL[dtype], what=f"gpu {dtype} {H}/{Hkv}/{D}")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("use_backend", ["triton"], indirect=True)
def test_gpu_sparse_attention_fp32_and_small_gqa(use_backend):
    for H, Hkv, D in [(8, 8, 64), (12, 4, 128), (8, 1, 256)]:
        q, k, v, q_pos = make_attention(77, 1000, H, Hkv, D, torch.float32, device="cuda")
        out = ops.sparse_attention(q, k, v, q_pos, D**-0.5)
        assert_close(out, ref.sparse_attention_ref(q, k, v, q_pos, D**-0.5), **TOL[torch.float32], what=f"gpu fp32 {H}/{Hkv}/{D}")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("use_backend", ["triton"], indirect=True)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_attention_mass(use_backend, dtype):
    q, k, _, _ = _gpu_attention(32, dtype)
    T = GPU_SHAPE["T"]
    q_pos = torch.arange(T - 32, T, device="cuda")  # probe = the question tokens at the end
    scale = GPU_SHAPE["D"] ** -0.5
    mass = ops.attention_mass(q, k, q_pos, scale)
    assert_close(mass, ref.attention_mass_ref(q, k, q_pos, scale), **MASS_TOL, what=f"gpu mass {dtype}")
    assert abs(mass.sum().item() - 1.0) < 1e-4


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("use_backend", ["triton"], indirect=True)
def test_gpu_attention_mass_split_over_many_key_ranges(use_backend):
    """The probe's shape on an 8B model (52 rows, ~10K keys): the log-sum-exp pass splits the
    keys into many ranges; rows early in the prompt see nothing in the later ones."""
    q, k, _, _ = make_attention(52, 10300, 32, 8, 128, torch.bfloat16, device="cuda")
    q_pos = torch.cat([torch.tensor([0, 700, 3000]), torch.arange(10300 - 49, 10300)]).cuda()
    assert ops._lse_splits(ops._cdiv(52, ops._mass_config(4, 128, False).block_m // 4) * 8, 10300, 64, False) > 4
    mass = ops.attention_mass(q, k, q_pos, 128 ** -0.5)
    assert_close(mass, ref.attention_mass_ref(q, k, q_pos, 128 ** -0.5), **MASS_TOL, what="gpu mass, split")
    assert abs(mass.sum().item() - 1.0) < 1e-4


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("use_backend", ["triton"], indirect=True)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_rerotate_scatter(use_backend, dtype):
    T, Hkv, D = GPU_SHAPE["T"], GPU_SHAPE["Hkv"], GPU_SHAPE["D"]
    rows = torch.sort(torch.randperm(T)[:1500]).values
    args = [x.cuda() for x in make_rerotate(T, Hkv, D, rows, dtype)]
    k_rot, v_out = ops.rerotate_scatter(*args)
    k_exp, v_exp = ref.rerotate_scatter_ref(*args)
    assert_close(k_rot, k_exp, **TOL[dtype], what=f"gpu k_rot {dtype}")
    assert torch.equal(v_out, v_exp)
    empty = torch.zeros(0, dtype=torch.int64, device="cuda")
    k_rot0, v_out0 = ops.rerotate_scatter(args[0], args[1], empty, args[3][:0], args[4][:0], args[5], args[6])
    assert torch.equal(v_out0, args[1])


def test_rerotate_scatter_reused_inverse_index_matches_and_is_checked():
    """Fused prefill builds inverse_rows once per request and passes it to every layer."""
    g = torch.Generator().manual_seed(7)
    T, Hkv, D = 37, 2, 16
    k_pre, v = torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
    rows = torch.tensor([0, 5, 6, 20, 36])
    k_new, v_new = torch.randn(5, Hkv, D, generator=g), torch.randn(5, Hkv, D, generator=g)
    cos, sin = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    inv = ops.inverse_rows(rows, T)
    assert inv.dtype == torch.int32 and inv[rows].tolist() == [0, 1, 2, 3, 4] and int((inv >= 0).sum()) == 5
    a = ops.rerotate_scatter(k_pre, v, rows, k_new, v_new, cos, sin)
    b = ops.rerotate_scatter(k_pre, v, rows, k_new, v_new, cos, sin, inv=inv)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="does not match rows"):
        ops.rerotate_scatter(k_pre, v, rows, k_new, v_new, cos, sin, inv=ops.inverse_rows(rows[:4], T))
    with pytest.raises(TypeError, match="inv has dtype"):
        ops.rerotate_scatter(k_pre, v, rows, k_new, v_new, cos, sin, inv=inv.long())
    with pytest.raises(ValueError, match=r"inv must be \(T,\)"):
        ops.rerotate_scatter(k_pre, v, rows, k_new, v_new, cos, sin, inv=inv[:-1])


@pytest.mark.parametrize("use_backend", ["torch"] + (["interpret"] if _triton_mode() == "interpreted" else []), indirect=True)
def test_rerotate_scatter_writes_into_out(use_backend):
    """Fused prefill hands a decode cache's layer as `out`: same values, written in place."""
    T, Hkv, D = 29, 2, 16
    rows = torch.tensor([0, 3, 4, 17, 28])
    args = make_rerotate(T, Hkv, D, rows, torch.float32)
    k_exp, v_exp = ops.rerotate_scatter(*args)
    cache = torch.full((2, 40, Hkv, D), 7.0)  # (k|v, capacity, Hkv, D)
    k_dst, v_dst = cache[0, :T], cache[1, :T]
    k_rot, v_out = ops.rerotate_scatter(*args, out=(k_dst, v_dst))
    assert k_rot.data_ptr() == k_dst.data_ptr() and v_out.data_ptr() == v_dst.data_ptr()
    assert torch.equal(cache[0, :T], k_exp) and torch.equal(cache[1, :T], v_exp)
    assert bool((cache[:, T:] == 7.0).all())  # nothing past T touched
    with pytest.raises(ValueError, match="out k must be"):
        ops.rerotate_scatter(*args, out=(cache[0, : T - 1], v_dst))
    with pytest.raises(TypeError, match="pair"):
        ops.rerotate_scatter(*args, out=k_dst)


@pytest.mark.parametrize("use_backend", ["torch"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["probe", "scattered", "from_zero"])
def test_torch_attention_mass_masks_only_what_it_must(use_backend, dtype, layout):
    """The torch path masks only the columns after the first row (in place) and equals the
    reference bit for bit: probe rows after the context, rows anywhere, a row at position 0."""
    R, T = 12, 200
    q, k, _, _ = make_attention(R, T, 6, 2, 32, dtype)
    if layout == "probe":
        q_pos = torch.arange(T - R, T)
    elif layout == "scattered":
        q_pos = torch.sort(torch.randperm(T, generator=torch.Generator().manual_seed(5))[:R]).values
    else:
        q_pos = torch.cat([torch.zeros(1, dtype=torch.int64), torch.arange(T - R + 1, T)])
    got = ops.attention_mass(q, k, q_pos, 0.2)
    assert torch.equal(got, ref.attention_mass_ref(q, k, q_pos, 0.2))
    assert (got[q_pos.max() + 1 :] == 0).all()
