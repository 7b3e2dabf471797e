"""Decode steps replayed from CUDA graphs: `GraphDecoder`, the scheduler's decode on a GPU.

An eager decode step of an 8B model launches some 600 kernels from Python - norms,
projections, RoPE, cache writes, attention, the MLP, per layer - and on an H200 the host
takes longer to launch them than the GPU takes to run them (the weights' read alone takes
3.35 ms). A CUDA graph records the launches of one step once and replays them with one call.

A graph fixes its tensors' addresses and shapes, so:

- batch sizes come in buckets (1, 2, 4, 8, 16, 32 rows; a step of B sequences runs the
  smallest bucket that holds them, padding rows attending to a one-token scratch cache; more
  than 32 run in several replays);
- each step's inputs - token ids, positions, visible lengths and the addresses of every
  sequence's per-layer K and V - are copied into the graph's own input tensor, and the
  attention kernels read each sequence's cache through those addresses
  (`qcfuse_kernels.decode_attention_ptrs`, `kv_append_ptrs`): the requests' caches from the
  engine's KV pool are used where they are, whatever set of them a step runs;
- RoPE comes from the adapter's table of positions, sized before capture to the largest
  cache capacity seen (a larger cache re-captures the graphs).

The attention's key ranges per (sequence, KV head) follow the bucket (`decode_splits`: one
sequence's step needs many ranges to fill the GPU, 32 sequences few).

Deterministic mode: one bucket of `CUDA_TILE` rows and one count of key ranges, so every
row-wise product has the same shape whatever the batch, and a sequence's bits do not
depend on its company (the attention's sum order then follows the row's own length).

Every bucket is captured at the first step (about a second on an H200), so no request
waits for a capture later.

`decode_rows` is the step's body, the same code eager and captured; tests run it eagerly on
the CPU under Triton's interpreter against `model.batched.decode_batch`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

import qcfuse_kernels as K
from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.model.batched import CUDA_TILE
from qcfuse_core.model.fusion import KVCache
from qcfuse_kernels.ops import DECODE_SPLITS

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32)
MIN_POSITIONS = 4096  # the smallest RoPE table the graphs are captured with
FEED_ROWS = 4096  # rows of a step whose greedy tokens can feed the next step on the device


def decode_rows(
    adapter: ModelAdapter,
    ids: torch.Tensor,
    pos: torch.Tensor,
    lens: torch.Tensor,
    k_ptrs: torch.Tensor,
    v_ptrs: torch.Tensor,
    max_position: int | None = None,
    splits: int | None = None,
    scale_ptrs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One decode step of B rows, each on its own cache given by address: ids, pos (B,) the
    input token and its position, lens (B,) = pos + 1, k_ptrs / v_ptrs (L, B) int64 the
    address of row b's layer-l keys / values (`layer_addresses`) -> logits (B, vocab) fp32.
    Writes each row's key and value at its position. No host sync (graph-capturable).
    splits: the attention's key ranges (None: `decode_splits` of B rows). scale_ptrs: fp8
    caches (`KVCache` with kv_dtype "fp8"), the (L, B) addresses of their key and value scales.

    Where the adapter packs its projections (`ModelAdapter.packed_projections`: Llama,
    Mistral, Qwen2), a layer is nine launches: q/k/v as one product, RoPE and the cache
    write in one pass, the attention's two, o_proj, the residual add with the next norm in
    one pass, gate/up as one product, the activation, down_proj. Other models run the
    adapter's own steps."""
    B = ids.shape[0]
    s = adapter.shape
    splits = splits or K.decode_splits(B, s.num_kv_heads)
    packed = adapter.packed_projections()
    ropes = adapter.rope_layers(pos, max_position=max_position)
    h = adapter.embed(ids)

    def scales(layer: int) -> dict[str, torch.Tensor]:
        if scale_ptrs is None:
            return {}
        return {"k_scale_ptrs": scale_ptrs[0][layer], "v_scale_ptrs": scale_ptrs[1][layer]}

    def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
        window = adapter.windows[layer]
        return K.decode_attention_ptrs(
            q,
            k_ptrs[layer],
            v_ptrs[layer],
            lens,
            adapter.scale,
            num_kv_heads=s.num_kv_heads,
            window=window,
            splits=splits,
            **scales(layer),
        )

    if packed is None:
        for layer in range(adapter.num_layers):
            q, k, v = adapter.qkv(layer, adapter.attn_norm(layer, h))
            cos, sin = ropes[layer]
            q, k = K.apply_rope(q, cos, sin), K.apply_rope(k, cos, sin)
            K.kv_append_ptrs(k_ptrs[layer], v_ptrs[layer], pos, k, v, **scales(layer))
            h = adapter.mlp(layer, adapter.attn_out(layer, h, attend(layer, q)))
        return adapter.logits(h)
    layers = adapter.layers
    norm = layers[0].input_layernorm
    x = K.rms_norm(h, norm.weight, norm.variance_epsilon)
    for layer, p in enumerate(packed):
        lyr = layers[layer]
        cos, sin = ropes[layer]
        qkv = F.linear(x, p.qkv, p.qkv_bias)
        q = K.rope_append_ptrs(
            qkv,
            cos,
            sin,
            k_ptrs[layer],
            v_ptrs[layer],
            pos,
            num_heads=s.num_heads,
            num_kv_heads=s.num_kv_heads,
            **scales(layer),
        )
        post = lyr.post_attention_layernorm
        h, x = K.add_rms_norm(
            h, lyr.self_attn.o_proj(attend(layer, q).reshape(B, -1)), post.weight, post.variance_epsilon
        )
        down = lyr.mlp.down_proj(K.silu_mul_packed(F.linear(x, p.gate_up, p.gate_up_bias)))
        norm = layers[layer + 1].input_layernorm if layer + 1 < len(packed) else adapter.model.model.norm
        h, x = K.add_rms_norm(h, down, norm.weight, norm.variance_epsilon)
    out = adapter.model.lm_head(x).float()
    if adapter.final_softcap is not None:  # as adapter.logits applies it
        out = torch.tanh(out / adapter.final_softcap) * adapter.final_softcap
    return out


def layer_addresses(tensors: Sequence[torch.Tensor], align: int = 16) -> torch.Tensor:
    """(L, B) int64: the address of layer l of each (L, capacity, ...) contiguous tensor
    (`align`-byte aligned: 16 for K and V, as the kernels need; 4 for fp8 scales)."""
    base = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    step = torch.tensor([t.stride(0) * t.element_size() for t in tensors], dtype=torch.int64)
    if bool((base % align).any()) or bool((step % align).any()):
        raise ValueError(
            f"a layer of the KV cache is not a whole number of {align}-byte units (head_dim * Hkv too odd)"
        )
    layers = torch.arange(tensors[0].shape[0], dtype=torch.int64)[:, None]
    return base[None, :] + layers * step[None, :]


def cache_tables(caches: Sequence[KVCache]) -> torch.Tensor:
    """(2 L, B) or, fp8 caches, (4 L, B) int64: the layer addresses of every cache's keys,
    values, and fp8 key and value scales (`decode_rows`' k_ptrs, v_ptrs, scale_ptrs)."""
    parts = [layer_addresses([c.k for c in caches]), layer_addresses([c.v for c in caches])]
    if caches[0].fp8:
        for scales in ([c.k_scale for c in caches], [c.v_scale for c in caches]):
            parts.append(layer_addresses([t for t in scales if t is not None], 4))
    return torch.cat(parts)


def feed_ids(ids: torch.Tensor, feed: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """A step's input tokens with device-side sampling: row b takes last[feed[b]] - the token
    the previous step chose on the device for its row feed[b] - where feed[b] >= 0, else ids[b]
    (a token the host chose). No host sync."""
    return torch.where(feed >= 0, last[feed.clamp(min=0)], ids)


def check_step(caches: Sequence[KVCache], tokens: Sequence[int]) -> None:
    """The arguments of one decode step: one token per cache, distinct caches, room in each,
    every cache of one KV dtype."""
    if len(caches) != len(tokens) or not caches:
        raise ValueError(f"{len(caches)} caches but {len(tokens)} tokens (need one token per cache, at least one)")
    if len({id(c) for c in caches}) != len(caches):
        raise ValueError("each sequence needs its own cache")
    if len({c.fp8 for c in caches}) != 1:
        raise ValueError("a decode step's caches must share one KV dtype (fp8 and not fp8 mixed)")
    for c in caches:
        if c.length >= c.capacity:
            raise ValueError(f"KV cache full ({c.capacity} tokens)")
        if not (c.k.is_contiguous() and c.v.is_contiguous()):
            raise ValueError("KV caches must be contiguous")


class CaptureError(RuntimeError):
    """A decode step could not be captured as a CUDA graph (the caller decodes eagerly)."""


class _Graph:
    """One captured step of `rows` rows: its input tensor, output logits and greedy tokens."""

    def __init__(
        self, rows: int, inputs: torch.Tensor, graph: torch.cuda.CUDAGraph, logits: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        self.rows, self.inputs, self.graph, self.logits, self.tokens = rows, inputs, graph, logits, tokens
        self.blank = inputs.cpu()  # every row padding


# rows of a graph's input tensor before the per-layer address tables
IDS, POS, LENS, FEED, TABLES = 0, 1, 2, 3, 4


class GraphDecoder:
    """Batched decode steps replayed from CUDA graphs (module docstring). Used from one thread
    at a time (the scheduler's worker); graphs are captured on first use of a bucket.
    kv_fp8: the caches it decodes are fp8 (`KVCache` kv_dtype "fp8"), every step's alike."""

    def __init__(self, adapter: ModelAdapter, *, deterministic: bool = False, kv_fp8: bool = False) -> None:
        if adapter.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {adapter.device}")
        if K.backend() != "triton":
            raise ValueError(f"CUDA graph decode needs the Triton kernels (kernel backend: {K.backend()})")
        self.adapter, self.kv_fp8 = adapter, kv_fp8
        self.buckets = (CUDA_TILE,) if deterministic else BUCKETS
        # the attention's key ranges: per bucket (`decode_splits`), or one count in the
        # deterministic mode, so that a row's bits do not depend on its batch
        self._splits = DECODE_SPLITS if deterministic else None
        adapter.packed_projections()  # not under capture: packing replaces the modules' weights
        self._graphs: dict[int, _Graph] = {}
        self._pool: Any = None  # the graphs share one memory pool
        self._positions = 0  # the RoPE table size the graphs were captured with
        # padding rows write position 0 of this one-token cache and read its one key
        self._pad = KVCache(adapter, 1, "fp8" if kv_fp8 else "auto")
        for t in (self._pad.k, self._pad.v):  # a cast copy: fp8 codes too
            t.copy_(torch.zeros(t.shape, device=adapter.device))
        # the previous step's greedy tokens, row by row (device-side sampling feeds them; the
        # graphs read this tensor, so it is never replaced)
        self.last = torch.zeros(FEED_ROWS, dtype=torch.int64, device=adapter.device)
        self.captures = 0  # graphs captured so far (statistics, tests)

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def step(self, caches: Sequence[KVCache], tokens: Sequence[int]) -> torch.Tensor:
        """One decode step of every sequence, as `model.batched.decode_batch`: token i appended
        to caches[i] at its own position -> logits (B, vocab) fp32."""
        return self.step_greedy(caches, tokens)[0]

    @torch.inference_mode()
    def step_greedy(
        self, caches: Sequence[KVCache], tokens: Sequence[int], feed: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`step` -> (logits (B, vocab) fp32, greedy tokens (B,) int64), on the device, nothing
        read back. feed: device-side sampling, row i's input is the previous step's greedy
        token of its row feed[i] where feed[i] >= 0 (tokens[i] is then ignored); a step's
        tokens stay in `last` until the next step."""
        check_step(caches, tokens)
        if caches[0].fp8 != self.kv_fp8:
            raise ValueError(f"this decoder's graphs read {'fp8' if self.kv_fp8 else 'model-dtype'} caches")
        if feed is not None and (len(feed) != len(caches) or max(feed) >= self.last.numel()):
            raise ValueError(f"feed needs one entry per cache, each < {self.last.numel()} (the last step's rows)")
        need = max(c.capacity for c in caches)
        if need > self._positions:
            self._reset(max(MIN_POSITIONS, 1 << (need - 1).bit_length()))
        if not self._graphs:  # every bucket now, the largest first (the others reuse its pool)
            for rows in sorted(self.buckets, reverse=True):
                self._capture(rows)
        n = self.max_rows
        outs = [
            self._run(caches[a : a + n], tokens[a : a + n], None if feed is None else feed[a : a + n])
            for a in range(0, len(caches), n)
        ]
        for c in caches:
            c.length += 1
        logits = outs[0][0] if len(outs) == 1 else torch.cat([o[0] for o in outs])
        greedy = outs[0][1] if len(outs) == 1 else torch.cat([o[1] for o in outs])
        kept = min(greedy.numel(), self.last.numel())
        self.last[:kept].copy_(greedy[:kept])  # after every replay has read the old ones
        return logits, greedy

    def _reset(self, positions: int) -> None:
        """Drop the graphs; the next ones are captured with a RoPE table of `positions`."""
        self._graphs.clear()
        self._positions = positions
        torch.cuda.synchronize(self.adapter.device)

    def _run(
        self, caches: Sequence[KVCache], tokens: Sequence[int], feed: Sequence[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(caches)
        rows = next(b for b in self.buckets if b >= n)
        g = self._graphs.get(rows) or self._capture(rows)
        # a fresh pinned buffer per step: the copy below is asynchronous and the caching host
        # allocator reuses a buffer only once its copy has run
        host = torch.empty(g.blank.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(g.blank)
        host[IDS, :n] = torch.tensor([int(t) for t in tokens], dtype=torch.int64)
        pos = torch.tensor([c.length for c in caches], dtype=torch.int64)
        host[POS, :n] = pos
        host[LENS, :n] = pos + 1
        if feed is not None:
            host[FEED, :n] = torch.tensor(list(feed), dtype=torch.int64)
        host[TABLES:, :n] = cache_tables(caches)
        g.inputs.copy_(host, non_blocking=True)
        g.graph.replay()
        return g.logits[:n].clone(), g.tokens[:n].clone()

    def _padding(self, rows: int) -> torch.Tensor:
        """The input tensor's content for `rows` padding rows: token 0 at position 0 of the
        scratch cache, fed by nobody. Rows: ids, positions, lengths, feed, then the cache
        tables (`cache_tables`: L key addresses, L value addresses, fp8: 2 L scale addresses)."""
        tables = cache_tables([self._pad])
        x = torch.zeros((TABLES + tables.shape[0], rows), dtype=torch.int64)
        x[LENS] = 1
        x[FEED] = -1
        x[TABLES:] = tables
        return x

    def _capture(self, rows: int) -> _Graph:
        adapter, dev = self.adapter, self.adapter.device
        L = adapter.num_layers
        inputs = self._padding(rows).to(dev)
        t = inputs[TABLES:]

        def body() -> tuple[torch.Tensor, torch.Tensor]:
            logits = decode_rows(
                adapter,
                feed_ids(inputs[IDS], inputs[FEED], self.last),
                inputs[POS],
                inputs[LENS],
                t[:L],
                t[L : 2 * L],
                self._positions - 1,
                self._splits,
                (t[2 * L : 3 * L], t[3 * L :]) if self.kv_fp8 else None,
            )
            return logits, logits.argmax(-1)

        try:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up: compiles the kernels, builds the RoPE table
                for _ in range(2):
                    body()
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits, tokens = body()
        except Exception as e:
            raise CaptureError(f"capturing a decode step of {rows} rows failed: {e}") from e
        self._pool = graph.pool()
        self._graphs[rows] = g = _Graph(rows, inputs, graph, logits, tokens)
        self.captures += 1
        log.info("captured a decode graph of %d rows (RoPE positions < %d)", rows, self._positions)
        return g
