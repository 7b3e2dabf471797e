"""The vector index read without writing: what `qcfuse ask` retrieves through.

Chroma cannot open an index read-only: its client writes `chroma.sqlite3` whenever it opens
one, and a reader that rewrites files races with every other reader (a second `ask` saw a
half-written file and called the index damaged). So a read never opens Chroma. It reads
Chroma's files the way `vector_index.py` checks them - SQLite with `mode=ro`, the HNSW
files with numpy - and searches exactly:

    vectors  = HNSW data_level0.bin rows (not deleted; unit length: the space is cosine)
               then the write log (`embeddings_queue` after the segment's max_seq_id, in
               order: add if absent, update / upsert, delete) - what Chroma replays on open
    query    = the top-k by cosine similarity over all of them (exact, not the graph's
               approximation: the same hits or better)
    rows     = the documents and metadata of the hits, from SQLite

Readers and writers agree through `<root>/.index-lock` (`index_lock`): a writer of the
indexes (an ingest's `add`, a repair's swap) holds it exclusively, a reader shares it while
it reads the files, so a reader never sees a half-written one. A reader never creates the
lock file (nothing writes the store on a read): where it is missing no writer has run.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pickle
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qcfuse_core.retrieval import vector_index as vi
from qcfuse_core.store.maintenance import read_only_db

log = logging.getLogger(__name__)

LOCK = ".index-lock"  # <store root>/.index-lock
_OPS = {0: "add", 1: "update", 2: "upsert", 3: "delete"}


@contextmanager
def index_lock(root: Path, *, exclusive: bool) -> Iterator[None]:
    """Hold the store root's index lock: exclusive for a writer (the file is created), shared
    for a reader (only when the file exists; a read-only store's is opened read-only)."""
    path = Path(root) / LOCK
    fd = -1
    try:
        if exclusive:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        elif path.exists():
            fd = os.open(path, os.O_RDONLY)
    except OSError:  # a read-only folder: nobody writes it
        fd = -1
    try:
        if fd >= 0:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        if fd >= 0:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


class LockedCollection:
    """A Chroma collection whose writes (add, upsert, update, delete) hold the store root's
    index lock exclusively, so readers (`VectorReader`) never see their files half-written.
    Everything else passes through."""

    def __init__(self, collection: Any, root: Path) -> None:
        self._collection, self._root = collection, Path(root)

    def _locked(self, name: str):
        fn = getattr(self._collection, name)

        def call(*args, **kw):
            with index_lock(self._root, exclusive=True):
                return fn(*args, **kw)

        return call

    def __getattr__(self, name: str):
        if name in ("add", "upsert", "update", "delete"):
            return self._locked(name)
        return getattr(self._collection, name)


@dataclass(frozen=True)
class _Vectors:
    ids: list[str]
    matrix: np.ndarray  # (N, dim) float32, unit rows


def _graph_vectors(folder: Path) -> dict[str, np.ndarray]:
    """id -> unit vector of every live element of one HNSW folder (nothing when none is
    persisted yet). The files were checked by `vector_index.structure_problem` first."""
    header = folder / "header.bin"
    if not header.is_file():
        return {}
    (_v, _o0, _max, cur, size, label_off, off_data, *_rest) = vi._HEADER.unpack(header.read_bytes())
    if cur == 0:
        return {}
    data = np.fromfile(folder / "data_level0.bin", dtype=np.uint8, count=cur * size).reshape(cur, size)
    vecs = data[:, off_data:label_off].copy().view("<f4")  # (cur, dim)
    labels = data[:, label_off:size].copy().view("<u8").ravel()
    live = ~(data[:, 2] & 1).astype(bool)
    label_to_id = vi._read_pickle(folder / "index_metadata.pickle").get("label_to_id", {})
    return {str(label_to_id[int(lb)]): v for lb, v, ok in zip(labels, vecs, live) if ok and int(lb) in label_to_id}


def _log_ops(db: sqlite3.Connection, segment: str) -> list[tuple[str, str, np.ndarray | None]]:
    """(op, id, vector or None) of the write log after what the vector segment persisted."""
    row = db.execute("SELECT seq_id FROM max_seq_id WHERE segment_id = ?", (segment,)).fetchone()
    after = int.from_bytes(row[0], "big") if row and isinstance(row[0], bytes) else int(row[0]) if row else -1
    coll = db.execute("SELECT collection FROM segments WHERE id = ?", (segment,)).fetchone()
    out: list[tuple[str, str, np.ndarray | None]] = []
    for op, eid, vec, enc, topic in db.execute(
        "SELECT operation, id, vector, encoding, topic FROM embeddings_queue WHERE seq_id > ? ORDER BY seq_id", (after,)
    ):
        if coll and not str(topic).endswith(str(coll[0])):
            continue
        v = None
        if vec is not None:
            if str(enc or "FLOAT32").upper() != "FLOAT32":
                raise ValueError(f"unsupported vector encoding {enc!r} in the write log")
            v = np.frombuffer(vec, dtype="<f4")
        out.append((_OPS.get(int(op), "?"), str(eid), v))
    return out


def _load(path: Path) -> _Vectors:
    if not (path / vi.CHROMA_DB).is_file():  # no index yet: nothing to find
        return _Vectors([], np.zeros((0, 0), np.float32))
    db = read_only_db(path / vi.CHROMA_DB)
    try:
        segments = [r[0] for r in db.execute("SELECT id FROM segments WHERE scope = 'VECTOR'")]
        vectors: dict[str, np.ndarray] = {}
        for seg in segments:
            vectors.update(_graph_vectors(path / seg))
            for op, eid, v in _log_ops(db, seg):
                if op == "delete":
                    vectors.pop(eid, None)
                elif v is not None and (op != "add" or eid not in vectors):
                    n = float(np.linalg.norm(v))
                    vectors[eid] = v / n if n > 0 else v
    finally:
        db.close()
    ids = list(vectors)
    matrix = np.stack([vectors[i] for i in ids]).astype(np.float32) if ids else np.zeros((0, 0), np.float32)
    return _Vectors(ids, matrix)


def _rows(path: Path, ids: Sequence[str]) -> dict[str, tuple[str | None, dict]]:
    """id -> (document, metadata) from SQLite."""
    if not ids:
        return {}
    db = read_only_db(path / vi.CHROMA_DB)
    try:
        segs = vi._metadata_segment(db)
        got = db.execute(
            "SELECT e.embedding_id, m.key, m.string_value, m.int_value, m.float_value, m.bool_value "
            "FROM embeddings e LEFT JOIN embedding_metadata m ON m.id = e.id "
            f"WHERE e.segment_id IN ({','.join('?' * len(segs))}) AND e.embedding_id IN ({','.join('?' * len(ids))})",
            [*segs, *ids],
        ).fetchall()
    finally:
        db.close()
    out: dict[str, tuple[str | None, dict]] = {}
    for eid, key, s, i, f, b in got:
        doc, meta = out.get(eid, (None, {}))
        if key == "chroma:document":
            doc = s
        elif key is not None:
            meta[key] = next((x for x in (s, i, f) if x is not None), None if b is None else bool(b))
        out[eid] = (doc, meta)
    return out


class VectorReader:
    """The vector index under `path` (a store's `chroma` folder), read-only: `count()` and
    `query(query_embeddings=, n_results=, include=)` as a Chroma collection answers them."""

    def __init__(self, path: str | Path, root: str | Path | None = None) -> None:
        self.path = Path(path)
        self.root = Path(root) if root is not None else self.path.parent
        with index_lock(self.root, exclusive=False):
            self._vectors = _load(self.path)

    def count(self) -> int:
        return len(self._vectors.ids)

    def query(
        self,
        query_embeddings: Sequence[Sequence[float]],
        n_results: int = 10,
        include: Sequence[str] = ("documents", "metadatas", "distances"),
    ) -> dict[str, list]:
        out: dict[str, list] = {"ids": [], "documents": [], "metadatas": [], "distances": []}
        m = self._vectors.matrix
        for q in query_embeddings:
            qv = np.asarray(q, dtype=np.float32)
            qv = qv / max(float(np.linalg.norm(qv)), 1e-12)
            sims = m @ qv if len(m) else np.zeros(0, np.float32)  # (N,)
            k = min(n_results, len(sims))
            top = np.argsort(-sims, kind="stable")[:k]
            ids = [self._vectors.ids[i] for i in top]
            with index_lock(self.root, exclusive=False):
                rows = _rows(self.path, ids)
            out["ids"].append(ids)
            out["documents"].append([rows.get(i, (None, {}))[0] for i in ids])
            out["metadatas"].append([rows.get(i, (None, {}))[1] for i in ids])
            out["distances"].append([float(1.0 - sims[i]) for i in top])
        return {k: v for k, v in out.items() if k == "ids" or k in include}


def open_reader(store: Path) -> VectorReader:
    """The store's vector index for reading (`store/chroma`)."""
    try:
        return VectorReader(Path(store) / vi.CHROMA, Path(store))
    except (sqlite3.Error, OSError, pickle.UnpicklingError, KeyError, ValueError) as e:
        from qcfuse_core.store import StoreError

        raise StoreError(
            f"the vector index at {Path(store) / vi.CHROMA} is unreadable ({e}); rebuild it with "
            f"`qcfuse store verify --repair --store {store}`"
        ) from e
