"""The store root's two indexes beside the KV store: checked and rebuilt from each other.

    <root>/chunk_texts.sqlite   chunk text -> node id (finding chunks inside framework prompts)
    <root>/chroma/              the vector index (ids, documents, embeddings)
    <root>/kv/                  the KV store (maintenance.py)

Both hold every chunk's text, so either rebuilds the other: the chunk-text index from
Chroma's documents, the vector index by embedding the chunk-text index's texts again
(texts shorter than `segment.ANCHOR` characters are not in the chunk-text index, and the
rebuilt vector index carries no source metadata). A rebuild writes the new index beside
the old one and swaps it in; the damaged one is kept as `<name>.bad-<time>`, never deleted.
Checks open copies or read-only connections: checking never writes.
"""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

CHUNK_TEXTS = "chunk_texts.sqlite"
CHROMA = "chroma"


@dataclass
class IndexState:
    path: str
    present: bool = False
    rows: int = 0
    problem: str = ""  # empty when usable

    @property
    def ok(self) -> bool:
        return not self.problem


@dataclass
class IndexReport:
    chunk_texts: IndexState
    chroma: IndexState
    notes: list[str] = field(default_factory=list)  # count disagreements: informational
    repaired: list[str] = field(default_factory=list)

    @property
    def bad(self) -> list[str]:
        return [f"{name}: {s.problem}" for name, s in (("chunk-text index", self.chunk_texts),
                                                       ("vector index", self.chroma)) if s.problem]

    def as_dict(self) -> dict:
        return {"chunk_texts": asdict(self.chunk_texts), "chroma": asdict(self.chroma),
                "notes": self.notes, "repaired": self.repaired}


def _ro(path: Path) -> sqlite3.Connection:
    """Read-only: mode=ro sees the write-ahead log; immutable=1 when a read-only folder
    cannot take the -shm file mode=ro needs."""
    uri = path.resolve().as_uri()
    try:
        db = sqlite3.connect(f"{uri}?mode=ro", uri=True)
        db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        return db
    except sqlite3.OperationalError:
        return sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True)


def check_chunk_texts(path: Path) -> IndexState:
    st = IndexState(str(path), path.is_file())
    if not st.present:
        return st
    try:
        db = _ro(path)
        try:
            res = db.execute("PRAGMA quick_check").fetchone()[0]
            if res != "ok":
                raise sqlite3.DatabaseError(res)
            st.rows = int(db.execute("SELECT COUNT(*) FROM chunk_text").fetchone()[0])
        finally:
            db.close()
    except sqlite3.Error as e:
        st.problem = f"unreadable ({e})"
    return st


@contextmanager
def _chroma_copy(path: Path):
    """A Chroma collection opened on a private copy (Chroma writes when it opens)."""
    from qcfuse_integrations.chroma import open_collection

    tmp = Path(tempfile.mkdtemp(prefix="qcfuse-chroma-check-"))
    try:
        shutil.copytree(path, tmp / CHROMA, copy_function=shutil.copyfile)
        for q in [tmp / CHROMA, *(tmp / CHROMA).rglob("*")]:  # the copy is ours to write, whatever the source's modes
            q.chmod(q.stat().st_mode | 0o700 if q.is_dir() else 0o600)
        yield open_collection(tmp / CHROMA)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_chroma(path: Path) -> tuple[IndexState, set[str]]:
    """-> (state, the ids it holds)."""
    st = IndexState(str(path), (path / "chroma.sqlite3").is_file())
    if not st.present:
        return st, set()
    try:
        import chromadb.errors as chroma_errors
    except ImportError:
        st.problem = "chromadb is not installed (pip install 'qcfuse[chroma]'): not checked"
        return st, set()
    try:
        with _chroma_copy(path) as col:
            ids = set(col.get(include=[])["ids"])
            st.rows = col.count()
        if st.rows != len(ids):
            st.problem = f"count {st.rows} disagrees with its {len(ids)} ids"
    except chroma_errors.ChromaError as e:
        st.problem = f"unreadable ({e})"
        ids = set()
    return st, ids


def check(root: Path, linked_nodes: set[str] | None = None) -> IndexReport:
    """Check both indexes and their agreement (with the KV store's node links, if given)."""
    texts = check_chunk_texts(root / CHUNK_TEXTS)
    chroma, ids = check_chroma(root / CHROMA)
    rep = IndexReport(texts, chroma)
    if texts.ok and chroma.ok and texts.present and chroma.present and texts.rows != chroma.rows:
        rep.notes.append(f"the chunk-text index has {texts.rows} texts, the vector index {chroma.rows} chunks "
                         f"(it never holds texts under 32 characters; others are missing after a full disk or a "
                         f"read-only run - the same `qcfuse ingest` again adds them)")
    if linked_nodes is not None and chroma.ok and ids:
        uncached = len(ids - linked_nodes)
        if uncached:
            rep.notes.append(f"{uncached} of {len(ids)} chunks have no stored cache (computed when asked; "
                             "`qcfuse ingest` stores them)")
    return rep


def _set_aside(path: Path) -> Path:
    aside = path.with_name(f"{path.name}.bad-{int(time.time())}")
    path.rename(aside)
    for suffix in ("-wal", "-shm"):  # a stale journal must never meet the new file
        j = Path(str(path) + suffix)
        if j.exists():
            j.rename(Path(str(aside) + suffix))
    return aside


def rebuild_chunk_texts(root: Path) -> int:
    """The chunk-text index from the vector index's documents. Returns the rows written."""
    from qcfuse_core.segment import ChunkTextIndex

    with _chroma_copy(root / CHROMA) as col:
        got = col.get(include=["documents"])
    tmp = root / f".{CHUNK_TEXTS}.rebuild"
    tmp.unlink(missing_ok=True)
    index = ChunkTextIndex(tmp)
    n = sum(index.add(text, node_id) for node_id, text in zip(got["ids"], got["documents"]))
    index.close()
    target = root / CHUNK_TEXTS
    if target.exists():
        _set_aside(target)
    for suffix in ("-wal", "-shm"):
        Path(str(tmp) + suffix).unlink(missing_ok=True)
    tmp.rename(target)
    return n


def rebuild_chroma(root: Path) -> int:
    """The vector index from the chunk-text index (texts embedded again). Returns its size."""
    from qcfuse_core.corpus import chunk_id
    from qcfuse_integrations.chroma import open_collection
    from qcfuse_integrations.embedder import get_embedder

    db = _ro(root / CHUNK_TEXTS)
    try:
        rows = db.execute("SELECT node_id, text FROM chunk_text ORDER BY rowid").fetchall()
    finally:
        db.close()
    tmp = root / f".{CHROMA}.rebuild"
    shutil.rmtree(tmp, ignore_errors=True)
    col = open_collection(tmp)
    embedder = get_embedder()
    ids = [nid or chunk_id("rebuilt", text) for nid, text in rows]
    for i in range(0, len(rows), 64):
        texts = [t for _, t in rows[i : i + 64]]
        col.add(ids=ids[i : i + 64], documents=texts, embeddings=embedder.embed(texts),
                metadatas=[{"source": "(rebuilt by store verify --repair)"} for _ in texts])
    n = col.count()
    del col
    _forget_chroma_clients()
    target = root / CHROMA
    if target.exists():
        target.rename(target.with_name(f"{CHROMA}.bad-{int(time.time())}"))
    tmp.rename(target)
    return n


def _forget_chroma_clients() -> None:
    """Chroma keeps one client per path in the process; one for a path we swap out must go."""
    try:
        from chromadb.api.client import SharedSystemClient

        SharedSystemClient.clear_system_cache()
    except (ImportError, AttributeError):
        pass


def repair(root: Path, rep: IndexReport) -> list[str]:
    """Rebuild whichever index is damaged from the other; -> what was done (or not)."""
    done = []
    texts, chroma = rep.chunk_texts, rep.chroma
    if texts.problem and chroma.ok and chroma.present:
        done.append(f"rebuilt the chunk-text index from the vector index ({rebuild_chunk_texts(root)} texts)")
    elif chroma.problem and texts.ok and texts.present:
        done.append(f"rebuilt the vector index from the chunk-text index ({rebuild_chroma(root)} chunks)")
    elif texts.problem and chroma.problem:
        done.append("both indexes are damaged: nothing to rebuild them from; run `qcfuse ingest` again")
    rep.repaired = done
    return done
