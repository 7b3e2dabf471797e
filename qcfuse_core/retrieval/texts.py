"""Content-addressed segmentation: find known chunk texts inside an arbitrary prompt.

Frameworks (LlamaIndex, LangChain) paste retrieved chunk texts verbatim into a prompt but
do not tell the LLM which ones. At ingestion every chunk text is registered here; at query
time `find(prompt)` returns the registered texts that occur in the prompt, in order and
non-overlapping, so the engine can split the prompt into prefix / chunk / glue / suffix.

    prompt:  "Context:\n" + [chunk A] + "\n\n" + [chunk B] + "\nQuery: ..."
    find ->  [Piece(chunk A), Piece(chunk B)]   (the text around them is computed fresh)

Lookup is a dictionary of each text's first `ANCHOR` characters, probed at every prompt
offset: O(len(prompt)) probes plus one `startswith` per candidate. Texts shorter than
`ANCHOR` characters are not worth caching and are ignored. The index lives in SQLite
(one file next to the store) or in memory.

Every row is keyed by the sha256 of its text, and a row whose text no longer hashes to its
key (a damaged file) is never returned: it is left out of `find` and `verified_rows`, with
one warning per change of the table (`qcfuse store verify --repair` rebuilds the file).

The file is never moved or deleted here: when it is read-only (or `read_only=True`) its
rows are copied into memory and new texts stay there; when it is damaged, or a write finds
the disk full, the index goes on in memory with one warning (`qcfuse store verify --repair`
rebuilds the file from the vector store).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path

from qcfuse_core.types import Piece

ANCHOR = 32
_SCHEMA = "CREATE TABLE IF NOT EXISTS chunk_text (sha TEXT PRIMARY KEY, node_id TEXT, text TEXT NOT NULL)"

log = logging.getLogger(__name__)


class ChunkTextIndex:
    def __init__(self, path: str | Path | None = None, *, read_only: bool = False) -> None:
        self.path = Path(path) if path is not None else None
        self.in_memory = self.path is None  # True once the file is not (or no longer) written
        self.problem = ""  # why the file is not used, when it is not
        self._lock = threading.Lock()
        if self.path is None:
            self._db = _memory_db()
        elif read_only or not _writable(self.path):
            self._db = self._memory_copy("read-only")
        else:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._db = sqlite3.connect(str(self.path), check_same_thread=False, timeout=30)
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute(_SCHEMA)
                self._db.commit()
            except (sqlite3.Error, OSError) as e:
                self._db = self._memory_copy(f"unusable: {e}")
        self._db.text_factory = lenient_text  # a damaged row must not stop every read
        self._by_anchor: dict[str, list[tuple[str, str | None]]] | None = None
        self._version: tuple | None = None  # (rows, max rowid) the table was built from
        self.damaged = 0  # rows whose text does not hash to their key (never served)

    def add(self, text: str, node_id: str | None = None, *, overwrite: bool = True) -> bool:
        """Register a chunk text (as it will appear in prompts). Returns False if too short to index.
        overwrite: a text registered already takes `node_id` (unless None); else it keeps its own."""
        if len(text) < ANCHOR:
            return False
        sha = hashlib.sha256(text.encode()).hexdigest()
        sql = "INSERT INTO chunk_text (sha, node_id, text) VALUES (?, ?, ?) " + (
            "ON CONFLICT(sha) DO UPDATE SET node_id = COALESCE(excluded.node_id, node_id)"
            if overwrite
            else "ON CONFLICT(sha) DO NOTHING"
        )
        with self._lock:
            try:
                self._db.execute(sql, (sha, node_id, text))
                self._db.commit()
            except sqlite3.OperationalError as e:  # disk full / not writable: go on in memory
                if self.in_memory:
                    raise
                self._db.rollback()
                old, self._db = self._db, _memory_db()
                self._db.text_factory = lenient_text
                old.backup(self._db)
                old.close()
                self._switched(f"not written ({e})")
                self._db.execute(sql, (sha, node_id, text))
            self._by_anchor = None
        return True

    def remove(self, text: str) -> bool:
        """Forget a registered text (it is no longer found in prompts). Returns whether it was there."""
        sha = hashlib.sha256(text.encode()).hexdigest()
        with self._lock:
            try:
                gone = self._db.execute("DELETE FROM chunk_text WHERE sha = ?", (sha,)).rowcount > 0
                self._db.commit()
            except sqlite3.OperationalError:  # not writable: the row stays (it is only a lost hit later)
                self._db.rollback()
                return False
            self._by_anchor = None
        return gone

    def __contains__(self, text: object) -> bool:
        """Whether `text` is registered."""
        if not isinstance(text, str):
            return False
        sha = hashlib.sha256(text.encode()).hexdigest()
        with self._lock:
            return self._db.execute("SELECT 1 FROM chunk_text WHERE sha = ?", (sha,)).fetchone() is not None

    def node_id(self, text: str) -> str | None:
        """The node id a registered text carries (None: none, or not registered)."""
        sha = hashlib.sha256(text.encode()).hexdigest()
        with self._lock:
            row = self._db.execute("SELECT node_id FROM chunk_text WHERE sha = ?", (sha,)).fetchone()
        return row[0] if row else None

    def _switched(self, why: str) -> None:
        self.in_memory, self.problem = True, why
        log.warning("chunk-text index %s %s; kept in memory for this process", self.path, why)

    def _memory_copy(self, why: str) -> sqlite3.Connection:
        """The file's rows in an in-memory database (empty if it is absent or damaged)."""
        assert self.path is not None  # only called for an index backed by a file
        mem = _memory_db()
        if self.path.is_file():
            for flags in ("mode=ro", "mode=ro&immutable=1"):
                try:
                    src = sqlite3.connect(f"{self.path.resolve().as_uri()}?{flags}", uri=True)
                    try:
                        src.execute("SELECT COUNT(*) FROM chunk_text").fetchone()
                        src.backup(mem)
                        break
                    finally:
                        src.close()
                except sqlite3.Error as e:
                    if "not a database" in str(e) or "malformed" in str(e):
                        why = f"damaged ({e}; `qcfuse store verify --repair` rebuilds it)"
                        mem = _memory_db()
                        break
                    mem = _memory_db()
        self._switched(why)
        return mem

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM chunk_text").fetchone()[0])

    def _anchors(self) -> dict[str, list[tuple[str, str | None]]]:
        """The anchor table, rebuilt when the SQLite table changed (also by another
        instance or process sharing the file)."""
        with self._lock:
            version = self._db.execute("SELECT COUNT(*), MAX(rowid) FROM chunk_text").fetchone()
            if self._by_anchor is None or version != self._version:
                self._version = version
                table: dict[str, list[tuple[str, str | None]]] = {}
                rows = self._db.execute("SELECT sha, node_id, text FROM chunk_text").fetchall()
                good = [(node_id, text) for sha, node_id, text in rows if text_hash_ok(sha, text)]
                if len(good) != len(rows) and len(rows) - len(good) != self.damaged:
                    log.warning(
                        "chunk-text index %s: %d of %d texts do not match their content hash "
                        "(damaged); they are ignored - `qcfuse store verify --repair` rebuilds it",
                        self.path,
                        len(rows) - len(good),
                        len(rows),
                    )
                self.damaged = len(rows) - len(good)
                for node_id, text in good:
                    table.setdefault(text[:ANCHOR], []).append((text, node_id))
                for cands in table.values():
                    cands.sort(key=lambda c: -len(c[0]))  # longest match first
                self._by_anchor = table
            return self._by_anchor

    def verified_rows(self) -> list[tuple[str, str | None, str]]:
        """(sha, node id, text) of every row whose text hashes to its key, in insertion order."""
        with self._lock:
            rows = self._db.execute("SELECT sha, node_id, text FROM chunk_text ORDER BY rowid").fetchall()
        return [r for r in rows if text_hash_ok(r[0], r[2])]

    def find(self, prompt: str, node_ids: dict[str, str] | None = None) -> list[Piece]:
        """Registered texts occurring in `prompt`, left to right, non-overlapping.

        `node_ids` (text -> id) overrides the stored id, e.g. ids a postprocessor passed along.
        """
        table = self._anchors()
        pieces: list[Piece] = []
        i, n = 0, len(prompt)
        while i <= n - ANCHOR:
            cands = table.get(prompt[i : i + ANCHOR])
            match = next((c for c in cands if prompt.startswith(c[0], i)), None) if cands else None
            if match is None:
                i += 1
                continue
            text, node_id = match
            if node_ids and text in node_ids:
                node_id = node_ids[text]
            pieces.append(Piece("chunk", text, node_id))
            i += len(text)
        return pieces

    def close(self) -> None:
        self._db.close()


def lenient_text(raw: bytes) -> str:
    """SQLite TEXT -> str; bytes that are not UTF-8 (a damaged file) become lone surrogates,
    which `text_hash_ok` rejects, instead of an error on every read."""
    return raw.decode("utf-8", "surrogateescape")


def text_hash_ok(sha: str, text: object) -> bool:
    """The stored text is the one its key names (sha256 of its UTF-8 bytes)."""
    if not isinstance(text, str):
        return False
    try:
        return hashlib.sha256(text.encode()).hexdigest() == sha
    except UnicodeEncodeError:
        return False


def _memory_db() -> sqlite3.Connection:
    db = sqlite3.connect(":memory:", check_same_thread=False)
    db.execute(_SCHEMA)
    db.commit()
    return db


def _writable(path: Path) -> bool:
    """The index file (or, before it exists, the nearest existing folder) can be written."""
    if path.exists():
        return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK | os.X_OK)
    probe = path.parent
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)


def split_prompt(prompt: str, chunks: Sequence[Piece], head: str = "", tail: str = "") -> list[Piece]:
    """Split a prompt around its chunks (as `ChunkTextIndex.find` returns them, in order).

        prompt:  [before ..........][chunk A][glue][chunk B][after ..........]
        pieces:  prefix(head+before) chunk A  text  chunk B  suffix(after+tail)

    The prefix always sits at position 0, so its cache is exact; glue and suffix are
    computed fresh. `head`/`tail` wrap the prompt (e.g. a chat template's frame). Empty
    pieces are dropped.
    """
    pieces: list[Piece] = []
    pos = 0
    for c in chunks:
        at = prompt.find(c.text, pos)
        if at < 0:
            raise ValueError("a chunk's text does not occur in the prompt (in order)")
        pieces.append(Piece("prefix" if not pieces else "text", (head if not pieces else "") + prompt[pos:at]))
        pieces.append(c)
        pos = at + len(c.text)
    if not pieces:
        pieces.append(Piece("prefix", head))
    pieces.append(Piece("suffix", prompt[pos:] + tail))
    return [p for p in pieces if p.text]
