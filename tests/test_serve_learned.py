"""Issue 55: OpenAI clients unchanged. The server learns chunks from prompts (qcfuse_core/learn.py),
reports reuse in `usage.prompt_tokens_details.cached_tokens`, and validates like OpenAI
(serve/validation.py). Real clients (openai, LangChain's ChatOpenAI, LlamaIndex's OpenAILike)
talk to a uvicorn server on 127.0.0.1 over the tiny random fp32 CPU model with a byte
tokenizer; nothing is registered through /v1/chunks. Every wait is bounded and on an event.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from fastapi.testclient import TestClient

from qcfuse_core import EngineConfig
from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.engine.chat import render
from qcfuse_core.learn import ChunkLearner, LearnConfig, count_learned, learned_id, spans
from qcfuse_core.model.testing import tiny_model
from qcfuse_core.retrieval.texts import ChunkTextIndex
from qcfuse_core.serve.app import ServeConfig, create_app
from qcfuse_core.serve.protocol import cached_tokens
from qcfuse_core.serve.validation import ModelIds
from qcfuse_core.store import MemoryStore
from tests.qc_fixtures import TEMPLATE, LiveServer, _fill, _metric, _run

NEW = 8
MODEL = "tiny-learned"
TIMEOUT_S = 60.0
SYSTEM = EngineConfig().frame.system_prompt

DOCS = {
    "ferry": "The coastal ferry from Bergen to Kirkenes calls at thirty-four ports and takes eleven days there "
    "and back.",
    "saffron": "Saffron is picked by hand from the crocus flower; each bloom gives only three red stigmas, dried "
    "over embers.",
    "mechanism": "The Antikythera mechanism, raised from a shipwreck in 1901, used bronze gears to predict eclipses.",
    "glacier": "The Aletsch glacier in the Swiss Alps is twenty kilometres long and loses fifty metres a year.",
    "violin": "A Stradivarius violin owes part of its tone to maple wood grown during a cold century.",
}


@pytest.fixture(scope="module")
def tiny():
    adapter = tiny_model("llama", tokenizer=True)
    adapter.tokenizer.chat_template = TEMPLATE
    return adapter


def _engine(tiny) -> QCFuseEngine:
    return QCFuseEngine(tiny, store=MemoryStore(), config=EngineConfig())  # nothing registered


@pytest.fixture()
def live(tiny):
    engine = _engine(tiny)
    server = LiveServer(create_app(engine, model_name=MODEL))
    server.engine = engine
    server.learner = server.server.config.app.state.learner
    yield server
    server.close()
    engine.close()


def _reference(tiny, messages: list[dict], texts: list[str]):
    """The results with `texts` registered (as /v1/chunks would) on a fresh engine: what the
    learned chunks must give -> (the first request, the next one: its prompt template cached)."""
    eng = _engine(tiny)
    try:
        eng.build_chunks(texts)
        prompt = render(eng.tokenizer, messages)
        return [eng.complete(prompt, framed=False, max_new_tokens=NEW, temperature=0.0) for _ in range(2)]
    finally:
        eng.close()


def _tokens(tiny, text: str) -> int:
    return len(tiny.tokenizer(text, add_special_tokens=False).input_ids)


# ---------------------------------------------------------------------------- spans


def test_spans_at_the_frameworks_boundaries():
    a, b = DOCS["ferry"], DOCS["saffron"]
    q = "How many ports does the Bergen ferry call at, and how is saffron picked in the fields of La Mancha?"
    renderings = {
        "langchain": f"Context:\n{a}\n\n{b}\n\nQuestion: {q}",
        "llama_index": "Context information is below.\n---------------------\ntopic: ferry\n\n"
        f"{a}\n\n{b}\n---------------------\nGiven the context information and not prior knowledge, answer the "
        f"query.\nQuery: {q}\nAnswer: ",
        "hub rag-prompt": "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
        f"context to answer the question.\nQuestion: {q} \nContext: {a}\n\n{b} \nAnswer:",
        "xml markers": f"<documents>\n<document>\n{a}\n</document>\nDocument 2:\n{b}\n</documents>\n{q}\n\nQ: {q}",
    }
    for name, text in renderings.items():
        got = spans(text)
        assert got[:2] == [a, b], (name, got)
        assert all(g in text for g in got)
    assert spans(renderings["xml markers"])[2:] == [q]  # an unlabelled line is context, a "Q:" line the question
    assert spans(f"Context:\n{a[:40]}\n\n{b}") == [b]  # too short: computed, not learned
    assert spans(f"{a}\n{b}") == [f"{a}\n{b}"]  # no boundary between them: one span


# ---------------------------------------------------------------------------- the learner


def test_learner_policy_and_bounds(tiny):
    eng = _engine(tiny)
    eng.build_chunks([DOCS["glacier"]], ["registered-glacier"])
    learner = ChunkLearner(eng, LearnConfig(after=2, max_learned=2, max_pending=1))
    a, b, c = DOCS["ferry"], DOCS["saffron"], DOCS["mechanism"]

    def seen(*docs: str) -> int:
        prompt = "Context:\n" + "\n\n".join(docs) + "\n\nQuestion: which?"
        found = eng.caches.texts.find(prompt)
        n = learner.observe(prompt, [prompt], found)
        assert learner.wait(TIMEOUT_S)
        return n

    try:
        assert seen(a, DOCS["glacier"]) == 0  # first sighting: counted; the registered text is no candidate
        assert seen(a, DOCS["glacier"]) == 1  # second: built in the background
        assert [p.node_id for p in eng.caches.texts.find(f"x {a} y {DOCS['glacier']}")] == [
            learned_id(a),
            "registered-glacier",
        ]
        assert eng.caches.is_stored(a)
        assert seen(b, c) == 0 and seen(b, c) == 1  # max_pending=1: c waits for a later sighting
        assert learner.stats().dropped == 1
        assert seen(c) == 1  # its third sighting: queued now; a (least recently used) is forgotten
        s = learner.stats()
        assert (s.learned, s.builds, s.evicted, s.failed, s.pending) == (2, 3, 1, 0, 0)
        assert not eng.caches.is_stored(a) and eng.caches.texts.node_id(a) is None
        assert eng.caches.texts.node_id(DOCS["glacier"]) == "registered-glacier"  # registered: never touched
        assert {p.text for p in eng.caches.texts.find(f"{b} {c}")} == {b, c}
        # misses: every sighting of a span not served from a learned cache
        assert s.misses == 2 + 2 * 2 + 1
    finally:
        learner.close()
        eng.close()


def test_a_span_longer_than_the_context_is_never_built(tiny):
    eng = _engine(tiny)
    learner = ChunkLearner(eng)
    long = " ".join(["a long paragraph about the harbour and its ledger"] * 100)  # 5,000 bytes: past 4,096 positions
    prompt = f"Context:\n{long}\n\n{DOCS['ferry']}\n\nQuestion: ?"
    try:
        for _ in range(2):  # seen twice: queued once, refused, not queued again
            learner.observe(prompt, [prompt], eng.caches.texts.find(prompt))
            assert learner.wait(TIMEOUT_S)
        s = learner.stats()
        assert (s.learned, s.builds, s.failed, s.pending) == (1, 1, 1, 0)
        assert [p.text for p in eng.caches.texts.find(prompt)] == [DOCS["ferry"]]
    finally:
        learner.close()
        eng.close()


def test_learned_texts_survive_a_restart_and_show_in_store_stats(tmp_path, tiny, capsys):
    _fill(tmp_path)  # a KV store for `store stats` to read
    index = ChunkTextIndex(tmp_path / "chunk_texts.sqlite")
    eng = QCFuseEngine(tiny, store=MemoryStore(), text_index=index)
    learner = ChunkLearner(eng)
    prompt = f"Context:\n{DOCS['ferry']}\n\n{DOCS['saffron']}\n\nQuestion: ?"
    assert learner.observe(prompt, [prompt], []) == 2 and learner.wait(TIMEOUT_S)
    learner.close()
    assert count_learned(tmp_path / "chunk_texts.sqlite") == (2, len(DOCS["ferry"]) + len(DOCS["saffron"]))
    again = ChunkLearner(eng)  # the next server over the same folder holds them (and bounds them)
    assert again.stats().learned == 2
    again.close()
    eng.close()
    code, out, _ = _run(capsys, "stats", "--store", str(tmp_path), "--json")
    assert code == 0 and json.loads(out)["learned_texts"] == 2


# ---------------------------------------------------------------------------- unmodified chains


def _langchain(live, **kw):
    from langchain_core.documents import Document
    from langchain_core.messages import SystemMessage
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.retrievers import BaseRetriever
    from langchain_core.runnables import RunnablePassthrough
    from langchain_openai import ChatOpenAI

    class Fixed(BaseRetriever):
        """Returns the documents a query names (as a vector store would for it)."""

        def _get_relevant_documents(self, query: str, *, run_manager) -> list[Document]:
            return [Document(page_content=DOCS[k], id=k) for k in re.findall(r"\[(\w+)\]", query)]

    prompt = ChatPromptTemplate.from_messages(
        [SystemMessage(SYSTEM), ("human", "Context:\n{context}\n\nQuestion: {question}")]
    )
    llm = ChatOpenAI(model=MODEL, base_url=live.url + "/v1", api_key="unused", temperature=0, max_tokens=NEW,
                     max_retries=0, timeout=TIMEOUT_S, **kw)  # fmt: skip
    chain = (
        {"context": Fixed() | (lambda ds: "\n\n".join(d.page_content for d in ds)), "question": RunnablePassthrough()}
        | prompt
        | llm
    )
    return chain


def test_langchain_chain_reuses_from_the_second_request(live, tiny):
    chain = _langchain(live, stream_usage=True)
    q1, q2 = "What about [ferry] and [saffron]?", "And [saffron] then [ferry]?"

    def messages(question: str, keys: list[str]) -> list[dict]:
        user = "Context:\n" + "\n\n".join(DOCS[k] for k in keys) + f"\n\nQuestion: {question}"
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]

    first = chain.invoke(q1)
    assert first.usage_metadata["input_token_details"]["cache_read"] == 0  # nothing cached yet
    assert live.learner.wait(TIMEOUT_S)  # the two documents built in the background
    metrics = httpx.get(live.url + "/metrics", timeout=TIMEOUT_S).text
    assert _metric(metrics, "qcfuse_learned_chunks") == 2 and _metric(metrics, "qcfuse_learned_misses_total") == 2

    # the second time (other order, other question): served from the learned caches, as registered ones
    wants = _reference(tiny, messages(q2, ["saffron", "ferry"]), [DOCS["saffron"], DOCS["ferry"]])
    for got, want in zip((chain.invoke(q2), _streamed(chain, q2)), wants):
        assert want.cache_hits == 2 and got.content == want.text
        cached = got.usage_metadata["input_token_details"]["cache_read"]
        assert cached == cached_tokens(want)
        doc_tokens = _tokens(tiny, DOCS["saffron"]) + _tokens(tiny, DOCS["ferry"])
        recomputed = want.recomputed_tokens
        assert cached >= doc_tokens - recomputed  # every document token not recomputed is served from a cache
    metrics = httpx.get(live.url + "/metrics", timeout=TIMEOUT_S).text
    assert _metric(metrics, "qcfuse_learned_hits_total") == 4 and _metric(metrics, "qcfuse_cache_misses_total") == 0


def _streamed(chain, question: str):
    whole = None
    for part in chain.stream(question):
        whole = part if whole is None else whole + part
    return whole


def test_llama_index_query_engine_reuses_from_the_second_request(live, tiny):
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
    from llama_index.llms.openai_like import OpenAILike

    class Raw(BaseEventHandler):
        """Each chat call's messages and response (its `raw`: the openai client's ChatCompletion)."""

        seen: list = []

        @classmethod
        def class_name(cls) -> str:
            return "Raw"

        def handle(self, event, **kw) -> None:
            if isinstance(event, LLMChatEndEvent) and event.response is not None:
                self.seen.append((event.messages, event.response))

    keys = ["glacier", "violin"]
    index = VectorStoreIndex.from_documents(
        [Document(text=DOCS[k], id_=k) for k in keys], embed_model=MockEmbedding(embed_dim=8)
    )
    llm = OpenAILike(model=MODEL, api_base=live.url + "/v1", api_key="unused", is_chat_model=True,
                     context_window=4096, max_tokens=NEW, temperature=0.0, max_retries=0, timeout=TIMEOUT_S)  # fmt: skip
    engine = index.as_query_engine(llm=llm, response_mode="compact", similarity_top_k=2)
    raw = Raw()
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(raw)
    try:
        first = engine.query("How long is the Aletsch glacier?")
        assert first.response and raw.seen[-1][1].raw.usage.prompt_tokens_details.cached_tokens == 0
        assert live.learner.wait(TIMEOUT_S)
        second = engine.query("What gives a Stradivarius its tone?")
    finally:
        dispatcher.event_handlers.remove(raw)
    sent, response = raw.seen[-1]
    messages = [{"role": m.role.value, "content": m.content} for m in sent]
    user = messages[-1]["content"]
    texts = sorted((DOCS[k] for k in keys), key=user.find)  # in the order the prompt holds them
    assert all(t in user for t in texts)
    wants = _reference(tiny, messages, texts)
    assert second.response == response.message.content == wants[0].text  # the answer registered chunks give
    # cached_tokens through OpenAILike's raw response: what the registered chunks' request counts (the
    # quality guard may recompute more of a request on this random model; it decides alike for both)
    assert response.raw.usage.prompt_tokens_details.cached_tokens == cached_tokens(wants[0])
    assert response.raw.model_extra["qcfuse"]["cache_hits"] == 2
    assert response.raw.model_extra["qcfuse"]["chunk_ids"] == [learned_id(t) for t in texts]
    metrics = httpx.get(live.url + "/metrics", timeout=TIMEOUT_S).text
    assert _metric(metrics, "qcfuse_learned_hits_total") == 2


# ---------------------------------------------------------------------------- validation


def test_model_ids():
    ids = ModelIds.of("SmolLM2-135M-Instruct-e81ea92056")
    assert ids.public == "SmolLM2-135M-Instruct"
    assert ids.aliases == {"SmolLM2-135M-Instruct-e81ea92056", "smollm2-135m"}
    assert ModelIds.of("my-model").public == "my-model" and ModelIds.of("my-model").aliases == frozenset()
    named = ModelIds.of("SmolLM2-135M-Instruct-e81ea92056", "rag")
    assert named.public == "rag" and named.accepts("smollm2-135m") and named.accepts(None)
    assert not named.accepts("gpt-4o")


def test_openai_errors_and_status_counts(tiny):
    import openai

    eng = _engine(tiny)
    server = LiveServer(create_app(eng, model_name=MODEL, config=ServeConfig(api_key="k")))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="gpt-4o", messages=msgs, max_tokens=2)
        assert e.value.code == "model_not_found" and e.value.body["param"] == "model"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="temprature"):
            client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, extra_body={"temprature": 0.5})
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10**6)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, user="u", metadata={"a": "b"},
                                            extra_body={"qcfuse": {"method": "full"}})  # fmt: skip
        assert ok.model == MODEL and ok.usage.prompt_tokens_details.cached_tokens == 0
        assert [m.id for m in client.models.list()] == [MODEL]
        text = httpx.get(server.url + "/metrics", timeout=TIMEOUT_S).text
        for route, status, n in (("chat", 404, 1), ("completions", 404, 1), ("chat", 400, 2), ("models", 401, 1),
                                 ("chat", 200, 1), ("models", 200, 1)):  # fmt: skip
            assert _metric(text, f'qcfuse_http_responses_total{{route="{route}",status="{status}"}}') == n, (route,
                                                                                                            status)
    finally:
        server.close()
        eng.close()


def test_status_counts_an_escaping_exception_as_a_500():
    import asyncio

    from qcfuse_core.serve.validation import StatusCounts

    seen: list[tuple[str, int]] = []

    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 413, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def boom(scope, receive, send):
        raise RuntimeError("a bug")

    async def sink(message):
        pass

    async def run(app, path):
        await StatusCounts(app, lambda route, status: seen.append((route, status)))(
            {"type": "http", "path": path}, None, sink
        )

    asyncio.run(run(ok, "/v1/chunks"))
    with pytest.raises(RuntimeError, match="a bug"):
        asyncio.run(run(boom, "/v1/chat/completions"))
    asyncio.run(run(ok, "/nowhere"))
    assert seen == [("chunks", 413), ("chat", 500), ("other", 413)]


def test_learning_options_of_the_command():
    from argparse import Namespace

    from qcfuse_core.serve.cli import learn_config

    assert learn_config(Namespace(learn_after=0, max_learned=4096)) == LearnConfig(enabled=False)
    assert learn_config(Namespace(learn_after=2, max_learned=10)) == LearnConfig(after=2, max_learned=10)
    with pytest.raises(ValueError, match="--learn-after"):
        learn_config(Namespace(learn_after=-1, max_learned=10))
    from qcfuse_core.cli.commands import build_parser

    args = build_parser().parse_args(["serve", "--tenant-max-pending", "8", "--tenant-max-learned-bytes", "2M"])
    assert learn_config(args) == LearnConfig(tenant_pending=8, tenant_bytes=2 << 20)
    assert learn_config(build_parser().parse_args(["serve"])) == LearnConfig()  # the quotas' defaults


def test_without_learning_nothing_is_learned(tiny):
    eng = _engine(tiny)
    prompt = f"Context:\n{DOCS['ferry']}\n\nQuestion: ?"
    with TestClient(create_app(eng, config=ServeConfig(learning=LearnConfig(enabled=False)))) as c:
        for _ in range(2):
            res = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            assert res.status_code == 200 and res.json()["qcfuse"]["chunks"] == 0
        assert "qcfuse_learned_chunks" not in c.get("/metrics").text
    assert len(eng.caches.texts) == 0
    eng.close()
