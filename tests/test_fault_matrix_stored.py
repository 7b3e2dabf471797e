"""The fault matrix, continued: what is stored beside the KV caches (issue 41).

Every row ends with the same answer as before the fault, or with a one-line
`qcfuse: error: ...` that names what is wrong and a command that works - and after that
command the store verifies clean (`qcfuse store verify` exits 0).

    row  fault                                       outcome
    41   texts altered in chunk_texts.sqlite         verify names them; never served or copied;
                                                     --repair restores them from the vector index
    45   a vector-index document edited in place     dropped with a warning (next candidates fill
                                                     in); --repair restores it from the chunk texts
    46   chroma/chroma.sqlite3 deleted               error "missing" (no empty index made);
                                                     --repair rebuilds it from the chunk texts
    48   10 bit flips in the HNSW graph's links      error in `ask`, no crash; verify says so;
         (3,003-chunk index, stub embedder)          --repair rebuilds; same answer
    49   the HNSW segment folder deleted             error "lacks N of M chunks"; --repair
    34   KV manifest damaged                         ask answers; stats/verify name `verify --repair`,
                                                     which rebuilds it from the cache files' headers
    38   KV manifest deleted                         the same
    55   disk full in the vector index's writes      one-line error; --repair and ingest again
    69   a cache removed between plan and load       recomputed (another process removed it)
    9    a file name that is not UTF-8               ingested under a replacement name, warned
    26   bytes that are not UTF-8 in a question      one-line error naming the byte
    -    an ingest that would write a lot of KV      refused without --yes (or asked on a terminal);
                                                     --max-kv-bytes caps it
    69   a plain ask (3,003-chunk index)             no file of either index changes (bytes, mtime)
    69b  4 concurrent asks x 3, a damaged cache      every ask answers as before; no false "damaged"
    36b  manifest deleted, then an ask               verify and --repair classify alike: unindexed
                                                     files indexed by --repair, orphans by --remove
    52b  store verify on a read-only store           "read-only", the manifest intact; --repair
                                                     refused in one line; nothing written
    -    chunk_texts.sqlite deleted                  verify: missing; --repair rebuilds it from
                                                     the vector index's verified copies
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from qcfuse_core.cli.commands import main
from tests.qc_fixtures import (  # noqa: F401  (fixtures)
    ASK,
    FAULT_DOCS,
    QUESTION,
    _ask,
    _cli,
    _one_line_error,
    _overwrite_head,
    _try_tmpfs,
    _verifies,
    _write_docs,
    baseline,
    baseline_answer,
    store,
)

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parent


def _chroma_documents(store: Path) -> dict[str, str]:
    from qcfuse_core.retrieval.vector_index import documents

    return {d.id: d.text for d in documents(store / "chroma")}


def _checkpoint(db_path: Path) -> None:
    db = sqlite3.connect(db_path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    for suffix in ("-wal", "-shm"):
        Path(str(db_path) + suffix).unlink(missing_ok=True)


def _alter_stored_texts(path: Path, texts: list[str]) -> None:
    """Flip one bit inside each of `texts` where the SQLite file stores it."""
    _checkpoint(path)
    b = bytearray(path.read_bytes())
    for t in texts:
        at = b.find(t.encode())
        assert at >= 0, t
        b[at + 4] ^= 0x08
    path.write_bytes(bytes(b))


# ------------------------------------------------------------------- 41: chunk texts


def test_chunk_texts_altered(store, baseline_answer, capsys):
    texts = [FAULT_DOCS["harbour.md"], FAULT_DOCS["ferry.md"]]
    _alter_stored_texts(store / "chunk_texts.sqlite", texts)
    from qcfuse_core.retrieval.texts import ChunkTextIndex

    index = ChunkTextIndex(store / "chunk_texts.sqlite", read_only=True)
    found = {p.text for p in index.find("Context: " + " ".join(FAULT_DOCS.values()))}
    assert found == {FAULT_DOCS["bakery.md"]} and index.damaged == 2  # never served
    index.close()
    assert _ask(capsys, store)["answer"] == baseline_answer["answer"]
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store))
    assert code == 1 and "2 of 3 texts do not match their content hash" in out and "--repair" in out
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store), "--repair")
    assert code == 0, out + err
    assert "rebuilt the chunk-text index from the verified texts (3 texts)" in out
    assert _verifies(capsys, store)["chunk_texts"]["rows"] == 3
    assert _ask(capsys, store)["answer"] == baseline_answer["answer"]


def test_chunk_texts_altered_never_copied_into_a_rebuilt_vector_index(store, baseline, capsys):
    _alter_stored_texts(store / "chunk_texts.sqlite", [FAULT_DOCS["harbour.md"], FAULT_DOCS["ferry.md"]])
    _overwrite_head(store / "chroma" / "chroma.sqlite3")  # and the vector index unreadable
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store), "--repair")
    assert code == 0, out + err
    assert "2 texts were damaged in both indexes and are not restored: ingest their files again" in out
    assert set(_chroma_documents(store).values()) == {FAULT_DOCS["bakery.md"]}  # the altered ones are not in it
    _verifies(capsys, store)
    code, out, err = _cli(capsys, "ingest", str(baseline[1]), "--store", str(store))
    assert code == 0, err  # the documented way back
    assert set(_chroma_documents(store).values()) == set(FAULT_DOCS.values())
    _verifies(capsys, store)


# ------------------------------------------------------------------- 45: vector documents


def test_vector_document_edited(store, baseline_answer, capsys):
    db = sqlite3.connect(store / "chroma" / "chroma.sqlite3")
    db.execute("UPDATE embedding_metadata SET string_value = replace(string_value, '1911', '1971') "
               "WHERE key = 'chroma:document'")
    db.commit()
    db.close()
    edited = [i for i, t in _chroma_documents(store).items() if "1971" in t]
    assert len(edited) == 1
    harbour = edited[0]
    code, out, err = _cli(capsys, "ask", QUESTION, "--store", str(store), *ASK)
    assert code == 0, err
    assert "1 retrieved chunk(s) do not match their content hash" in err and "--repair" in err
    r = json.loads(out)
    assert harbour not in r["sources"] and len(r["sources"]) == 2  # dropped, never served
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store))
    assert code == 1 and "1 of 3 documents do not match their content hash" in out
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store), "--repair")
    assert code == 0, out + err
    assert FAULT_DOCS["harbour.md"] in _chroma_documents(store).values()
    _verifies(capsys, store)
    r = _ask(capsys, store)
    assert r["answer"] == baseline_answer["answer"] and harbour in r["sources"]


# ------------------------------------------------------------------- 46: vector index deleted


def test_vector_index_deleted(store, baseline_answer, capsys):
    (store / "chroma" / "chroma.sqlite3").unlink()
    code, out, err = _cli(capsys, "ask", QUESTION, "--store", str(store), *ASK)
    assert code == 2
    _one_line_error(err, "is missing while 3 chunk texts are stored")
    assert f"qcfuse store verify --repair --store {store}" in err
    assert not (store / "chroma" / "chroma.sqlite3").exists()  # no empty index made in its place
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store))
    assert code == 1 and "vector index" in out and "BAD: missing" in out
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store), "--repair")
    assert code == 0, out + err
    _verifies(capsys, store)
    assert _ask(capsys, store)["answer"] == baseline_answer["answer"]


# ------------------------------------------------------------------- 48, 49: the HNSW files


@contextmanager
def _stub_embedder():
    from stub_embedder import HashEmbedder

    import qcfuse_core.retrieval.embedder as embedder

    old, embedder._SINGLETON = embedder._SINGLETON, HashEmbedder()
    try:
        yield
    finally:
        embedder._SINGLETON = old


TINY = 3000


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    """The three documents and 3,000 tiny chunks (no caches), embedded by the stub: enough
    for Chroma to write its HNSW graph to disk. -> (store, the answer before any fault)."""
    import io
    from contextlib import redirect_stdout

    from chromadb.api.client import SharedSystemClient
    from stub_embedder import HashEmbedder

    from qcfuse_core.retrieval.chroma import open_collection
    from qcfuse_core.retrieval.texts import ChunkTextIndex
    from qcfuse_core.retrieval.vector_index import SHA_KEY, text_sha256
    from qcfuse_core.types import chunk_id

    root = tmp_path_factory.mktemp("big")
    docs = _write_docs(root / "docs")
    store = root / "store"
    with _stub_embedder():
        assert main(["ingest", str(docs), "--store", str(store)]) == 0
        col = open_collection(store / "chroma")
        index = ChunkTextIndex(store / "chunk_texts.sqlite")
        texts = [f"tide note {i}: gauge {i % 97} read {i * 7 % 31} cm at dawn on the east pier" for i in range(TINY)]
        for i in range(0, TINY, 500):
            batch = texts[i : i + 500]
            ids = [chunk_id("tides.md", t) for t in batch]
            col.add(ids=ids, documents=batch, embeddings=HashEmbedder().embed(batch),
                    metadatas=[{"source": "tides.md", SHA_KEY: text_sha256(t)} for t in batch])
            for t, i_ in zip(batch, ids):
                index.add(t, i_)
        index.close()
        del col
        SharedSystemClient.clear_system_cache()
        buf = io.StringIO()
        with redirect_stdout(buf):
            assert main(["ask", QUESTION, "--store", str(store), *ASK]) == 0
    assert list((store / "chroma").glob("*/data_level0.bin")), "Chroma wrote no HNSW graph"
    return store, json.loads(buf.getvalue())


@pytest.fixture
def big(big_store, tmp_path):
    dst = tmp_path / "store"
    shutil.copytree(big_store[0], dst)
    return dst


def _stub_cli(*argv) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, str(TESTS / "stub_embedder.py"), *map(str, argv)],
                          capture_output=True, text=True, env=env, timeout=1800)


def _flip_links(folder: Path, n: int) -> None:
    """Flip bit 30 of the first link of `n` elements of the level-0 graph (what a few random
    flips there do: a neighbour id far past the last element)."""
    import struct

    from qcfuse_core.retrieval.vector_index import _HEADER

    h = _HEADER.unpack((folder / "header.bin").read_bytes())
    cur, size = h[3], h[4]
    data = bytearray((folder / "data_level0.bin").read_bytes())
    done = 0
    for i in range(cur):
        at = i * size
        if struct.unpack_from("<H", data, at)[0]:
            data[at + 4 + 3] ^= 0x40  # bit 30 of link 0
            done += 1
            if done == n:
                break
    (folder / "data_level0.bin").write_bytes(bytes(data))


def test_hnsw_links_damaged(big, big_store, capsys):
    folder = next(p.parent for p in (big / "chroma").glob("*/data_level0.bin"))
    _flip_links(folder, 10)
    proc = _stub_cli("ask", QUESTION, "--store", big, *ASK)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])  # not -11: no crash
    _one_line_error(proc, "its HNSW files are damaged")
    assert f"qcfuse store verify --repair --store {big}" in proc.stderr
    with _stub_embedder():
        code, out, err = _cli(capsys, "store", "verify", "--store", str(big))
        assert code == 1 and "HNSW files are damaged" in out
        code, out, err = _cli(capsys, "store", "verify", "--store", str(big), "--repair")
        assert code == 0, out + err
        assert f"rebuilt the vector index from the verified texts ({TINY + 3} chunks)" in out
        _verifies(capsys, big)
        r = _ask(capsys, big)
    assert r["answer"] == big_store[1]["answer"] and r["sources"] == big_store[1]["sources"]


def test_hnsw_folder_deleted(big, big_store, capsys):
    for d in (big / "chroma").iterdir():
        if d.is_dir():
            shutil.rmtree(d)
    with _stub_embedder():
        code, out, err = _cli(capsys, "ask", QUESTION, "--store", str(big), *ASK)
        assert code == 2
        _one_line_error(err, "its graph lacks")
        assert f"of its {TINY + 3} chunks" in err
        code, out, err = _cli(capsys, "store", "verify", "--store", str(big))
        assert code == 1 and "its graph lacks" in out
        code, out, err = _cli(capsys, "store", "verify", "--store", str(big), "--repair")
        assert code == 0, out + err
        _verifies(capsys, big)
        r = _ask(capsys, big)
    assert r["answer"] == big_store[1]["answer"] and r["sources"] == big_store[1]["sources"]


# ------------------------------------------------------------------- 34, 38: the KV manifest


def _damage_pages(path: Path) -> None:
    """Garble the b-tree page headers of every page after the first (what bit flips there do)."""
    _checkpoint(path)
    b = bytearray(path.read_bytes())
    page = int.from_bytes(b[16:18], "big") or 65536
    for at in range(page, len(b), page):
        for k in range(8):
            b[at + k] ^= 0xA5
    path.write_bytes(bytes(b))


@pytest.mark.parametrize("fault", ["damaged", "deleted"])
def test_kv_manifest_lost(store, baseline_answer, capsys, fault):
    manifest = store / "kv" / "manifest.sqlite"
    if fault == "damaged":
        _damage_pages(manifest)
    else:
        _checkpoint(manifest)
        manifest.unlink()
    other = store.parent / "plain-ask"
    shutil.copytree(store, other)
    assert _ask(capsys, other)["answer"] == baseline_answer["answer"]  # ask still answers
    assert _ask(capsys, store, QUESTION, "--read-only")["answer"] == baseline_answer["answer"]
    for cmd in ("stats", "gc --max-bytes 1G", "clear --yes"):
        code, out, err = _cli(capsys, "store", *cmd.split(), "--store", str(store))
        assert code == 2, (cmd, out, err)
        _one_line_error(err, f"the KV manifest {manifest} is {'damaged' if fault == 'damaged' else 'missing'}")
        assert f"rebuild it with `qcfuse store verify --repair --store {store}`" in err
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store), "--json")
    rep = json.loads(out)
    assert code == 1 and rep["manifest"]["problem"].startswith(fault if fault == "damaged" else "missing")
    assert len(rep["unindexed"]) >= 6 and not rep["orphans"]  # every cache file listed
    code, out, err = _cli(capsys, "store", "verify", "--repair", "--store", str(store))  # the command named
    assert code == 0, out + err
    assert "rebuilt from the cache files' headers" in out
    rep = _verifies(capsys, store)
    assert rep["ok"] >= 3 and not rep["unindexed"] and not rep["manifest"]["problem"]
    if fault == "damaged":
        assert list(manifest.parent.glob("manifest.sqlite.bad-*"))  # set aside, not deleted
    r = _ask(capsys, store)
    assert r["cache_hits"] == 3 and r["answer"] == baseline_answer["answer"]
    code, out, err = _cli(capsys, "store", "stats", "--store", str(store))
    assert code == 0, err


# ------------------------------------------------------------------- 55: disk full in the vector index


def test_disk_full_in_the_vector_index(tmp_path, capsys, monkeypatch):
    many = {f"note-{i:03d}.md": f"Note {i}: the tide gauge number {i} on Veyla recorded {i * 7 % 31} "
                                f"centimetres above the mean on the morning of day {i}. " * 3
            for i in range(300)}
    docs = _write_docs(tmp_path / "docs", {**FAULT_DOCS, **many})
    mnt = tmp_path / "small-disk"
    real = _try_tmpfs(mnt, "400k")
    try:
        if not real:  # no mount privileges: the vector index's writes fail as on a full disk
            from chromadb.api.models.Collection import Collection
            from chromadb.errors import InternalError

            add, calls = Collection.add, {"n": 0}

            def full_after_2(self, *a, **kw):
                calls["n"] += 1
                if calls["n"] > 2:
                    raise InternalError("Error in compaction: database or disk is full")
                return add(self, *a, **kw)

            monkeypatch.setattr(Collection, "add", full_after_2)
        store = mnt / "store"
        code, out, err = _cli(capsys, "ingest", str(docs), "--store", str(store), "--max-kv-bytes", "0")
        assert code == 2
        _one_line_error(err, "disk full while writing the vector index")
        assert f"qcfuse store verify --repair --store {store}" in err
        if real:
            from chromadb.api.client import SharedSystemClient

            SharedSystemClient.clear_system_cache()
            assert subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)]).returncode == 0  # space freed
        else:
            monkeypatch.undo()
        code, out, err = _cli(capsys, "store", "verify", "--store", str(store), "--repair")
        assert code == 0, out + err
        code, out, err = _cli(capsys, "ingest", str(docs), "--store", str(store), "--max-kv-bytes", "0")
        assert code == 0, err
        assert "ingested 303 chunks" in out
        rep = _verifies(capsys, store)
        assert rep["chroma"]["rows"] == 303
        assert _ask(capsys, store)["answer"]
    finally:
        if real:
            import gc

            from chromadb.api.client import SharedSystemClient

            SharedSystemClient.clear_system_cache()
            gc.collect()
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(mnt)], check=False)


# ------------------------------------------------------------------- 69: a cache gone between plan and load


def test_cache_removed_between_plan_and_load(store, baseline_answer, monkeypatch, caplog):
    from qcfuse_core.cli.commands import _collection, retrieve
    from qcfuse_core.engine.api import open_engine

    engine = open_engine(store)
    ids, docs = retrieve(_collection(store), QUESTION, 3)
    for t in engine.caches.store.memory_tiers:  # every chunk from disk, as in a fresh process
        t.clear()
    real = engine.lookup.prefetcher.start
    removed = []

    def another_process_removes_them(prompt):  # after the plan and the sidecar reads, before the load
        if not removed:
            for d in docs:  # what a concurrent `ask` does when it finds a cache file gone
                removed.append(engine.caches.store.delete(engine.caches.chunk_tokens(d)[1]))
        return real(prompt)

    monkeypatch.setattr(engine.lookup.prefetcher, "start", another_process_removes_them)
    r = engine.answer(QUESTION, docs, node_ids=ids, method="qcfuse", max_new_tokens=8)
    assert any(removed), "nothing was removed: the fault was not injected"
    assert r.text == baseline_answer["answer"]
    assert "left every tier after it was planned" in caplog.text


# ------------------------------------------------------------------- 9, 26: names and questions that are not UTF-8


def test_file_name_not_utf8(tmp_path, capsys):
    docs = _write_docs(tmp_path / "docs")
    name = os.fsdecode(b"caf\xe9-notes.md")
    (docs / name).write_text("The caf\u00e9 on Veyla's pier serves fish soup on Fridays and closes at nine.\n")
    store = tmp_path / "store"
    code, out, err = _cli(capsys, "ingest", str(docs), "--store", str(store))
    assert code == 0, err
    assert "Traceback" not in err
    assert "qcfuse: warning: the file name " in err and "caf\\xe9-notes.md" in err
    assert "ingested as 'caf\ufffd-notes.md'" in err
    assert "ingested 4 chunks" in out
    from qcfuse_core.retrieval.vector_index import documents

    assert {"caf\ufffd-notes.md"} <= {d.metadata["source"] for d in documents(store / "chroma")}
    _verifies(capsys, store)


def test_question_not_utf8(baseline):
    store, _ = baseline
    proc = subprocess.run([sys.executable, "-m", "qcfuse_core.cli.commands", "ask", b"Who built the harbour \xe9?",
                           "--store", str(store), *ASK], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=1800)
    assert proc.returncode == 2
    _one_line_error(proc, "the question is not valid UTF-8 (byte 0xe9 at position 22)")


def test_embedder_refuses_text_that_is_not_utf8():
    from qcfuse_core.retrieval.embedder import MiniLMEmbedder

    emb = MiniLMEmbedder.__new__(MiniLMEmbedder)  # the checks run before the model is used
    with pytest.raises(ValueError, match="not valid UTF-8"):
        emb.embed(["fine", "caf\udce9"])
    with pytest.raises(TypeError, match="list of strings, got a bytes"):
        emb.embed([b"bytes"])


# ------------------------------------------------------------------- large ingests


def test_large_ingest_asks_first(tmp_path, capsys, monkeypatch):
    para = "The harbour master of Veyla wrote in the log that the tide was high and the wind came from the west. "
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "log.md").write_text("\n\n".join(f"Entry {i}. " + para * 10 for i in range(4)) + "\n")  # 4 chunks
    store = tmp_path / "store"
    code, out, err = _cli(capsys, "ingest", str(docs), "--store", str(store), "--confirm-above", "10M")
    assert code == 2
    _one_line_error(err, "this ingest would write about")
    assert "pass --yes to write it, or --max-kv-bytes N" in err
    assert not (store / "chroma").exists() and not list((store / "kv").rglob("*.safetensors"))  # nothing written
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    code, out, err = _cli(capsys, "ingest", str(docs), "--store", str(store), "--confirm-above", "10M")
    assert code == 2
    _one_line_error(err, "ingest cancelled: nothing was written")
    monkeypatch.undo()
    code, out, err = _cli(capsys, "ingest", str(docs), "--store", str(store), "--confirm-above", "10M",
                          "--max-kv-bytes", "8M")
    assert code == 0, err
    assert "ingested 4 chunks" in out and "1 caches built" in out and "3 chunks not cached" in out
    assert "(over --max-kv-bytes 8.0 MB: computed when asked)" in out  # the cap that held them back
    rep = _verifies(capsys, store)
    assert rep["ok"] == 1 and rep["chroma"]["rows"] == 4


# ------------------------------------------------------------------- issue 56: reads never write


def _index_files(store: Path) -> dict[str, tuple[int, int]]:
    """Size and mtime of every file of the two indexes (SQLite's -shm lock files and empty
    -wal files a reader of a WAL database creates left out: they hold no data)."""
    out = {}
    for p in [store / "chunk_texts.sqlite", *(store / "chroma").rglob("*")]:
        if p.is_file() and not (p.name.endswith("-shm") or (p.name.endswith("-wal") and p.stat().st_size == 0)):
            out[str(p.relative_to(store))] = (p.stat().st_size, p.stat().st_mtime_ns)
    return out


def test_ask_and_verify_write_nothing_in_the_indexes(big, big_store, capsys):
    """Row 69: a plain `qcfuse ask` (and `store verify`) leaves every file of the vector and
    chunk-text indexes as it was: no byte and no mtime changes (Chroma rewrote all four HNSW
    files and chroma.sqlite3 on every ask)."""
    before = _index_files(big)
    assert any(k.endswith("header.bin") for k in before) and "chroma/chroma.sqlite3" in before
    with _stub_embedder():
        r = _ask(capsys, big)
        _verifies(capsys, big)
    assert r["answer"] == big_store[1]["answer"] and r["sources"] == big_store[1]["sources"]
    assert _index_files(big) == before


def test_concurrent_asks_on_a_damaged_store(big, big_store):
    """Row 69b: 4 asks at once, twice, on a store with damaged caches (an ask recomputes
    them): every ask answers as one ask alone did on the same damage, none reports a damaged
    index (an ask that rewrote the HNSW files made another read a 0-byte header.bin, 1 trial
    in 3), and after each trial no index file has changed - the check that makes the race
    impossible, not unlikely (the reader-against-writer race is repeated 100s of times in
    tests/test_vector_reader.py). Every ask runs the same kernels (the interpreter: slow asks
    overlap) with one CPU thread, and its answer is compared with one computed the same way:
    the store's caches were built in this process on the reference kernels, and a bf16 cache
    recomputed on other kernels or another thread count rounds differently, so the answer
    can part from the undamaged store's on a close token. Every cache entry is damaged, not
    the first file found (which may be a probe sidecar, whose damage costs only its anchors)."""
    from tests.qc_fixtures import _flip_bytes

    env = {**os.environ, "TRITON_INTERPRET": "1", "QCFUSE_THREADS": "1"}

    def ask() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(TESTS / "stub_embedder.py"), "ask", QUESTION, "--store",
                                 str(big), *ASK], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def damage() -> None:
        entries = [p for p in (big / "kv").rglob("*.safetensors") if not p.name.endswith(".sidecar.safetensors")]
        assert entries
        for entry in entries:
            _flip_bytes(entry)

    damage()
    out, err = ask().communicate(timeout=1800)  # alone: the damaged caches recomputed (and stored again)
    want = json.loads(out)
    assert want["sources"] == big_store[1]["sources"] and want["store"]["corrupt"] >= 1, err[-2000:]
    damage()
    before = _index_files(big)
    for trial in range(2):
        procs = [ask() for _ in range(4)]
        corrupt = 0
        for p in procs:
            out, err = p.communicate(timeout=1800)
            assert p.returncode == 0, (trial, err[-2000:])
            assert "damaged" not in err and "Traceback" not in err, (trial, err[-2000:])
            got = json.loads(out)
            assert got["answer"] == want["answer"] and got["sources"] == want["sources"], trial
            corrupt += got["store"]["corrupt"]
        assert trial == 1 or corrupt >= 1  # the damage was read (and recomputed) in the first trial
        assert _index_files(big) == before, trial


# ------------------------------------------------------------------- issue 56: verify and repair agree


def test_manifest_deleted_then_asked_verify_and_repair_agree(store, baseline_answer, capsys):
    """Row 36b: the manifest deleted, then an ask (which stores its caches again): what verify
    lists, the flag it names does - unindexed files are indexed by --repair, orphans (second
    copies of indexed entries) are left by --repair and deleted by --remove - never each
    sending you to the other."""
    manifest = store / "kv" / "manifest.sqlite"
    for suffix in ("", "-wal", "-shm"):
        Path(str(manifest) + suffix).unlink(missing_ok=True)
    assert _ask(capsys, store)["answer"] == baseline_answer["answer"]
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store), "--json")
    first = json.loads(out)
    code, text, err = _cli(capsys, "store", "verify", "--store", str(store))
    if first["unindexed"]:
        assert code == 1 and f"run with --repair to index the {len(first['unindexed'])} unindexed" in text
    if first["orphans"]:
        assert f"run with --remove to delete the 0 bad, 0 stale and {len(first['orphans'])} orphan files" in text
    assert first["unindexed"] or first["orphans"]
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store), "--repair", "--json")
    repaired = json.loads(out)
    assert code == 0, out + err
    assert repaired["repaired"] == len(first["unindexed"]) and repaired["orphans"] == first["orphans"]
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store), "--remove", "--json")
    removed = json.loads(out)
    assert removed["removed"] == len(first["orphans"]) and not removed["unindexed"]
    rep = _verifies(capsys, store)
    assert not rep["orphans"] and not rep["unindexed"] and not rep["bad"]
    r = _ask(capsys, store)
    assert r["cache_hits"] == 3 and r["answer"] == baseline_answer["answer"]


def test_verify_on_a_read_only_store_says_read_only(store, baseline_answer):
    """Row 52b: `store verify` on a read-only store (root's permission overrides dropped)
    reports an intact manifest as intact and the store as read-only, not "damaged"; --repair
    is refused in one line; nothing is written."""
    from tests.qc_fixtures import _needs_setpriv, _read_only, _snapshot, _subprocess, _writable

    _needs_setpriv()
    before = _snapshot(store)
    _read_only(store)
    try:
        proc = _subprocess(["store", "verify", "--store", str(store)], drop_caps=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "read-only" in proc.stdout and "damaged" not in proc.stdout and "BAD" not in proc.stdout, proc.stdout
        assert "3 ok, 0 bad" in proc.stdout or "4 ok, 0 bad" in proc.stdout or " ok, 0 bad" in proc.stdout
        proc = _subprocess(["store", "verify", "--store", str(store), "--json"], drop_caps=True)
        rep = json.loads(proc.stdout)
        assert rep["read_only"] and not rep["manifest"]["problem"] and rep["ok"] >= 3 and not rep["unindexed"]
        proc = _subprocess(["store", "verify", "--store", str(store), "--repair"], drop_caps=True)
        assert proc.returncode == 2
        _one_line_error(proc, "read-only")
        proc = _subprocess(["ask", QUESTION, "--store", str(store), *ASK], drop_caps=True)
        assert proc.returncode == 0 and json.loads(proc.stdout)["answer"] == baseline_answer["answer"], proc.stderr
    finally:
        _writable(store)
    assert _snapshot(store) == before


def test_repair_rebuilds_a_deleted_chunk_text_index_from_the_vector_index(store, baseline_answer, capsys):
    """The chunk-text index deleted: verify names it missing (the vector index holds the texts),
    --repair rebuilds it from Chroma's verified copies, and ask finds the chunks again."""
    for suffix in ("", "-wal", "-shm"):
        Path(str(store / "chunk_texts.sqlite") + suffix).unlink(missing_ok=True)
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store))
    assert code == 1 and "chunk-text index" in out and "missing, while the vector index holds 3 texts" in out
    assert "run with --repair to rebuild the chunk-text index" in out
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store), "--repair")
    assert code == 0, out + err
    assert "rebuilt the chunk-text index from the verified texts (3 texts)" in out
    rep = _verifies(capsys, store)
    assert rep["chunk_texts"]["rows"] == 3 and not rep["chunk_texts"]["problem"]
    from qcfuse_core.retrieval.texts import ChunkTextIndex

    index = ChunkTextIndex(store / "chunk_texts.sqlite", read_only=True)
    try:
        assert {p.text.strip() for p in index.find("\n\n".join(FAULT_DOCS.values()))} == {t.strip() for t in FAULT_DOCS.values()}
    finally:
        index.close()
    r = _ask(capsys, store)
    assert r["answer"] == baseline_answer["answer"] and r["cache_hits"] == 3
