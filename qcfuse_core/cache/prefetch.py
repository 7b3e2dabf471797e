"""Layer-wise loading of a fused prompt's chunk caches: sidecars first, then layer 0, 1, 2, ...

    request   lookup ─ plan ─ sidecars ─┬─ probe ─ select ─ layer 0 ─ layer 1 ─ ... ─ layer L-1
    loader                              └─ load 0 ─ load 1 ─ load 2 ─ ...  (side stream / thread)

Fused prefill asks for layer l only after it has enqueued layer l-1's compute, and waits on
one event per layer, so layer l's compute overlaps the loads of layers l+1, l+2, ... The
probe and the selection overlap the first loads too.

Who issues the loads: with a disk source, a loader thread per request; on CUDA with memory
tiers only, the request's own thread - the first `ahead` layers when the request starts,
then layer l + ahead each time fused prefill asks for layer l (a loader thread there
competed with the selection for the interpreter lock); on a CPU with memory tiers only, the
request's own thread copies layer l when fused prefill asks for it (a loader thread there
only copied RAM to RAM beside the compute threads and slowed their team).

The shared `Prefetcher` keeps what outlives a request (the side stream, reusable buffers,
probe sidecars on the compute device); each request's loads, events and report live in its
`LoadSession`, closed in the engine's `finally`.

Pins: a session pins every memory-tier entry it streams from (`store.pin`, when it starts)
and unpins them when it closes (also after an error), so the tier never evicts, and never
re-lets the bytes of, an image a request is still reading (store/tier.py).

Per layer the prefetcher fills one buffer pair laid out as the prompt (what
`FusedPrompt.layer` returns, and what `fusion.LayerSource` promises):

    rows:   0        P          P+n1   P+n1+g                 T-S       T-1
            [prefix ][chunk 1   ][glue][chunk 2  ]  ...       [suffix      ]
    source  tensor    gpu/host   zeros  disk                   zeros
            (in-memory KVChunk; a memory-tier image; the disk tier; nothing)

Sources, chosen per segment when the request starts (`locate`):

    tensor  an in-memory KVChunk (the prefix, MemoryStore chunks)    copy k[l], v[l]
    gpu     an entry image in GPU memory                              device -> device copy
    host    an entry image in host memory (pinned under CUDA)         host -> device, async
    disk    the disk tier: pread into a reused pinned staging ring,   disk -> pinned -> device
            then host -> device (on a CPU straight into the buffer)
    none    uncached (glue, suffix, chunks the planner recomputes)    zeros, once per request

What must hold:
- `layer(l)` returns exactly what `FusedPrompt.layer(l)` would for the same caches (tests);
- layers are asked for in order 0..L-1, each once per request;
- buffers are reused across requests: a new request's loads are ordered after every piece
  of compute already enqueued (the side stream waits on the compute stream at `start`);
- on CUDA nothing here blocks the compute thread except waiting for the loader thread to
  have enqueued a layer (disk: the read itself) or enqueueing a layer's copies itself
  (memory tiers: tens of microseconds, inside the prefill loop, ahead of the GPU).

Selection runs before the bulk arrives on `ChunkView`s: lazy stand-ins for `KVChunk` that
serve a selector from the chunk's sidecar (anchor indices with their K/V at the probe layers,
full K at the critical layers) and load anything else synchronously from the store (counted
as `sync_layer_loads`: qcall/qclast need whole layers and break the pipeline by design).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.model.fusion import FusedPrompt
from qcfuse_core.selection.anchors import AnchorConfig, ensure_anchors
from qcfuse_core.types import ChunkKey, KVChunk

if TYPE_CHECKING:
    from qcfuse_core.store.tier import TierPin

log = logging.getLogger(__name__)

TIERS = ("gpu", "host", "disk")


# ----------------------------------------------------------------------------- sidecars / views


def _k_name(method: str) -> str:
    return f"{method}.k"


def _v_name(method: str) -> str:
    return f"{method}.v"


def probe_sidecar(
    adapter: ModelAdapter, chunk: KVChunk, depth: int, critical: list[int], config: AnchorConfig = AnchorConfig()
) -> tuple[dict[str, torch.Tensor], dict[int, torch.Tensor]]:
    """What the qcfuse probe needs of one chunk -> (anchors, layer_keys) for `Sidecar`.

    anchors[method] (depth, n) local indices; anchors[method.k], anchors[method.v]
    (depth, n, Hkv, D) their K (pre-RoPE) / V; layer_keys[l] (T, Hkv, D) K of each critical layer.
    """
    idx, _ = ensure_anchors(adapter, chunk, depth, config)
    idx = idx[:depth]
    ak = torch.stack([chunk.k[l][idx[l]] for l in range(depth)])  # (depth, n, Hkv, D)
    av = torch.stack([chunk.v[l][idx[l]] for l in range(depth)])
    anchors = {config.method: idx, _k_name(config.method): ak, _v_name(config.method): av}
    return anchors, {l: chunk.k[l] for l in critical}


def ensure_sidecar(
    store, adapter: ModelAdapter, key: ChunkKey, depth: int, critical: list[int], config: AnchorConfig = AnchorConfig()
) -> bool:
    """Make the store's sidecar of `key` serve the probe (compute it from the chunk once).

    -> True when it had to be computed (reads the whole chunk: do this at ingestion)."""
    if _sidecar_ok(store.get_sidecar(key), depth, critical, config.method):
        return False
    chunk = store.get(key)
    if chunk is None:
        raise KeyError(f"chunk {key} is not in the store")
    if chunk.k.device.type != "cpu":  # a GPU-tier hit: sidecars live on the host; anchor picking mixes devices
        chunk = KVChunk(chunk.key, chunk.token_ids.cpu(), chunk.k.cpu(), chunk.v.cpu(), dict(chunk.anchors))
    anchors, layer_keys = probe_sidecar(adapter, chunk, depth, critical, config)
    store.put_sidecar(key, anchors=anchors, layer_keys=layer_keys)
    return True


def _sidecar_ok(side, depth: int, critical: list[int], method: str) -> bool:
    if side is None:
        return False
    a, ak = side.anchors.get(method), side.anchors.get(_k_name(method))
    return (
        a is not None
        and ak is not None
        and a.shape[0] >= depth
        and ak.shape[0] >= depth
        and all(l in side.layer_keys for l in critical)
    )


class _AnchorRows:
    """Layer l of a chunk as the probe's `gather_context` reads it: `[anchor indices]`."""

    def __init__(self, view: "ChunkView", layer: int, which: int) -> None:
        self.view, self.layer, self.which = view, layer, which

    def __getitem__(self, local):
        idx = self.view.anchor_idx[self.layer]
        if isinstance(local, torch.Tensor) and local.device.type == "cpu" and torch.equal(local, idx):
            return (self.view.anchor_k if self.which == 0 else self.view.anchor_v)[self.layer]
        return self.view.full_layer(self.layer)[self.which][local]


class _Layers:
    """chunk.k / chunk.v of a ChunkView: `[l]` a layer, `[a:b]` a stack of layers."""

    def __init__(self, view: "ChunkView", which: int) -> None:
        self.view, self.which = view, which

    def __getitem__(self, item):
        if isinstance(item, slice):
            return torch.stack([self[l] for l in range(*item.indices(self.view.num_layers))])
        return self.view.layer_tensor(int(item), self.which)


class ChunkView:
    """A KVChunk stand-in whose layers stay in the store until fused prefill asks for them.

    Serves from the sidecar: anchor rows of layers < depth (K and V) and full K of the
    critical layers; anything else is read synchronously from the store (counted).
    """

    def __init__(
        self,
        key: ChunkKey,
        token_ids: torch.Tensor,
        num_layers: int,
        store,
        device: torch.device,
        dtype: torch.dtype,
        method: str | None = None,
        anchor_idx: torch.Tensor | None = None,
        anchor_k: torch.Tensor | None = None,
        anchor_v: torch.Tensor | None = None,
        critical_k: dict[int, torch.Tensor] | None = None,
    ) -> None:
        self.key, self.token_ids, self.num_layers = key, token_ids, num_layers
        self.store, self.device, self.dtype = store, device, dtype
        self.anchors: dict[str, torch.Tensor] = {method: anchor_idx} if method and anchor_idx is not None else {}
        self.anchor_idx, self.anchor_k, self.anchor_v = anchor_idx, anchor_k, anchor_v
        self.critical_k = critical_k or {}
        self.k, self.v = _Layers(self, 0), _Layers(self, 1)
        self.sync_layer_loads = 0

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def depth(self) -> int:
        return 0 if self.anchor_idx is None else int(self.anchor_idx.shape[0])

    def layer_tensor(self, layer: int, which: int):
        if which == 0 and layer in self.critical_k:
            return self.critical_k[layer]
        if layer < self.depth:
            return _AnchorRows(self, layer, which)
        return self.full_layer(layer)[which]

    def full_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole layer, read synchronously (breaks the pipeline; counted)."""
        got = self.store.get_layer(self.key, layer)
        if got is None:
            raise KeyError(f"layer {layer} of {self.key} is unreadable")
        self.sync_layer_loads += 1
        return got[0].to(self.device, self.dtype), got[1].to(self.device, self.dtype)


# ----------------------------------------------------------------------------- the prefetcher


@dataclass(frozen=True)
class PrefetchConfig:
    threaded: bool = (
        True  # a loader thread runs ahead (on a CPU only for disk sources); False: each layer loads when asked
    )
    staging_slots: int = 3  # pinned disk staging buffers (CUDA), layers in flight from disk
    # layers the loader may run ahead of the consumer (None: all). Bounding it (4) did not
    # speed up the probe on the H200 and slowed `naive` from 41 to 61 ms (2026-11-30 runs 2/4)
    window: int | None = None
    sidecar_bytes: int = 1 << 30  # probe sidecars kept between requests (LRU beyond this)
    # CUDA, memory tiers only (no disk source): no loader thread. The copies of the first
    # `ahead` layers are enqueued on the side stream when the request starts, and asking for
    # layer l enqueues layer l + ahead - from the request's own thread, inside the prefill
    # loop, where the host runs ahead of the GPU anyway. A loader thread held the
    # interpreter lock for ~10 ms of Python per request while the selection ran (H200,
    # 10 x 1024 host tier: select 15 ms synced with it); enqueueing every layer at the start
    # cost the start ~3 ms (640 copies). The copies are asynchronous either way, and fused
    # prefill waits on one event per layer.
    eager_memory: bool = True
    ahead: int = 4
    # When a request uses chunks only the disk tier holds, copy those the store admits into
    # the memory tiers in the background (`TieredStore.promote`, from `ChunkLookup.find`),
    # so the next request that uses them reads memory. Off: a benchmark of the disk tier
    # repeats the same reads.
    promote_disk_reads: bool = False
    # Chunks streamed from the host tier are copied into the store's GPU tier as they load
    # (when the store admits them and the engine's GPU budget has room), so the next request
    # that uses them loads nothing over the bus (cache/budget.py, the GPU budget).
    fill_device_tier: bool = True

    def __post_init__(self) -> None:
        if self.ahead < 1:
            raise ValueError(f"ahead must be >= 1, got {self.ahead}")
        if self.staging_slots < 1:
            raise ValueError(f"staging_slots must be >= 1, got {self.staging_slots}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1 or None, got {self.window}")


@dataclass
class PrefetchReport:
    """Per request. wait_ms[l]: how long layer l's compute waited for its load (device time
    from events on CUDA, host time otherwise); compute_ms[l] (CUDA only): device time of
    layer l after its wait, up to asking for layer l+1; load_ms[l]: loader host time."""

    sources: dict[str, int] = field(default_factory=dict)  # segments per source kind
    segment_sources: list[str] = field(default_factory=list)  # each prompt segment's source kind, in order
    sidecar_ms: float = 0.0
    bytes_loaded: int = 0
    bytes_by_source: dict[str, int] = field(default_factory=dict)  # bytes_loaded per source kind
    wait_ms: list[float] = field(default_factory=list)
    load_ms: list[float] = field(default_factory=list)
    compute_ms: list[float] = field(default_factory=list)
    order: list[str] = field(default_factory=list)  # "sidecar:<segment>", "layer:<l>"
    failed: list[int] = field(default_factory=list)  # segments whose layer read failed
    sync_layer_loads: int = 0

    @property
    def total_wait_ms(self) -> float:
        return float(sum(self.wait_ms))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total_wait_ms"] = self.total_wait_ms
        return d


@dataclass
class _Src:
    kind: str  # tensor | gpu | host | disk | none
    start: int
    end: int
    obj: Any = None  # KVChunk, EntryImage, or ChunkKey


@dataclass
class _Fill:
    """A host-tier image copied onto the device tier as a request streams it."""

    host: Any  # EntryImage in the host tier (pinned by the session)
    device: Any  # EntryImage on the device, filled layer by layer
    charged: int  # the device tier's claim


class Prefetcher:
    """The shared half of layer-wise loading over a TieredStore (or in-memory chunks): the
    side stream, a pool of reusable layer buffers and the sidecar cache. Each request gets
    its own `LoadSession` from `start` (the `fusion.LayerSource` of that request), so a
    request that fails or is abandoned leaves nothing behind once its session is closed."""

    def __init__(self, adapter: ModelAdapter, store=None, config: PrefetchConfig = PrefetchConfig()) -> None:
        self.adapter, self.store, self.config = adapter, store, config
        self.device, self.dtype = adapter.device, adapter.dtype
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._free: list[_Buffers] = []  # buffers of finished sessions, reused by the next
        self._lock = threading.Lock()
        self._sidecars: OrderedDict[ChunkKey, tuple] = OrderedDict()  # key -> (idx, ak, av, crit) at home
        self._sidecar_bytes = 0
        self._promoter: ThreadPoolExecutor | None = None  # one background thread, made on first use

    def promote(self, keys: Sequence[ChunkKey]) -> Future | None:
        """Copy these disk-tier chunks into the memory tiers, in the background (one thread;
        never raises: a chunk that cannot be read stays on disk). -> the job's future."""
        if not keys or self.store is None:
            return None
        with self._lock:
            if self._promoter is None:
                self._promoter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qcfuse-promote")
            pool = self._promoter

        def run() -> int:
            done = 0
            for key in keys:
                try:
                    done += bool(self.store.promote(key))
                except Exception:  # noqa: BLE001 - a failed promotion only costs the next request a disk read
                    log.warning("prefetch: promoting %s into memory failed", key, exc_info=True)
            return done

        return pool.submit(run)

    # -- lookup ------------------------------------------------------------------------------
    def tier_of(self, key: ChunkKey) -> str | None:
        """gpu | host | disk | None: the fastest tier holding `key` (no promotion, no read)."""
        st = self.store
        if st is None:
            return None
        for tier in getattr(st, "memory_tiers", []):
            if key in tier:
                return tier.name
        disk = getattr(st, "disk", None)
        return "disk" if disk is not None and disk.contains(key) else None

    def view(
        self,
        key: ChunkKey,
        token_ids: torch.Tensor,
        *,
        depth: int = 0,
        critical: Sequence[int] = (),
        anchors: AnchorConfig = AnchorConfig(),
        keep: str | None = None,
    ) -> ChunkView:
        """A lazy chunk for `key`; with depth > 0 it carries the probe sidecar (sidecars first).

        keep: where this prefetcher caches sidecars between requests - "device" (default on
        CUDA: where the probe runs, no copy per request), "host" (pinned under CUDA) or
        "none" (read from the store each time). The cache is bounded by
        `PrefetchConfig.sidecar_bytes` (least recently used dropped)."""
        L = self.adapter.num_layers
        if depth <= 0:
            return ChunkView(key, token_ids, L, self.store, self.device, self.dtype)
        keep = keep or ("device" if self.cuda else "host")
        want = (depth, tuple(critical), anchors.method)
        got = self._cached_sidecar(key, want)
        if got is None:
            side = self.store.get_sidecar(key)
            if not _sidecar_ok(side, depth, list(critical), anchors.method):
                raise KeyError(f"chunk {key} has no probe sidecar; call ensure_sidecar at ingestion")
            m = anchors.method
            got = (
                side.anchors[m][:depth].to(torch.int64),
                side.anchors[_k_name(m)][:depth],
                side.anchors[_v_name(m)][:depth],
                {l: side.layer_keys[l] for l in critical},
            )
            if keep == "device":
                got = _home(got, self.device, self.dtype, pin=False)
            elif keep == "host":
                got = _home(got, None, None, pin=self.cuda)
            if keep != "none":
                self._cache_sidecar(key, want, got)
        idx, ak, av, crit = got
        nb = self.cuda
        return ChunkView(
            key,
            token_ids,
            L,
            self.store,
            self.device,
            self.dtype,
            anchors.method,
            idx,
            ak.to(self.device, self.dtype, non_blocking=nb),
            av.to(self.device, self.dtype, non_blocking=nb),
            {l: t.to(self.device, self.dtype, non_blocking=nb) for l, t in crit.items()},
        )

    def _cached_sidecar(self, key: ChunkKey, want: tuple) -> tuple | None:
        with self._lock:
            hit = self._sidecars.get(key)
            if hit is None or hit[0] != want:
                return None
            self._sidecars.move_to_end(key)
            return hit[1]

    def _cache_sidecar(self, key: ChunkKey, want: tuple, got: tuple) -> None:
        idx, ak, av, crit = got
        nbytes = sum(t.numel() * t.element_size() for t in (idx, ak, av, *crit.values()))
        with self._lock:
            old = self._sidecars.pop(key, None)
            self._sidecar_bytes -= old[2] if old is not None else 0
            self._sidecars[key] = (want, got, nbytes)
            self._sidecar_bytes += nbytes
            while self._sidecar_bytes > self.config.sidecar_bytes and len(self._sidecars) > 1:
                _, (_, _, n) = self._sidecars.popitem(last=False)
                self._sidecar_bytes -= n

    def forget_sidecars(self) -> None:
        with self._lock:
            self._sidecars.clear()
            self._sidecar_bytes = 0

    def drop_buffers(self) -> None:
        """Free the layer buffers finished sessions left for reuse (sessions still open keep
        theirs; the next session allocates anew)."""
        with self._lock:
            self._free = []

    # -- request -----------------------------------------------------------------------------
    def start(self, prompt: FusedPrompt) -> "LoadSession":
        """Resolve every segment's source and begin loading layer 0, 1, 2, ... of them.
        The caller must `finish()` or `close()` the session (in a `finally`)."""
        return LoadSession(self, prompt)

    def _take_buffers(self, T: int, disk_T: int) -> "_Buffers":
        L = self.adapter.num_layers
        Hkv, D = self.adapter.shape.num_kv_heads, self.adapter.shape.head_dim
        with self._lock:
            bufs = self._free.pop() if self._free else _Buffers(None, [])
        with torch.inference_mode():
            if bufs.kv is None or bufs.kv.shape[2] < T or bufs.kv.shape[1] != L:
                bufs.kv = torch.empty((2, L, T, Hkv, D), device=self.device, dtype=self.dtype)
            if self.cuda and disk_T and (not bufs.stage or bufs.stage[0].shape[1] < disk_T):
                bufs.stage = [
                    torch.empty((2, disk_T, Hkv, D), dtype=self.dtype, pin_memory=True)
                    for _ in range(self.config.staging_slots)
                ]
        return bufs

    def _give_back(self, bufs: "_Buffers") -> None:
        with self._lock:
            self._free.append(bufs)


@dataclass
class _Buffers:
    kv: torch.Tensor | None  # (2, L, Tcap, Hkv, D) on the compute device
    stage: list[torch.Tensor]  # pinned (2, Tcap_disk, Hkv, D) per slot (CUDA, disk sources)


class LoadSession:
    """One request's layer loads: `fusion.LayerSource` for its fused prefill.

    Owns the loader thread, the events and the report of that request. `finish()` joins
    the loader and returns the report; `close()` (idempotent, also after an error) lets go
    of everything, so the next request starts clean."""

    def __init__(self, pf: Prefetcher, prompt: FusedPrompt) -> None:
        self.pf, self.adapter, self.store, self.config = pf, pf.adapter, pf.store, pf.config
        self.device, self.dtype, self.cuda = pf.device, pf.dtype, pf.cuda
        self._stream = pf._stream
        self.report = PrefetchReport()
        self._prompt = prompt
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._need: list[torch.cuda.Event] | None = None  # CUDA: where the compute asked for each layer
        self._pins: list[TierPin] = []  # memory-tier entries held against eviction until close
        self._fills: list[_Fill] = []  # host images copied onto the device tier as they stream
        try:
            self._setup(prompt)
        except BaseException:
            self._unclaim()
            self._unpin()
            raise

    def _setup(self, prompt: FusedPrompt) -> None:
        pf = self.pf
        T, L = prompt.num_tokens, self.adapter.num_layers
        Hkv, D = self.adapter.shape.num_kv_heads, self.adapter.shape.head_dim
        self._srcs = [self._locate(s, st) for s, st in zip(prompt.segments, prompt.starts)]
        for i, (s, seg) in enumerate(zip(self._srcs, prompt.segments)):
            if s.kind == "none" and isinstance(seg.chunk, ChunkView):  # gone since the plan: recomputed
                log.warning(
                    "prefetch: %s left every tier after it was planned (another process?); it is recomputed",
                    seg.chunk.key,
                )
                self.report.failed.append(i)
        for s, seg in zip(self._srcs, prompt.segments):
            self.report.sources[s.kind] = self.report.sources.get(s.kind, 0) + 1
            self.report.segment_sources.append(s.kind)
            if isinstance(seg.chunk, ChunkView) and seg.chunk.depth:
                self.report.order.append(f"sidecar:{seg.chunk.key.token_hash[:8]}")
        self._fills = self._claim_fills()
        disk_T = sum(s.end - s.start for s in self._srcs if s.kind == "disk")
        self._bufs = pf._take_buffers(T, disk_T)
        kv = self._bufs.kv
        assert kv is not None  # _take_buffers always allocates it
        self._buf: torch.Tensor = kv
        self._stage = self._bufs.stage
        self._host_ready = [threading.Event() for _ in range(L)]
        self._credits = threading.Semaphore(self.config.window or L)  # loads allowed ahead of layer()
        self._next = 0
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            self._base = torch.cuda.Event(enable_timing=True)
            self._base.record(cur)
            assert self._stream is not None  # the prefetcher makes one on CUDA
            self._stream.wait_stream(cur)  # reuse of buffers: after everything already enqueued
            self._ready = [torch.cuda.Event(enable_timing=True) for _ in range(L)]
            self._need = [torch.cuda.Event(enable_timing=True) for _ in range(L)]
        with self._on_side(), torch.inference_mode():
            for s in self._srcs:  # uncached rows: zeros (they are always recomputed)
                if s.kind == "none":
                    self._buf[:, :, s.start : s.end].zero_()
        self.report.load_ms = [0.0] * L
        self.report.wait_ms = [0.0] * L
        self._disk_jobs: list[tuple[_Src, int]] = []  # disk sources and their offsets in staging
        for src in self._srcs:
            if src.kind == "disk":
                self._disk_jobs.append((src, sum(j.end - j.start for j, _ in self._disk_jobs)))
        self._enqueued = self.cuda and self.config.eager_memory and not self._disk_jobs
        row_bytes = 2 * Hkv * D * self._buf.element_size()
        self._layer_bytes = sum(s.end - s.start for s in self._srcs if s.kind != "none") * row_bytes
        self._source_bytes: dict[str, int] = {}  # one layer's bytes per source kind
        for s in self._srcs:
            if s.kind != "none":
                self._source_bytes[s.kind] = self._source_bytes.get(s.kind, 0) + (s.end - s.start) * row_bytes
        self._issued = 0  # layers whose copies are enqueued (eager mode)
        if self._enqueued:
            try:
                self._issue(min(L, self.config.ahead))
            except BaseException:
                self.close()
                raise
        elif self.config.threaded and (self.cuda or self._disk_jobs):
            # a CPU request from memory tiers loads each layer in its own thread when asked: a
            # loader thread there only copies RAM to RAM, and beside the compute threads' team
            # it slowed the probe by ~40% on 2 cores (team barriers wait for the switched-out
            # thread; docs/benchmarks.md "CPU")
            self._thread = threading.Thread(target=self._loader, name="qcfuse-prefetch", daemon=True)
            self._thread.start()

    def layer(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer` of the prompt's caches: k_pre, v (T, Hkv, D); zeros where uncached."""
        if self._closed:
            raise RuntimeError("this load session is closed")
        if layer != self._next:
            raise ValueError(f"layers must be asked for in order: expected {self._next}, got {layer}")
        self._next += 1
        self._credits.release()  # the consumer moved on: the loader may start one more layer
        t0 = time.perf_counter()
        if self._thread is not None:
            self._host_ready[layer].wait()
            if self._error is not None:
                raise RuntimeError("prefetch failed") from self._error
        else:
            try:
                if self._enqueued:
                    self._issue(min(self.adapter.num_layers, layer + 1 + self.config.ahead))
                else:
                    with torch.inference_mode():
                        self._load(layer)
            except Exception as e:  # the same error as from the loader thread
                self._error = e
                raise RuntimeError("prefetch failed") from e
        host_wait = (time.perf_counter() - t0) * 1e3
        T = self._prompt.num_tokens
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            assert self._need is not None  # set on CUDA until the session closes
            self._need[layer].record(cur)
            cur.wait_event(self._ready[layer])
        else:
            self.report.wait_ms[layer] = host_wait
        kv = self._buf[:, layer, :T]  # (2, T, Hkv, D), ordered after its load on the current stream
        k, v = kv[0], kv[1]
        if like.dtype != k.dtype or like.device != k.device:
            k, v = k.to(like.device, like.dtype), v.to(like.device, like.dtype)
        return k, v

    def finish(self) -> PrefetchReport:
        """Join the loader; on CUDA turn the events into per-layer waits (synchronizes).
        Closes the session; raises if a load failed."""
        self._join()
        if self.cuda and self._need is not None and self._next:
            torch.cuda.current_stream(self.device).synchronize()
            n = self._next
            need = [self._base.elapsed_time(e) for e in self._need[:n]]
            ready = [self._base.elapsed_time(e) for e in self._ready[:n]]
            self.report.wait_ms = [max(0.0, r - q) for q, r in zip(need, ready)] + [0.0] * (len(self._need) - n)
            self.report.compute_ms = [need[l + 1] - need[l] - self.report.wait_ms[l] for l in range(n - 1)]
            self._need = None
        if self._error is None and self._fills and self._next == self.adapter.num_layers:
            self._admit_fills()
        self.close()
        if self._error is not None:
            raise RuntimeError("prefetch failed") from self._error
        return self.report

    def _issue(self, upto: int) -> None:
        """Eager mode: enqueue the copies of layers up to `upto` (exclusive)."""
        with torch.inference_mode():
            while self._issued < upto:
                self._load(self._issued)
                self._issued += 1

    def close(self) -> None:
        """Let go of the loader thread, the buffers and the pins (idempotent; never raises)."""
        if self._closed:
            return
        self._join()
        self._closed = True
        self._need = None
        self._unclaim()
        self._unpin()
        for src in getattr(self, "_srcs", ()):  # the host tier reuses an image's bytes once nobody holds it
            if src.kind in ("gpu", "host"):
                src.obj = None
        self.pf._give_back(self._bufs)

    # -- the device tier ----------------------------------------------------------------------
    def _claim_fills(self) -> list["_Fill"]:
        """Host-tier sources to copy into the store's device tier as they stream: those not
        already there for which the tier grants a claim (the engine's GPU budget has room).
        From its first use: the bytes cross the bus for this request anyway, and the tier's
        policy (slru by default) keeps chunks used again ahead of those seen once. Each
        source then reads from its device copy, filled per layer just before (same stream,
        so in order)."""
        tier = self._device_tier()
        if not self.config.fill_device_tier or tier is None:
            return []
        from qcfuse_core.store.entry import EntryImage  # the store's image format (imported where it is used)

        fills: dict[ChunkKey, _Fill] = {}
        for s in self._srcs:
            if s.kind != "host":
                continue
            image = s.obj
            fill = fills.get(image.key)
            if fill is None:
                if image.key in tier:
                    continue
                charged = tier.claim(image.nbytes)
                if charged is None:  # the running requests hold the room: stream it as usual
                    continue
                data = torch.empty(image.nbytes, dtype=torch.uint8, device=self.device)
                first = image.layout.layer_spans[0][0] if image.layout.layer_spans else image.nbytes
                with self._on_side():
                    data[:first].copy_(image.data[:first], non_blocking=self.cuda)  # header, tokens, scales
                fill = fills[image.key] = _Fill(image, EntryImage(image.layout, data), charged)
            s.obj = fill.device  # this segment's rows now come from the device copy
        return list(fills.values())

    def _copy_fills(self, layer: int) -> None:
        """Layer `layer`'s bytes of each filled image, host -> device tier (on the side stream)."""
        for f in self._fills:
            a, b = f.host.layout.layer_spans[layer]
            f.device.data[a:b].copy_(f.host.data[a:b], non_blocking=self.cuda)

    def _admit_fills(self) -> None:
        """Every layer is loaded (and, on CUDA, the copies are done): the device copies become
        the device tier's entries."""
        tier = self._device_tier()
        fills, self._fills = self._fills, []
        for f in fills:
            assert tier is not None  # a fill exists only where the store has the tier
            tier.admit(f.charged, f.device)

    def _device_tier(self):
        """The store's tier on the compute device, or None (none, or no store: in-memory chunks)."""
        return self.store.device_tier(self.device) if self.store is not None else None

    def _unclaim(self) -> None:
        fills, self._fills = self._fills, []
        tier = self._device_tier()
        for f in fills:
            if tier is not None:  # a fill exists only where the store has the tier
                tier.unclaim(f.charged)

    def _unpin(self) -> None:
        pins, self._pins = self._pins, []
        for pin in pins:
            try:
                self.store.unpin(pin)
            except Exception:  # noqa: BLE001 - close never raises; a pin left behind only costs room
                log.warning("prefetch: unpinning %s failed", pin.key, exc_info=True)

    def __enter__(self) -> "LoadSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _join(self) -> None:
        if self._thread is not None:
            self._credits.release(self.adapter.num_layers)  # never leave the loader blocked
            self._thread.join()
            self._thread = None

    # -- loading -----------------------------------------------------------------------------
    def _locate(self, seg, start: int) -> _Src:
        end = start + len(seg)
        c = seg.chunk
        if c is None:
            return _Src("none", start, end)
        if not isinstance(c, ChunkView):
            return _Src("tensor", start, end, c)
        pin = self.store.pin(c.key)  # held until the session closes: the tier cannot evict it
        if pin is not None:
            self._pins.append(pin)
            return _Src(pin.tier, start, end, pin.image)
        if self.store.disk.contains(c.key):
            return _Src("disk", start, end, c.key)
        return _Src("none", start, end)  # vanished since the plan (another process removed it): a miss

    def _layer_copies(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One layer's (destinations, sources) of every in-memory source: a chunk tensor, a
        gpu / host image (its per-layer views made once per image; fp8 ones decoded here)."""
        dst, src = [], []
        buf = self._buf
        for s in self._srcs:
            if s.kind == "tensor":
                k, v = s.obj.k[layer], s.obj.v[layer]
            elif s.kind in ("gpu", "host"):
                if s.obj.layout.scale_span is not None:  # fp8: decoded per layer, where it is used
                    from qcfuse_core.store.codec import decode_layer

                    raw, scale = s.obj.kv(layer), s.obj.scale(layer)
                    if raw.device != self.device:  # the stored bytes (half of bf16's) travel, not the decode
                        nb = self.cuda and raw.is_pinned()
                        raw, scale = raw.to(self.device, non_blocking=nb), scale.to(self.device, non_blocking=nb)
                    kv = decode_layer(raw, scale, self.dtype)
                    k, v = kv[0], kv[1]
                else:
                    ks, vs = _layer_views(s.obj)
                    k, v = ks[layer], vs[layer]
            else:
                continue
            dst += [buf[0, layer, s.start : s.end], buf[1, layer, s.start : s.end]]
            src += [k, v]
        return dst, src

    def _on_side(self):
        if not self.cuda:
            return _Null()
        return torch.cuda.stream(self._stream)

    def _loader(self) -> None:
        try:
            if self.cuda:
                torch.cuda.set_device(self.device)
            with torch.inference_mode():
                for layer in range(self.adapter.num_layers):
                    self._credits.acquire()
                    self._load(layer)
        except BaseException as e:  # surfaced to the compute thread by layer() / finish()
            self._error = e
            for ev in self._host_ready:
                ev.set()

    def _load(self, layer: int) -> None:
        t0 = time.perf_counter()
        with self._on_side():
            self._copy_fills(layer)
            dst, src = self._layer_copies(layer)
            self.report.bytes_loaded += self._layer_bytes
            for kind, n in self._source_bytes.items():
                self.report.bytes_by_source[kind] = self.report.bytes_by_source.get(kind, 0) + n
            if dst:  # one call for the layer's copies
                torch._foreach_copy_(dst, src, non_blocking=self.cuda)
            if self._disk_jobs:
                self._load_disk(layer, self._disk_jobs)
            if self.cuda:
                self._ready[layer].record(self._stream)
        self.report.load_ms[layer] = (time.perf_counter() - t0) * 1e3
        self.report.order.append(f"layer:{layer}")
        self._host_ready[layer].set()

    def _load_disk(self, layer: int, jobs: list[tuple[_Src, int]]) -> None:
        """Disk -> (pinned staging slot ->) this layer's buffer rows."""
        buf = self._buf
        if not self.cuda:
            dst = [(buf[0, layer, s.start : s.end], buf[1, layer, s.start : s.end]) for s, _ in jobs]
        else:
            slot = layer % len(self._stage)
            if layer >= len(self._stage):  # the slot's previous copies must be done before reuse
                self._ready[layer - len(self._stage)].synchronize()
            st = self._stage[slot]
            dst = [(st[0, o : o + s.end - s.start], st[1, o : o + s.end - s.start]) for s, o in jobs]
        oks = self.store.disk.read_layers_into([(s.obj, layer, k, v) for (s, _), (k, v) in zip(jobs, dst)])
        for (s, _), (k, v), ok in zip(jobs, dst, oks):
            if not ok:
                log.warning("prefetch: layer %d of %s unreadable; its rows are zeros", layer, s.obj)
                seg = self._srcs.index(s)
                if seg not in self.report.failed:
                    self.report.failed.append(seg)
                k.zero_()
                v.zero_()
            if self.cuda:
                buf[0, layer, s.start : s.end].copy_(k, non_blocking=True)
                buf[1, layer, s.start : s.end].copy_(v, non_blocking=True)


def _layer_views(image) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Per-layer K and V views of a memory-tier image, made once per image (they alias its
    buffer, which lives as long as the image)."""
    got = getattr(image, "_layer_views", None)
    if got is None:
        kv = image.layers_kv()  # (L, 2, n, Hkv, D)
        got = image._layer_views = (kv.select(1, 0).unbind(0), kv.select(1, 1).unbind(0))
    return got


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _home(got: tuple, device: torch.device | None, dtype: torch.dtype | None, pin: bool) -> tuple:
    """Sidecar tensors moved to where this prefetcher keeps them between requests (on the
    compute device: already in the model's dtype, so a request's `.to()` is a no-op)."""

    def move(t: torch.Tensor) -> torch.Tensor:
        if device is not None:
            return t.to(device, dtype)
        t = t.cpu()
        return t.pin_memory() if pin and not t.is_pinned() else t

    idx, ak, av, crit = got
    return idx.cpu(), move(ak), move(av), {l: move(t) for l, t in crit.items()}
