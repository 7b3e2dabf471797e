"""LlamaIndex integration: the example end to end, then each promise of issue 7 on the same store.

One store per module: the example ingests the sample corpus into it (chunk caches, content
index, Chroma), and the later tests query it with the embedded SmolLM2-135M-Instruct. Every
generation is greedy and short (<= 12 new tokens) to keep the file quick on a CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import io
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document, Settings, VectorStoreIndex  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, MessageRole  # noqa: E402
from llama_index.core.schema import NodeWithScore, TextNode  # noqa: E402

from qcfuse_core.retrieval.texts import ChunkTextIndex  # noqa: E402
from qcfuse_core.types import Piece  # noqa: E402
from qcfuse_integrations.llama_index import (  # noqa: E402
    QCFuseCacheBuilder,
    QCFuseEmbedding,
    QCFuseLLM,
    FusionStats,
    QCFuseNodePostprocessor,
    chroma_vector_store,
    render_for_prompt,
    retrieved_nodes,
)
from qcfuse_core.retrieval.texts import split_prompt  # noqa: E402
from qcfuse_integrations.llama_index.postprocessor import set_retrieved_nodes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NEW = 6  # max new tokens everywhere (the example too, so answers can be compared)
Q_FOUNDER = "Who founded the Zephyr Institute?"


def _load_example():
    spec = importlib.util.spec_from_file_location("llamaindex_rag_example", ROOT / "examples" / "llamaindex_rag.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------- fixtures




@pytest.fixture(scope="module", autouse=True)
def _offline_settings():
    """LlamaIndex falls back to hosted providers unless both are set; restore afterwards."""
    old = Settings._llm, Settings._embed_model
    Settings.embed_model = QCFuseEmbedding()
    yield
    Settings._llm, Settings._embed_model = old


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The example run once: (store folder, its printed output, its per-question results)."""
    store = tmp_path_factory.mktemp("li_store")
    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out):
        results = _load_example().main(["--store", str(store), "--max-new-tokens", str(NEW)])
    print(f"\n[example: {time.perf_counter() - t0:.1f} s]\n{out.getvalue()}")
    return SimpleNamespace(store=store, output=out.getvalue(), results=results)


@pytest.fixture(scope="module")
def index(example):
    return VectorStoreIndex.from_vector_store(chroma_vector_store(example.store / "chroma"), embed_model=QCFuseEmbedding())


def make_llm(example, **kw) -> QCFuseLLM:
    kw.setdefault("max_new_tokens", NEW)
    return QCFuseLLM(store_dir=str(example.store), **kw)


def postprocessor(example) -> QCFuseNodePostprocessor:
    return QCFuseNodePostprocessor(store_dir=str(example.store))


@pytest.fixture
def fusion():
    """The LLM calls' statistics, as the instrumentation's end events carry them."""
    handler = FusionStats.attach()
    yield handler
    handler.detach()


# ---------------------------------------------------------------------- no model needed


def test_missing_llama_index_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m.startswith("qcfuse_integrations.llama_index")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "llama_index.core", None)  # import of it raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'qcfuse\[llama-index\]'"):
        importlib.import_module("qcfuse_integrations.llama_index")


def test_bad_settings_raise_listing_valid_values():
    with pytest.raises(ValueError, match=r"unknown method 'nope'; valid: .*epic.*full"):
        QCFuseLLM(method="nope")
    with pytest.raises(ValueError):
        QCFuseLLM(ratio=1.5)
    with pytest.raises(ValueError, match="unknown method"):
        QCFuseLLM().complete("hello", method="nope")  # checked before any model is loaded


def test_render_for_prompt_is_the_llm_rendering_stripped():
    node = TextNode(text="  The tower is thirty-two metres tall.  ", metadata={"title": "Lighthouse", "secret": "x"},
                    excluded_llm_metadata_keys=["secret"])
    text = render_for_prompt(node)
    assert text == "title: Lighthouse\n\n  The tower is thirty-two metres tall."  # outer whitespace only
    assert "secret" not in text


def test_unframed_pieces_splits_a_templated_prompt():
    a, b = Piece("chunk", "A" * 40, "a"), Piece("chunk", "B" * 40, "b")
    prompt = "<sys>head " + a.text + "\n\n" + b.text + " question<assistant>"
    pieces = split_prompt(prompt, [a, b])
    assert [p.kind for p in pieces] == ["prefix", "chunk", "text", "chunk", "suffix"]
    assert "".join(p.text for p in pieces) == prompt
    assert [p.kind for p in split_prompt("just a question", [])] == ["suffix"]


async def test_async_postprocessing_keeps_ids_in_the_query_task():
    """The base class would run _postprocess_nodes via to_thread, in a copied context."""
    set_retrieved_nodes(None)
    pp = QCFuseNodePostprocessor(prefetch=False)
    nodes = [NodeWithScore(node=TextNode(text="Some retrieved chunk text, long enough.", id_="n1"), score=1.0)]
    assert await pp.apostprocess_nodes(nodes) == nodes
    assert dict(retrieved_nodes()) == {"Some retrieved chunk text, long enough.": "n1"}


def test_embedding_offline_minilm():
    emb = QCFuseEmbedding()
    q = emb.get_query_embedding("Who founded the marine research station?")
    docs = emb.get_text_embedding_batch(["Ada Ferreira founded the Zephyr Institute.", "Fish soup with dill."])
    assert len(q) == 384 and len(docs) == 2
    dot = [sum(x * y for x, y in zip(q, d)) for d in docs]
    assert dot[0] > dot[1]
    assert asyncio.run(emb.aget_query_embedding("Who founded the marine research station?")) == pytest.approx(q, abs=1e-5)


# ---------------------------------------------------------------------- the example, end to end


def test_example_end_to_end(example):
    r1, r2 = example.results
    assert "ingested 12 documents" in example.output and "cache hits" in example.output
    for r in example.results:
        assert r["answer"] and r["chunks"] == 2 and r["cache_misses"] == 0
        assert len(r["chunk_ids"]) == 2 and None not in r["chunk_ids"]  # content matching found every node
    assert r2["cache_hits"] > 0
    assert 0 < r1["recomputed_tokens"] < r1["context_tokens"]
    # a second run over the same store ingests nothing and still hits
    with contextlib.redirect_stdout(io.StringIO()) as out:
        again = _load_example().main(["--store", str(example.store), "--max-new-tokens", "1",
                                      "--question", Q_FOUNDER])
    assert "-> 0 new chunks" in out.getvalue() and "Chroma: 12 vectors" in out.getvalue()
    assert again[0]["cache_hits"] == 2


def test_metadata_comes_from_the_model(example):
    llm = make_llm(example, max_new_tokens=20)
    meta = llm.metadata
    assert meta.context_window == llm.engine.adapter.model.config.max_position_embeddings
    assert meta.num_output == 20 and "SmolLM2" in meta.model_name and meta.is_chat_model
    assert make_llm(example).engine is llm.engine  # one engine per (store, model) per process


async def test_aquery_and_async_streaming(example, index, fusion):
    llm = make_llm(example)
    qe = index.as_query_engine(llm=llm, similarity_top_k=2, node_postprocessors=[postprocessor(example)])
    response = await qe.aquery(Q_FOUNDER)
    assert str(response).strip() == example.results[0]["answer"]  # greedy: same as the sync query
    stats = fusion.last  # the aquery's own call, not a stale one
    assert stats["chunk_ids"] == [n.node.node_id for n in response.source_nodes]
    assert stats["cache_hits"] == 2

    streaming = index.as_query_engine(llm=llm, similarity_top_k=2, streaming=True,
                                      node_postprocessors=[postprocessor(example)])
    stream = await streaming.aquery(Q_FOUNDER)
    text = "".join([t async for t in stream.async_response_gen()])
    assert text.strip() == example.results[0]["answer"]


def test_sync_streaming(example, index, fusion):
    llm = make_llm(example)
    qe = index.as_query_engine(llm=llm, similarity_top_k=2, streaming=True)
    response = qe.query(Q_FOUNDER)
    deltas = list(response.response_gen)
    assert len(deltas) > 1 and "".join(deltas).strip() == example.results[0]["answer"]
    assert fusion.last["cache_hits"] == 2


async def test_acomplete_does_not_block_the_loop(example):
    """The event loop keeps running while the model decodes (a wrapped sync call would block it)."""
    llm = make_llm(example)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    prompt = "Write one sentence about lighthouses."
    response = await llm.acomplete(prompt)
    task.cancel()
    assert ticks >= 3, f"the loop ticked only {ticks} times during decode"
    assert response.additional_kwargs["qcfuse"]["new_tokens"] >= 1
    chunks = [r async for r in await llm.astream_complete(prompt)]
    assert "".join(r.delta for r in chunks) == response.text == chunks[-1].text
    assert chunks[-1].additional_kwargs["qcfuse"]["finish_reason"] in ("stop", "length")


async def test_chat_through_the_chat_template(example, index):
    llm = make_llm(example)
    chunk = render_for_prompt(index.as_retriever(similarity_top_k=1).retrieve(Q_FOUNDER)[0].node)
    messages = [ChatMessage(role=MessageRole.SYSTEM, content="Answer in a few words."),
                ChatMessage(role=MessageRole.USER, content=f"{chunk}\n\n{Q_FOUNDER}")]
    reply = llm.chat(messages)
    assert reply.message.role == MessageRole.ASSISTANT and reply.message.content
    stats = reply.additional_kwargs["qcfuse"]
    assert stats["chunks"] == 1 and stats["cache_hits"] == 1  # the ingested chunk, found inside the message
    assert reply.raw["qcfuse"]["guard"]["signal"] == "first_token_margin" and stats["guard"]["action"]  # issue 53
    assert stats["fidelity"]["config"] == "qcfuse@0.15" and "measured" in stats["fidelity"]  # the audit's report
    rendered = llm.engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer in a few words."}, {"role": "user", "content": f"{chunk}\n\n{Q_FOUNDER}"}],
        tokenize=False, add_generation_prompt=True)
    assert stats["prompt_tokens"] == pytest.approx(len(llm.engine.caches.tokenize(rendered)), abs=3)
    streamed = [r async for r in await llm.astream_chat(messages)]
    assert "".join(r.delta or "" for r in streamed) == reply.message.content


async def test_never_built_chunks_are_computed_stored_and_hit_next_time(example, fusion):
    llm = make_llm(example, max_new_tokens=4)
    docs = [Document(text="The Orrin ferry crosses from Port Halden to the Skerry Isles twice a day in summer.", id_="ferry"),
            Document(text="Skerry Isles pottery is glazed with ash from burnt kelp, which gives it a green colour.", id_="pots")]
    fresh = VectorStoreIndex.from_documents(docs, embed_model=QCFuseEmbedding())  # no QCFuseCacheBuilder
    q = "How often does the Orrin ferry sail?"

    built = llm.learner.counters()["background_builds"]
    plain = fresh.as_query_engine(llm=llm, similarity_top_k=2)
    response = await plain.aquery(q)  # the retrieval event: both nodes built in the background
    stats = fusion.last
    assert stats["chunk_ids"] == [n.node.node_id for n in response.source_nodes]  # learned under aquery
    assert stats["chunks"] == 2 and llm.learner.counters()["background_builds"] == built + 2

    plain.query(q)  # next time: stored and registered
    assert fusion.last["cache_hits"] == 2 and fusion.last["cache_misses"] == 0


def test_builder_is_idempotent(example):
    from llama_index.core.node_parser import SentenceSplitter

    engine = make_llm(example).engine
    docs = [Document(text=f.read_text(encoding="utf-8"), id_=f.name, metadata={"file_name": f.name})
            for f in sorted(_load_example().corpus_dir().glob("*.md"))]
    nodes = SentenceSplitter(chunk_size=256, chunk_overlap=32).get_nodes_from_documents(docs)  # new node ids
    before = (engine.caches.store.stats()["entries"], len(engine.caches.texts))
    out = QCFuseCacheBuilder(store_dir=str(example.store))(nodes, show_progress=False)
    assert out is nodes and (engine.caches.store.stats()["entries"], len(engine.caches.texts)) == before
    assert all(engine.caches.store.resolve(n.node_id) is not None for n in nodes)  # the new ids are linked


def test_other_model_store_not_reused_and_full_recompute_equals_full(example, index, fusion):
    """float32 is another fingerprint (the store was built in bfloat16), and exact enough for
    greedy answers to agree between fused prefill with every row recomputed and HF's forward."""
    everything = make_llm(example, dtype="float32", method="random", ratio=1.0)
    assert everything.engine.caches.fingerprint != make_llm(example).engine.caches.fingerprint
    texts = [render_for_prompt(n.node) for n in index.as_retriever(similarity_top_k=2).retrieve(Q_FOUNDER)]
    keys = [everything.engine.caches.chunk_tokens(t)[1] for t in texts]  # keys carry the model's fingerprint
    assert not any(everything.engine.caches.store.contains(k) for k in keys)  # the bfloat16 caches do not count
    a = index.as_query_engine(llm=everything, similarity_top_k=2).query(Q_FOUNDER)
    stats = fusion.last
    assert stats["chunks"] == 2 and all(everything.engine.caches.store.contains(k) for k in keys)  # built for float32
    assert stats["recomputed_tokens"] == stats["context_tokens"]
    full = make_llm(example, dtype="float32", method="full")
    b = index.as_query_engine(llm=full, similarity_top_k=2).query(Q_FOUNDER)
    assert (fusion.last["cache_hits"], fusion.last["cache_misses"]) == (0, 0)  # full needs no cache
    assert str(a) == str(b)
    index.as_query_engine(llm=everything, similarity_top_k=2).query(Q_FOUNDER)
    assert fusion.last["cache_hits"] == 2  # its own caches, stored by the first query
