"""Every LangChain retriever's documents reach QCFuse, with nothing added to the chain.

Why a callback and not a retriever wrapper: LangChain runs `on_retriever_end(documents)`
for every retriever (vector stores' `as_retriever()`, ensemble, multi-query, custom
`BaseRetriever`s) in every way a chain is run (invoke, batch, stream, async, inside
`create_retrieval_chain` or `RetrievalQA`), and `register_configure_hook` - the mechanism
LangSmith's tracer uses - attaches a handler to every run in the process. A wrapper would
work only where the user remembered it. A retriever that is a plain function, not a
`BaseRetriever` (`RunnableLambda(search)`, a function piped into a chain), emits no
retriever event; but every runnable step reports its output in `on_chain_end`, so a step
whose output is a list of `Document`s is taken as a retrieval the same way. A function
that returns bare strings is not recognisable as a retriever: the learner's warning then
names the fix (return Documents, or build the texts with `QCFuseCacheBuilder`).

The hook is registered when this package is imported; it forwards (page_content, id) of
each retrieved document to every engine's learner (qcfuse_integrations/learning.py), which
registers the texts and builds their caches in the background.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.tracers.context import register_configure_hook

from qcfuse_integrations.learning import see_everywhere


class RetrievalRecorder(BaseCallbackHandler):
    """Forwards retrieved documents to the learners; ignores every other event."""

    run_inline = True  # cheap (it only queues work): no executor hop in async runs
    raise_error = False

    @property
    def ignore_llm(self) -> bool:
        return True

    @property
    def ignore_chain(self) -> bool:
        return False  # a plain-function retriever's Documents come in its chain end (on_chain_end)

    @property
    def ignore_agent(self) -> bool:
        return True

    @property
    def ignore_chat_model(self) -> bool:
        return True

    @property
    def ignore_custom_event(self) -> bool:
        return True

    def on_retriever_end(self, documents, **kwargs: Any) -> None:
        see_everywhere(
            [
                (d.page_content, getattr(d, "id", None))
                for d in documents
                if isinstance(getattr(d, "page_content", None), str)
            ]
        )

    def on_chain_end(self, outputs: Any, **kwargs: Any) -> None:
        """A step that returned Documents (a plain-function retriever): learned like a retrieval."""
        if isinstance(outputs, (list, tuple)) and outputs and all(isinstance(d, Document) for d in outputs):
            self.on_retriever_end(outputs)


RECORDER = RetrievalRecorder()
# A default value turns the hook on in every thread and task of the process.
_HOOK: ContextVar[RetrievalRecorder | None] = ContextVar("qcfuse_retrieval_recorder", default=RECORDER)
register_configure_hook(_HOOK, inheritable=True)
