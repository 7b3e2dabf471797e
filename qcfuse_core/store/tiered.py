"""The tiered chunk store: GPU memory -> host memory -> disk, behind `ChunkStore`.

    get(key)            gpu hit ──────────────────────────────> decode
                        host hit ──> promote to gpu ──────────> decode
                        disk hit ──> host (pinned) ──> gpu ───> decode
                        miss everywhere ──> None (the engine recomputes and puts)
    put(chunk)          encode once (host image) ──> disk (write-through) ──> host tier

What must hold:
- tiers are inclusive caches of the disk; each holds at most its byte capacity;
- every tensor handed out is a fresh copy the caller owns (in-place edits by the engine,
  such as scattering recomputed rows, never reach a cached entry);
- nothing here raises to the engine on a damaged or missing entry: that is a miss;
- when the disk is full, puts still fill the memory tiers (counted as write failures), and
  every answer is still served (from memory or by recomputing);
- an entry a load session streams from is pinned in its memory tier (`pin` ... `unpin`,
  reference counted): never evicted while pinned; a put that only evicting pinned entries
  could make room for is not admitted (counted in the tier's `refused_pinned`; tier.py);
- a read-only store (`read_only=True`, or auto-detected by `open_store`) answers from what
  is stored and keeps what it computes in memory only; nothing on disk changes.
GPU tier: only when CUDA is present; the host tier is pinned then, plain memory otherwise.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from qcfuse_core.store.base import ChunkStore, ReadOnlyStoreError, StoreStats
from qcfuse_core.store.codec import check_storage_name, decode_layer
from qcfuse_core.store.disk import DiskTier, never, plain_alloc
from qcfuse_core.store.entry import FORMAT_VERSION, EntryImage, EntryLayout, encode_chunk
from qcfuse_core.store.eviction import get_policy
from qcfuse_core.store.host_tier import HostTier
from qcfuse_core.store.sidecar import Sidecar
from qcfuse_core.store.sizing import disk_tier_bytes, host_tier_bytes
from qcfuse_core.store.tier import MemoryTier, TierPin
from qcfuse_core.types import ChunkKey, KVChunk, NodeId

logger = logging.getLogger(__name__)

GiB = 1 << 30
KV_SUBDIR = "kv"
USES_KEPT = 1 << 16  # keys whose recent uses the store remembers (admission by use)


def kv_dir(store_root: Path | str) -> Path:
    """The KV store folder inside a QCFuse store root (which also holds the Chroma data)."""
    return Path(store_root) / KV_SUBDIR


ADMISSION = ("always", "second")


@dataclass(frozen=True)
class StoreConfig:
    """memory_bytes: the host tier (pinned when CUDA is present); None: sized from the
    machine (`sizing.host_tier_bytes`). disk_bytes: the disk tier; None: sized from the disk
    when the store opens (`sizing.disk_tier_bytes`, DISK_SHARE). gpu_bytes: a cap on the GPU tier, used only when
    CUDA is present; None: no cap - the tier holds what the engine's GPU budget leaves
    (cache/budget.py), nothing in a store opened without an engine.
    admission: when a chunk a request read from the disk tier enters memory (the engine's
    `promote_disk_reads`) - "second": from its second use on (a chunk seen once, the bulk of
    a long tail, costs no promotion and pushes nothing out); "always": from its first use.
    A chunk streamed from the host tier enters the GPU tier from its first use (its bytes
    cross the bus anyway); the policy (slru) then keeps the chunks used again."""

    memory_bytes: int | None = None
    gpu_bytes: int | None = None
    disk_bytes: int | None = None  # None: sized from the disk (`sizing.disk_tier_bytes`)
    storage_dtype: str = "auto"  # auto | bf16 | fp16 | fp32 | fp8
    policy: str = "slru"  # eviction.py
    sidecar_layers: tuple[int, ...] = ()  # layers whose K goes into the sidecar on put
    sidecar_cache_bytes: int = 256 << 20
    durable: bool = False  # fsync each file: survives power loss (slower ingestion; store/atomic.py)
    admission: str = "second"

    def __post_init__(self) -> None:
        check_storage_name(self.storage_dtype)
        get_policy(self.policy)
        if self.admission not in ADMISSION:
            raise ValueError(f"admission must be one of {ADMISSION}, got {self.admission!r}")
        for name, v in (("memory_bytes", self.memory_bytes), ("gpu_bytes", self.gpu_bytes)):
            if v is not None and v < 0:  # None: sized from the machine
                raise ValueError(f"{name} must be >= 0, got {v}")
        if self.sidecar_cache_bytes is None or self.sidecar_cache_bytes < 0:
            raise ValueError(f"sidecar_cache_bytes must be >= 0, got {self.sidecar_cache_bytes}")
        if self.disk_bytes is not None and self.disk_bytes < 0:
            raise ValueError(f"disk_bytes must be >= 0 or None, got {self.disk_bytes}")
        if any(l < 0 for l in self.sidecar_layers):
            raise ValueError(f"sidecar_layers must be >= 0, got {self.sidecar_layers}")


@dataclass
class LayerBatch:
    """One layer of C chunks laid end to end.

        k, v (T_total, Hkv, D):  | chunk 0 | chunk 1 | ... | chunk C-1 |
        offsets (C+1,):          0        t1        t2   ...          T_total
    A chunk found nowhere occupies zero rows; a chunk whose read failed verification keeps
    its rows (contents undefined). Either way found[c] is False and the caller recomputes it.
    """

    k: torch.Tensor
    v: torch.Tensor
    offsets: list[int]
    found: list[bool]


def _pinned_alloc(nbytes: int) -> torch.Tensor:
    # Staging for disk reads (and `encode_chunk`'s images under CUDA): blocks of torch's caching
    # host allocator, power-of-two sized and reused once released. What the host tier keeps
    # it copies into its arena (store/arena.py), charged at the image's own size.
    register_pinned_pages()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


PIN_REGISTER_THREADS = 8
_pin_lock = threading.Lock()
_pin_registered: bool | None = None  # decided once per process


def register_pinned_pages() -> bool:
    """Let torch's pinned host allocator page-lock fresh blocks with cudaHostRegister on
    PIN_REGISTER_THREADS threads instead of cudaHostAlloc (once per process; not when the
    user configured the pinned allocator in PYTORCH_CUDA_ALLOC_CONF). On the H200 host a
    cudaHostAlloc pinned ~2.1 GB/s and serialised the store's writer threads; registration
    ~7.7 GB/s (docs/benchmarks.md, ingestion). -> True when the setting is in effect."""
    global _pin_registered
    with _pin_lock:
        if _pin_registered is None:
            _pin_registered = _set_pinned_register()
        return _pin_registered


def _set_pinned_register() -> bool:
    import os

    if "pinned" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return False  # the user's choice stands
    setting = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{PIN_REGISTER_THREADS}"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    try:
        setter(setting)
    except (RuntimeError, AttributeError, ValueError) as e:  # a torch without the option: cudaHostAlloc
        logger.info("pinned allocator setting not applied (%s)", e)
        return False
    return True


class TieredStore(ChunkStore):
    streams_layers = True  # probe sidecars and layer-wise reads (see ChunkStore)

    def __init__(
        self,
        root: Path | str,
        config: StoreConfig = StoreConfig(),
        *,
        use_cuda: bool | None = None,
        read_only: bool = False,
        chunk_device: str | None = None,
    ) -> None:
        """chunk_device: where the fastest tier (named "gpu") lives - default "cuda" when CUDA
        is used; tests of the GPU budget on a CPU pass "cpu"."""
        self.config = config
        self.cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        policy = get_policy(config.policy)
        dev = chunk_device or ("cuda" if self.cuda else None)
        gpu_cap = config.gpu_bytes
        self.gpu = (
            MemoryTier("gpu", dev, 0 if gpu_cap is None else gpu_cap, policy)
            if dev is not None and gpu_cap != 0
            else None
        )
        memory = config.memory_bytes if config.memory_bytes is not None else host_tier_bytes()
        self.host = HostTier("host", memory, policy, pin=self.cuda)  # images in one arena (store/arena.py)
        gpu = self.gpu
        if gpu is not None:  # a chunk on the GPU keeps its host copy only while the room is spare
            self.host.shadowed = gpu.__contains__
        self._uses: OrderedDict[ChunkKey, int] = OrderedDict()  # recent uses per key (admission)
        self.disk = DiskTier(
            root,
            config.storage_dtype,
            capacity_bytes=config.disk_bytes,
            alloc=_pinned_alloc if self.cuda else plain_alloc,
            durable=config.durable,
            read_only=read_only,
        )
        if config.disk_bytes is None and not self.disk.read_only:
            self.disk.capacity_bytes = disk_tier_bytes(root, self.disk.manifest.count_and_bytes()[1])
        self._stats = StoreStats()
        self._sidecars: OrderedDict[ChunkKey, Sidecar] = OrderedDict()
        self._sidecar_bytes = 0
        self._nodes: dict[tuple[str, str], ChunkKey] = {}  # fallback when the disk is full
        self._lock = threading.Lock()

    @property
    def memory_tiers(self) -> list[MemoryTier]:
        return [t for t in (self.gpu, self.host) if t is not None]

    # -- lookup with promotion --------------------------------------------------------------
    def _image(self, key: ChunkKey) -> EntryImage | None:
        """The entry from the fastest tier that has it, promoting it into faster tiers."""
        for i, tier in enumerate(self.memory_tiers):
            image = tier.get(key)
            if image is not None:
                for faster in self.memory_tiers[:i]:
                    faster.put(image)
                    image = faster.get(key, count=False) or image
                return image
        image = self.disk.read(key)
        if image is None:
            return None
        for tier in reversed(self.memory_tiers):  # host first, then gpu
            tier.put(image)
            image = tier.get(key, count=False) or image
        return image

    # -- admission by use -------------------------------------------------------------------
    def note_use(self, key: ChunkKey) -> int:
        """Count a request's use of `key` -> its uses so far (bounded memory: the least recently
        used counts are forgotten beyond USES_KEPT keys)."""
        with self._lock:
            n = self._uses.pop(key, 0) + 1
            self._uses[key] = n
            while len(self._uses) > USES_KEPT:
                self._uses.popitem(last=False)
            return n

    def admits(self, key: ChunkKey) -> bool:
        """Whether `key`, read from a slower tier, may enter a faster one now
        (`StoreConfig.admission`)."""
        if self.config.admission == "always":
            return True
        with self._lock:
            return self._uses.get(key, 0) >= 2

    def device_tier(self, device: torch.device) -> MemoryTier | None:
        """The "gpu" tier when it lives on `device`'s kind of memory (`chunk_device`), else None."""
        gpu = self.gpu
        return gpu if gpu is not None and gpu.device.type == torch.device(device).type else None

    def fit_device_tier(self, device: torch.device, room: int) -> bool:
        """As `ChunkStore.fit_device_tier`, the tier capped at `StoreConfig.gpu_bytes` (None: no
        cap but the room)."""
        cap = self.config.gpu_bytes
        return super().fit_device_tier(device, room if cap is None else min(cap, room))

    def in_memory(self, key: ChunkKey) -> bool:
        return any(key in t for t in self.memory_tiers)

    # -- pins -------------------------------------------------------------------------------
    def pin(self, key: ChunkKey) -> TierPin | None:
        """Pin `key` in the fastest memory tier holding it (no promotion; each tier asked
        counts a hit or a miss: a load session reads what it pins) -> the pin, or None when
        it is only on disk (or nowhere). While pinned it is never evicted from that tier (see
        `tier.MemoryTier.put`)."""
        for tier in self.memory_tiers:
            image = tier.pin(key)
            if image is not None:
                return TierPin(tier.name, image)
        return None

    def unpin(self, pin: TierPin) -> None:
        for tier in self.memory_tiers:
            if tier.name == pin.tier:
                tier.unpin(pin.key)

    def promote(self, key: ChunkKey) -> bool:
        """Copy a disk-tier entry into the slowest memory tier (host), where the next request's
        layer loads find it -> True when it was read and admitted. Already in a memory tier,
        not on disk, or larger than the tier: False."""
        tiers = self.memory_tiers
        if not tiers or tiers[-1].capacity_bytes == 0 or self.in_memory(key):
            return False
        image = self.disk.read(key)
        if image is None:
            return False
        tiers[-1].put(image)
        return key in tiers[-1]

    def get(self, key: ChunkKey) -> KVChunk | None:
        image = self._image(key)
        if image is None:
            self._count(misses=1)
            return None
        chunk = image.decode()
        side = self.get_sidecar(key)
        if side is not None:
            chunk.anchors = dict(side.anchors)
        self._count(hits=1, bytes_read=image.nbytes)
        return chunk

    def get_layer(self, key: ChunkKey, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k, v) of one layer, each (T, Hkv, D); a disk hit reads only that layer (no promotion)."""
        for tier in self.memory_tiers:
            image = tier.get(key)
            if image is not None:
                self._count(hits=1, bytes_read=image.layout.layer_bytes)
                return image.decode_layer(layer)
        lay = self.disk.layout(key)
        if lay is not None:
            k = torch.empty(lay.layer_shape[1:], dtype=lay.src_dtype)
            v = torch.empty_like(k)
            if self.disk.read_layer_into(key, layer, k, v):
                self._count(hits=1, bytes_read=lay.layer_bytes)
                return k, v
        self._count(misses=1)
        return None

    def read_layer_batch(
        self,
        keys: Sequence[ChunkKey],
        layer: int,
        *,
        out_k: torch.Tensor | None = None,
        out_v: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> LayerBatch:
        """Layer `layer` of many chunks into one (preallocated, possibly pinned) buffer pair.

        out_k/out_v, when given, must be (T_total, Hkv, D) with T_total the sum of the found
        chunks' lengths; otherwise they are allocated on `device` (host: pinned under CUDA).
        """
        sources: list[tuple[str, EntryImage | None, EntryLayout | None]] = []
        lengths = []
        for key in keys:
            src: tuple[str, EntryImage | None, EntryLayout | None] | None = None
            for tier in self.memory_tiers:
                image = tier.get(key)
                if image is not None:
                    src = ("mem", image, image.layout)
                    break
            if src is None:
                lay = self.disk.layout(key)
                src = ("disk", None, lay) if lay is not None else ("miss", None, None)
            sources.append(src)
            lengths.append(0 if src[2] is None else src[2].num_tokens)
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        first = next((s[2] for s in sources if s[2] is not None), None)
        if out_k is None or out_v is None:
            shape = (offsets[-1], *(first.layer_shape[2:] if first else (0, 0)))
            dtype = first.src_dtype if first else torch.float32
            dev = torch.device(device or "cpu")
            pin = self.cuda and dev.type == "cpu"
            out_k = torch.empty(shape, dtype=dtype, device=dev, pin_memory=pin)
            out_v = torch.empty(shape, dtype=dtype, device=dev, pin_memory=pin)
        elif out_k.shape[0] != offsets[-1]:
            raise ValueError(f"out_k has {out_k.shape[0]} rows, the found chunks have {offsets[-1]}")
        found = [kind != "miss" for kind, _, _ in sources]
        to_host, to_dev = [], []  # disk reads, run together on the disk tier's I/O threads
        for c, ((kind, image, lay), key, a, b) in enumerate(zip(sources, keys, offsets, offsets[1:])):
            if kind == "mem":
                assert image is not None  # a memory tier's source carries its image
                kv, sc = image.kv(layer), image.scale(layer)
                nb = image.data.is_pinned() and out_k.device.type == "cuda"
                if sc is not None:  # fp8: move the stored bytes (half of bf16), decode there
                    kv = decode_layer(kv.to(out_k.device, non_blocking=nb), sc.to(out_k.device), out_k.dtype)
                out_k[a:b].copy_(kv[0], non_blocking=nb)
                out_v[a:b].copy_(kv[1], non_blocking=nb)
            elif kind == "disk" and out_k.device.type == "cpu":
                to_host.append((c, (key, layer, out_k[a:b], out_v[a:b])))
            elif kind == "disk":
                to_dev.append((c, (key, layer)))
        for (c, _), ok in zip(to_host, self.disk.read_layers_into([job for _, job in to_host])):
            found[c] = ok
        # device outputs: stored bytes into pinned buffers, one copy each, decoded on the device
        for (c, _), raw in zip(to_dev, self.disk.map_io(self.disk.read_layer_raw, [j for _, j in to_dev])):
            found[c] = raw is not None
            if raw is not None:
                a, b = offsets[c], offsets[c + 1]
                kv = raw[0].to(out_k.device, non_blocking=self.cuda)
                sc = None if raw[1] is None else raw[1].to(out_k.device)
                if sc is not None or kv.dtype != out_k.dtype:
                    kv = decode_layer(kv, sc, out_k.dtype)
                out_k[a:b].copy_(kv[0])
                out_v[a:b].copy_(kv[1])
        for ok, (_, _, lay) in zip(found, sources):
            self._count(hits=int(ok), misses=int(not ok), bytes_read=lay.layer_bytes if ok and lay is not None else 0)
        return LayerBatch(out_k, out_v, offsets, found)

    # -- writes -----------------------------------------------------------------------------
    def put(
        self,
        chunk: KVChunk,
        *,
        sidecar_layers: Iterable[int] | None = None,
        anchors: dict[str, torch.Tensor] | None = None,
        layer_keys: dict[int, torch.Tensor] | None = None,
        bulk: bool = False,
    ) -> None:
        """Store a chunk (idempotent); its anchors and the K of `sidecar_layers` (default: the
        config's) go into the sidecar, with `anchors` / `layer_keys` merged in: one sidecar
        write per chunk.

        bulk (ingestion): the host tier takes the chunk only while it has room, so a bulk load
        never evicts what requests made hot. (The image is pinned either way: a device-to-
        pageable copy on the writers stalled the compute; a released pinned block goes back to
        torch's pinned cache and serves the next chunk, see `prepare_bulk`. The host tier keeps
        a copy in its arena.)"""
        key = chunk.key
        memory_only = self.disk.degraded or self.disk.read_only
        if not (self.disk.contains(key) or (memory_only and key in self.host)):
            keep = not bulk or self.host.has_room(self._entry_bytes(chunk)) or memory_only
            image = encode_chunk(chunk, self.config.storage_dtype, pin=self.cuda)
            stored = self.disk.write(image)  # the entry before its sidecar (see gc)
            if keep:
                self.host.put(image)
            self._count(
                puts=1,
                bytes_written=image.nbytes if stored else 0,
                write_failures=int(not stored and not self.disk.read_only),
            )
        layers = tuple(self.config.sidecar_layers if sidecar_layers is None else sidecar_layers)
        if chunk.anchors or layers or anchors or layer_keys:
            self.put_sidecar(
                key,
                anchors={**chunk.anchors, **(anchors or {})},
                layer_keys={**{l: chunk.k[l] for l in layers if l < chunk.num_layers}, **(layer_keys or {})},
            )

    def _entry_bytes(self, chunk: KVChunk) -> int:
        L, T, Hkv, D = chunk.k.shape
        return self.entry_bytes(chunk.key, chunk.k.dtype, L, T, Hkv, D)

    def stored_bytes(self, key: ChunkKey) -> int:
        return self.disk.stored_bytes(key)

    def disk_capacity(self) -> int | None:
        return self.disk.capacity_bytes

    def evict_first(self, expendable: Callable[[str], bool] | None) -> None:
        self.disk.expendable = expendable or never

    def entry_bytes(self, key: ChunkKey, dtype: torch.dtype, L: int, T: int, Hkv: int, D: int) -> int:
        """Bytes of the entry (file and host image) of a chunk of this shape."""
        from qcfuse_core.store.entry import plan_layout

        return plan_layout(key, self.config.storage_dtype, dtype, L, T, Hkv, D)[0].file_bytes

    def prepare_bulk(self, sizes: list[int], writers: int) -> int:
        """Before a bulk load's compute starts: page-lock the host memory its writes will use,
        so none is page-locked while the GPU computes (that stalled the compute: 64 x 1024-token
        Llama-8B chunks took 3-4 s instead of 0.55 s, docs/benchmarks.md). Two kinds: the
        writers' staging images (`writers` in flight, at most one per chunk), as blocks
        released into torch's pinned cache where the writers' allocations find them; and the
        host tier's arena slabs for the entries it has room for (`HostTier.prepare`; the tier
        copies each staged image into an extent, so those need no pinned blocks of their own).
        sizes: the chunks' entry sizes in bytes (`entry_bytes`). -> chunks prepared for (0
        without CUDA)."""
        if not self.cuda or not sizes:
            return 0
        staged = min(len(sizes), writers)
        register_pinned_pages()
        held = [torch.empty(max(sizes), dtype=torch.uint8, pin_memory=True) for _ in range(staged)]
        del held  # back into the cache, page-locked
        return min(len(sizes), staged + self.host.prepare(sizes))

    def put_sidecar(
        self,
        key: ChunkKey,
        *,
        anchors: dict[str, torch.Tensor] | None = None,
        layer_keys: dict[int, torch.Tensor] | None = None,
    ) -> None:
        """Merge anchors / critical-layer keys into the chunk's sidecar (written through)."""
        old = self.get_sidecar(key) or Sidecar()
        side = Sidecar({**old.anchors, **(anchors or {})}, {**old.layer_keys, **(layer_keys or {})})
        side = Sidecar(
            {m: t.detach().cpu().clone() for m, t in side.anchors.items()},
            {l: t.detach().cpu().clone() for l, t in side.layer_keys.items()},
        )
        self.disk.write_sidecar(key, side)
        self._cache_sidecar(key, side)

    def get_sidecar(self, key: ChunkKey) -> Sidecar | None:
        """Anchors and critical-layer keys, from host memory or the small sidecar file."""
        with self._lock:
            if key in self._sidecars:
                self._sidecars.move_to_end(key)
                return self._sidecars[key]
        side = self.disk.read_sidecar(key)
        if side is not None:  # absence is not cached: another process may add it any time
            self._cache_sidecar(key, side)
        return side

    def _cache_sidecar(self, key: ChunkKey, side: Sidecar) -> None:
        with self._lock:
            old = self._sidecars.pop(key, None)
            self._sidecar_bytes -= old.nbytes if old is not None else 0
            self._sidecars[key] = side
            self._sidecar_bytes += side.nbytes
            while self._sidecar_bytes > self.config.sidecar_cache_bytes and self._sidecars:
                _, gone = self._sidecars.popitem(last=False)
                self._sidecar_bytes -= gone.nbytes

    # -- index ------------------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        return any(key in t for t in self.memory_tiers) or self.disk.contains(key)

    def delete(self, key: ChunkKey) -> bool:
        removed = [t.remove(key) for t in self.memory_tiers]
        with self._lock:
            side = self._sidecars.pop(key, None)
            self._sidecar_bytes -= side.nbytes if side is not None else 0
        return self.disk.delete(key) or any(removed)

    def link(self, node_id: NodeId, key: ChunkKey) -> None:
        self._nodes[(node_id, key.fingerprint)] = key

        def write() -> bool:
            self.disk.manifest.link(node_id, key.fingerprint, key.to_string())
            return True

        self.disk.guard(write)

    def resolve(self, node_id: NodeId, fingerprint: str | None = None) -> ChunkKey | None:
        """The key `node_id` was linked to (for `fingerprint`, else the latest link)."""
        try:
            s = self.disk.manifest.resolve(node_id, fingerprint)
        except sqlite3.Error as e:  # fall back to this process's links
            logger.warning("KV store: node lookup failed (%s)", e)
            s = None
        if s is not None:
            return ChunkKey.from_string(s)
        for (nid, fp), key in self._nodes.items():
            if nid == node_id and fingerprint in (None, fp):
                return key
        return None

    def keys(self) -> Iterator[ChunkKey]:
        seen = dict.fromkeys(self.disk.keys())
        for t in self.memory_tiers:
            seen.update(dict.fromkeys(t.keys()))
        return iter(list(seen))

    # -- observability ----------------------------------------------------------------------
    def _count(self, **deltas: int) -> None:
        """Add to the store-level counters (the engine's loader threads call in too)."""
        with self._lock:
            for name, d in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + d)

    def counters(self) -> dict:
        """What `stats` counts in this process, without querying the index (cheap: per answer)."""
        evictions = sum(t.stats.evictions for t in self.memory_tiers) + self.disk.stats.evictions
        with self._lock:
            counters = self._stats.as_dict()
        return {
            "backend": "tiered",
            "degraded": self.disk.degraded,
            "read_only": self.disk.read_only,
            **counters,
            "corrupt": self.disk.stats.corrupt,
            "evictions": evictions,
        }

    def stats(self) -> dict:
        entries, nbytes = self.disk.manifest.count_and_bytes(FORMAT_VERSION, self.config.storage_dtype)
        evictions = sum(t.stats.evictions for t in self.memory_tiers) + self.disk.stats.evictions
        corrupt = self.disk.stats.corrupt
        tiers = {t.name: t.summary() for t in self.memory_tiers}
        tiers["disk"] = {
            "path": str(self.disk.root),
            "entries": entries,
            "bytes_used": nbytes,
            "capacity_bytes": self.disk.capacity_bytes,
            "degraded": self.disk.degraded,
            **self.disk.stats.as_dict(),
        }
        for t in tiers.values():  # None: no lookups yet / an unbounded tier
            looked, cap = t["hits"] + t["misses"], t["capacity_bytes"]
            t["hit_rate"] = t["hits"] / looked if looked else None
            t["occupancy"] = t["bytes_used"] / cap if cap else None
        with self._lock:
            counters = self._stats.as_dict()
        s = counters | {"corrupt": corrupt, "evictions": evictions}
        return {
            "backend": "tiered",
            "format_version": FORMAT_VERSION,
            "read_only": self.disk.read_only,
            "storage_dtype": self.config.storage_dtype,
            "policy": self.config.policy,
            "entries": entries,
            "degraded": self.disk.degraded,
            **s,
            "tiers": tiers,
        }

    def close(self) -> None:
        for t in self.memory_tiers:
            t.clear()
        self.disk.close()


def open_store(
    path: Path | str,
    *,
    memory_bytes: int | None = None,
    gpu_bytes: int | None = None,
    storage_dtype: str = "auto",
    policy: str = "slru",
    disk_bytes: int | None = None,
    sidecar_layers: Sequence[int] = (),
    use_cuda: bool | None = None,
    durable: bool = False,
    read_only: bool | None = None,
    admission: str = "second",
    chunk_device: str | None = None,
) -> TieredStore:
    """Open (creating if needed) the tiered KV store in folder `path` (use `kv_dir(root)`).
    Sizes and admission: `StoreConfig`; chunk_device: `TieredStore`'s.

    read_only: None (default) opens it read-only when it is not writable (one warning);
    True never writes; False expects to write (a refused write still turns it read-only)."""
    config = StoreConfig(
        memory_bytes=memory_bytes,
        gpu_bytes=gpu_bytes,
        disk_bytes=disk_bytes,
        storage_dtype=storage_dtype,
        policy=policy,
        sidecar_layers=tuple(sidecar_layers),
        durable=durable,
        admission=admission,
    )
    if read_only is None:
        read_only = not writable(path)
        if read_only:
            logger.warning(
                "KV store %s is not writable: opened read-only (answers from what is stored; "
                "nothing computed is stored)",
                path,
            )
    try:
        return TieredStore(path, config, use_cuda=use_cuda, read_only=read_only, chunk_device=chunk_device)
    except ReadOnlyStoreError as e:
        logger.warning("%s: opened read-only", e)
        return TieredStore(path, config, use_cuda=use_cuda, read_only=True, chunk_device=chunk_device)


def writable(path: Path | str) -> bool:
    """Can a store in folder `path` be written: the folder (or, while it does not exist,
    its nearest existing parent), its data folder and its manifest files."""
    from qcfuse_core.store.disk import DATA_DIR, MANIFEST_NAME

    p = Path(path)
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            return False
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        return False
    names = [DATA_DIR] + [MANIFEST_NAME + s for s in ("", "-wal", "-shm")]
    return all(os.access(p / n, os.W_OK) for n in names if (p / n).exists())
