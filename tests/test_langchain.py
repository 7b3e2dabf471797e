"""LangChain integration (issue 8): the example end to end, QCFuseLLM's surface, the explicit
chunk channel, a chunk never built, the cache builder, and the standard embeddings suites.

One store folder and so one engine for the whole module (the example ingests the sample
corpus into it first). Decoding is greedy with few new tokens to keep the file fast on CPU.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.runnables import RunnablePassthrough
from langchain_tests.integration_tests import EmbeddingsIntegrationTests
from langchain_tests.unit_tests import EmbeddingsUnitTests

from qcfuse_core.types import NodeId
from qcfuse_integrations.langchain import (
    LANGCHAIN_PIP, QCFuseCacheBuilder, QCFuseEmbeddings, QCFuseLLM, document_id, format_docs, qcfuse_callback,
    with_documents,
)

# the embedded model through the shared per-process model cache: fast tier (tests/README.md)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "langchain_rag.py"
NEW_TOKENS = 8


def _load_example():
    spec = importlib.util.spec_from_file_location("langchain_rag_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module




@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The example run once on a fresh store: (module, store folder, per-question rows)."""
    store = tmp_path_factory.mktemp("langchain-store")
    ex = _load_example()
    rows = ex.main(["--store", str(store), "--max-new-tokens", str(NEW_TOKENS)])
    return ex, store, rows


@pytest.fixture(scope="module")
def llm(example) -> QCFuseLLM:
    _, store, _ = example
    return QCFuseLLM(store_dir=str(store), max_new_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def docs(example, llm) -> list[Document]:
    """The corpus as ingested (ids assigned, caches already stored)."""
    ex, _, _ = example
    return list(QCFuseCacheBuilder(llm.engine).transform_documents(ex.load_corpus(ex.sample_corpus_dir(), 400)))


def rag_prompt(ex, chunks: list[Document], question: str) -> str:
    return ex.PROMPT.format(context=format_docs(chunks), question=question)


@pytest.fixture(scope="module")
def prompts(example, docs) -> list[str]:
    ex, _, _ = example
    return [rag_prompt(ex, docs[0:3], "Where is Port Halden?"), rag_prompt(ex, docs[5:7], "What is Veloria?")]


@pytest.fixture(scope="module")
def reference(llm, prompts):
    """generate() over both prompts: the answers every other call path must reproduce."""
    return llm.generate(prompts)


class Tokens(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


class Infos(BaseCallbackHandler):
    def __init__(self) -> None:
        self.infos: list[dict] = []

    def on_llm_end(self, response, **kwargs) -> None:
        self.infos.extend(g[0].generation_info for g in response.generations)


class AsyncTokens(AsyncCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    async def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


# ---------------------------------------------------------------------------- example


def test_example_end_to_end(example, llm):
    ex, store, rows = example
    assert len(rows) == 2 and all(r["answer"].strip() for r in rows)
    second = rows[1]
    assert second["cache_hits"] > 0 and second["cache_misses"] == 0
    assert second["chunks"] == 3 and len(second["chunk_ids"]) == 3 and all(second["chunk_ids"])
    assert second["recomputed_tokens"] < second["context_tokens"]
    # re-ingesting is idempotent: same ids, nothing rebuilt, nothing duplicated in Chroma
    vectorstore = ex.open_vectorstore(store)
    again = ex.ingest(llm, vectorstore, ex.sample_corpus_dir(), 400)
    assert again["built"] == 0 and again["reused"] == again["chunks"]
    assert vectorstore._collection.count() == again["chunks"]


def test_full_recompute_equals_full_mode(llm, prompts):
    full = llm.generate([prompts[0]], method="full").generations[0][0]
    assert full.generation_info["method"] == "full"
    # every chunk token recomputed through the fused path (random at ratio 1 picks them all)
    fused = llm.generate([prompts[0]], method="random", ratio=1.0).generations[0][0]
    assert fused.text == full.text
    info = fused.generation_info
    assert info["recomputed_tokens"] == info["context_tokens"] and info["cache_hits"] == 3


# ---------------------------------------------------------------------------- LLM surface


def test_generate_batch_invoke_stream(llm, prompts, docs, reference):
    result = reference
    texts = [g[0].text for g in result.generations]
    for g, ids in zip(result.generations, ([d.id for d in docs[0:3]], [d.id for d in docs[5:7]])):
        info = g[0].generation_info
        assert info["requested_method"] == "qcfuse" and info["cache_hits"] == len(ids) and info["cache_misses"] == 0
        escalated_to_full = bool(info["guard"]["rungs"]) and info["guard"]["rungs"][-1][0] >= 1.0
        assert info["method"] == ("full" if escalated_to_full else "qcfuse")  # what answered
        assert info["chunk_ids"] == ids
        assert 0 < info["ttft_ms"] <= info["total_ms"]
    assert result.llm_output["fingerprint"] == llm.engine.caches.fingerprint
    assert llm.batch(prompts) == texts
    handler = Tokens()
    streamed = list(llm.stream(prompts[0], config={"callbacks": [handler]}))
    assert "".join(streamed) == texts[0]
    assert handler.tokens == [s for s in streamed if s] and len(handler.tokens) > 1


def test_invoke(llm, prompts, reference):
    assert llm.invoke(prompts[1]) == reference.generations[1][0].text


def test_what_answered_reaches_a_completion_chain_through_the_callback(llm, prompts, reference):
    """The completion LLM's statistics (its generations' generation_info) reach
    qcfuse_callback() from a chain that ends in a string, streamed too."""
    from langchain_core.output_parsers import StrOutputParser

    chain = llm | StrOutputParser()
    with qcfuse_callback() as cb:
        assert chain.invoke(prompts[1]) == reference.generations[1][0].text
        assert "".join(chain.stream(prompts[1])) == reference.generations[1][0].text
    want = reference.generations[1][0].generation_info["answered"]
    assert [c["answered"] for c in cb.calls] == [want, want] and cb.answered == want


async def test_ainvoke_astream_do_not_block_the_loop(llm, prompts, reference):
    expected = reference.generations[1][0].text
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    try:
        assert await llm.ainvoke(prompts[1]) == expected
        handler = AsyncTokens()
        chunks = [c async for c in llm.astream(prompts[1], config={"callbacks": [handler]})]
    finally:
        task.cancel()
    assert "".join(chunks) == expected
    assert handler.tokens == [c for c in chunks if c] and len(handler.tokens) > 1
    assert ticks >= 5, "the event loop was blocked while the model decoded"


async def test_astream_closed_early_releases_the_engine(llm, prompts):
    stream = llm.astream(prompts[1], max_new_tokens=NEW_TOKENS)
    first = await stream.__anext__()
    await stream.aclose()
    assert first
    assert await llm.ainvoke(prompts[1], max_new_tokens=2)  # the engine lock was let go


def test_identity_and_tokens(example, llm, prompts):
    _, store, _ = example
    # one engine per (store, model) per process, whoever asks for it
    assert QCFuseLLM(store_dir=str(store), method="naive").engine is llm.engine
    assert QCFuseCacheBuilder(store_dir=str(store)).engine is llm.engine
    assert QCFuseLLM.from_engine(llm.engine, ratio=0.5).engine is llm.engine
    assert llm._llm_type == "qcfuse"
    assert llm._identifying_params["method"] == "qcfuse" and llm._identifying_params["model"] == "embedded"
    ids = llm.get_token_ids(prompts[0])
    assert ids == llm.engine.tokenizer(prompts[0], add_special_tokens=False).input_ids
    assert llm.get_num_tokens(prompts[0]) == len(ids)


def test_bad_options_raise(llm, prompts):
    with pytest.raises(ValueError, match="unknown method 'nope'; valid: .*full"):
        llm.invoke(prompts[0], method="nope")
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['max_tokenz'\]; valid: .*max_tokens"):
        llm.invoke(prompts[0], max_tokenz=3)
    short = llm.generate([prompts[0]], max_tokens=2).generations[0][0]  # LangChain's usual name
    assert short.generation_info["new_tokens"] == 2 and short.generation_info["finish_reason"] == "length"
    with pytest.raises(ValueError):
        QCFuseLLM(ratio=1.5)


def test_missing_langchain_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m.startswith("qcfuse_integrations.langchain")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "langchain_core", None)
    with pytest.raises(ImportError, match=r"pip install 'qcfuse\[langchain\]'"):
        importlib.import_module("qcfuse_integrations.langchain")
    assert LANGCHAIN_PIP == "pip install 'qcfuse[langchain]'"


# ---------------------------------------------------------------------------- explicit channel


def test_doc_ids_label_and_check_chunks(llm, prompts, docs):
    chosen = docs[1].id
    stats = Infos()
    llm.bind(doc_ids=[chosen]).invoke(prompts[0], max_new_tokens=2, config={"callbacks": [stats]})
    assert stats.infos[0]["chunk_ids"][1] == chosen and stats.infos[0]["cache_hits"] == 3
    with pytest.raises(ValueError, match="no chunk was built under this id"):
        llm.invoke(prompts[0], doc_ids=["never-built"])
    with pytest.raises(ValueError, match="does not occur verbatim in the prompt"):
        llm.invoke(prompts[0], doc_ids=[docs[9].id])  # built, but not in this prompt
    with pytest.raises(TypeError, match="doc_ids must be a list of id strings, got str"):
        llm.invoke(prompts[0], doc_ids=chosen)
    with pytest.raises(TypeError, match="documents must be a list of Documents, got Document"):
        llm.invoke(prompts[0], documents=docs[0])


def test_documents_channel_in_a_chain(example, llm):
    ex, store, rows = example
    retriever = ex.open_vectorstore(store).as_retriever(search_kwargs={"k": 3})
    chain = {"context": retriever, "question": RunnablePassthrough()} | with_documents(ex.PROMPT, llm)
    stats = ex.FusionStats()
    answer = chain.invoke(ex.QUESTIONS[1], config={"callbacks": [stats]})
    retrieved = [d.id for d in retriever.invoke(ex.QUESTIONS[1])]
    assert answer == rows[1]["answer"]  # same prompt, same chunks as the content-only chain
    assert stats.runs[-1]["chunk_ids"] == retrieved and stats.runs[-1]["cache_hits"] == 3
    altered = [Document(page_content="not what the formatter rendered at all, no", id="x")]
    with pytest.raises(ValueError, match="does not occur verbatim in the prompt"):
        llm.invoke("Context: something else entirely.\nQuestion: ?", documents=altered)


def test_chunk_never_built_is_computed_stored_and_hit(example, llm):
    ex, _, _ = example
    doc = Document(page_content="The Halden ferry to the mainland leaves at seven every morning from pier four.",
                   id="ferry-1")
    prompt = rag_prompt(ex, [doc], "When does the ferry leave?")
    info = lambda **kw: llm.generate([prompt], max_new_tokens=3, **kw).generations[0][0].generation_info  # noqa: E731
    unseen = info()
    assert unseen["chunks"] == 0 and unseen["cache_misses"] == 0  # content matching cannot know it
    first = info(documents=[doc])
    assert first["cache_misses"] == 1 and first["cache_hits"] == 0 and first["chunk_ids"] == ["ferry-1"]
    assert llm.engine.caches.store.resolve(NodeId("ferry-1")) is not None
    second = info(documents=[doc])
    assert second["cache_hits"] == 1 and second["cache_misses"] == 0
    by_content = info()  # registered on first use: now found without the channel too
    assert by_content["cache_hits"] == 1 and by_content["chunk_ids"] == ["ferry-1"]


# ---------------------------------------------------------------------------- cache builder


def test_cache_builder_ids_are_deterministic(llm, docs):
    raw = [Document(page_content=d.page_content, metadata={"source": d.metadata["source"]}) for d in docs[:4]]
    builder = QCFuseCacheBuilder(llm.engine)
    first, second = builder.transform_documents(raw), builder.transform_documents(raw)
    assert [d.id for d in first] == [d.id for d in second] == [d.id for d in docs[:4]]
    assert builder.last_build.built == 0 and builder.last_build.reused == 4
    assert all(d.metadata["qcfuse_chunk_key"] for d in first) and raw[0].id is None  # inputs untouched
    # the index within a source is part of the id: the same text twice gets two ids
    twice = builder.transform_documents([raw[0], raw[0]])
    assert twice[0].id != twice[1].id
    assert twice[1].id == document_id(raw[0].metadata["source"], 1, raw[0].page_content)
    kept = builder.transform_documents([Document(page_content=raw[0].page_content, id="mine")])
    assert kept[0].id == "mine"
    replaced = QCFuseCacheBuilder(llm.engine, overwrite_ids=True).transform_documents(
        [Document(page_content=raw[0].page_content, id="mine", metadata=raw[0].metadata)])
    assert replaced[0].id == docs[0].id
    with pytest.raises(ValueError, match="index must be >= 0"):
        document_id("a", -1, "text")


# ---------------------------------------------------------------------------- embeddings


class TestQCFuseEmbeddingsUnit(EmbeddingsUnitTests):
    @property
    def embeddings_class(self) -> type[QCFuseEmbeddings]:
        return QCFuseEmbeddings


class TestQCFuseEmbeddingsIntegration(EmbeddingsIntegrationTests):
    @property
    def embeddings_class(self) -> type[QCFuseEmbeddings]:
        return QCFuseEmbeddings


def test_embeddings_are_unit_vectors_and_rank_sensibly():
    emb = QCFuseEmbeddings()
    q = emb.embed_query("How tall is the lighthouse?")
    d = emb.embed_documents(["The stone tower is thirty-two metres tall.", "Kelp forests grow offshore."])
    assert len(q) == emb.dimensions == 384 and abs(sum(x * x for x in q) - 1) < 1e-4
    assert sum(a * b for a, b in zip(q, d[0])) > sum(a * b for a, b in zip(q, d[1]))
    with pytest.raises(TypeError, match="list of strings"):
        emb.embed_documents("one string")
