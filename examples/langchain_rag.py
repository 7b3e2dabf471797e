"""LangChain RAG with QCFuse: an ordinary LCEL chain whose LLM answers from fused chunk caches.

    python examples/langchain_rag.py [--store DIR]      (default: <cache dir>/examples/langchain)
    python examples/langchain_rag.py --store /tmp/qcfuse-langchain --explicit-ids -q "How tall is ..."

Steps:
    1. split     the shipped sample corpus (qcfuse_core/data/sample_corpus/*.md) into Documents
    2. build     QCFuseCacheBuilder: deterministic ids + each chunk's cache (skipped when stored)
    3. index     langchain_chroma.Chroma on a persistent client (telemetry off), offline MiniLM
    4. chain     {"context": retriever | format_docs, "question": ...} | prompt | QCFuseLLM
    5. ask       stream each answer; print the fusion statistics from generation_info

Everything is local: the embedded model, the offline embedder, Chroma under --store/chroma.
Needs: pip install 'qcfuse[langchain]'.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.prompts import PromptTemplate
from langchain_core.runnables import RunnablePassthrough

from qcfuse_core.ingest.corpus import sample_corpus_dir, split_text
from qcfuse_core.retrieval.chroma import persistent_client
from qcfuse_integrations.langchain import (
    QCFuseCacheBuilder,
    QCFuseEmbeddings,
    QCFuseLLM,
    format_docs,
    with_documents,
)

QUESTIONS = (
    "How tall is the Cape Wrayth lighthouse?",
    "When did the Lantern Festival begin?",
)

PROMPT = PromptTemplate.from_template(
    "Answer the question using only the context below.\n\n"
    "Context:\n{context}\n\n"
    "Question: {question}\nAnswer in one short sentence."
)


def load_corpus(folder: Path, chunk_chars: int) -> list[Document]:
    """1. split: one Document per chunk, metadata source = file name, no ids (like a splitter)."""
    docs = []
    for path in sorted(folder.glob("*.md")):
        for text in split_text(path.read_text(encoding="utf-8"), chunk_chars):
            docs.append(Document(page_content=text, metadata={"source": path.name}))
    if not docs:
        raise SystemExit(f"no markdown files in {folder}")
    return docs


def open_vectorstore(store: Path, collection: str = "langchain"):
    try:
        from langchain_chroma import Chroma
    except ImportError as e:
        raise ImportError("this example needs langchain-chroma: pip install 'qcfuse[langchain]'") from e
    return Chroma(
        client=persistent_client(store / "chroma"),
        collection_name=collection,
        embedding_function=QCFuseEmbeddings(),
        collection_metadata={"hnsw:space": "cosine"},
    )


def ingest(llm: QCFuseLLM, vectorstore, corpus: Path, chunk_chars: int) -> dict[str, int]:
    """2-3. build caches, then upsert into Chroma under the same deterministic ids."""
    builder = QCFuseCacheBuilder(llm.engine)
    docs = builder.transform_documents(load_corpus(corpus, chunk_chars))
    vectorstore.add_documents(docs, ids=[d.id for d in docs])
    report = builder.last_build
    return {"chunks": report.documents, "built": report.built, "reused": report.reused}


def build_chain(llm: QCFuseLLM, vectorstore, k: int, explicit_ids: bool):
    """4. the LCEL chain; with explicit_ids the retrieved Documents also reach the LLM."""
    retriever = vectorstore.as_retriever(search_kwargs={"k": k})
    if explicit_ids:
        return {"context": retriever, "question": RunnablePassthrough()} | with_documents(PROMPT, llm)
    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | llm


class FusionStats(BaseCallbackHandler):
    """Collects each LLM run's generation_info (the fusion statistics)."""

    def __init__(self) -> None:
        self.runs: list[dict[str, Any]] = []

    def on_llm_end(self, response, **kwargs: Any) -> None:
        self.runs.extend(g[0].generation_info or {} for g in response.generations)


def ask(chain, question: str) -> dict[str, Any]:
    """5. stream one answer to stdout; return the answer with its statistics."""
    stats = FusionStats()
    print(f"Q: {question}\nA: ", end="", flush=True)
    answer = ""
    for delta in chain.stream(question, config={"callbacks": [stats]}):
        answer += delta
        print(delta, end="", flush=True)
    info = stats.runs[-1]
    ratio = "" if info["ratio"] is None else f" @ {info['ratio']:.2f}"
    print(
        f"\n   [{info['method']}{ratio}] TTFT {info['ttft_ms']:.1f} ms, total {info['total_ms']:.1f} ms, "
        f"{info['recomputed_tokens']}/{info['context_tokens']} context tokens recomputed, "
        f"chunk cache {info['cache_hits']} hits / {info['cache_misses']} misses, {info['cache_built']} built now "
        f"({info['chunks']} chunks in the prompt)\n"
    )
    return {"question": question, "answer": answer, **info}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--store",
        default=None,
        type=Path,
        help="store folder (chunk caches, text index, chroma/); default: <cache dir>/examples/langchain "
        "($QCFUSE_CACHE_DIR or ~/.cache/qcfuse)",
    )
    ap.add_argument("--corpus", type=Path, default=sample_corpus_dir(), help="folder of .md files")
    ap.add_argument("-q", "--question", action="append", help="question (repeatable); default: two samples")
    ap.add_argument("--method", default="qcfuse", help="recompute method (qcfuse_core.selection.selectors)")
    ap.add_argument("--ratio", type=float, default=0.15, help="share of context tokens recomputed")
    ap.add_argument("--k", type=int, default=3, help="chunks retrieved per question")
    ap.add_argument("--chunk-chars", type=int, default=400, help="split size in characters")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--explicit-ids", action="store_true", help="also pass the retrieved Documents to the LLM")
    args = ap.parse_args(argv)
    if args.store is None:
        from qcfuse_core import cache_dir

        args.store = cache_dir() / "examples" / "langchain"
    args.store.mkdir(parents=True, exist_ok=True)

    llm = QCFuseLLM(store_dir=str(args.store), method=args.method, ratio=args.ratio, max_new_tokens=args.max_new_tokens)
    vectorstore = open_vectorstore(args.store)
    stats = ingest(llm, vectorstore, args.corpus, args.chunk_chars)
    print(
        f"ingested {stats['chunks']} chunks into {args.store}: {stats['built']} caches built, "
        f"{stats['reused']} already stored\n"
    )
    chain = build_chain(llm, vectorstore, args.k, args.explicit_ids)
    return [ask(chain, q) for q in (args.question or QUESTIONS)]


if __name__ == "__main__":
    main()
