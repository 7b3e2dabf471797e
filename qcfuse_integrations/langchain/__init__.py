"""LangChain integration: QCFuseLLM, QCFuseCacheBuilder, QCFuseEmbeddings.

    builder = QCFuseCacheBuilder(llm.engine)          # after the splitter, before Chroma
    chain = retriever | format_docs | prompt | llm    # chunk texts are found by content

Needs the optional extra: pip install 'qcfuse[langchain]'.
"""

LANGCHAIN_PIP = "pip install 'qcfuse[langchain]'"

try:
    import langchain_core  # noqa: F401
except ImportError as e:
    raise ImportError(f"the LangChain integration needs langchain-core; install it with:\n    {LANGCHAIN_PIP}") from e

from qcfuse_integrations.langchain.chunks import format_docs, locate_chunks, with_documents  # noqa: E402
from qcfuse_integrations.langchain.embeddings import QCFuseEmbeddings  # noqa: E402
from qcfuse_integrations.engines import engine_lock, shared_engine  # noqa: E402
from qcfuse_integrations.langchain.llm import QCFuseLLM  # noqa: E402
from qcfuse_integrations.langchain.transformer import QCFuseCacheBuilder, document_id  # noqa: E402

__all__ = [
    "LANGCHAIN_PIP", "QCFuseCacheBuilder", "QCFuseEmbeddings", "QCFuseLLM", "document_id", "engine_lock",
    "format_docs", "locate_chunks", "shared_engine", "with_documents",
]
