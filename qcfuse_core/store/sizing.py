"""Default sizes of the memory tiers, from the machine.

    host tier   HOST_SHARE of the RAM available when the store opens (MemAvailable on
                Linux), at least HOST_MIN_BYTES; `StoreConfig.memory_bytes` overrides it.
                `qcfuse serve --replicas N` gives each replica 1/N of the share.
    GPU tier    no size of its own: the chunk share of the engine's one GPU budget
                (`CacheConfig.kv_memory_share` of the device memory free at start). What the
                running requests' KV caches do not hold is chunk cache, evicted the moment a
                request needs the room (cache/budget.py, `KVBudget.reserve`).
                `StoreConfig.gpu_bytes` caps it.

    disk tier   DISK_SHARE of the room the store's disk offers it - what the store holds
                plus what is free - when the store opens, never less than it holds then;
                `StoreConfig.disk_bytes` overrides it. Past it the least recently used
                entries leave, learned ones (qcfuse_core/learn.py) before any other.

A store opened without an engine (the `qcfuse store` commands) keeps nothing on the GPU.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

GiB = 1 << 30
HOST_SHARE = 0.5  # of available RAM: the rest stays for the process, the OS page cache, other work
HOST_MIN_BYTES = 256 << 20
HOST_FALLBACK_BYTES = 2 * GiB  # where available RAM cannot be read
DISK_SHARE = 0.5  # of what the store holds plus the disk's free space: the rest stays for the machine


def available_ram() -> int | None:
    """Bytes of RAM available to new allocations without swapping (Linux: MemAvailable);
    None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def host_tier_bytes(available: int | None = None, share: float = HOST_SHARE) -> int:
    """The host tier's default capacity: `share` of `available` RAM (default: measured now),
    at least HOST_MIN_BYTES; HOST_FALLBACK_BYTES when the machine does not say."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share must be in (0, 1], got {share!r}")
    avail = available_ram() if available is None else available
    if avail is None:
        return HOST_FALLBACK_BYTES
    return max(HOST_MIN_BYTES, int(avail * share))


def gpu_budget_bytes(free: int, share: float, idle: int = 0) -> int:
    """The engine's one GPU budget (running requests' KV caches + the chunk tier): `share` of
    the device memory `free` when the engine sizes it, plus what it already holds and could
    give back (`idle`: pooled KV caches, chunk entries)."""
    return int(share * (free + idle))


def free_disk(path: Path | str) -> int | None:
    """Bytes free on the file system of `path` (or, while it does not exist, of its nearest
    existing parent); None where it cannot be read."""
    probe = Path(path)
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def disk_tier_bytes(root: Path | str, held: int, share: float = DISK_SHARE) -> int | None:
    """The disk tier's default capacity: `share` of what the store `held` at open plus the
    free space of its disk, at least `held`; None (unbounded) where the disk does not say."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share must be in (0, 1], got {share!r}")
    free = free_disk(root)
    if free is None:
        log.warning("KV store %s: the free disk space cannot be read; the disk tier is unbounded", root)
        return None
    return max(held, int(share * (held + free)))
