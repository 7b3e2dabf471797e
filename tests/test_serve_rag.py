"""A RAG chain of each framework end to end through a live `qcfuse serve` (qcfuse_core/serve/):
LangChain's LCEL chain (retriever -> prompt -> ChatOpenAI -> StrOutputParser) and LlamaIndex's
query engine (VectorStoreIndex -> compact synthesis -> OpenAILike), real clients over HTTP on
127.0.0.1, on the tiny random fp32 CPU model with a byte tokenizer and a toy chat template.

The chunks are built through POST /v1/chunks first, as an ingestion pipeline elsewhere would;
each framework puts them verbatim into the prompt it sends, so the server finds them by content
and fuses their caches. The server learns no chunk from prompts here (`LearnConfig(enabled=
False)`): this is the registered path; tests/test_serve_learned.py has the learned one. The model is random, its words mean nothing: an answer must be the
engine's own answer to the exact prompt the client sent (captured on the wire), and the
statistics must say which chunks hit. Every wait is bounded; the server stops at the end.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from qcfuse_core import EngineConfig
from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.engine.chat import render
from qcfuse_core.learn import LearnConfig
from qcfuse_core.model.testing import tiny_model
from qcfuse_core.serve.app import ServeConfig, create_app
from qcfuse_core.store import MemoryStore
from tests.qc_fixtures import TEMPLATE, LiveServer, _metric

NEW = 10  # max_tokens of every answer
MODEL = "tiny-rag"
TIMEOUT_S = 60.0  # every HTTP call
SYSTEM = EngineConfig().frame.system_prompt  # the engine's frame: a chat with it renders as `engine.complete`'s prompt

# LangChain's corpus: the keyword retriever ranks ferry > saffron for Q1 and saffron > ferry for Q2
LC_DOCS = {
    "ferry": "The coastal ferry from Bergen to Kirkenes calls at thirty-four ports and takes eleven days there "
    "and back.",
    "saffron": "Saffron is picked by hand from the crocus flower; each bloom gives only three red stigmas, dried "
    "over embers.",
    "mechanism": "The Antikythera mechanism, raised from a shipwreck in 1901, used bronze gears to predict eclipses.",
    "bees": "Honeybees tell their sisters the distance and direction of flowers with a waggle dance inside the hive.",
}
Q1 = "How many ports does the Bergen ferry call at, and how is saffron picked?"
Q2 = "Which crocus flower gives saffron its red stigmas, and where does the ferry sail?"

# LlamaIndex's corpus (apart from LangChain's, so the two tests do not depend on their order)
LI_DOCS = {
    "glacier": "The Aletsch glacier in the Swiss Alps is twenty kilometres long and loses fifty metres a year.",
    "violin": "A Stradivarius violin owes part of its tone to maple wood grown during a cold century.",
    "tides": "Spring tides come twice a month, when the sun and the moon pull along one line.",
}


@pytest.fixture(scope="module")
def engine():
    adapter = tiny_model("llama", tokenizer=True)
    adapter.tokenizer.chat_template = TEMPLATE
    return QCFuseEngine(adapter, store=MemoryStore(), config=EngineConfig())  # no chunk built yet


@pytest.fixture(scope="module")
def live(engine):
    server = LiveServer(create_app(engine, model_name=MODEL, config=ServeConfig(learning=LearnConfig(enabled=False))))
    yield server
    server.close()


class Wire:
    """An httpx client that keeps the JSON body of every chat request it sends: the messages
    exactly as the framework rendered them."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.client = httpx.Client(timeout=TIMEOUT_S, event_hooks={"request": [self._keep]})

    def _keep(self, request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            self.bodies.append(json.loads(request.content))

    @property
    def messages(self) -> list[dict]:
        return self.bodies[-1]["messages"]


def _post_chunks(live, texts: list[str], ids: list[str]) -> None:
    res = httpx.post(live.url + "/v1/chunks", json={"texts": texts, "ids": ids}, timeout=TIMEOUT_S)
    assert res.status_code == 200, res.text
    assert [d["id"] for d in res.json()["data"]] == ids


def _engine_chat(engine: QCFuseEngine, messages: list[dict]) -> str:
    """The engine's greedy answer to `messages` in process: rendered in the chat template, its
    registered chunk texts found by content (what the chat route does before it submits)."""
    prompt = render(engine.tokenizer, messages)
    return engine.complete(prompt, framed=False, max_new_tokens=NEW, temperature=0.0).text


# ---------------------------------------------------------------------------- LangChain


def _langchain_chain(live, wire: Wire):
    """retriever -> prompt -> ChatOpenAI -> StrOutputParser, and the callback that collects the
    server's statistics of every LLM call."""
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.documents import Document
    from langchain_core.messages import SystemMessage
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.retrievers import BaseRetriever
    from langchain_core.runnables import RunnablePassthrough
    from langchain_openai import ChatOpenAI

    def words(text: str) -> set[str]:
        return set(re.findall(r"[a-z0-9]+", text.lower()))

    class KeywordRetriever(BaseRetriever):
        """The k documents sharing the most words with the query (a tie: the earlier one)."""

        documents: list[Document]
        k: int = 2

        def _get_relevant_documents(self, query: str, *, run_manager) -> list[Document]:
            q = words(query)
            return sorted(self.documents, key=lambda d: -len(q & words(d.page_content)))[: self.k]

    class StatsChatOpenAI(ChatOpenAI):
        """ChatOpenAI keeping the server's `qcfuse` statistics in `response_metadata["qcfuse"]`:
        ChatOpenAI drops a response's unknown top-level fields (the openai client keeps them in
        `model_extra`, which `model_dump` includes)."""

        def _create_chat_result(self, response, generation_info=None):
            result = super()._create_chat_result(response, generation_info)
            raw = response if isinstance(response, dict) else response.model_dump()
            if "qcfuse" in raw:
                result.generations[0].message.response_metadata["qcfuse"] = raw["qcfuse"]
            return result

        def _convert_chunk_to_generation_chunk(self, chunk, default_chunk_class, base_generation_info):
            gen = super()._convert_chunk_to_generation_chunk(chunk, default_chunk_class, base_generation_info)
            if gen is not None and "qcfuse" in chunk:  # the closing chunk of a stream
                gen.message.response_metadata["qcfuse"] = chunk["qcfuse"]
            return gen

    class Stats(BaseCallbackHandler):
        def __init__(self) -> None:
            self.seen: list[dict | None] = []

        def on_llm_end(self, response, **kw) -> None:
            self.seen.append(response.generations[0][0].message.response_metadata.get("qcfuse"))

    docs = [Document(page_content=t, id=i) for i, t in LC_DOCS.items()]
    retriever = KeywordRetriever(documents=docs)
    prompt = ChatPromptTemplate.from_messages(
        [SystemMessage(SYSTEM), ("human", "Context:\n{context}\n\nQuestion: {question}")]
    )
    llm = StatsChatOpenAI(
        model=MODEL,
        base_url=live.url + "/v1",
        api_key="unused",
        temperature=0,
        max_tokens=NEW,
        max_retries=0,
        timeout=TIMEOUT_S,
        http_client=wire.client,
    )
    chain = (
        {"context": retriever | (lambda ds: "\n\n".join(d.page_content for d in ds)), "question": RunnablePassthrough()}
        | prompt
        | llm
        | StrOutputParser()
    )
    return chain, retriever, Stats()


def _user_prompt(question: str, ids: list[str]) -> str:
    return "Context:\n" + "\n\n".join(LC_DOCS[i] for i in ids) + f"\n\nQuestion: {question}"


def test_langchain_rag_chain(live, engine):
    wire = Wire()
    chain, retriever, stats = _langchain_chain(live, wire)
    assert [d.id for d in retriever.invoke(Q1)] == ["ferry", "saffron"]
    assert [d.id for d in retriever.invoke(Q2)] == ["saffron", "ferry"]

    def ask(question: str, ids: list[str]) -> dict:
        """One chain run: the chunks reached the server verbatim inside the prompt, and the answer
        is `engine.complete`'s to that prompt (system prompt = the engine's frame)."""
        answer = chain.invoke(question, config={"callbacks": [stats]})
        assert answer  # not an empty answer matching an empty one
        user = _user_prompt(question, ids)
        assert wire.messages == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        assert answer == engine.complete(user, max_new_tokens=NEW, temperature=0.0).text
        assert stats.seen[-1] is not None
        return stats.seen[-1]

    try:
        # 1. the chunks not built: the server finds none of them in the prompt
        before = ask(Q1, ["ferry", "saffron"])
        assert before["chunks"] == 0 and before["cache_hits"] == 0

        # 2. built through POST /v1/chunks: both found by content, served from their caches
        _post_chunks(live, list(LC_DOCS.values()), list(LC_DOCS))
        got = ask(Q1, ["ferry", "saffron"])
        assert got["chunks"] == 2 and got["cache_hits"] == 2 and got["cache_misses"] == 0
        assert got["chunk_ids"] == ["ferry", "saffron"]

        # 3. the same chunks in the other order still hit (position-independent caches)
        swapped = ask(Q2, ["saffron", "ferry"])
        assert swapped["cache_hits"] == 2 and swapped["cache_misses"] == 0
        assert swapped["chunk_ids"] == ["saffron", "ferry"]

        # 4. streamed through the chain: the same answer, the statistics in the closing chunk
        want = engine.complete(_user_prompt(Q2, ["saffron", "ferry"]), max_new_tokens=NEW, temperature=0.0).text
        parts = list(chain.stream(Q2, config={"callbacks": [stats]}))
        assert "".join(parts) == want and len(parts) > 1
        assert stats.seen[-1]["cache_hits"] == 2 and stats.seen[-1]["chunk_ids"] == ["saffron", "ferry"]

        # 5. async (ChatOpenAI's async client)
        answer = asyncio.run(asyncio.wait_for(chain.ainvoke(Q2, config={"callbacks": [stats]}), TIMEOUT_S))
        assert answer == want
        assert stats.seen[-1]["cache_hits"] == 2
    finally:
        wire.client.close()


# ---------------------------------------------------------------------------- LlamaIndex


def test_llama_index_query_engine(live, engine):
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.schema import MetadataMode
    from llama_index.llms.openai_like import OpenAILike

    # 1. index: one node per document; the text LlamaIndex renders into the prompt is the node's
    #    content with its metadata (MetadataMode.LLM), and that text is what gets cached
    documents = [Document(text=t, id_=i, metadata={"topic": i}) for i, t in LI_DOCS.items()]
    index = VectorStoreIndex.from_documents(documents, embed_model=MockEmbedding(embed_dim=8))
    nodes = list(index.docstore.docs.values())
    assert len(nodes) == len(LI_DOCS)
    rendered = {n.node_id: n.get_content(metadata_mode=MetadataMode.LLM) for n in nodes}
    _post_chunks(live, list(rendered.values()), list(rendered))

    wire = Wire()
    llm = OpenAILike(
        model=MODEL,
        api_base=live.url + "/v1",
        api_key="unused",
        is_chat_model=True,
        context_window=4096,  # room for both nodes: compact packs them into one prompt, unsplit
        max_tokens=NEW,
        temperature=0.0,
        max_retries=0,
        timeout=TIMEOUT_S,
        http_client=wire.client,
    )
    question = "How long is the Aletsch glacier?"
    try:
        for streaming in (False, True):
            query_engine = index.as_query_engine(
                llm=llm, response_mode="compact", similarity_top_k=2, streaming=streaming
            )
            metrics = httpx.get(live.url + "/metrics", timeout=TIMEOUT_S).text
            hits, misses = _metric(metrics, "qcfuse_cache_hits_total"), _metric(metrics, "qcfuse_cache_misses_total")
            sent = len(wire.bodies)

            # 2. the query: retrieve two nodes, put their texts in one prompt, one chat request
            response = query_engine.query(question)
            answer = "".join(response.response_gen) if streaming else response.response
            assert answer and len(wire.bodies) == sent + 1
            prompt = wire.messages[-1]["content"]
            used = [n.node.node_id for n in response.source_nodes]
            assert len(used) == 2 and all(rendered[i] in prompt for i in used)

            # 3. the engine's own answer to that prompt; the server served both nodes from cache
            assert answer == _engine_chat(engine, wire.messages)
            metrics = httpx.get(live.url + "/metrics", timeout=TIMEOUT_S).text
            assert _metric(metrics, "qcfuse_cache_hits_total") == hits + 2
            assert _metric(metrics, "qcfuse_cache_misses_total") == misses
    finally:
        wire.client.close()
