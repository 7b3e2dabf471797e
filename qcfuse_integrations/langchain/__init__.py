"""LangChain integration: ChatQCFuse, QCFuseLLM, QCFuseCacheBuilder, QCFuseEmbeddings.

    llm = ChatQCFuse(store_dir=store)                 # or QCFuseLLM for a completion LLM
    chain = retriever | format_docs | prompt | llm    # retrieved texts are learned (callbacks),
                                                      # built, and found by content
    builder = QCFuseCacheBuilder(llm.engine)          # optional: build caches at ingestion
    with qcfuse_callback() as cb:                     # what answered, from any chain's run
        chain.invoke(question); cb.answered           # (callbacks.py)

Needs the optional extra: pip install 'qcfuse[langchain]'.
"""

LANGCHAIN_PIP = "pip install 'qcfuse[langchain]'"

try:
    import langchain_core  # noqa: F401
except ImportError as e:
    raise ImportError(f"the LangChain integration needs langchain-core; install it with:\n    {LANGCHAIN_PIP}") from e

from qcfuse_integrations.engines import shared_engine  # noqa: E402
from qcfuse_integrations.langchain import retrieval  # noqa: E402,F401  (registers the retrieval hook)
from qcfuse_integrations.langchain.callbacks import QCFuseCallbackHandler, qcfuse_callback  # noqa: E402
from qcfuse_integrations.langchain.chat import ChatQCFuse  # noqa: E402
from qcfuse_integrations.langchain.chunks import format_docs, locate_chunks, with_documents  # noqa: E402
from qcfuse_integrations.langchain.embeddings import QCFuseEmbeddings  # noqa: E402
from qcfuse_integrations.langchain.llm import QCFuseLLM  # noqa: E402
from qcfuse_integrations.langchain.transformer import QCFuseCacheBuilder, document_id  # noqa: E402

__all__ = [
    "ChatQCFuse",
    "LANGCHAIN_PIP",
    "QCFuseCallbackHandler",
    "QCFuseCacheBuilder",
    "QCFuseEmbeddings",
    "QCFuseLLM",
    "document_id",
    "format_docs",
    "locate_chunks",
    "qcfuse_callback",
    "shared_engine",
    "with_documents",
]
