"""The model fingerprint: the model's content, never the folder it was loaded from."""

from __future__ import annotations

import os

import pytest

from qcfuse_core.model import fingerprint as fp_mod
from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.model.testing import tiny_model


@pytest.fixture
def saved(tmp_path, monkeypatch):
    monkeypatch.setenv("QCFUSE_CACHE_DIR", str(tmp_path / "cache"))
    adapter = tiny_model("llama")
    folder = tmp_path / "a" / "tiny"
    adapter.model.save_pretrained(folder)
    return adapter, folder


def test_moved_folder_keeps_the_fingerprint(saved, tmp_path):
    adapter, folder = saved
    d1 = fp_mod.weights_digest(folder)
    adapter.model.config._name_or_path = str(folder)
    f1 = ModelAdapter(adapter.model, name="tiny", weights_digest=d1).fingerprint()
    moved = tmp_path / "b" / "elsewhere"
    moved.parent.mkdir()
    folder.rename(moved)
    d2 = fp_mod.weights_digest(moved)
    adapter.model.config._name_or_path = str(moved)
    assert d2 == d1
    assert ModelAdapter(adapter.model, name="tiny", weights_digest=d2).fingerprint() == f1


def test_hash_is_computed_once_per_file(saved, monkeypatch):
    _, folder = saved
    calls = []
    real = fp_mod.hash_file
    monkeypatch.setattr(fp_mod, "hash_file", lambda p: calls.append(p) or real(p))
    d = fp_mod.weights_digest(folder)
    assert len(calls) == len(fp_mod.weight_files(folder)) >= 1
    assert fp_mod.weights_digest(folder) == d and len(calls) == len(fp_mod.weight_files(folder))  # cached


def test_changed_weights_change_the_fingerprint(saved):
    _, folder = saved
    d = fp_mod.weights_digest(folder)
    f = fp_mod.weight_files(folder)[0]
    st = f.stat()
    b = bytearray(f.read_bytes())
    b[-1] ^= 0x01  # same size
    f.write_bytes(bytes(b))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert fp_mod.weights_digest(folder) != d


def test_unwritable_cache_dir_only_costs_a_rehash(saved, monkeypatch, tmp_path):
    _, folder = saved
    blocker = tmp_path / "plain-file"
    blocker.write_text("x")
    monkeypatch.setenv("QCFUSE_CACHE_DIR", str(blocker / "cache"))
    assert fp_mod.weights_digest(folder) == fp_mod.weights_digest(folder)
