"""The vector index's files checked without opening them, and stored texts by their hash
(CPU, random vectors: no embedding model)."""

from __future__ import annotations

import shutil
import sqlite3
import struct
from pathlib import Path

import numpy as np
import pytest

from qcfuse_core.retrieval import vector_index as vi
from qcfuse_core.store import StoreError

N = 1500  # past Chroma's sync threshold (1000): the graph is written to disk


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory) -> Path:
    from chromadb.api.client import SharedSystemClient

    from qcfuse_core.retrieval.chroma import open_collection

    path = tmp_path_factory.mktemp("vi") / "chroma"
    col = open_collection(path)
    rng = np.random.default_rng(0)
    for i in range(0, N, 500):
        ids = [f"id{j:05d}" for j in range(i, i + 500)]
        docs = [f"chunk {j} of the test index" for j in range(i, i + 500)]
        col.add(
            ids=ids,
            documents=docs,
            embeddings=rng.standard_normal((500, 384)).astype(np.float32),
            metadatas=[{"source": "t", vi.SHA_KEY: vi.text_sha256(d)} for d in docs],
        )
    del col
    SharedSystemClient.clear_system_cache()
    assert vi.persisted_graph(path)
    return path


@pytest.fixture
def copy(index_dir, tmp_path) -> Path:
    dst = tmp_path / "chroma"
    shutil.copytree(index_dir, dst)
    return dst


def _graph(path: Path) -> Path:
    return next(p.parent for p in path.glob("*/data_level0.bin"))


def test_an_intact_index_passes_every_check(index_dir):
    assert vi.quick_problem(index_dir) == ""
    assert vi.probe(index_dir) == ""
    docs = list(vi.documents(index_dir))
    assert len(docs) == N and all(d.ok for d in docs)


def test_a_link_past_the_last_element_is_found_before_chroma_opens_it(copy):
    from qcfuse_core.retrieval.chroma import open_collection

    folder = _graph(copy)
    h = vi._HEADER.unpack((folder / "header.bin").read_bytes())
    size = h[4]
    data = bytearray((folder / "data_level0.bin").read_bytes())
    i = next(i for i in range(h[3]) if struct.unpack_from("<H", data, i * size)[0])
    data[i * size + 4 + 3] ^= 0x40  # bit 30 of its first link
    (folder / "data_level0.bin").write_bytes(bytes(data))
    assert "a link names no element" in vi.quick_problem(copy)
    with pytest.raises(StoreError, match="HNSW files are damaged.*store verify --repair"):
        open_collection(copy)


@pytest.mark.parametrize(
    "where, needle",
    [
        ("vector", "not of unit length"),
        ("count", "link count exceeds"),
        ("header", "header.bin"),
        ("length", "length.bin"),
        ("links", "link_lists.bin"),
    ],
)
def test_each_kind_of_damage_is_named(copy, where, needle):
    folder = _graph(copy)
    h = vi._HEADER.unpack((folder / "header.bin").read_bytes())
    size, off_data = h[4], h[6]
    if where == "header":
        (folder / "header.bin").write_bytes((folder / "header.bin").read_bytes()[:60])
    elif where == "length":
        (folder / "length.bin").write_bytes(b"\0" * 8)
    elif where == "links":
        (folder / "link_lists.bin").write_bytes((folder / "link_lists.bin").read_bytes()[:-3])
    else:
        data = bytearray((folder / "data_level0.bin").read_bytes())
        if where == "vector":
            data[7 * size + off_data + 4 * 10 + 3] ^= 0x40  # an exponent bit of element 7's 11th value
        else:
            struct.pack_into("<H", data, 7 * size, 999)  # element 7's link count
        (folder / "data_level0.bin").write_bytes(bytes(data))
    assert needle in vi.quick_problem(copy)


def test_a_lost_graph_is_a_coverage_problem_and_fails_the_probe(copy):
    import re

    shutil.rmtree(_graph(copy))
    m = re.fullmatch(rf"its graph lacks (\d+) of its {N} chunks \(HNSW files lost or stale\)", vi.quick_problem(copy))
    assert m and 0 < int(m.group(1)) < N  # the write log still holds the last additions
    assert vi.probe(copy) != ""


def test_an_edited_document_fails_its_hash(copy):
    db = sqlite3.connect(copy / vi.CHROMA_DB)
    db.execute(
        "UPDATE embedding_metadata SET string_value = 'chunk 7 of the test INDEX' "
        "WHERE key = 'chroma:document' AND string_value = 'chunk 7 of the test index'"
    )
    db.commit()
    db.close()
    bad = [d.id for d in vi.documents(copy) if not d.ok]
    assert bad == ["id00007"]


def test_document_ok_without_a_stored_hash_checks_the_id():
    from qcfuse_core.types import chunk_id

    text = "The harbour of Veyla was built in 1911."
    assert vi.document_ok(chunk_id("a.md", text), text, {"source": "a.md"})
    assert not vi.document_ok(chunk_id("a.md", text), text.replace("1911", "1971"), {"source": "a.md"})
    assert not vi.document_ok("x", None, {})
    assert not vi.document_ok("x", "caf\udce9", {vi.SHA_KEY: "0"})


def test_chunk_text_rows_that_fail_their_hash_are_never_served(tmp_path, caplog):
    from qcfuse_core.retrieval.texts import ChunkTextIndex

    path = tmp_path / "texts.sqlite"
    index = ChunkTextIndex(path)
    good, bad = (
        "A text about the harbour of Veyla and its breakwater.",
        "A text about the Grey Heron ferry and its crossing.",
    )
    index.add(good, "g")
    index.add(bad, "b")
    index._db.execute("UPDATE chunk_text SET text = ? WHERE node_id = 'b'", (bad.replace("Grey", "Gray"),))
    index._db.commit()
    prompt = f"{good}\n{bad}\n{bad.replace('Grey', 'Gray')}"
    assert [p.node_id for p in index.find(prompt)] == ["g"]
    assert index.damaged == 1 and "do not match their content hash" in caplog.text
    assert [r[1] for r in index.verified_rows()] == ["g"]
    index.close()


def test_a_full_disk_when_chroma_opens_is_not_called_damage(tmp_path, monkeypatch):
    from chromadb.errors import InternalError

    import qcfuse_core.retrieval.chroma as chroma
    from qcfuse_core.cli import commands as cli

    def full(path, name="qcfuse"):
        raise InternalError("error returned from database: (code: 13) database or disk is full")

    monkeypatch.setattr(chroma, "open_collection", full)
    with pytest.raises(StoreError, match="is full and Chroma writes when it opens.*free space first .`qcfuse ask` reads it without writing"):
        cli._collection(tmp_path / "store")


def test_a_store_without_a_vector_index_is_noted_one_that_lost_it_is_bad(tmp_path):
    """Texts registered without a vector index (`qcfuse serve`'s /v1/chunks) are not damage:
    verify notes the absence. Once a vector index was opened under the root (the marker), its
    absence is a loss, which --repair rebuilds."""
    from qcfuse_core.retrieval import indexes
    from qcfuse_core.retrieval.chroma import open_collection
    from qcfuse_core.retrieval.texts import ChunkTextIndex

    idx = ChunkTextIndex(tmp_path / indexes.CHUNK_TEXTS)
    for i in range(3):
        idx.add(f"a chunk of text long enough to be indexed, number {i}", f"node-{i}")
    idx.close()
    rep = indexes.check(tmp_path, probe=False)
    assert not rep.bad and not rep.chroma.present
    assert any(n.startswith("no vector index: the 3 texts") for n in rep.notes)
    assert not (tmp_path / indexes.VECTOR_MARKER).exists()  # checking never writes

    del idx
    open_collection(tmp_path / indexes.CHROMA)  # a vector index was made here: now it is expected
    assert (tmp_path / indexes.VECTOR_MARKER).exists()
    from chromadb.api.client import SharedSystemClient

    SharedSystemClient.clear_system_cache()
    shutil.rmtree(tmp_path / indexes.CHROMA)
    rep = indexes.check(tmp_path, probe=False)
    assert rep.bad == [
        "vector index: missing, while the chunk-text index holds 3 texts (the vector index is rebuilt from them)"
    ]
    assert not any(n.startswith("no vector index") for n in rep.notes)
