"""Offline upkeep of a disk tier: verify every entry, collect garbage, clear.

The manifest is derived data: every entry's and sidecar's header carries its key and its
checksums, so a manifest that is damaged (`manifest_problem`) or deleted is rebuilt by
setting it aside (`set_aside_manifest`, kept as `manifest.sqlite.bad-<time>`) and
indexing the files again (`verify(..., repair=True)`). Node links (framework node id ->
chunk cache) live only in the manifest and are made again when the chunks are next asked.

A file under `data/` that no manifest row names is either
- *unindexed*: an intact entry or sidecar (its header names its key, every checksum and the
  token-id hash agree, its name carries the tag of its checksums) - e.g. after the manifest
  was lost or replaced. It is never removed; `repair` indexes it again;
- an *orphan*: a temporary file of a writer that died, a file published by a writer killed
  before its manifest commit that does not verify, or a second intact copy of an entry that
  is indexed (or unindexed and repairable) already. Orphans are never read; `remove`
  deletes them. Files younger than `grace_s` that do not verify are left alone, since a
  live writer in another process may be about to commit them.

`verify` classifies every file the same way with or without `repair`: what it lists as
unindexed, `repair` indexes; what it lists as orphans, `remove` deletes (and `repair`
leaves). So the advice a report gives is what the named flag then does.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qcfuse_core.store.atomic import TMP_PREFIX
from qcfuse_core.store.codec import DTYPE_NAME
from qcfuse_core.store.disk import DATA_DIR, DiskTier
from qcfuse_core.store.entry import FORMAT_VERSION, EntryFormatError, EntryImage, checksum, header_length, parse_header
from qcfuse_core.store.manifest import EntryRow, SidecarRow
from qcfuse_core.store.sidecar import decode_sidecar
from qcfuse_core.types import ChunkKey, hash_token_ids

DEFAULT_GRACE_S = 600.0


@dataclass
class VerifyReport:
    checked: int = 0
    ok: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)  # (chunk key or path, reason)
    stale: list[str] = field(default_factory=list)  # entries of another format version
    orphans: list[str] = field(default_factory=list)  # paths relative to the store folder
    unindexed: list[str] = field(default_factory=list)  # intact files no row names (repairable)
    removed: int = 0
    repaired: int = 0

    def as_dict(self) -> dict:
        return {
            "checked": self.checked,
            "ok": self.ok,
            "bad": [list(b) for b in self.bad],
            "stale": self.stale,
            "orphans": self.orphans,
            "unindexed": self.unindexed,
            "removed": self.removed,
            "repaired": self.repaired,
        }


@dataclass
class GcReport:
    removed_entries: int = 0
    removed_bytes: int = 0
    removed_orphans: int = 0
    total_bytes: int = 0  # entry bytes left

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def manifest_problem(path: Path) -> str:
    """'' when the manifest at `path` reads in full (SQLite's quick_check and every table);
    'missing' when there is no file; else 'damaged (<why>)'. Read-only: never writes."""
    if not path.is_file():
        return "missing"
    try:
        db = read_only_db(path)
        try:
            res = db.execute("PRAGMA quick_check").fetchone()[0]
            if res != "ok":
                raise sqlite3.DatabaseError(res)
            for table in ("meta", "entries", "sidecars", "nodes"):
                db.execute(f"SELECT * FROM {table}").fetchall()
        finally:
            db.close()
    except sqlite3.Error as e:
        return f"damaged ({e})"
    return ""


def read_only_db(path: Path) -> sqlite3.Connection:
    """A read-only connection; on a read-only folder, where SQLite cannot make the -shm file a
    write-ahead-logged database needs, the file is read as immutable (nothing writes there)."""
    uri = path.resolve().as_uri()
    try:
        db = sqlite3.connect(f"{uri}?mode=ro", uri=True)
        db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        return db
    except sqlite3.OperationalError:
        if writable_folder(path.parent):
            raise
        return sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True)


def writable_folder(folder: Path) -> bool:
    """This process may create files in `folder` (what SQLite needs beside a database)."""
    import os

    return os.access(folder, os.W_OK | os.X_OK)


def set_aside_manifest(path: Path) -> Path:
    """Move a damaged manifest (and its journal files) to `<name>.bad-<time>`; never deletes."""
    aside = path.with_name(f"{path.name}.bad-{int(time.time())}")
    for suffix in ("", "-wal", "-shm"):
        p = Path(str(path) + suffix)
        if p.exists():
            p.rename(Path(str(aside) + suffix))
    return aside


def cache_files(root: Path) -> int:
    """Entry and sidecar files under the KV store folder's data/ (indexed or not)."""
    data = root / DATA_DIR
    return sum(1 for p in data.rglob("*.safetensors") if p.is_file()) if data.is_dir() else 0


def _unnamed(disk: DiskTier) -> list[Path]:
    named = {r.path for r in disk.manifest.entries()} | {s.path for s in disk.manifest.sidecars()}
    data = disk.root / DATA_DIR
    if not data.is_dir():
        return []
    return [p for p in sorted(data.rglob("*")) if p.is_file() and p.relative_to(disk.root).as_posix() not in named]


def _orphans(disk: DiskTier, grace_s: float) -> list[Path]:
    """Unnamed files older than `grace_s` that are not intact entries or sidecars."""
    now = time.time()
    out = []
    for p in _unnamed(disk):
        try:
            old = now - p.stat().st_mtime >= grace_s
        except FileNotFoundError:
            continue
        if old and recover_row(disk, p) is None:
            out.append(p)
    return out


def recover_row(disk: DiskTier, path: Path) -> EntryRow | SidecarRow | None:
    """The manifest row an unnamed file would have, if it is an intact entry or sidecar of
    this format version at the path a writer would give it; None otherwise."""
    if path.name.startswith(TMP_PREFIX):
        return None
    rel = path.relative_to(disk.root).as_posix()
    try:
        blob = path.read_bytes()
        S = header_length(blob[:8])
        meta = json.loads(blob[8:S]).get("__metadata__", {})
        key = ChunkKey.from_string(meta.get("key", ""))
    except (OSError, ValueError):
        return None
    prefix = f"{DATA_DIR}/{key.fingerprint}/{key.token_hash[:2]}/{key.token_hash}."
    if path.name.endswith(".sidecar.safetensors"):
        try:
            decode_sidecar(blob, key)
        except EntryFormatError:
            return None
        digest = checksum(blob)
        if rel != f"{prefix}v{FORMAT_VERSION}.{digest[:12]}.sidecar.safetensors":
            return None
        return SidecarRow(key.to_string(), FORMAT_VERSION, rel, len(blob), digest)
    storage = meta.get("storage", "")
    try:
        layout = parse_header(blob[:S], key, storage)
    except EntryFormatError:
        return None
    if layout.file_bytes != len(blob):
        return None
    image = EntryImage(layout, torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    sums = image.checksums()
    if hash_token_ids(image.token_ids()) != key.token_hash:
        return None
    if rel != f"{prefix}{storage}.v{FORMAT_VERSION}.{checksum(''.join(sums).encode())[:12]}.safetensors":
        return None
    mtime = path.stat().st_mtime
    return EntryRow(
        key.to_string(),
        FORMAT_VERSION,
        storage,
        rel,
        layout.file_bytes,
        sums,
        layout.num_layers,
        layout.num_tokens,
        DTYPE_NAME[layout.dtype],
        mtime,
        mtime,
    )


def _reindex(disk: DiskTier, row: EntryRow | SidecarRow) -> bool:
    """Index an intact unnamed file again (unless its key already has a usable row)."""
    m = disk.manifest
    if isinstance(row, SidecarRow):
        if m.lookup_sidecar(row.chunk_key, row.format_version) is not None:
            return False
        m.commit_sidecar(row, lambda: None)
        return True
    committed, _ = m.commit_entry(row, lambda: None, disk._entry_ok)
    return committed


def _drop_row(disk: DiskTier, chunk_key: str, version: int, storage: str, path: str) -> int:
    if disk.manifest.remove_entry(chunk_key, version, storage, path):
        p = disk.root / path
        n = p.stat().st_size if p.exists() else 0
        p.unlink(missing_ok=True)
        return n
    return 0


def verify(
    disk: DiskTier, *, remove: bool = False, repair: bool = False, grace_s: float = DEFAULT_GRACE_S
) -> VerifyReport:
    """Read and check every entry and sidecar, then every file no row names; with `repair`,
    index intact unnamed files again (entries before sidecars); with `remove`, delete bad,
    stale and orphaned ones - never the only intact copy of an entry."""
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
    now = time.time()
    recovered: list[tuple[Path, EntryRow | SidecarRow]] = []
    for p in _unnamed(disk):
        rec = recover_row(disk, p)
        if rec is not None:
            recovered.append((p, rec))
            continue
        try:
            old = now - p.stat().st_mtime >= grace_s
        except FileNotFoundError:
            continue
        if old:
            rep.orphans.append(p.relative_to(disk.root).as_posix())
            if remove:
                p.unlink(missing_ok=True)
                rep.removed += 1
    recovered.sort(key=lambda pr: isinstance(pr[1], SidecarRow))  # entries first
    seen: set[tuple] = set()
    for p, rec in recovered:
        rel = p.relative_to(disk.root).as_posix()
        ident = (isinstance(rec, SidecarRow), rec.chunk_key, rec.format_version, getattr(rec, "storage", ""))
        if ident in seen or _indexed_copy(disk, rec):  # a second copy: an orphan, in either mode
            rep.orphans.append(rel)
            if remove:
                p.unlink(missing_ok=True)
                rep.removed += 1
            continue
        seen.add(ident)
        if not repair:
            rep.unindexed.append(rel)
        elif _reindex(disk, rec):
            rep.repaired += 1
        else:  # indexed by another process meanwhile: this copy is a second one
            rep.orphans.append(rel)
    return rep


def _indexed_copy(disk: DiskTier, row: EntryRow | SidecarRow) -> bool:
    """The manifest already has a usable row for this file's entry or sidecar (the test
    `_reindex` applies before it indexes a file)."""
    m = disk.manifest
    if isinstance(row, SidecarRow):
        return m.lookup_sidecar(row.chunk_key, row.format_version) is not None
    old = m.lookup(row.chunk_key, row.format_version, row.storage)
    return old is not None and disk._entry_ok(old)


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
