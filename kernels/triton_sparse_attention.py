"""Triton kernel: location-aware sparse attention (jitted code only; launcher in `ops.py`).

A scattered set of R query rows, each at its own absolute position, attends to the whole
fused prompt's keys 0..T-1. Row i sees key j iff j <= q_pos[i]. No (R, T) mask exists:
visibility is decided per tile from the positions themselves.

Tiling (one program = one tile of query vectors x one KV head, GQA grouped):

    GROUP = H // Hkv query heads share KV head `kvh`.  A tile packs ROWS = BLOCK_M // GROUP
    consecutive rows, all GROUP heads each, so one K/V tile feeds BLOCK_M query vectors:

        tile index m:   0      1   ..  GROUP-1 | GROUP ...           | ...
        (row, head):  (r0,g0)(r0,g1) (r0,gG-1) | (r0+1,g0) ...       | padding (m >= ROWS*GROUP)

    q[r, kvh*GROUP + g, :] for g in 0..GROUP-1 is GROUP*D contiguous values, so a tile reads
    q in ROWS contiguous runs.

Key range of a tile (lo / hi = smallest / largest position among its rows):

    keys   0 ............ lo_block | lo_block ........ hi | hi+1 ... T-1
           phase 1: every row sees | phase 2: per-element   | never loaded
           every key, no mask      | mask  j <= pos(row)    | (skipped)

Sliding-window layers (WINDOWED, width W = WINDOW): row i sees key j iff
q_pos[i] - W < j <= q_pos[i]. Keys before the first row's window start (lo - W + 1) are
never loaded; the keys every row of the tile sees lie in [hi - W + 1, lo]:

    keys   0 ... kstart | kstart ..... full_lo | full_lo .. lo_block | lo_block .. hi | hi+1 ...
           skipped      | masked (window edge) | no mask             | masked (causal)| skipped

(kstart, full_lo rounded to BLOCK_N; the middle phase is empty when the tile's rows span more
than W positions). A row may meet whole blocks it sees no key of before its window starts, so
the masked sweeps subtract 0 while a row's running max is still -inf.

Invariants the launcher guarantees: q, k, v, out contiguous with the shapes in the
signature; 0 <= q_pos < T; BLOCK_M >= GROUP; BLOCK_D = next power of two >= HEAD_DIM.
Correctness never depends on row order; speed does - rows sorted ascending by position make
each tile's [lo, hi] span narrow, so the masked phase is short and later keys skipped. Tiles
are launched heaviest (largest positions) first to shorten the tail.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _attn_inner(
    acc,
    l_i,
    m_i,
    q,
    pos,
    k_base,
    v_base,
    start,
    end,
    qk_scale,
    offs_d,
    KV_STRIDE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    window,
):
    """Online-softmax sweep over keys [start, end) for one tile (base-2 exponentials).

    acc (BLOCK_M, BLOCK_D) fp32, l_i/m_i (BLOCK_M,) fp32, q (BLOCK_M, BLOCK_D), pos (BLOCK_M,).
    MASKED=False: every key in the range is visible to every row and in bounds (phase 1).
    MASKED=True: end <= T; key j counts for row m iff j <= pos[m] (phase 2), and with
    WINDOWED also j > pos[m] - window.
    Without a window the first block a row ever sees holds at least one visible key (key 0
    or phase-1 keys), so m_i is finite after it and no NaN arises; with one, a row can meet
    blocks without a visible key first; there 0 stands in for the -inf running max.
    """
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        k_ptrs = k_base + offs_n[None, :] * KV_STRIDE + offs_d[:, None]  # (BLOCK_D, BLOCK_N)
        v_ptrs = v_base + offs_n[:, None] * KV_STRIDE + offs_d[None, :]  # (BLOCK_N, BLOCK_D)
        if MASKED:
            n_ok = offs_n < end
            if EVEN_D:
                k = tl.load(k_ptrs, mask=n_ok[None, :], other=0.0)
                v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
            else:
                d_ok = offs_d < HEAD_DIM
                k = tl.load(k_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            if EVEN_D:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
            else:
                d_ok = offs_d < HEAD_DIM
                k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        if UPCAST:  # interpreter + bf16: no arithmetic on bf16 values
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N) fp32
        if MASKED:
            visible = offs_n[None, :] <= pos[:, None]
            if WINDOWED:
                visible = visible & (offs_n[None, :] > pos[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = m_new
        if WINDOWED and MASKED:  # no key seen yet: subtract 0 instead (exp2(-inf) = 0, never NaN)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(qk - m_ref[:, None])  # (BLOCK_M, BLOCK_N) fp32, 0 where masked
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_tile(
    Q,
    K,
    V,
    POS,
    OUT,  # one prompt: q/out (R, H, D), k/v (T, Hkv, D), pos (R,) int
    R,
    T,
    tile,
    kvh,
    qk_scale,
    window,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    """One program's work: tile `tile` of rows x the GROUP query heads of KV head `kvh`.

    Writes out[rows of the tile, heads of kvh]. The pointers address one prompt's rows and
    keys; 0 <= tile < cdiv(R, ROWS).
    """
    ROWS: tl.constexpr = BLOCK_M // GROUP
    KV_STRIDE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM  # token stride of k/v
    Q_STRIDE: tl.constexpr = NUM_KV_HEADS * GROUP * HEAD_DIM  # row stride of q/out
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row = tile * ROWS + offs_m // GROUP  # (BLOCK_M,)
    head = kvh * GROUP + offs_m % GROUP  # (BLOCK_M,)
    m_ok = (offs_m < ROWS * GROUP) & (row < R)
    pos = tl.load(POS + row, mask=m_ok, other=0).to(tl.int32)  # padding rows: pos 0
    lo = tl.minimum(tl.min(tl.where(m_ok, pos, T), 0), T - 1)  # clamps: never read past T-1
    hi = tl.minimum(tl.max(pos, 0), T - 1)
    lo_block = ((lo + 1) // BLOCK_N) * BLOCK_N  # keys [0, lo_block) visible to every row
    end = hi + 1

    q_ptrs = Q + row[:, None] * Q_STRIDE + head[:, None] * HEAD_DIM + offs_d[None, :]
    if EVEN_D:
        io_mask = m_ok[:, None]
    else:
        io_mask = m_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptrs, mask=io_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
    if UPCAST:
        q = q.to(tl.float32)

    k_base = K + kvh * HEAD_DIM
    v_base = V + kvh * HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if WINDOWED:
        kstart = (tl.maximum(lo - window + 1, 0) // BLOCK_N) * BLOCK_N  # earlier keys: no row sees them
        full_lo = tl.cdiv(tl.maximum(hi - window + 1, 0), BLOCK_N) * BLOCK_N  # from here every row sees...
        full_lo = tl.maximum(tl.minimum(full_lo, lo_block), kstart)  # ...every key up to lo_block
        acc, l_i, m_i = _attn_inner(
            acc,
            l_i,
            m_i,
            q,
            pos,
            k_base,
            v_base,
            kstart,
            full_lo,
            qk_scale,
            offs_d,
            KV_STRIDE,
            HEAD_DIM,
            BLOCK_N,
            True,
            EVEN_D,
            UPCAST,
            PRECISION,
            True,
            window,
        )
        acc, l_i, m_i = _attn_inner(
            acc,
            l_i,
            m_i,
            q,
            pos,
            k_base,
            v_base,
            full_lo,
            lo_block,
            qk_scale,
            offs_d,
            KV_STRIDE,
            HEAD_DIM,
            BLOCK_N,
            False,
            EVEN_D,
            UPCAST,
            PRECISION,
            True,
            window,
        )
        acc, l_i, m_i = _attn_inner(
            acc,
            l_i,
            m_i,
            q,
            pos,
            k_base,
            v_base,
            lo_block,
            end,
            qk_scale,
            offs_d,
            KV_STRIDE,
            HEAD_DIM,
            BLOCK_N,
            True,
            EVEN_D,
            UPCAST,
            PRECISION,
            True,
            window,
        )
    else:
        acc, l_i, m_i = _attn_inner(
            acc,
            l_i,
            m_i,
            q,
            pos,
            k_base,
            v_base,
            0,
            lo_block,
            qk_scale,
            offs_d,
            KV_STRIDE,
            HEAD_DIM,
            BLOCK_N,
            False,
            EVEN_D,
            UPCAST,
            PRECISION,
            False,
            0,
        )
        acc, l_i, m_i = _attn_inner(
            acc,
            l_i,
            m_i,
            q,
            pos,
            k_base,
            v_base,
            lo_block,
            end,
            qk_scale,
            offs_d,
            KV_STRIDE,
            HEAD_DIM,
            BLOCK_N,
            True,
            EVEN_D,
            UPCAST,
            PRECISION,
            False,
            0,
        )
    if WINDOWED:  # padding rows may see no key at all: keep their (never stored) output finite
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    o_ptrs = OUT + row[:, None] * Q_STRIDE + head[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=io_mask)


@triton.jit
def sparse_attention_kernel(
    Q,
    K,
    V,
    POS,
    OUT,  # q/out (R, H, D), k/v (T, Hkv, D), pos (R,) int
    R,
    T,
    qk_scale,  # qk_scale = softmax scale * log2(e)
    window,  # sliding window W (read only when WINDOWED)
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    """Grid (cdiv(R, BLOCK_M // GROUP), Hkv). Writes out[rows of the tile, heads of kvh]."""
    n_tiles = tl.cdiv(R, BLOCK_M // GROUP)
    tile = n_tiles - 1 - tl.program_id(0)  # heaviest tiles first
    _attn_tile(
        Q,
        K,
        V,
        POS,
        OUT,
        R,
        T,
        tile,
        tl.program_id(1),
        qk_scale,
        window,
        NUM_KV_HEADS,
        GROUP,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_M,
        BLOCK_N,
        UPCAST,
        PRECISION,
        WINDOWED,
    )
