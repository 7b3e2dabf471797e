"""Launchers for the QCFuse kernels.

Interim version: only the PyTorch reference backend exists; the Triton kernels and the
capability-based choice land with the kernels issue. The signatures here are the contract
the engine relies on.
"""

from __future__ import annotations

import torch

from qcfuse_kernels import reference as ref

_BACKENDS = ("torch",)
_backend: str | None = None


def backend() -> str:
    global _backend
    if _backend is None:
        _backend = "torch"
    return _backend


def set_backend(name: str | None) -> None:
    """Force a backend by name (tests); None re-detects on next use."""
    global _backend
    if name is not None and name not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; valid: {', '.join(_BACKENDS)}")
    _backend = name


def sparse_attention(q, k, v, q_pos, scale: float) -> torch.Tensor:
    return ref.sparse_attention_ref(q, k, v, q_pos, scale)


def attention_mass(q, k, q_pos, scale: float) -> torch.Tensor:
    return ref.attention_mass_ref(q, k, q_pos, scale)


def rerotate_scatter(k_pre, v, rows, k_new_pre, v_new, cos, sin):
    return ref.rerotate_scatter_ref(k_pre, v, rows, k_new_pre, v_new, cos, sin)
