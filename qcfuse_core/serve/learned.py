"""Chunks learned from prompts: reuse for clients that never register their chunks.

A RAG framework pointed at the server (LangChain's `ChatOpenAI`, LlamaIndex's `OpenAILike`)
sends its retrieved texts inside the prompt and says nothing about them. The server finds
them itself:

    1. split   the context of a prompt (a chat's user and tool messages, a completion's
               prompt) into spans at the boundaries RAG frameworks render (`spans`)
    2. sight   count each span (by content hash) over requests; a span seen
               `LearnConfig.after` times (default: once) is queued
    3. build   its cache is built in the background (the learner's own thread, never
               inside a request) and the text is registered in the chunk-text index under
               the node id "learned:<sha256[:16]>"
    4. serve   from then on the text is found in any prompt by content (`texts.find`, as a
               registered chunk is), in any order and beside registered chunks

The boundaries (one template of each framework's defaults, as they render):

    LangChain  "Context:\\n{doc 1}\\n\\n{doc 2}\\n\\nQuestion: {q}"   (format_docs joins with a blank line)
    LlamaIndex "Context information is below.\\n-----\\n{node 1}\\n\\n{node 2}\\n-----\\nGiven ... \\nQuery: {q}\\nAnswer: "
    hub's rag  "... Question: {q} \\nContext: {doc 1}\\n\\n{doc 2} \\nAnswer:"

    blank lines and separator lines (---, ===, ***, a lone <tag>) end a span; a line starting
    with a context label ("Context:", "Documents:", "Sources:", ...) starts one after the
    label; a short line ending with ":" ("Document 1:", "Answer:") at either end of a span is
    trimmed; a span holding a question line ("Question:", "Query:") is the question, never
    learned; spans shorter than `min_chars` (metadata lines, headings) are left to compute.

Bounds. The sightings remembered (`remembered` hashes, LRU), the builds waiting (`max_pending`;
more are dropped and counted, the span is queued again when seen again) and the texts learned
(`max_learned`, LRU by last use): past it, the least recently used learned text leaves the
index and its cache leaves the store. Registered chunks (`/v1/chunks`, ingestion) are never
touched: a span is only a candidate where no registered text was found.

Counts (`LearnedStats`, in /metrics as qcfuse_learned_*): texts learned now, builds, hits
(learned chunks served from their cache), misses (context spans a request computed because no
cache held them yet: first sightings, builds under way), evicted, dropped, failed builds.
`qcfuse store stats` counts the learned texts of a store folder (retrieval/texts.py
`count_learned`).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.retrieval.texts import ANCHOR, LEARNED_PREFIX
from qcfuse_core.types import FusionResult, Piece

log = logging.getLogger(__name__)

_SEPARATOR = re.compile(r"^\s*(?:([-=*_~#])\1{2,}|</?[A-Za-z][\w:-]*(?:\s[^<>]*)?>)\s*$")  # ---, ===, <doc>, </doc>
_CONTEXT_LABEL = re.compile(
    r"^\s*(?:retrieved\s+)?(?:context(?:\s+information)?|documents?|sources?|passages?|excerpts?)\s*:\s*", re.I
)
_QUESTION = re.compile(r"^\s*(?:question|query|q)\s*:", re.I)
_HEADER_CHARS = 80  # a line this short ending with ":" is a header ("Document 1:", "Answer:")


@dataclass(frozen=True)
class LearnConfig:
    """The learning policy of one server (module docstring)."""

    enabled: bool = True
    after: int = 1  # sightings before a span's cache is built (1: the second sighting is served)
    min_chars: int = 2 * ANCHOR  # shorter spans are computed (metadata lines, headings)
    max_chars: int = 32768  # longer spans are computed (one span past a model's context is useless)
    max_spans: int = 64  # spans one prompt may add (the rest are computed)
    max_learned: int = 4096  # learned texts kept (LRU by last use); past it the oldest leaves index and store
    max_pending: int = 256  # spans waiting for their build; more are dropped until seen again
    remembered: int = 1 << 16  # span hashes whose sightings are counted (LRU)

    def __post_init__(self) -> None:
        if self.after < 1 or self.max_spans < 1 or self.max_learned < 1 or self.max_pending < 1:
            raise ValueError(f"after, max_spans, max_learned and max_pending must be >= 1, got {self}")
        if not ANCHOR <= self.min_chars <= self.max_chars:
            raise ValueError(f"need {ANCHOR} <= min_chars <= max_chars, got {self}")
        if self.remembered < self.max_pending:
            raise ValueError(f"remembered must be >= max_pending, got {self}")


@dataclass(frozen=True)
class LearnedStats:
    """The learner's counters (`ChunkLearner.stats()`)."""

    learned: int  # texts learned and held now
    builds: int  # spans whose cache was built
    hits: int  # learned chunks requests served from their cache
    misses: int  # context spans requests computed: no cache held them yet
    evicted: int  # learned texts forgotten (index and store) past max_learned
    dropped: int  # spans not queued: max_pending builds were waiting
    failed: int  # spans whose build raised or that exceed the model's context (computed, as before)
    pending: int  # spans queued or building now


def learned_id(text: str) -> str:
    """The node id of a learned text: "learned:" + 16 hex chars of its sha256."""
    return LEARNED_PREFIX + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def spans(text: str, min_chars: int = 2 * ANCHOR, max_chars: int = 32768) -> list[str]:
    """The context spans of `text` (module docstring), each a substring of it, in order.

    "Context:\\nA ...\\n\\nB ...\\n\\nQuestion: q"   ->  ["A ...", "B ..."]
    """
    blocks: list[list[tuple[int, int]]] = []  # each: its lines' (start, end) offsets
    question: list[bool] = []
    cur: list[tuple[int, int]] | None = None
    pos = 0
    for line in text.splitlines(keepends=True):
        start, end = pos, pos + len(line.rstrip("\r\n"))
        pos += len(line)
        body = text[start:end]
        if not body.strip() or _SEPARATOR.match(body):
            cur = None
            continue
        label = _CONTEXT_LABEL.match(body)
        if label:
            cur = None
            start += label.end()
            if not text[start:end].strip():
                continue
        if cur is None:
            cur = []
            blocks.append(cur)
            question.append(False)
        cur.append((start, end))
        if _QUESTION.match(body):
            question[-1] = True
    out = []
    for lines, asked in zip(blocks, question):
        if asked:
            continue
        while lines and _header(text[lines[0][0] : lines[0][1]]):
            lines = lines[1:]
        while lines and _header(text[lines[-1][0] : lines[-1][1]]):
            lines = lines[:-1]
        if not lines:
            continue
        span = text[lines[0][0] : lines[-1][1]].strip()
        if min_chars <= len(span) <= max_chars:
            out.append(span)
    return out


def _header(line: str) -> bool:
    s = line.strip()
    return len(s) <= _HEADER_CHARS and s.endswith(":")


class ChunkLearner:
    """One server's learned chunks over its engine (module docstring). Thread-safe: `observe`
    runs on the event loop (hashing and dictionary updates only), builds on the learner's
    own thread."""

    def __init__(self, engine: QCFuseEngine, config: LearnConfig | None = None) -> None:
        self.engine, self.config = engine, config or LearnConfig()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._seen: OrderedDict[str, int] = OrderedDict()  # learned id -> sightings (not learned yet)
        self._pending: set[str] = set()  # learned ids queued or building
        self._unfit: OrderedDict[str, None] = OrderedDict()  # spans longer than the model's context
        # learned id -> text, least recently used first: what this index holds (also from earlier runs)
        self._learned: OrderedDict[str, str] = OrderedDict(
            (nid, text) for _, nid, text in engine.caches.texts.verified_rows() if nid and _is_learned(nid)
        )
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qcfuse-serve-learn")
        self._counts = dict(builds=0, hits=0, misses=0, evicted=0, dropped=0, failed=0)
        self._closed = False

    # ------------------------------------------------------------------ requests
    def observe(self, prompt: str, contexts: Sequence[str], found: Sequence[Piece]) -> int:
        """A request located by content: `prompt` as the model reads it (rendered), `contexts`
        the texts to learn from (substrings of it), `found` the chunks located in it. Counts
        sightings and queues the builds the policy calls for -> how many were queued."""
        cfg = self.config
        taken = _positions(prompt, found)
        candidates: dict[str, str] = {}
        every = (span for ctx in contexts for span in spans(ctx, cfg.min_chars, cfg.max_chars))
        for span in every:
            at = prompt.find(span)
            if at < 0 or any(at < e and s < at + len(span) for s, e in taken):
                continue  # not in the prompt as rendered, or a registered chunk covers it
            candidates.setdefault(learned_id(span), span)
            if len(candidates) >= cfg.max_spans:
                break
        todo: list[tuple[str, str]] = []
        with self._lock:
            for c in found:
                if c.node_id is not None and c.node_id in self._learned:
                    self._learned.move_to_end(c.node_id)
            if self._closed:
                return 0
            for nid, span in candidates.items():
                if nid in self._learned:  # learned, yet not found: another request's build just landed
                    continue
                self._counts["misses"] += 1
                if nid in self._pending or nid in self._unfit:
                    continue
                n = self._seen.pop(nid, 0) + 1
                if n < cfg.after:
                    self._seen[nid] = n
                elif len(self._pending) >= cfg.max_pending:
                    self._counts["dropped"] += 1
                    self._seen[nid] = n  # queued when seen next, if there is room then
                else:
                    self._pending.add(nid)
                    todo.append((span, nid))
            while len(self._seen) > cfg.remembered:
                self._seen.popitem(last=False)
            if todo:
                self._pool.submit(self._build, todo)
        return len(todo)

    def finished(self, result: FusionResult) -> None:
        """A request ended: its learned chunks served from their cache count as hits."""
        n = sum(1 for s in result.spans if s.kind == "chunk" and s.cache_hit and _is_learned(s.node_id))
        if n:
            with self._lock:
                self._counts["hits"] += n

    # ------------------------------------------------------------------ building
    def _build(self, items: list[tuple[str, str]]) -> None:
        """Build and register `items` ((text, learned id)) on the learner's thread, then forget
        the least recently used learned texts past max_learned."""
        engine, queued = self.engine, items
        limit = engine.adapter.max_positions
        try:
            if limit:  # a span longer than the model's context cannot have a cache of its own: never queued again
                long = {nid for t, nid in items if int(engine.caches.chunk_tokens(t)[0].numel()) > limit}
                if long:
                    with self._lock:
                        self._counts["failed"] += len(long)
                        for nid in long:
                            self._unfit[nid] = None
                        while len(self._unfit) > self.config.remembered:
                            self._unfit.popitem(last=False)
                    items = [item for item in items if item[1] not in long]
            engine.build_chunks([t for t, _ in items], register=False)  # no node link: nothing to unlink later
            texts = engine.caches.texts
            for text, nid in items:  # a text registered meanwhile (/v1/chunks) keeps its own id
                texts.add(text, nid, overwrite=False)
            learned = [(t, nid) for t, nid in items if texts.node_id(t) == nid]
            with self._lock:
                for text, nid in learned:
                    self._learned[nid] = text
                self._counts["builds"] += len(items)
                over = max(0, len(self._learned) - self.config.max_learned)
                old = [self._learned.popitem(last=False) for _ in range(over)]
            for nid, text in old:
                self._forget(nid, text)
        except Exception:  # a failed build is only a lost hit: the spans are computed, as before
            log.exception("building the caches of %d learned span(s) failed", len(items))
            with self._lock:
                self._counts["failed"] += len(items)
        finally:
            with self._lock:
                self._pending.difference_update(nid for _, nid in queued)
                self._idle.notify_all()

    def _forget(self, nid: str, text: str) -> None:
        """A learned text leaves the index and its cache the store - unless it has since been
        registered under an id of its own (then it is a registered chunk: kept)."""
        caches = self.engine.caches
        if caches.texts.node_id(text) != nid:
            return
        caches.texts.remove(text)
        key = caches.chunk_tokens(text)[1]
        if key is not None:
            caches.store.delete(key)
        with self._lock:
            self._counts["evicted"] += 1

    # ------------------------------------------------------------------ its life
    def stats(self) -> LearnedStats:
        with self._lock:
            return LearnedStats(learned=len(self._learned), pending=len(self._pending), **self._counts)

    def wait(self, timeout: float) -> bool:
        """Until no build is queued or running (tests, benchmarks) -> False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    def close(self) -> None:
        """Stop building: queued builds are dropped, a running one finishes."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._pending.clear()
            self._idle.notify_all()


def _is_learned(node_id: str | None) -> bool:
    return node_id is not None and node_id.startswith(LEARNED_PREFIX)


def _positions(prompt: str, found: Sequence[Piece]) -> list[tuple[int, int]]:
    """(start, end) of each located chunk in `prompt` (they are in order, non-overlapping)."""
    out, pos = [], 0
    for c in found:
        at = prompt.find(c.text, pos)
        if at < 0:
            continue
        out.append((at, at + len(c.text)))
        pos = at + len(c.text)
    return out


class LearnedCollector:
    """The learner's counters in /metrics, read at scrape time:

    qcfuse_learned_chunks                learned texts held now
    qcfuse_learned_pending               spans queued or building now
    qcfuse_learned_{builds,hits,misses,evicted,dropped,failed}_total   (LearnedStats)
    """

    def __init__(self, learner: ChunkLearner) -> None:
        self.learner = learner

    def collect(self):
        s = self.learner.stats()
        for name, doc, value in (
            ("qcfuse_learned_chunks", "chunk texts learned from prompts, held now", s.learned),
            ("qcfuse_learned_pending", "learned spans queued or building", s.pending),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        for name, doc, value in (
            ("builds", "learned spans whose cache was built", s.builds),
            ("hits", "learned chunks served from their cache", s.hits),
            ("misses", "context spans computed because no cache held them yet", s.misses),
            ("evicted", "learned texts forgotten past the limit (index and store)", s.evicted),
            ("dropped", "spans not queued: too many builds waiting", s.dropped),
            ("failed", "learned spans whose build failed", s.failed),
        ):
            c = CounterMetricFamily(f"qcfuse_learned_{name}", doc)
            c.add_metric([], value)
            yield c
