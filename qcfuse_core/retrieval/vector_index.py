"""The vector index (Chroma) checked without opening it in this process.

Chroma keeps its rows in `chroma.sqlite3` and each collection's nearest-neighbour graph in
a folder of HNSW files, which native code loads and trusts: a flipped link id there is a
segmentation fault, not an exception. So before the index is opened in a user's process
its files are read here with SQLite and numpy, and checked:

    <store>/chroma/chroma.sqlite3         rows: ids, documents, metadata; the write log
    <store>/chroma/<segment uuid>/
        header.bin          100 bytes: version, sizes, element count, entry point, M
        data_level0.bin     per element: link count (u16), flags, maxM0 links (u32),
                            the vector (dim x f32), its label (u64)
        length.bin          per element: the vector's norm before normalising (f32)
        link_lists.bin      per element: u32 byte size, then its upper levels' links
        index_metadata.pickle   id <-> label maps (plain dicts)

What must hold for `structure_problem` to return "": every link count within its level's
maximum, every link naming an existing element, the entry point existing at the top
level, unit-norm finite vectors (the collections are cosine), labels unique and equal to
the pickle's map. `coverage_problem` says which rows the graph (with the write log not
yet folded into it) does not hold: a deleted or stale HNSW folder makes Chroma answer from
whatever is left, silently. `probe` opens a private copy in a child process and checks
that a sample of stored vectors finds itself; a crash there is reported, never suffered.

Every stored document is checked by its content hash (`document_ok`). The checks write
nothing; `mark_vector_index` writes the store root's marker file when an index is opened.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import sqlite3
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qcfuse_core.store.maintenance import read_only_db
from qcfuse_core.types import chunk_id

log = logging.getLogger(__name__)

CHROMA = "chroma"  # a store root's vector index folder
CHROMA_DB = "chroma.sqlite3"
VECTOR_MARKER = ".vector-index"  # <store>/.vector-index: a vector index was opened there (retrieval/indexes.py)
SHA_KEY = "sha256"  # metadata key: sha256 of the document's UTF-8 bytes
_HEADER = struct.Struct("<i6QiI3QdQ")  # 100 bytes (chroma-hnswlib's persisted header)
_UNIT_TOL = 1e-3  # |norm - 1| of a stored (normalised) vector


def mark_vector_index(root: Path) -> None:
    """Record that the store root `root` has a vector index (`VECTOR_MARKER`: from then on
    `store verify` expects one there); a read-only root is left as it is."""
    marker = Path(root) / VECTOR_MARKER
    if marker.exists():
        return
    try:
        marker.write_text("a vector index was opened under this folder; `qcfuse store verify` expects it\n")
    except OSError:
        pass


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def document_ok(doc_id: str, document: str | None, metadata: dict | None) -> bool:
    """The document is the text that was stored under `doc_id`: its sha256 equals the
    metadata's `sha256`, or (rows written before that key existed) the id is
    `chunk_id(source, document)`."""
    if document is None:
        return False
    meta = metadata or {}
    try:
        if SHA_KEY in meta:
            return meta[SHA_KEY] == text_sha256(document)
        return chunk_id(str(meta.get("source", "")), document) == doc_id
    except UnicodeEncodeError:
        return False


@dataclass(frozen=True)
class StoredDocument:
    id: str
    text: str | None
    metadata: dict

    @property
    def ok(self) -> bool:
        return document_ok(self.id, self.text, self.metadata)


def _metadata_segment(db: sqlite3.Connection) -> list[str]:
    return [r[0] for r in db.execute("SELECT id FROM segments WHERE scope = 'METADATA'")]


def documents(path: Path) -> Iterator[StoredDocument]:
    """Every row of the index at `path` (the `chroma` folder), read from SQLite directly.
    Raises sqlite3.DatabaseError when the database is unreadable."""
    db = read_only_db(path / CHROMA_DB)
    try:
        segs = _metadata_segment(db)
        rows = db.execute(
            "SELECT e.id, e.embedding_id, m.key, m.string_value FROM embeddings e "
            "LEFT JOIN embedding_metadata m ON m.id = e.id "
            f"WHERE e.segment_id IN ({','.join('?' * len(segs))}) ORDER BY e.id",
            segs,
        ).fetchall()
    finally:
        db.close()
    meta: dict[str, str | None] = {}
    cur, doc_id, text = None, "", None
    for rowid, eid, key, value in rows:
        if rowid != cur:
            if cur is not None:
                yield StoredDocument(doc_id, text, meta)
            cur, doc_id, text, meta = rowid, eid, None, {}
        if key == "chroma:document":
            text = value
        elif key is not None:
            meta[key] = value
    if cur is not None:
        yield StoredDocument(doc_id, text, meta)


# ------------------------------------------------------------------------- HNSW files


class _NoGlobals(pickle.Unpickler):
    """index_metadata.pickle holds dicts of str/int only: refuse anything else."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"unexpected object {module}.{name}")


def _read_pickle(path: Path) -> dict:
    obj = _NoGlobals(io.BytesIO(path.read_bytes())).load()
    if not isinstance(obj, dict):
        raise pickle.UnpicklingError("not a dict")
    return obj


def hnsw_folders(path: Path) -> list[Path]:
    """The vector segments' folders that exist (named by segment id)."""
    db = read_only_db(path / CHROMA_DB)
    try:
        segs = [r[0] for r in db.execute("SELECT id FROM segments WHERE scope = 'VECTOR'")]
    finally:
        db.close()
    return [path / s for s in segs if (path / s).is_dir()]


def structure_problem(folder: Path, *, unit_vectors: bool = True) -> str:
    """'' when the HNSW files in `folder` are consistent (or hold nothing yet); else what is
    wrong. Reads every byte of the graph; never hands the files to native code."""
    header = folder / "header.bin"
    if not header.exists():
        return "" if not (folder / "data_level0.bin").exists() else "header.bin missing"
    h = header.read_bytes()
    if len(h) != _HEADER.size:
        return f"header.bin has {len(h)} bytes, expected {_HEADER.size}"
    (_ver, off0, max_el, cur, size, label_off, off_data, max_level, entry, max_m, max_m0, _m, _mult, _efc) = (
        _HEADER.unpack(h)
    )
    dim4 = label_off - off_data
    if not (
        off0 == 0
        and off_data == 4 + 4 * max_m0
        and label_off == size - 8
        and dim4 > 0
        and dim4 % 4 == 0
        and 0 <= cur <= max_el
        and 0 < max_m <= 4096
        and 0 < max_m0 <= 8192
    ):
        return "header.bin is inconsistent"
    if cur == 0:
        return ""
    if not (0 <= entry < cur and max_level >= 0):
        return "header.bin: entry point out of range"
    files = {n: folder / n for n in ("data_level0.bin", "length.bin", "link_lists.bin")}
    for name, need in (("data_level0.bin", cur * size), ("length.bin", cur * 4)):
        if not files[name].exists() or files[name].stat().st_size < need:
            return f"{name} is missing or shorter than {cur} elements"
    data = np.fromfile(files["data_level0.bin"], dtype=np.uint8, count=cur * size).reshape(cur, size)
    counts = data[:, 0:2].copy().view("<u2").ravel()
    if int(counts.max()) > max_m0:
        return "data_level0.bin: a link count exceeds its maximum"
    links = data[:, 4:off_data].copy().view("<u4")  # (cur, maxM0)
    used = np.arange(max_m0)[None, :] < counts[:, None]
    if bool((links[used] >= cur).any()):
        return "data_level0.bin: a link names no element"
    vecs = data[:, off_data:label_off].copy().view("<f4")  # (cur, dim)
    if not np.isfinite(vecs).all():
        return "data_level0.bin: a vector is not finite"
    with np.errstate(over="ignore", invalid="ignore"):
        off_unit = np.abs(np.linalg.norm(vecs.astype(np.float64), axis=1) - 1) > _UNIT_TOL
    if unit_vectors and bool(off_unit.any()):
        return "data_level0.bin: a vector is damaged (not of unit length)"
    labels = data[:, label_off:size].copy().view("<u8").ravel()
    deleted = (data[:, 2] & 1).astype(bool)
    if len(np.unique(labels)) != cur:
        return "data_level0.bin: two elements share a label"
    norms = np.fromfile(files["length.bin"], dtype="<f4", count=cur)
    if not (np.isfinite(norms).all() and (norms >= 0).all()):
        return "length.bin: a norm is not a finite non-negative number"
    blob = files["link_lists.bin"].read_bytes() if files["link_lists.bin"].exists() else b""
    per_level = 4 + 4 * max_m
    pos, top = 0, -1
    for i in range(cur):
        if pos + 4 > len(blob):
            return "link_lists.bin is truncated"
        n = int.from_bytes(blob[pos : pos + 4], "little")
        pos += 4
        if n % per_level or pos + n > len(blob):
            return "link_lists.bin: a list size is inconsistent"
        if n:
            lv = np.frombuffer(blob, dtype="<u4", count=n // 4, offset=pos).reshape(-1, 1 + max_m)
            c = lv[:, 0] & 0xFFFF
            if int(c.max()) > max_m:
                return "link_lists.bin: a link count exceeds its maximum"
            if bool((lv[:, 1:][np.arange(max_m)[None, :] < c[:, None]] >= cur).any()):
                return "link_lists.bin: a link names no element"
            if i == entry:
                top = len(lv)
            elif len(lv) > max_level:
                return "link_lists.bin: an element above the top level"
        elif i == entry:
            top = 0
        pos += n
    if top != max_level:
        return "the entry point is not on the top level"
    meta_file = folder / "index_metadata.pickle"
    if meta_file.exists():
        try:
            meta = _read_pickle(meta_file)
            label_to_id = meta["label_to_id"]
            if set(label_to_id) != {int(x) for x in labels[~deleted]}:
                return "index_metadata.pickle disagrees with the graph's labels"
        except (pickle.UnpicklingError, KeyError, TypeError, ValueError, EOFError) as e:
            return f"index_metadata.pickle is unreadable ({e})"
    return ""


def persisted_graph(path: Path) -> bool:
    """Some vector segment has a graph on disk (Chroma writes one after `sync_threshold`
    additions; before that every vector is replayed from its write log into memory)."""
    for folder in hnsw_folders(path):
        h = folder / "header.bin"
        if h.is_file() and h.stat().st_size == _HEADER.size and _HEADER.unpack(h.read_bytes())[3] > 0:
            return True
    return False


def vector_ids(path: Path) -> set[str]:
    """Ids the vector index can return: those in its HNSW folders' maps plus those still in
    Chroma's write log (replayed into the graph when it is opened)."""
    ids: set[str] = set()
    for folder in hnsw_folders(path):
        meta_file = folder / "index_metadata.pickle"
        if meta_file.exists():
            try:
                ids.update(str(k) for k in _read_pickle(meta_file).get("id_to_label", {}))
            except (pickle.UnpicklingError, TypeError, ValueError, EOFError):
                pass
    db = read_only_db(path / CHROMA_DB)
    try:
        ids.update(r[0] for r in db.execute("SELECT id FROM embeddings_queue WHERE operation IN (0, 1, 2)"))
    finally:
        db.close()
    return ids


def row_ids(path: Path) -> list[str]:
    db = read_only_db(path / CHROMA_DB)
    try:
        segs = _metadata_segment(db)
        return [
            r[0]
            for r in db.execute(
                f"SELECT embedding_id FROM embeddings WHERE segment_id IN ({','.join('?' * len(segs))})", segs
            )
        ]
    finally:
        db.close()


def coverage_problem(path: Path) -> str:
    """'' when every row has a vector in the index; else how many do not."""
    rows = row_ids(path)
    missing = len(set(rows) - vector_ids(path))
    return f"its graph lacks {missing} of its {len(rows)} chunks (HNSW files lost or stale)" if missing else ""


def quick_problem(path: Path) -> str:
    """What `ask` checks before opening the index in-process: the database, the HNSW
    files' structure, the graph's coverage of the rows. '' when usable."""
    try:
        for folder in hnsw_folders(path):
            why = structure_problem(folder)
            if why:
                return f"its HNSW files are damaged ({folder.name}/{why})"
        return coverage_problem(path)
    except sqlite3.Error as e:
        return f"{CHROMA_DB} is unreadable ({e})"
    except OSError as e:
        return f"unreadable ({e})"


# ------------------------------------------------------------------------- child probe

_PROBE = """
import json, sys
from qcfuse_core.retrieval.chroma import open_collection
col = open_collection(sys.argv[1])
n = col.count()
got = col.get(include=["embeddings"], limit=min(n, 2000))
ids, embs = got["ids"], got["embeddings"]
step = max(1, len(ids) // int(sys.argv[2]))
bad = 0
for i in range(0, len(ids), step):
    r = col.query(query_embeddings=[embs[i]], n_results=min(5, n), include=["distances"])
    if not r["distances"][0] or r["distances"][0][0] > 1e-3:
        bad += 1
print(json.dumps({"count": n, "sampled": len(range(0, len(ids), step)), "lost": bad}))
"""


def probe(path: Path, samples: int = 16, timeout_s: float = 600.0) -> str:
    """Open a private copy of the index at `path` in a child process, look up a sample of
    its stored vectors and check each finds itself. '' when it does; else what happened
    (a crash of the child included)."""
    tmp = Path(tempfile.mkdtemp(prefix="qcfuse-vector-probe-"))
    try:
        shutil.copytree(path, tmp / "chroma", copy_function=shutil.copyfile)
        for q in [tmp / "chroma", *(tmp / "chroma").rglob("*")]:
            q.chmod(q.stat().st_mode | 0o700 if q.is_dir() else 0o600)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _PROBE, str(tmp / "chroma"), str(samples)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env=env,
            )
        except subprocess.TimeoutExpired:
            return f"a probe query did not finish in {timeout_s:.0f} s"
        if proc.returncode < 0:
            return f"opening it crashes a probe process (signal {-proc.returncode})"
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
            return f"a probe query fails ({last})"
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        if res["lost"]:
            return f"{res['lost']} of {res['sampled']} sampled chunks are not found by their own vector"
        return ""
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
