"""End to end through the engine: damaged caches are recomputed and the answer is unchanged;
a full disk still answers."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from store_fixtures import entry_file, store_at

import qcfuse_core.store.atomic as atomic
from qcfuse_core.engine.api import EngineConfig, QCFuseEngine
from qcfuse_core.model.testing import tiny_model

DOCS = ["The castle of Aldermoor was built in 1204 by the river.",
        "Its first keeper was a miller named Oswin Brook.",
        "The castle burned in 1391 and was never rebuilt."]
QUESTION = "Who kept the castle?"


class ByteTokenizer:
    """Bytes as token ids (the tiny models have a 256-token vocabulary)."""

    eos_token_id = None
    chat_template = None

    class _Enc:
        def __init__(self, ids):
            self.input_ids = ids

    def __call__(self, text, add_special_tokens=False):
        return self._Enc(list(text.encode()))

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")

    def get_vocab(self):
        return {chr(i): i for i in range(256)}


@pytest.fixture(scope="module")
def adapter():
    m = tiny_model("llama")
    m.tokenizer = ByteTokenizer()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # toy matmuls: threads only add overhead on a shared machine
    yield m
    torch.set_num_threads(threads)


def _engine(adapter, root):
    return QCFuseEngine(adapter, store=store_at(root), config=EngineConfig(method="naive"))


def _answer(engine):
    return engine.answer(QUESTION, DOCS, method="naive", max_new_tokens=6)


def test_damaged_caches_are_recomputed_same_answer(tmp_path, adapter):
    eng = _engine(adapter, tmp_path)
    for i, d in enumerate(DOCS):
        eng.build_chunks([d], [f"doc-{i}"])
    before = _answer(eng)
    assert before.cache_hits == 3 and before.cache_misses == 0 and before.token_ids
    paths = [entry_file(eng.caches.store, eng.caches.store.resolve(f"doc-{i}")) for i in range(3)]
    eng.caches.store.close()
    with open(paths[0], "r+b") as f:  # bit rot in the middle
        f.seek(os.path.getsize(paths[0]) // 2)
        f.write(b"\xff\xfe\xfd\xfc")
    os.truncate(paths[1], os.path.getsize(paths[1]) // 3)  # torn file
    paths[2].unlink()  # lost file

    eng = _engine(adapter, tmp_path)  # a restart: cold memory tiers
    after = _answer(eng)
    assert after.token_ids == before.token_ids and after.text == before.text
    assert after.cache_misses == 3 and after.cache_hits == 0
    assert after.store_stats["corrupt"] == 3
    again = _answer(eng)  # recomputed caches were written back
    assert again.cache_misses == 0 and again.token_ids == before.token_ids
    eng.caches.store.close()
    eng = _engine(adapter, tmp_path)
    assert _answer(eng).cache_hits == 3
    eng.caches.store.close()


def test_disk_full_still_answers(tmp_path, adapter, monkeypatch):
    eng = _engine(adapter, tmp_path)
    reference = _answer(eng)
    eng.caches.store.close()

    def full(fd, buffers):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic, "write_all", full)
    eng = _engine(adapter, tmp_path / "other")  # empty store on a "full" disk
    first = _answer(eng)
    assert first.token_ids == reference.token_ids and first.cache_misses == 3
    assert first.store_stats["degraded"] and first.store_stats["write_failures"] >= 3
    second = _answer(eng)  # served from the host tier
    assert second.token_ids == reference.token_ids and second.cache_hits == 3
    eng.caches.store.close()
