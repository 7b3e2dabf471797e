"""What a cold query reports (issue 40, items 2 and 3), on a tiny random model with a byte
tokenizer, in each framework's plain idiom.

A cache built during a request - by the engine's lookup, or by the background build of a
retrieval that the request waited for or is the first to use - counts as built, never as a
hit, and the request's TTFT includes the wait. A LangChain retriever that is a plain
function (`RunnableLambda`) returning Documents is learned like a vector-store retriever:
its texts hit from the second call.
"""

from __future__ import annotations

import pytest

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.model.testing import tiny_model
from qcfuse_core.types import FusionResult

TEXTS = [
    "Port Halden is a small harbour town on the north coast of Veloria, known for its red lighthouse.",
    "The Zephyr Institute was founded in 1987 by the marine biologist Ada Ferreira at Cape Wrayth.",
]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def engine() -> QCFuseEngine:
    """A fresh engine (its own in-memory store and learner): every test starts cold."""
    adapter = tiny_model("llama", tokenizer=True)
    adapter.tokenizer.chat_template = TEMPLATE
    return QCFuseEngine(adapter)


def test_the_engine_counts_caches_built_during_the_request():
    eng = engine()
    cold = eng.answer("Where is Port Halden?", TEXTS, method="naive", max_new_tokens=2)
    assert (cold.cache_hits, cold.cache_misses, cold.cache_built, cold.chunks) == (0, 2, 2, 2)
    assert cold.ttft_ms >= cold.timings_ms["lookup_ms"]  # the builds happened inside the TTFT
    assert cold.to_dict()["cache_built"] == 2
    warm = eng.answer("Where is Port Halden?", TEXTS, method="naive", max_new_tokens=2)
    assert (warm.cache_hits, warm.cache_misses, warm.cache_built) == (2, 0, 0)


def test_the_cli_line_says_what_was_built_now():
    from qcfuse_core.cli.commands import _cache_line

    assert _cache_line(FusionResult(cache_hits=1, cache_misses=3, cache_built=3)) == "1 hits / 3 misses (3 built now)"
    assert _cache_line(FusionResult(cache_hits=4)) == "4 hits / 0 misses"


# ---------------------------------------------------------------------- LangChain


def _langchain_chain(retriever, chat):
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    prompt = ChatPromptTemplate.from_messages([("system", "Answer from the context."),
                                               ("human", "Context:\n{context}\n\nQuestion: {question}")])

    def format_docs(docs):
        return "\n\n".join(d.page_content for d in docs)

    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | chat


def test_a_cold_langchain_query_reports_its_builds():
    pytest.importorskip("langchain_core")
    from langchain_core.documents import Document
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langchain_core.vectorstores import InMemoryVectorStore

    from qcfuse_integrations.langchain import ChatQCFuse

    docs = [Document(page_content=t, id=f"fact-{i}") for i, t in enumerate(TEXTS)]
    retriever = InMemoryVectorStore.from_documents(docs, DeterministicFakeEmbedding(size=16)).as_retriever(
        search_kwargs={"k": 2})
    chat = ChatQCFuse.from_engine(engine(), max_tokens=2, method="naive")
    chain = _langchain_chain(retriever, chat)
    cold = chain.invoke("Who founded the Zephyr Institute?").response_metadata["qcfuse"]
    assert (cold["chunks"], cold["cache_hits"], cold["cache_misses"], cold["cache_built"]) == (2, 0, 2, 2)
    assert cold["ttft_ms"] >= cold["build_wait_ms"]  # the wait for the background builds is in the TTFT
    warm = chain.invoke("Who founded the Zephyr Institute?").response_metadata["qcfuse"]
    assert (warm["chunks"], warm["cache_hits"], warm["cache_misses"], warm["cache_built"]) == (2, 2, 0, 0)


def test_a_runnable_lambda_retriever_hits_by_the_second_call():
    pytest.importorskip("langchain_core")
    from langchain_core.documents import Document
    from langchain_core.runnables import RunnableLambda

    from qcfuse_integrations.langchain import ChatQCFuse

    def search(question: str) -> list[Document]:  # a plain function, not a BaseRetriever
        return [Document(page_content=t, id=f"fact-{i}") for i, t in enumerate(TEXTS)]

    chat = ChatQCFuse.from_engine(engine(), max_tokens=2, method="naive")
    chain = _langchain_chain(RunnableLambda(search), chat)
    first = chain.invoke("Where is Port Halden?").response_metadata["qcfuse"]
    second = chain.invoke("Where is Port Halden?").response_metadata["qcfuse"]
    assert first["chunks"] == 2 and first["cache_built"] == 2 and first["chunk_ids"] == ["fact-0", "fact-1"]
    assert (second["cache_hits"], second["cache_misses"]) == (2, 0)
    assert chat.learner.counters()["unmatched_prompts"] == 0


def test_a_retriever_of_plain_strings_gets_a_warning_naming_the_fix(caplog):
    pytest.importorskip("langchain_core")
    import logging

    from langchain_core.runnables import RunnableLambda

    from qcfuse_integrations.langchain import ChatQCFuse

    # texts no retriever in this process returned, long enough to look like retrieved context
    long = [f"Tide note {i}: the tide tables of harbour {i} change with the moon and the wind. " * 3 for i in range(3)]
    chat = ChatQCFuse.from_engine(engine(), max_tokens=2, method="naive")
    chain = _langchain_chain(RunnableLambda(lambda q: [type("Doc", (), {"page_content": t})() for t in long]), chat)
    with caplog.at_level(logging.WARNING, logger="qcfuse_integrations.learning"):
        stats = chain.invoke("Where is Port Halden?").response_metadata["qcfuse"]
    assert stats["chunks"] == 0 and stats["unmatched"]
    warning = " ".join(r.getMessage() for r in caplog.records if "matched no cached chunk" in r.getMessage())
    assert "return langchain_core.documents.Document objects" in warning
    assert "QCFuseCacheBuilder(llm.engine).transform_documents(docs)" in warning


# ---------------------------------------------------------------------- LlamaIndex


def test_a_cold_llama_index_query_reports_its_builds():
    pytest.importorskip("llama_index.core")
    from llama_index.core import Document, MockEmbedding, VectorStoreIndex

    from qcfuse_integrations.llama_index import FusionStats, QCFuseLLM

    llm = QCFuseLLM(engine=engine(), max_tokens=2, method="naive")
    index = VectorStoreIndex.from_documents([Document(text=t) for t in TEXTS], embed_model=MockEmbedding(embed_dim=8))
    query_engine = index.as_query_engine(llm=llm, similarity_top_k=2)
    stats = FusionStats.attach()
    try:
        query_engine.query("Who founded the Zephyr Institute?")
        query_engine.query("Who founded the Zephyr Institute?")
    finally:
        stats.detach()
    (_, cold), (_, warm) = stats.events[-2:]
    assert (cold["chunks"], cold["cache_hits"], cold["cache_misses"], cold["cache_built"]) == (2, 0, 2, 2)
    assert (warm["chunks"], warm["cache_hits"], warm["cache_built"]) == (2, 2, 0)
