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

fp8 caches (KV_FP8, `CacheConfig.kv_dtype="fp8"`): K and V rows are float8_e4m3fn, one fp32
scale per (token, KV head) beside them (KSP[b] / VSP[b] point at sequence b's (capacity, Hkv)
scales of one layer): a row of D values is amax / 448 times its e4m3 codes
(`reference.quantize_fp8_rows`). The writers quantize; the attention reads the codes, widens
them to the queries' dtype (exact) and applies each key's scale to its score and each value's
scale to its probability - the bytes read per key are half of bf16's plus 8 bytes of scales.

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
    KSP,  # KV_FP8: (B,) int64 address of sequence b's key scales of this layer, (capacity, Hkv) fp32
    VSP,  # KV_FP8: the same for values
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
    KV_FP8: tl.constexpr = False,  # the caches hold float8_e4m3fn rows with one fp32 scale each
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
    if KV_FP8:
        kbase = tl.multiple_of(tl.load(KP + b), 16).to(tl.pointer_type(tl.float8e4nv))
        vbase = tl.multiple_of(tl.load(VP + b), 16).to(tl.pointer_type(tl.float8e4nv))
        ksbase = tl.load(KSP + b).to(tl.pointer_type(tl.float32))
        vsbase = tl.load(VSP + b).to(tl.pointer_type(tl.float32))
    else:
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
        elif KV_FP8:  # e4m3 is exact in bf16 / fp16: the products run in the queries' dtype
            k = k.to(Q.dtype.element_ty)
            v = v.to(Q.dtype.element_ty)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_G, BLOCK_N)
        if KV_FP8:  # each key's scale; each value's scale folded into its probability
            sc_off = t * NUM_KV_HEADS + kvh
            qk = qk * tl.load(ksbase + sc_off, mask=t_ok, other=0.0)[None, :]
        qk = tl.where(t_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = p
        if KV_FP8:
            pv = p * tl.load(vsbase + sc_off, mask=t_ok, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v, input_precision=PRECISION)
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
def _fp8(x, ROUND: tl.constexpr):
    """fp32 -> float8_e4m3fn, to nearest. ROUND (Triton's interpreter, whose cast drops a
    rounding that carries into the exponent: 125.4 became 64): rounded here to an e4m3 value
    first, which the cast then keeps."""
    if ROUND:
        e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        step = tl.exp2((tl.maximum(e, -6) - 3).to(tl.float32))
        x = tl.floor(x / step + 0.5) * step
    return x.to(tl.float8e4nv)


@triton.jit
def _quantize_rows(x, scales, sc_off, sc_ok):
    """(heads, D) fp32 rows -> each divided by its scale (amax / 448, 1 for an all-zero row;
    clamped to +-448), the scales stored at scales + sc_off: `reference.quantize_fp8_rows`."""
    amax = tl.max(tl.abs(x), 1)
    sc = tl.where(amax > 0, amax / 448.0, 1.0)
    tl.store(scales + sc_off, sc, mask=sc_ok)
    return tl.clamp(x / sc[:, None], -448.0, 448.0)


@triton.jit
def kv_append_kernel(
    KP,  # (B,) int64 addresses as in decode_partial_kernel
    VP,
    KSP,  # KV_FP8: (B,) int64 addresses of the scales, as in decode_partial_kernel
    VSP,
    POS,  # (B,) int: where sequence b's new key and value go
    K_NEW,  # (B, Hkv * D) contiguous, the model's dtype
    V_NEW,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
    ROUND_FP8: tl.constexpr,  # the interpreter: `_fp8`
):
    b = tl.program_id(0)
    pos = tl.load(POS + b).to(tl.int64)
    hk = tl.arange(0, BLOCK_H)
    dd = tl.arange(0, BLOCK_D)
    ok = (hk < NUM_KV_HEADS)[:, None] & (dd < HEAD_DIM)[None, :]
    off = hk[:, None] * HEAD_DIM + dd[None, :]
    ROW = NUM_KV_HEADS * HEAD_DIM
    k = tl.load(K_NEW + b * ROW + off, mask=ok, other=0.0)
    v = tl.load(V_NEW + b * ROW + off, mask=ok, other=0.0)
    if KV_FP8:
        ptr_ty = tl.pointer_type(tl.float8e4nv)
    else:
        ptr_ty = tl.pointer_type(K_NEW.dtype.element_ty)
    kbase = tl.load(KP + b).to(ptr_ty) + pos * ROW
    vbase = tl.load(VP + b).to(ptr_ty) + pos * ROW
    if KV_FP8:
        sc_off = pos * NUM_KV_HEADS + hk
        sc_ok = hk < NUM_KV_HEADS
        kq = _quantize_rows(k.to(tl.float32), tl.load(KSP + b).to(tl.pointer_type(tl.float32)), sc_off, sc_ok)
        vq = _quantize_rows(v.to(tl.float32), tl.load(VSP + b).to(tl.pointer_type(tl.float32)), sc_off, sc_ok)
        tl.store(kbase + off, _fp8(kq, ROUND_FP8), mask=ok)
        tl.store(vbase + off, _fp8(vq, ROUND_FP8), mask=ok)
    else:
        tl.store(kbase + off, k, mask=ok)
        tl.store(vbase + off, v, mask=ok)


@triton.jit
def _quantize_halves(x1, x2, scales, sc_off, sc_ok):
    """`_quantize_rows` of rows given as their two halves (heads, half) each."""
    amax = tl.maximum(tl.max(tl.abs(x1), 1), tl.max(tl.abs(x2), 1))
    sc = tl.where(amax > 0, amax / 448.0, 1.0)
    tl.store(scales + sc_off, sc, mask=sc_ok)
    return tl.clamp(x1 / sc[:, None], -448.0, 448.0), tl.clamp(x2 / sc[:, None], -448.0, 448.0)


@triton.jit
def rope_append_kernel(
    QKV,  # (B, (H + 2 * Hkv) * D) contiguous: each row's q, k, v projections, pre-RoPE
    COS,  # (B, D) fp32
    SIN,
    KP,  # (B,) int64 addresses as in decode_partial_kernel
    VP,
    KSP,  # KV_FP8: (B,) int64 addresses of the scales, as in decode_partial_kernel
    VSP,
    POS,  # (B,) int: where sequence b's new key and value go
    Q_OUT,  # (B, H, D) rotated queries
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    KV_FP8: tl.constexpr,
    ROUND_FP8: tl.constexpr,  # the interpreter: `_fp8`
):
    """Grid (B,): RoPE of row b's queries and key (rope_kernel's arithmetic), the rotated key
    and the value written at the row's position of its caches (kv_append_kernel's; KV_FP8:
    the rotated key rounded to the model's dtype first, as the reference rotates then
    quantizes)."""
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

    hk = tl.arange(0, BLOCK_HKV)
    ok = (hk < NUM_KV_HEADS)[:, None] & c_ok[None, :]
    off = hk[:, None] * HEAD_DIM + offs_c[None, :]
    k_src = src + NUM_HEADS * HEAD_DIM
    x1 = tl.load(k_src + off, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(k_src + off + HALF, mask=ok, other=0.0).to(tl.float32)
    k1 = x1 * cos1 - x2 * sin1
    k2 = x2 * cos2 + x1 * sin2
    v_src = k_src + KV_ROW
    if KV_FP8:
        kbase = tl.load(KP + b).to(tl.pointer_type(tl.float8e4nv)) + pos * KV_ROW
        vbase = tl.load(VP + b).to(tl.pointer_type(tl.float8e4nv)) + pos * KV_ROW
        sc_off = pos * NUM_KV_HEADS + hk
        sc_ok = hk < NUM_KV_HEADS
        k1 = k1.to(QKV.dtype.element_ty).to(tl.float32)
        k2 = k2.to(QKV.dtype.element_ty).to(tl.float32)
        k1, k2 = _quantize_halves(k1, k2, tl.load(KSP + b).to(tl.pointer_type(tl.float32)), sc_off, sc_ok)
        v1 = tl.load(v_src + off, mask=ok, other=0.0).to(tl.float32)
        v2 = tl.load(v_src + off + HALF, mask=ok, other=0.0).to(tl.float32)
        v1, v2 = _quantize_halves(v1, v2, tl.load(VSP + b).to(tl.pointer_type(tl.float32)), sc_off, sc_ok)
        tl.store(kbase + off, _fp8(k1, ROUND_FP8), mask=ok)
        tl.store(kbase + off + HALF, _fp8(k2, ROUND_FP8), mask=ok)
        tl.store(vbase + off, _fp8(v1, ROUND_FP8), mask=ok)
        tl.store(vbase + off + HALF, _fp8(v2, ROUND_FP8), mask=ok)
    else:
        kbase = tl.load(KP + b).to(tl.pointer_type(QKV.dtype.element_ty)) + pos * KV_ROW
        vbase = tl.load(VP + b).to(tl.pointer_type(QKV.dtype.element_ty)) + pos * KV_ROW
        tl.store(kbase + off, k1.to(QKV.dtype.element_ty), mask=ok)
        tl.store(kbase + off + HALF, k2.to(QKV.dtype.element_ty), mask=ok)
        tl.store(vbase + off, tl.load(v_src + off, mask=ok), mask=ok)
        tl.store(vbase + off + HALF, tl.load(v_src + off + HALF, mask=ok), mask=ok)
