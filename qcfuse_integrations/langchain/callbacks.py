"""What answered, from any LangChain chain: a callback handler over QCFuse's model calls.

A chain that ends in `StrOutputParser` returns a string; the AIMessage that carried the
fusion statistics (`response_metadata["qcfuse"]`, or a completion's `generation_info`) is
gone by then. LangChain's callbacks still see it, and this is how LangChain users read
token usage (`get_usage_metadata_callback`, `get_openai_callback`). The same here:

    with qcfuse_callback() as cb:                       # every QCFuse call inside the block
        answer = chain.invoke("Who founded the Zephyr Institute?")
    cb.answered        # 'qcfuse @ 0.15 · guard: kept (margin 0.41 ≥ 0.13)'
    cb.last            # the last call's statistics (FusionResult.to_dict() without the answer)

or pass a handler to one run: `chain.invoke(q, config={"callbacks": [QCFuseCallbackHandler()]})`.
Calls of other models are ignored; concurrent runs in one block are all recorded, in the
order they ended (`calls`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.outputs import ChatGeneration, LLMResult
from langchain_core.tracers.context import register_configure_hook


def fusion_stats(generation: Any) -> dict[str, Any] | None:
    """The QCFuse statistics a generation carries (ChatQCFuse: its message's
    `response_metadata["qcfuse"]`; QCFuseLLM: its `generation_info`), else None."""
    if isinstance(generation, ChatGeneration):
        stats = generation.message.response_metadata.get("qcfuse")
        return stats if isinstance(stats, dict) else None
    info = getattr(generation, "generation_info", None)
    return info if isinstance(info, dict) and "answered" in info and "method" in info else None


class QCFuseCallbackHandler(BaseCallbackHandler):
    """Collects the fusion statistics of every QCFuse model call it sees (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.calls: list[dict[str, Any]] = []

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        found = [s for gens in response.generations for g in gens if (s := fusion_stats(g)) is not None]
        with self._lock:
            self.calls.extend(found)

    @property
    def last(self) -> dict[str, Any] | None:
        """The statistics of the call that ended last (None before any)."""
        with self._lock:
            return self.calls[-1] if self.calls else None

    @property
    def answered(self) -> str | None:
        """What answered the last call and what the quality guard did, in one line."""
        last = self.last
        return None if last is None else last["answered"]


_HANDLER: ContextVar[QCFuseCallbackHandler | None] = ContextVar("qcfuse_callback", default=None)
register_configure_hook(_HANDLER, inheritable=True)  # once: every run started in its context gets it


@contextmanager
def qcfuse_callback() -> Iterator[QCFuseCallbackHandler]:
    """A handler that every LangChain run started inside the block reports to."""
    handler = QCFuseCallbackHandler()
    token = _HANDLER.set(handler)
    try:
        yield handler
    finally:
        _HANDLER.reset(token)
