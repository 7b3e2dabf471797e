"""Batched ("varlen") sparse attention: B requests, each its own prompt, in one launch.

`ops.sparse_attention_varlen` against (a) `ops.sparse_attention` run request by request and
(b) the PyTorch reference `reference.sparse_attention_varlen_ref`.

CPU: Triton's interpreter on tiny shapes (tests/conftest.py sets TRITON_INTERPRET=1); its
tile is 16 query vectors x 32 keys, so with GQA 2 a tile holds 8 rows and the requests below
span 0 to 5 tiles. There both ops run the same tile code on the same rows, so (a) holds bit
for bit. GPU: compiled kernels at a batched fused prefill's shape (TRITON_INTERPRET=0 on a
CUDA host). Tolerances against the reference are those of tests/test_kernels.py.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest
import torch

from qcfuse_kernels import ops
from qcfuse_kernels import reference as ref
from tests.test_kernels import TOL, assert_close, needs_cuda, needs_interpreter, use_backend  # noqa: F401

pytestmark = pytest.mark.kernels


def make_batch(requests, H, Hkv, D, dtype, device="cpu", seed=0):
    """requests: [(T_b, positions_b)] -> q, k, v, q_pos, cu_rows, cu_keys (requests end to end).

    q (R_total, H, D), k/v (T_total, Hkv, D), q_pos (R_total,) local, cu_* (B + 1,) int64."""
    g = torch.Generator().manual_seed(seed)
    T_total = sum(T for T, _ in requests)
    q_pos = torch.tensor([p for _, rows in requests for p in rows], dtype=torch.int64)
    q = torch.randn(len(q_pos), H, D, generator=g).to(dtype)
    k = torch.randn(T_total, Hkv, D, generator=g).to(dtype)
    v = torch.randn(T_total, Hkv, D, generator=g).to(dtype)
    cu_rows = torch.tensor([0] + [len(rows) for _, rows in requests]).cumsum(0)
    cu_keys = torch.tensor([0] + [T for T, _ in requests]).cumsum(0)
    return [x.to(device) for x in (q, k, v, q_pos, cu_rows, cu_keys)]


def per_request(q, k, v, q_pos, cu_rows, cu_keys, scale, window):
    """`ops.sparse_attention` on each request's slices, written into one (R_total, H, D)."""
    out = torch.zeros_like(q)
    rows, keys = cu_rows.tolist(), cu_keys.tolist()
    for b in range(len(rows) - 1):
        r0, r1, k0, k1 = rows[b], rows[b + 1], keys[b], keys[b + 1]
        if r1 > r0:
            out[r0:r1] = ops.sparse_attention(q[r0:r1], k[k0:k1], v[k0:k1], q_pos[r0:r1], scale, window)
    return out


def _ragged(T, n, seed):
    """n sorted unique positions in [0, T) that include 0 and T - 1."""
    inner = torch.randperm(T - 2, generator=torch.Generator().manual_seed(seed))[: n - 2] + 1
    return sorted([0, T - 1, *inner.tolist()])


LAYOUTS = {
    # every row of a 40-key prompt | 3 scattered rows | no rows | a ragged 15% of 100 keys
    "mixed": [(40, list(range(40))), (130, [3, 64, 129]), (70, []), (100, _ragged(100, 15, 1))],
    # empty requests first and last; a request whose rows fill whole tiles
    "empty_ends": [(30, []), (64, list(range(0, 64, 4))), (20, [19]), (45, [])],
}


# ---------------------------------------------------------------- interpreter (CPU)


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize("window", [None, 7, 33])
@pytest.mark.parametrize("D", [16, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_varlen_matches_per_request_op_and_reference(use_backend, layout, dtype, D, window):
    q, k, v, q_pos, cu_rows, cu_keys = make_batch(LAYOUTS[layout], 4, 2, D, dtype)  # GQA 2
    scale = D**-0.5
    out = ops.sparse_attention_varlen(q, k, v, q_pos, cu_rows, cu_keys, scale, window)
    assert out.dtype == dtype and out.shape == q.shape
    each = per_request(q, k, v, q_pos, cu_rows, cu_keys, scale, window)
    assert torch.equal(out, each), f"varlen != per-request op: max abs diff {(out - each).abs().max().item():.3e}"
    want = ref.sparse_attention_varlen_ref(q, k, v, q_pos, cu_rows, cu_keys, scale, window)
    assert_close(out, want, **TOL[dtype], what=f"varlen {layout} {dtype} D={D} window={window}")


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.parametrize("window", [None, 20, 150])
def test_one_request_equals_plain_op(use_backend, window):
    q, k, v, q_pos, cu_rows, cu_keys = make_batch([(150, _ragged(150, 21, 2))], 4, 2, 16, torch.float32)
    out = ops.sparse_attention_varlen(q, k, v, q_pos, cu_rows, cu_keys, 0.3, window)
    assert torch.equal(out, ops.sparse_attention(q, k, v, q_pos, 0.3, window))


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the other requests' NaN rows
def test_requests_never_see_each_others_keys(use_backend):
    """NaN in every other request's keys and values changes nothing in request 1's rows."""
    q, k, v, q_pos, cu_rows, cu_keys = make_batch(LAYOUTS["mixed"], 4, 2, 16, torch.float32)
    want = ops.sparse_attention_varlen(q, k, v, q_pos, cu_rows, cu_keys, 0.3)
    k0, k1 = int(cu_keys[1]), int(cu_keys[2])
    for x in (k, v):
        x[:k0], x[k1:] = float("nan"), float("nan")
    got = ops.sparse_attention_varlen(q, k, v, q_pos, cu_rows, cu_keys, 0.3)
    r0, r1 = int(cu_rows[1]), int(cu_rows[2])
    assert torch.equal(got[r0:r1], want[r0:r1])


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
def test_varlen_unsorted_rows_int32_tables_and_max_rows(use_backend):
    """Rows out of order inside a request are correct (only slower); int32 positions and
    offsets work; a `max_rows` bound above the longest request changes nothing."""
    requests = [(60, [59, 2, 30, 31, 0, 45, 7, 58, 12]), (33, [32, 1]), (80, [79, 40, 41, 3])]
    q, k, v, q_pos, cu_rows, cu_keys = make_batch(requests, 8, 2, 16, torch.float32)  # GQA 4
    want = ref.sparse_attention_varlen_ref(q, k, v, q_pos, cu_rows, cu_keys, 0.3, 16)
    i32 = [x.to(torch.int32) for x in (q_pos, cu_rows, cu_keys)]
    out = ops.sparse_attention_varlen(q, k, v, *i32, 0.3, 16)
    assert_close(out, want, **TOL[torch.float32], what="unsorted, int32")
    assert torch.equal(ops.sparse_attention_varlen(q, k, v, *i32, 0.3, 16, max_rows=40), out)


@needs_interpreter
@pytest.mark.parametrize("use_backend", ["interpret"], indirect=True)
def test_varlen_no_rows_at_all(use_backend):
    q, k, v, q_pos, cu_rows, cu_keys = make_batch([(30, []), (12, [])], 4, 2, 16, torch.bfloat16)
    out = ops.sparse_attention_varlen(q, k, v, q_pos, cu_rows, cu_keys, 0.3)
    assert out.shape == (0, 4, 16) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("use_backend", ["torch"], indirect=True)
def test_torch_backend_is_the_reference(use_backend):
    args = make_batch(LAYOUTS["mixed"], 4, 2, 16, torch.float32)
    for window in (None, 9):
        got = ops.sparse_attention_varlen(*args, 0.25, window)
        assert torch.equal(got, ref.sparse_attention_varlen_ref(*args, 0.25, window))


# ---------------------------------------------------------------- validation errors


def _batch():
    # rows 0..3 -> request 0 (T 40), rows 4..5 -> request 1 (T 130), request 2 (T 70) empty
    return make_batch([(40, [0, 9, 20, 39]), (130, [64, 129]), (70, [])], 4, 2, 16, torch.float32)


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda p, r, c: (p, r + 1, c), ValueError, r"cu_rows must run from 0 to the number of query rows \(6\)"),
        (lambda p, r, c: (p, torch.tensor([0, 4, 5, 5]), c), ValueError, r"cu_rows must run from 0 .* got 0 \.\. 5"),
        (lambda p, r, c: (p, r, torch.tensor([0, 40, 170, 200])), ValueError, r"number of keys \(240\)"),
        (lambda p, r, c: (p, torch.tensor([0, 5, 4, 6]), c), ValueError, r"cu_rows must not decrease: cu_rows\[1\] = 5"),
        (lambda p, r, c: (p, r, c[:-1]), ValueError, r"B \+ 1 >= 2"),
        (lambda p, r, c: (p, r[:1], c[:1]), ValueError, r"B \+ 1 >= 2"),
        (lambda p, r, c: (p, r.float(), c), TypeError, "cu_rows has dtype"),
        (lambda p, r, c: (p, r, c[None]), ValueError, "cu_keys must be 1-D"),
        (lambda p, r, c: (p, r, c.to("meta")), ValueError, "cu_keys must be on the CPU or on q's device"),
        # position 60 is inside the batch's 240 keys but past request 0's 40
        (lambda p, r, c: (torch.tensor([0, 9, 20, 60, 64, 129]), r, c), ValueError,
         r"q_pos\[3\] = 60 lies outside \[0, 40\), the keys of its request 0 \(rows 0\.\.3\)"),
        (lambda p, r, c: (torch.tensor([0, 9, 20, 39, 64, 130]), r, c), ValueError,
         r"q_pos\[5\] = 130 lies outside \[0, 130\), the keys of its request 1"),
        (lambda p, r, c: (p - 1, r, c), ValueError, r"q_pos must lie in \[0, 240\)"),
    ],
)
def test_varlen_rejects_bad_offsets_and_positions(mutate, exc, match):
    q, k, v, q_pos, cu_rows, cu_keys = _batch()
    p, r, c = mutate(q_pos, cu_rows, cu_keys)
    with pytest.raises(exc, match=match):
        ops.sparse_attention_varlen(q, k, v, p, r, c, 0.25)


def test_varlen_rejects_bad_max_rows_and_shared_checks():
    q, k, v, q_pos, cu_rows, cu_keys = _batch()
    with pytest.raises(ValueError, match="max_rows = 3 but a request holds 4 rows"):
        ops.sparse_attention_varlen(q, k, v, q_pos, cu_rows, cu_keys, 0.25, max_rows=3)
    with pytest.raises(ValueError, match="max_rows must be a non-negative int"):
        ops.sparse_attention_varlen(q, k, v, q_pos, cu_rows, cu_keys, 0.25, max_rows=-1)
    with pytest.raises(ValueError, match="window must be a positive int"):
        ops.sparse_attention_varlen(q, k, v, q_pos, cu_rows, cu_keys, 0.25, window=0)
    with pytest.raises(TypeError, match="v has dtype"):
        ops.sparse_attention_varlen(q, k, v.half(), q_pos, cu_rows, cu_keys, 0.25)


# ---------------------------------------------------------------- GPU (realistic shape)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("use_backend", ["triton"], indirect=True)
@pytest.mark.parametrize("window", [None, 512])
def test_gpu_varlen_batched_prefill_shape(use_backend, window):
    """4 fused prompts of 1-3K keys, ~15% of each recomputed (one request with none), an 8B
    model's heads (32 / 8, D 128), bf16: reference, per-request op and host vs device tables."""
    sizes = [2900, 1100, 1800, 2400]
    requests = [(T, _ragged(T, int(0.15 * T), b) if b != 2 else []) for b, T in enumerate(sizes)]
    q, k, v, q_pos, cu_rows, cu_keys = make_batch(requests, 32, 8, 128, torch.bfloat16, device="cuda")
    scale = 128**-0.5
    host = (cu_rows.cpu(), cu_keys.cpu())
    out = ops.sparse_attention_varlen(q, k, v, q_pos, *host, scale, window)
    want = ref.sparse_attention_varlen_ref(q, k, v, q_pos, cu_rows, cu_keys, scale, window)
    tol = TOL[torch.bfloat16]
    assert_close(out, want, **tol, what=f"gpu varlen window={window}")
    each = per_request(q, k, v, q_pos, cu_rows, cu_keys, scale, window)
    assert_close(out, each, **tol, what=f"gpu varlen vs per-request window={window}")
    longest = int(cu_rows.diff().max())
    on_device = ops.sparse_attention_varlen(q, k, v, q_pos, cu_rows, cu_keys, scale, window, max_rows=longest)
    assert torch.equal(on_device, out)
