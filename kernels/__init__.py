"""QCFuse kernels (installed as `qcfuse_kernels`).

Public operations, each with a plain PyTorch reference in `reference.py`:

    sparse_attention(q, k, v, q_pos, scale, window=None)      -> (R, H, D)
    attention_mass(q, k, q_pos, scale)                        -> (T,) fp32
    rerotate_scatter(k_pre, v, rows, k_new_pre, v_new, cos, sin, inv=None) -> (k_rot, v_out)
    inverse_rows(rows, T)                                      -> (T,) int32, reusable across layers
    apply_rope(x, cos, sin)                                    -> x rotated (T, Hx, D)
    rms_norm(x, weight, eps)                                   -> HF RMSNorm of x (..., N)
    silu_mul(gate, up)                                         -> silu(gate) * up
    decode_attention(q, ks, vs, lens, scale, window=None)      -> (B, H, D), each row its own cache
    kv_append(ks, vs, pos, k, v)                               -> each row's new key/value written
    add_rms_norm(x, d, weight, eps)                            -> (x + d, its RMSNorm), one pass
    silu_mul_packed(gu)                                        -> silu(gate) * up of one (rows, 2I) product
    quantize_fp8_rows(x) / dequantize_fp8_rows(q, scale)       -> e4m3 codes, one scale per row of D (fp8 KV)

`decode_attention_ptrs` / `kv_append_ptrs` / `rope_append_ptrs` (RoPE of a decode step's
packed q, k, v and the cache write, one pass) take the caches by address
(`cache_addresses`): the form a CUDA graph captures; `decode_splits` picks the attention's
key ranges for a batch size. With scale tables (`k_scale_ptrs`, `v_scale_ptrs`) they read
and write fp8 caches (float8_e4m3fn rows, one fp32 scale per token and KV head).

`ops.py` holds the launchers: they validate inputs and pick the Triton kernel or the
reference once per process (see `ops.backend()`), with an override for tests. The jitted
code lives in `triton_sparse_attention.py`, `triton_attention_mass.py`,
`triton_rerotate.py`, `triton_pointwise.py` and `triton_decode_attention.py` (imported
lazily: this package imports without triton).
"""

from qcfuse_kernels.ops import (
    add_rms_norm,
    apply_rope,
    attention_mass,
    backend,
    cache_addresses,
    decode_attention,
    decode_attention_ptrs,
    decode_splits,
    inverse_rows,
    kv_append,
    kv_append_ptrs,
    rerotate_scatter,
    rms_norm,
    rope_append_ptrs,
    set_backend,
    silu_mul,
    silu_mul_packed,
    sparse_attention,
)
from qcfuse_kernels.reference import dequantize_fp8_rows, quantize_fp8_rows, rotate_half

__all__ = [
    "add_rms_norm",
    "apply_rope",
    "attention_mass",
    "backend",
    "cache_addresses",
    "decode_attention",
    "decode_attention_ptrs",
    "decode_splits",
    "dequantize_fp8_rows",
    "inverse_rows",
    "kv_append",
    "kv_append_ptrs",
    "quantize_fp8_rows",
    "rerotate_scatter",
    "rms_norm",
    "rope_append_ptrs",
    "rotate_half",
    "set_backend",
    "silu_mul",
    "silu_mul_packed",
    "sparse_attention",
]
