"""The two Python traps of issue 66 (item 3): `QCFuseEngine("my-store")` raises a TypeError
that names `open_engine`, and a string where a sequence of documents belongs raises a
TypeError - in the engine's verbs and in both integrations - instead of being taken as one
document per character. Tiny random model, CPU."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from qcfuse_core import Piece, QCFuseEngine, require_sequence
from qcfuse_core.model.testing import tiny_model

DOCS = [f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(12)) for i in range(2)]
Q = "Which document mentions word1x5?"
ONE_STRING = "a string where a list of documents belongs"


@pytest.fixture(scope="module")
def engine():
    eng = QCFuseEngine(tiny_model("llama", tokenizer=True))
    yield eng
    eng.close()


@pytest.mark.parametrize("where", ["my-store", Path("my-store")], ids=["str", "path"])
def test_an_engine_from_a_path_names_open_engine(where):
    with pytest.raises(TypeError, match=r"QCFuseEngine takes a loaded model .*got (str|\w*Path) .*use open_engine\("):
        QCFuseEngine(where)  # type: ignore[arg-type]


def test_a_string_for_the_documents_is_refused_by_every_verb(engine):
    match = r"documents must be a list, not a str \(for one document, pass \[text\]\)"
    with pytest.raises(TypeError, match=match):
        engine.answer(Q, ONE_STRING)
    with pytest.raises(TypeError, match=match):
        engine.stream(Q, ONE_STRING)

    async def aio():
        with pytest.raises(TypeError, match=match):
            engine.astream(Q, ONE_STRING)
        with pytest.raises(TypeError, match=match):
            await engine.aanswer(Q, ONE_STRING)

    asyncio.run(aio())
    with pytest.raises(TypeError, match=r"node_ids must be a list, not a str"):
        engine.answer(Q, DOCS, node_ids="doc-0")
    with pytest.raises(TypeError, match=r"documents\[1\] must be a str, got int"):
        engine.answer(Q, [DOCS[0], 7])
    with pytest.raises(TypeError, match=r"texts must be a list, not a str \(for one chunk, pass \[text\]\)"):
        engine.build_chunks(ONE_STRING)
    with pytest.raises(TypeError, match=r"chunks must be a list, not a str"):
        engine.complete("Context: " + DOCS[0], chunks=DOCS[0])
    with pytest.raises(TypeError, match=r"chunks\[0\] must be a Piece, got str"):
        engine.complete("Context: " + DOCS[0], chunks=[DOCS[0]])
    with pytest.raises(TypeError, match=r"question must be a str, got list"):
        engine.answer(DOCS, DOCS)  # type: ignore[arg-type]
    # the right shapes still answer
    assert engine.answer(Q, DOCS[:1], max_new_tokens=1).chunks == 1
    assert engine.complete("Context: " + DOCS[0], chunks=[Piece("chunk", DOCS[0])], max_new_tokens=1).chunks == 1


def test_require_sequence_takes_any_iterable_and_refuses_the_rest():
    assert require_sequence(("a", "b"), "xs") == ["a", "b"]
    assert require_sequence((t for t in "ab"), "xs") == ["a", "b"]
    for bad, word in ((b"ab", "not a bytes"), ({"a": 1}, "got dict"), (3, "got int")):
        with pytest.raises(TypeError, match=word):
            require_sequence(bad, "xs")


def test_langchain_refuses_a_string_for_its_documents(engine):
    pytest.importorskip("langchain_core")
    from langchain_core.documents import Document
    from langchain_core.prompts import PromptTemplate

    from qcfuse_integrations.langchain import QCFuseCacheBuilder, QCFuseLLM, format_docs, locate_chunks, with_documents

    with pytest.raises(TypeError, match=r"documents must be a list, not a str \(for one, pass \[document\]\)"):
        QCFuseCacheBuilder(engine).transform_documents(ONE_STRING)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"docs must be a list, not a str"):
        format_docs(ONE_STRING)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"documents must be a list, not a str"):
        locate_chunks(engine, "Context: " + DOCS[0], documents=DOCS[0])
    with pytest.raises(TypeError, match=r"doc_ids must be a list, not a str"):
        locate_chunks(engine, "Context: " + DOCS[0], doc_ids="doc-0")
    llm = QCFuseLLM.from_engine(engine, max_new_tokens=1)
    with pytest.raises(TypeError, match=r"documents must be a list of Documents, got str"):
        llm.invoke("Context: " + DOCS[0], documents=DOCS[0])
    chain = with_documents(PromptTemplate.from_template("{context}\nQ: {question}"), llm)
    with pytest.raises(TypeError, match=r"the input's 'context' must be a list, not a str"):
        chain.invoke({"context": DOCS[0], "question": Q})
    docs = [Document(page_content=DOCS[0])]
    assert chain.invoke({"context": docs, "question": Q}) is not None  # the right shape still runs


def test_llama_index_refuses_a_string_for_its_nodes(engine):
    pytest.importorskip("llama_index.core")
    from qcfuse_integrations.llama_index import QCFuseCacheBuilder, QCFuseEmbedding, QCFuseLLM

    with pytest.raises(TypeError, match=r"nodes must be a list, not a str \(for one, pass \[node\]\)"):
        QCFuseCacheBuilder(engine=engine)(ONE_STRING)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"texts must be a list, not a str \(use get_text_embedding for one\)"):
        QCFuseEmbedding()._get_text_embeddings(ONE_STRING)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"node_ids must be a dict \{rendered node text: node id\}, got str"):
        QCFuseLLM(engine=engine, max_new_tokens=1).complete("Context: " + DOCS[0], node_ids="doc-0")
