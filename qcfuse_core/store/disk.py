"""The disk tier: entry files + the SQLite manifest, verified on every read.

Folder layout (under the KV store folder, `<store root>/kv`):

    manifest.sqlite                                     (+ -wal, -shm)
    data/<fingerprint>/<hash[:2]>/<hash>.<storage>.v<version>.<tag>.safetensors
    data/<fingerprint>/<hash[:2]>/<hash>.v<version>.<tag>.sidecar.safetensors

`tag` is a hash of the entry's checksums, so two different byte images of one entry never
share a path and a row always describes exactly the file it names.

What must hold:
- a read returns the bytes that were written, or None: the file size, the header (checked
  against the canonical layout), every segment checksum and the token-id hash are verified;
  any failure is a miss that is logged, counted (`corrupt`) and removed from the manifest;
- an entry is valid only under its format version and storage name (other rows are ignored);
- a full disk (ENOSPC/EDQUOT, or SQLite's "disk is full") puts the tier in degraded mode:
  one warning, then writes are skipped and counted as `write_failures`; reads continue;
- a read-only tier (`read_only=True`, or a write refused by permissions, after which the
  tier turns read-only with one warning) writes, moves and deletes nothing: damaged entries
  are hidden from this process only, and every write is a no-op returning False.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from qcfuse_core.store.atomic import is_disk_full, prepare_tmp, publish, read_exact
from qcfuse_core.store.base import ReadOnlyStoreError
from qcfuse_core.store.codec import DTYPE_NAME, check_storage_name, decode_layer
from qcfuse_core.store.entry import (
    FORMAT_VERSION,
    EntryFormatError,
    EntryImage,
    EntryLayout,
    checksum,
    header_length,
    parse_header,
)
from qcfuse_core.store.manifest import EntryRow, Manifest, SidecarRow, is_read_only
from qcfuse_core.store.sidecar import Sidecar, decode_sidecar, encode_sidecar
from qcfuse_core.store.tier import TierStats
from qcfuse_core.types import ChunkKey, hash_token_ids

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.sqlite"
DATA_DIR = "data"
_LAYOUT_CACHE = 4096
_TOUCH_EVERY_S = 30.0

Alloc = Callable[[int], torch.Tensor]  # nbytes -> uint8 host buffer (plain or pinned)


def plain_alloc(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


@dataclass
class _Located:
    """A verified header + preamble, cached for single-layer reads."""

    row: EntryRow
    layout: EntryLayout
    scales: torch.Tensor | None  # (L, 2, Hkv) float32 for fp8


def never(chunk_key: str) -> bool:
    """No entry is expendable (`DiskTier.expendable`'s default)."""
    return False


def _sqlite_full(e: sqlite3.Error) -> bool:
    return getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(e)


class DiskTier:
    def __init__(
        self,
        root: Path | str,
        storage: str = "auto",
        *,
        capacity_bytes: int | None = None,
        alloc: Alloc = plain_alloc,
        io_threads: int = 8,
        durable: bool = False,
        read_only: bool = False,
    ) -> None:
        self.root = Path(root)
        self.durable = durable  # fsync every file before publishing it (see store/atomic.py)
        self.storage = check_storage_name(storage)
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"disk capacity must be >= 0 or None, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        # entries (by key string) that leave first past the capacity; a write of one of them
        # evicts only such entries (learned caches never push out registered ones)
        self.expendable: Callable[[str], bool] = never
        self.alloc = alloc
        self.read_only = read_only
        if not read_only:
            (self.root / DATA_DIR).mkdir(parents=True, exist_ok=True)
        self.manifest = Manifest(self.root / MANIFEST_NAME, read_only=read_only)
        self.stats = TierStats()
        self.degraded = False
        self._hidden: set[ChunkKey] = set()  # read-only: damaged entries this process skips
        self._hidden_sidecars: set[ChunkKey] = set()
        self._located: OrderedDict[ChunkKey, _Located] = OrderedDict()
        self._lock = threading.RLock()
        self.io_threads = io_threads
        self._pool: ThreadPoolExecutor | None = None

    # -- paths ------------------------------------------------------------------------------
    def _rel(self, key: ChunkKey, tag: str, kind: str) -> str:
        h = key.token_hash
        name = (
            f"{h}.{self.storage}.v{FORMAT_VERSION}.{tag}.safetensors"
            if kind == "entry"
            else f"{h}.v{FORMAT_VERSION}.{tag}.sidecar.safetensors"
        )
        return f"{DATA_DIR}/{key.fingerprint}/{h[:2]}/{name}"

    # -- failure handling -------------------------------------------------------------------
    def _degrade(self, exc: BaseException) -> None:
        self.stats.write_failures += 1
        if not self.degraded:
            self.degraded = True
            logger.warning(
                "KV store %s: disk full (%s); no more disk writes (memory tiers and recompute still serve)",
                self.root,
                exc,
            )

    def _turn_read_only(self, exc: BaseException) -> None:
        if not self.read_only:
            self.read_only = True
            logger.warning(
                "KV store %s is not writable (%s); answering from what is stored, nothing more is written",
                self.root,
                exc,
            )

    def guard(self, fn: Callable[[], bool]) -> bool:
        """Run a write. A full disk degrades the tier (one warning, then every write is a
        counted no-op); a write refused by permissions turns the tier read-only (one
        warning, then every write is a no-op); any other error propagates."""
        if self.read_only:
            return False
        if self.degraded:
            self.stats.write_failures += 1
            return False
        try:
            return fn()
        except ReadOnlyStoreError as e:
            self._turn_read_only(e)
            return False
        except OSError as e:
            if is_disk_full(e):
                self._degrade(e)
                return False
            if is_read_only(e):
                self._turn_read_only(e)
                return False
            raise
        except sqlite3.OperationalError as e:
            if _sqlite_full(e):
                self._degrade(e)
                return False
            if is_read_only(e):
                self._turn_read_only(e)
                return False
            raise

    def _bad(self, key: ChunkKey, row: EntryRow, reason: str) -> None:
        """A damaged entry: log, count, forget it (row first, then the file it named)."""
        logger.warning("KV store: entry %s unusable (%s); treated as a miss", key, reason)
        with self._lock:
            self.stats.corrupt += 1
            self.stats.misses += 1
            self._located.pop(key, None)
            if self.read_only:  # never delete what we cannot rewrite: skip it in this process
                self._hidden.add(key)
                return
        try:
            if self.manifest.remove_entry(row.chunk_key, row.format_version, row.storage, row.path):
                (self.root / row.path).unlink(missing_ok=True)
        except (OSError, sqlite3.Error, ReadOnlyStoreError) as e:
            logger.warning("KV store: could not remove damaged entry %s: %s", key, e)
            with self._lock:
                self._hidden.add(key)

    def _lookup(self, key: ChunkKey) -> EntryRow | None:
        if key in self._hidden:
            return None
        try:
            return self.manifest.lookup(key.to_string(), FORMAT_VERSION, self.storage)
        except sqlite3.Error as e:
            logger.warning("KV store: manifest lookup failed for %s: %s", key, e)
            return None

    # -- writes -----------------------------------------------------------------------------
    def write(self, image: EntryImage) -> bool:
        """Write-through of a host image. True when the entry is on disk afterwards."""
        if image.layout.storage != self.storage:
            raise ValueError(f"image stored as {image.layout.storage!r}, tier is {self.storage!r}")
        return self.guard(lambda: self._write(image))

    def _entry_ok(self, row: EntryRow) -> bool:
        p = self.root / row.path
        return p.exists() and p.stat().st_size == row.nbytes

    def _write(self, image: EntryImage) -> bool:
        key, lay = image.key, image.layout
        old = self._lookup(key)
        if old is not None and self._entry_ok(old):
            return True  # idempotent: already stored
        sums = image.checksums()
        rel = self._rel(key, checksum("".join(sums).encode())[:12], "entry")
        final = self.root / rel
        now = time.time()
        row = EntryRow(
            key.to_string(),
            FORMAT_VERSION,
            self.storage,
            rel,
            lay.file_bytes,
            sums,
            lay.num_layers,
            lay.num_tokens,
            DTYPE_NAME[lay.dtype],
            now,
            now,
        )
        tmp = prepare_tmp(final, [memoryview(image.data.numpy())], self.durable)  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+
        try:
            committed, old = self.manifest.commit_entry(row, lambda: publish(tmp, final, self.durable), self._entry_ok)
        finally:
            tmp.unlink(missing_ok=True)
        if committed:
            self.stats.bytes_written += lay.file_bytes
            if old is not None and old.path != rel:
                (self.root / old.path).unlink(missing_ok=True)
            with self._lock:
                self._located.pop(key, None)
                self._hidden.discard(key)
            self._enforce_capacity(key)
        return True

    def _enforce_capacity(self, written: ChunkKey) -> None:
        """Past the capacity, the least recently used entries leave: expendable ones first,
        and only those when the entry just `written` is expendable itself."""
        if self.capacity_bytes is None:
            return
        _, total = self.manifest.count_and_bytes()
        if total <= self.capacity_bytes:
            return
        rows = list(self.manifest.entries())  # least recently used first
        spare = self.expendable
        order = [r for r in rows if spare(r.chunk_key)]
        if not spare(written.to_string()):
            order += [r for r in rows if not spare(r.chunk_key)]
        for row in order:
            if total <= self.capacity_bytes:
                break
            if self.manifest.remove_entry(row.chunk_key, row.format_version, row.storage, row.path):
                (self.root / row.path).unlink(missing_ok=True)
                total -= row.nbytes
                self.stats.evictions += 1
                self.drop_orphan_sidecars(row.chunk_key)
                with self._lock:
                    self._located.pop(ChunkKey.from_string(row.chunk_key), None)

    # -- reads ------------------------------------------------------------------------------
    def read(self, key: ChunkKey) -> EntryImage | None:
        """The whole entry, verified, in a fresh host buffer; None on a miss."""
        row = self._lookup(key)
        if row is None:
            self.stats.misses += 1
            return None
        image, reason = self.read_row(key, row)
        if image is None:
            self._bad(key, row, reason)
            return None
        self.stats.hits += 1
        self.stats.bytes_read += row.nbytes
        if time.time() - row.last_access > _TOUCH_EVERY_S and not self.read_only:
            try:
                self.manifest.touch(row.chunk_key, row.format_version, row.storage, time.time())
            except (sqlite3.Error, ReadOnlyStoreError):
                pass  # recency is advisory (gc order); the read itself succeeded
        return image

    def read_row(self, key: ChunkKey, row: EntryRow) -> tuple[EntryImage | None, str]:
        """Read and fully verify the file a row names. Returns (image, "") or (None, reason)."""
        try:
            fd = os.open(self.root / row.path, os.O_RDONLY)
        except FileNotFoundError:
            return None, "file missing"
        except OSError as e:
            return None, f"open failed: {e}"
        try:
            size = os.fstat(fd).st_size
            if size != row.nbytes:
                return None, f"size {size} != {row.nbytes} (truncated or replaced)"
            data = self.alloc(row.nbytes)
            if read_exact(fd, memoryview(data.numpy()), 0) != row.nbytes:  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+
                return None, "short read"
        except OSError as e:
            return None, f"read failed: {e}"
        finally:
            os.close(fd)
        mv = memoryview(data.numpy())  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+
        try:
            S = header_length(bytes(mv[:8]))
            if S > row.nbytes or checksum(mv[:S]) != row.checksums[0]:
                return None, "header checksum mismatch"
            layout = parse_header(bytes(mv[:S]), key, row.storage)
        except EntryFormatError as e:
            return None, f"bad header: {e}"
        if layout.file_bytes != row.nbytes or len(row.checksums) != len(layout.segments()):
            return None, "layout disagrees with manifest"
        image = EntryImage(layout, data)
        if image.checksums() != row.checksums:
            return None, "data checksum mismatch"
        if hash_token_ids(image.token_ids()) != key.token_hash:
            return None, "token ids do not match the key"
        return image, ""

    def _locate(self, key: ChunkKey) -> _Located | None:
        """Verified header and preamble of an entry (cached); counts a miss when absent."""
        with self._lock:
            loc = self._located.get(key)
            if loc is not None:
                self._located.move_to_end(key)
                return loc
        row = self._lookup(key)
        if row is None:
            with self._lock:
                self.stats.misses += 1
            return None
        reason = ""
        try:
            with open(self.root / row.path, "rb") as f:
                prefix = f.read(8)
                S = header_length(prefix)
                header = prefix + f.read(S - 8)
                if checksum(header) != row.checksums[0]:
                    raise EntryFormatError("header checksum mismatch")
                layout = parse_header(header, key, row.storage)
                if layout.file_bytes != row.nbytes or os.fstat(f.fileno()).st_size != row.nbytes:
                    raise EntryFormatError("file size disagrees with manifest")
                pre = f.read(layout.layer_spans[0][0] - S)
                if checksum(pre) != row.checksums[1]:
                    raise EntryFormatError("preamble checksum mismatch")
        except FileNotFoundError:
            reason = "file missing"
        except (OSError, EntryFormatError) as e:
            reason = str(e)
        if reason:
            self._bad(key, row, reason)
            return None
        pre_t = torch.frombuffer(bytearray(pre), dtype=torch.uint8)
        T = layout.num_tokens
        if hash_token_ids(pre_t[: 8 * T].view(torch.int64)) != key.token_hash:
            self._bad(key, row, "token ids do not match the key")
            return None
        scales = None
        if layout.scale_span is not None:
            scales = pre_t[8 * T :].view(torch.float32).view(layout.num_layers, 2, layout.kv_heads)
        loc = _Located(row, layout, scales)
        with self._lock:
            self._located[key] = loc
            while len(self._located) > _LAYOUT_CACHE:
                self._located.popitem(last=False)
        return loc

    def layout(self, key: ChunkKey) -> EntryLayout | None:
        loc = self._locate(key)
        return None if loc is None else loc.layout

    def _read_layer(self, key: ChunkKey, layer: int, views_for) -> _Located | None:
        """Read one layer's bytes into `views_for(layout)` (two buffers: K bytes, V bytes)
        and verify them; counts the hit, or handles the damage and returns None."""
        loc = self._locate(key)
        if loc is None:
            return None
        lay = loc.layout
        if not 0 <= layer < lay.num_layers:
            raise IndexError(f"layer {layer} out of range for {lay.num_layers} layers")
        start, end = lay.layer_spans[layer]
        views = views_for(lay)
        reason = ""
        try:
            fd = os.open(self.root / loc.row.path, os.O_RDONLY)
        except OSError as e:
            self._bad(key, loc.row, f"open failed: {e}")
            return None
        try:
            if os.fstat(fd).st_size != loc.row.nbytes:  # truncated or grown: the entry is damaged
                reason = "file size disagrees with manifest"
            elif read_exact(fd, views, start) != end - start:
                reason = "short read (truncated)"
        except OSError as e:
            reason = f"read failed: {e}"
        finally:
            os.close(fd)
        if not reason:
            h = xxhash.xxh3_64()
            for view in views:
                h.update(view)
            if h.hexdigest() != loc.row.checksums[2 + layer]:
                reason = f"layer {layer} checksum mismatch"
        if reason:
            self._bad(key, loc.row, reason)
            return None
        with self._lock:
            self.stats.hits += 1
            self.stats.bytes_read += end - start
        return loc

    def read_layer_raw(self, key: ChunkKey, layer: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """One layer as stored: (kv (2, T, Hkv, D) in the stored dtype, in a fresh host buffer
        (pinned under CUDA), fp8 scale (2, Hkv) or None). For decoding on another device."""
        buf: list[torch.Tensor] = []

        def views_for(lay: EntryLayout) -> list[memoryview]:
            buf.append(self.alloc(lay.layer_bytes))
            mv = memoryview(buf[0].numpy())  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+
            return [mv[: lay.layer_bytes // 2], mv[lay.layer_bytes // 2 :]]

        loc = self._read_layer(key, layer, views_for)
        if loc is None:
            return None
        kv = buf[0].view(loc.layout.dtype).view(loc.layout.layer_shape)
        return kv, None if loc.scales is None else loc.scales[layer]

    def read_layer_into(self, key: ChunkKey, layer: int, out_k: torch.Tensor, out_v: torch.Tensor) -> bool:
        """Read layer `layer` of one entry into out_k, out_v (T, Hkv, D) on the host.

        Fast path (stored dtype == out dtype, contiguous): the bytes go straight from the
        file into the two output buffers (one preadv), then are checksummed in place; on a
        failure they hold garbage and False is returned. Otherwise: raw read, then decode.
        """
        lay = self.layout(key)
        if lay is None:
            return False
        shape = lay.layer_shape[1:]
        if tuple(out_k.shape) != shape or tuple(out_v.shape) != shape:
            raise ValueError(f"out_k/out_v must be {shape}, got {tuple(out_k.shape)}, {tuple(out_v.shape)}")
        direct = (
            out_k.dtype == lay.dtype
            and out_v.dtype == lay.dtype
            and lay.scale_span is None
            and out_k.device.type == "cpu"
            and out_k.is_contiguous()
            and out_v.is_contiguous()
        )
        if direct:
            views = [
                memoryview(out_k.view(torch.uint8).numpy()).cast("B"),  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+
                memoryview(out_v.view(torch.uint8).numpy()).cast("B"),  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+
            ]
            return self._read_layer(key, layer, lambda _: views) is not None
        raw = self.read_layer_raw(key, layer)
        if raw is None:
            return False
        with (
            torch.inference_mode()
        ):  # the I/O threads do not inherit the caller's mode; out_k may be an inference tensor
            kv = decode_layer(raw[0], raw[1], out_k.dtype)
            out_k.copy_(kv[0])
            out_v.copy_(kv[1])
        return True

    def map_io(self, fn, items: list) -> list:
        """`[fn(*item) for item in items]` on the I/O threads (preadv and xxh3 release the GIL)."""
        if len(items) <= 1 or self.io_threads <= 1:
            return [fn(*item) for item in items]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="qcfuse-kv-io")
        return list(self._pool.map(lambda item: fn(*item), items))

    def _prefetch(self, key: ChunkKey, layer: int) -> None:
        """Ask the kernel to start reading one layer's bytes (asynchronous, advisory)."""
        loc = self._locate(key)
        if loc is None or not hasattr(os, "posix_fadvise") or not 0 <= layer < loc.layout.num_layers:
            return
        start, end = loc.layout.layer_spans[layer]
        try:
            fd = os.open(self.root / loc.row.path, os.O_RDONLY)
        except OSError:
            return  # the read itself reports it
        try:
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # advisory only
        finally:
            os.close(fd)

    def read_layers_into(self, jobs: list[tuple[ChunkKey, int, torch.Tensor, torch.Tensor]]) -> list[bool]:
        """`read_layer_into` for many (key, layer, out_k, out_v) at once, on the I/O threads,
        with every read announced to the kernel first so the disk sees a deeper queue."""
        if len(jobs) > 1:
            for key, layer, _, _ in jobs:
                self._prefetch(key, layer)
        return self.map_io(self.read_layer_into, jobs)

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:  # a verified entry of this process: no index query on the hot path
            if key in self._located:
                return True
        return self._lookup(key) is not None

    def stored_bytes(self, key: ChunkKey) -> int:
        """Bytes of the entry of `key` on disk (0: none)."""
        row = self._lookup(key)
        return row.nbytes if row is not None else 0

    def delete(self, key: ChunkKey) -> bool:
        with self._lock:
            self._located.pop(key, None)
            if self.read_only:
                self._hidden.add(key)
                return False
        row = self._lookup(key)
        if row is None:
            return False
        removed = self.manifest.remove_entry(row.chunk_key, row.format_version, row.storage, row.path)
        if removed:
            (self.root / row.path).unlink(missing_ok=True)
            self.drop_orphan_sidecars(row.chunk_key)
        return removed

    def drop_orphan_sidecars(self, chunk_key: str | None = None) -> int:
        """Remove sidecars whose chunk has no entry left (puts write the entry first)."""
        if self.read_only:
            return 0
        n = 0
        for side in self.manifest.orphan_sidecars(chunk_key):
            if self.manifest.remove_sidecar(side.chunk_key, side.format_version, side.path):
                (self.root / side.path).unlink(missing_ok=True)
                n += 1
        return n

    def keys(self) -> list[ChunkKey]:
        return [ChunkKey.from_string(r.chunk_key) for r in self.manifest.entries(FORMAT_VERSION, self.storage)]

    # -- sidecars ---------------------------------------------------------------------------
    def write_sidecar(self, key: ChunkKey, sidecar: Sidecar) -> bool:
        """Replace the chunk's sidecar (atomic, like entries). True when it is on disk."""
        blob = encode_sidecar(key, sidecar)

        def write() -> bool:
            digest = checksum(blob)
            rel = self._rel(key, digest[:12], "sidecar")
            final = self.root / rel
            tmp = prepare_tmp(final, [memoryview(blob)], self.durable)
            row = SidecarRow(key.to_string(), FORMAT_VERSION, rel, len(blob), digest)
            try:
                replaced = self.manifest.commit_sidecar(row, lambda: publish(tmp, final, self.durable))
            finally:
                tmp.unlink(missing_ok=True)
            if replaced is not None:
                (self.root / replaced).unlink(missing_ok=True)
            self._hidden_sidecars.discard(key)
            self.stats.bytes_written += len(blob)
            return True

        return self.guard(write)

    def read_sidecar(self, key: ChunkKey) -> Sidecar | None:
        """The verified sidecar, or None (absent, or damaged: then logged, counted, removed)."""
        if key in self._hidden_sidecars:
            return None
        try:
            row = self.manifest.lookup_sidecar(key.to_string(), FORMAT_VERSION)
        except sqlite3.Error as e:
            logger.warning("KV store: sidecar lookup failed for %s: %s", key, e)
            return None
        if row is None:
            return None
        reason = ""
        try:
            blob = (self.root / row.path).read_bytes()
            if len(blob) != row.nbytes or checksum(blob) != row.checksum:
                raise EntryFormatError("sidecar checksum mismatch")
            side = decode_sidecar(blob, key)
        except FileNotFoundError:
            reason = "sidecar file missing"
        except (OSError, EntryFormatError) as e:
            reason = str(e)
        if reason:
            logger.warning("KV store: sidecar of %s unusable (%s); treated as a miss", key, reason)
            with self._lock:
                self.stats.corrupt += 1
            if self.read_only:
                self._hidden_sidecars.add(key)
                return None
            try:
                if self.manifest.remove_sidecar(row.chunk_key, row.format_version, row.path):
                    (self.root / row.path).unlink(missing_ok=True)
            except (OSError, sqlite3.Error, ReadOnlyStoreError) as e:
                logger.warning("KV store: could not remove damaged sidecar of %s: %s", key, e)
                self._hidden_sidecars.add(key)
            return None
        self.stats.bytes_read += len(blob)
        return side

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.manifest.close()
