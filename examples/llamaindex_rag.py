"""LlamaIndex RAG over the sample corpus with QCFuse: ingest into Chroma, then ask questions.

    python examples/llamaindex_rag.py [--store DIR]     (default: <cache dir>/examples/llamaindex)

1. ingest   the sample corpus (one Document per file) -> IngestionPipeline(SentenceSplitter,
            QCFuseCacheBuilder, QCFuseEmbedding) -> ChromaVectorStore (persistent, telemetry off).
            The pipeline's docstore is persisted under --store, so a second run ingests nothing.
2. query    VectorStoreIndex.from_vector_store(...).as_query_engine(llm=QCFuseLLM(...),
            node_postprocessors=[QCFuseNodePostprocessor(...)]) - the only QCFuse-specific lines.
3. report   each answer with its fusion statistics (chunk cache hits / misses, recomputed share, TTFT).

Everything runs offline on the embedded SmolLM2-135M-Instruct and MiniLM embedder.
"""

from __future__ import annotations

import argparse
import logging
from importlib.resources import files
from pathlib import Path
from typing import Any

QUESTIONS = (
    "Who founded the Zephyr Institute?",
    "When did the Lantern Festival begin?",
)


def corpus_dir() -> Path:
    return Path(str(files("qcfuse_core.data") / "sample_corpus"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--store",
        default=None,
        help="folder for the chunk caches, content index, Chroma and docstore "
        "(default: <cache dir>/examples/llamaindex, $QCFUSE_CACHE_DIR or ~/.cache/qcfuse)",
    )
    p.add_argument("--method", default="qcfuse", help="recompute-selection method (default: qcfuse)")
    p.add_argument("--ratio", type=float, default=0.15, help="share of chunk tokens recomputed (default: 0.15)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--top-k", type=int, default=2, help="retrieved chunks per question")
    p.add_argument("--question", action="append", help="ask this instead of the built-in questions (repeatable)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from llama_index.core import Document, Settings, VectorStoreIndex
    from llama_index.core.ingestion import DocstoreStrategy, IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.storage.docstore import SimpleDocumentStore

    from qcfuse_core import cache_dir
    from qcfuse_integrations.llama_index import (
        FusionStats,
        QCFuseCacheBuilder,
        QCFuseEmbedding,
        QCFuseLLM,
        QCFuseNodePostprocessor,
        chroma_vector_store,
    )

    store = Path(args.store) if args.store else cache_dir() / "examples" / "llamaindex"
    store.mkdir(parents=True, exist_ok=True)
    llm = QCFuseLLM(store_dir=str(store), method=args.method, ratio=args.ratio, max_new_tokens=args.max_new_tokens)
    embed = QCFuseEmbedding()
    Settings.llm, Settings.embed_model = llm, embed  # or LlamaIndex reaches for a hosted provider
    vector_store = chroma_vector_store(store / "chroma")

    # 1. ingest (a second run over the same --store finds every document unchanged)
    docs = [
        Document(text=f.read_text(encoding="utf-8"), id_=f.name, metadata={"file_name": f.name})
        for f in sorted(corpus_dir().glob("*.md"))
    ]
    pipeline = IngestionPipeline(
        transformations=[
            SentenceSplitter(chunk_size=256, chunk_overlap=32),
            QCFuseCacheBuilder(store_dir=str(store)),
            embed,
        ],
        vector_store=vector_store,
        docstore=SimpleDocumentStore(),
        docstore_strategy=DocstoreStrategy.UPSERTS,
    )
    persist = store / "llamaindex_pipeline"
    if persist.is_dir():
        pipeline.load(str(persist))
    nodes = pipeline.run(documents=docs)
    pipeline.persist(str(persist))
    print(
        f"ingested {len(docs)} documents -> {len(nodes)} new chunks "
        f"(store: {len(llm.engine.caches.texts)} chunk texts, Chroma: {vector_store.client.count()} vectors)"
    )

    # 2. query
    index = VectorStoreIndex.from_vector_store(vector_store, embed_model=embed)
    query_engine = index.as_query_engine(
        llm=llm,
        similarity_top_k=args.top_k,
        response_mode="compact",
        node_postprocessors=[QCFuseNodePostprocessor(store_dir=str(store))],
    )
    results = []
    fusion = FusionStats.attach()  # the LLM calls' statistics, from the instrumentation events
    for question in args.question or QUESTIONS:
        response = query_engine.query(question)
        stats = dict(fusion.last or {})
        sources = [Path(n.node.metadata.get("file_name", n.node.node_id)).name for n in response.source_nodes]
        # 3. report
        print(f"\nQ: {question}\nA: {str(response).strip()}")
        print(
            f"   chunks {stats['chunks']} (cache hits {stats['cache_hits']}, misses {stats['cache_misses']}, built now {stats['cache_built']}) | "
            f"recomputed {stats['recomputed_tokens']}/{stats['context_tokens']} context tokens "
            f"({100 * stats['recompute_share']:.1f}%) | TTFT {stats['ttft_ms']:.0f} ms | "
            f"total {stats['total_ms']:.0f} ms | method {stats['method']}"
        )
        print(f"   sources: {', '.join(sources)}")
        results.append({"question": question, "answer": str(response).strip(), "sources": sources, **stats})
    return results


if __name__ == "__main__":
    main()
