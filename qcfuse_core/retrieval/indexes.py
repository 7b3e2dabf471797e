"""The store root's two indexes beside the KV store: checked and rebuilt from each other.

    <root>/chunk_texts.sqlite   chunk text -> node id (finding chunks inside framework prompts)
    <root>/chroma/              the vector index (ids, documents, embeddings)
    <root>/.vector-index        written when the vector index is first opened: it is expected
    <root>/kv/                  the KV store (maintenance.py)

Both hold every chunk's text, and every text is checked by its content hash: a chunk-text
row by its key (the sha256 of its text), a vector-index document by its metadata's sha256
(or, for rows written before that key, by its id, `chunk_id(source, text)`). A text that
fails is damaged: reported, never served, never copied. The vector index is derived data:
missing while texts are stored, with damaged documents, damaged HNSW files, a graph that
lacks rows, or a probe (a child process) that crashes or cannot find stored vectors - it
is rebuilt from every verified text (its own verified documents with their ids and
sources, then the chunk-text index's) by embedding them again. The chunk-text index is
rebuilt from the same verified texts. Texts shorter than `segment.ANCHOR` characters are
not in the chunk-text index; a text damaged in both indexes is lost (ingest its file
again). A chunk-text index that is missing while the vector index holds texts is rebuilt
from them too. A rebuild writes the new index beside the old one and swaps it in under the
store's index lock (retrieval/reader.py: a reader never sees the swap half-done); the
damaged one is kept as `<name>.bad-<time>`, never deleted. Checks read with read-only
connections and open Chroma only in a child process on a copy: checking never writes.

A store whose texts came without a vector index - registered through `qcfuse serve`'s
`/v1/chunks`, where retrieval runs in the client's framework - never had one: its absence is
noted, not reported as damage. The marker `.vector-index`, written when a vector index is
first opened under the root, tells the two apart: with it, a missing vector index is lost.
"""

from __future__ import annotations

import shutil
import sqlite3
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qcfuse_core.retrieval import vector_index as vi
from qcfuse_core.retrieval.reader import index_lock
from qcfuse_core.retrieval.texts import ANCHOR, ChunkTextIndex, lenient_text, text_hash_ok
from qcfuse_core.retrieval.vector_index import CHROMA, VECTOR_MARKER, mark_vector_index
from qcfuse_core.store.maintenance import read_only_db
from qcfuse_core.types import chunk_id

CHUNK_TEXTS = "chunk_texts.sqlite"


@dataclass
class IndexState:
    path: str
    present: bool = False
    rows: int = 0
    problem: str = ""  # empty when usable
    damaged: int = 0  # rows whose text does not match its content hash

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
        return [
            f"{name}: {s.problem}"
            for name, s in (("chunk-text index", self.chunk_texts), ("vector index", self.chroma))
            if s.problem
        ]

    def as_dict(self) -> dict:
        return {
            "chunk_texts": asdict(self.chunk_texts),
            "chroma": asdict(self.chroma),
            "notes": self.notes,
            "repaired": self.repaired,
        }


def _ro(path: Path) -> sqlite3.Connection:
    """`read_only_db`, with text that is not UTF-8 read as surrogates."""
    db = read_only_db(path)
    db.text_factory = lenient_text
    return db


def _text_rows(path: Path) -> list[tuple[str, str | None, str]]:
    """(sha, node id, text) of every chunk-text row, verified or not."""
    db = _ro(path)
    try:
        return db.execute("SELECT sha, node_id, text FROM chunk_text ORDER BY rowid").fetchall()
    finally:
        db.close()


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
        finally:
            db.close()
        rows = _text_rows(path)
    except sqlite3.Error as e:
        st.problem = f"unreadable ({e})"
        return st
    st.rows = len(rows)
    st.damaged = sum(1 for sha, _, text in rows if not text_hash_ok(sha, text))
    if st.damaged:
        st.problem = f"{st.damaged} of {st.rows} texts do not match their content hash (damaged; they are never served)"
    return st


def check_chroma(path: Path, expected_texts: int = 0, *, probe: bool = True) -> tuple[IndexState, set[str]]:
    """-> (state, the ids it holds). `expected_texts`: verified texts stored elsewhere (the
    vector index must exist when there are any). `probe`: also open a copy in a child
    process and look up a sample of its vectors (once a graph is written to disk)."""
    st = IndexState(str(path), (path / vi.CHROMA_DB).is_file())
    if not st.present:
        if expected_texts:
            st.problem = (
                f"missing, while the chunk-text index holds {expected_texts} texts "
                "(the vector index is rebuilt from them)"
            )
        return st, set()
    try:
        docs = list(vi.documents(path))
    except sqlite3.Error as e:
        st.problem = f"unreadable ({e})"
        return st, set()
    st.rows = len(docs)
    ids = {d.id for d in docs}
    st.damaged = sum(1 for d in docs if not d.ok)
    if st.damaged:
        st.problem = (
            f"{st.damaged} of {st.rows} documents do not match their content hash (damaged; they are never served)"
        )
        return st, ids
    if st.rows != len(ids):
        st.problem = f"count {st.rows} disagrees with its {len(ids)} ids"
        return st, ids
    st.problem = vi.quick_problem(path)
    if not st.problem and probe and st.rows and vi.persisted_graph(path):
        try:
            import chromadb  # noqa: F401
        except ImportError:
            st.problem = "chromadb is not installed (pip install 'qcfuse[chroma]'): not checked"
            return st, ids
        st.problem = vi.probe(path)
    return st, ids


def check(root: Path, linked_nodes: set[str] | None = None, *, probe: bool = True) -> IndexReport:
    """Check both indexes and their agreement (with the KV store's node links, if given)."""
    texts = check_chunk_texts(root / CHUNK_TEXTS)
    verified = texts.rows - texts.damaged if texts.present else 0
    expected = (root / VECTOR_MARKER).exists()
    chroma, ids = check_chroma(root / CHROMA, verified if expected else 0, probe=probe)
    if not texts.present and chroma.present and chroma.rows:
        try:
            n = sum(1 for d in vi.documents(root / CHROMA) if d.ok and len(d.text or "") >= ANCHOR)
        except sqlite3.Error:
            n = 0
        if n:
            texts.problem = f"missing, while the vector index holds {n} texts (it is rebuilt from them)"
    rep = IndexReport(texts, chroma)
    if verified and not chroma.present and not expected:
        rep.notes.append(
            f"no vector index: the {verified} texts came without one (registered through `qcfuse serve`'s "
            "/v1/chunks, where retrieval runs in the client's framework); `qcfuse ingest` builds one"
        )
    if texts.ok and chroma.ok and texts.present and chroma.present and texts.rows != chroma.rows:
        rep.notes.append(
            f"the chunk-text index has {texts.rows} texts, the vector index {chroma.rows} chunks "
            f"(it never holds texts under 32 characters; others are missing after a full disk or a "
            f"read-only run - the same `qcfuse ingest` again adds them)"
        )
    if linked_nodes is not None and chroma.ok and ids:
        uncached = len(ids - linked_nodes)
        if uncached:
            rep.notes.append(
                f"{uncached} of {len(ids)} chunks are not linked to a stored cache (a stored one is "
                "found by its tokens when asked, a missing one computed; `qcfuse ingest` stores them)"
            )
    return rep


def verified_texts(root: Path) -> tuple[list[tuple[str, str, dict]], set[str]]:
    """Every text that verifies, from both indexes: ([(id, text, metadata)] in order, the
    vector index's first), and the content hashes of the damaged chunk-text rows that no
    verified copy replaces (texts lost)."""
    out: list[tuple[str, str, dict]] = []
    seen_ids: set[str] = set()
    shas: set[str] = set()
    if (root / CHROMA / vi.CHROMA_DB).is_file():
        try:
            for d in vi.documents(root / CHROMA):
                if d.ok and d.id not in seen_ids:
                    assert d.text is not None  # ok: the text is present and matches its hash
                    sha = vi.text_sha256(d.text)
                    seen_ids.add(d.id)
                    shas.add(sha)
                    out.append((d.id, d.text, {**d.metadata, vi.SHA_KEY: sha}))
        except sqlite3.Error:
            pass
    damaged: set[str] = set()
    if (root / CHUNK_TEXTS).is_file():
        try:
            rows = _text_rows(root / CHUNK_TEXTS)
        except sqlite3.Error:
            rows = []
        for sha, node_id, text in rows:
            if not text_hash_ok(sha, text):
                damaged.add(sha)
            elif sha not in shas:
                doc_id = node_id or chunk_id("rebuilt", text)
                if doc_id in seen_ids:
                    continue
                shas.add(sha)
                seen_ids.add(doc_id)
                out.append((doc_id, text, {"source": "(rebuilt by store verify --repair)", vi.SHA_KEY: sha}))
    return out, damaged - shas


def _set_aside(path: Path) -> Path:
    aside = path.with_name(f"{path.name}.bad-{int(time.time())}")
    path.rename(aside)
    for suffix in ("-wal", "-shm"):  # a stale journal must never meet the new file
        j = Path(str(path) + suffix)
        if j.exists():
            j.rename(Path(str(aside) + suffix))
    return aside


def rebuild_chunk_texts(root: Path, texts: list[tuple[str, str, dict]] | None = None) -> int:
    """The chunk-text index from the verified texts (`verified_texts`). Returns the rows written."""
    if texts is None:
        texts, _ = verified_texts(root)
    tmp = root / f".{CHUNK_TEXTS}.rebuild"
    tmp.unlink(missing_ok=True)
    index = ChunkTextIndex(tmp)
    n = sum(index.add(text, node_id) for node_id, text, _ in texts)
    index.close()
    target = root / CHUNK_TEXTS
    for suffix in ("-wal", "-shm"):
        Path(str(tmp) + suffix).unlink(missing_ok=True)
    with index_lock(root, exclusive=True):
        if target.exists():
            _set_aside(target)
        tmp.rename(target)
    return n


def rebuild_chroma(root: Path, texts: list[tuple[str, str, dict]] | None = None) -> int:
    """The vector index from the verified texts (embedded again). Returns its size."""
    from qcfuse_core.retrieval.chroma import open_collection
    from qcfuse_core.retrieval.embedder import get_embedder

    if texts is None:
        texts, _ = verified_texts(root)
    tmp = root / f".{CHROMA}.rebuild"
    shutil.rmtree(tmp, ignore_errors=True)
    col = open_collection(tmp)
    embedder = get_embedder()
    for i in range(0, len(texts), 64):
        batch = texts[i : i + 64]
        docs = [t for _, t, _ in batch]
        col.add(
            ids=[d for d, _, _ in batch],
            documents=docs,
            embeddings=embedder.embed(docs),
            metadatas=[m for _, _, m in batch],
        )
    n = col.count()
    del col
    _forget_chroma_clients()
    target = root / CHROMA
    with index_lock(root, exclusive=True):
        if target.exists():
            target.rename(target.with_name(f"{CHROMA}.bad-{int(time.time())}"))
        tmp.rename(target)
    mark_vector_index(root)
    return n


def _forget_chroma_clients() -> None:
    """Chroma keeps one client per path in the process; one for a path we swap out must go."""
    try:
        from chromadb.api.client import SharedSystemClient

        SharedSystemClient.clear_system_cache()
    except (ImportError, AttributeError):
        pass


def repair(root: Path, rep: IndexReport) -> list[str]:
    """Rebuild whichever index is damaged (or missing while the other holds texts) from
    every text that verifies in either; -> what was done (or not)."""
    done: list[str] = []
    texts, chroma = rep.chunk_texts, rep.chroma
    if not texts.problem and not chroma.problem:
        rep.repaired = done
        return done
    good, lost = verified_texts(root)
    if not good:
        done.append("no text verifies in either index: nothing to rebuild them from; run `qcfuse ingest` again")
        rep.repaired = done
        return done
    if chroma.problem:
        done.append(f"rebuilt the vector index from the verified texts ({rebuild_chroma(root, good)} chunks)")
    if texts.problem:
        done.append(f"rebuilt the chunk-text index from the verified texts ({rebuild_chunk_texts(root, good)} texts)")
    if lost:
        done.append(f"{len(lost)} texts were damaged in both indexes and are not restored: ingest their files again")
    rep.repaired = done
    return done
