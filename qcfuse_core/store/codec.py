"""Storage dtypes and the fp8-e4m3 per-head codec (pure tensor math, no I/O).

A chunk's layer l is stored as one tensor `kv` (2, T, Hkv, D): kv[0] = K (pre-RoPE), kv[1] = V.
Storage names and what they keep:

    auto   the chunk's own dtype            bit-exact
    bf16 / fp16 / fp32                      bit-exact when the chunk already has that dtype
    fp8    float8_e4m3fn + a float32 scale per (K|V, KV head) of each layer: half of bf16

fp8 error bound (e4m3 has 3 mantissa bits, max 448, subnormal step 2^-9): with
s = amax(|x| over T, D of one head) / 448, every element decodes within

    |x - decode(x)| <= |x| / 16 + s / 1024        (before the final cast to the chunk dtype)

The test suite checks this bound (plus one rounding of the output dtype).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn

STORAGE_NAMES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
}

# safetensors dtype strings, both directions
ST_DTYPE: dict[torch.dtype, str] = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int64: "I64",
}
DTYPE_FROM_ST: dict[str, torch.dtype] = {v: k for k, v in ST_DTYPE.items()}

# short names used in the manifest and file metadata
DTYPE_NAME: dict[torch.dtype, str] = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8",
}
DTYPE_FROM_NAME: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAME.items()}


def check_storage_name(name: str) -> str:
    if name not in STORAGE_NAMES:
        raise ValueError(f"unknown storage dtype {name!r}; valid: {sorted(STORAGE_NAMES)}")
    return name


def stored_dtype(storage: str, src_dtype: torch.dtype) -> torch.dtype:
    """The dtype a chunk of `src_dtype` is written in under storage name `storage`."""
    check_storage_name(storage)
    if src_dtype not in DTYPE_NAME or src_dtype == torch.float8_e4m3fn:
        raise TypeError(f"chunk dtype must be one of bf16/fp16/fp32, got {src_dtype}")
    target = STORAGE_NAMES[storage]
    return src_dtype if target is None else target


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == torch.float8_e4m3fn


def quantize_fp8(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv (2, T, Hkv, D) float -> (q (2, T, Hkv, D) float8_e4m3fn, scale (2, Hkv) float32).

    One scale per (K|V, head): amax over tokens and dims / 448, 1.0 where the head is all zero.
    """
    x = kv.float()
    amax = x.abs().amax(dim=(1, 3))  # (2, Hkv)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.contiguous()


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q (2, T, Hkv, D) fp8, scale (2, Hkv) -> (2, T, Hkv, D) in `dtype`."""
    return (q.float() * scale.to(q.device)[:, None, :, None]).to(dtype)


def encode_layer(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """k, v (T, Hkv, D) -> (kv (2, T, Hkv, D) in `dtype`, scale (2, Hkv) or None)."""
    kv = torch.stack([k, v])  # (2, T, Hkv, D)
    if is_fp8(dtype):
        return quantize_fp8(kv)
    return kv.to(dtype), None


def decode_layer(kv: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored (2, T, Hkv, D) -> (2, T, Hkv, D) in `dtype`; always a new tensor (callers own it)."""
    if scale is not None:
        return dequantize_fp8(kv, scale, dtype)
    return kv.to(dtype, copy=True)
