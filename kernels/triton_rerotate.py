"""Triton kernel: scatter fresh rows into a layer's cache and rotate every key, in one pass
(jitted code only; launcher in `ops.py`).

A program takes BLOCK_T tokens with all their KV heads, as a (BLOCK_T, BLOCK_H, half-D)
tile, so each token's cos/sin row is read once and broadcast over its heads. The head dim
is split into halves for rotate_half:

    x = [x1 | x2]  (D/2 each)       rope(x) = [x1*cos1 - x2*sin1 | x2*cos2 + x1*sin2]

Source of token t (one read, no intermediate scattered copy):

    inv[t] = -1      ->  k_pre[t], v[t]            (cached row)
    inv[t] = i >= 0  ->  k_new_pre[i], v_new[i]    (fresh row, rows[i] == t)

Invariants the launcher guarantees: all tensors contiguous; inv (T,) int32 with entries in
[-1, R); cos/sin (T, D); HALF = D // 2; BLOCK_HALF and BLOCK_H the next powers of two
>= HALF and >= Hkv.
Rotation is computed in fp32; outputs are in k_pre's / v's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rerotate_scatter_kernel(
    K_PRE,
    V,
    K_NEW,
    V_NEW,
    INV,
    COS,
    SIN,
    K_OUT,
    V_OUT,  # (T,Hkv,D) x2, (R,Hkv,D) x2, (T,), (T,D) x2, (T,Hkv,D) x2
    T,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK_T),). Every output element is written exactly once."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BT,)
    hd = tl.arange(0, BLOCK_H)  # (BH,)
    offs_c = tl.arange(0, BLOCK_HALF)  # (BC,) column inside one half
    t_ok = tok < T
    c_ok = offs_c < HALF
    src = tl.load(INV + tok, mask=t_ok, other=-1)  # (BT,)
    is_new = (src >= 0)[:, None, None]  # (BT, 1, 1)
    ok = t_ok[:, None, None] & (hd < NUM_KV_HEADS)[None, :, None] & c_ok[None, None, :]  # (BT, BH, BC)
    new_ok = ok & is_new
    old_ok = ok & (src < 0)[:, None, None]

    old_row = tok[:, None] * NUM_KV_HEADS + hd[None, :]  # (BT, BH) flat row t*Hkv + h
    new_row = src[:, None] * NUM_KV_HEADS + hd[None, :]
    old_off = old_row[:, :, None] * HEAD_DIM + offs_c[None, None, :]  # first half of each row
    new_off = new_row[:, :, None] * HEAD_DIM + offs_c[None, None, :]
    trig_off = tok[:, None] * HEAD_DIM + offs_c[None, :]  # (BT, BC)
    trig_ok = t_ok[:, None] & c_ok[None, :]

    # keys: gather, rotate in fp32 (cos/sin read once per token, broadcast over heads)
    x1 = tl.where(
        is_new,
        tl.load(K_NEW + new_off, mask=new_ok, other=0.0).to(tl.float32),
        tl.load(K_PRE + old_off, mask=old_ok, other=0.0).to(tl.float32),
    )
    x2 = tl.where(
        is_new,
        tl.load(K_NEW + new_off + HALF, mask=new_ok, other=0.0).to(tl.float32),
        tl.load(K_PRE + old_off + HALF, mask=old_ok, other=0.0).to(tl.float32),
    )
    cos1 = tl.load(COS + trig_off, mask=trig_ok, other=0.0).to(tl.float32)[:, None, :]
    cos2 = tl.load(COS + trig_off + HALF, mask=trig_ok, other=0.0).to(tl.float32)[:, None, :]
    sin1 = tl.load(SIN + trig_off, mask=trig_ok, other=0.0).to(tl.float32)[:, None, :]
    sin2 = tl.load(SIN + trig_off + HALF, mask=trig_ok, other=0.0).to(tl.float32)[:, None, :]
    y1 = x1 * cos1 - x2 * sin1
    y2 = x2 * cos2 + x1 * sin2
    tl.store(K_OUT + old_off, y1.to(K_OUT.dtype.element_ty), mask=ok)
    tl.store(K_OUT + old_off + HALF, y2.to(K_OUT.dtype.element_ty), mask=ok)

    # values: gather and copy (same dtype in and out: bit-exact, no arithmetic)
    for half in tl.static_range(2):
        v_new = tl.load(V_NEW + new_off + half * HALF, mask=new_ok, other=0.0)
        v_old = tl.load(V + old_off + half * HALF, mask=old_ok, other=0.0)
        tl.store(V_OUT + old_off + half * HALF, tl.where(is_new, v_new, v_old), mask=ok)
