"""Triton kernels: attention-mass scoring in two passes (jitted code only; launcher in `ops.py`).

    mass[j] = 1/(R*H) * sum_{r, h : j <= q_pos[r]} softmax_j(q[r, h] . k[j, h // GROUP] * scale)

The (R, H, T) probability matrix is never stored:

    pass 1  lse_kernel   grid (cdiv(R, ROWS), Hkv, splits):   lse[r, h] = log2 sum_{j<=pos} 2^(s_rhj)
            (with several splits each program covers one range of keys and stores its running
            max and sum; the launcher combines them - a few dozen rows over ~10K keys are
            otherwise 32 programs for 132 SMs)
    pass 2  mass_kernel  grid (cdiv(T, BLOCK_N), Hkv): part[kvh, j] = sum_{r, g} 2^(s_rhj - lse[r, h])

with s = q.k * scale * log2(e) (base-2 exponentials). The launcher sums `part` over KV heads
and divides by R*H (deterministic: no atomics). Query tiles use the same GQA packing as
`triton_sparse_attention.py`: tile index m -> (row = m // GROUP, head = kvh*GROUP + m % GROUP).

Invariants the launcher guarantees: q, k contiguous; 0 <= q_pos < T; BLOCK_M >= GROUP;
BLOCK_D = next power of two >= HEAD_DIM; lse is (R, H) fp32, part (Hkv, T) fp32. Both
passes compute s with the same tl.dot, so p <= 1 up to rounding and sum_j p == 1 per (r, h).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_query_tile(
    Q,
    POS,
    tile,
    kvh,
    R,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """-> q (BLOCK_M, BLOCK_D), pos (BLOCK_M,) int32, row, head, m_ok (BLOCK_M,)."""
    ROWS: tl.constexpr = BLOCK_M // GROUP
    Q_STRIDE: tl.constexpr = NUM_KV_HEADS * GROUP * HEAD_DIM
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row = tile * ROWS + offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    m_ok = (offs_m < ROWS * GROUP) & (row < R)
    pos = tl.load(POS + row, mask=m_ok, other=0).to(tl.int32)
    q_ptrs = Q + row[:, None] * Q_STRIDE + head[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    return q, pos, row, head, m_ok


@triton.jit
def lse_kernel(
    Q,
    K,
    POS,
    LSE,
    MPART,
    LPART,  # q (R, H, D), k (T, Hkv, D), pos (R,), lse (R, H) fp32; partials (splits, R, H)
    R,
    T,
    qk_scale,
    split_n,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Pass 1, grid (cdiv(R, BLOCK_M // GROUP), Hkv, splits): base-2 log-sum-exp per (row,
    head) into LSE; with SPLIT, split s covers keys [s * split_n, (s + 1) * split_n) (split_n
    a multiple of BLOCK_N) and stores its running max and sum into MPART / LPART[s]."""
    KV_STRIDE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    H: tl.constexpr = NUM_KV_HEADS * GROUP
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    q, pos, row, head, m_ok = _load_query_tile(
        Q, POS, tile, kvh, R, NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, UPCAST
    )
    offs_d = tl.arange(0, BLOCK_D)
    end = tl.minimum(tl.max(pos, 0) + 1, T)  # keys beyond the tile's last position are never loaded
    lo = 0
    if SPLIT:
        lo = tl.program_id(2) * split_n
        end = tl.minimum(end, lo + split_n)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for start_n in range(lo, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = K + kvh * HEAD_DIM + offs_n[None, :] * KV_STRIDE + offs_d[:, None]  # (BLOCK_D, BLOCK_N)
        k = tl.load(k_ptrs, mask=(offs_n[None, :] < end) & (offs_d[:, None] < HEAD_DIM), other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        s = tl.where(offs_n[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: key 0 is in the first block
        if SPLIT:  # a later split's first block may hide every key from a row: keep -inf out of m - m
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        else:
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new
    if SPLIT:
        at = tl.program_id(2) * R * H + row * H + head
        tl.store(MPART + at, m_i, mask=m_ok)
        tl.store(LPART + at, l_i, mask=m_ok)
    else:
        lse = m_i + tl.log2(l_i)
        tl.store(LSE + row * H + head, lse, mask=m_ok)


@triton.jit
def mass_kernel(
    Q,
    K,
    POS,
    LSE,
    PART,  # q (R, H, D), k (T, Hkv, D), pos (R,), lse (R, H), part (Hkv, T)
    R,
    T,
    qk_scale,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Pass 2, grid (cdiv(T, BLOCK_N), Hkv): part[kvh, j] = mass of key j summed over the
    rows and the GROUP query heads of KV head kvh. Each K tile is loaded once."""
    ROWS: tl.constexpr = BLOCK_M // GROUP
    KV_STRIDE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    H: tl.constexpr = NUM_KV_HEADS * GROUP
    kv_tile = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_n = kv_tile * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < T
    k_ptrs = K + kvh * HEAD_DIM + offs_n[None, :] * KV_STRIDE + offs_d[:, None]  # (BLOCK_D, BLOCK_N)
    k = tl.load(k_ptrs, mask=n_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    col = tl.zeros([BLOCK_N], tl.float32)
    for tile in range(0, tl.cdiv(R, ROWS)):
        q, pos, row, head, m_ok = _load_query_tile(
            Q, POS, tile, kvh, R, NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, UPCAST
        )
        lse = tl.load(LSE + row * H + head, mask=m_ok, other=0.0)  # (BLOCK_M,)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        visible = (offs_n[None, :] <= pos[:, None]) & m_ok[:, None]
        p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
        col += tl.sum(p, 0)
    tl.store(PART + kvh * T + offs_n, col, mask=n_ok)
