"""`qcfuse serve`'s safety (qcfuse_core/serve/): bearer-token auth, the limits (body bytes,
prompt tokens, documents, max_tokens) as 4xx errors in OpenAI's shape, node ids that are
keys and never paths, malformed requests that never stop the server, and a graceful
shutdown on SIGTERM. Tiny random fp32 CPU model with a byte tokenizer; every wait bounded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from qcfuse_core.cli.store import main as store_main
from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.model.testing import tiny_model
from qcfuse_core.serve.app import ServeConfig, create_app
from qcfuse_core.store import kv_dir, open_store
from tests.qc_fixtures import SERVE_DOCS, TEMPLATE, LiveServer, _engine, _error, _prompt, _sse, _wait

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-test-0123456789"
GRACE_S = 10  # the shutdown grace period of the SIGTERM test


@pytest.fixture(scope="module")
def tiny():
    adapter = tiny_model("llama", tokenizer=True)
    adapter.tokenizer.chat_template = TEMPLATE
    return adapter


@pytest.fixture(scope="module")
def engine(tiny):
    return _engine(tiny)


# ---------------------------------------------------------------------------- auth


def test_api_key_guards_every_v1_route(engine):
    with TestClient(create_app(engine, config=ServeConfig(api_key=KEY))) as c:
        body = {"prompt": _prompt(), "max_tokens": 2}
        for method, path, kw in (("GET", "/v1/models", {}), ("POST", "/v1/completions", {"json": body}),
                                 ("POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user",
                                                                                          "content": "hi"}]}}),
                                 ("POST", "/v1/chunks", {"json": {"texts": ["x"]}}), ("GET", "/v1/nothing", {})):
            res = c.request(method, path, **kw)
            assert _error(res, 401, "missing API key")["type"] == "invalid_request_error"
            assert res.headers["www-authenticate"] == "Bearer"
            for bad in (f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", KEY, f"Basic {KEY}", "Bearer ", "Bearer"):
                _error(c.request(method, path, headers={"Authorization": bad}, **kw), 401, "invalid API key")
        ok = {"Authorization": f"Bearer {KEY}"}
        assert c.get("/v1/models", headers=ok).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
        res = c.post("/v1/completions", json=body, headers=ok)
        assert res.status_code == 200 and res.json()["usage"]["completion_tokens"] == 2
        assert c.get("/v1/nothing", headers=ok).status_code == 404
        # open: liveness and the Prometheus scrape (counts and timings only)
        assert c.get("/health").json()["status"] == "ok"
        assert "qcfuse_requests_total" in c.get("/metrics").text
        # a 401 is answered before a body is read: an over-limit body without the key is a 401, not a 413
        _error(c.post("/v1/completions", content=b"x" * (2 << 20)), 401)
    with pytest.raises(ValueError, match="api_key"):
        ServeConfig(api_key=" ")
    assert KEY not in repr(ServeConfig(api_key=KEY))


def test_openai_client_with_the_key(engine):
    import openai

    server = LiveServer(create_app(engine, config=ServeConfig(api_key=KEY)))
    try:
        good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        (model,) = [m.id for m in good.models.list()]  # an id the server does not serve is a 404 (test_serve_learned)
        assert good.completions.create(model=model, prompt=_prompt(), max_tokens=3).usage.completion_tokens == 3
        with pytest.raises(openai.AuthenticationError, match="invalid API key"):
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        server.close()


# ---------------------------------------------------------------------------- limits


def test_limits_are_openai_4xx(engine):
    cfg = ServeConfig(max_prompt_tokens=600, max_documents=2, max_tokens=64, default_max_tokens=8,
                      max_body_bytes=64 << 10)
    with TestClient(create_app(engine, config=cfg)) as c:
        short = _prompt()
        assert len(short.encode()) < 300  # framed: under 600
        assert c.post("/v1/completions", json={"prompt": short, "max_tokens": 2}).status_code == 200
        long = _prompt("Why? " * 150)  # 750 + bytes: the byte tokenizer's tokens
        err = _error(c.post("/v1/completions", json={"prompt": long, "max_tokens": 2}), 400, "tokens", "limit of 600")
        assert err["param"] == "prompt"
        err = _error(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]}),
                     400, "limit of 600")
        assert err["param"] == "messages"
        three = _prompt(docs=SERVE_DOCS[:3])
        err = _error(c.post("/v1/completions", json={"prompt": three, "qcfuse": {"documents": SERVE_DOCS[:3]}}),
                     400, "3 chunks", "limit of 2")
        assert err["param"] == "qcfuse.documents"
        err = _error(c.post("/v1/completions", json={"prompt": three, "qcfuse": {"node_ids": ["a", "b", "c"]}}),
                     400, "limit of 2")
        assert err["param"] == "qcfuse.node_ids"
        ok = c.post("/v1/completions", json={"prompt": _prompt(docs=SERVE_DOCS[:2]), "max_tokens": 2,
                                             "qcfuse": {"documents": SERVE_DOCS[:2]}})
        assert ok.status_code == 200 and ok.json()["qcfuse"]["chunks"] == 2
        assert _error(c.post("/v1/completions", json={"prompt": short, "max_tokens": 65}), 400,
                      "limit of 64")["param"] == "max_tokens"
        _error(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                    "max_completion_tokens": 10**12}), 400, "limit")
        _error(c.post("/v1/completions", json={"prompt": "x" * (70 << 10)}), 413, "over the limit")
    for bad in ({"max_prompt_tokens": 0}, {"max_documents": 0}):
        with pytest.raises(ValueError, match="must be >= 1"):
            ServeConfig(**bad)


def test_ignore_eos_runs_every_answer_to_max_tokens(engine):
    with TestClient(create_app(engine)) as c:
        body = {"prompt": _prompt(), "max_tokens": 9, "stop": None, "qcfuse": {"ignore_eos": True}}
        res = c.post("/v1/completions", json=body)
        assert res.status_code == 200 and res.json()["usage"]["completion_tokens"] == 9
        assert res.json()["choices"][0]["finish_reason"] == "length"
        _error(c.post("/v1/completions", json={**body, "qcfuse": {"ignore_eos": "sometimes"}}), 400, "ignore_eos")


# ---------------------------------------------------------------------------- node ids are keys


def test_node_ids_never_become_paths(tiny, tmp_path, monkeypatch):
    """Ids shaped like paths are stored as opaque keys in the store's manifest: the chunks are
    hits by those ids, and no file appears outside the store's folder."""
    root = tmp_path / "srv" / "store"
    cwd = tmp_path / "srv" / "cwd"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)  # a relative path resolved against the working directory would land here
    store = open_store(kv_dir(root))
    eng = QCFuseEngine(tiny, store=store)
    ids = ["../../etc/passwd", "/tmp/qcfuse-escape", "..\\..\\windows\\x", "a/b/../../../c", "CON", "nul\x00byte",
           "." * 300]
    texts = [f"Passage {i} about " + " ".join(f"p{i}w{j}" for j in range(8)) for i in range(len(ids))]
    try:
        with TestClient(create_app(eng)) as c:
            res = c.post("/v1/chunks", json={"texts": texts, "ids": ids})
            assert res.status_code == 200, res.text
            assert [d["id"] for d in res.json()["data"]] == ids
            for i, t in zip(ids, texts):
                assert store.resolve(i) is not None and store.resolve(i) == eng.caches.chunk_tokens(t)[1]
            got = c.post("/v1/completions", json={"prompt": "Context:\n" + "\n\n".join(texts[:3]), "max_tokens": 2,
                                                  "qcfuse": {"node_ids": ids[:3]}})
            assert got.status_code == 200, got.text
            assert got.json()["qcfuse"]["chunk_ids"] == ids[:3] and got.json()["qcfuse"]["cache_hits"] == 3
    finally:
        store.close()
    outside = [p for p in tmp_path.rglob("*") if root not in p.parents and p not in (root, cwd, cwd.parent)]
    assert outside == [], outside
    assert not Path("/tmp/qcfuse-escape").exists()
    names = [p.name for p in root.rglob("*")]
    assert not any(w in n for n in names for w in ("passwd", "escape", "windows", "CON")), names


# ---------------------------------------------------------------------------- malformed requests


MALFORMED = [
    b"{not json",
    b"",
    b"\xff\xfe\x00garbage",
    b'{"prompt": "caf\xe9"}',  # latin-1, not UTF-8
    b'{"prompt": "hi \\ud800 there", "max_tokens": 2}',  # a lone surrogate
    b'{"prompt": "hi", "stop": "\\udfff"}',
    b'{"prompt": "hi", "qcfuse": {"documents": ["\\ud83d"]}}',
    b"[1, 2, 3]",
    b'"a string"',
    b"null",
    b'{"prompt": 12}',
    b'{"prompt": ["a", "b"]}',
    b'{"prompt": {"nested": true}}',
    b'{"prompt": "hi", "max_tokens": "many"}',
    b'{"prompt": "hi", "max_tokens": 1e400}',
    b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"prompt": "hi", "max_tokens": -1}',
    b'{"prompt": "hi", "seed": 100000000000000000000000000000}',
    b'{"prompt": "hi", "temperature": NaN}',
    b'{"prompt": "hi", "top_p": Infinity}',
    b'{"prompt": "hi", "stream": "yes please"}',
    b'{"prompt": "hi", "qcfuse": {"ratio": -0.5}}',
    b'{"prompt": "hi", "qcfuse": {"documents": "not a list"}}',
    b'{"prompt": "hi", "qcfuse": {"node_ids": [1, 2]}}',
    b'{"prompt": "hi", "qcfuse": {"unknown": 1}}',
    b'{"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}',
    b'{"prompt": "hi", "stream_options": 7}',
    b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",  # deep nesting
    b'{"prompt": "hi", "qcfuse": ' + b'{"a": ' * 900 + b"1" + b"}" * 900 + b"}",
]
MALFORMED_CHAT = [
    b'{"messages": []}',
    b'{"messages": [1]}',
    b'{"messages": [{"role": "user", "content": 5}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}',
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}',
]
MALFORMED_CHUNKS = [b'{"texts": ["\\ud800 text"], "ids": ["x"]}', b'{"texts": ["t"], "ids": ["\\udc00"]}',
                    b'{"texts": []}', b'{"texts": [""]}', b'{"texts": "t"}']


def test_malformed_requests_never_stop_the_server(engine):
    """Each malformed body is a 400 in OpenAI's error shape on a live uvicorn server, and the
    next well-formed request is answered; so is a request that is not even HTTP."""
    server = LiveServer(create_app(engine))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            for path, bodies in (("/v1/completions", MALFORMED), ("/v1/chat/completions", MALFORMED_CHAT),
                                 ("/v1/chunks", MALFORMED_CHUNKS)):
                for body in bodies:
                    res = c.post(path, content=body, headers={"content-type": "application/json"})
                    assert res.status_code == 400, (path, body[:80], res.status_code, res.text[:300])
                    err = res.json()["error"]
                    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            sock.sendall(b"\x16\x03\x01 not http at all \r\n\r\n")
            sock.recv(1024)
            sock.close()
            res = c.post("/v1/completions", json={"prompt": _prompt(), "max_tokens": 3})
            assert res.status_code == 200 and res.json()["usage"]["completion_tokens"] == 3
            assert c.get("/health").json()["status"] == "ok"
    finally:
        server.close()


# ---------------------------------------------------------------------------- graceful shutdown

SERVER = """
import sys
from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.model.testing import tiny_model
from qcfuse_core.serve.app import create_app
from qcfuse_core.serve.cli import listen, run_server
from qcfuse_core.store import kv_dir, open_store

root, grace, texts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
engine = QCFuseEngine(tiny_model("llama", tokenizer=True), store=open_store(kv_dir(root)))
engine.build_chunks(texts, [f"doc-{i}" for i in range(len(texts))])
sock = listen("127.0.0.1", 0)
print(sock.getsockname()[1], flush=True)
run_server(create_app(engine, owns_engine=True), sock, grace)
s = engine.stats().scheduler
print(f"stopped: running={s.running} waiting={s.waiting} finished={s.finished} aborted={s.aborted}", flush=True)
"""


def _stream(url: str, body: dict, out: dict, first: threading.Event) -> None:
    """A streamed completion; out: the events read and how it ended."""
    events: list = []
    out["events"] = events
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as res:
            for line in res.iter_lines():
                if line:
                    events.extend(_sse([line]))
                    first.set()
        out["end"] = "done" if events and events[-1] == "[DONE]" else "cut"
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        out["end"] = f"closed: {type(e).__name__}"
    finally:
        first.set()


@pytest.mark.slow  # a server process through a 10 s shutdown grace period
def test_sigterm_finishes_or_cancels_streams_and_closes_the_store(tmp_path):
    """SIGTERM while two streams run: the short one finishes inside the grace period, the long
    one (3000 tokens) is cancelled when it ends (its connection closed); the scheduler stops,
    the store closes, the process exits 0 promptly, and `qcfuse store verify` is clean."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(tmp_path), str(GRACE_S), *SERVE_DOCS[:2]], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline().strip() or 0)
        assert port, proc.stderr.read() if proc.poll() is not None else "no port"
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, 30)
        prompt = _prompt(docs=SERVE_DOCS[:2])
        runs = {}
        for name, tokens in (("long", 3000), ("short", 16)):
            out: dict = {}
            first = threading.Event()
            body = {"prompt": prompt, "max_tokens": tokens, "stream": True, "qcfuse": {"ignore_eos": True}}
            t = threading.Thread(target=_stream, args=(url, body, out, first), daemon=True)
            t.start()
            assert first.wait(60), name
            runs[name] = (t, out)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
        took = time.monotonic() - t0
        stdout, stderr = proc.communicate(timeout=10)
        assert rc == 0, stderr
        last = stdout.strip().splitlines()[-1]
        assert last.startswith("stopped: running=0 waiting=0") and "aborted=1" in last, (stdout, stderr)
        assert took < GRACE_S + 20, took  # the grace period, then the cancel and the store's close
        for t, _ in runs.values():
            t.join(30)
            assert not t.is_alive()
        assert runs["short"][1]["end"] == "done"
        assert runs["short"][1]["events"][-2]["choices"][0]["finish_reason"] == "length"
        assert runs["long"][1]["end"] != "done"  # cancelled at the end of the grace period
        assert len(runs["long"][1]["events"]) < 3000
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert store_main(["store", "verify", "--store", str(tmp_path)]) == 0
    store = open_store(kv_dir(tmp_path))
    try:
        assert store.resolve("doc-0") is not None and store.resolve("doc-1") is not None
    finally:
        store.close()
