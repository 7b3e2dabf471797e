"""retrieval/reader.py: the vector index read without opening Chroma (issue 56, rows 69/69b).
The reader's vectors are the ones Chroma holds (its HNSW graph plus its write log: adds,
upserts, deletes), its hits the exact nearest ones, its documents Chroma's; reading changes
no file (size and mtime); a reader waits for a writer holding the index lock. Random
vectors, no model."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("chromadb", reason="the chroma extra is not installed")

from qcfuse_core.retrieval.chroma import open_collection  # noqa: E402
from qcfuse_core.retrieval.reader import LOCK, LockedCollection, VectorReader, index_lock  # noqa: E402

DIM = 32


def _unit(rng, n: int) -> np.ndarray:
    v = rng.normal(size=(n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _files(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """1,200 vectors (Chroma writes its HNSW graph), then in the write log: 40 more, 5
    deleted, 3 moved by upsert. -> (store root, {id: unit vector} as Chroma now holds them)."""
    from chromadb.api.client import SharedSystemClient

    root = tmp_path_factory.mktemp("reader")
    rng = np.random.default_rng(0)
    col = LockedCollection(open_collection(root / "chroma"), root)
    held: dict[str, np.ndarray] = {}
    base = _unit(rng, 1200)
    for i in range(0, 1200, 400):
        ids = [f"id{j}" for j in range(i, i + 400)]
        col.add(ids=ids, embeddings=base[i : i + 400].tolist(), documents=[f"document {j}" for j in range(i, i + 400)],
                metadatas=[{"source": f"s{j % 7}.md", "n": j} for j in range(i, i + 400)])
        held.update(zip(ids, base[i : i + 400]))
    more = _unit(rng, 40)
    ids = [f"new{j}" for j in range(40)]
    col.add(ids=ids, embeddings=more.tolist(), documents=[f"new document {j}" for j in range(40)])
    held.update(zip(ids, more))
    gone = ["id3", "id500", "new7", "id1199", "id42"]
    col.delete(ids=gone)
    for g in gone:
        held.pop(g)
    moved = _unit(rng, 3)
    col.upsert(ids=["id10", "id11", "new0"], embeddings=moved.tolist(), documents=["moved a", "moved b", "moved c"])
    held.update(zip(["id10", "id11", "new0"], moved))
    assert col.count() == len(held)
    assert list((root / "chroma").glob("*/data_level0.bin")), "Chroma wrote no HNSW graph"
    del col
    SharedSystemClient.clear_system_cache()
    return root, held


def test_the_reader_holds_chromas_vectors_and_finds_the_exact_nearest(index):
    root, held = index
    reader = VectorReader(root / "chroma")
    assert reader.count() == len(held)
    ids = list(held)
    m = np.stack([held[i] for i in ids])
    rng = np.random.default_rng(1)
    for q in [*_unit(rng, 10), held["id10"], held["new3"]]:
        got = reader.query([q.tolist()], n_results=5, include=["documents", "metadatas", "distances"])
        sims = m @ q
        want = [ids[i] for i in np.argsort(-sims, kind="stable")[:5]]
        assert got["ids"][0] == want
        np.testing.assert_allclose(got["distances"][0], 1 - np.sort(sims)[::-1][:5], atol=1e-5)
    hit = reader.query([held["id10"].tolist()], n_results=1)
    assert hit["ids"] == [["id10"]] and hit["documents"] == [["moved a"]]
    hit = reader.query([held["id20"].tolist()], n_results=1)
    assert hit["documents"] == [["document 20"]] and hit["metadatas"] == [[{"source": "s6.md", "n": 20}]]
    for g in ("id3", "new7"):
        assert g not in reader._vectors.ids
    # what Chroma itself answers for a stored vector
    col = open_collection(root / "chroma")
    try:
        want = col.query(query_embeddings=[held["id77"].tolist()], n_results=3, include=["documents", "metadatas"])
        got = reader.query([held["id77"].tolist()], n_results=3, include=["documents", "metadatas"])
        assert got["ids"][0][0] == want["ids"][0][0] == "id77"
        assert got["documents"][0][0] == want["documents"][0][0] and got["metadatas"][0][0] == want["metadatas"][0][0]
    finally:
        from chromadb.api.client import SharedSystemClient

        del col
        SharedSystemClient.clear_system_cache()


def test_reading_writes_nothing(index, tmp_path):
    import shutil

    root = tmp_path / "store"
    shutil.copytree(index[0], root)
    (root / LOCK).unlink(missing_ok=True)  # a store no writer of this version touched
    before = _files(root)
    reader = VectorReader(root / "chroma")
    for q in _unit(np.random.default_rng(2), 5):
        reader.query([q.tolist()], n_results=4)
    assert _files(root) == before  # no byte, no mtime, no new file (not even the lock)
    assert VectorReader(tmp_path / "nothing" / "chroma").count() == 0  # no index: nothing found, nothing made
    assert not (tmp_path / "nothing").exists()


def test_a_reader_waits_for_a_writer_holding_the_lock(index):
    root, held = index
    done = threading.Event()
    with index_lock(root, exclusive=True):
        t = threading.Thread(target=lambda: (VectorReader(root / "chroma"), done.set()), daemon=True)
        t.start()
        assert not done.wait(0.5)  # blocked while the writer holds the lock
    assert done.wait(30)
    t.join(30)


def test_readers_never_see_a_writer_half_done(tmp_path):
    """A writer adds 1,500 vectors in batches of 100 (Chroma writes its HNSW files at 1,000 and
    rewrites them after) while 3 readers check and read the index over and over, as `ask` does
    (the files' check, then the reader, under the shared lock): every check passes, every read
    holds a whole number of batches, and the counts only grow."""
    from chromadb.api.client import SharedSystemClient

    from qcfuse_core.retrieval.vector_index import quick_problem

    root = tmp_path / "store"
    root.mkdir()
    rng = np.random.default_rng(3)
    vecs = _unit(rng, 1500)
    col = LockedCollection(open_collection(root / "chroma"), root)
    col.add(ids=["first"], embeddings=[vecs[0].tolist()], documents=["first"])
    writing = threading.Event()
    writing.set()
    seen: list[list[int]] = [[] for _ in range(3)]
    problems: list[str] = []

    def write() -> None:
        try:
            for i in range(1, 1500, 100):
                end = min(i + 100, 1500)
                col.add(ids=[f"v{j}" for j in range(i, end)], embeddings=vecs[i:end].tolist(),
                        documents=[f"doc {j}" for j in range(i, end)])
        finally:
            writing.clear()

    def read(k: int) -> None:
        while True:
            last = not writing.is_set()  # this read starts after the last batch
            try:
                with index_lock(root, exclusive=False):
                    why = quick_problem(root / "chroma")
                    n = VectorReader(root / "chroma").count()
            except Exception as e:  # a half-written file read as damage, say
                problems.append(f"{type(e).__name__}: {e}")
                return
            if why:
                problems.append(why)
            seen[k].append(n)
            if last and len(seen[k]) >= 5:
                return
            time.sleep(0.005)  # pacing, not a wait: shared locks back to back would starve the writer

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
        assert not t.is_alive()
    del col
    SharedSystemClient.clear_system_cache()
    assert not problems, problems[:3]
    assert list((root / "chroma").glob("*/data_level0.bin")), "Chroma wrote no HNSW graph"
    for counts in seen:
        assert counts == sorted(counts) and counts[-1] == 1500
        assert all(c == 1 or (c - 1) % 100 == 0 or c == 1500 for c in counts), counts
    assert sum(len(c) for c in seen) >= 15
