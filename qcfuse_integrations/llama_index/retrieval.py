"""Every LlamaIndex retrieval reaches QCFuse, and every answer says how it was made, with
nothing added to the pipeline.

LlamaIndex's instrumentation dispatcher emits `RetrievalEndEvent(nodes=...)` from every
retriever (the one behind `VectorStoreIndex.as_query_engine()` and `as_chat_engine()`,
fusion and auto-merging retrievers, custom `BaseRetriever`s), sync and async. A handler on
the root dispatcher, added once when the first `QCFuseLLM` is made, hands each node's two
renderings to every engine's learner (qcfuse_integrations/learning.py):

    node.get_content(MetadataMode.LLM).strip()   what compact / refine / tree_summarize paste
                                                  into the prompt: registered and built in the
                                                  background
    node.get_content(MetadataMode.NONE)          the bare text: remembered for prompts that
                                                  render it without metadata (built when one does)

A second handler on the same dispatcher (`ResponseStats`) puts the QCFuse statistics of the
LLM call that wrote a query's answer on the `Response` the query engine returns:
`response.metadata["qcfuse"]` (`FusionResult.to_dict()` without the answer, with `answered`:
what answered and what the quality guard did, in one line).
"""

from __future__ import annotations

import threading
from contextvars import ContextVar
from typing import Any

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.schema import MetadataMode

from qcfuse_integrations.learning import see_everywhere
from qcfuse_integrations.llama_index.builder import render_for_prompt


class RetrievalRecorder(BaseEventHandler):
    """Forwards retrieved nodes to the learners; ignores every other event."""

    @classmethod
    def class_name(cls) -> str:
        return "QCFuseRetrievalRecorder"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if not isinstance(event, RetrievalEndEvent):
            return
        rendered, bare = [], []
        for n in event.nodes:
            node = n.node
            rendered.append((render_for_prompt(node), node.node_id))
            bare.append((node.get_content(metadata_mode=MetadataMode.NONE), node.node_id))
        see_everywhere(rendered)
        see_everywhere(bare, build=False)


# the QCFuse statistics of the LLM calls of each synthesis under way in this context, the
# innermost last: a list per synthesis, shared with the tasks it starts (they copy the context)
_SYNTHESES: ContextVar[tuple[list[dict], ...]] = ContextVar("qcfuse_syntheses", default=())


class ResponseStats(BaseEventHandler):
    """Puts the statistics of the LLM call that wrote a query's answer on its `Response`:

        response = query_engine.query("...")
        response.metadata["qcfuse"]["answered"]   # 'qcfuse @ 0.15 · guard: kept (margin 0.41 ≥ 0.13)'

    A synthesis (`SynthesizeStartEvent` .. `SynthesizeEndEvent`, sync or async) collects the
    QCFuse statistics of the LLM calls made inside it, in its own context (concurrent queries
    never see each other's calls); at its end the last call's - the one whose text is the
    answer (refine and tree_summarize make several; `llm_calls` counts them) - go into the
    response's metadata. A streaming response is returned before its LLM call ends: its
    statistics are in the LLM end event only (`FusionStats`)."""

    @classmethod
    def class_name(cls) -> str:
        return "QCFuseResponseStats"

    def handle(self, event: Any, **kwargs: Any) -> None:
        from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent
        from llama_index.core.instrumentation.events.synthesis import SynthesizeEndEvent, SynthesizeStartEvent

        if isinstance(event, SynthesizeStartEvent):
            _SYNTHESES.set((*_SYNTHESES.get(), []))
        elif isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)):
            raw = getattr(event.response, "raw", None)
            open_ = _SYNTHESES.get()
            if open_ and isinstance(raw, dict) and "qcfuse" in raw:
                open_[-1].append(raw["qcfuse"])
        elif isinstance(event, SynthesizeEndEvent):
            open_ = _SYNTHESES.get()
            if not open_:
                return
            _SYNTHESES.set(open_[:-1])
            calls, response = open_[-1], event.response
            if calls and hasattr(response, "metadata"):
                response.metadata = {**(response.metadata or {}), "qcfuse": {**calls[-1], "llm_calls": len(calls)}}


_ADDED = threading.Lock()
_RECORDER: RetrievalRecorder | None = None


def install() -> RetrievalRecorder:
    """Add the recorder and `ResponseStats` to the root dispatcher once per process."""
    global _RECORDER
    with _ADDED:
        if _RECORDER is None:
            _RECORDER = RetrievalRecorder()
            get_dispatcher().add_event_handler(_RECORDER)
            get_dispatcher().add_event_handler(ResponseStats())
        return _RECORDER


class FusionStats(BaseEventHandler):
    """Collects the QCFuse statistics of LLM calls from the instrumentation's end events.

    A query engine returns a `Response`, not the LLM's response object; its statistics travel
    in the LLM end event (`event.response.raw["qcfuse"]`). Add one to the root dispatcher:

        stats = FusionStats.attach()
        query_engine.query("...")
        stats.last["cache_hits"]

    `events` keeps (span id, stats) of every call, in order; concurrent queries' calls are
    told apart by span id.
    """

    events: list = []

    @classmethod
    def class_name(cls) -> str:
        return "QCFuseFusionStats"

    @classmethod
    def attach(cls) -> "FusionStats":
        handler = cls(events=[])
        get_dispatcher().add_event_handler(handler)
        return handler

    def detach(self) -> None:
        root = get_dispatcher()
        root.event_handlers = [h for h in root.event_handlers if h is not self]

    def handle(self, event: Any, **kwargs: Any) -> None:
        from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent

        if not isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)) or event.response is None:
            return
        raw = event.response.raw
        if isinstance(raw, dict) and "qcfuse" in raw:
            self.events.append((event.span_id, raw["qcfuse"]))

    @property
    def last(self) -> dict | None:
        return self.events[-1][1] if self.events else None
