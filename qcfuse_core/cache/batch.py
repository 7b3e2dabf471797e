"""Loads shared across a batch: requests prefilled together read one load of their chunks.

The scheduler runs several fused prefills together, layer by layer. Requests of a batch
often use the same chunks; each unique chunk crosses to the device once per layer:

    prompt 0   [prefix][ A ][glue][ B ][suffix]
    prompt 1   [prefix][ B ][ C ][suffix  ]
    union      [prefix][ A ][ B ][ C ][0]       one LoadSession over each unique chunk once;
                                       └ one zero row (its suffix): where uncached rows read

    member m, layer l:   k, v = union_kv[l][:, index_m]      index_m (T_m,) int64: the union
                                                             row of each of its rows

The union session IS a `LoadSession` (cache/prefetch.py): the same sources, overlap (side
stream and eager issue on CUDA, a loader thread for disk), pins and buffers. For each layer
the first member to ask advances it; every member then gathers its rows from the union's
buffer on the device (one `index_select` per member and layer, ordered after the load), so
what a member gets is bit for bit what a lone session over its prompt would return.

A chunk is the same chunk in two prompts when both are `ChunkView`s of one `ChunkKey`
(loaded from the store), or the same in-memory `KVChunk` object (two chunks computed apart
need not agree bit for bit, so they are not merged).

What must hold:
- each member asks for layers in order 0..L-1; members may be at different layers (the
  union keeps every layer until it closes), and one may close early: the others go on;
- the union session (its buffers, pins, loader) is let go when the last member closes; it
  is finished (which may promote its disk reads) when that member leaves by `finish`;
- counters, per member (`PrefetchReport`): `bytes_loaded` / `bytes_by_source` its share of
  the union's load - for each layer, a chunk's bytes go to the first member that reads
  that layer of it (in lock step: the first member of the batch that uses the chunk);
  `bytes_shared` what it read of chunks another member's share brought. A chunk repeated
  within one prompt is loaded once and counted once. Per batch (the same on every member,
  read when the member reads a layer or finishes): `batch_bytes_loaded` what the union
  moved, `batch_bytes_separate` what lone sessions would have moved for the same layers;
- `failed` lists the member's own segment indices whose chunk's reads failed, on every
  member that uses that chunk; timings: `wait_ms` per member (device time from events on
  CUDA, host time otherwise), `load_ms` the union's (shared) loader time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from qcfuse_core.cache.prefetch import ChunkView, LoadSession, Prefetcher, PrefetchReport
from qcfuse_core.model.fusion import FusedPrompt, Segment


def start_batch(pf: Prefetcher, prompts: Sequence[FusedPrompt]) -> list[LoadSession | BatchSession]:
    """One layer source per prompt, for requests whose fused prefills run together layer by
    layer: a `BatchSession` per prompt over one shared load of their unique chunks (see the
    module docstring); a batch of one is `pf.start`. Each must be finished or closed (in a
    `finally`)."""
    if len(prompts) <= 1:
        return [pf.start(p) for p in prompts]
    shared = SharedLoad(pf, prompts)
    members: list[LoadSession | BatchSession] = []
    try:
        for m, p in enumerate(prompts):
            members.append(BatchSession(shared, m, p))
    except BaseException:
        shared.session.close()  # no member was handed out: nothing else would let go of it
        raise
    return members


def _identity(chunk) -> tuple:
    return ("view", chunk.key) if isinstance(chunk, ChunkView) else ("tensor", id(chunk))


class SharedLoad:
    """The union session of a batch and its bookkeeping: which union segment each member
    segment reads, who claimed each layer of each chunk, how many members are open."""

    def __init__(self, pf: Prefetcher, prompts: Sequence[FusedPrompt]) -> None:
        # 1. the union prompt: each unique chunk once, in batch order, then one zero row
        unique: dict[tuple, int] = {}
        segs: list[Segment] = []
        self.uses: list[list[int | None]] = []  # member -> per segment: its union segment (None: uncached)
        for p in prompts:
            row: list[int | None] = []
            for seg in p.segments:
                if seg.chunk is None:
                    row.append(None)
                    continue
                ident = _identity(seg.chunk)
                if ident not in unique:
                    unique[ident] = len(segs)
                    segs.append(Segment("chunk", seg.token_ids, seg.chunk))
                row.append(unique[ident])
            self.uses.append(row)
        segs.append(Segment("suffix", torch.zeros(1, dtype=torch.int64)))
        self.union = FusedPrompt(segs)
        self.zero_row = self.union.num_tokens - 1  # the suffix: never cached, always zeros
        # 2. one session loads them all (sources, pins, overlap: LoadSession's own)
        self.session: LoadSession = pf.start(self.union)
        self.kinds = self.session.source_kinds()
        shape = pf.adapter.shape
        row_bytes = 2 * shape.num_kv_heads * shape.head_dim * pf.dtype.itemsize
        self.seg_bytes = [  # one layer of each union segment
            0 if kind == "none" else len(seg) * row_bytes for kind, seg in zip(self.kinds, segs)
        ]
        self.separate_layer_bytes = sum(self.seg_bytes[u] for row in self.uses for u in row if u is not None)
        self.claimed = [0] * len(segs)  # per union segment: layers already claimed by a member
        self.size = len(prompts)
        self.open = len(prompts)
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def read(self, member: int, layer: int) -> tuple[torch.Tensor, int, int, dict[str, int]]:
        """Layer `layer` of the union (2, T_u, Hkv, D), ordered after its load on the current
        stream, and the member's (loaded, shared, loaded per source) bytes for it."""
        with self._lock:
            try:
                kv = self.session.layer_kv(layer)
            except Exception as e:
                self.error = self.error or e
                raise
            loaded, shared = 0, 0
            by_source: dict[str, int] = {}
            for u in dict.fromkeys(u for u in self.uses[member] if u is not None):  # repeats once
                n = self.seg_bytes[u]
                if not n:
                    continue
                if self.claimed[u] <= layer:  # the first reader of this layer of the chunk
                    self.claimed[u] = layer + 1
                    loaded += n
                    by_source[self.kinds[u]] = by_source.get(self.kinds[u], 0) + n
                else:
                    shared += n
            return kv, loaded, shared, by_source

    def batch_bytes(self) -> tuple[int, int]:
        """(what the union moved, what lone sessions would have moved for the same layers)."""
        s = self.session
        return s.report.bytes_loaded, s.layers_loaded * self.separate_layer_bytes

    def failed(self, member: int) -> list[int]:
        """The member's segments whose chunk's reads failed, in the order they were found."""
        out: list[int] = []
        for u in list(self.session.report.failed):
            out += [i for i, v in enumerate(self.uses[member]) if v == u and i not in out]
        return out

    def leave(self, finished: bool) -> None:
        """A member closed; the last one lets go of the union (finishing it when it finished)."""
        with self._lock:
            self.open -= 1
            last = self.open == 0
        if not last:
            return
        if finished and self.error is None:
            self.session.finish()
        else:
            self.session.close()


class BatchSession:
    """One member of a batch: `fusion.LayerSource` of its request, over the batch's shared
    load. The same interface as `LoadSession`: `layer`, `finish`, `close`, `report`."""

    def __init__(self, shared: SharedLoad, member: int, prompt: FusedPrompt) -> None:
        self.shared, self.member, self.prompt = shared, member, prompt
        session = shared.session
        self.device, self.cuda = session.device, session.cuda
        L = session.adapter.num_layers
        self.num_layers = L
        self.report = PrefetchReport(batch_size=shared.size)
        self.report.wait_ms = [0.0] * L
        self.report.load_ms = [0.0] * L
        for u, seg in zip(shared.uses[member], prompt.segments):
            kind = "none" if u is None else shared.kinds[u]
            self.report.sources[kind] = self.report.sources.get(kind, 0) + 1
            self.report.segment_sources.append(kind)
            if isinstance(seg.chunk, ChunkView) and seg.chunk.depth:
                self.report.order.append(f"sidecar:{seg.chunk.key.token_hash[:8]}")
        self.report.failed = shared.failed(member)
        # index (T_m,): the union row of each of the member's rows
        #   member  [prefix ][glue][ B      ][suffix]
        #   union    0..P-1   zr    uB..uB+n  zr ...     zr = the union's zero row
        index = torch.full((prompt.num_tokens,), shared.zero_row, dtype=torch.int64)
        for u, seg, start in zip(shared.uses[member], prompt.segments, prompt.starts):
            if u is not None:
                us = shared.union.starts[u]
                index[start : start + len(seg)] = torch.arange(us, us + len(seg))
        self._index = index.to(self.device)
        self._next = 0
        self._closed = False
        self._need: list[torch.cuda.Event] | None = None
        if self.cuda:
            self._base = torch.cuda.Event(enable_timing=True)
            self._base.record(torch.cuda.current_stream(self.device))
            self._need = [torch.cuda.Event(enable_timing=True) for _ in range(L)]

    def layer(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer` of the prompt's caches: k_pre, v (T, Hkv, D); zeros where uncached."""
        if self._closed:
            raise RuntimeError("this load session is closed")
        if layer != self._next:
            raise ValueError(f"layers must be asked for in order: expected {self._next}, got {layer}")
        self._next += 1
        t0 = time.perf_counter()
        if self._need is not None:
            self._need[layer].record(torch.cuda.current_stream(self.device))
        union_kv, loaded, shared, by_source = self.shared.read(self.member, layer)  # (2, T_u, Hkv, D)
        with torch.inference_mode():
            kv = union_kv.index_select(1, self._index)  # (2, T, Hkv, D)
        rep = self.report
        if not self.cuda:
            rep.wait_ms[layer] = (time.perf_counter() - t0) * 1e3
        rep.bytes_loaded += loaded
        rep.bytes_shared += shared
        for kind, n in by_source.items():
            rep.bytes_by_source[kind] = rep.bytes_by_source.get(kind, 0) + n
        rep.order.append(f"layer:{layer}")
        self._sync()
        k, v = kv[0], kv[1]
        if like.dtype != k.dtype or like.device != k.device:
            k, v = k.to(like.device, like.dtype), v.to(like.device, like.dtype)
        return k, v

    def _sync(self) -> None:
        """The batch-level figures and the failures found so far."""
        rep = self.report
        rep.batch_bytes_loaded, rep.batch_bytes_separate = self.shared.batch_bytes()
        rep.failed = self.shared.failed(self.member)

    def finish(self) -> PrefetchReport:
        """On CUDA turn the events into per-layer waits (synchronizes); closes the member
        (the last one finishes the union); raises if the shared load failed."""
        n = self._next
        if self._need is not None and n and not self._closed:
            torch.cuda.current_stream(self.device).synchronize()
            need = [self._base.elapsed_time(e) for e in self._need[:n]]
            ready = []
            for l in range(n):
                ev = self.shared.session.ready_event(l)
                assert ev is not None  # CUDA sessions record one per layer
                ready.append(self._base.elapsed_time(ev))
            rep = self.report
            rep.wait_ms = [max(0.0, r - q) for q, r in zip(need, ready)] + [0.0] * (self.num_layers - n)
            rep.compute_ms = [need[l + 1] - need[l] - rep.wait_ms[l] for l in range(n - 1)]
        if not self._closed:
            self.report.load_ms = list(self.shared.session.report.load_ms)
            self._sync()
        self._close(finished=True)
        if self.shared.error is not None:
            raise RuntimeError("prefetch failed") from self.shared.error
        return self.report

    def close(self) -> None:
        """Leave the batch (idempotent; never raises); the last member lets go of the union."""
        self._close(finished=False)

    def _close(self, finished: bool) -> None:
        if self._closed:
            return
        self._closed = True
        self._need = None
        self.shared.leave(finished)

    def __enter__(self) -> BatchSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
