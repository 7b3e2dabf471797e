"""Learning chunks from what clients send: the one learner of `qcfuse serve` and the integrations.

Neither an OpenAI client nor a RAG framework tells the model which texts of its prompt are
retrieved chunks. Two callers find them, over the machinery of this module:

    qcfuse serve   `ChunkLearner`: the context spans of prompts, learned (below)
    integrations   qcfuse_integrations/learning.py: the texts a retriever returned, built in
                   the background (`BackgroundBuilds`) and matched in prompts that re-render them

What is here:

    spans      `span_offsets` / `spans`: a context's spans at the boundaries RAG frameworks
               render; `chunk_positions` / `overlaps`: where located chunks sit in a prompt
    sightings  each span counted (by content hash) over requests; a span seen
               `LearnConfig.after` times (default: once) is queued
    builds     `BackgroundBuilds`: one background thread per learner, never inside a request; a
               text's latest job is what a prompt holding it waits for
    bounds     `LearnConfig`: the sightings remembered, the builds waiting, the texts learned
    LRU        past `max_learned`, the least recently used learned text leaves the chunk-text
               index and its cache leaves the store

The learned spans of `qcfuse serve`:

    1. split   the context of a prompt (a chat's user and tool messages, a completion's
               prompt) into spans (`spans`)
    2. sight   count each span; a span seen `after` times is queued
    3. build   its cache is built on the learner's thread and the text registered in the
               chunk-text index under the node id "learned:<sha256[:16]>" (`learned_id`)
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
(`max_learned`, LRU by last use). Registered chunks (`/v1/chunks`, ingestion) are never
touched: a span is only a candidate where no registered text was found.

Counts (`LearnedStats`, in /metrics as qcfuse_learned_*): texts learned now, builds, hits
(learned chunks served from their cache), misses (context spans a request computed because no
cache held them yet: first sightings, builds under way), evicted, dropped, failed builds.
`qcfuse store stats` counts the learned texts of a store folder (`count_learned`).
"""

from __future__ import annotations

import hashlib
import logging
import re
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from qcfuse_core.retrieval.texts import ANCHOR
from qcfuse_core.types import FusionResult, Piece

if TYPE_CHECKING:
    from qcfuse_core.engine.api import QCFuseEngine

log = logging.getLogger(__name__)

LEARNED_PREFIX = "learned:"  # node ids of learned texts: "learned:<sha256[:16]>"
_SEPARATOR = re.compile(r"^\s*(?:([-=*_~#])\1{2,}|</?[A-Za-z][\w:-]*(?:\s[^<>]*)?>)\s*$")  # ---, ===, <doc>, </doc>
_CONTEXT_LABEL = re.compile(
    r"^\s*(?:retrieved\s+)?(?:context(?:\s+information)?|documents?|sources?|passages?|excerpts?)\s*:\s*", re.I
)
_QUESTION = re.compile(r"^\s*(?:question|query|q)\s*:", re.I)
_HEADER_CHARS = 80  # a line this short ending with ":" is a header ("Document 1:", "Answer:")


# ---------------------------------------------------------------------------- spans


def learned_id(text: str) -> str:
    """The node id of a learned text: "learned:" + 16 hex chars of its sha256."""
    return LEARNED_PREFIX + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def is_learned(node_id: str | None) -> bool:
    return node_id is not None and node_id.startswith(LEARNED_PREFIX)


def span_offsets(text: str, min_chars: int = 2 * ANCHOR, max_chars: int = 32768) -> list[tuple[int, int]]:
    """(start, end) in `text` of its context spans (module docstring), in order.

    "Context:\\nA ...\\n\\nB ...\\n\\nQuestion: q"   ->  [(9, 9 + len("A ...")), ...]
    """
    out = []
    for lines in _blocks(text):
        while lines and _header(text[lines[0][0] : lines[0][1]]):
            lines = lines[1:]
        while lines and _header(text[lines[-1][0] : lines[-1][1]]):
            lines = lines[:-1]
        if not lines:
            continue
        start, end = lines[0][0], lines[-1][1]
        body = text[start:end]
        start += len(body) - len(body.lstrip())
        end -= len(body) - len(body.rstrip())
        if min_chars <= end - start <= max_chars:
            out.append((start, end))
    return out


def spans(text: str, min_chars: int = 2 * ANCHOR, max_chars: int = 32768) -> list[str]:
    """The context spans of `text` (module docstring), each a substring of it, in order.

    "Context:\\nA ...\\n\\nB ...\\n\\nQuestion: q"   ->  ["A ...", "B ..."]
    """
    return [text[s:e] for s, e in span_offsets(text, min_chars, max_chars)]


def _blocks(text: str) -> list[list[tuple[int, int]]]:
    """The blocks of `text` that are not the question: each its lines' (start, end) offsets."""
    blocks: list[list[tuple[int, int]]] = []
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
    return [lines for lines, asked in zip(blocks, question) if not asked]


def _header(line: str) -> bool:
    s = line.strip()
    return len(s) <= _HEADER_CHARS and s.endswith(":")


def chunk_positions(prompt: str, found: Sequence[Piece]) -> list[tuple[int, int]]:
    """(start, end) of each located chunk in `prompt` (they are in order, non-overlapping;
    one that does not occur is left out)."""
    out, pos = [], 0
    for c in found:
        at = prompt.find(c.text, pos)
        if at < 0:
            continue
        out.append((at, at + len(c.text)))
        pos = at + len(c.text)
    return out


def overlaps(taken: Sequence[tuple[int, int]], start: int, end: int) -> bool:
    return any(start < e and s < end for s, e in taken)


# ---------------------------------------------------------------------------- background builds


class _Job:
    """One submitted job: the pending keys it owns are those still pointing at it."""


class BackgroundBuilds:
    """One learner's background builds: a single thread, never a request's. Each job names the
    keys it builds (a key with a tag: the integrations' node id); a key submitted again while
    it waits follows its latest job. Thread-safe."""

    def __init__(self, thread_name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._cv = threading.Condition()
        self._pending: dict[Hashable, tuple[Future, object, _Job]] = {}  # key -> its latest job
        self.closed = False

    def submit(self, keys: Sequence[tuple[Hashable, object]], fn: Callable[..., object], *args) -> Future | None:
        """Run `fn(*args)` in the background; `keys` ((key, tag)) are pending until it ends.
        None when there is nothing to do or the builds are closed."""
        with self._cv:
            if self.closed or not keys:
                return None
            job = _Job()
            future = self._start(self._run, job, fn, args)
            for key, tag in keys:
                self._pending[key] = (future, tag, job)
            return future

    def _start(self, fn: Callable[..., object], *args) -> Future:
        """The one place work is handed to the background thread."""
        return self._pool.submit(fn, *args)

    def _run(self, job: _Job, fn: Callable[..., object], args: tuple) -> object:
        try:
            return fn(*args)
        finally:
            with self._cv:
                for key in [k for k, (_, _, j) in self._pending.items() if j is job]:
                    del self._pending[key]
                self._cv.notify_all()

    def pending(self, key: Hashable) -> Future | None:
        with self._cv:
            got = self._pending.get(key)
            return got[0] if got else None

    def tag(self, key: Hashable, default: object = None) -> object:
        """The tag `key` was last submitted with, while its job waits or runs (else `default`)."""
        with self._cv:
            got = self._pending.get(key)
            return got[1] if got else default

    def where(self, keep: Callable[[Hashable], bool]) -> set[Future]:
        """The jobs of the pending keys `keep` accepts."""
        with self._cv:
            return {f for k, (f, _, _) in self._pending.items() if keep(k)}

    def __len__(self) -> int:
        with self._cv:
            return len(self._pending)

    def wait(self, timeout: float | None = None) -> bool:
        """Until no key is pending -> False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending, timeout)

    def close(self, *, cancel: bool) -> None:
        """Stop: cancel, the jobs not started are dropped (else they run first); a running one
        finishes."""
        with self._cv:
            self.closed = True
        self._pool.shutdown(wait=True, cancel_futures=cancel)
        with self._cv:
            self._pending.clear()
            self._cv.notify_all()


# ---------------------------------------------------------------------------- the learned spans


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


class ChunkLearner:
    """One server's learned chunks over its engine (module docstring). Thread-safe: `observe`
    runs on the event loop (hashing and dictionary updates only), builds on the learner's
    own thread."""

    def __init__(self, engine: QCFuseEngine, config: LearnConfig | None = None) -> None:
        self.engine, self.config = engine, config or LearnConfig()
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, int] = OrderedDict()  # learned id -> sightings (not learned yet)
        self._unfit: OrderedDict[str, None] = OrderedDict()  # spans longer than the model's context
        # learned id -> text, least recently used first: what this index holds (also from earlier runs)
        self._learned: OrderedDict[str, str] = OrderedDict(
            (nid, text) for _, nid, text in engine.caches.texts.verified_rows() if nid is not None and is_learned(nid)
        )
        self._builds = BackgroundBuilds("qcfuse-serve-learn")
        self._counts = dict(builds=0, hits=0, misses=0, evicted=0, dropped=0, failed=0)

    # ------------------------------------------------------------------ requests
    def observe(self, prompt: str, contexts: Sequence[str], found: Sequence[Piece]) -> int:
        """A request located by content: `prompt` as the model reads it (rendered), `contexts`
        the texts to learn from (substrings of it), `found` the chunks located in it. Counts
        sightings and queues the builds the policy calls for -> how many were queued."""
        candidates = self._candidates(prompt, contexts, found)
        with self._lock:
            for c in found:
                if c.node_id is not None and c.node_id in self._learned:
                    self._learned.move_to_end(c.node_id)
            if self._builds.closed:
                return 0
            todo = self._sight(candidates)
            self._builds.submit([(nid, None) for _, nid in todo], self._build, todo)
        return len(todo)

    def _candidates(self, prompt: str, contexts: Sequence[str], found: Sequence[Piece]) -> dict[str, str]:
        """{learned id: span} of the contexts' spans in `prompt` no located chunk covers."""
        cfg = self.config
        taken = chunk_positions(prompt, found)
        candidates: dict[str, str] = {}
        every = (span for ctx in contexts for span in spans(ctx, cfg.min_chars, cfg.max_chars))
        for span in every:
            at = prompt.find(span)
            if at < 0 or overlaps(taken, at, at + len(span)):
                continue  # not in the prompt as rendered, or a registered chunk covers it
            candidates.setdefault(learned_id(span), span)
            if len(candidates) >= cfg.max_spans:
                break
        return candidates

    def _sight(self, candidates: dict[str, str]) -> list[tuple[str, str]]:
        """(under the lock) count the sightings -> (span, id) of those to build now."""
        cfg = self.config
        todo: list[tuple[str, str]] = []
        waiting = len(self._builds)
        for nid, span in candidates.items():
            if nid in self._learned:  # learned, yet not found: another request's build just landed
                continue
            self._counts["misses"] += 1
            if self._builds.pending(nid) is not None or nid in self._unfit:
                continue
            n = self._seen.pop(nid, 0) + 1
            if n < cfg.after:
                self._seen[nid] = n
            elif waiting + len(todo) >= cfg.max_pending:
                self._counts["dropped"] += 1
                self._seen[nid] = n  # queued when seen next, if there is room then
            else:
                todo.append((span, nid))
        while len(self._seen) > cfg.remembered:
            self._seen.popitem(last=False)
        return todo

    def finished(self, result: FusionResult) -> None:
        """A request ended: its learned chunks served from their cache count as hits."""
        n = sum(1 for s in result.spans if s.kind == "chunk" and s.cache_hit and is_learned(s.node_id))
        if n:
            with self._lock:
                self._counts["hits"] += n

    # ------------------------------------------------------------------ building
    def _build(self, items: list[tuple[str, str]]) -> None:
        """Build and register `items` ((text, learned id)) on the learner's thread, then forget
        the least recently used learned texts past max_learned."""
        engine = self.engine
        try:
            items = self._fitting(items)
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

    def _fitting(self, items: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """`items` less the spans longer than the model's context (they cannot have a cache of
        their own: counted as failed, never queued again)."""
        limit = self.engine.adapter.max_positions
        if not limit:
            return items
        caches = self.engine.caches
        long = {nid for t, nid in items if int(caches.chunk_tokens(t)[0].numel()) > limit}
        if long:
            with self._lock:
                self._counts["failed"] += len(long)
                for nid in long:
                    self._unfit[nid] = None
                while len(self._unfit) > self.config.remembered:
                    self._unfit.popitem(last=False)
        return [item for item in items if item[1] not in long]

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
            return LearnedStats(learned=len(self._learned), pending=len(self._builds), **self._counts)

    def wait(self, timeout: float) -> bool:
        """Until no build is queued or running (tests, benchmarks) -> False on timeout."""
        return self._builds.wait(timeout)

    def close(self) -> None:
        """Stop building: queued builds are dropped, a running one finishes."""
        self._builds.close(cancel=True)


def count_learned(path: str | Path) -> tuple[int, int]:
    """(texts, characters) the server learned from prompts in the chunk-text index file at
    `path`, read without writing ((0, 0) when there is no file)."""
    path = Path(path)
    if not path.is_file():
        return 0, 0
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        row = db.execute(
            "SELECT COUNT(*), COALESCE(SUM(LENGTH(text)), 0) FROM chunk_text WHERE node_id LIKE ?",
            (LEARNED_PREFIX + "%",),
        ).fetchone()
    except sqlite3.Error:
        return 0, 0
    finally:
        db.close()
    return int(row[0]), int(row[1])
