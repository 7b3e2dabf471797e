"""The query probe: suffix rows through the first layers against a compressed context.

QCFuse asks the query which context tokens matter before fusing (algorithm.md section 3.2).
The probe runs only the S suffix tokens, at their true positions, through layers
0..last, attending to a per-layer context of cached entries - the prefix cache plus every
chunk's anchors, each at its true global position:

    global:   0      P        s1            e1   s2            e2        T-S       T-1
              [prefix][chunk 1 ............ ][gl][chunk 2 ....... ]  ...  [suffix ... ]
    context:  all     a a   a    a  a            a   a a    a                  (none)
    queries:                                                               q q q ... q

Query row i (position p_i) sees every context entry (all precede the suffix) and the query
rows at positions <= p_i. Cost: S x (P + anchors) per layer - a few dozen rows against a
few hundred keys. With every context token as an anchor the probe equals an ordinary
prefill of the prompt restricted to the suffix rows (tests/test_probe.py checks this).

`context_keys` and `query_mass` score the context at one layer from the probe's output:
softmax of the probed Q over [all context K at global positions ; the query's own K], the
mass each context key receives averaged over heads and query rows (`attention_mass`).

On a GPU the probe is launch-bound (32 rows through 17 layers of an 8B model is ~2 ms of
weight reads but ~250 kernel launches from Python), so its layer loop is captured once per
shape bucket as a CUDA graph and replayed (`run_probe(graphs=...)`).

Math only: no I/O, no store.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import qcfuse_kernels as K
from qcfuse_core.fusion import FusedPrompt, Segment
from qcfuse_core.model import ModelAdapter, to_device

log = logging.getLogger(__name__)


@dataclass
class LayerContext:
    """The cached entries the probe attends to at one layer (N entries, any order)."""

    k_pre: torch.Tensor  # (N, Hkv, D) pre-RoPE
    v: torch.Tensor  # (N, Hkv, D)
    pos: torch.Tensor  # (N,) int64 absolute positions, all < the first query position


@dataclass
class ProbeContext:
    """Every probed layer's context stacked: the same N entries per layer (their picks differ)."""

    k_pre: torch.Tensor  # (Lp, N, Hkv, D) pre-RoPE
    v: torch.Tensor  # (Lp, N, Hkv, D)
    pos: torch.Tensor  # (Lp, N) int64 on the host

    def __len__(self) -> int:
        return int(self.k_pre.shape[0])

    def __getitem__(self, layer: int) -> LayerContext:
        return LayerContext(self.k_pre[layer], self.v[layer], self.pos[layer])

    def head(self, n: int) -> "ProbeContext":
        return ProbeContext(self.k_pre[:n], self.v[:n], self.pos[:n])


@dataclass
class ProbeResult:
    """Rotated Q and K of the query rows at the kept layers, and the last hidden state."""

    q: dict[int, torch.Tensor]  # layer -> (S, H, D) rotated to the query positions
    k: dict[int, torch.Tensor]  # layer -> (S, Hkv, D) rotated
    hidden: torch.Tensor | None  # (S, hidden) after the last probed layer (None unless asked for)
    layer_ms: list[float] = field(default_factory=list)  # host time per layer (eager runs only)
    context_sizes: list[int] = field(default_factory=list)  # N per probed layer
    elapsed_ms: float = 0.0  # host time of the whole probe (a CUDA-graph replay does not wait)
    graphed: bool = False  # replayed from a captured CUDA graph


AnchorPick = Callable[[Segment], torch.Tensor | None]
"""segment -> (L', n) local anchor indices per layer, or None for all of its tokens."""


def gather_context(prompt: FusedPrompt, num_layers: int, pick: AnchorPick | None = None) -> ProbeContext:
    """Per layer 0..num_layers-1: the prefix cache plus each chunk's picked entries.

    The prefix is always whole (its cache is exact). Chunks contribute `pick(segment)[l]`
    (local indices) or all their tokens when `pick` is None or returns None. Uncached
    segments (glue text, suffix) contribute nothing.

    Built batched over layers (a segment picks the same number of entries at every layer):
    one gather per segment and one concatenation, then a per-layer view - a few dozen tensor
    ops per request instead of a few per segment and layer.
    """
    ks, vs, ps = [], [], []  # per segment: (Lp, n, Hkv, D) x2, (Lp, n)
    layers = torch.arange(num_layers)
    for s, start in zip(prompt.segments, prompt.starts):
        if s.chunk is None or s.kind not in ("prefix", "chunk"):
            continue
        idx = pick(s) if (pick is not None and s.kind == "chunk") else None
        if idx is None:
            k = _stack_layers(s.chunk.k, num_layers)
            v = _stack_layers(s.chunk.v, num_layers)
            local = torch.arange(len(s)).expand(num_layers, -1)
        else:
            if idx.shape[0] < num_layers:
                raise ValueError(f"anchors cover {idx.shape[0]} layers; the probe needs {num_layers}")
            local = idx[:num_layers].to(torch.int64)  # (Lp, n)
            view_k = getattr(s.chunk, "anchor_k", None)  # a ChunkView serving anchors from its sidecar
            if view_k is not None and torch.equal(local, s.chunk.anchor_idx[:num_layers].to(torch.int64)):
                k, v = view_k[:num_layers], s.chunk.anchor_v[:num_layers]
            else:
                k = s.chunk.k[:num_layers]
                v = s.chunk.v[:num_layers]
                sel = to_device(local, k.device)
                k, v = k[layers.to(k.device)[:, None], sel], v[layers.to(v.device)[:, None], sel]
        ks.append(k)
        vs.append(v)
        ps.append(local + start)
    if not ks:
        raise ValueError("the probe needs at least one cached segment (prefix or chunk)")
    dev = ks[0].device
    k_all = torch.cat([k.to(dev) for k in ks], dim=1)  # (Lp, N, Hkv, D)
    v_all = torch.cat([v.to(dev) for v in vs], dim=1)
    p_all = torch.cat(ps, dim=1)  # (Lp, N) host
    return ProbeContext(k_all, v_all, p_all)


def _stack_layers(layers, n: int) -> torch.Tensor:
    """chunk.k[:n] as one (n, T, Hkv, D) tensor (KVChunk tensors slice; views stack)."""
    got = layers[:n]
    return got if isinstance(got, torch.Tensor) else torch.stack([layers[l] for l in range(n)])


PAD_ROWS = 16  # CUDA-graph buckets: query rows rounded up to a multiple of this
PAD_CONTEXT = 256  # ... and context entries per layer
HIDDEN = torch.iinfo(torch.int64).max  # position of a padding entry: no query row sees it
MAX_GRAPHS = 4  # captured probe graphs kept per model (least recently used dropped)


def stack_context(context: "ProbeContext | Sequence[LayerContext]", num_layers: int) -> ProbeContext:
    """The first `num_layers` layers of `context` as one ProbeContext (per-layer lists stacked)."""
    if len(context) < num_layers:
        raise ValueError(f"context covers {len(context)} layers; the probe needs {num_layers}")
    if isinstance(context, ProbeContext):
        return context.head(num_layers)
    layers = [context[l] for l in range(num_layers)]
    if len({int(c.pos.numel()) for c in layers}) != 1:
        raise ValueError("every probed layer needs the same number of context entries")
    dev = layers[0].k_pre.device
    return ProbeContext(torch.stack([c.k_pre.to(dev) for c in layers]), torch.stack([c.v.to(dev) for c in layers]),
                        torch.stack([c.pos.to(torch.int64).cpu() for c in layers]))


@torch.inference_mode()
def run_probe(
    adapter: ModelAdapter,
    ids: torch.Tensor,
    positions: torch.Tensor,
    context: "ProbeContext | Sequence[LayerContext]",
    keep: Sequence[int],
    *,
    graphs: bool | None = None,
    pad: bool = False,
    hidden: bool = False,
) -> ProbeResult:
    """ids, positions (S,) -> ProbeResult with q/k kept at `keep` layers.

    Runs layers 0..max(keep); `context[l]` is what layer l attends to besides the query.
    graphs: replay a captured CUDA graph of the layer loop (default: on for CUDA unless
    QCFUSE_PROBE_GRAPHS=0). The probe is a few dozen rows per layer, so eagerly it is bound
    by kernel launches, not by the GPU; a graph replays all layers in one launch. Graphs are
    captured per bucket (rows rounded up to PAD_ROWS, context entries to PAD_CONTEXT), and
    the padding is invisible: padded context entries sit at position HIDDEN, padded query
    rows after the real ones. pad: use the padded layout without a graph (tests).
    hidden: also run the last layer's attention and MLP and return its output (tests; a
    selection needs only that layer's Q and K, so by default it stops there).
    """
    if not keep:
        raise ValueError("keep at least one layer")
    last = max(keep)
    if last >= adapter.num_layers or min(keep) < 0:
        raise ValueError(f"probe layers must lie in [0, {adapter.num_layers}), got {sorted(keep)}")
    ctx = stack_context(context, last + 1)
    pos = positions.to(torch.int64).cpu()
    if bool((ctx.pos >= pos.min()).any()):  # checked on the host copy: no device sync
        raise ValueError("every context entry must precede the first query position")
    t0 = time.perf_counter()
    dev, dtype = adapter.device, adapter.dtype
    Lp, N = ctx.pos.shape
    S = int(pos.numel())
    use_graph = _graphs_enabled(adapter) if graphs is None else bool(graphs)
    if use_graph and dev.type != "cuda":
        raise ValueError("CUDA graphs need the model on a CUDA device")
    Sp, Np = (_round_up(S, PAD_ROWS), _round_up(N, PAD_CONTEXT)) if (use_graph or pad) else (S, N)
    # every position this probe touches goes to the device in one copy; the context keys of
    # all layers are rotated at once, outside the layer loop
    # (and the token ids with them: one pinned copy)
    q_pos = torch.cat([pos, pos[-1] + 1 + torch.arange(Sp - S)])
    ids_host = ids.to(torch.int64).cpu()
    if Sp > S:
        ids_host = torch.cat([ids_host, ids_host.new_zeros(Sp - S)])
    staged = to_device(torch.cat([q_pos, ctx.pos.reshape(-1), ids_host]), dev)
    all_pos, ids = staged[: Sp + Lp * N], staged[Sp + Lp * N :]
    groups, tables = _rope_groups(adapter, all_pos, int(q_pos[-1]))  # one RoPE table per group of layers
    if len(tables) == 1:
        cos, sin = tables[0][0][None], tables[0][1][None]  # (1, Sp + Lp*N, D) views
    else:
        cos = torch.stack([c for c, _ in tables])  # (G, Sp + Lp*N, D)
        sin = torch.stack([s_ for _, s_ in tables])
    q_pos_dev, ctx_pos_dev = all_pos[:Sp], all_pos[Sp:].view(Lp, N)
    k_flat = ctx.k_pre.to(dev, dtype).reshape(Lp * N, *ctx.k_pre.shape[2:])
    rotated = [K.apply_rope(k_flat, cos[g, Sp:], sin[g, Sp:]).view(Lp, N, *k_flat.shape[1:])
               for g in range(len(tables))]
    k_rot = rotated[0] if len(rotated) == 1 else torch.stack([rotated[groups[l]][l] for l in range(Lp)])
    v = ctx.v.to(dev, dtype)
    inputs = _ProbeInputs(ids, cos[:, :Sp], sin[:, :Sp], q_pos_dev, k_rot, v, ctx_pos_dev)
    res = ProbeResult({}, {}, ids, context_sizes=[N] * Lp)
    if use_graph:
        try:
            qs, ks, h = _graph_cache(adapter).run(adapter, inputs, Sp, Np, tuple(sorted(set(keep))), Lp, hidden)
            res.graphed = True
        except Exception as e:  # noqa: BLE001 - a capture failure must not fail the request
            _graph_cache(adapter).broken = True
            log.warning("probe CUDA graph capture failed (%s); running the probe eagerly from now on", e)
            use_graph = False
    if not use_graph:
        if Np > N:
            inputs = inputs.padded(Np)
        qs, ks, h = _probe_layers(adapter, inputs, Lp, set(keep), res.layer_ms, hidden)
    res.q = {l: q[:S] for l, q in qs.items()}
    res.k = {l: k[:S] for l, k in ks.items()}
    res.hidden = h[:S] if h is not None else None
    res.elapsed_ms = (time.perf_counter() - t0) * 1e3
    return res


def _rope_groups(adapter: ModelAdapter, positions: torch.Tensor,
                 max_position: int | None = None) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
    """-> (per layer its group's index, per group (cos, sin) at `positions`): layers sharing a
    RoPE form one group (one group except for Gemma 3's local and global layers)."""
    ropes = adapter.rope_layers(positions, max_position=max_position)
    index: dict[int, int] = {}
    tables = []
    for cos, sin in ropes:
        if id(cos) not in index:
            index[id(cos)] = len(tables)
            tables.append((cos, sin))
    return [index[id(cos)] for cos, _ in ropes], tables


def _group_index(adapter: ModelAdapter) -> list[int]:
    """Per layer, its RoPE group's index in `_rope_groups`' order (first appearance)."""
    order = list(dict.fromkeys(adapter.rope_keys))
    return [order.index(key) for key in adapter.rope_keys]


def _round_up(n: int, m: int) -> int:
    return max(m, -(-n // m) * m)


@dataclass
class _ProbeInputs:
    """Device inputs of the probe's layer loop (also a CUDA graph's static buffers)."""

    ids: torch.Tensor  # (S,) int64
    cos: torch.Tensor  # (G, S, D) fp32 at the query positions, per RoPE group (`_rope_groups`)
    sin: torch.Tensor
    q_pos: torch.Tensor  # (S,) int64
    k_rot: torch.Tensor  # (Lp, N, Hkv, D) rotated context keys
    v: torch.Tensor  # (Lp, N, Hkv, D)
    k_pos: torch.Tensor  # (Lp, N) int64; HIDDEN marks padding

    def padded(self, n: int) -> "_ProbeInputs":
        """The same inputs with the context padded to n entries per layer (hidden entries)."""
        Lp, N = self.k_pos.shape
        extra = n - N
        pad_k = self.k_rot.new_zeros(Lp, extra, *self.k_rot.shape[2:])
        return _ProbeInputs(self.ids, self.cos, self.sin, self.q_pos, torch.cat([self.k_rot, pad_k], 1),
                            torch.cat([self.v, pad_k], 1), torch.cat([self.k_pos, self.k_pos.new_full((Lp, extra), HIDDEN)], 1))

    @classmethod
    def empty(cls, adapter: ModelAdapter, S: int, N: int, Lp: int) -> "_ProbeInputs":
        dev, dtype, sh = adapter.device, adapter.dtype, adapter.shape
        kv = (Lp, N, sh.num_kv_heads, sh.head_dim)
        G = len(set(adapter.rope_keys))
        return cls(torch.zeros(S, dtype=torch.int64, device=dev), torch.ones(G, S, sh.head_dim, device=dev),
                   torch.zeros(G, S, sh.head_dim, device=dev), torch.arange(S, device=dev),
                   torch.zeros(kv, dtype=dtype, device=dev), torch.zeros(kv, dtype=dtype, device=dev),
                   torch.full((Lp, N), HIDDEN, dtype=torch.int64, device=dev))

    def load(self, src: "_ProbeInputs") -> None:
        """Copy `src` (fewer or equal rows / entries) into these buffers; the rest is hidden."""
        S, N = src.ids.shape[0], src.k_pos.shape[1]
        self.ids[:S].copy_(src.ids)
        self.cos[:, :S].copy_(src.cos)
        self.sin[:, :S].copy_(src.sin)
        self.q_pos[:S].copy_(src.q_pos)
        self.k_rot[:, :N].copy_(src.k_rot)
        self.v[:, :N].copy_(src.v)
        self.k_pos[:, :N].copy_(src.k_pos)
        self.k_pos[:, N:].fill_(HIDDEN)


def _probe_layers(adapter: ModelAdapter, x: _ProbeInputs, Lp: int, keep: set[int],
                  layer_ms: list[float] | None = None, hidden: bool = True) -> tuple[dict, dict, torch.Tensor]:
    """The layer loop over fixed-shape device tensors (graph-capturable: no host syncs).
    Without `hidden` the last layer stops after its Q and K (its attention and MLP would only
    feed the hidden state)."""
    qs, ks = {}, {}
    h = adapter.embed(x.ids)  # (S, hidden)
    visible_q = x.q_pos[None, :] <= x.q_pos[:, None]  # (S, S) query rows among themselves
    groups = _group_index(adapter)
    for layer in range(Lp):
        t0 = time.perf_counter()
        q_pre, k_new, v_new = adapter.qkv(layer, adapter.attn_norm(layer, h))  # (S,H,D), (S,Hkv,D) x2
        cos, sin = x.cos[groups[layer]], x.sin[groups[layer]]
        q = K.apply_rope(q_pre, cos, sin)
        kq = K.apply_rope(k_new, cos, sin)
        if layer in keep:
            qs[layer], ks[layer] = q, kq
        if layer == Lp - 1 and not hidden:
            if layer_ms is not None:
                layer_ms.append((time.perf_counter() - t0) * 1e3)
            break
        keys = torch.cat([x.k_rot[layer], kq])  # (N+S, Hkv, D)
        vals = torch.cat([x.v[layer], v_new])
        visible = torch.cat([x.k_pos[layer][None, :] <= x.q_pos[:, None], visible_q], dim=1)  # (S, N+S)
        window = adapter.windows[layer]
        if window is not None:  # a sliding layer: only keys p - W < j <= p
            k_pos = torch.cat([x.k_pos[layer], x.q_pos])
            visible = visible & (k_pos[None, :] > x.q_pos[:, None] - window)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], vals.transpose(0, 1)[None],
            attn_mask=visible[None, None], scale=adapter.scale, enable_gqa=True,
        )[0].transpose(0, 1)  # (S, H, D)
        h = adapter.mlp(layer, adapter.attn_out(layer, h, attn))
        if layer_ms is not None:
            layer_ms.append((time.perf_counter() - t0) * 1e3)
    return qs, ks, (h if hidden else None)


class _ProbeGraph:
    """One captured layer loop: static input buffers, the graph, its output tensors."""

    def __init__(self, adapter: ModelAdapter, S: int, N: int, Lp: int, keep: tuple[int, ...], hidden: bool) -> None:
        self.inputs = _ProbeInputs.empty(adapter, S, N, Lp)
        dev = adapter.device
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up: kernels compiled, cuBLAS workspaces made
            _probe_layers(adapter, self.inputs, Lp, set(keep), hidden=hidden)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the prefetcher's loader thread keeps issuing copies while we capture
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.out = _probe_layers(adapter, self.inputs, Lp, set(keep), hidden=hidden)

    def run(self, x: _ProbeInputs) -> tuple[dict, dict, torch.Tensor]:
        self.inputs.load(x)
        self.graph.replay()
        qs, ks, h = self.out  # overwritten by the next replay: hand out copies
        return {l: q.clone() for l, q in qs.items()}, {l: k.clone() for l, k in ks.items()}, h.clone() if h is not None else None


class _GraphCache:
    def __init__(self) -> None:
        self.graphs: OrderedDict[tuple, _ProbeGraph] = OrderedDict()
        self.lock = threading.Lock()
        self.broken = False  # a capture failed: this model's probe runs eagerly from then on

    def run(self, adapter: ModelAdapter, x: _ProbeInputs, S: int, N: int, keep: tuple[int, ...], Lp: int,
            hidden: bool):
        key = (S, N, Lp, keep, adapter.dtype, hidden)
        with self.lock:
            g = self.graphs.get(key)
            if g is None:
                g = _ProbeGraph(adapter, S, N, Lp, keep, hidden)
                self.graphs[key] = g
                while len(self.graphs) > MAX_GRAPHS:
                    self.graphs.popitem(last=False)
            self.graphs.move_to_end(key)
            return g.run(x)


_CACHES: "weakref.WeakKeyDictionary[ModelAdapter, _GraphCache]" = weakref.WeakKeyDictionary()


def _graph_cache(adapter: ModelAdapter) -> _GraphCache:
    cache = _CACHES.get(adapter)
    if cache is None:
        cache = _CACHES[adapter] = _GraphCache()
    return cache


def _graphs_enabled(adapter: ModelAdapter) -> bool:
    return (adapter.device.type == "cuda" and os.environ.get("QCFUSE_PROBE_GRAPHS", "1") != "0"
            and not _graph_cache(adapter).broken)


def context_keys(adapter: ModelAdapter, prompt: FusedPrompt, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All cached context keys of `layer` rotated to their global positions.

    -> k_rot (N, Hkv, D), pos (N,) over prefix and chunk tokens in prompt order (glue text
    has no cache and is left out; it is always recomputed anyway).
    """
    return context_keys_at(adapter, prompt, [layer])[0]


def context_keys_at(adapter: ModelAdapter, prompt: FusedPrompt, layers: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`context_keys` for several layers: the positions and their cos/sin are built once."""
    segs = [(s, start) for s, start in zip(prompt.segments, prompt.starts) if s.chunk is not None and s.kind in ("prefix", "chunk")]
    pos = torch.cat([torch.arange(start, start + len(s)) for s, start in segs])
    ropes = adapter.rope_layers(pos)  # host positions: a table lookup on CUDA (ModelAdapter.rope)
    out = []
    for layer in layers:
        k = torch.cat([s.chunk.k[layer].to(adapter.device, adapter.dtype) for s, _ in segs])
        out.append((K.apply_rope(k, *ropes[layer]), pos))
    return out


def query_mass(q: torch.Tensor, k_ctx: torch.Tensor, k_query: torch.Tensor, scale: float, last: int = 0, *,
               window: int | None = None, ctx_pos: torch.Tensor | None = None, q_start: int | None = None) -> torch.Tensor:
    """Mass each context key receives from the query rows, averaged over heads and rows.

    q (S, H, D) and k_query (S, Hkv, D) rotated at the query positions; k_ctx (N, Hkv, D)
    rotated at positions that all precede the query -> (N,) fp32. Keys are laid out
    [context ; query] so index order is causal order; query row i sees all N context keys
    and query keys 0..i. last > 0 averages over the last `last` query rows only (each still
    sees every query key before it); 0, or last >= S, over all of them. Uses
    `qcfuse_kernels.attention_mass` (Triton on a GPU).

    A sliding-window layer (`window` W) needs the true positions: the context's `ctx_pos` (N,)
    and the first query row's `q_start` (query rows sit at q_start, q_start + 1, ...); a row
    at p then gives mass only to keys p - W < j <= p (context further back gets none, as in
    the model), computed in fp32 by PyTorch (a few dozen rows).
    """
    N, S = k_ctx.shape[0], q.shape[0]
    if last < 0:
        raise ValueError(f"last must be >= 0, got {last}")
    R = S if last == 0 else min(last, S)
    if window is not None:
        if ctx_pos is None or q_start is None:
            raise ValueError("a windowed layer's mass needs ctx_pos and q_start")
        return _window_mass(q[S - R :], torch.cat([k_ctx, k_query.to(k_ctx.dtype)]), ctx_pos, q_start, S, scale, window)[:N]
    keys = torch.cat([k_ctx, k_query.to(k_ctx.dtype)]).contiguous()  # (N+S, Hkv, D)
    q_pos = torch.arange(N + S - R, N + S, device=keys.device)
    mass = K.attention_mass(q[S - R :].to(keys.dtype).contiguous(), keys, q_pos, scale)  # (N+S,)
    return mass[:N]


def _window_mass(q: torch.Tensor, keys: torch.Tensor, ctx_pos: torch.Tensor, q_start: int, S: int, scale: float,
                 window: int) -> torch.Tensor:
    """`query_mass` of the last R query rows q (R, H, D) over keys (N+S, Hkv, D) laid out
    [context ; query] in a sliding layer of width `window` -> (N+S,) fp32."""
    R, H, _ = q.shape
    dev = keys.device
    k_pos = torch.cat([to_device(ctx_pos.to(torch.int64), dev), q_start + torch.arange(S, device=dev)])
    r_pos = q_start + torch.arange(S - R, S, device=dev)
    visible = (k_pos[None, :] <= r_pos[:, None]) & (k_pos[None, :] > r_pos[:, None] - window)  # (R, N+S)
    kf = keys.float().repeat_interleave(H // keys.shape[1], dim=1).transpose(0, 1)  # (H, N+S, D)
    scores = torch.matmul(q.float().transpose(0, 1), kf.transpose(1, 2)) * scale  # (H, R, N+S)
    probs = torch.softmax(scores.masked_fill(~visible[None], float("-inf")), dim=-1)
    return probs.mean(dim=(0, 1))
