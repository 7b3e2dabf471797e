"""The query probe: suffix rows through the first layers against a compressed context.

QCFuse asks the query which context tokens matter before fusing (docs/design.md, the method).
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
from typing import Any

import torch
import torch.nn.functional as F

import qcfuse_kernels as K
from qcfuse_core.model.adapter import ModelAdapter, to_device
from qcfuse_core.model.fusion import FusedPrompt, Segment

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
    batch: int = 1  # requests probed in the same pass (their layer and elapsed times are shared)


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
            view: Any = s.chunk  # a ChunkView serves anchors from its sidecar (a KVChunk has none)
            view_k = getattr(view, "anchor_k", None)
            if view_k is not None and torch.equal(local, view.anchor_idx[:num_layers].to(torch.int64)):
                k, v = view_k[:num_layers], view.anchor_v[:num_layers]
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
    return ProbeContext(
        torch.stack([c.k_pre.to(dev) for c in layers]),
        torch.stack([c.v.to(dev) for c in layers]),
        torch.stack([c.pos.to(torch.int64).cpu() for c in layers]),
    )


@dataclass
class ProbeItem:
    """One request's probe in a batch: its query ids and absolute positions (S,), the context
    its query rows attend to, and the layers whose Q/K it keeps."""

    ids: torch.Tensor
    positions: torch.Tensor
    context: "ProbeContext | Sequence[LayerContext]"
    keep: Sequence[int]


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
    return run_probe_batch(adapter, [ProbeItem(ids, positions, context, keep)], graphs=graphs, pad=pad, hidden=hidden)[
        0
    ]


@torch.inference_mode()
def run_probe_batch(
    adapter: ModelAdapter,
    items: Sequence[ProbeItem],
    *,
    graphs: bool | None = None,
    pad: bool = False,
    hidden: bool = False,
) -> list[ProbeResult]:
    """Several requests' probes in one pass over the layers (`run_probe` is a batch of one).

    The query rows of every request are laid end to end, and so are their contexts; each row
    and each context entry carries its request's index, and a row sees only entries and rows
    of its own request (at positions <= its own). Every matrix product (norms, projections,
    MLP) runs once over all rows; one attention call covers every request. A request's Q/K
    come out as when it is probed alone, up to the rounding of products over more rows
    (tests/test_probe_batch.py). Requests probing to different depths run to the deepest;
    a shallower one's context is hidden at the layers beyond its own (their outputs are
    never read).
    """
    if not items:
        return []
    keeps = []
    for it in items:
        if not it.keep:
            raise ValueError("keep at least one layer")
        if max(it.keep) >= adapter.num_layers or min(it.keep) < 0:
            raise ValueError(f"probe layers must lie in [0, {adapter.num_layers}), got {sorted(it.keep)}")
        keeps.append(sorted(set(it.keep)))
    Lp = max(k[-1] for k in keeps) + 1
    ctxs, poss = [], []
    for it, keep in zip(items, keeps):
        ctx = stack_context(it.context, keep[-1] + 1)
        pos = it.positions.to(torch.int64).cpu()
        if pos.numel() == 0:
            raise ValueError("a probe needs at least one query row")
        if bool((ctx.pos >= pos.min()).any()):  # checked on the host copy: no device sync
            raise ValueError("every context entry must precede the first query position")
        ctxs.append(_deepen(ctx, Lp))
        poss.append(pos)
    t0 = time.perf_counter()
    dev, dtype = adapter.device, adapter.dtype
    sizes = [int(p.numel()) for p in poss]
    widths = [int(c.pos.shape[1]) for c in ctxs]
    S, N = sum(sizes), sum(widths)
    pos = torch.cat(poss)
    use_graph = _graphs_enabled(adapter) if graphs is None else bool(graphs)
    if use_graph and dev.type != "cuda":
        raise ValueError("CUDA graphs need the model on a CUDA device")
    Sp, Np = (_round_up(S, PAD_ROWS), _round_up(N, PAD_CONTEXT)) if (use_graph or pad) else (S, N)
    # every position this probe touches goes to the device in one copy; the context keys of
    # all layers are rotated at once, outside the layer loop
    # (and the token ids and request indices with them: one copy)
    top = int(pos.max())
    q_pos = torch.cat([pos, top + 1 + torch.arange(Sp - S)])
    ids_host = torch.cat([it.ids.to(torch.int64).cpu() for it in items])
    if Sp > S:
        ids_host = torch.cat([ids_host, ids_host.new_zeros(Sp - S)])
    q_req = torch.cat(
        [torch.full((n,), b, dtype=torch.int64) for b, n in enumerate(sizes)]
        + [torch.full((Sp - S,), -1, dtype=torch.int64)]
    )
    k_req = torch.cat([torch.full((n,), b, dtype=torch.int64) for b, n in enumerate(widths)])
    ctx_pos = torch.cat([c.pos for c in ctxs], dim=1)  # (Lp, N)
    staged = to_device(torch.cat([q_pos, ctx_pos.reshape(-1), ids_host, q_req, k_req]), dev)
    a, b_ = Sp + Lp * N, Sp + Lp * N + Sp
    all_pos, ids, q_req_dev, k_req_dev = staged[:a], staged[a:b_], staged[b_ : b_ + Sp], staged[b_ + Sp :]
    top_q = int(q_pos.max())
    # a hidden entry (a layer beyond its request's depth) is rotated as if at the last
    # position: its key is never seen
    groups, tables = _rope_groups(adapter, all_pos.clamp(max=top_q) if len(items) > 1 else all_pos, top_q)
    if len(tables) == 1:
        cos, sin = tables[0][0][None], tables[0][1][None]  # (1, Sp + Lp*N, D) views
    else:
        cos = torch.stack([c for c, _ in tables])  # (G, Sp + Lp*N, D)
        sin = torch.stack([s_ for _, s_ in tables])
    q_pos_dev, ctx_pos_dev = all_pos[:Sp], all_pos[Sp:].view(Lp, N)
    k_pre = ctxs[0].k_pre if len(ctxs) == 1 else torch.cat([c.k_pre.to(ctxs[0].k_pre.device) for c in ctxs], dim=1)
    v_ctx = ctxs[0].v if len(ctxs) == 1 else torch.cat([c.v.to(ctxs[0].v.device) for c in ctxs], dim=1)
    k_flat = k_pre.to(dev, dtype).reshape(Lp * N, *k_pre.shape[2:])
    rotated = [
        K.apply_rope(k_flat, cos[g, Sp:], sin[g, Sp:]).view(Lp, N, *k_flat.shape[1:]) for g in range(len(tables))
    ]
    k_rot = rotated[0] if len(rotated) == 1 else torch.stack([rotated[groups[l]][l] for l in range(Lp)])
    v = v_ctx.to(dev, dtype)
    inputs = _ProbeInputs(
        ids, cos[:, :Sp], sin[:, :Sp], q_pos_dev, k_rot, v, ctx_pos_dev, q_req_dev, k_req_dev.expand(Lp, N)
    )
    keep_all = tuple(sorted({l for k in keeps for l in k}))
    layer_ms: list[float] = []
    graphed = False
    if use_graph:
        try:
            qs, ks, h = _graph_cache(adapter).run(adapter, inputs, Sp, Np, keep_all, Lp, hidden)
            graphed = True
        except Exception as e:  # noqa: BLE001 - a capture failure must not fail the request
            _graph_cache(adapter).broken = True
            log.warning("probe CUDA graph capture failed (%s); running the probe eagerly from now on", e)
            use_graph = False
    if not use_graph:
        if Np > N:
            inputs = inputs.padded(Np)
        qs, ks, h = _probe_layers(adapter, inputs, Lp, set(keep_all), layer_ms, hidden)
    elapsed = (time.perf_counter() - t0) * 1e3
    out, start = [], 0
    for n, keep, width in zip(sizes, keeps, widths):
        end = start + n
        res = ProbeResult(
            {l: qs[l][start:end] for l in keep},
            {l: ks[l][start:end] for l in keep},
            h[start:end] if h is not None else None,
            layer_ms=list(layer_ms[: keep[-1] + 1]),
            context_sizes=[width] * (keep[-1] + 1),
            elapsed_ms=elapsed,
            graphed=graphed,
            batch=len(items),
        )
        out.append(res)
        start = end
    return out


def _deepen(ctx: ProbeContext, layers: int) -> ProbeContext:
    """`ctx` over `layers` layers: layers it lacks are hidden entries (position HIDDEN)."""
    have = len(ctx)
    if have >= layers:
        return ctx.head(layers)
    extra = layers - have
    k = ctx.k_pre.new_zeros((extra, *ctx.k_pre.shape[1:]))
    return ProbeContext(
        torch.cat([ctx.k_pre, k]),
        torch.cat([ctx.v, k]),
        torch.cat([ctx.pos, ctx.pos.new_full((extra, ctx.pos.shape[1]), HIDDEN)]),
    )


def _rope_groups(
    adapter: ModelAdapter, positions: torch.Tensor, max_position: int | None = None
) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
    """-> (per layer its group's index, per group (cos, sin) at `positions`): layers sharing a
    RoPE form one group (one group except for Gemma 3's local and global layers)."""
    ropes = adapter.rope_layers(positions, max_position=max_position)
    index: dict[int, int] = {}
    tables: list[tuple[torch.Tensor, torch.Tensor]] = []
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
    q_req: torch.Tensor  # (S,) int64: each query row's request in the batch (-1: padding)
    k_req: torch.Tensor  # (Lp, N) int64: each context entry's request (-1: padding)

    def padded(self, n: int) -> "_ProbeInputs":
        """The same inputs with the context padded to n entries per layer (hidden entries)."""
        Lp, N = self.k_pos.shape
        extra = n - N
        pad_k = self.k_rot.new_zeros(Lp, extra, *self.k_rot.shape[2:])
        return _ProbeInputs(
            self.ids,
            self.cos,
            self.sin,
            self.q_pos,
            torch.cat([self.k_rot, pad_k], 1),
            torch.cat([self.v, pad_k], 1),
            torch.cat([self.k_pos, self.k_pos.new_full((Lp, extra), HIDDEN)], 1),
            self.q_req,
            torch.cat([self.k_req, self.k_req.new_full((Lp, extra), -1)], 1),
        )

    @classmethod
    def empty(cls, adapter: ModelAdapter, S: int, N: int, Lp: int) -> "_ProbeInputs":
        dev, dtype, sh = adapter.device, adapter.dtype, adapter.shape
        kv = (Lp, N, sh.num_kv_heads, sh.head_dim)
        G = len(set(adapter.rope_keys))
        return cls(
            torch.zeros(S, dtype=torch.int64, device=dev),
            torch.ones(G, S, sh.head_dim, device=dev),
            torch.zeros(G, S, sh.head_dim, device=dev),
            torch.arange(S, device=dev),
            torch.zeros(kv, dtype=dtype, device=dev),
            torch.zeros(kv, dtype=dtype, device=dev),
            torch.full((Lp, N), HIDDEN, dtype=torch.int64, device=dev),
            torch.full((S,), -1, dtype=torch.int64, device=dev),
            torch.full((Lp, N), -1, dtype=torch.int64, device=dev),
        )

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
        self.q_req[:S].copy_(src.q_req)
        self.q_req[S:].fill_(-1)
        self.k_req[:, :N].copy_(src.k_req)
        self.k_req[:, N:].fill_(-1)


def _probe_layers(
    adapter: ModelAdapter,
    x: _ProbeInputs,
    Lp: int,
    keep: set[int],
    layer_ms: list[float] | None = None,
    hidden: bool = True,
) -> tuple[dict, dict, torch.Tensor | None]:
    """The layer loop over fixed-shape device tensors (graph-capturable: no host syncs).
    Without `hidden` the last layer stops after its Q and K (its attention and MLP would only
    feed the hidden state)."""
    qs, ks = {}, {}
    h = adapter.embed(x.ids)  # (S, hidden)
    same_q = x.q_req[None, :] == x.q_req[:, None]  # (S, S): rows of one request see each other
    visible_q = (x.q_pos[None, :] <= x.q_pos[:, None]) & same_q  # (S, S) query rows among themselves
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
        own = (x.k_pos[layer][None, :] <= x.q_pos[:, None]) & (x.k_req[layer][None, :] == x.q_req[:, None])
        visible = torch.cat([own, visible_q], dim=1)  # (S, N+S)
        window = adapter.windows[layer]
        if window is not None:  # a sliding layer: only keys p - W < j <= p
            k_pos = torch.cat([x.k_pos[layer], x.q_pos])
            visible = visible & (k_pos[None, :] > x.q_pos[:, None] - window)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            vals.transpose(0, 1)[None],
            attn_mask=visible[None, None],
            scale=adapter.scale,
            enable_gqa=True,
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

    def run(self, x: _ProbeInputs) -> tuple[dict, dict, torch.Tensor | None]:
        self.inputs.load(x)
        self.graph.replay()
        qs, ks, h = self.out  # overwritten by the next replay: hand out copies
        return (
            {l: q.clone() for l, q in qs.items()},
            {l: k.clone() for l, k in ks.items()},
            h.clone() if h is not None else None,
        )


class _GraphCache:
    def __init__(self) -> None:
        self.graphs: OrderedDict[tuple, _ProbeGraph] = OrderedDict()
        self.lock = threading.Lock()
        self.broken = False  # a capture failed: this model's probe runs eagerly from then on

    def run(self, adapter: ModelAdapter, x: _ProbeInputs, S: int, N: int, keep: tuple[int, ...], Lp: int, hidden: bool):
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
    return (
        adapter.device.type == "cuda"
        and os.environ.get("QCFUSE_PROBE_GRAPHS", "1") != "0"
        and not _graph_cache(adapter).broken
    )


def context_keys(adapter: ModelAdapter, prompt: FusedPrompt, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All cached context keys of `layer` rotated to their global positions.

    -> k_rot (N, Hkv, D), pos (N,) over prefix and chunk tokens in prompt order (glue text
    has no cache and is left out; it is always recomputed anyway).
    """
    return context_keys_at(adapter, prompt, [layer])[0]


def context_keys_at(
    adapter: ModelAdapter, prompt: FusedPrompt, layers: Sequence[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`context_keys` for several layers: the positions and their cos/sin are built once."""
    segs = [
        (s.chunk, start, len(s))
        for s, start in zip(prompt.segments, prompt.starts)
        if s.chunk is not None and s.kind in ("prefix", "chunk")
    ]
    pos = torch.cat([torch.arange(start, start + n) for _, start, n in segs])
    ropes = adapter.rope_layers(pos)  # host positions: a table lookup on CUDA (ModelAdapter.rope)
    out = []
    for layer in layers:
        k = torch.cat([c.k[layer].to(adapter.device, adapter.dtype) for c, _, _ in segs])
        out.append((K.apply_rope(k, *ropes[layer]), pos))
    return out


def query_mass(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    k_query: torch.Tensor,
    scale: float,
    last: int = 0,
    *,
    window: int | None = None,
    ctx_pos: torch.Tensor | None = None,
    q_start: int | None = None,
) -> torch.Tensor:
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
        return _window_mass(
            q[S - R :], torch.cat([k_ctx, k_query.to(k_ctx.dtype)]), ctx_pos, q_start, S, scale, window
        )[:N]
    keys = torch.cat([k_ctx, k_query.to(k_ctx.dtype)]).contiguous()  # (N+S, Hkv, D)
    q_pos = torch.arange(N + S - R, N + S, device=keys.device)
    mass = K.attention_mass(q[S - R :].to(keys.dtype).contiguous(), keys, q_pos, scale)  # (N+S,)
    return mass[:N]


def _window_mass(
    q: torch.Tensor, keys: torch.Tensor, ctx_pos: torch.Tensor, q_start: int, S: int, scale: float, window: int
) -> torch.Tensor:
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
