"""Crash-safe file writes: temporary file in the target folder, rename (fsync when durable).

A reader never sees a partial file under a final name from a killed writer: the rename is
atomic, so a writer killed at any point leaves at most a `.tmp-*` file (never read, removed
by `gc`) or a published file that no manifest row points to yet (an orphan: never read,
removed by `gc`).

    prepare_tmp(final, buffers, sync)  ->  tmp    (write [+ fsync]; unlinked on any error)
    publish(tmp, final, sync)                     (rename [+ fsync of the folder])

sync=True also survives a power loss: the data reaches the disk before the rename publishes
it. Without it the operating system writes the file back later, and a power loss can leave
a published file shorter than its manifest row or with lost pages - which every read
detects (file size and per-layer checksums against the row) and treats as a miss. A KV
cache can always be recomputed from its text, so the store does not fsync by default
(`StoreConfig.durable`): an fsync per 128 MiB entry held ingestion to the disk's write rate.
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path

TMP_PREFIX = ".tmp-"
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def write_all(fd: int, buffers: list[memoryview]) -> None:
    """Write every buffer in order, resuming after short writes."""
    for buf in buffers:
        view = memoryview(buf).cast("B")
        while len(view):
            n = os.write(fd, view)
            view = view[n:]


def prepare_tmp(final: Path, buffers: list[memoryview], sync: bool = True) -> Path:
    tmp = final.parent / f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}-{final.name}"
    for attempt in range(3):  # a concurrent `gc` may prune the empty folder in between
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            break
        except FileNotFoundError:
            if attempt == 2:
                raise
    try:
        write_all(fd, buffers)
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    return tmp


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path, sync: bool = True) -> None:
    os.replace(tmp, final)
    if sync:
        fsync_dir(final.parent)


def read_exact(fd: int, buffers: memoryview | list[memoryview], offset: int) -> int:
    """pread into `buffers` (filled in order, from `offset`) until full or end of file.

    One preadv call for all buffers in the common case; returns the bytes read."""
    views = [memoryview(b).cast("B") for b in (buffers if isinstance(buffers, list) else [buffers])]
    want = sum(len(v) for v in views)
    got = 0
    while views:
        n = os.preadv(fd, views, offset + got)
        if n == 0:
            break
        got += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return min(got, want)
