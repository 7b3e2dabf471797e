"""Offline upkeep of a disk tier: verify every entry, collect garbage, clear.

Orphans are files under `data/` that no manifest row names: temporary files of a writer that
died, or a file published by a writer killed before its manifest commit. Neither is ever
read. Files younger than `grace_s` are left alone, since a live writer in another process
may be about to commit them.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from qcfuse_core.store.disk import DATA_DIR, DiskTier
from qcfuse_core.store.entry import FORMAT_VERSION, checksum
from qcfuse_core.types import ChunkKey

DEFAULT_GRACE_S = 600.0


@dataclass
class VerifyReport:
    checked: int = 0
    ok: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)  # (chunk key or path, reason)
    stale: list[str] = field(default_factory=list)  # entries of another format version
    orphans: list[str] = field(default_factory=list)  # paths relative to the store folder
    removed: int = 0

    def as_dict(self) -> dict:
        return {"checked": self.checked, "ok": self.ok, "bad": [list(b) for b in self.bad],
                "stale": self.stale, "orphans": self.orphans, "removed": self.removed}


@dataclass
class GcReport:
    removed_entries: int = 0
    removed_bytes: int = 0
    removed_orphans: int = 0
    total_bytes: int = 0  # entry bytes left

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _orphans(disk: DiskTier, grace_s: float) -> list[Path]:
    named = {r.path for r in disk.manifest.entries()} | {s.path for s in disk.manifest.sidecars()}
    now = time.time()
    out = []
    for p in sorted((disk.root / DATA_DIR).rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(disk.root).as_posix()
        try:
            old = now - p.stat().st_mtime >= grace_s
        except FileNotFoundError:
            continue
        if rel not in named and old:
            out.append(p)
    return out


def _drop_row(disk: DiskTier, chunk_key: str, version: int, storage: str, path: str) -> int:
    if disk.manifest.remove_entry(chunk_key, version, storage, path):
        p = disk.root / path
        n = p.stat().st_size if p.exists() else 0
        p.unlink(missing_ok=True)
        return n
    return 0


def verify(disk: DiskTier, *, remove: bool = False, grace_s: float = DEFAULT_GRACE_S) -> VerifyReport:
    """Read and check every entry and sidecar; with `remove`, delete bad, stale and orphaned ones."""
    rep = VerifyReport()
    for row in disk.manifest.entries():
        rep.checked += 1
        if row.format_version != FORMAT_VERSION:
            rep.stale.append(row.chunk_key)
            if remove:
                _drop_row(disk, row.chunk_key, row.format_version, row.storage, row.path)
                rep.removed += 1
            continue
        try:
            key = ChunkKey.from_string(row.chunk_key)
        except ValueError:
            image, reason = None, "malformed key"
        else:
            image, reason = disk.read_row(key, row)
        if image is not None:
            rep.ok += 1
            continue
        rep.bad.append((row.chunk_key, reason))
        if remove:
            _drop_row(disk, row.chunk_key, row.format_version, row.storage, row.path)
            rep.removed += 1
    for side in disk.manifest.sidecars():
        p = disk.root / side.path
        reason = ""
        if side.format_version != FORMAT_VERSION:
            reason = "stale format version"
        elif not p.exists():
            reason = "sidecar file missing"
        elif checksum(p.read_bytes()) != side.checksum:
            reason = "sidecar checksum mismatch"
        if reason:
            rep.bad.append((side.path, reason))
            if remove and disk.manifest.remove_sidecar(side.chunk_key, side.format_version, side.path):
                p.unlink(missing_ok=True)
                rep.removed += 1
    for p in _orphans(disk, grace_s):
        rep.orphans.append(p.relative_to(disk.root).as_posix())
        if remove:
            p.unlink(missing_ok=True)
            rep.removed += 1
    return rep


def gc(disk: DiskTier, max_bytes: int, *, grace_s: float = DEFAULT_GRACE_S) -> GcReport:
    """Drop stale-version entries and old orphans, then least recently used entries until the
    entries take at most `max_bytes`."""
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    rep = GcReport()
    for p in _orphans(disk, grace_s):
        p.unlink(missing_ok=True)
        rep.removed_orphans += 1
    rows = disk.manifest.entries()  # least recently used first
    total = sum(r.nbytes for r in rows)
    for row in rows:
        if row.format_version == FORMAT_VERSION and total <= max_bytes:
            continue
        if disk.manifest.remove_entry(row.chunk_key, row.format_version, row.storage, row.path):
            (disk.root / row.path).unlink(missing_ok=True)
            total -= row.nbytes
            rep.removed_entries += 1
            rep.removed_bytes += row.nbytes
    rep.total_bytes = total
    rep.removed_orphans += disk.drop_orphan_sidecars()
    _prune_empty_dirs(disk.root / DATA_DIR)
    return rep


def clear(disk: DiskTier) -> int:
    """Remove every entry, sidecar and node link. Returns the number of entries removed."""
    n, _ = disk.manifest.count_and_bytes()
    disk.manifest.clear()
    data = disk.root / DATA_DIR
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True, exist_ok=True)
    return n


def _prune_empty_dirs(root: Path) -> None:
    for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        try:
            d.rmdir()
        except OSError:
            pass  # not empty
