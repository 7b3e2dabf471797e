"""`qcfuse bench trace` (qcfuse_core/eval/trace*.py, issue 63): its numbers come from the
server's responses - a fake server whose first token is late on purpose shows it on the
client's clock and reports it on its own -, the per-batch shape on the embedded model in
process, the templates against the frameworks' own, the streamed in-process transport, and
`cached_tokens` counting reused tokens only (what was recomputed is in the `qcfuse` field).
Absolute times are not checked."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from qcfuse_core.cli.commands import main as cli_main
from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.engine.config import EngineConfig
from qcfuse_core.engine.guard import GuardConfig
from qcfuse_core.eval.trace_client import ASGIStreamTransport
from qcfuse_core.eval.trace_prompts import LANGCHAIN_RAG, LLAMAINDEX_QA, LLAMAINDEX_SYSTEM, corpus, render
from qcfuse_core.serve.app import create_app
from qcfuse_core.store import MemoryStore
from tests.qc_fixtures import LiveServer, tiny  # noqa: F401  (fixture)

DOCS = ["first document text", "second document text"]
SLOW_S = {"qcfuse": 0.40, "full": 0.10}  # the fake server's time to its first token, per method
REPORTED_MS = {"qcfuse": 7.0, "full": 3.0}  # ... and the ttft_ms it reports (its own clock, on purpose not the same)


# ----------------------------------------------------------------------------- the templates


def test_templates_are_the_frameworks_own():
    from langchain_core.prompts import ChatPromptTemplate
    from llama_index.core.prompts.chat_prompts import TEXT_QA_PROMPT_TMPL_MSGS, TEXT_QA_SYSTEM_PROMPT
    from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT_TMPL

    assert LLAMAINDEX_QA == DEFAULT_TEXT_QA_PROMPT_TMPL == TEXT_QA_PROMPT_TMPL_MSGS[1].content
    assert LLAMAINDEX_SYSTEM == TEXT_QA_SYSTEM_PROMPT.content
    chat = render("llamaindex", DOCS, "why?", chat=True).messages
    assert chat is not None and [m["role"] for m in chat] == ["system", "user"]
    assert "\n" + DOCS[0] + "\n\n" + DOCS[1] + "\n-----" in chat[1]["content"]  # context_str: a blank line between
    # LangChain's chat prompt sent to a completion model is its buffer string
    lc = ChatPromptTemplate.from_messages([("human", LANGCHAIN_RAG)])
    value = lc.format_prompt(context="\n\n".join(DOCS), question="why?")
    assert render("langchain", DOCS, "why?", chat=False).text == value.to_string()
    assert render("langchain", DOCS, "why?", chat=True).messages == [
        {"role": "user", "content": value.to_messages()[0].content}
    ]
    with pytest.raises(ValueError, match="unknown template"):
        render("haystack", DOCS, "why?", chat=True)


def test_corpus_documents_are_distinct_and_of_the_asked_length(tiny):  # noqa: F811
    from qcfuse_core.model.adapter import load_model

    tok = load_model(None).tokenizer  # the embedded model's: the packaged sample corpus's paragraphs
    pool, questions = corpus(tok, 30, 48, seed=3)
    assert len(set(pool.texts)) == 30 and questions == []
    lengths = [len(tok(t, add_special_tokens=False).input_ids) for t in pool.texts]
    assert all(44 <= n <= 52 for n in lengths), lengths
    assert all("\n\n" not in t for t in pool.texts)  # a blank line would split a document into spans
    byte_pool, _ = corpus(tiny.tokenizer, 5, 100, seed=3)  # a byte-level tokenizer: generated text, exact
    assert [len(t) for t in byte_pool.texts] == [100] * 5


# ----------------------------------------------------------------------------- a fake server


def fake_server() -> FastAPI:
    """OpenAI's completion stream with a `qcfuse` field, its first token SLOW_S late; it
    reports REPORTED_MS as its TTFT, 60 of 100 prompt tokens cached for qcfuse (0 for full)."""
    app = FastAPI()
    seen: list[dict] = []
    app.state.seen = seen

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model", "created": 0, "owned_by": "t"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": 0, "waiting": 0}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse("qcfuse_learned_pending 0\nqcfuse_learned_builds_total 0\n")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        method, n = body["qcfuse"]["method"], body["max_tokens"]

        def event(**kw) -> str:
            return (
                "data: "
                + json.dumps({"id": "c", "object": "text_completion", "created": 0, "model": "fake", **kw})
                + "\n\n"
            )

        async def stream():
            await asyncio.sleep(SLOW_S[method])
            for _ in range(n):
                yield event(choices=[{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}])
                await asyncio.sleep(0.01)
            stats = {
                "method": method, "ttft_ms": REPORTED_MS[method], "total_ms": REPORTED_MS[method] + 2.0 * (n - 1),
                "recomputed_tokens": 6 if method == "qcfuse" else 40, "context_tokens": 40, "chunks": 2,
                "cache_hits": 2 if method == "qcfuse" else 0, "chunk_sources": {"host": 2} if method == "qcfuse" else {},
                "guard": {"escalated": False},
            }  # fmt: skip
            yield event(choices=[{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}], qcfuse=stats)
            cached = 60 if method == "qcfuse" else 0
            usage = {"prompt_tokens": 100, "completion_tokens": n, "total_tokens": 100 + n}
            yield event(choices=[], usage=usage | {"prompt_tokens_details": {"cached_tokens": cached}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def test_a_slow_server_shows_on_both_clocks(tmp_path):
    app = fake_server()
    server = LiveServer(app)
    out = tmp_path / "trace.json"
    try:
        code = cli_main(
            ["bench", "trace", "--url", server.url, "--shape", "tiny-llama", "--device", "cpu", "--modes", "learned",
             "--pool-docs", "6", "--doc-tokens", "40", "--docs-per-request", "2", "--batches", "2", "--clients", "2",
             "--max-new-tokens", "3", "--api", "completions", "--json", str(out), "--plot", str(tmp_path / "t.png")]
        )  # fmt: skip
    finally:
        server.close()
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["method"]) for r in rows] == [(1, "qcfuse"), (1, "full"), (2, "qcfuse"), (2, "full")]
    for r in rows:
        m = r["method"]
        assert r["finished"] == r["submitted"] == 2 and r["errors"] == 0
        assert r["ttft_ms_p50"] >= 1e3 * SLOW_S[m]  # the client waited for the late first token ...
        assert r["server_ttft_ms_p50"] == REPORTED_MS[m]  # ... and the server's own figure is what it said
        assert r["itl_ms_p50"] == pytest.approx(2.0)  # (total - ttft) / (tokens - 1), the server's
        assert r["cached_share"] == (0.6 if m == "qcfuse" else 0.0)
        assert r["recompute_share"] == (0.15 if m == "qcfuse" else 1.0)
        assert r["chunks_host"] == (1.0 if m == "qcfuse" else None)
    qc = rows[0]
    assert qc["speedup"] < 1 and qc["server_speedup"] == pytest.approx(3.0 / 7.0, abs=1e-3)
    assert (tmp_path / "t.png").stat().st_size > 0
    # what was sent: new questions, the documents in the prompt, nothing naming them
    seen = app.state.seen
    timed = [b for b in seen if b["max_tokens"] == 3]
    assert len(timed) == 8 and len({b["prompt"] for b in timed}) == 4  # 4 requests, each run by both methods
    assert all(set(b["qcfuse"]) == {"method", "ratio", "ignore_eos"} for b in seen)
    assert any(b["prompt"].startswith("Human: You are an assistant") for b in timed)
    assert any(b["prompt"].startswith("Context information is below.") for b in timed)


def test_the_in_process_transport_streams():
    """Each event reaches the client as the app sends it (httpx's ASGITransport would hand the
    whole body over at the end), and a client closing early ends the app's response."""

    async def go() -> tuple[float, float]:
        http = httpx.AsyncClient(transport=ASGIStreamTransport(fake_server()), base_url="http://127.0.0.1")
        client = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="k", http_client=http, max_retries=0)
        t0 = time.perf_counter()
        stream = await client.completions.create(
            model="fake", prompt="p", max_tokens=40, stream=True, extra_body={"qcfuse": {"method": "full"}}
        )
        async for chunk in stream:
            first = time.perf_counter() - t0
            break
        await stream.close()
        return first, time.perf_counter() - t0

    first, closed = asyncio.run(go())
    assert first < SLOW_S["full"] + 0.2  # not after the 40 x 10 ms of the whole body
    assert closed < SLOW_S["full"] + 0.3


# ----------------------------------------------------------------------------- the real server, in process


def test_per_batch_shape_on_the_embedded_model(tmp_path):
    out = tmp_path / "trace.json"
    code = cli_main(
        ["bench", "trace", "--pool-docs", "8", "--doc-tokens", "64", "--docs-per-request", "4", "--batches", "3",
         "--clients", "2", "--max-new-tokens", "2", "--settle-s", "60", "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["api"] for r in rows} == {"chat"} and {r["where"] for r in rows} == {"in process"}
    qc = {(r["mode"], r["batch"]): r for r in rows if r["method"] == "qcfuse"}
    full = [r for r in rows if r["method"] == "full"]
    assert all(r["finished"] == r["submitted"] == 2 for r in rows)
    for r in full:  # full prefill reuses nothing: no cached token, everything recomputed
        assert r["cached_tokens"] == 0 and r["recompute_share"] in (None, 1.0) and r["ran_as"] == ["full"]
    # learned: the first batch is the server's first sighting of its documents; from the
    # second on it serves the ones it has seen from their caches
    assert qc["learned", 1]["cached_tokens"] < qc["learned", 2]["cached_tokens"]
    assert qc["learned", 1]["learned"]["builds"] > 0
    for b in (2, 3):
        assert qc["learned", b]["chunk_hit_share"] > 0.5 and qc["learned", b]["cached_share"] > 0.2
    # registered: the corpus is there from the first batch on
    assert rows[6]["register_s"] is not None and qc["registered", 1]["chunk_hit_share"] == 1.0
    for r in qc.values():  # every figure a row reports comes from its requests' responses
        reqs = r["requests"]
        assert sum(q["cached_tokens"] for q in reqs) == r["cached_tokens"]
        assert sum(q["escalated"] for q in reqs) == r["escalations"]
        assert r["speedup"] == pytest.approx(
            next(f for f in full if (f["mode"], f["batch"]) == (r["mode"], r["batch"]))["ttft_ms_p50"]
            / r["ttft_ms_p50"],
            abs=2e-3,
        )


def test_no_guard_runs_the_server_app_with_the_guard_off(tmp_path, capsys):
    out = tmp_path / "trace.json"
    argv = ["bench", "trace", "--shape", "tiny-llama", "--dtype", "fp32", "--modes", "registered", "--pool-docs", "4",
            "--doc-tokens", "80", "--docs-per-request", "2", "--batches", "1", "--clients", "1", "--max-new-tokens", "2"]  # fmt: skip
    assert cli_main([*argv, "--no-guard", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["guard"] for r in rows} == {"off"}
    assert [q["guard"] for q in rows[0]["requests"]] == ["off"]  # what the server said it did
    capsys.readouterr()
    assert cli_main([*argv, "--no-guard", "--url", "http://127.0.0.1:9"]) == 2  # the server's guard is its own
    assert "--no-guard" in capsys.readouterr().err


# ----------------------------------------------------------------------------- cached_tokens, honest


@pytest.mark.parametrize(
    ("method", "guard"),
    [
        ("qcfuse", GuardConfig(threshold=0.0)),  # kept: fused at 0.15
        ("qcfuse", GuardConfig(threshold=1.0, ladder=(0.5,))),  # escalated to ratio 0.5
        ("qcfuse", GuardConfig(threshold=1.0)),  # escalated to full prefill
        ("full", GuardConfig()),
    ],
)
def test_cached_tokens_count_reused_tokens_only(tiny, method, guard):  # noqa: F811
    """Over the wire: usage's cached_tokens are the prompt tokens served from caches and not
    recomputed - cached + recomputed context tokens == context tokens (the prefix differs per
    request: never cached here) -, 0 where full prefill answered; the recomputed tokens are in
    the `qcfuse` field."""
    texts = ["The coastal ferry from Bergen to Kirkenes calls at thirty-four ports. " * 3,
             "Saffron is picked by hand from the crocus flower, three stigmas a bloom. " * 3]  # fmt: skip
    engine = QCFuseEngine(tiny, store=MemoryStore(), config=EngineConfig(guard=guard))
    engine.build_chunks(texts)
    app = create_app(engine)

    async def ask(i: int, miss: bool) -> tuple[dict, dict]:
        http = httpx.AsyncClient(transport=ASGIStreamTransport(app), base_url="http://127.0.0.1")
        client = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="k", http_client=http, max_retries=0)
        docs = texts + (["A chunk no cache holds, so it is computed in the request. " * 3] if miss else [])
        prompt = f"Context {i}:\n" + "\n\n".join(docs) + "\n\nQuestion: where?"
        res = await client.completions.create(
            model=engine.adapter.name, prompt=prompt, max_tokens=2,
            extra_body={"qcfuse": {"method": method, "ratio": 0.15, "documents": docs}},
        )  # fmt: skip
        return res.usage.model_dump(), res.model_extra["qcfuse"]

    try:
        for i, miss in enumerate((False, True)):
            usage, stats = asyncio.run(ask(i, miss))
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            computed = stats["recomputed_tokens"] + stats["built_tokens"]
            assert cached + computed == stats["context_tokens"], (usage, stats)
            if method != "full":  # full prefill looks nothing up
                assert stats["cache_misses"] == int(miss)
            if stats["method"] == "full":  # asked for, or escalated to: every token computed
                assert cached == 0 and stats["recomputed_tokens"] == stats["context_tokens"]
            else:
                assert 0 < cached < stats["context_tokens"] and (stats["built_tokens"] > 0) == miss
            escalated = guard.threshold == 1.0 and method == "qcfuse"
            assert stats["guard"] is None or stats["guard"]["escalated"] == escalated
    finally:
        app.state.learner.close()
        app.state.builds.close()
        engine.close()
