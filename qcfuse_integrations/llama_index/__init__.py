"""QCFuse for LlamaIndex (optional extra: pip install 'qcfuse[llama-index]').

Settings.llm = QCFuseLLM(store_dir=store)             # answers from fused chunk caches; the
                                                      # retrieved nodes' caches are built and
                                                      # found by content, nothing else needed
stats = FusionStats.attach()                          # per-call statistics (stats.last)
# optional, for speed at the first query: build caches at ingestion, prefetch them
pipeline = IngestionPipeline(transformations=[SentenceSplitter(), QCFuseCacheBuilder(store_dir=store),
                                              QCFuseEmbedding()], vector_store=chroma_vector_store(...))
engine = index.as_query_engine(llm=llm, node_postprocessors=[QCFuseNodePostprocessor(store_dir=store)])
"""

try:
    import llama_index.core  # noqa: F401
except ImportError as e:
    raise ImportError(
        "QCFuse's LlamaIndex integration needs llama-index-core; install it with:\n"
        "    pip install 'qcfuse[llama-index]'"
    ) from e

from qcfuse_integrations.llama_index.builder import QCFuseCacheBuilder, render_for_prompt
from qcfuse_integrations.llama_index.chroma import chroma_vector_store
from qcfuse_integrations.llama_index.embedding import QCFuseEmbedding
from qcfuse_integrations.llama_index.llm import QCFuseLLM
from qcfuse_integrations.llama_index.postprocessor import QCFuseNodePostprocessor, retrieved_nodes
from qcfuse_integrations.llama_index.retrieval import FusionStats

__all__ = [
    "FusionStats",
    "QCFuseCacheBuilder",
    "QCFuseEmbedding",
    "QCFuseLLM",
    "QCFuseNodePostprocessor",
    "chroma_vector_store",
    "render_for_prompt",
    "retrieved_nodes",
]
