"""Context limits: a prompt must fit the model's positions, generation included.

    [prefix][doc 1][glue][doc 2] ... [doc n][suffix + question]  + max_new_tokens  <=  limit

A model asked past its trained positions answers garbage without any error, so the engine
refuses such a request (`check_context`, checked by the cache manager's lookup before it
builds anything: cache/lookup.py), and the CLI keeps the best-ranked documents that fit
(`fit_documents`) and says how many it dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qcfuse_core.cache.lookup import check_context as check_context
from qcfuse_core.cache.lookup import context_error


@dataclass(frozen=True)
class Fit:
    kept: int  # documents kept (the first `kept`, in retrieval order)
    dropped: int
    prompt_tokens: int  # of the prompt with the kept documents


def fit_documents(engine, question: str, documents: Sequence[str], new_tokens: int, limit: int) -> Fit:
    """The longest prefix of `documents` (best ranked first) whose RAG prompt, plus
    `new_tokens`, fits in `limit` positions. Raises ValueError when even none fit."""
    pieces = engine.frame.rag_pieces(question, [])
    frame = 0
    for p in pieces:
        frame += int(
            (engine.caches.chunk_tokens(p.text)[0] if p.kind == "prefix" else engine.caches.tokenize(p.text)).numel()
        )
    glue = int(engine.caches.tokenize(engine.config.frame.glue).numel())
    total, kept = frame, 0
    for i, doc in enumerate(documents):
        n = int(engine.caches.chunk_tokens(doc)[0].numel()) + (glue if i else 0)
        if total + n + new_tokens > limit:
            break
        total, kept = total + n, kept + 1
    if frame + new_tokens > limit:
        raise ValueError(context_error(frame, new_tokens, limit, "shorten the question"))
    return Fit(kept, len(documents) - kept, total)
