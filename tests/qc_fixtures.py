"""Helpers and fixtures the test modules share (import them from here, never from another
test module):

- toy prompts for the selection and fusion tests on a tiny random model: caches built alone
  (`chunk_alone`: one chunk's, as an engine builds it; `prompt_of`, `prompt_alone`) or exact
  (`prompt_exact`); `hold_worker`, which holds an engine's scheduler inside its next request;
  `engine_config`, an EngineConfig from the fields a test varies;
- the kernel tests' tolerances, skips and backend fixture;
- `qcfuse serve` on a tiny model (`tiny`, `_engine`, `LiveServer`, response checks);
- `qcfuse store` and store fixtures (`_run`, `_fill`, `_store`, `adapter`);
- the fault matrices' documents, CLI runners and baseline store fixtures.

A fixture defined here is a fixture of each module that imports it (module-scoped ones are
built once per such module)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch
from store_fixtures import make_chunk, store_at

from qcfuse_core import CacheConfig, EngineConfig, FrameConfig, SchedulerConfig
from qcfuse_core.cli.commands import main as cli_main
from qcfuse_core.cli.store import main as store_main
from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.model.fusion import FusedPrompt, KVCache, Segment, fill_from_hf, fused_prefill
from qcfuse_core.model.testing import tiny_model
from qcfuse_core.store import MemoryStore, kv_dir, open_store
from qcfuse_core.types import ChunkKey, KVChunk
from qcfuse_kernels import ops

# A whole tiny model through each backend: the PyTorch references in the fast tier, Triton's
# interpreter in the slow tier (40-80x slower on a CPU). Each kernel is compared with its
# reference on tiny shapes in the fast tier (test_kernels*.py, test_graph_decode.py).
WHOLE_MODEL_BACKENDS = [
    pytest.param("reference", id="ref"),
    pytest.param("interpreter", id="interp", marks=[pytest.mark.kernels, pytest.mark.slow]),
]

KINDS = ["prefix", "chunk", "text", "chunk", "chunk", "suffix"]
LENS = [6, 20, 2, 24, 16, 7]


def parts(adapter: ModelAdapter, lens=LENS, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, adapter.shape.vocab_size, (n,), generator=g) for n in lens]


def chunk_alone(engine: QCFuseEngine, ids: torch.Tensor) -> KVChunk:
    """The cache of a chunk's exact tokens as `engine` builds it (alone at positions 0..n-1,
    with its anchors), built and stored now."""
    key = ChunkKey.for_tokens(engine.caches.fingerprint, ids)
    return engine.builder.build({key: ids}, keep=True)[key]


def prompt_of(adapter: ModelAdapter, parts: list[torch.Tensor], kinds: list[str]) -> FusedPrompt:
    """Prefix and chunks cached alone (positions 0..n-1); glue and suffix uncached."""
    eng = QCFuseEngine(adapter)
    segs = []
    for ids, kind in zip(parts, kinds):
        if kind in ("prefix", "chunk"):
            segs.append(Segment(kind, ids, chunk_alone(eng, ids)))
        else:
            segs.append(Segment(kind, ids))
    return FusedPrompt(segs)


def prompt_alone(adapter: ModelAdapter, lens=LENS, kinds=KINDS, seed: int = 0) -> FusedPrompt:
    """`prompt_of` the parts of `lens` drawn from `seed`."""
    return prompt_of(adapter, parts(adapter, lens, seed), kinds)


def report(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"max abs err {(a - b).abs().max().item():.3e}"


def prompt_exact(adapter: ModelAdapter, lens=LENS, kinds=KINDS, seed: int = 0) -> tuple[FusedPrompt, KVCache]:
    """Every cached segment holds its true in-context K/V (from a full prefill); also the
    full prefill's rotated cache (L, T, Hkv, D)."""
    ids = parts(adapter, lens, seed)
    whole = FusedPrompt([Segment("suffix", torch.cat(ids))])
    T = whole.num_tokens
    cache = KVCache(adapter, T)
    out = fused_prefill(adapter, whole, torch.arange(T), kv_out=cache, capture_pre_rope=True)
    segs, pos = [], 0
    fp = "0" * 16
    for x, kind in zip(ids, kinds):
        n = len(x)
        if kind in ("prefix", "chunk"):
            k = out.k_pre[:, pos : pos + n].clone()
            v = cache.v[:, pos : pos + n].clone()
            segs.append(Segment(kind, x, KVChunk(ChunkKey.for_tokens(fp, x), x, k, v)))
        else:
            segs.append(Segment(kind, x))
        pos += n
    return FusedPrompt(segs), cache


def hold_worker(engine: QCFuseEngine, timeout: float = 30.0) -> threading.Event:
    """Hold `engine`'s scheduler worker inside the next request it admits, at the start of its
    lookup (the request counts as running), until the returned gate is set: requests
    submitted meanwhile wait in the queue, and the step that goes on admits them too. The
    requests themselves stay data; only the engine's chunk lookup is wrapped, once."""
    gate = threading.Event()
    lookup = engine.lookup
    real = lookup.find

    def find(*args, **kwargs):
        del lookup.find  # only this one lookup waits
        gate.wait(timeout)
        return real(*args, **kwargs)

    lookup.find = find  # type: ignore[method-assign]
    return gate


def engine_config(**kw: Any) -> EngineConfig:
    """An EngineConfig from keywords naming fields of it or of its sub-configs (frame,
    scheduler, cache): `engine_config(max_running=1, kv_cache_bytes=4096)`."""
    parts = {"frame": FrameConfig, "scheduler": SchedulerConfig, "cache": CacheConfig}
    sub = {name: {f.name: kw.pop(f.name) for f in fields(kind) if f.name in kw} for name, kind in parts.items()}
    return EngineConfig(**kw, **{name: parts[name](**given) for name, given in sub.items() if given})


# ------------------------------------- kernels (test_kernels*.py, test_graph_decode.py, test_decode_step.py)


TOL = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _triton_mode():
    return ops._triton_mode()


needs_interpreter = pytest.mark.skipif(
    _triton_mode() != "interpreted",
    reason="Triton interpreter not active (needs triton and TRITON_INTERPRET=1 before its import)",
)


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or _triton_mode() != "compiled",
    reason="needs CUDA and compiled triton (run with TRITON_INTERPRET=0 on a GPU host)",
)


@pytest.fixture
def use_backend(request):
    """Force a backend for one test, restore auto-detection afterwards."""
    ops.set_backend(request.param)
    yield request.param
    ops.set_backend(None)


def assert_close(out, expected, atol, rtol, what):
    out, expected = out.float(), expected.float()
    err = (out - expected).abs()
    bound = atol + rtol * expected.abs()
    worst = (err - bound).max().item()
    assert out.shape == expected.shape, f"{what}: shape {tuple(out.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    assert worst <= 0, f"{what}: max abs err {err.max().item():.3e} exceeds atol {atol} + rtol {rtol} * |ref|"


def _caches(adapter, lengths, room, seed=1):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        _, kv = adapter.hf_forward(torch.randint(0, 256, (n,), generator=gen).to(adapter.device))
        c = KVCache(adapter, n + room)
        fill_from_hf(c, kv)
        out.append(c)
    return out


def _copy(cache):
    out = KVCache.__new__(KVCache)
    out.k, out.v, out.length = cache.k.clone(), cache.v.clone(), cache.length
    return out


# ----------------------------------------------------------------------- serve (test_serve*.py)


TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


SERVE_DOCS = [f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(10)) for i in range(4)]


@pytest.fixture(scope="module")
def tiny():
    adapter = tiny_model("llama", tokenizer=True)
    adapter.tokenizer.chat_template = TEMPLATE
    return adapter


def _engine(tiny, **cfg) -> QCFuseEngine:
    eng = QCFuseEngine(tiny, store=MemoryStore(), config=engine_config(**cfg))
    eng.build_chunks(SERVE_DOCS, [f"doc-{i}" for i in range(len(SERVE_DOCS))])
    return eng


def ledger(i: int, topic: str = "harbour") -> str:
    """A context paragraph of its own (~110 characters, so about as many tokens): the learned-chunk tests'."""
    return f"Ledger {i} of the {topic}: {i * 7} barrels of salt herring, {i * 3 + 1} casks of tar and {i % 5} bells."


def docs_engine(adapter: ModelAdapter, docs, store=None, **cfg) -> QCFuseEngine:
    """An engine over `adapter` (a MemoryStore unless given) with `docs` ingested, its config
    from `engine_config(**cfg)`."""
    eng = QCFuseEngine(adapter, store=store if store is not None else MemoryStore(), config=engine_config(**cfg))
    eng.build_chunks(docs)
    return eng


def _prompt(question: str = "Which document mentions word1x3?", docs=(SERVE_DOCS[0], SERVE_DOCS[1])) -> str:
    return "Context:\n" + "\n\n".join(docs) + f"\n\nQuestion: {question}"


def _sse(lines) -> list[dict | str]:
    out: list[dict | str] = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _error(res, status: int, *words: str) -> dict:
    assert res.status_code == status, (res.status_code, res.text)
    err = res.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["code"], str), err  # one shape: a string code on every route (issue 66)
    for w in words:
        assert w in err["message"], err
    return err


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def _wait(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


class LiveServer:
    """uvicorn on 127.0.0.1 (a free port) in a thread; stopped by `close`."""

    def __init__(self, app) -> None:
        import uvicorn  # here, not at the top: the GPU image has no server packages, and its tests import this module

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        _wait(lambda: self.server.started, 30)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


# ---------------------- the store (test_store_cli.py, test_serve_learned.py, test_prefetch*.py)


def _fill(root, n=4, **kw):
    chunks = [make_chunk(i, **kw) for i in range(n)]
    with store_at(kv_dir(root)) as s:
        for i, c in enumerate(chunks):
            s.put(c)
            s.link(f"node-{i}", c.key)
    return chunks


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = store_main(["store", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def adapter():
    return tiny_model("llama")


def _store(tmp_path, tier: str):
    st = open_store(tmp_path / tier, memory_bytes=(64 << 20) if tier == "host" else 0, gpu_bytes=0, use_cuda=False)
    assert st.gpu is None
    return st


# --------------------------------------------------- the fault matrices (test_fault_matrix*.py)


QUESTION = "Who built the harbour of Veyla?"


FAULT_DOCS = {
    "harbour.md": "The harbour of Veyla was built in 1911 by the engineer Maren Dahl, who also "
                  "designed the lighthouse at the northern cape of the island.",
    "bakery.md": "The bakery on Veyla's main square sells cardamom buns every morning from six "
                 "o'clock, baked by Ole Brandt in a wood-fired oven.",
    "ferry.md": "A ferry connects Veyla with the mainland twice a day; the crossing takes forty "
                "minutes and the boat is called the Grey Heron.",
}


ASK = ["--mode", "qcfuse", "--top-k", "3", "--max-new-tokens", "8", "--json"]


SETPRIV = shutil.which("setpriv")


DROP_CAPS = [SETPRIV or "setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner",
             "--inh-caps=-all", "--"]


def _write_docs(folder: Path, docs: dict[str, str] = FAULT_DOCS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in docs.items():
        (folder / name).write_text(text + "\n")
    return folder


def _cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = cli_main(list(argv))
    except SystemExit as e:  # argparse
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _ask(capsys, store: Path, question: str = QUESTION, *extra) -> dict:
    code, out, err = _cli(capsys, "ask", question, "--store", str(store), *ASK, *extra)
    assert code == 0, err
    assert "Traceback" not in err
    return json.loads(out)


def _verifies(capsys, store: Path) -> dict:
    code, out, err = _cli(capsys, "store", "verify", "--store", str(store), "--json")
    assert code == 0, out + err
    return json.loads(out)


def _subprocess(argv: list[str], *, drop_caps: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "qcfuse_core.cli.commands", *argv]
    if drop_caps:
        cmd = DROP_CAPS + cmd
    full_env = {**os.environ, "TRITON_INTERPRET": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=1800)  # a loaded CI machine is slow


def _one_line_error(proc_or_err, needle: str) -> None:
    err = proc_or_err if isinstance(proc_or_err, str) else proc_or_err.stderr
    assert "Traceback" not in err, err
    lines = [l for l in err.splitlines() if l.startswith("qcfuse: error:")]
    assert len(lines) == 1 and needle in lines[0], err


def _needs_setpriv():
    if SETPRIV is None:
        pytest.skip("setpriv (util-linux) is missing: cannot drop root's permission overrides")


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """A store with the three documents, and the answer before any fault."""
    import _pytest.capture  # noqa: F401

    root = tmp_path_factory.mktemp("baseline")
    docs = _write_docs(root / "docs")
    store = root / "store"
    assert cli_main(["ingest", str(docs), "--store", str(store)]) == 0
    return store, docs


@pytest.fixture(scope="module")
def baseline_answer(baseline):
    import io
    from contextlib import redirect_stdout

    store, _ = baseline
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli_main(["ask", QUESTION, "--store", str(store), *ASK]) == 0
    r = json.loads(buf.getvalue())
    assert r["cache_hits"] == 3 and r["cache_misses"] == 0
    return r


@pytest.fixture
def store(baseline, tmp_path):
    """A private copy of the baseline store."""
    dst = tmp_path / "store"
    shutil.copytree(baseline[0], dst)
    return dst


def _flip_bytes(path: Path) -> None:
    b = bytearray(path.read_bytes())
    for f in (1 / 3, 1 / 2, 2 / 3):
        b[int(len(b) * f)] ^= 0xFF
    path.write_bytes(bytes(b))


def _read_only(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        p.chmod(p.stat().st_mode & ~0o222)


def _writable(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        p.chmod(p.stat().st_mode | 0o200)


def _snapshot(path: Path, *, shm: bool = True) -> dict[str, tuple[int, int]]:
    """Size and mtime of every file; shm=False leaves out SQLite's -shm files and empty -wal
    files (the lock index and log a reader of a writable WAL database creates; they hold no
    store data)."""
    def kept(p: Path) -> bool:
        return shm or not (p.name.endswith("-shm") or (p.name.endswith("-wal") and p.stat().st_size == 0))

    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in path.rglob("*") if p.is_file() and kept(p)}


def _overwrite_head(path: Path) -> None:
    """Overwrite the first 100 bytes, after folding any write-ahead log into the file (else
    SQLite would read page 1 back from the log and heal the damage)."""
    import sqlite3

    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    for suffix in ("-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    with open(path, "r+b") as f:
        f.write(os.urandom(100))


def _try_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    return r.returncode == 0
