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

Math only: no I/O, no store.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import qcfuse_kernels as K
from qcfuse_core.fusion import FusedPrompt, Segment
from qcfuse_core.model import ModelAdapter


@dataclass
class LayerContext:
    """The cached entries the probe attends to at one layer (N entries, any order)."""

    k_pre: torch.Tensor  # (N, Hkv, D) pre-RoPE
    v: torch.Tensor  # (N, Hkv, D)
    pos: torch.Tensor  # (N,) int64 absolute positions, all < the first query position


@dataclass
class ProbeResult:
    """Rotated Q and K of the query rows at the kept layers, and the last hidden state."""

    q: dict[int, torch.Tensor]  # layer -> (S, H, D) rotated to the query positions
    k: dict[int, torch.Tensor]  # layer -> (S, Hkv, D) rotated
    hidden: torch.Tensor  # (S, hidden) after the last probed layer
    layer_ms: list[float] = field(default_factory=list)
    context_sizes: list[int] = field(default_factory=list)  # N per probed layer


AnchorPick = Callable[[Segment], torch.Tensor | None]
"""segment -> (L', n) local anchor indices per layer, or None for all of its tokens."""


def gather_context(prompt: FusedPrompt, num_layers: int, pick: AnchorPick | None = None) -> list[LayerContext]:
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
                sel = local.to(k.device)
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
    return [LayerContext(k_all[l], v_all[l], p_all[l]) for l in range(num_layers)]


def _stack_layers(layers, n: int) -> torch.Tensor:
    """chunk.k[:n] as one (n, T, Hkv, D) tensor (KVChunk tensors slice; views stack)."""
    got = layers[:n]
    return got if isinstance(got, torch.Tensor) else torch.stack([layers[l] for l in range(n)])


@torch.inference_mode()
def run_probe(
    adapter: ModelAdapter,
    ids: torch.Tensor,
    positions: torch.Tensor,
    context: Sequence[LayerContext],
    keep: Sequence[int],
) -> ProbeResult:
    """ids, positions (S,) -> ProbeResult with q/k kept at `keep` layers.

    Runs layers 0..max(keep); `context[l]` is what layer l attends to besides the query.
    """
    if not keep:
        raise ValueError("keep at least one layer")
    last = max(keep)
    if last >= adapter.num_layers or min(keep) < 0:
        raise ValueError(f"probe layers must lie in [0, {adapter.num_layers}), got {sorted(keep)}")
    if len(context) <= last:
        raise ValueError(f"context covers {len(context)} layers; the probe needs {last + 1}")
    dev, dtype = adapter.device, adapter.dtype
    pos = positions.to(torch.int64).cpu()
    for ctx in context[: last + 1]:  # checked on the host copies: no device sync
        if bool((ctx.pos >= pos.min()).any()):
            raise ValueError("every context entry must precede the first query position")
    # every position this probe touches goes to the device in one copy; cos/sin come from one table
    sizes = [int(c.pos.numel()) for c in context[: last + 1]]
    all_pos = torch.cat([pos] + [c.pos.to(torch.int64) for c in context[: last + 1]]).to(dev)
    pos_dev, *ctx_pos_dev = all_pos.split([pos.numel()] + sizes)
    cos_t, sin_t = adapter.rope(torch.arange(int(pos.max()) + 1))  # (P, D) for positions 0..max
    cos_q, sin_q = cos_t[pos_dev], sin_t[pos_dev]  # (S, D)
    h = adapter.embed(ids.to(torch.int64))  # (S, hidden)
    res = ProbeResult({}, {}, h)
    for layer in range(last + 1):
        t0 = time.perf_counter()
        ctx, cpos = context[layer], ctx_pos_dev[layer]
        q_pre, k_new, v_new = adapter.qkv(layer, adapter.attn_norm(layer, h))  # (S,H,D), (S,Hkv,D) x2
        q = K.apply_rope(q_pre, cos_q, sin_q)
        kq = K.apply_rope(k_new, cos_q, sin_q)
        kc = K.apply_rope(ctx.k_pre.to(dev, dtype), cos_t[cpos], sin_t[cpos])  # (N, Hkv, D)
        keys = torch.cat([kc, kq])  # (N+S, Hkv, D)
        vals = torch.cat([ctx.v.to(dev, dtype), v_new])
        key_pos = torch.cat([cpos, pos_dev])
        visible = key_pos[None, :] <= pos_dev[:, None]  # (S, N+S)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], vals.transpose(0, 1)[None],
            attn_mask=visible[None, None], scale=adapter.scale, enable_gqa=True,
        )[0].transpose(0, 1)  # (S, H, D)
        h = adapter.mlp(layer, adapter.attn_out(layer, h, attn))
        if layer in keep:
            res.q[layer], res.k[layer] = q, kq
        res.layer_ms.append((time.perf_counter() - t0) * 1e3)
        res.context_sizes.append(sizes[layer])
    res.hidden = h
    return res


def context_keys(adapter: ModelAdapter, prompt: FusedPrompt, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All cached context keys of `layer` rotated to their global positions.

    -> k_rot (N, Hkv, D), pos (N,) over prefix and chunk tokens in prompt order (glue text
    has no cache and is left out; it is always recomputed anyway).
    """
    ks, ps = [], []
    for s, start in zip(prompt.segments, prompt.starts):
        if s.chunk is not None and s.kind in ("prefix", "chunk"):
            ks.append(s.chunk.k[layer])
            ps.append(torch.arange(start, start + len(s)))
    pos = torch.cat(ps)
    cos, sin = adapter.rope(pos)
    return K.apply_rope(torch.cat(ks).to(adapter.device, adapter.dtype), cos, sin), pos


def query_mass(q: torch.Tensor, k_ctx: torch.Tensor, k_query: torch.Tensor, scale: float) -> torch.Tensor:
    """Mass each context key receives from the query rows, averaged over heads and rows.

    q (S, H, D) and k_query (S, Hkv, D) rotated at the query positions; k_ctx (N, Hkv, D)
    rotated at positions that all precede the query -> (N,) fp32. Keys are laid out
    [context ; query] so index order is causal order; query row i sees all N context keys
    and query keys 0..i. Uses `qcfuse_kernels.attention_mass` (Triton on a GPU).
    """
    N, S = k_ctx.shape[0], q.shape[0]
    keys = torch.cat([k_ctx, k_query.to(k_ctx.dtype)]).contiguous()  # (N+S, Hkv, D)
    q_pos = torch.arange(N, N + S, device=keys.device)
    mass = K.attention_mass(q.to(keys.dtype).contiguous(), keys, q_pos, scale)  # (N+S,)
    return mass[:N]
