"""One decode step of several sequences at once: `decode_batch` (one matrix product per
weight over every sequence's row) and `decode_steps` (each row alone, bit for bit as
`fusion.decode_step`; benchmarks).

`decode_batch` is the serving path: a weight matrix is read once for the whole batch. A
product over B rows rounds differently from one over 1 row (the BLAS and cuBLAS choose
kernels and summation orders by shape), so a sequence's logits depend on how many others
share its step. With `tile` (the engine's deterministic mode, `deterministic_tile`) every
row-wise operation - norms, projections, the MLP, the LM head - runs on blocks of exactly
`tile` rows, the batch padded with zero rows: a row's arithmetic then has the same shapes
whether it is alone or batched with any others, and the same bits. Attention runs per
sequence over its own cache, as `decode_step` runs it.

`decode_steps`:

`bench quality` decodes a dozen independent sequences per question - every method's greedy
answer and its teacher-forced pass along full prefill's answer - each on its own fused
cache. On a CPU one decode step is bound by reading the weights (SmolLM2-135M in fp32: about
540 MB per token, the LM head alone 113 MB). `decode_steps` advances every sequence by one
token, one weight matrix at a time: a matrix read from memory for the first sequence serves
the others from the CPU's cache.

Every operation still runs on one row of one sequence, with the same calls and shapes as
`decode_step`, so the logits are decode_step's to the bit (a matrix product over several
rows at once would round differently; tests/test_lockstep.py checks with torch.equal). The
one regrouping is the LM head, split by vocabulary rows into blocks that fit the cache; a
one-row product computes each output as its own dot product, so the split changes no bit -
`head_blocks_exact` checks that once per model on this machine and the whole head is used
otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

import qcfuse_kernels as K
from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.model.fusion import KVCache, decode_attention, decode_step

# Rows per block in the deterministic mode. On a GPU a decode GEMM of up to 32 rows costs
# what one row costs (the weights' read bounds it), so a batch of up to 32 pays nothing;
# on a CPU the product's arithmetic grows with the rows, so blocks stay small.
CUDA_TILE = 32
CPU_TILE = 4

HEAD_BLOCK = 1024  # LM-head rows per block (576-wide fp32: 2.4 MB, an L2 cache's worth)
_EXACT_HEAD: dict[tuple[int, int], bool] = {}  # (id(lm_head weight), block) -> bit-identical here


def deterministic_tile(device: torch.device | str) -> int:
    """Rows per block of the deterministic mode on `device` (CUDA_TILE / CPU_TILE)."""
    return CUDA_TILE if torch.device(device).type == "cuda" else CPU_TILE


@torch.inference_mode()
def decode_batch(
    adapter: ModelAdapter, caches: Sequence[KVCache], tokens: Sequence[int], *, tile: int | None = None
) -> torch.Tensor:
    """One decode step of every sequence: token i appended to caches[i] at its own position
    -> logits (B, vocab) fp32. tile: run row-wise operations on blocks of exactly `tile`
    rows (batch-invariant, see the module docstring); None: one product over the B rows."""
    B = len(caches)
    if B != len(tokens) or B == 0:
        raise ValueError(f"{B} caches but {len(tokens)} tokens (need one token per cache, at least one)")
    if len({id(c) for c in caches}) != B:
        raise ValueError("each sequence needs its own cache")
    if tile is not None and tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    for c in caches:
        if c.length >= c.capacity:
            raise ValueError(f"KV cache full ({c.capacity} tokens)")
    dev = adapter.device
    rows = B if tile is None else -(-B // tile) * tile  # padded to whole blocks
    pos = [c.length for c in caches]
    positions = torch.zeros(rows, dtype=torch.int64)
    positions[:B] = torch.tensor(pos)
    ids = torch.zeros(rows, dtype=torch.int64)
    ids[:B] = torch.tensor([int(t) for t in tokens])
    ropes = adapter.rope_layers(positions.to(dev), max_position=max(pos))
    blocks = [slice(0, rows)] if tile is None else [slice(a, a + tile) for a in range(0, rows, tile)]

    def rowwise(fn, *xs: torch.Tensor):
        """fn over the rows, block by block (each block its own call of `tile` rows)."""
        outs = [fn(*(x[b] for x in xs)) for b in blocks]
        if len(outs) == 1:
            return outs[0]
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*outs))
        return torch.cat(outs)

    h = rowwise(adapter.embed, ids.to(dev))  # (rows, hidden)
    for layer in range(adapter.num_layers):
        q, k, v = rowwise(lambda x, layer=layer: adapter.qkv(layer, adapter.attn_norm(layer, x)), h)
        cos, sin = ropes[layer]
        q, k = rowwise(K.apply_rope, q, cos, sin), rowwise(K.apply_rope, k, cos, sin)
        attn = torch.zeros_like(q)  # padding rows attend to nothing
        w = adapter.windows[layer]
        for b, (cache, p) in enumerate(zip(caches, pos)):
            cache.write(layer, p, k[b], v[b])
            lo = 0 if w is None else max(0, p + 1 - w)
            attn[b] = decode_attention(q[b : b + 1], *cache.read(layer, lo, p + 1), adapter.scale)[0]
        h = rowwise(lambda x, a, layer=layer: adapter.mlp(layer, adapter.attn_out(layer, x, a)), h, attn)
    for c, p in zip(caches, pos):
        c.length = p + 1
    return rowwise(adapter.logits, h)[:B]


@torch.inference_mode()
def decode_steps(adapter: ModelAdapter, caches: Sequence[KVCache], tokens: Sequence[int]) -> list[torch.Tensor]:
    """`decode_step(adapter, caches[i], tokens[i])` for every i -> their logits (vocab,) fp32,
    identical to running them one after the other. Each cache gets its token at its own
    `length` (its own position) and advances by one."""
    if len(caches) != len(tokens):
        raise ValueError(f"{len(caches)} caches but {len(tokens)} tokens")
    if len({id(c) for c in caches}) != len(caches):
        raise ValueError("each sequence needs its own cache")
    if len(caches) == 1:
        return [decode_step(adapter, caches[0], int(tokens[0]))]
    for c in caches:
        if c.length >= c.capacity:
            raise ValueError(f"KV cache full ({c.capacity} tokens)")
    dev = adapter.device
    pos = [c.length for c in caches]
    ropes = [adapter.rope_layers(torch.tensor([p], device=dev)) for p in pos]
    hs = [adapter.embed(torch.tensor([int(t)], device=dev)) for t in tokens]  # (1, hidden) each
    split_mlp = adapter.fused_mlp and not adapter.gemma
    for layer in range(adapter.num_layers):
        qkv = [adapter.qkv(layer, adapter.attn_norm(layer, h)) for h in hs]
        w = adapter.windows[layer]
        outs = []
        for b, (cache, p, (q, k, v)) in enumerate(zip(caches, pos, qkv)):
            cos, sin = ropes[b][layer]
            cache.write(layer, p, K.apply_rope(k, cos, sin)[0], v[0])
            q = K.apply_rope(q, cos, sin)
            lo = 0 if w is None else max(0, p + 1 - w)
            outs.append(decode_attention(q, *cache.read(layer, lo, p + 1), adapter.scale))
        hs = [adapter.attn_out(layer, h, o) for h, o in zip(hs, outs)]
        if split_mlp:  # adapter.mlp's own steps, each matrix once for every sequence
            lyr = adapter.layers[layer]
            m = lyr.mlp
            xs = [adapter._norm(lyr.post_attention_layernorm, h) for h in hs]
            gates = [m.gate_proj(x) for x in xs]
            acts = [K.silu_mul(g, m.up_proj(x)) for g, x in zip(gates, xs)]
            hs = [h + m.down_proj(a) for h, a in zip(hs, acts)]
        else:
            hs = [adapter.mlp(layer, h) for h in hs]
    for c, p in zip(caches, pos):
        c.length = p + 1
    return [row[0] for row in head_logits(adapter, hs)]


def head_logits(adapter: ModelAdapter, hs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`adapter.logits(h)` for each (1, hidden) h, the LM head read in blocks of HEAD_BLOCK
    rows shared by every h when that is bit-identical on this machine (`head_blocks_exact`)."""
    head = adapter.model.lm_head
    if not (isinstance(head, torch.nn.Linear) and head_blocks_exact(adapter)):
        return [adapter.logits(h) for h in hs]
    xs = [adapter._norm(adapter.model.model.norm, h) for h in hs]
    W, bias = head.weight, head.bias
    parts: list[list[torch.Tensor]] = [[] for _ in xs]
    for a in range(0, W.shape[0], HEAD_BLOCK):
        wb = W[a : a + HEAD_BLOCK]
        bb = None if bias is None else bias[a : a + HEAD_BLOCK]
        for b, x in enumerate(xs):
            parts[b].append(F.linear(x, wb, bb))
    out = []
    for p in parts:
        lg = torch.cat(p, dim=-1).float()
        if adapter.final_softcap is not None:  # as adapter.logits applies it
            lg = torch.tanh(lg / adapter.final_softcap) * adapter.final_softcap
        out.append(lg)
    return out


def head_blocks_exact(adapter: ModelAdapter) -> bool:
    """Whether the LM head computed in blocks of rows equals the whole head's product bit for
    bit on this machine and dtype (checked once per model on two rows)."""
    head = adapter.model.lm_head
    key = (id(head.weight), HEAD_BLOCK)
    if key not in _EXACT_HEAD:
        gen = torch.Generator().manual_seed(0)
        ok = True
        for _ in range(2):
            x = torch.randn(1, head.in_features, generator=gen).to(head.weight.device, head.weight.dtype)
            whole = head(x)
            blocks = torch.cat(
                [
                    F.linear(
                        x, head.weight[a : a + HEAD_BLOCK], None if head.bias is None else head.bias[a : a + HEAD_BLOCK]
                    )
                    for a in range(0, head.weight.shape[0], HEAD_BLOCK)
                ],
                dim=-1,
            )
            ok = ok and torch.equal(whole, blocks)
        _EXACT_HEAD[key] = ok
    return _EXACT_HEAD[key]
