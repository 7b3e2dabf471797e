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

`decode_attention_ptrs` / `kv_append_ptrs` take the caches by address (`cache_addresses`):
the form a CUDA graph captures.

`ops.py` holds the launchers: they validate inputs and pick the Triton kernel or the
reference once per process (see `ops.backend()`), with an override for tests. The jitted
code lives in `triton_sparse_attention.py`, `triton_attention_mass.py`,
`triton_rerotate.py`, `triton_pointwise.py` and `triton_decode_attention.py` (imported
lazily: this package imports without triton).
"""

from qcfuse_kernels.ops import (
    apply_rope,
    attention_mass,
    backend,
    cache_addresses,
    decode_attention,
    decode_attention_ptrs,
    inverse_rows,
    kv_append,
    kv_append_ptrs,
    rerotate_scatter,
    rms_norm,
    set_backend,
    silu_mul,
    sparse_attention,
)
from qcfuse_kernels.reference import rotate_half

__all__ = [
    "apply_rope",
    "attention_mass",
    "backend",
    "cache_addresses",
    "decode_attention",
    "decode_attention_ptrs",
    "inverse_rows",
    "kv_append",
    "kv_append_ptrs",
    "rerotate_scatter",
    "rms_norm",
    "rotate_half",
    "set_backend",
    "silu_mul",
    "sparse_attention",
]
