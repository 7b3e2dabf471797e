"""Which chunks are in a LangChain prompt: content matching, plus an explicit channel.

LangChain hands an LLM one string; which documents went into it is lost on the way. Two
sources say where the chunks are, and the prompt text is the judge of both:

    content     every text registered at ingestion (`QCFuseCacheBuilder`) that occurs
                verbatim in the prompt (engine.caches.texts.find) - always on, works with any chain
    documents=  Documents passed with the call (`llm.bind(documents=docs)` or
                `with_documents(prompt, llm)`): each page_content must occur in the prompt;
                a text never built is computed on this call, stored, and hit the next time
    doc_ids=    ids given to chunks at ingestion: each must name a stored chunk whose
                exact text occurs in the prompt; it labels that chunk

    prompt:   "Context:\\n" [chunk A] "\\n\\n" [chunk B] "\\n\\nQuestion: ..."
              |-- prefix --|-- A --|- glue -|-- B --|------ suffix -------|

A mismatch (a document whose text the formatter changed, an id whose chunk is not in the
prompt) raises `ValueError`: a silent "0 cache hits" is the failure this module exists to
prevent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from qcfuse_core import ChunkKey, NodeId, Piece, QCFuseEngine, require_sequence


@dataclass(frozen=True)
class Span:
    """One chunk located in the prompt: prompt[start:end] == text."""

    start: int
    text: str
    node_id: str | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.text)

    def overlaps(self, other: "Span") -> bool:
        return self.start < other.end and other.start < self.end


def locate_chunks(
    engine: QCFuseEngine,
    prompt: str,
    *,
    doc_ids: Sequence[str] = (),
    documents: Sequence = (),
) -> list[Piece]:
    """The chunk pieces of `prompt`, left to right, non-overlapping (see the module doc).

    1. content      registered texts found in the prompt
    2. documents    each document's text, at its first unclaimed occurrence; it replaces any
                    content match it overlaps and is registered for content matching
    3. doc_ids      each id's stored chunk key must equal the key of a located chunk
    """
    documents = require_sequence(documents, "documents", None, one="for one, pass [document]")
    doc_ids = require_sequence(doc_ids, "doc_ids", one="for one, pass [doc_id]")
    # 1. content
    spans, pos = [], 0
    for piece in engine.caches.texts.find(prompt):
        at = prompt.find(piece.text, pos)
        spans.append(Span(at, piece.text, piece.node_id))
        pos = at + len(piece.text)
    # 2. documents
    claimed: list[Span] = []
    for doc in documents:
        text, doc_id = _document_text(doc), getattr(doc, "id", None)
        span = _first_unclaimed(prompt, text, doc_id, claimed)
        if span is None:
            raise ValueError(
                f"document {doc_id or text[:40]!r}: its page_content does not occur verbatim in the prompt "
                "(once per document); pass the documents that the chain's formatter put into the prompt"
            )
        claimed.append(span)
        engine.caches.texts.add(text, doc_id)
    spans = sorted(claimed + [s for s in spans if not any(s.overlaps(c) for c in claimed)], key=lambda s: s.start)
    # 3. doc_ids
    if doc_ids:
        by_key = {
            ChunkKey.for_tokens(engine.caches.fingerprint, engine.caches.tokenize(s.text)): i
            for i, s in enumerate(spans)
        }
        for doc_id in doc_ids:
            key = engine.caches.store.resolve(NodeId(doc_id))
            if key is None:
                raise ValueError(
                    f"doc id {doc_id!r}: no chunk was built under this id; build it with QCFuseCacheBuilder "
                    "or pass the Document itself with documents="
                )
            if key not in by_key:
                raise ValueError(
                    f"doc id {doc_id!r}: the text built under this id does not occur verbatim in the prompt "
                    f"(chunks found in the prompt: {len(spans)})"
                )
            i = by_key[key]
            spans[i] = Span(spans[i].start, spans[i].text, doc_id)
    return [Piece("chunk", s.text, s.node_id) for s in spans]


def _document_text(doc) -> str:
    text = getattr(doc, "page_content", None)
    if not isinstance(text, str):
        raise TypeError(f"documents= takes LangChain Documents, got {type(doc).__name__}")
    if not text:
        raise ValueError("a document's page_content is empty")
    return text


def _first_unclaimed(prompt: str, text: str, doc_id: str | None, claimed: list[Span]) -> Span | None:
    at = prompt.find(text)
    while at >= 0:
        span = Span(at, text, doc_id)
        if not any(span.overlaps(c) for c in claimed):
            return span
        at = prompt.find(text, at + 1)
    return None


def format_docs(docs: Sequence) -> str:
    """The usual LCEL formatter: page contents joined by blank lines."""
    return "\n\n".join(_document_text(d) for d in require_sequence(docs, "docs", None, one="pass [document]"))


def with_documents(prompt, llm, *, docs_key: str = "context", format_docs: Callable[[Sequence], str] = format_docs):
    """`prompt | llm` that also hands the retrieved Documents to the LLM (`documents=`).

    Input: the prompt's variables, with `docs_key` holding the list of Documents, e.g.

        chain = {"context": retriever, "question": RunnablePassthrough()} | with_documents(prompt, llm)

    The documents are formatted into `docs_key` with `format_docs` before the prompt renders.
    invoke / batch / stream and their async forms all pass through.
    """
    from langchain_core.runnables import RunnableLambda

    def route(inputs: dict):
        if not isinstance(inputs, dict) or docs_key not in inputs:
            raise ValueError(f"with_documents expects a dict input with the key {docs_key!r} (a list of Documents)")
        docs = require_sequence(inputs[docs_key], f"the input's {docs_key!r}", None, one="a list of Documents")
        values = {**inputs, docs_key: format_docs(docs)}
        return RunnableLambda(lambda _: values, name="format_docs") | prompt | llm.bind(documents=docs)

    return RunnableLambda(route, name="qcfuse_with_documents")
