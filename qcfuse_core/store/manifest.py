"""The SQLite manifest of the disk tier: which entry files are valid, and node id -> key.

A file is valid only while a row points to it; rows are written after the file is durable
(see `atomic.py`), inside one `BEGIN IMMEDIATE` transaction with the rename, so concurrent
writers in several processes serialise on SQLite's lock and each row always describes the
file at its path. WAL mode lets readers proceed while a writer commits; a busy timeout makes
writers wait rather than fail. Plain columns and JSON text only (no pickle).

    entries   (chunk_key, format_version, storage) -> path, bytes, segment checksums, shapes
    sidecars  (chunk_key, format_version)          -> path, bytes, checksum
    nodes     (node_id, fingerprint)               -> chunk_key
"""

from __future__ import annotations

import errno
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from qcfuse_core.store.base import ReadOnlyStoreError

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
    chunk_key TEXT NOT NULL, format_version INTEGER NOT NULL, storage TEXT NOT NULL,
    path TEXT NOT NULL, nbytes INTEGER NOT NULL, checksums TEXT NOT NULL,
    num_layers INTEGER NOT NULL, num_tokens INTEGER NOT NULL, dtype TEXT NOT NULL,
    created REAL NOT NULL, last_access REAL NOT NULL,
    PRIMARY KEY (chunk_key, format_version, storage));
CREATE TABLE IF NOT EXISTS sidecars (
    chunk_key TEXT NOT NULL, format_version INTEGER NOT NULL,
    path TEXT NOT NULL, nbytes INTEGER NOT NULL, checksum TEXT NOT NULL,
    PRIMARY KEY (chunk_key, format_version));
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT NOT NULL, fingerprint TEXT NOT NULL, chunk_key TEXT NOT NULL,
    updated REAL NOT NULL, PRIMARY KEY (node_id, fingerprint));
"""


@dataclass(frozen=True)
class EntryRow:
    chunk_key: str
    format_version: int
    storage: str
    path: str  # relative to the store folder
    nbytes: int
    checksums: tuple[str, ...]  # one per segment: header, preamble, layers
    num_layers: int
    num_tokens: int
    dtype: str  # stored dtype name
    created: float
    last_access: float


@dataclass(frozen=True)
class SidecarRow:
    chunk_key: str
    format_version: int
    path: str
    nbytes: int
    checksum: str


_ENTRY_COLS = (
    "chunk_key, format_version, storage, path, nbytes, checksums, num_layers, num_tokens, dtype, created, last_access"
)


def _entry(row: tuple) -> EntryRow:
    r = list(row)
    r[5] = tuple(json.loads(r[5]))
    return EntryRow(*r)


def is_corrupt(e: sqlite3.Error) -> bool:
    """The file is not a (usable) database - as opposed to one we may not write."""
    code = getattr(e, "sqlite_errorcode", None)
    return code in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT) or "manifest schema" in str(e)


def is_read_only(e: BaseException) -> bool:
    """A write refused by permissions or a read-only file system (SQLite or the OS)."""
    if isinstance(e, sqlite3.Error):
        code = getattr(e, "sqlite_errorcode", None)
        return (
            code in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM)
            or "readonly database" in str(e)
            or "unable to open database" in str(e)
        )
    return isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS)


class Manifest:
    """read_only: opened without ever writing (no schema creation, no journal files); a
    missing or damaged file reads as an empty manifest. A writable manifest that is damaged
    (not a database, a foreign schema) is set aside and started empty; one that merely
    cannot be written raises `ReadOnlyStoreError` - it is never moved."""

    def __init__(self, path: Path, *, busy_timeout_s: float = 60.0, read_only: bool = False) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._busy_timeout_s = busy_timeout_s
        self.read_only = read_only
        if read_only:
            self._conn = self._open_read_only()
            return
        try:
            self._conn = self._open()
        except sqlite3.DatabaseError as e:
            if not is_corrupt(e):
                if is_read_only(e):
                    raise ReadOnlyStoreError(f"the KV manifest {self.path} is not writable ({e})") from e
                raise
            aside = self.path.with_name(f"{self.path.name}.bad-{int(time.time())}")
            logger.warning(
                "manifest %s unusable (%s); moved to %s, starting empty (`qcfuse store verify "
                "--repair` re-indexes the entries)",
                self.path,
                e,
                aside,
            )
            for suffix in ("", "-wal", "-shm"):
                p = Path(str(self.path) + suffix)
                if p.exists():
                    p.rename(Path(str(aside) + suffix))
            self._conn = self._open()

    def _open_read_only(self) -> sqlite3.Connection:
        """mode=ro first (sees a live writer's WAL); immutable=1 when even the -shm file
        cannot be made (a read-only folder); an in-memory empty manifest when the file is
        absent or damaged."""
        if self.path.is_file():
            for flags in ("mode=ro", "mode=ro&immutable=1"):
                conn = sqlite3.connect(
                    f"{self.path.resolve().as_uri()}?{flags}",
                    uri=True,
                    timeout=self._busy_timeout_s,
                    isolation_level=None,
                    check_same_thread=False,
                )
                try:
                    row = conn.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
                    conn.execute("SELECT COUNT(*) FROM entries").fetchone()
                    if row is not None and row[0] != str(SCHEMA_VERSION):
                        raise sqlite3.DatabaseError(f"manifest schema {row[0]}, expected {SCHEMA_VERSION}")
                    return conn
                except sqlite3.DatabaseError as e:
                    conn.close()
                    if is_corrupt(e) or "no such table" in str(e):
                        logger.warning("manifest %s unusable (%s); read-only: every entry is a miss", self.path, e)
                        break
        conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        for stmt in _SCHEMA.strip().split(";"):
            if stmt.strip():
                conn.execute(stmt)
        return conn

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=self._busy_timeout_s, isolation_level=None, check_same_thread=False)
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_s * 1000)}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("BEGIN IMMEDIATE")
            for stmt in _SCHEMA.strip().split(";"):
                if stmt.strip():
                    conn.execute(stmt)
            row = conn.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
            if row is None:
                conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif row[0] != str(SCHEMA_VERSION):
                conn.execute("ROLLBACK")
                raise sqlite3.DatabaseError(f"manifest schema {row[0]}, expected {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            conn.close()
            raise
        return conn

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """An exclusive-writer transaction (BEGIN IMMEDIATE), rolled back on error."""
        if self.read_only:
            raise ReadOnlyStoreError(f"the KV manifest {self.path} is open read-only")
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    # -- entries ----------------------------------------------------------------------------
    def lookup(self, chunk_key: str, version: int, storage: str) -> EntryRow | None:
        rows = self._query(
            f"SELECT {_ENTRY_COLS} FROM entries WHERE chunk_key=? AND format_version=? AND storage=?",
            (chunk_key, version, storage),
        )
        return _entry(rows[0]) if rows else None

    def commit_entry(
        self, row: EntryRow, install: Callable[[], None], keep: Callable[[EntryRow], bool]
    ) -> tuple[bool, EntryRow | None]:
        """Insert `row` after running `install()` (the rename), unless an existing row for the
        same entry passes `keep(existing)`. Returns (committed, the row it replaced or kept)."""
        with self.transaction() as c:
            found = c.execute(
                f"SELECT {_ENTRY_COLS} FROM entries WHERE chunk_key=? AND format_version=? AND storage=?",
                (row.chunk_key, row.format_version, row.storage),
            ).fetchone()
            old = None if found is None else _entry(found)
            if old is not None and keep(old):
                return False, old
            install()
            c.execute(
                f"INSERT OR REPLACE INTO entries ({_ENTRY_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (
                    row.chunk_key,
                    row.format_version,
                    row.storage,
                    row.path,
                    row.nbytes,
                    json.dumps(list(row.checksums)),
                    row.num_layers,
                    row.num_tokens,
                    row.dtype,
                    row.created,
                    row.last_access,
                ),
            )
            return True, old

    def remove_entry(self, chunk_key: str, version: int, storage: str, path: str | None = None) -> bool:
        """Delete the row (only if it still points to `path`, when given)."""
        sql = "DELETE FROM entries WHERE chunk_key=? AND format_version=? AND storage=?"
        args: tuple = (chunk_key, version, storage)
        if path is not None:
            sql, args = sql + " AND path=?", args + (path,)
        with self.transaction() as c:
            return c.execute(sql, args).rowcount > 0

    def touch(self, chunk_key: str, version: int, storage: str, when: float) -> None:
        with self.transaction() as c:
            c.execute(
                "UPDATE entries SET last_access=? WHERE chunk_key=? AND format_version=? AND storage=?",
                (when, chunk_key, version, storage),
            )

    def entries(self, version: int | None = None, storage: str | None = None) -> list[EntryRow]:
        sql = f"SELECT {_ENTRY_COLS} FROM entries WHERE 1=1"
        args: tuple[int | str, ...] = ()
        if version is not None:
            sql, args = sql + " AND format_version=?", args + (version,)
        if storage is not None:
            sql, args = sql + " AND storage=?", args + (storage,)
        return [_entry(r) for r in self._query(sql + " ORDER BY last_access, created", args)]

    def count_and_bytes(self, version: int | None = None, storage: str | None = None) -> tuple[int, int]:
        sql = "SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM entries WHERE 1=1"
        args: tuple[int | str, ...] = ()
        if version is not None:
            sql, args = sql + " AND format_version=?", args + (version,)
        if storage is not None:
            sql, args = sql + " AND storage=?", args + (storage,)
        n, b = self._query(sql, args)[0]
        return int(n), int(b)

    # -- sidecars ---------------------------------------------------------------------------
    def lookup_sidecar(self, chunk_key: str, version: int) -> SidecarRow | None:
        rows = self._query(
            "SELECT chunk_key, format_version, path, nbytes, checksum FROM sidecars "
            "WHERE chunk_key=? AND format_version=?",
            (chunk_key, version),
        )
        return SidecarRow(*rows[0]) if rows else None

    def commit_sidecar(self, row: SidecarRow, install: Callable[[], None]) -> str | None:
        """Insert or replace; returns the path of the row it replaced (to unlink), if any."""
        with self.transaction() as c:
            old = c.execute(
                "SELECT path FROM sidecars WHERE chunk_key=? AND format_version=?",
                (row.chunk_key, row.format_version),
            ).fetchone()
            install()
            c.execute(
                "INSERT OR REPLACE INTO sidecars VALUES (?,?,?,?,?)",
                (row.chunk_key, row.format_version, row.path, row.nbytes, row.checksum),
            )
            return old[0] if old and old[0] != row.path else None

    def remove_sidecar(self, chunk_key: str, version: int, path: str | None = None) -> bool:
        sql = "DELETE FROM sidecars WHERE chunk_key=? AND format_version=?"
        args: tuple = (chunk_key, version)
        if path is not None:
            sql, args = sql + " AND path=?", args + (path,)
        with self.transaction() as c:
            return c.execute(sql, args).rowcount > 0

    def orphan_sidecars(self, chunk_key: str | None = None) -> list[SidecarRow]:
        """Sidecars whose chunk has no entry left (in any format version or storage)."""
        sql = (
            "SELECT chunk_key, format_version, path, nbytes, checksum FROM sidecars s WHERE NOT EXISTS "
            "(SELECT 1 FROM entries e WHERE e.chunk_key = s.chunk_key)"
        )
        args: tuple = ()
        if chunk_key is not None:
            sql, args = sql + " AND s.chunk_key = ?", (chunk_key,)
        return [SidecarRow(*r) for r in self._query(sql, args)]

    def sidecars(self) -> list[SidecarRow]:
        rows = self._query("SELECT chunk_key, format_version, path, nbytes, checksum FROM sidecars")
        return [SidecarRow(*r) for r in rows]

    # -- nodes ------------------------------------------------------------------------------
    def link(self, node_id: str, fingerprint: str, chunk_key: str) -> None:
        with self.transaction() as c:
            c.execute("INSERT OR REPLACE INTO nodes VALUES (?,?,?,?)", (node_id, fingerprint, chunk_key, time.time()))

    def resolve(self, node_id: str, fingerprint: str | None = None) -> str | None:
        if fingerprint is None:
            rows = self._query("SELECT chunk_key FROM nodes WHERE node_id=? ORDER BY updated DESC LIMIT 1", (node_id,))
        else:
            rows = self._query("SELECT chunk_key FROM nodes WHERE node_id=? AND fingerprint=?", (node_id, fingerprint))
        return rows[0][0] if rows else None

    def node_links(self) -> list[tuple[str, str]]:
        """(node id, chunk key) of every link."""
        return [(n, k) for n, k in self._query("SELECT node_id, chunk_key FROM nodes")]

    def num_nodes(self) -> int:
        return int(self._query("SELECT COUNT(*) FROM nodes")[0][0])

    def clear(self) -> None:
        with self.transaction() as c:
            for table in ("entries", "sidecars", "nodes"):
                c.execute(f"DELETE FROM {table}")

    def close(self) -> None:
        with self._lock:
            self._conn.close()
