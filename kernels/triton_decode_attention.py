"""Triton kernels: one decode step's attention over each sequence's own KV cache (jitted code
only; launchers `decode_attention_ptrs` / `kv_append_ptrs` in `ops.py`).

A batch of B sequences, one new query row each, every sequence with its own cache tensor
(the engine's KV pool hands each request its own buffer). The kernels read the caches
through tables of base addresses - KP[b] / VP[b] point at sequence b's (capacity, Hkv, D)
block of one layer - so a launch needs no gather of the caches into one tensor, and the
addresses live in device memory: a CUDA graph captured once replays for any set of caches
whose addresses are written into the same table.

`rope_append_kernel` is the step before: one row's projections in, its rotated queries out,
its rotated key and its value written into its caches.

Split-KV, two passes, no atomics (the same bits every run, and a row's bits do not depend on
the other rows of the batch):

    decode_partial_kernel  grid (B * Hkv, SPLITS): program (b, kvh, s) takes the GROUP query
        heads of KV head kvh and keys [start_s, end_s) of sequence b - the sequence's visible
        keys [lo, n) cut into SPLITS equal ranges of whole BLOCK_N blocks - and writes its
        running max m (log2 domain), sum l and unnormalised output acc (fp32).
    decode_combine_kernel  grid (B * H,): one program per query head merges its SPLITS
        partials (one reduction over a fixed-size vector: a fixed order).

n = LENS[b] keys are visible (the new token's key already appended); a sliding layer of
width W sees keys [max(0, n - W), n). The ranges depend on n and SPLITS only, so the sum
order of a row is fixed by its own length: its bits do not depend on the other rows.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_partial_kernel(
    Q,  # (B, H, D) post-RoPE queries, H = NUM_KV_HEADS * GROUP
    KP,  # (B,) int64: address of sequence b's keys of this layer, (capacity, Hkv, D) contiguous
    VP,  # (B,) int64: the same for values
    LENS,  # (B,) int: visible keys of sequence b (>= 1)
    M_OUT,  # (B * Hkv, SPLITS, BLOCK_G) fp32
    L_OUT,  # (B * Hkv, SPLITS, BLOCK_G) fp32
    ACC_OUT,  # (B * Hkv, SPLITS, BLOCK_G, BLOCK_D) fp32
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window width, 0: none
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // NUM_KV_HEADS
    kvh = pid % NUM_KV_HEADS

    n = tl.load(LENS + b).to(tl.int32)
    lo = n * 0
    if window > 0:
        lo = tl.maximum(n - window, 0)
    per = tl.cdiv(tl.cdiv(n - lo, SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per
    end = tl.minimum(n, start + per)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    q_rows = b * NUM_KV_HEADS * GROUP + kvh * GROUP + offs_g
    q = tl.load(Q + q_rows[:, None] * HEAD_DIM + offs_d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # interpreter + bf16: no arithmetic on bf16 values
        q = q.to(tl.float32)

    # the launcher guarantees 16-byte aligned addresses: the hint lets loads be vectorised
    kbase = tl.multiple_of(tl.load(KP + b), 16).to(tl.pointer_type(Q.dtype.element_ty))
    vbase = tl.multiple_of(tl.load(VP + b), 16).to(tl.pointer_type(Q.dtype.element_ty))
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + offs_n
        t_ok = t < end
        off = (t[:, None] * NUM_KV_HEADS + kvh) * HEAD_DIM + offs_d[None, :]
        kv_ok = t_ok[:, None] & d_ok[None, :]
        k = tl.load(kbase + off, mask=kv_ok, other=0.0)
        v = tl.load(vbase + off, mask=kv_ok, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_G, BLOCK_N)
        qk = tl.where(t_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    part = pid * SPLITS + split
    tl.store(M_OUT + part * BLOCK_G + offs_g, m_i)
    tl.store(L_OUT + part * BLOCK_G + offs_g, l_i)
    tl.store(ACC_OUT + (part * BLOCK_G + offs_g[:, None]) * BLOCK_D + offs_d[None, :], acc)


@triton.jit
def decode_combine_kernel(
    M_IN,
    L_IN,
    ACC_IN,
    OUT,  # (B, H, D) in the queries' dtype
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr,
):
    pid = tl.program_id(0)  # one query head: (b * Hkv + kvh) * GROUP + g
    part = pid // GROUP  # its (sequence, KV head)
    g = pid % GROUP
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    rows = (part * SPLITS + offs_s) * BLOCK_G + g  # split s's entry of this head
    m_s = tl.load(M_IN + rows)  # (SPLITS,)
    m = tl.max(m_s, 0)  # finite: the sequence sees at least one key
    w = tl.exp2(m_s - m)  # 0 for a split that saw no key
    l_sum = tl.sum(w * tl.load(L_IN + rows), 0)
    acc = tl.load(ACC_IN + rows[:, None] * BLOCK_D + offs_d[None, :])  # (SPLITS, BLOCK_D)
    out = tl.sum(w[:, None] * acc, 0) / l_sum
    tl.store(OUT + pid * HEAD_DIM + offs_d, out.to(OUT.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def kv_append_kernel(
    KP,  # (B,) int64 addresses as in decode_partial_kernel
    VP,
    POS,  # (B,) int: where sequence b's new key and value go
    K_NEW,  # (B, Hkv * D) contiguous, the caches' dtype
    V_NEW,
    ROW: tl.constexpr,  # Hkv * D
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    pos = tl.load(POS + b).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < ROW
    kbase = tl.load(KP + b).to(tl.pointer_type(K_NEW.dtype.element_ty))
    vbase = tl.load(VP + b).to(tl.pointer_type(K_NEW.dtype.element_ty))
    tl.store(kbase + pos * ROW + offs, tl.load(K_NEW + b * ROW + offs, mask=ok), mask=ok)
    tl.store(vbase + pos * ROW + offs, tl.load(V_NEW + b * ROW + offs, mask=ok), mask=ok)


@triton.jit
def rope_append_kernel(
    QKV,  # (B, (H + 2 * Hkv) * D) contiguous: each row's q, k, v projections, pre-RoPE
    COS,  # (B, D) fp32
    SIN,
    KP,  # (B,) int64 addresses as in decode_partial_kernel
    VP,
    POS,  # (B,) int: where sequence b's new key and value go
    Q_OUT,  # (B, H, D) rotated queries
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Grid (B,): RoPE of row b's queries and key (rope_kernel's arithmetic), the rotated key
    and the value written at the row's position of its caches (kv_append_kernel's)."""
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_HALF)
    c_ok = offs_c < HALF
    cos1 = tl.load(COS + b * HEAD_DIM + offs_c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(COS + b * HEAD_DIM + HALF + offs_c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(SIN + b * HEAD_DIM + offs_c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(SIN + b * HEAD_DIM + HALF + offs_c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    ROW = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    KV_ROW = NUM_KV_HEADS * HEAD_DIM
    src = QKV + b * ROW

    hq = tl.arange(0, BLOCK_HQ)
    ok = (hq < NUM_HEADS)[:, None] & c_ok[None, :]
    off = hq[:, None] * HEAD_DIM + offs_c[None, :]
    x1 = tl.load(src + off, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + off + HALF, mask=ok, other=0.0).to(tl.float32)
    dst = Q_OUT + b * NUM_HEADS * HEAD_DIM
    tl.store(dst + off, (x1 * cos1 - x2 * sin1).to(Q_OUT.dtype.element_ty), mask=ok)
    tl.store(dst + off + HALF, (x2 * cos2 + x1 * sin2).to(Q_OUT.dtype.element_ty), mask=ok)

    kbase = tl.load(KP + b).to(tl.pointer_type(QKV.dtype.element_ty)) + pos * KV_ROW
    vbase = tl.load(VP + b).to(tl.pointer_type(QKV.dtype.element_ty)) + pos * KV_ROW
    hk = tl.arange(0, BLOCK_HKV)
    ok = (hk < NUM_KV_HEADS)[:, None] & c_ok[None, :]
    off = hk[:, None] * HEAD_DIM + offs_c[None, :]
    k_src = src + NUM_HEADS * HEAD_DIM
    x1 = tl.load(k_src + off, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(k_src + off + HALF, mask=ok, other=0.0).to(tl.float32)
    tl.store(kbase + off, (x1 * cos1 - x2 * sin1).to(QKV.dtype.element_ty), mask=ok)
    tl.store(kbase + off + HALF, (x2 * cos2 + x1 * sin2).to(QKV.dtype.element_ty), mask=ok)
    v_src = k_src + KV_ROW
    tl.store(vbase + off, tl.load(v_src + off, mask=ok), mask=ok)
    tl.store(vbase + off + HALF, tl.load(v_src + off + HALF, mask=ok), mask=ok)
