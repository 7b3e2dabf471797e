"""Layer-wise fused prefill over cached chunks, and decoding from the fused cache.

A prompt is a list of segments laid end to end; each has its own token ids and, where one
exists, a cache computed for that segment alone at positions 0..n-1 (pre-RoPE keys):

    position: 0        P          P+n1            P+n1+g      ...               T-1
              [prefix ][chunk 1   ][glue][chunk 2  ]...[chunk n  ][suffix          ]
    cache:    exact     reused      none  reused        reused     none
    rows:     never     selected    all   selected      selected   all

The prefix sits at offset 0, so its alone-cache is exact. Rows without a cache (glue text,
suffix) are always recomputed. For every layer l (docs/design.md, the method):

    1. gather layer l of every cached segment: pre-RoPE K, V (T, Hkv, D); zeros where uncached
    2. write the recomputed rows' fresh K/V into it and rotate all keys to positions 0..T-1
    3. the recomputed rows attend to every key at a position <= their own (in a sliding-window
       layer of width W, only to keys p - W < j <= p)
    4. o_proj + MLP on the recomputed rows only

Layers < `full_layers` recompute every row (CacheBlend's first layers); after them the row
set narrows to `rows`, possibly chosen by an `on_layer_end` hook. With every row recomputed
the result equals an ordinary prefill of the whole prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

import qcfuse_kernels as K
from qcfuse_core.model.adapter import ModelAdapter, to_device
from qcfuse_core.types import KVChunk

KINDS = ("prefix", "chunk", "text", "suffix")


@dataclass
class Segment:
    """One stretch of the prompt. kind: prefix | chunk | text | suffix."""

    kind: str
    token_ids: torch.Tensor  # (n,) int64
    chunk: KVChunk | None = None
    node_id: str | None = None
    cache_hit: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown segment kind {self.kind!r}; valid: prefix, chunk, text, suffix")
        if self.chunk is not None and self.chunk.num_tokens != self.token_ids.shape[0]:
            raise ValueError("segment tokens and its chunk cache disagree in length")

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass
class FusedPrompt:
    """Segments plus the derived index arithmetic (starts, masks)."""

    segments: list[Segment]
    token_ids: torch.Tensor = field(init=False)  # (T,)
    starts: list[int] = field(init=False)
    _kinds: torch.Tensor | None = field(init=False, repr=False, default=None)  # (T,) int8 KINDS index
    _uncached: torch.Tensor | None = field(init=False, repr=False, default=None)  # (T,) bool
    _masks: dict = field(init=False, repr=False, default_factory=dict)  # kinds -> (T,) bool

    def __post_init__(self) -> None:
        if not self.segments or self.segments[-1].kind != "suffix" or len(self.segments[-1]) == 0:
            raise ValueError("a fused prompt must end with a non-empty suffix segment")
        self.token_ids = torch.cat([s.token_ids.to(torch.int64) for s in self.segments])
        self.starts, pos = [], 0
        for s in self.segments:
            self.starts.append(pos)
            pos += len(s)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def _per_token(self, values: list[int]) -> torch.Tensor:
        """(T,) int8: each segment's value repeated over its tokens (a fill per segment:
        `repeat_interleave` took ~0.5 ms of host time per call on the request path)."""
        out = torch.empty(self.num_tokens, dtype=torch.int8)
        for v, s, start in zip(values, self.segments, self.starts):
            out[start : start + len(s)] = v
        return out

    def mask(self, *kinds: str) -> torch.Tensor:
        """(T,) bool: positions in segments of the given kinds (a fresh tensor; each kind set
        is built once per prompt)."""
        m = self._masks.get(kinds)
        if m is None:
            if self._kinds is None:
                self._kinds = self._per_token([KINDS.index(s.kind) for s in self.segments])
            m = torch.zeros(self.num_tokens, dtype=torch.bool)
            for k in kinds:
                m |= self._kinds == KINDS.index(k)
            self._masks[kinds] = m
        return m.clone()

    def uncached_mask(self) -> torch.Tensor:
        """(T,) bool: positions without a cache (a fresh tensor). A prompt's segments are not
        changed after it is built (what the masks are made of is cached)."""
        if self._uncached is None:
            self._uncached = self._per_token([int(s.chunk is None) for s in self.segments]).bool()
        return self._uncached.clone()

    @property
    def context_tokens(self) -> int:
        """Tokens between prefix and suffix (chunks and glue): what a ratio is a share of."""
        return int(self.mask("chunk", "text").sum())

    def chunk_spans(self) -> list[tuple[int, int]]:
        return [(st, st + len(s)) for s, st in zip(self.segments, self.starts) if s.kind == "chunk"]

    def layer(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer` of all segment caches laid end to end: k_pre, v (T, Hkv, D); zeros where uncached."""
        ks, vs = [], []
        for s in self.segments:
            if s.chunk is not None:
                ks.append(s.chunk.k[layer].to(like.device, like.dtype))
                vs.append(s.chunk.v[layer].to(like.device, like.dtype))
            else:
                z = like.new_zeros((len(s), *like.shape[1:]))
                ks.append(z)
                vs.append(z)
        return torch.cat(ks), torch.cat(vs)


KV_DTYPES = ("auto", "fp8")  # CacheConfig.kv_dtype: the model's own dtype, or e4m3 with scales


def check_kv_dtype(kv_dtype: str) -> str:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    return kv_dtype


class KVCache:
    """Rotated K and V of a fused prompt plus decoded tokens: (L, Tmax, Hkv, D), filled to `length`.

    kv_dtype "auto": k, v in the model's dtype. "fp8": k, v float8_e4m3fn with one fp32 scale
    per (layer, token, KV head) in k_scale, v_scale (L, Tmax, Hkv): a token's key of one head
    is its D codes times its scale (`qcfuse_kernels.reference.quantize_fp8_rows`; per token,
    not per head over a chunk as the store's fp8 images are, because a running cache grows a
    token at a time). Write rows with `write`, read them in the model's dtype with `read`;
    the decode kernels read the codes and scales where they are."""

    fp8 = False
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def __init__(self, adapter: ModelAdapter, capacity: int, kv_dtype: str = "auto") -> None:
        s = adapter.shape
        shape = (s.num_layers, capacity, s.num_kv_heads, s.head_dim)
        self.dtype = adapter.dtype  # what `read` gives
        self.fp8 = check_kv_dtype(kv_dtype) == "fp8"
        store = torch.float8_e4m3fn if self.fp8 else adapter.dtype
        self.k = torch.empty(shape, device=adapter.device, dtype=store)
        self.v = torch.empty(shape, device=adapter.device, dtype=store)
        if self.fp8:
            self.k_scale = torch.ones(shape[:3], device=adapter.device, dtype=torch.float32)
            self.v_scale = torch.ones(shape[:3], device=adapter.device, dtype=torch.float32)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    @staticmethod
    def bytes_for(adapter: ModelAdapter, tokens: int, kv_dtype: str = "auto") -> int:
        """Bytes of a cache of `tokens` rows (`nbytes` of one made now): K and V in the model's
        dtype, or fp8 codes plus their fp32 scales (one per token and KV head)."""
        s = adapter.shape
        if check_kv_dtype(kv_dtype) == "auto":
            return s.kv_bytes(tokens, adapter.dtype)
        return s.kv_bytes(tokens, torch.float8_e4m3fn) + 2 * s.num_layers * tokens * s.num_kv_heads * 4

    def clone(self) -> KVCache:
        """A copy of the cache (its own tensors, the same length)."""
        out = KVCache.__new__(KVCache)
        out.__dict__.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()})
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of the cache's tensors (codes and scales)."""
        return sum(t.nbytes for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None)

    def write(self, layer: int, at, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows `at` (a position, a slice or an index tensor) of layer `layer` = k, v (..., Hkv, D)
        in the model's dtype (quantized here in fp8)."""
        if not self.fp8:
            self.k[layer, at] = k.to(self.k.dtype)
            self.v[layer, at] = v.to(self.v.dtype)
            return
        assert self.k_scale is not None and self.v_scale is not None
        for codes, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, sc = K.quantize_fp8_rows(x)
            codes.view(torch.uint8)[layer, at] = q.view(torch.uint8)  # bytes: every indexing kernel has them
            scales[layer, at] = sc

    def read(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [lo, hi) of layer `layer`: (k, v) (hi - lo, Hkv, D) in the model's dtype (views
        of the cache, or dequantized copies in fp8)."""
        if not self.fp8:
            return self.k[layer, lo:hi], self.v[layer, lo:hi]
        assert self.k_scale is not None and self.v_scale is not None
        deq = K.dequantize_fp8_rows
        return (
            deq(self.k[layer, lo:hi], self.k_scale[layer, lo:hi], self.dtype),
            deq(self.v[layer, lo:hi], self.v_scale[layer, lo:hi], self.dtype),
        )


class LayerSource(Protocol):
    """Where fused prefill gets layer l of the cached segments (the prefetcher implements this).

    `layer(l, like)` returns k_pre, v (T, Hkv, D) on like's device and dtype, laid out as the
    prompt's segments, zeros where a segment has no cache. Layers are asked for in order.
    """

    def layer(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class LayerState:
    """What an `on_layer_end` hook sees after layer `layer`."""

    layer: int
    rows: torch.Tensor  # (R,) positions currently recomputed
    k_pre_fresh: torch.Tensor  # (R, Hkv, D)
    v_fresh: torch.Tensor  # (R, Hkv, D)
    k_pre_cached: torch.Tensor  # (T, Hkv, D) zeros where uncached
    v_cached: torch.Tensor  # (T, Hkv, D)


@dataclass
class PrefillOutput:
    logits: torch.Tensor  # (R_last, vocab) fp32 for the final row set (or last row only)
    rows: torch.Tensor  # the final layer's row set
    layer_ms: list[float]
    k_pre: torch.Tensor | None = None  # (L, T, Hkv, D) when capture_pre_rope
    # (first layer, rows) each time the row set changed, from layer 0: layer l recomputed the
    # rows of the last entry whose first layer is <= l (each set is a subset of the one before)
    row_sets: list[tuple[int, torch.Tensor]] = field(default_factory=list)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    masks: list[tuple[int, int, int, int, torch.Tensor]] | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """q (R, H, D) at positions `rows`; k, v (T, Hkv, D) -> (R, H, D).

    Row p sees keys j <= p, and with a sliding `window` W only those with j > p - W. All rows
    0..T-1 -> SDPA (causal, or a band mask); otherwise location-aware sparse attention.
    `masks` (torch path): the row blocks' masks from `row_masks` for this window, made once
    per row set.
    """
    T = k.shape[0]
    if window is not None and window >= T:
        window = None  # every key a row may see is inside its window
    if rows.shape[0] == T:
        if window is None:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )  # (1, H, T, D)
            return out[0].transpose(0, 1)
        masks = masks if masks is not None else row_masks(rows, T, q.dtype, q.device, window)
        return torch.cat([_masked_sdpa(q[s:e], k[a:n], v[a:n], m, scale) for s, e, a, n, m in masks])
    if K.backend() == "torch":  # no kernels: SDPA with a row mask beats the fp32 dense oracle ~5-10x on CPU
        masks = masks if masks is not None else row_masks(rows, T, q.dtype, q.device, window)
        return torch.cat([_masked_sdpa(q[s:e], k[a:n], v[a:n], m, scale) for s, e, a, n, m in masks])
    return K.sparse_attention(q.contiguous(), k, v, rows, scale, window=window)


ROW_BLOCK = 256  # torch path: rows per SDPA call; each block reads keys only up to its last row


def row_masks(
    rows: torch.Tensor, T: int, dtype: torch.dtype, device: torch.device, window: int | None = None
) -> list[tuple[int, int, int, int, torch.Tensor]]:
    """Per block of ROW_BLOCK sorted rows: (first, end) row indices, the key range [a, n) the
    block sees (keys after its last row, and with a sliding `window` W keys at or before its
    first row - W, are masked for all of its rows, so they are cut) and its additive mask
    (1, 1, rows, n - a) in the model's dtype: 0 where visible, -inf elsewhere.
    Built once per row set, not per layer. An additive mask is faster on a CPU than a
    boolean one: fused prefill 724 vs 788 ms (qcfuse@0.15, SmolLM2-135M bf16, 8 x 256
    tokens, 1 thread, medians of 8 interleaved runs)."""
    out = []
    for s in range(0, rows.shape[0], ROW_BLOCK):
        r = rows[s : s + ROW_BLOCK]
        on_host = r.device.type == "cpu"  # no device sync for the cuts
        n = int(r[-1]) + 1 if on_host else T
        a = max(0, int(r[0]) - window + 1) if window is not None and on_host else 0
        keys = torch.arange(a, n, device=device)[None, :]
        rd = r.to(device)[:, None]
        visible = keys <= rd  # (R, n - a)
        if window is not None:
            visible &= keys > rd - window
        mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
        out.append((s, s + r.shape[0], a, n, mask[None, None]))
    return out


def _masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q (R, H, D) over keys k, v (n, Hkv, D) under an additive mask (1, 1, R, n) -> (R, H, D)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )  # (1, H, R, D)
    return out[0].transpose(0, 1)


def prefill_slices(rows: torch.Tensor, size: int) -> list[tuple[int, int]]:
    """Chunked prefill: the spans [a, b) of positions that split the recomputed `rows` (sorted,
    ending at the prompt's last position) into slices of at most `size` rows each, end to
    end from 0 - a function of the rows and `size` alone, so a request's slices (and so its
    bits in deterministic mode) do not depend on what runs beside it. One span: not split."""
    rows = rows.to(torch.int64).cpu()
    ends = [int(rows[min(i + size, rows.numel()) - 1]) + 1 for i in range(0, rows.numel(), size)]
    return list(zip([0, *ends[:-1]], ends))


@torch.inference_mode()
def fused_prefill(
    adapter: ModelAdapter,
    prompt: FusedPrompt,
    rows: torch.Tensor,
    *,
    full_layers: int = 0,
    on_layer_end: Callable[[LayerState], torch.Tensor | None] | None = None,
    kv_out: KVCache | None = None,
    logits_last: int | None = 1,
    capture_pre_rope: bool = False,
    source: LayerSource | None = None,
    span: tuple[int, int] | None = None,
) -> PrefillOutput:
    """Run the layer loop; `rows` (R,) sorted unique positions recomputed after `full_layers`.

    Logits come back for the last `logits_last` final rows (None: every final row).

    `rows` must contain every uncached position (glue text, suffix), including the last.
    `on_layer_end` may return a new row set (a subset of the current one) for later layers.
    `source` supplies the cached layers (default: read the prompt's in-memory chunk caches).

    `span` (chunked prefill, `prefill_slices`): the slice of positions [a, b) that `rows` lie
    in, its rows attending to keys 0..b-1 of `kv_out`, which it fills to b:

        positions   [0, a)                [a, b)                 [b, T)
                    earlier slices        this slice's rows      later slices
                    (read from kv_out)    (attend to 0..b-1)     (not seen)

    The first slice (a = 0) reads `source` and lays every cached row of the prompt into
    `kv_out`; a later one reads what is before it from `kv_out`. Logits only when b = T; a
    slice takes no `full_layers`, `on_layer_end` or `capture_pre_rope`.
    """
    st = _Fusing(adapter, prompt, rows, full_layers, on_layer_end, kv_out, logits_last, capture_pre_rope, span)
    dev = adapter.device
    for layer in range(adapter.num_layers):
        t0 = time.perf_counter()
        q_pre, k_new, v_new = adapter.qkv(layer, adapter.attn_norm(layer, st.h))
        window = adapter.windows[layer]
        cached: tuple[torch.Tensor, torch.Tensor] | None = None  # this layer's cached K/V, for the hook
        if st.a > 0:  # a later slice: the keys before it and its cached rows are in kv_out
            attn = _later_slice(adapter, st, layer, q_pre, k_new, v_new, window)
        else:
            k_cached, v_cached = (source or prompt).layer(layer, k_new)  # (T, Hkv, D) each
            cached = (k_cached, v_cached)
            # the kernel writes a model-dtype cache in place; fp8 rows are quantized below
            dst = None if kv_out is None or kv_out.fp8 else (kv_out.k[layer, : st.T], kv_out.v[layer, : st.T])
            cos_all, sin_all = st.ropes[layer]
            k_rot, v_all = K.rerotate_scatter(
                k_cached,
                v_cached,
                st.cur_dev,
                k_new.contiguous(),
                v_new.contiguous(),
                cos_all,
                sin_all,
                inv=st.inv,
                out=dst,
            )
            if kv_out is not None and dst is None:  # fp8: the rows quantized into the cache
                kv_out.write(layer, slice(0, st.T), k_rot, v_all)
            if st.captured is not None:
                kp = k_cached.clone()
                kp[st.cur_dev] = k_new
                st.captured.append(kp)
            q = K.apply_rope(q_pre, *st.ropes_cur[layer])
            masks = None if st.masks is None else st.masks[window]
            n = st.b  # a first slice sees keys 0..b-1 (it wrote every cached row of the prompt)
            attn = attend(q, k_rot[:n], v_all[:n], st.cur_dev, adapter.scale, masks, window)  # (R, H, D)
        st.h = adapter.mlp(layer, adapter.attn_out(layer, st.h, attn))
        nxt = None
        if on_layer_end is not None:
            assert cached is not None
            nxt = on_layer_end(LayerState(layer, st.cur, k_new, v_new, cached[0], cached[1]))
        if nxt is None and layer + 1 == full_layers and full_layers > 0:
            nxt = rows
        if nxt is not None:
            nxt = nxt.to(torch.int64).cpu()
            _check_rows(nxt, prompt)
            st.h = st.h[to_device(_positions_in(st.cur, nxt), dev)]
            st.narrow(adapter, nxt, layer + 1)
        st.layer_ms.append((time.perf_counter() - t0) * 1e3)
    if kv_out is not None:
        kv_out.length = st.b
    # logits of the prompt's last rows: none for a slice before the last
    if st.b < st.T:
        logits = st.h.new_empty((0, 0))
    else:
        logits = adapter.logits(st.h if logits_last is None else st.h[-logits_last:])
    captured = torch.stack(st.captured) if st.captured is not None else None
    return PrefillOutput(logits, st.cur, st.layer_ms, captured, st.row_sets)


class _Fusing:
    """The layer loop's state: the current rows (a host copy, and on the device), their RoPE
    rows and masks, the hidden states; for a slice ([a, b)) its key range: keys 0..b-1."""

    def __init__(
        self,
        adapter: ModelAdapter,
        prompt: FusedPrompt,
        rows: torch.Tensor,
        full_layers: int,
        on_layer_end: Callable[[LayerState], torch.Tensor | None] | None,
        kv_out: KVCache | None,
        logits_last: int | None,
        capture_pre_rope: bool,
        span: tuple[int, int] | None,
    ) -> None:
        self.T = prompt.num_tokens
        self.kv_out = kv_out
        if logits_last is not None and logits_last < 1:
            raise ValueError(f"logits_last must be >= 1 or None, got {logits_last}")
        self.a, self.b = span if span is not None else (0, self.T)
        if span is not None:
            if not 0 <= self.a < self.b <= self.T:
                raise ValueError(f"span {span} is not within the prompt's {self.T} positions")
            if kv_out is None or full_layers or on_layer_end is not None or capture_pre_rope:
                raise ValueError("a slice needs kv_out, and no full_layers, on_layer_end or capture_pre_rope")
        rows = rows.to(torch.int64).cpu()
        _check_rows(rows, prompt, (self.a, self.b))
        dev = adapter.device
        # device copies made once per row set (not per layer): no host syncs in the layer loop
        self.ropes = adapter.rope_layers(torch.arange(self.T, device=dev), max_position=self.T - 1)
        self.captured: list[torch.Tensor] | None = [] if capture_pre_rope else None
        self.layer_ms: list[float] = []
        self.row_sets: list[tuple[int, torch.Tensor]] = []
        self.narrow(adapter, torch.arange(self.T) if full_layers > 0 else rows, 0)
        self.h = adapter.embed(prompt.token_ids[self.cur])  # (R, hidden)

    def narrow(self, adapter: ModelAdapter, rows: torch.Tensor, layer: int) -> None:
        """Recompute `rows` from `layer` on (the hidden states are cut by the caller)."""
        self.cur = rows
        self.row_sets.append((layer, rows))
        self.cur_dev = to_device(rows, adapter.device)
        self.ropes_cur = _rows_of(self.ropes, self.cur_dev)  # per layer (R, D) cos, sin
        self.inv = K.inverse_rows(self.cur_dev, self.T)  # (T,) position -> row index or -1
        self.masks = _masks_for(rows, self.b, adapter)


def _later_slice(
    adapter: ModelAdapter,
    st: _Fusing,
    layer: int,
    q_pre: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """Attention of a slice after the first (span [a, b), a > 0) at `layer`: its rows' rotated
    K/V written into kv_out at their positions, then its rows attend to kv_out's keys 0..b-1 -
    the rows of earlier slices as they recomputed them, the cached rows as the first slice
    laid them down, its own fresh rows. Exact by causality: no row sees a later position."""
    kv = st.kv_out
    assert kv is not None
    cos, sin = st.ropes_cur[layer]
    kv.write(layer, st.cur_dev, K.apply_rope(k_new, cos, sin), v_new)
    q = K.apply_rope(q_pre, cos, sin)
    masks = None if st.masks is None else st.masks[window]
    return attend(q, *kv.read(layer, 0, st.b), st.cur_dev, adapter.scale, masks, window)


def _rows_of(
    ropes: list[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the (cos, sin) rows at `rows`; layers sharing a table share the result."""
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for cos, sin in ropes:
        if id(cos) not in done:
            done[id(cos)] = (cos[rows], sin[rows])
    return [done[id(cos)] for cos, _ in ropes]


def _masks_for(rows: torch.Tensor, T: int, adapter: ModelAdapter):
    """The row-block masks of a row set per window of the model (`adapter.windows` values),
    None where SDPA needs none (every row, full attention) or when a kernel runs sparse rows."""
    full = rows.shape[0] == T
    if not full and K.backend() != "torch":
        return None
    out = {}
    for w in set(adapter.windows):
        eff = w if w is not None and w < T else None
        out[w] = None if full and eff is None else row_masks(rows, T, adapter.dtype, adapter.device, eff)
    return out if any(m is not None for m in out.values()) else None


def _check_rows(rows: torch.Tensor, prompt: FusedPrompt, span: tuple[int, int] | None = None) -> None:
    """rows: sorted, unique, within the span [a, b) (default: the whole prompt), ending at its
    last position, every uncached position of the span among them."""
    T = prompt.num_tokens
    a, b = span if span is not None else (0, T)
    if rows.dim() != 1 or rows.numel() == 0:
        raise ValueError("rows must be a non-empty 1-D tensor of positions")
    if rows[0] < a or rows[-1] != b - 1 or (rows.numel() > 1 and not bool((rows[1:] > rows[:-1]).all())):
        raise ValueError("rows must be sorted, unique, within [0, T) and include the last position")
    need = prompt.uncached_mask()[a:b]
    have = torch.zeros(b - a, dtype=torch.bool)
    have[rows - a] = True
    if bool((need & ~have).any()):
        raise ValueError("every uncached position (glue text, suffix) must be recomputed")


def _positions_in(cur: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
    """Indices into `cur` of the positions in `sub` (sub must be a subset of cur)."""
    idx = torch.searchsorted(cur, sub)
    if bool((idx >= cur.numel()).any()) or not bool((cur[idx.clamp(max=cur.numel() - 1)] == sub).all()):
        raise ValueError("a narrowed row set must be a subset of the current rows")
    return idx


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One token's attention over the keys it sees: q (1, H, D), k and v (n, Hkv, D) (post-RoPE
    keys, any GQA grouping) -> (1, H, D) in q's dtype.

    Plain products and a softmax in fp32 - the same bits every time. On the H200 the fused
    SDPA kernels were not repeatable in decode: the same 16-step greedy decode run twice
    (Llama-3.1-8B shape, bf16, 4K context) gave identical logits at 8 of 16 steps with the
    default backend and 16 of 16 with the math backend (docs/determinism.md)."""
    n, Hkv, D = k.shape
    H = q.shape[1]
    qg = q[0].reshape(Hkv, H // Hkv, D).float()  # query heads grouped by their KV head
    scores = torch.bmm(qg, k.permute(1, 2, 0).float()) * scale  # (Hkv, G, n)
    out = torch.bmm(torch.softmax(scores, dim=-1), v.transpose(0, 1).float())  # (Hkv, G, D)
    return out.reshape(1, H, D).to(q.dtype)


@torch.inference_mode()
def decode_step(adapter: ModelAdapter, cache: KVCache, token_id: int) -> torch.Tensor:
    """Append one token at position cache.length; returns its logits (vocab,) fp32."""
    pos = cache.length
    if pos >= cache.capacity:
        raise ValueError(f"KV cache full ({cache.capacity} tokens)")
    dev = adapter.device
    positions = torch.tensor([pos], device=dev)
    ropes = adapter.rope_layers(positions, max_position=pos)
    h = adapter.embed(torch.tensor([token_id], device=dev))  # (1, hidden)
    for layer in range(adapter.num_layers):
        cos, sin = ropes[layer]
        q, k, v = adapter.qkv(layer, adapter.attn_norm(layer, h))
        cache.write(layer, pos, K.apply_rope(k, cos, sin)[0], v[0])
        q = K.apply_rope(q, cos, sin)
        w = adapter.windows[layer]
        lo = 0 if w is None else max(0, pos + 1 - w)  # a sliding layer sees its last W keys
        out = decode_attention(q, *cache.read(layer, lo, pos + 1), adapter.scale)
        h = adapter.mlp(layer, adapter.attn_out(layer, h, out))
    cache.length = pos + 1
    return adapter.logits(h)[0]


def fill_from_hf(cache: KVCache, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy HF's per-layer (post-RoPE k, v) (T, Hkv, D) into our cache."""
    T = kv[0][0].shape[0]
    for layer, (k, v) in enumerate(kv):
        cache.write(layer, slice(0, T), k, v)
    cache.length = T
