"""`qcfuse serve` (qcfuse_core/serve/): the OpenAI routes over the scheduler, on a tiny random
fp32 CPU model with a byte tokenizer and a toy chat template. Answers through HTTP are the
engine's own answers to the same prompt and settings; the real clients (openai, LangChain's
ChatOpenAI, LlamaIndex's OpenAILike) talk to a uvicorn server on 127.0.0.1. Every wait is
bounded."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from qcfuse_core.serve.app import ServeConfig, create_app
from qcfuse_core.serve.protocol import cached_tokens
from tests.qc_fixtures import (  # noqa: F401  (fixtures)
    SERVE_DOCS,
    LiveServer,
    _engine,
    _error,
    _metric,
    _prompt,
    _sse,
    _wait,
    engine_config,
    tiny,
)

NEW = 12
MODEL = "tiny-serve"



@pytest.fixture(scope="module")
def engine(tiny):
    return _engine(tiny)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, model_name=MODEL)) as c:
        yield c



def _chat_messages(engine, prompt: str) -> list[dict]:
    """A chat whose rendering is the engine's completion frame around `prompt` (the same system
    prompt), so the chat route's answer must be `engine.complete(prompt)`'s."""
    return [{"role": "system", "content": engine.config.frame.system_prompt}, {"role": "user", "content": prompt}]



# ---------------------------------------------------------------------------- same answers


def test_completions_are_engine_complete(client, engine):
    prompt = _prompt()
    engine.complete(prompt, max_new_tokens=1)  # the prompt template's cache stored: a hit from now on, as over HTTP
    want = engine.complete(prompt, max_new_tokens=NEW, temperature=0.0)
    res = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": NEW, "temperature": 0})
    assert res.status_code == 200, res.text
    body = res.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"][0]["text"] == want.text
    assert body["choices"][0]["finish_reason"] == "length"
    cached = cached_tokens(want)
    assert 0 < cached < want.prompt_tokens
    assert body["usage"] == {"prompt_tokens": want.prompt_tokens, "completion_tokens": NEW,
                             "total_tokens": want.prompt_tokens + NEW,
                             "prompt_tokens_details": {"cached_tokens": cached}}
    stats = body["qcfuse"]
    assert stats["cache_hits"] == 2 and stats["cache_misses"] == 0 and stats["chunk_ids"] == ["doc-0", "doc-1"]
    assert stats["context_tokens"] == want.context_tokens and stats["method"] == engine.config.method
    assert stats["guard"] == want.guard.to_dict() | {"added_ms": stats["guard"]["added_ms"]}  # the quality guard's report
    label = f"{engine.config.method}@{engine.config.ratio:g}"
    assert stats["fidelity"]["config"] == label and stats["fidelity"]["status"] == "fixed"  # the audit's report


def test_chat_is_engine_complete_streamed_or_not(client, engine):
    prompt = _prompt("Where is word0x7?")
    want = engine.complete(prompt, max_new_tokens=NEW, temperature=0.0)
    body = {"model": MODEL, "messages": _chat_messages(engine, prompt), "max_completion_tokens": NEW,
            "temperature": 0}
    res = client.post("/v1/chat/completions", json=body)
    assert res.status_code == 200, res.text
    got = res.json()
    assert got["object"] == "chat.completion"
    assert got["choices"][0]["message"] == {"role": "assistant", "content": want.text}
    assert got["usage"]["completion_tokens"] == NEW and got["usage"]["prompt_tokens"] == want.prompt_tokens
    assert got["qcfuse"]["cache_hits"] == 2

    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as res:
        assert res.status_code == 200 and res.headers["content-type"].startswith("text/event-stream")
        events = _sse(res.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["qcfuse"]["cache_hits"] == 2
    assert not any("usage" in c for c in chunks)  # not asked for


def test_streamed_completion_with_usage(client, engine):
    prompt = _prompt("Name the second document.")
    engine.complete(prompt, max_new_tokens=1)  # the prompt template's cache stored, as for the request below
    want = engine.complete(prompt, max_new_tokens=NEW, temperature=0.7, top_p=0.9, seed=5)
    body = {"prompt": prompt, "max_tokens": NEW, "temperature": 0.7, "top_p": 0.9, "seed": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as res:
        assert res.status_code == 200
        events = _sse(res.iter_lines())
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    assert last["choices"] == [] and last["usage"] == {
        "prompt_tokens": want.prompt_tokens, "completion_tokens": NEW, "total_tokens": want.prompt_tokens + NEW,
        "prompt_tokens_details": {"cached_tokens": cached_tokens(want)}}


def test_stop_strings(client, engine):
    prompt = _prompt()
    full = engine.complete(prompt, max_new_tokens=40, temperature=0.0).text
    stop = next(ch for ch in full[5:] if ch.isprintable() and ch.strip())  # a character it writes later on
    want = engine.complete(prompt, max_new_tokens=40, temperature=0.0, stop=(stop,))
    for value in (stop, [stop, "never-written"]):
        res = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": value})
        assert res.status_code == 200, res.text
        choice = res.json()["choices"][0]
        assert choice["text"] == want.text and stop not in choice["text"] and len(choice["text"]) < len(full)
        assert choice["finish_reason"] == "stop"


# ---------------------------------------------------------------------------- errors


def test_bad_requests_get_openai_errors(client):
    prompt = _prompt()
    assert _error(client.post("/v1/completions", json={"prompt": prompt, "n": 2}), 400, "n=2")["param"] == "n"
    _error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 3}),
           400, "n=3")
    _error(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10**6}), 400, "limit")
    _error(client.post("/v1/completions", json={"prompt": prompt, "temperature": -1}), 400, "temperature")
    _error(client.post("/v1/completions", json={"prompt": prompt, "logprobs": 3}), 400, "logprobs")
    _error(client.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}), 400, "role")
    _error(client.post("/v1/completions", json={"prompt": prompt, "qcfuse": {"method": "nope"}}), 400, "nope")
    _error(client.post("/v1/completions", json={"prompt": prompt, "qcfuse": {"documents": ["not in it at all"]}}),
           400, "does not occur")
    _error(client.post("/v1/completions", json={"prompt": prompt, "qcfuse": {"node_ids": ["doc-3"]}}),
           400, "doc-3")
    _error(client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    _error(client.post("/v1/completions", json={"prompt": "x" * (2 << 20)}), 413)
    assert client.get("/health").json()["status"] == "ok"  # the server goes on


def test_kv_budget_is_a_400(tiny):
    eng = _engine(tiny, kv_cache_bytes=4096)
    with TestClient(create_app(eng)) as c:
        for stream in (False, True):
            res = c.post("/v1/completions", json={"prompt": _prompt(), "max_tokens": 8, "stream": stream})
            _error(res, 400, "KV budget")


def test_a_full_queue_is_a_429(tiny):
    eng = _engine(tiny, max_queue=1, max_running=1)
    long = dict(max_new_tokens=3000, temperature=0.0)
    running = eng.complete(_prompt(), stream=True, **long)
    try:
        _wait(lambda: eng.stats().scheduler.running == 1)
        waiting = eng.complete(_prompt("b"), stream=True, **long)  # fills the queue of one
        try:
            with TestClient(create_app(eng)) as c:
                res = c.post("/v1/completions", json={"prompt": _prompt("c"), "max_tokens": 4})
                err = _error(res, 429, "max_queue")
                assert err["type"] == "rate_limit_error" and res.headers["retry-after"] == "1"
                assert 'qcfuse_requests_total{outcome="busy",route="completions"} 1.0' in c.get("/metrics").text
        finally:
            waiting.close()
    finally:
        running.close()


# ---------------------------------------------------------------------------- chunks and stats


def test_documents_name_the_chunks(client, engine):
    new = "A fresh passage that nobody registered: " + " ".join(f"fresh{j}" for j in range(12))
    prompt = _prompt(docs=(new, SERVE_DOCS[2]))
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "qcfuse": {"documents": [new, SERVE_DOCS[2]],
                                                                              "method": "cacheblend", "ratio": 0.3}}
    first = client.post("/v1/completions", json=body).json()["qcfuse"]
    assert first["method"] == "cacheblend" and first["ratio"] == 0.3
    assert first["chunks"] == 2 and first["cache_hits"] == 1 and first["cache_misses"] == 1
    assert first["chunk_ids"] == [None, "doc-2"]
    again = client.post("/v1/completions", json=body).json()["qcfuse"]
    assert again["cache_hits"] == 2 and again["recomputed_tokens"] > 0
    # by content the new text is unknown (never registered): only the document is found
    by_content = client.post("/v1/completions", json={**body, "qcfuse": None}).json()["qcfuse"]
    assert by_content["chunk_ids"] == ["doc-2"]
    by_id = client.post("/v1/completions", json={**body, "qcfuse": {"node_ids": ["doc-2"]}}).json()["qcfuse"]
    assert by_id["chunk_ids"] == ["doc-2"] and by_id["cache_hits"] == 1


def test_prebuilt_chunks_hit(client, engine):
    texts = [f"Ingested elsewhere {i}: " + " ".join(f"ing{i}y{j}" for j in range(10)) for i in range(2)]
    res = client.post("/v1/chunks", json={"texts": texts, "ids": ["ing-0", "ing-1"]})
    assert res.status_code == 200, res.text
    keys = [d["key"] for d in res.json()["data"]]
    assert [d["id"] for d in res.json()["data"]] == ["ing-0", "ing-1"] and len(set(keys)) == 2
    got = client.post("/v1/chat/completions", json={"messages": _chat_messages(engine, _prompt(docs=texts)),
                                                    "max_tokens": 4}).json()["qcfuse"]
    assert got["cache_hits"] == 2 and got["cache_misses"] == 0 and got["chunk_ids"] == ["ing-0", "ing-1"]
    _error(client.post("/v1/chunks", json={"texts": texts, "ids": ["one"]}), 400, "differ")


def test_models_health_metrics(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert client.get("/health").json()["status"] == "ok"
    before = _metric(client.get("/metrics").text, 'qcfuse_requests_total{outcome="ok",route="completions"}')
    hits = _metric(client.get("/metrics").text, "qcfuse_cache_hits_total")
    client.post("/v1/completions", json={"prompt": _prompt(), "max_tokens": 3})
    text = client.get("/metrics").text
    for name in ("qcfuse_ttft_seconds_bucket", "qcfuse_e2e_seconds_count", "qcfuse_prompt_tokens_total",
                 "qcfuse_completion_tokens_total", "qcfuse_cache_misses_total", "qcfuse_recompute_share_bucket",
                 "qcfuse_queue_length", "qcfuse_running_requests", "qcfuse_max_batch_seen",
                 "qcfuse_scheduler_steps_total",
                 "qcfuse_scheduler_requests_total", "qcfuse_kv_pool_idle_bytes"):
        assert name in text, name
    assert _metric(text, 'qcfuse_requests_total{outcome="ok",route="completions"}') == before + 1
    assert _metric(text, "qcfuse_cache_hits_total") == hits + 2
    assert _metric(text, 'qcfuse_ttft_seconds_count{route="completions"}') >= 1
    assert client.get("/v1/nothing").status_code == 404
    # the audit's checks (engine/audit.py): counted now, the agreement per configuration once one ran
    for name in ("qcfuse_fidelity_audited_total", "qcfuse_fidelity_shadow_total", "qcfuse_fidelity_waiting"):
        assert name in text, name



# ---------------------------------------------------------------------------- a live server



@pytest.fixture(scope="module")
def live(engine):
    server = LiveServer(create_app(engine, model_name=MODEL))
    yield server
    server.close()


def test_a_disconnecting_client_aborts_its_request(tiny):
    eng = _engine(tiny)
    server = LiveServer(create_app(eng, config=ServeConfig(disconnect_poll_s=0.05)))
    try:
        for stream in (True, False):
            aborted = eng.stats().scheduler.aborted
            body = json.dumps({"prompt": _prompt(), "max_tokens": 3000, "temperature": 0, "stream": stream}).encode()
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            _wait(lambda: eng.stats().scheduler.running == 1)  # decoding 3000 tokens: seconds
            sock.close()
            t0 = time.monotonic()
            _wait(lambda: eng.stats().scheduler.aborted == aborted + 1, timeout=10)
            assert time.monotonic() - t0 < 5  # at once, not after the 3000 tokens
            _wait(lambda: eng.stats().scheduler.running == 0)
        text = httpx.get(server.url + "/metrics").text
        assert _metric(text, 'qcfuse_requests_total{outcome="aborted",route="completions"}') == 2
    finally:
        server.close()


def test_concurrent_requests_share_decode_steps(tiny):
    eng = _engine(tiny)
    server = LiveServer(create_app(eng))
    prompts = [_prompt(f"Question number {i}?") for i in range(8)]
    want = [eng.complete(p, max_new_tokens=24, temperature=0.0).text for p in prompts]
    start = eng.stats().scheduler
    got: list[str | None] = [None] * 8
    errors: list[BaseException] = []
    gate = threading.Barrier(8)

    def one(i: int) -> None:
        try:
            with httpx.Client(base_url=server.url, timeout=120) as c:
                gate.wait(30)
                res = c.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 24, "temperature": 0})
                res.raise_for_status()
                got[i] = res.json()["choices"][0]["text"]
        except BaseException as e:  # surfaced below
            errors.append(e)

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not errors, errors
        assert got == want
        stats = eng.stats().scheduler
        assert stats.finished - start.finished == 8 and stats.max_batch_seen > 1
    finally:
        server.close()


# ---------------------------------------------------------------------------- real clients


def test_openai_client(live, engine):
    import openai

    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    prompt = _prompt("Which words does document 1 hold?")
    want = engine.complete(prompt, max_new_tokens=NEW, temperature=0.0)
    res = client.chat.completions.create(model=MODEL, messages=_chat_messages(engine, prompt), max_tokens=NEW,
                                         temperature=0, extra_body={"qcfuse": {"node_ids": ["doc-0", "doc-1"]}})
    assert res.choices[0].message.content == want.text
    assert res.usage.completion_tokens == NEW
    assert res.model_extra["qcfuse"]["cache_hits"] == 2
    parts, usage = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=_chat_messages(engine, prompt),
                                                max_tokens=NEW, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        usage = chunk.usage or usage
    assert "".join(parts) == want.text and usage.total_tokens == want.prompt_tokens + NEW
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0)
    assert done.choices[0].text == want.text
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.BadRequestError, match="n=2"):
        client.chat.completions.create(model=MODEL, messages=_chat_messages(engine, prompt), n=2)


def test_langchain_chat_openai(live, engine):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=live.url + "/v1", api_key="unused", temperature=0, max_tokens=NEW,
                     max_retries=0)
    prompt = _prompt("What does word1x2 belong to?")
    want = engine.complete(prompt, max_new_tokens=NEW, temperature=0.0).text
    messages = [("system", engine.config.frame.system_prompt), ("human", prompt)]
    msg = llm.invoke(messages)
    assert msg.content == want
    assert msg.usage_metadata["output_tokens"] == NEW
    assert "".join(c.content for c in llm.stream(messages)) == want


def test_llama_index_openai_like(live, engine):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    prompt = _prompt("Which document is first?")
    want = engine.complete(prompt, max_new_tokens=NEW, temperature=0.0).text
    common = dict(model=MODEL, api_base=live.url + "/v1", api_key="unused", temperature=0.0, max_tokens=NEW,
                  context_window=4096, max_retries=0)
    completion = OpenAILike(**common, is_chat_model=False)
    assert completion.complete(prompt).text == want
    chat = OpenAILike(**common, is_chat_model=True)
    reply = chat.chat([ChatMessage(role="system", content=engine.config.frame.system_prompt),
                       ChatMessage(role="user", content=prompt)])
    assert reply.message.content == want


def test_forced_tool_call_and_json_response_format(client, engine):
    tool = {"type": "function", "function": {"name": "lookup", "description": "find a word",
                                             "parameters": {"type": "object", "properties": {"word": {"type": "string",
                                                                                                      "maxLength": 8}},
                                                            "required": ["word"]}}}
    body = {"messages": [{"role": "user", "content": "Look up word1x3."}], "tools": [tool], "max_tokens": 80,
            "tool_choice": {"type": "function", "function": {"name": "lookup"}}, "temperature": 0}
    res = client.post("/v1/chat/completions", json=body)
    assert res.status_code == 200, res.text
    choice = res.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "lookup" and isinstance(json.loads(call["function"]["arguments"])["word"], str)
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as res:
        events = _sse(res.iter_lines())
    deltas = [c["choices"][0]["delta"] for c in events[:-1]]
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d] == ["lookup"]
    res = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "JSON please"}],
                                                    "response_format": {"type": "json_object"}, "max_tokens": 80,
                                                    "temperature": 0})
    assert res.status_code == 200, res.text
    assert isinstance(json.loads(res.json()["choices"][0]["message"]["content"]), dict)
    _error(client.post("/v1/chat/completions", json={**body, "tool_choice": {"type": "function",
                                                                             "function": {"name": "other"}}}),
           400, "names no bound tool")
