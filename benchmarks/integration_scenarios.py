"""The framework setups of issue 19, each run twice in the framework's plain idiom: how many
chunks the QCFuse model matched and how many of them were cache hits, per call (and, where
the version reports it, how many chunk tokens were served from sub-spans of stored chunks).

    python benchmarks/integration_scenarios.py [--json OUT] [--only TEXT ...]

Uses only APIs that older QCFuse versions had too (LangChain's `QCFuseLLM`, LlamaIndex's
`QCFuseLLM`), so the same script gives the before/after table. Every store is fresh.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import traceback

QUESTION = "Who founded the Zephyr Institute?"
NEW = 4


def corpus() -> list[tuple[str, str]]:
    from pathlib import Path

    import qcfuse_core

    root = Path(qcfuse_core.__file__).parent / "data" / "sample_corpus"
    return [(f.name, f.read_text(encoding="utf-8")) for f in sorted(root.glob("*.md"))]


# ---------------------------------------------------------------------- LangChain


def _lc(formatter: str, builder: str | None) -> list[dict]:
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.documents import Document
    from langchain_core.prompts import PromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_core.vectorstores import InMemoryVectorStore

    from qcfuse_integrations.langchain import QCFuseCacheBuilder, QCFuseEmbeddings, QCFuseLLM

    class Infos(BaseCallbackHandler):
        def __init__(self):
            self.infos = []

        def on_llm_end(self, response, **kw):
            self.infos.extend(g[0].generation_info or {} for g in response.generations)

    store = tempfile.mkdtemp(prefix="qcfuse-scen-")
    llm = QCFuseLLM(store_dir=store, max_new_tokens=NEW)
    docs = []
    for name, text in corpus():
        for j, para in enumerate(p for p in text.split("\n\n") if len(p) > 80):
            docs.append(Document(page_content=para, metadata={"source": name}))
    if builder == "before_split":  # the whole files built, then split: the splits were never built
        whole = [Document(page_content=t, metadata={"source": n}) for n, t in corpus()]
        QCFuseCacheBuilder(llm.engine).transform_documents(whole)
    elif builder == "then_metadata":
        docs = list(QCFuseCacheBuilder(llm.engine).transform_documents(docs))
        for d in docs:
            d.metadata["edited"] = "yes"
    retriever = InMemoryVectorStore.from_documents(docs, QCFuseEmbeddings()).as_retriever(search_kwargs={"k": 3})
    fmt = {
        "plain": lambda ds: "\n\n".join(d.page_content for d in ds),
        "header": lambda ds: "\n\n".join(f"Source: {d.metadata['source']}\n{d.page_content}" for d in ds),
        "whitespace": lambda ds: "\n\n".join(" ".join(d.page_content.split()) for d in ds),
        "truncate": lambda ds: "\n\n".join(d.page_content[:200] for d in ds),
    }[formatter]
    prompt = PromptTemplate.from_template("Answer from the context.\n\nContext:\n{context}\n\nQuestion: {question}\nAnswer:")
    chain = {"context": retriever | fmt, "question": RunnablePassthrough()} | prompt | llm
    cb = Infos()
    for _ in range(2):
        chain.invoke(QUESTION, config={"callbacks": [cb]})
    return [_row(i) for i in cb.infos]


def _row(stats: dict) -> dict:
    row = {"chunks": stats.get("chunks"), "hits": stats.get("cache_hits")}
    if "subspan_tokens" in stats:
        row["subspan_tokens"] = stats["subspan_tokens"]
    return row


# ---------------------------------------------------------------------- LlamaIndex


def _li(mode: str) -> list[dict]:
    from llama_index.core import Document, Settings, VectorStoreIndex

    from qcfuse_integrations.llama_index import QCFuseEmbedding, QCFuseLLM

    store = tempfile.mkdtemp(prefix="qcfuse-scen-")
    llm = QCFuseLLM(store_dir=store, max_new_tokens=NEW)
    Settings.llm, Settings.embed_model = llm, QCFuseEmbedding()
    stats_of = _li_stats(llm)
    index = VectorStoreIndex.from_documents([Document(text=t, metadata={"file_name": n}) for n, t in corpus()])
    qe = index.as_query_engine(similarity_top_k=2, response_mode=mode)
    out = []
    for _ in range(2):
        qe.query(QUESTION)
        out.append(_row(stats_of()))
    return out


def _li_stats(llm):
    try:
        from qcfuse_integrations.llama_index import FusionStats
    except ImportError:  # older versions: per-thread last_stats
        return lambda: dict(llm.last_stats or {})
    handler = FusionStats.attach()
    return lambda: dict(handler.last or {})


def _li_chat() -> list[dict]:
    from llama_index.core.base.llms.types import ChatMessage

    from qcfuse_integrations.llama_index import QCFuseLLM

    llm = QCFuseLLM(store_dir=tempfile.mkdtemp(prefix="qcfuse-scen-"), max_new_tokens=NEW)
    reply = llm.chat([ChatMessage(role="user", content="Say hi")])
    return [{"answered": bool(reply.message.content)}]


def _lc_max_tokens() -> list[dict]:
    from qcfuse_integrations.langchain import QCFuseLLM

    llm = QCFuseLLM(store_dir=tempfile.mkdtemp(prefix="qcfuse-scen-"))
    info = llm.generate(["Say hi"], max_tokens=3).generations[0][0].generation_info
    return [{"new_tokens": info.get("new_tokens")}]


SCENARIOS = {
    "LlamaIndex from_documents + as_query_engine (compact)": lambda: _li("compact"),
    "LlamaIndex simple_summarize": lambda: _li("simple_summarize"),
    "LlamaIndex chat() with no documents": _li_chat,
    "LangChain LCEL, plain retriever, no builder": lambda: _lc("plain", None),
    "LangChain builder before the splitter": lambda: _lc("plain", "before_split"),
    "LangChain metadata edited after the builder": lambda: _lc("header", "then_metadata"),
    "LangChain format_docs with metadata headers": lambda: _lc("header", None),
    "LangChain format_docs normalising whitespace": lambda: _lc("whitespace", None),
    "LangChain format_docs truncating page_content": lambda: _lc("truncate", None),
    "LangChain invoke(max_tokens=3)": _lc_max_tokens,
}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--only", nargs="+", metavar="TEXT", help="run the scenarios whose name contains one of these")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    chosen = {n: r for n, r in SCENARIOS.items() if not args.only or any(t in n for t in args.only)}
    if not chosen:
        ap.error(f"no scenario matches {args.only}; names: {', '.join(SCENARIOS)}")
    results = {}
    for name, run in chosen.items():
        try:
            results[name] = run()
        except Exception as e:  # a scenario that fails is a row of the table, not the end of it
            results[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
            traceback.print_exc()
        print(f"{name:55s} {results[name]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
