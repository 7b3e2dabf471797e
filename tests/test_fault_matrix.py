"""The fault matrix: what a user can do to the store, the disk or the input, one test per row.

Every row ends in one of two ways: the answer is the same as before the fault (the damaged
part is recomputed and counted as a miss), or a one-line `qcfuse: error: ...` that names the
problem and the fix, with a non-zero exit status and no traceback. Either way the store
still verifies afterwards (`qcfuse store verify` exits 0).

    row                                         outcome
    every KV file damaged                       same answer, all misses, rebuilt
    a non-UTF-8 file among good ones            skipped with a warning naming it; --strict: error
    the same chunk twice in one ingest          deduplicated
    read-only store (permissions honoured)      same answer, nothing written (auto read-only)
    read-only kv/manifest.sqlite only           same answer, nothing written
    chunk_texts.sqlite header overwritten       same answer; verify reports it; --repair rebuilds
    chroma/chroma.sqlite3 header overwritten    error naming the fix; --repair rebuilds
    disk full during ingest                     ingest reports what was stored; ask answers
    read-only HOME / cache dir under a file     error naming QCFUSE_CACHE_DIR
    cache dir moved                             every chunk still a hit
    prompt longer than the model's context      CLI drops chunks with a warning; engine refuses
    verify after the manifest was replaced      unindexed entries, never orphans; --repair
    a loader error in one request               the next request answers normally

Read-only rows run as root by dropping the permission-override capabilities with
`setpriv` (skipped only where setpriv is missing). The disk-full row uses a 30 MB tmpfs
where mounting is permitted, else an in-process ENOSPC on the entry writes.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.qc_fixtures import (  # noqa: F401  (fixtures)
    ASK,
    DROP_CAPS,
    FAULT_DOCS,
    QUESTION,
    _ask,
    _cli,
    _flip_bytes,
    _needs_setpriv,
    _one_line_error,
    _overwrite_head,
    _read_only,
    _snapshot,
    _subprocess,
    _try_tmpfs,
    _verifies,
    _writable,
    _write_docs,
    baseline,
    baseline_answer,
    store,
)

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------------- rows


def test_every_kv_file_damaged(store, baseline_answer, capsys):
    files = list((store / "kv").rglob("*.safetensors"))
    assert len(files) >= 6  # entries and sidecars
    for f in files:
        _flip_bytes(f)
    r = _ask(capsys, store)
    assert r["answer"] == baseline_answer["answer"]
    assert r["cache_misses"] == 3 and r["cache_hits"] == 0
    _verifies(capsys, store)
    again = _ask(capsys, store)  # rebuilt: hits again
    assert again["cache_hits"] == 3 and again["answer"] == baseline_answer["answer"]


def test_non_utf8_file_is_skipped(tmp_path, capsys):
    docs = _write_docs(tmp_path / "docs")
    bad = docs / "latin1.md"
    bad.write_bytes("caf\xe9 au lait is coffee with hot milk, served in a bowl in the morning.\n".encode("latin-1"))
    store = tmp_path / "store"
    code, out, err = _cli(capsys, "ingest", str(docs), "--store", str(store))
    assert code == 0, err
    assert f"qcfuse: warning: {bad} is not UTF-8 text (skipped)" in err
    assert "ingested 3 chunks" in out and "skipped 1 file" in out
    _verifies(capsys, store)
    code, out, err = _cli(capsys, "ingest", str(docs), "--store", str(tmp_path / "strict"), "--strict")
    assert code != 0
    _one_line_error(err, f"{bad} is not UTF-8 text")


@pytest.mark.parametrize("how", ["file twice", "folder and a file in it", "identical files", "repeated paragraph"])
def test_duplicate_chunks_in_one_ingest(tmp_path, capsys, how):
    docs = _write_docs(tmp_path / "docs")
    one = docs / "harbour.md"
    if how == "file twice":
        paths = [one, one]
    elif how == "folder and a file in it":
        paths = [docs, one]
    elif how == "identical files":
        for sub in ("a", "b"):
            (docs / sub).mkdir()
            shutil.copy(one, docs / sub / "harbour.md")
        paths = [docs]
    else:
        para = FAULT_DOCS["harbour.md"]
        (docs / "repeat.md").write_text(f"{para}\n\n{'x' * 1100}\n\n{para}\n")
        paths = [docs / "repeat.md"]
    store = tmp_path / "store"
    code, out, err = _cli(capsys, "ingest", *map(str, paths), "--store", str(store), "--chunk-chars", "1200")
    assert code == 0, err
    assert "Traceback" not in err
    _verifies(capsys, store)
    from qcfuse_core.retrieval.chroma import open_collection

    ids = open_collection(store / "chroma").get(include=[])["ids"]
    assert len(ids) == len(set(ids)) > 0



def test_read_only_store(store, baseline_answer, capsys):
    _needs_setpriv()
    for f in (store / "kv").rglob("*.sidecar.safetensors"):  # one damaged part: computed, not stored
        _flip_bytes(f)
        break
    docs = _write_docs(store.parent / "docs", {"new.md": "A new note about the Veyla ferry timetable."})
    before = _snapshot(store)
    _read_only(store)
    try:
        proc = _subprocess(["ask", QUESTION, "--store", str(store), *ASK], drop_caps=True)
        assert proc.returncode == 0, proc.stderr
        assert "Traceback" not in proc.stderr
        assert "read-only" in proc.stderr
        r = json.loads(proc.stdout)
        assert r["answer"] == baseline_answer["answer"]
        proc = _subprocess(["ingest", str(docs), "--store", str(store)], drop_caps=True)
        assert proc.returncode != 0
        _one_line_error(proc, "read-only")
    finally:
        _writable(store)
    assert _snapshot(store) == before  # nothing written, moved or deleted
    assert not list(store.rglob("*.bad-*"))
    # the flag, on a writable store: the same, in this process
    for f in (store / "kv").rglob("*.safetensors"):
        _flip_bytes(f)
        break
    before = _snapshot(store, shm=False)
    r = _ask(capsys, store, QUESTION, "--read-only")
    assert r["answer"] == baseline_answer["answer"]
    assert _snapshot(store, shm=False) == before


def test_read_only_manifest_only(store, baseline_answer, capsys):
    _needs_setpriv()
    manifest = store / "kv" / "manifest.sqlite"
    manifest.chmod(0o444)
    try:
        proc = _subprocess(["ask", QUESTION, "--store", str(store), *ASK], drop_caps=True)
    finally:
        manifest.chmod(0o644)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "read-only" in proc.stderr
    assert json.loads(proc.stdout)["answer"] == baseline_answer["answer"]
    _verifies(capsys, store)



def test_chunk_text_index_damaged(store, baseline_answer, capsys):
    _overwrite_head(store / "chunk_texts.sqlite")
    assert _ask(capsys, store)["answer"] == baseline_answer["answer"]
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store))
    assert code == 1 and "chunk-text index" in out and "--repair" in out
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store), "--repair")
    assert code == 0, out + err
    rep = _verifies(capsys, store)
    assert rep["chunk_texts"]["rows"] == 3


def test_chroma_damaged(store, baseline_answer, capsys):
    _overwrite_head(store / "chroma" / "chroma.sqlite3")
    code, out, err = _cli(capsys, "ask", QUESTION, "--store", str(store), *ASK)
    assert code == 2
    _one_line_error(err, "--repair")
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store))
    assert code == 1 and "vector index" in out
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store), "--repair")
    assert code == 0, out + err
    _verifies(capsys, store)
    assert _ask(capsys, store)["answer"] == baseline_answer["answer"]



def test_disk_full(tmp_path, capsys, monkeypatch):
    docs = tmp_path / "docs"
    many = {f"note-{i:03d}.md": f"Note {i}: the tide gauge number {i} on Veyla recorded {i * 7 % 31} "
                                f"centimetres above the mean on the morning of day {i}. " * 2
            for i in range(200)}
    many.update(FAULT_DOCS)
    _write_docs(docs, many)
    mnt = tmp_path / "small-disk"
    real = _try_tmpfs(mnt, "30m")
    # the disk tier is bounded by default (half the disk's room: store/sizing.py), which keeps
    # an ingest off a full disk; a disk that fills all the same (a limit set past it, other
    # files written meanwhile) is this row: the tier unbounded here
    import qcfuse_core.store.tiered as tiered

    monkeypatch.setattr(tiered, "disk_tier_bytes", lambda root, held, *a, **k: None)
    try:
        if not real:  # no mount privileges: every entry write fails as a full disk would
            import qcfuse_core.store.atomic as atomic

            orig, calls = atomic.write_all, {"n": 0}

            def full_after_20(fd, buffers):
                calls["n"] += 1
                if calls["n"] > 20:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return orig(fd, buffers)

            monkeypatch.setattr(atomic, "write_all", full_after_20)
        store = mnt / "store"
        code, out, err = _cli(capsys, "ingest", str(docs), "--store", str(store))
        assert code == 0, err
        assert "Traceback" not in err and "disk full" in (out + err)
        assert "ingested 203 chunks" in out and "203 new in Chroma" in out
        import re

        built = int(re.search(r"(\d+) caches built", out).group(1))
        not_stored = int(re.search(r"(\d+) chunk caches were not stored", err).group(1))
        assert built + not_stored == 203 and 0 < built < 203
        r = _ask(capsys, store)
        assert r["answer"]
        code, out, err = _cli(capsys, "store", "verify", "--store", str(store), "--json")
        assert "Traceback" not in err and not json.loads(out)["bad"]
        monkeypatch.undo()
        code, out, err = _cli(capsys, "store", "verify", "--store", str(store))
        assert code == 0, out + err
    finally:
        if real:
            import gc

            from chromadb.api.client import SharedSystemClient

            SharedSystemClient.clear_system_cache()  # Chroma holds its files open
            gc.collect()
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(mnt)], check=False)  # detach; freed once closed


def test_unusable_cache_dir(tmp_path, baseline):
    _needs_setpriv()
    store, _ = baseline
    home = tmp_path / "ro-home"
    home.mkdir()
    home.chmod(0o555)
    env = {k: v for k, v in os.environ.items() if k != "QCFUSE_CACHE_DIR"}
    env["HOME"] = str(home)
    proc = subprocess.run(DROP_CAPS + [sys.executable, "-m", "qcfuse_core.cli.commands", "ask", QUESTION, "--store",
                                       str(store), *ASK], capture_output=True, text=True, env=env, timeout=1800)
    assert proc.returncode != 0
    _one_line_error(proc, "QCFUSE_CACHE_DIR")
    plain = tmp_path / "plain-file"
    plain.write_text("not a folder")
    proc = _subprocess(["ask", QUESTION, "--store", str(store), *ASK],
                       env={"QCFUSE_CACHE_DIR": str(plain / "cache")})
    assert proc.returncode != 0
    _one_line_error(proc, "QCFUSE_CACHE_DIR")


def test_cache_dir_moved(tmp_path, capsys, monkeypatch):
    from qcfuse_core.engine import api as engine_mod
    from qcfuse_core.model.adapter import default_model_dir

    src = default_model_dir()
    a = tmp_path / "cache-a"
    (a / "models" / src.name).mkdir(parents=True)
    for f in src.iterdir():
        try:
            os.link(f, a / "models" / src.name / f.name)
        except OSError:
            shutil.copy2(f, a / "models" / src.name / f.name)
    docs = _write_docs(tmp_path / "docs")
    monkeypatch.setattr(engine_mod, "_ADAPTERS", {})
    monkeypatch.setenv("QCFUSE_CACHE_DIR", str(a))
    code, out, err = _cli(capsys, "ingest", str(docs))  # default store: <cache dir>/store
    assert code == 0, err
    assert (a / "store" / "kv").is_dir()
    b = tmp_path / "cache-b"
    a.rename(b)
    monkeypatch.setattr(engine_mod, "_ADAPTERS", {})
    monkeypatch.setenv("QCFUSE_CACHE_DIR", str(b))
    code, out, err = _cli(capsys, "ask", QUESTION, *ASK)
    assert code == 0, err
    r = json.loads(out)
    assert r["cache_hits"] == 3 and r["cache_misses"] == 0
    _verifies(capsys, b / "store")


def test_prompt_longer_than_the_context(tmp_path, capsys):
    long_docs = {f"part-{i:02d}.md": (f"Section {i} of the Veyla chronicle. " + "The wind blew over the cape. " * 40)
                 for i in range(14)}  # ~14 x 330 tokens > 4,096
    long_docs.update(FAULT_DOCS)
    docs = _write_docs(tmp_path / "docs", long_docs)
    store = tmp_path / "store"
    assert _cli(capsys, "ingest", str(docs), "--store", str(store))[0] == 0
    from qcfuse_core.engine.api import open_engine

    engine = open_engine(store)
    limit = engine.adapter.max_positions
    code, out, err = _cli(capsys, "ask", QUESTION, "--store", str(store), "--top-k", "1000", "--max-new-tokens", "4",
                          "--json", "--max-context", "4096")
    assert code == 0, err
    assert "qcfuse: warning: dropped" in err and "4,096" in err
    r = json.loads(out)
    assert r["prompt_tokens"] + 4 <= 4096
    # a question longer than the whole context: a clear error
    code, out, err = _cli(capsys, "ask", "why? " * 10_000, "--store", str(store), "--max-new-tokens", "4")
    assert code == 2
    _one_line_error(err, f"{limit:,}")
    # the engine refuses instead of answering garbage
    texts = [t for t in long_docs.values()] * 3
    with pytest.raises(ValueError, match=f"the model takes {limit:,}"):
        engine.answer(QUESTION, texts * (limit // 4000 + 1), max_new_tokens=4)
    _verifies(capsys, store)


def test_verify_after_manifest_replaced(store, baseline_answer, capsys):
    manifest = store / "kv" / "manifest.sqlite"
    for suffix in ("", "-wal", "-shm"):
        Path(str(manifest) + suffix).unlink(missing_ok=True)
    from qcfuse_core.store.manifest import Manifest

    Manifest(manifest).close()  # an empty one in its place
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store), "--json", "--grace-s", "0")
    rep = json.loads(out)
    assert code == 1 and rep["orphans"] == [] and len(rep["unindexed"]) >= 6
    files = _snapshot(store / "kv" / "data")
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store), "--remove", "--grace-s", "0")
    assert _snapshot(store / "kv" / "data") == files  # --remove never deletes a file that verifies
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store), "--repair")
    assert code == 0, out + err
    rep = _verifies(capsys, store)
    assert rep["ok"] >= 4 and not rep["unindexed"]
    r = _ask(capsys, store)
    assert r["cache_hits"] == 3 and r["answer"] == baseline_answer["answer"]


def test_loader_error_in_one_request(baseline, baseline_answer, monkeypatch):
    from qcfuse_core.engine.api import open_engine

    store, _ = baseline
    engine = open_engine(store)
    from qcfuse_core.cli.commands import _collection, retrieve

    ids, docs = retrieve(_collection(store), QUESTION, 3)
    disk = engine.caches.store.disk
    real = disk.read_layers_into
    state = {"fail": True}

    def flaky(jobs):
        if state["fail"]:
            state["fail"] = False
            raise OSError(errno.EIO, "Input/output error")
        return real(jobs)

    for t in engine.caches.store.memory_tiers:  # every chunk from disk, so the loader reads
        t.clear()
    monkeypatch.setattr(disk, "read_layers_into", flaky)
    try:
        engine.answer(QUESTION, docs, node_ids=ids, method="qcfuse", max_new_tokens=8)
    except Exception as e:  # the failed request may raise; it must not poison the next one
        assert "Input/output" in str(e) or "prefetch" in str(e)
    assert not state["fail"], "the loader never read from disk: the fault was not injected"
    for t in engine.caches.store.memory_tiers:
        t.clear()
    r = engine.answer(QUESTION, docs, node_ids=ids, method="qcfuse", max_new_tokens=8)
    assert r.text == baseline_answer["answer"]
