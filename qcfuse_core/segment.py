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
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path

from qcfuse_core.types import Piece

ANCHOR = 32


class ChunkTextIndex:
    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path) if self.path else ":memory:", check_same_thread=False, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL" if self.path else "PRAGMA journal_mode=MEMORY")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS chunk_text (sha TEXT PRIMARY KEY, node_id TEXT, text TEXT NOT NULL)"
        )
        self._db.commit()
        self._lock = threading.Lock()
        self._by_anchor: dict[str, list[tuple[str, str | None]]] | None = None
        self._version: tuple | None = None  # (rows, max rowid) the table was built from

    def add(self, text: str, node_id: str | None = None) -> bool:
        """Register a chunk text (as it will appear in prompts). Returns False if too short to index."""
        if len(text) < ANCHOR:
            return False
        sha = hashlib.sha256(text.encode()).hexdigest()
        with self._lock:
            self._db.execute(
                "INSERT INTO chunk_text (sha, node_id, text) VALUES (?, ?, ?) "
                "ON CONFLICT(sha) DO UPDATE SET node_id = COALESCE(excluded.node_id, node_id)",
                (sha, node_id, text),
            )
            self._db.commit()
            self._by_anchor = None
        return True

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
                for node_id, text in self._db.execute("SELECT node_id, text FROM chunk_text"):
                    table.setdefault(text[:ANCHOR], []).append((text, node_id))
                for cands in table.values():
                    cands.sort(key=lambda c: -len(c[0]))  # longest match first
                self._by_anchor = table
            return self._by_anchor

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


def split_prompt(prompt: str, chunks: Sequence[Piece], head: str = "", tail: str = "") -> list[Piece]:
    """Split a prompt around its chunks (as `ChunkTextIndex.find` returns them, in order).

        prompt:  [before ..........][chunk A][glue][chunk B][after ..........]
        pieces:  prefix(head+before) chunk A  text  chunk B  suffix(after+tail)

    The prefix always sits at position 0, so its cache is exact; glue and suffix are
    computed fresh. `head`/`tail` wrap the prompt (e.g. a chat template's frame). Empty
    pieces are dropped.
    """
    pieces, pos = [], 0
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
