"""Triton kernels: the per-row pointwise steps of a decoder layer, one pass each (jitted code
only; launchers in `ops.py`).

Fused prefill recomputes ~1-3K rows per layer; in PyTorch each of these steps is 4-8 small
kernels with fp32 temporaries (HF's RMSNorm: upcast, pow, mean, rsqrt, mul, downcast, mul),
together about a fifth of a layer's device time on an H200. Each kernel here reads its
inputs once and writes its output once, with the same rounding points as the PyTorch
reference, so bf16 results agree with it to an ulp:

    rms_norm   y = w * bf16(x * rsqrt(mean(x^2) + eps))      (x upcast to fp32; HF's order)
    silu_mul   y = bf16(silu(g)) * u                         (HF's act_fn(gate) * up)
    rope       y = x * cos + rotate_half(x) * sin            (fp32, like reference.apply_rope)

and two for the decode step, where each row is one sequence's token:

    add_rms_norm     h = x + d (rounded like torch's add), y = rms_norm(h): the residual add
                     and the next norm in one pass
    silu_mul_packed  silu_mul of one (rows, 2I) product holding gate then up (the gated
                     MLP's two projections read as one matrix)

Invariants the launchers guarantee: tensors contiguous; rms_norm's BLOCK_N >= N (a whole
row per program); rope's cos/sin are (T, D) with HALF = D // 2 and BLOCK_HALF, BLOCK_H the
next powers of two >= HALF and >= the head count.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(X, W, Y, N, eps, BLOCK_N: tl.constexpr):
    """Grid (rows,): one program normalises one row of N values."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    ok = offs < N
    x = tl.load(X + row * N + offs, mask=ok, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / N
    normed = (x * tl.rsqrt(var + eps)).to(Y.dtype.element_ty)  # HF rounds here, then scales
    w = tl.load(W + offs, mask=ok, other=0.0)
    tl.store(Y + row * N + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def silu_mul_kernel(G, U, Y, numel, BLOCK: tl.constexpr):
    """Grid (cdiv(numel, BLOCK),) over the flattened tensors."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty)  # silu rounded to the model dtype, as torch does
    u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + offs, (act.to(tl.float32) * u).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def rope_kernel(
    X,
    COS,
    SIN,
    Y,  # (T, Hx, D), (T, D) x2, (T, Hx, D)
    T,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK_T),): BLOCK_T tokens with all their heads; cos/sin read once per token."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BT,)
    hd = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_HALF)
    t_ok = tok < T
    c_ok = offs_c < HALF
    ok = t_ok[:, None, None] & (hd < NUM_HEADS)[None, :, None] & c_ok[None, None, :]  # (BT, BH, BC)
    off = (tok.to(tl.int64)[:, None] * NUM_HEADS + hd[None, :])[:, :, None] * HEAD_DIM + offs_c[None, None, :]
    trig_off = tok[:, None] * HEAD_DIM + offs_c[None, :]
    trig_ok = t_ok[:, None] & c_ok[None, :]
    x1 = tl.load(X + off, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(X + off + HALF, mask=ok, other=0.0).to(tl.float32)
    cos1 = tl.load(COS + trig_off, mask=trig_ok, other=0.0).to(tl.float32)[:, None, :]
    cos2 = tl.load(COS + trig_off + HALF, mask=trig_ok, other=0.0).to(tl.float32)[:, None, :]
    sin1 = tl.load(SIN + trig_off, mask=trig_ok, other=0.0).to(tl.float32)[:, None, :]
    sin2 = tl.load(SIN + trig_off + HALF, mask=trig_ok, other=0.0).to(tl.float32)[:, None, :]
    tl.store(Y + off, (x1 * cos1 - x2 * sin1).to(Y.dtype.element_ty), mask=ok)
    tl.store(Y + off + HALF, (x2 * cos2 + x1 * sin2).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def add_rms_norm_kernel(X, D, W, H_OUT, Y, N, eps, BLOCK_N: tl.constexpr):
    """Grid (rows,): h = x + d rounded to the dtype (torch's add), then rms_norm_kernel's y of h."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    ok = offs < N
    x = tl.load(X + row * N + offs, mask=ok, other=0.0).to(tl.float32)
    d = tl.load(D + row * N + offs, mask=ok, other=0.0).to(tl.float32)
    h = (x + d).to(H_OUT.dtype.element_ty)
    tl.store(H_OUT + row * N + offs, h, mask=ok)
    hf = h.to(tl.float32)
    var = tl.sum(hf * hf, axis=0) / N
    normed = (hf * tl.rsqrt(var + eps)).to(Y.dtype.element_ty)
    w = tl.load(W + offs, mask=ok, other=0.0)
    tl.store(Y + row * N + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def silu_mul_packed_kernel(GU, Y, I, BLOCK: tl.constexpr):
    """Grid (rows, cdiv(I, BLOCK)): row r of GU (rows, 2I) holds gate then up; Y (rows, I)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    g = tl.load(GU + row * 2 * I + offs, mask=ok, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty)
    u = tl.load(GU + row * 2 * I + I + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * I + offs, (act.to(tl.float32) * u).to(Y.dtype.element_ty), mask=ok)
