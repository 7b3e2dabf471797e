"""Plain PyTorch references for every QCFuse kernel.

These are the oracles the Triton kernels are tested against and the path the engine takes
on a plain CPU. They favour obviousness over speed, but avoid dense (R x T) masks where a
simple loop-free formulation exists.

Conventions (token-major, batch 1):
    q      (R, H, D)    query rows, already rotated to their absolute positions
    k, v   (T, Hkv, D)  the fused prompt's keys (rotated) and values; key j sits at position j
    q_pos  (R,)  int64  absolute position of each query row; key j is visible iff j <= q_pos
    H % Hkv == 0 (grouped-query attention: query head h reads KV head h // (H // Hkv))

RoPE follows HF transformers' `rotate_half` convention: cos/sin are (T, D) with the two
halves of the head dim repeated, and rope(x) = x * cos + rotate_half(x) * sin.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, Hx, D), cos/sin (T, D) -> rotated x (T, Hx, D), computed in fp32, returned in x's dtype."""
    xf = x.float()
    c = cos.float()[:, None, :]
    s = sin.float()[:, None, :]
    return (xf * c + rotate_half(xf) * s).to(x.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim exactly as HF's Llama/Mistral/Qwen RMSNorm computes it:
    fp32 statistics, normalised values rounded to x's dtype, then scaled by `weight`."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm: h = x + d, (h, rms_norm_ref(h))."""
    h = x + d
    return h, rms_norm_ref(h, weight, eps)


def silu_mul_packed_ref(gu: torch.Tensor) -> torch.Tensor:
    """gu (..., 2I) holding gate then up -> silu_mul_ref(gate, up) (..., I)."""
    gate, up = gu.chunk(2, dim=-1)
    return silu_mul_ref(gate, up)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, the gated MLP's activation (HF: act_fn(gate_proj(x)) * up_proj(x))."""
    return torch.nn.functional.silu(gate) * up


def _visible(T: int, q_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """(R, T) bool: key j visible to the row at q_pos: j <= q_pos, and j > q_pos - window."""
    j = torch.arange(T, device=q_pos.device)[None, :]
    p = q_pos[:, None]
    visible = j <= p
    if window is not None:
        visible &= j > p - window
    return visible


def _expand_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    # (T, Hkv, D) -> (T, Hkv * n_rep, D), head h reading KV head h // n_rep
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def sparse_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Location-aware attention of scattered rows over the whole prompt.

    q (R, H, D), k/v (T, Hkv, D), q_pos (R,) -> out (R, H, D) in q's dtype.
    Row i sees keys 0..q_pos[i] (with a sliding `window` W: q_pos[i] - W < j <= q_pos[i]);
    fp32 softmax and accumulation.
    """
    R, H, D = q.shape
    T, Hkv, _ = k.shape
    n_rep = H // Hkv
    kf = _expand_kv(k, n_rep).float().transpose(0, 1)  # (H, T, D)
    vf = _expand_kv(v, n_rep).float().transpose(0, 1)  # (H, T, D)
    qf = q.float().transpose(0, 1)  # (H, R, D)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # (H, R, T)
    visible = _visible(T, q_pos.to(q.device), window)  # (R, T)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vf)  # (H, R, D)
    return out.transpose(0, 1).to(q.dtype).contiguous()


def attention_mass_ref(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention mass each key receives from probe queries, averaged over heads and queries.

    q (R, H, D), k (T, Hkv, D), q_pos (R,) -> mass (T,) fp32.
    Softmax of each (row, head) runs over the keys the row can see (j <= q_pos); the mass of
    key j is the mean over rows and heads of its probability (0 where it is not visible).
    sum(mass) == 1 up to rounding.
    """
    R, H, D = q.shape
    T, Hkv, _ = k.shape
    kf = _expand_kv(k, H // Hkv).float().transpose(0, 1)  # (H, T, D)
    qf = q.float().transpose(0, 1)  # (H, R, D)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # (H, R, T)
    visible = torch.arange(T, device=q.device)[None, :] <= q_pos.to(q.device)[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return probs.mean(dim=(0, 1))


def rerotate_scatter_ref(
    k_pre: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    k_new_pre: torch.Tensor,
    v_new: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write fresh rows into a layer's cache and rotate every key to its position.

    k_pre, v (T, Hkv, D) cached pre-RoPE keys and values; rows (R,) int64 unique positions;
    k_new_pre, v_new (R, Hkv, D); cos/sin (T, D) for positions 0..T-1.
    Returns (k_rot, v_out), both (T, Hkv, D) new tensors in k_pre's / v's dtype:
        k_rot[j] = rope(k_new_pre[i] if j == rows[i] else k_pre[j], pos=j)
        v_out[j] = v_new[i]      if j == rows[i] else v[j]
    """
    k_all = k_pre.clone()
    v_out = v.clone()
    if rows.numel():
        k_all[rows] = k_new_pre.to(k_all.dtype)
        v_out[rows] = v_new.to(v_out.dtype)
    return apply_rope(k_all, cos, sin), v_out


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> (q (..., D) float8_e4m3fn, scale (...) fp32): one scale per row of D
    (a token's key or value of one KV head), amax / 448, 1.0 where the row is all zero; the
    row decodes as q * scale (`dequantize_fp8_rows`), each element within |x| / 16 plus
    scale / 1024 (e4m3: 3 mantissa bits, subnormal step 2^-9)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q (..., D) float8_e4m3fn, scale (...) -> (..., D) in `dtype`."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def decode_attention_ref(
    q: torch.Tensor,
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    k_scales: Sequence[torch.Tensor] | None = None,
    v_scales: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """One decode step's attention, each sequence over its own cache.

    q (B, H, D); ks[b], vs[b] (capacity_b, Hkv, D); lens (B,): sequence b sees keys
    [lo, lens[b]) of its cache, lo = max(0, lens[b] - window) on a sliding layer, else 0
    -> (B, H, D) in q's dtype; fp32 softmax and accumulation. fp8 caches: k_scales[b],
    v_scales[b] (capacity_b, Hkv) the rows' scales (`quantize_fp8_rows`)."""
    out = torch.empty_like(q)
    for b, n in enumerate(lens.tolist()):
        lo = 0 if window is None else max(0, n - window)
        k, v = ks[b][lo:n].float(), vs[b][lo:n].float()  # (n, Hkv, D)
        if k_scales is not None and v_scales is not None:
            k, v = k * k_scales[b][lo:n, :, None].float(), v * v_scales[b][lo:n, :, None].float()
        Hkv, H = k.shape[1], q.shape[1]
        qg = q[b].float().reshape(Hkv, H // Hkv, -1)  # query heads grouped by KV head
        probs = torch.softmax(torch.bmm(qg, k.permute(1, 2, 0)) * scale, dim=-1)  # (Hkv, G, n)
        out[b] = torch.bmm(probs, v.transpose(0, 1)).reshape(H, -1).to(q.dtype)
    return out


def kv_append_ref(
    ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """ks[b][pos[b]] = k[b] and vs[b][pos[b]] = v[b] for each sequence b (k, v (B, Hkv, D))."""
    for b, p in enumerate(pos.tolist()):
        ks[b][p] = k[b]
        vs[b][p] = v[b]


def rope_append_ref(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    pos: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """qkv (B, (H + 2 Hkv) D) each row's q, k, v projections, cos/sin (B, D): the rotated
    queries (B, H, D); row b's rotated key and its value written at pos[b] of ks[b], vs[b]."""
    B = qkv.shape[0]
    D = cos.shape[-1]
    q, k, v = qkv.view(B, -1, D).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    kv_append_ref(ks, vs, pos, apply_rope(k, cos, sin), v)
    return apply_rope(q, cos, sin)
