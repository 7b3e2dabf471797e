"""Launchers for the QCFuse kernels: validate, allocate, pick the grid, dispatch.

Backend, chosen once per process by capability (`backend()`), overridable for tests
(`set_backend`):

    "triton"     triton importable and CUDA available: Triton kernels on CUDA tensors
    "interpret"  triton was imported with TRITON_INTERPRET=1: Triton kernels run by the
                 interpreter on CPU tensors (tests; slow)
    "torch"      otherwise: the PyTorch references in `reference.py`

A call whose tensors live on a device the chosen backend does not serve (CPU tensors
under "triton", CUDA tensors under "interpret") runs the reference. Validation is the same
on every backend, so a call that fails on the GPU fails on the CPU too.

Value checks that would need a device->host sync (positions inside [0, T), unique rows)
run for CPU tensors only; on CUDA they are preconditions.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from dataclasses import dataclass

import torch

from qcfuse_kernels import reference as ref

log = logging.getLogger(__name__)

BACKENDS = ("triton", "interpret", "torch")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
_LOG2E = 1.4426950408889634

_backend: str | None = None


# ---------------------------------------------------------------- backend choice


@functools.lru_cache(maxsize=1)
def _triton_mode() -> str | None:
    """'compiled', 'interpreted' (TRITON_INTERPRET=1 at triton import) or None (no triton).

    Asks the decorated kernel itself: triton decides at decoration time whether a
    @triton.jit function is compiled or interpreted, so this is the ground truth.
    """
    try:
        from qcfuse_kernels import triton_sparse_attention as sa
    except ImportError:
        return None
    if type(sa.sparse_attention_kernel).__name__ != "InterpretedFunction":
        return "compiled"
    _serialise_interpreter()
    return "interpreted"


_INTERPRETER_LOCK = threading.RLock()


def _serialise_interpreter() -> None:
    """Run interpreted launches one at a time. For the length of each launch the interpreter
    swaps triton.language's functions, process-wide, for its own: a launch from another
    thread (the engine's scheduler, a background build) that ends meanwhile swaps them back
    under this one, which then fails ("Did you forget to add @triton.jit?")."""
    from triton.runtime import interpreter

    call = interpreter.GridExecutor.__call__
    if getattr(call, "_qcfuse_serialised", False):
        return

    def serialised(self, *args, **kwargs):
        with _INTERPRETER_LOCK:
            return call(self, *args, **kwargs)

    serialised._qcfuse_serialised = True  # type: ignore[attr-defined]
    interpreter.GridExecutor.__call__ = serialised


def _detect() -> str:
    mode = _triton_mode()
    if mode == "interpreted":
        return "interpret"
    if mode == "compiled" and torch.cuda.is_available():
        return "triton"
    return "torch"


def backend() -> str:
    """The backend in use: 'triton', 'interpret' or 'torch' (detected once, then cached)."""
    global _backend
    if _backend is None:
        _backend = _detect()
        log.info("qcfuse_kernels backend: %s", _backend)
    return _backend


def set_backend(name: str | None) -> None:
    """Force a backend by name (tests); None re-detects on next use.

    'triton' needs triton compiled mode and CUDA; 'interpret' needs triton imported with
    TRITON_INTERPRET=1 (set it before anything imports triton, e.g. in tests/conftest.py).
    """
    global _backend
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; valid: {', '.join(BACKENDS)}")
    if name == "interpret" and _triton_mode() != "interpreted":
        raise ValueError("backend 'interpret' needs TRITON_INTERPRET=1 set before triton is first imported")
    if name == "triton" and not (_triton_mode() == "compiled" and torch.cuda.is_available()):
        raise ValueError("backend 'triton' needs triton (not in interpreter mode) and a CUDA device")
    _backend = name


def _use_kernels(device: torch.device) -> bool:
    b = backend()
    return (b == "triton" and device.type == "cuda") or (b == "interpret" and device.type == "cpu")


# ---------------------------------------------------------------- validation


def _check_tensor(name: str, x, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        valid = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {x.dtype}; valid: {valid}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def _check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {n: t.device for n, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        raise ValueError(f"all tensors must be on one device, got {devices}")
    return first


def _check_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float, got {scale!r}")
    return float(scale)


def _check_attention_inputs(q, k, q_pos, scale) -> tuple[int, int, int, int, int]:
    """Shared checks of sparse_attention / attention_mass -> (R, H, D, T, Hkv)."""
    _check_tensor("q", q, 3, FLOAT_DTYPES)
    _check_tensor("k", k, 3, FLOAT_DTYPES)
    _check_tensor("q_pos", q_pos, 1, INDEX_DTYPES)
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {k.dtype} but q has {q.dtype}; they must match")
    R, H, D = q.shape
    T, Hkv, Dk = k.shape
    if Dk != D:
        raise ValueError(f"head dim mismatch: q {tuple(q.shape)} vs k {tuple(k.shape)}")
    if T == 0 or Hkv == 0 or H == 0 or D == 0:
        raise ValueError(f"empty attention: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of KV heads ({Hkv})")
    if q_pos.shape[0] != R:
        raise ValueError(f"q_pos has {q_pos.shape[0]} entries for {R} query rows")
    _check_scale(scale)
    if q_pos.device.type == "cpu" and R:
        lo, hi = int(q_pos.min()), int(q_pos.max())
        if lo < 0 or hi >= T:
            raise ValueError(f"q_pos must lie in [0, {T}), got range [{lo}, {hi}]")
    return R, H, D, T, Hkv


def _check_sparse_inputs(q, k, v, q_pos, scale, window) -> tuple[int, int, int, int, int, int | None, torch.device]:
    """Checks of sparse_attention -> (R, H, D, T, Hkv, window, device); window becomes None
    when it is at least T (no row loses a key to it)."""
    R, H, D, T, Hkv = _check_attention_inputs(q, k, q_pos, scale)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    _check_tensor("v", v, 3, FLOAT_DTYPES)
    if v.dtype != q.dtype:
        raise TypeError(f"v has dtype {v.dtype} but q has {q.dtype}; they must match")
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    device = _check_same_device(q=q, k=k, v=v, q_pos=q_pos)
    if window is not None and window >= T:
        window = None  # no row can see a key outside its window
    return R, H, D, T, Hkv, window, device


# ---------------------------------------------------------------- launch configs


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # query vectors per tile (rows x GQA group)
    block_n: int  # keys per tile
    num_warps: int = 4
    num_stages: int = 2


def _block_d(D: int) -> int:
    return max(16, _next_pow2(D))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _attention_configs(group: int, block_d: int, interpret: bool, fp32: bool) -> list[LaunchConfig]:
    """Candidate tiles for the sparse attention kernel, heuristic choice first.

    Interpreter: one small tile (several tiles per test, fast numpy ops). CUDA (H200):
    FlashAttention-2-style tiles sized so K/V stages fit shared memory; the autotuner
    times them once per (GROUP, D, dtype) and drops any that fail to compile. (Checked by
    compiling for sm_90a: the bf16 D=128 tiles use wgmma + cp.async pipelining, no spills.)
    fp32 inputs (exact "ieee" products, no tensor cores: a correctness path, not a fast
    one) get one small tile that keeps register spills low.
    """
    min_m = max(16, _next_pow2(group))
    if interpret:
        return [LaunchConfig(min_m, 32)]
    if fp32:
        return [LaunchConfig(min_m, 32 if block_d <= 128 else 16, 4, 2)]
    if block_d <= 64:
        cands = [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4)]
    elif block_d <= 128:
        cands = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3)]
    elif block_d <= 256:
        cands = [(64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2)]
    else:
        cands = [(32, 32, 4, 1), (16, 16, 4, 1)]
    cfgs = [LaunchConfig(*c) for c in cands if c[0] >= min_m]
    return cfgs or [LaunchConfig(min_m, 32 if block_d <= 128 else 16, 4, 1)]


def _lse_splits(programs: int, T: int, block_n: int, interpret: bool, sms: int = 132) -> int:
    """Key ranges the log-sum-exp pass splits into: enough programs for every SM (`sms`,
    132 on an H200) about four times over, each range at least 8 key blocks. Under the
    interpreter: 2 when there are at least 2 blocks, so CPU tests run the split path."""
    blocks = _cdiv(T, block_n)
    if interpret:
        return 2 if blocks >= 2 else 1
    want = _cdiv(4 * sms, max(1, programs))
    return max(1, min(want, blocks // 8))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 when it is not one)."""
    if device.type != "cuda":
        return 132
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _mass_config(group: int, block_d: int, interpret: bool) -> LaunchConfig:
    min_m = max(16, _next_pow2(group))
    if interpret:
        return LaunchConfig(min_m, 32)
    return LaunchConfig(max(64, min_m), 64 if block_d <= 128 else 32, 4, 2)


@functools.lru_cache(maxsize=None)
def _tuned_attention_kernel(group: int, block_d: int, interpret: bool, fp32: bool):
    """The sparse attention kernel wrapped in triton.autotune over `_attention_configs`.

    Under the interpreter the list has exactly one config (autotune with several fails
    there), so the same launch path runs in CPU tests.
    """
    import triton

    from qcfuse_kernels import triton_sparse_attention as sa

    configs = [
        triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": c.block_n}, num_warps=c.num_warps, num_stages=c.num_stages)
        for c in _attention_configs(group, block_d, interpret, fp32)
    ]
    return triton.autotune(configs=configs, key=["NUM_KV_HEADS", "GROUP", "HEAD_DIM", "WINDOWED"])(
        sa.sparse_attention_kernel
    )


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products (no TF32) so results match the fp32 reference;
    # fp16/bf16: "tf32" is triton's default and means plain tensor-core products.
    return "ieee" if dtype == torch.float32 else "tf32"


# ---------------------------------------------------------------- public ops


def sparse_attention(q, k, v, q_pos, scale: float, window: int | None = None) -> torch.Tensor:
    """Location-aware attention of scattered rows over the whole prompt.

    q (R, H, D), k/v (T, Hkv, D), q_pos (R,) int32/int64 with 0 <= q_pos < T -> (R, H, D)
    in q's dtype. Row i sees keys 0..q_pos[i] - with a sliding `window` W (a sliding-window
    layer), only keys q_pos[i] - W < j <= q_pos[i]; fp32 softmax and accumulation; no dense
    mask. Any row order is correct; pass rows sorted by ascending position (the engine's
    recompute set is) so each tile skips the keys beyond its last row and, with a window,
    the key blocks before its first row's window.
    """
    R, H, D, T, Hkv, window, device = _check_sparse_inputs(q, k, v, q_pos, scale, window)
    if not _use_kernels(device):
        return ref.sparse_attention_ref(q, k, v, q_pos, scale, window)

    out = torch.empty_like(q)  # (R, H, D)
    if R == 0:
        return out
    group = H // Hkv
    block_d = _block_d(D)
    interpret = backend() == "interpret"
    kernel = _tuned_attention_kernel(group, block_d, interpret, q.dtype == torch.float32)

    def grid(meta):
        return (_cdiv(R, meta["BLOCK_M"] // group), Hkv)

    kernel[grid](
        q,
        k,
        v,
        q_pos,
        out,
        R,
        T,
        float(scale) * _LOG2E,
        window or 0,
        NUM_KV_HEADS=Hkv,
        GROUP=group,
        HEAD_DIM=D,
        BLOCK_D=block_d,
        UPCAST=interpret and q.dtype == torch.bfloat16,
        PRECISION=_dot_precision(q.dtype),
        WINDOWED=window is not None,
    )
    return out


def attention_mass(q, k, q_pos, scale: float) -> torch.Tensor:
    """Attention mass each key receives from probe queries, averaged over heads and rows.

    q (R, H, D), k (T, Hkv, D), q_pos (R,) with 0 <= q_pos < T, R >= 1 -> mass (T,) fp32;
    mass[j] = mean over (row, head) of softmax_j, 0 for keys no row sees; sum == 1.
    Two passes (log-sum-exp, then mass); the (R, H, T) probabilities are never stored.
    """
    R, H, D, T, Hkv = _check_attention_inputs(q, k, q_pos, scale)
    if R == 0:
        raise ValueError("attention_mass needs at least one query row")
    device = _check_same_device(q=q, k=k, q_pos=q_pos)
    if not _use_kernels(device):
        return _attention_mass_torch(q, k, q_pos, scale)

    from qcfuse_kernels.triton_attention_mass import lse_kernel, mass_kernel

    group = H // Hkv
    block_d = _block_d(D)
    interpret = backend() == "interpret"
    cfg = _mass_config(group, block_d, interpret)
    lse = torch.empty((R, H), device=device, dtype=torch.float32)  # base-2 log-sum-exp
    part = torch.empty((Hkv, T), device=device, dtype=torch.float32)  # mass per KV head
    common = dict(
        NUM_KV_HEADS=Hkv,
        GROUP=group,
        HEAD_DIM=D,
        BLOCK_D=block_d,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        UPCAST=interpret and q.dtype == torch.bfloat16,
        PRECISION=_dot_precision(q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    qk_scale = float(scale) * _LOG2E
    tiles = _cdiv(R, cfg.block_m // group)
    splits = _lse_splits(tiles * Hkv, T, cfg.block_n, interpret, _sm_count(device))
    split_n = _cdiv(_cdiv(T, splits), cfg.block_n) * cfg.block_n
    splits = _cdiv(T, split_n)
    if splits > 1:  # partial (max, sum) per key range, combined here: lse = M + log2 sum l 2^(m - M)
        m_part = torch.empty((splits, R, H), device=device, dtype=torch.float32)
        l_part = torch.empty_like(m_part)
        lse_kernel[(tiles, Hkv, splits)](
            q, k, q_pos, lse, m_part, l_part, R, T, qk_scale, split_n, SPLIT=True, **common
        )
        top = m_part.amax(0)  # finite: every row sees key 0, in split 0
        lse = torch.log2((l_part * torch.exp2(m_part - top)).sum(0)).add_(top)
    else:
        lse_kernel[(tiles, Hkv, 1)](q, k, q_pos, lse, lse, lse, R, T, qk_scale, T, SPLIT=False, **common)
    mass_kernel[(_cdiv(T, cfg.block_n), Hkv)](q, k, q_pos, lse, part, R, T, qk_scale, **common)
    return part.sum(0).div_(R * H)  # (T,)


def _attention_mass_torch(q, k, q_pos, scale: float) -> torch.Tensor:
    """`reference.attention_mass_ref` with the same operations in the same order, except that
    only the key columns after the first row's position are masked (every earlier key is
    visible to every row), in place: the probe's rows come after the whole context, so the
    mask touches S of N + S columns instead of all of them (bitwise equal to the reference;
    tests/test_kernels.py)."""
    R, H, _ = q.shape
    T, Hkv, _ = k.shape
    kf = ref._expand_kv(k, H // Hkv).float().transpose(0, 1)  # (H, T, D)
    qf = q.float().transpose(0, 1)  # (H, R, D)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # (H, R, T)
    p = q_pos.to(q.device)
    first = int(p.min()) + 1  # keys before this column are visible to every row
    if first < T:
        visible = torch.arange(first, T, device=q.device)[None, :] <= p[:, None]  # (R, T - first)
        scores[:, :, first:].masked_fill_(~visible[None], float("-inf"))
    return torch.softmax(scores, dim=-1).mean(dim=(0, 1))


def inverse_rows(rows: torch.Tensor, T: int) -> torch.Tensor:
    """(T,) int32 on rows' device: inv[rows[i]] = i, -1 elsewhere. Build it once per row set
    and pass it to every layer's `rerotate_scatter` (rows do not change across layers)."""
    inv = torch.full((T,), -1, device=rows.device, dtype=torch.int32)
    if rows.numel():
        inv[rows] = torch.arange(rows.numel(), device=rows.device, dtype=torch.int32)
    return inv


def rerotate_scatter(
    k_pre, v, rows, k_new_pre, v_new, cos, sin, inv=None, out=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write fresh rows into a layer's cache and rotate every key to its position, one pass.

    k_pre, v (T, Hkv, D) cached pre-RoPE keys / values; rows (R,) unique positions in
    [0, T) (R may be 0); k_new_pre, v_new (R, Hkv, D) with k_pre's / v's dtype; cos, sin
    (T, D), D even (HF rotate_half convention). -> (k_rot, v_out), new (T, Hkv, D) tensors:
        k_rot[j] = rope(k_new_pre[i] if j == rows[i] else k_pre[j], pos=j)
        v_out[j] = v_new[i]      if j == rows[i] else v[j]
    inv: optional `inverse_rows(rows, T)`, reused across layers to skip rebuilding it.
    out: optional (k_dst, v_dst), contiguous (T, Hkv, D) of k_pre's / v's dtype and device, to
    write into (a decode cache's layer) instead of new tensors; they are returned.
    """
    _check_tensor("k_pre", k_pre, 3, FLOAT_DTYPES)
    _check_tensor("v", v, 3, FLOAT_DTYPES)
    _check_tensor("rows", rows, 1, INDEX_DTYPES)
    _check_tensor("k_new_pre", k_new_pre, 3, FLOAT_DTYPES)
    _check_tensor("v_new", v_new, 3, FLOAT_DTYPES)
    _check_tensor("cos", cos, 2, FLOAT_DTYPES)
    _check_tensor("sin", sin, 2, FLOAT_DTYPES)
    if k_new_pre.dtype != k_pre.dtype:
        raise TypeError(f"k_new_pre has dtype {k_new_pre.dtype} but k_pre has {k_pre.dtype}; they must match")
    if v_new.dtype != v.dtype:
        raise TypeError(f"v_new has dtype {v_new.dtype} but v has {v.dtype}; they must match")
    T, Hkv, D = k_pre.shape
    R = rows.shape[0]
    if v.shape != k_pre.shape:
        raise ValueError(f"v shape {tuple(v.shape)} must equal k_pre shape {tuple(k_pre.shape)}")
    if k_new_pre.shape != (R, Hkv, D) or v_new.shape != (R, Hkv, D):
        raise ValueError(
            f"k_new_pre {tuple(k_new_pre.shape)} and v_new {tuple(v_new.shape)} must be "
            f"(len(rows), Hkv, D) = {(R, Hkv, D)}"
        )
    if cos.shape != (T, D) or sin.shape != (T, D):
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be (T, D) = {(T, D)}")
    if D % 2:
        raise ValueError(f"head dim must be even for rotate_half RoPE, got {D}")
    device = _check_same_device(k_pre=k_pre, v=v, rows=rows, k_new_pre=k_new_pre, v_new=v_new, cos=cos, sin=sin)
    if device.type == "cpu" and R:
        lo, hi = int(rows.min()), int(rows.max())
        if lo < 0 or hi >= T:
            raise ValueError(f"rows must lie in [0, {T}), got range [{lo}, {hi}]")
        if torch.unique(rows).numel() != R:
            raise ValueError("rows must be unique")
    if inv is not None:
        _check_tensor("inv", inv, 1, (torch.int32,))
        if inv.shape[0] != T or inv.device != device:
            raise ValueError(f"inv must be (T,) = ({T},) on {device}, got {tuple(inv.shape)} on {inv.device}")
        if device.type == "cpu" and not torch.equal(inv, inverse_rows(rows, T)):
            raise ValueError("inv does not match rows: pass inverse_rows(rows, T)")
    if out is not None:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError("out must be a (k_dst, v_dst) pair")
        for name, dst, like in (("out k", out[0], k_pre), ("out v", out[1], v)):
            _check_tensor(name, dst, 3, FLOAT_DTYPES)
            if dst.shape != like.shape or dst.dtype != like.dtype or dst.device != device:
                raise ValueError(
                    f"{name} must be {tuple(like.shape)} {like.dtype} on {device}, got "
                    f"{tuple(dst.shape)} {dst.dtype} on {dst.device}"
                )
    if not _use_kernels(device):
        k_rot, v_out = ref.rerotate_scatter_ref(k_pre, v, rows, k_new_pre, v_new, cos, sin)
        if out is None:
            return k_rot, v_out
        out[0].copy_(k_rot)
        out[1].copy_(v_out)
        return out[0], out[1]

    from qcfuse_kernels.triton_rerotate import rerotate_scatter_kernel

    k_rot = torch.empty_like(k_pre) if out is None else out[0]  # (T, Hkv, D)
    v_out = torch.empty_like(v) if out is None else out[1]  # (T, Hkv, D)
    if T == 0 or Hkv == 0 or D == 0:
        return k_rot, v_out
    if inv is None:
        inv = inverse_rows(rows, T)  # position -> fresh row or -1
    if not R:  # never read (inv is all -1); avoids handing the kernel a 0-element pointer
        k_new_pre, v_new = k_pre, v
    half, block_half, block_h, block_t = _rope_tiles(Hkv, D)
    rerotate_scatter_kernel[(_cdiv(T, block_t),)](
        k_pre,
        v,
        k_new_pre,
        v_new,
        inv,
        cos,
        sin,
        k_rot,
        v_out,
        T,
        NUM_KV_HEADS=Hkv,
        HEAD_DIM=D,
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_H=block_h,
        BLOCK_T=block_t,
        num_warps=4,
    )
    return k_rot, v_out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rope_tiles(heads: int, D: int) -> tuple[int, int, int, int]:
    """Tiles of the RoPE kernels (rerotate_scatter, rope): a program takes (BLOCK_T tokens,
    BLOCK_H heads, BLOCK_HALF columns of one half) -> (half, block_half, block_h, block_t)."""
    half = D // 2
    block_half, block_h = _next_pow2(half), _next_pow2(heads)
    # ~4K elements per tile: enough bytes in flight per program, few registers
    block_t = max(1, min(64, 4096 // (block_h * block_half)))
    if backend() == "interpret":
        block_t = min(block_t, 8)
    return half, block_half, block_h, block_t


# ---------------------------------------------------------------- pointwise layer steps


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, Hx, D) rotated to the positions of cos/sin (T, D) (HF rotate_half convention),
    computed in fp32, returned in x's dtype as a new tensor. One pass on a kernel backend."""
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    x, cos, sin = _rows_of(x), _rows_of(cos), _rows_of(sin)
    _check_tensor("x", x, 3, FLOAT_DTYPES)
    _check_tensor("cos", cos, 2, FLOAT_DTYPES)
    _check_tensor("sin", sin, 2, FLOAT_DTYPES)
    T, Hx, D = x.shape
    if cos.shape != (T, D) or sin.shape != (T, D):
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be (T, D) = {(T, D)}")
    if D % 2:
        raise ValueError(f"head dim must be even for rotate_half RoPE, got {D}")
    device = _check_same_device(x=x, cos=cos, sin=sin)
    if not _use_kernels(device) or x.numel() == 0:
        return ref.apply_rope(x, cos, sin)
    from qcfuse_kernels.triton_pointwise import rope_kernel

    y = torch.empty_like(x)
    half, block_half, block_h, block_t = _rope_tiles(Hx, D)
    rope_kernel[(_cdiv(T, block_t),)](
        x,
        cos,
        sin,
        y,
        T,
        NUM_HEADS=Hx,
        HEAD_DIM=D,
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_H=block_h,
        BLOCK_T=block_t,
        num_warps=4,
    )
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (..., N) with weight (N,), HF's rounding order (`reference.rms_norm_ref`).

    One pass on a kernel backend when x and weight share a dtype; otherwise the reference
    (which then follows torch's type promotion, like HF)."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("x and weight must be torch.Tensors")
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight {tuple(weight.shape)} must be (N,) for x {tuple(x.shape)} normalised over its last dim"
        )
    eps = _check_scale(eps)
    device = _check_same_device(x=x, weight=weight)
    if not _use_kernels(device) or x.dtype != weight.dtype or x.dtype not in FLOAT_DTYPES or x.numel() == 0:
        return ref.rms_norm_ref(x, weight, eps)
    from qcfuse_kernels.triton_pointwise import rms_norm_kernel

    N = x.shape[-1]
    x2 = _rows_of(x).view(-1, N)
    y = torch.empty_like(x2)
    block = _next_pow2(N)
    rms_norm_kernel[(x2.shape[0],)](
        x2, _rows_of(weight), y, N, eps, BLOCK_N=block, num_warps=max(1, min(16, block // 256))
    )
    return y.view(x.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (same shape and dtype), rounded like torch (`reference.silu_mul_ref`)."""
    if not isinstance(gate, torch.Tensor) or not isinstance(up, torch.Tensor):
        raise TypeError("gate and up must be torch.Tensors")
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match")
    device = _check_same_device(gate=gate, up=up)
    if not _use_kernels(device) or gate.dtype not in FLOAT_DTYPES or gate.numel() == 0:
        return ref.silu_mul_ref(gate, up)
    from qcfuse_kernels.triton_pointwise import silu_mul_kernel

    g, u = _rows_of(gate), _rows_of(up)
    y = torch.empty_like(g)
    block = 1024 if backend() == "triton" else 256
    silu_mul_kernel[(_cdiv(g.numel(), block),)](g, u, y, g.numel(), BLOCK=block, num_warps=4)
    return y


def add_rms_norm(
    x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm in one pass: h = x + d (x, d (rows, N), one dtype),
    y = rms_norm(h, weight, eps) -> (h, y), new tensors, each rounded as `reference.add_rms_norm_ref`."""
    if not all(isinstance(t, torch.Tensor) for t in (x, d, weight)):
        raise TypeError("x, d and weight must be torch.Tensors")
    if x.dim() != 2 or d.shape != x.shape or d.dtype != x.dtype or weight.shape != (x.shape[-1],):
        raise ValueError(
            f"x {tuple(x.shape)} and d {tuple(d.shape)} must be one (rows, N) shape and dtype, "
            f"weight (N,), got {tuple(weight.shape)}"
        )
    eps = _check_scale(eps)
    device = _check_same_device(x=x, d=d, weight=weight)
    if not _use_kernels(device) or x.dtype != weight.dtype or x.dtype not in FLOAT_DTYPES or x.numel() == 0:
        return ref.add_rms_norm_ref(x, d, weight, eps)
    from qcfuse_kernels.triton_pointwise import add_rms_norm_kernel

    N = x.shape[-1]
    x, d = _rows_of(x), _rows_of(d)
    h, y = torch.empty_like(x), torch.empty_like(x)
    block = _next_pow2(N)
    add_rms_norm_kernel[(x.shape[0],)](
        x, d, _rows_of(weight), h, y, N, eps, BLOCK_N=block, num_warps=max(1, min(16, block // 256))
    )
    return h, y


def silu_mul_packed(gu: torch.Tensor) -> torch.Tensor:
    """gu (rows, 2I) holding the gate's then the up projection's outputs -> silu(gate) * up
    (rows, I), rounded as `silu_mul`."""
    if not isinstance(gu, torch.Tensor):
        raise TypeError("gu must be a torch.Tensor")
    if gu.dim() != 2 or gu.shape[1] % 2:
        raise ValueError(f"gu must be (rows, 2I), got {tuple(gu.shape)}")
    if not _use_kernels(gu.device) or gu.dtype not in FLOAT_DTYPES or gu.numel() == 0:
        return ref.silu_mul_packed_ref(gu)
    from qcfuse_kernels.triton_pointwise import silu_mul_packed_kernel

    gu = _rows_of(gu)
    rows, inner = gu.shape[0], gu.shape[1] // 2
    y = torch.empty((rows, inner), device=gu.device, dtype=gu.dtype)
    block = 1024 if backend() == "triton" else 256
    silu_mul_packed_kernel[(rows, _cdiv(inner, block))](gu, y, inner, BLOCK=block, num_warps=4)
    return y


# ---------------------------------------------------------------- decode attention

DECODE_SPLITS = 32  # key ranges per (sequence, KV head) where the caller names none
DECODE_CONFIG = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}  # the partial pass's launch on CUDA
DECODE_PROGRAMS = 512  # partial-pass programs `decode_splits` aims at (about 4 per SM of an H100/H200)


def decode_splits(rows: int, num_kv_heads: int) -> int:
    """Key ranges per (sequence, KV head) for a decode step of `rows` sequences: enough
    programs to fill the GPU (B * Hkv * splits ~ DECODE_PROGRAMS), a power of two in [4, 64].
    On an H100 at 10K keys (Llama-3.1-8B shape) one sequence is fastest at 64 ranges of 32-key
    blocks and eight at 8 (docs/benchmarks.md, "Decode"). A row's bits follow its length and
    the split count, so a caller that needs them independent of the batch passes one count."""
    if rows < 1 or num_kv_heads < 1:
        raise ValueError(f"rows and num_kv_heads must be positive, got {rows} and {num_kv_heads}")
    want = -(-DECODE_PROGRAMS // (rows * num_kv_heads))
    return max(4, min(64, _next_pow2(want)))


def _check_caches(ks, vs, B: int, Hkv: int, D: int, dtype: torch.dtype) -> None:
    for name, caches in (("ks", ks), ("vs", vs)):
        if len(caches) != B:
            raise ValueError(f"{name} holds {len(caches)} caches for {B} sequences")
        for c in caches:
            _check_tensor(name, c, 3, FLOAT_DTYPES)
            if c.dtype != dtype or tuple(c.shape[1:]) != (Hkv, D):
                raise ValueError(
                    f"a cache in {name} is {tuple(c.shape)} {c.dtype}; need (capacity, {Hkv}, {D}) {dtype}"
                )


def cache_addresses(caches) -> torch.Tensor:
    """(B,) int64 base addresses of the tensors `caches` (for the `*_ptrs` launchers), each
    checked to be 16-byte aligned (the kernels' loads assume it)."""
    out = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)
    if bool((out % 16).any()):
        raise ValueError("cache tensors must start at 16-byte aligned addresses (a fresh tensor, or a slice of one)")
    return out


def decode_attention(q, ks, vs, lens, scale: float, window: int | None = None) -> torch.Tensor:
    """One decode step's attention, each sequence over its own cache.

    q (B, H, D) post-RoPE queries; ks[b], vs[b] (capacity_b, Hkv, D) contiguous, q's dtype
    and device; lens (B,) int: sequence b sees keys [0, lens[b]) (a sliding `window` W: the
    last W of them) -> (B, H, D) in q's dtype, fp32 softmax and accumulation. On a kernel
    backend: split-KV in two passes without atomics (`triton_decode_attention.py`), the same
    bits every run, and a row's bits do not depend on the other rows of the batch."""
    _check_tensor("q", q, 3, FLOAT_DTYPES)
    _check_tensor("lens", lens, 1, INDEX_DTYPES)
    B, H, D = q.shape
    if not ks:
        raise ValueError("need at least one sequence")
    Hkv = ks[0].shape[1] if ks[0].dim() == 3 else -1
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"{H} query heads are not a multiple of the caches' KV heads ({Hkv})")
    _check_caches(ks, vs, B, Hkv, D, q.dtype)
    if lens.shape[0] != B:
        raise ValueError(f"lens has {lens.shape[0]} entries for {B} sequences")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    device = _check_same_device(q=q, lens=lens, **{f"k{b}": k for b, k in enumerate(ks)})
    _check_same_device(q=q, **{f"v{b}": v for b, v in enumerate(vs)})
    if device.type == "cpu":
        for b, n in enumerate(lens.tolist()):
            if not 1 <= n <= ks[b].shape[0]:
                raise ValueError(f"lens[{b}] = {n} outside [1, {ks[b].shape[0]}] (the cache's capacity)")
    if not _use_kernels(device):
        return ref.decode_attention_ref(q, ks, vs, lens, _check_scale(scale), window)
    kp, vp = cache_addresses(ks).to(device), cache_addresses(vs).to(device)
    return decode_attention_ptrs(q, kp, vp, lens, scale, num_kv_heads=Hkv, window=window)


def decode_attention_ptrs(
    q: torch.Tensor,
    k_ptrs: torch.Tensor,
    v_ptrs: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    *,
    num_kv_heads: int,
    window: int | None = None,
    splits: int = DECODE_SPLITS,
    k_scale_ptrs: torch.Tensor | None = None,
    v_scale_ptrs: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decode_attention` with the caches given by address (`cache_addresses`, on q's device):
    nothing is read back to the host and every buffer is allocated here, so a CUDA graph can
    capture the call. Preconditions (not checked): each address is a live, 16-byte aligned
    (capacity, Hkv, D) contiguous tensor of q's dtype with lens[b] <= capacity. fp8 caches:
    k_scale_ptrs / v_scale_ptrs (B,) the addresses of each sequence's (capacity, Hkv) fp32
    scales, the caches then float8_e4m3fn (`reference.quantize_fp8_rows`). Kernel backends
    only."""
    if not _use_kernels(q.device):
        raise RuntimeError(f"decode_attention_ptrs needs a kernel backend for {q.device} tensors (backend {backend()})")
    from qcfuse_kernels.triton_decode_attention import decode_combine_kernel, decode_partial_kernel

    B, H, D = q.shape
    group = H // num_kv_heads
    block_g, block_d = max(16, _next_pow2(group)), _block_d(D)
    interpret = backend() == "interpret"
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"splits must be a power of two, got {splits}")
    if interpret:
        splits = min(splits, 4)  # a few key ranges: the split path runs, the interpreter stays quick
    programs = B * num_kv_heads
    m = torch.empty((programs, splits, block_g), device=q.device, dtype=torch.float32)
    lsum = torch.empty_like(m)
    acc = torch.empty((programs, splits, block_g, block_d), device=q.device, dtype=torch.float32)
    fp8 = _fp8_tables(k_scale_ptrs, v_scale_ptrs)
    decode_partial_kernel[(programs, splits)](
        q,
        k_ptrs,
        v_ptrs,
        lens,
        k_ptrs if k_scale_ptrs is None else k_scale_ptrs,
        v_ptrs if v_scale_ptrs is None else v_scale_ptrs,
        m,
        lsum,
        acc,
        _check_scale(scale) * _LOG2E,
        window or 0,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        BLOCK_G=block_g,
        HEAD_DIM=D,
        BLOCK_D=block_d,
        SPLITS=splits,
        PRECISION=_dot_precision(q.dtype),
        UPCAST=interpret and (q.dtype == torch.bfloat16 or fp8),
        KV_FP8=fp8,
        **({"BLOCK_N": 16} if interpret else DECODE_CONFIG),
    )
    out = torch.empty_like(q)
    decode_combine_kernel[(B * H,)](
        m, lsum, acc, out, GROUP=group, BLOCK_G=block_g, HEAD_DIM=D, BLOCK_D=block_d, SPLITS=splits, num_warps=4
    )
    return out


def _fp8_tables(k_scale_ptrs: torch.Tensor | None, v_scale_ptrs: torch.Tensor | None) -> bool:
    """Whether a `*_ptrs` launch reads / writes fp8 caches: both scale tables given, or none."""
    if (k_scale_ptrs is None) != (v_scale_ptrs is None):
        raise ValueError("fp8 caches need both k_scale_ptrs and v_scale_ptrs (or neither)")
    return k_scale_ptrs is not None


def kv_append(ks, vs, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """ks[b][pos[b]] = k[b], vs[b][pos[b]] = v[b]: each sequence's new key and value (k, v
    (B, Hkv, D)) written into its own cache (ks[b], vs[b] (capacity_b, Hkv, D))."""
    _check_tensor("k", k, 3, FLOAT_DTYPES)
    _check_tensor("v", v, 3, FLOAT_DTYPES)
    _check_tensor("pos", pos, 1, INDEX_DTYPES)
    B, Hkv, D = k.shape
    if v.shape != k.shape or v.dtype != k.dtype or pos.shape[0] != B:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} and pos {tuple(pos.shape)} disagree")
    _check_caches(ks, vs, B, Hkv, D, k.dtype)
    device = _check_same_device(k=k, v=v, pos=pos, **{f"k{b}": c for b, c in enumerate(ks)})
    if device.type == "cpu":
        for b, p in enumerate(pos.tolist()):
            if not 0 <= p < ks[b].shape[0] or ks[b].shape[0] != vs[b].shape[0]:
                raise ValueError(f"pos[{b}] = {p} outside the cache's capacity {ks[b].shape[0]}")
    if not _use_kernels(device):
        ref.kv_append_ref(ks, vs, pos, k, v)
        return
    kv_append_ptrs(cache_addresses(ks).to(device), cache_addresses(vs).to(device), pos, k, v)


def rope_append_ptrs(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_ptrs: torch.Tensor,
    v_ptrs: torch.Tensor,
    pos: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    k_scale_ptrs: torch.Tensor | None = None,
    v_scale_ptrs: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step's RoPE and cache write in one pass: qkv (B, (H + 2 Hkv) D) each row's
    query, key and value projections (pre-RoPE), cos/sin (B, D) its position's -> the rotated
    queries (B, H, D); row b's rotated key and its value written at pos[b] of the caches at
    k_ptrs[b] / v_ptrs[b] (`apply_rope` then `kv_append_ptrs`, the same arithmetic; the
    preconditions of `kv_append_ptrs`; fp8 caches with scale tables as there). Kernel
    backends only (graph-capturable)."""
    if not _use_kernels(qkv.device):
        raise RuntimeError(f"rope_append_ptrs needs a kernel backend for {qkv.device} tensors (backend {backend()})")
    from qcfuse_kernels.triton_decode_attention import rope_append_kernel

    B = qkv.shape[0]
    D = cos.shape[-1]
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * D or D % 2:
        raise ValueError(
            f"qkv {tuple(qkv.shape)} is not (B, (H + 2 Hkv) D) for H={num_heads}, Hkv={num_kv_heads}, D={D} (even)"
        )
    q = torch.empty((B, num_heads, D), device=qkv.device, dtype=qkv.dtype)
    rope_append_kernel[(B,)](
        _rows_of(qkv),
        _rows_of(cos),
        _rows_of(sin),
        k_ptrs,
        v_ptrs,
        k_ptrs if k_scale_ptrs is None else k_scale_ptrs,
        v_ptrs if v_scale_ptrs is None else v_scale_ptrs,
        pos,
        q,
        KV_FP8=_fp8_tables(k_scale_ptrs, v_scale_ptrs),
        ROUND_FP8=backend() == "interpret",
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=D,
        HALF=D // 2,
        BLOCK_HQ=_next_pow2(num_heads),
        BLOCK_HKV=_next_pow2(num_kv_heads),
        BLOCK_HALF=_next_pow2(D // 2),
        num_warps=4,
    )
    return q


def kv_append_ptrs(
    k_ptrs: torch.Tensor,
    v_ptrs: torch.Tensor,
    pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale_ptrs: torch.Tensor | None = None,
    v_scale_ptrs: torch.Tensor | None = None,
) -> None:
    """`kv_append` with the caches given by address (graph-capturable; the preconditions of
    `decode_attention_ptrs`, and 0 <= pos[b] < capacity; fp8 caches with scale tables as
    there). Kernel backends only."""
    if not _use_kernels(k.device):
        raise RuntimeError(f"kv_append_ptrs needs a kernel backend for {k.device} tensors (backend {backend()})")
    from qcfuse_kernels.triton_decode_attention import kv_append_kernel

    B, Hkv, D = k.shape
    kv_append_kernel[(B,)](
        k_ptrs,
        v_ptrs,
        k_ptrs if k_scale_ptrs is None else k_scale_ptrs,
        v_ptrs if v_scale_ptrs is None else v_scale_ptrs,
        pos,
        _rows_of(k),
        _rows_of(v),
        NUM_KV_HEADS=Hkv,
        HEAD_DIM=D,
        BLOCK_H=_next_pow2(Hkv),
        BLOCK_D=_next_pow2(D),
        KV_FP8=_fp8_tables(k_scale_ptrs, v_scale_ptrs),
        ROUND_FP8=backend() == "interpret",
        num_warps=4,
    )
