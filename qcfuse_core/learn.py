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
    bounds     `LearnConfig`: the sightings remembered, the builds waiting, the texts and the
               bytes learned
    LRU        past a bound, the tenant holding most gives up its least recently used text;
               a text no tenant holds leaves the chunk-text index and its cache the store

The learned spans of `qcfuse serve`, per tenant (the server says whose a request is: its API
key, its `user`, its `cache_salt`, or no one's - "", the tenant every request shares):

    1. split   the context blocks of a prompt (a chat's user and tool messages - system ones
               too with `LearnConfig.system` -, a completion's prompt) into spans (`spans`),
               each at its offset in the prompt as rendered
    2. sight   count each span per tenant; a span a tenant sent `after` times is queued
    3. build   its cache is built on the learner's thread and the text registered in the
               chunk-text index under the node id "learned:<sha256[:16]>" (`learned_id`);
               the tenants holding it are written down beside it (`_Ledger`)
    4. serve   `pieces`: a request is given the texts its tenant learned where they stand as
               whole spans of a block whose role allows them - never inside a word or a
               longer paragraph, a question or a system prompt (unless opted in), never
               another tenant's - in any order and beside registered chunks

The index finds learned texts by content like any other (it does not know what "learned"
means); the server hands the learner only the registered ones (`is_learned`) and serves
what `pieces` grants.

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
more are dropped and counted, the span is queued again when seen again), the texts learned
(`max_learned`) and their caches' bytes (`max_bytes`, default LEARNED_SHARE of the store's
disk limit): past either, the tenant holding most gives up its least recently used text
(`_Holdings`), so one tenant's flood never evicts another's texts.

Quotas, per tenant. A tenant has at most `tenant_pending` builds waiting (default 64 of the
256): past it, its own new spans are dropped, so one tenant's flood leaves the others room in
the queue. While two tenants or more hold learned texts, each keeps at most `tenant_bytes`
of caches (default TENANT_SHARE of the byte budget; a lone tenant may use all of it).
The builds waiting run tenant by tenant in turn (`BackgroundBuilds` lanes), first in first
out within a tenant, so one tenant's flood of new spans never queues ahead of another's.
Builds run at the scheduler's lowest priority (`build_chunks(background=True)`: one chunk in
a step where no request waits or runs, once none has for IDLE_WORK_AFTER_S), so a flood of
requests delays the builds, never another tenant's requests. Registered chunks
(`/v1/chunks`, ingestion) are never touched: a span is only a candidate where no registered
text was found, and the store evicts learned caches first and only learned caches to make
room for one (`ChunkStore.evict_first`).

Counts (`LearnedStats`, in /metrics as qcfuse_learned_*): texts and bytes learned now,
tenants, builds, hits (learned chunks served from their cache), misses (context spans a
request computed because no cache held them yet: first sightings, builds under way),
evicted, dropped, failed builds. `qcfuse store stats` counts the learned texts and bytes of a
store folder (`count_learned`, `learned_bytes`).
"""

from __future__ import annotations

import hashlib
import logging
import re
import sqlite3
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from qcfuse_core.retrieval.texts import ANCHOR
from qcfuse_core.types import ChunkKey, FusionResult, Piece

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
CONTEXT_ROLES = ("user", "tool")  # the messages whose context blocks are learned and served
SYSTEM_ROLES = ("system", "developer")  # learned too only where the operator opts in (`LearnConfig.system`)
LEARNED_SHARE = 0.25  # of the store's disk limit: the default byte budget of learned caches
DEFAULT_LEARNED_BYTES = 1 << 30  # the budget where the store has no disk limit (an in-memory store)
TENANT_SHARE = 0.5  # of the byte budget: the most one tenant holds while another holds learned texts too


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
    return [(s, e) for s, e, _ in _located(prompt, found)]


def overlaps(taken: Sequence[tuple[int, int]], start: int, end: int) -> bool:
    return any(start < e and s < end for s, e in taken)


# ---------------------------------------------------------------------------- background builds


class _Job:
    """One submitted job: the pending keys it owns are those still pointing at it."""


class BackgroundBuilds:
    """One learner's background builds: a single thread, never a request's. Each job names the
    keys it builds (a key with a tag: the integrations' node id); a key submitted again while
    it waits follows its latest job. Jobs run lane by lane in turn (`submit`'s lane: the
    server's tenant), first in first out within a lane, so one lane's flood of builds never
    queues ahead of another lane's one. Thread-safe."""

    def __init__(self, thread_name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._cv = threading.Condition()
        self._pending: dict[Hashable, tuple[Future, object, _Job]] = {}  # key -> its latest job
        # lane -> its waiting jobs; the lane served next first (a lane served goes to the back)
        self._lanes: OrderedDict[Hashable, deque[tuple[_Job, Future, Callable[..., object], tuple]]] = OrderedDict()
        self.closed = False

    def submit(
        self, keys: Sequence[tuple[Hashable, object]], fn: Callable[..., object], *args, lane: Hashable = None
    ) -> Future | None:
        """Run `fn(*args)` in the background, in `lane`'s turn; `keys` ((key, tag)) are pending
        until it ends. None when there is nothing to do or the builds are closed."""
        with self._cv:
            if self.closed or not keys:
                return None
            job, future = _Job(), Future[object]()
            self._lanes.setdefault(lane, deque()).append((job, future, fn, args))
            for key, tag in keys:
                self._pending[key] = (future, tag, job)
            self._start(self._run_next)
            return future

    def _start(self, fn: Callable[..., object], *args) -> Future:
        """The one place work is handed to the background thread (one task per job: each runs
        the job whose turn it is when it starts)."""
        return self._pool.submit(fn, *args)

    def _run_next(self) -> None:
        """The first job of the lane whose turn it is; that lane goes to the back."""
        with self._cv:
            if not self._lanes:
                return
            lane, jobs = next(iter(self._lanes.items()))
            job, future, fn, args = jobs.popleft()
            del self._lanes[lane]
            if jobs:
                self._lanes[lane] = jobs
        try:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # the job's own error, for its submitter
                    future.set_exception(e)
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

    def count(self, keep: Callable[[Hashable], bool]) -> int:
        """How many pending keys `keep` accepts."""
        with self._cv:
            return sum(1 for k in self._pending if keep(k))

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
            for jobs in self._lanes.values():
                for _, future, _, _ in jobs:
                    future.cancel()
            self._lanes.clear()
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
    max_learned: int = 4096  # learned texts kept; past it the tenant holding most gives up its oldest
    # bytes of learned caches kept, the same way (None: LEARNED_SHARE of the store's disk limit,
    # DEFAULT_LEARNED_BYTES for a store without one)
    max_bytes: int | None = None
    max_pending: int = 256  # spans waiting for their build; more are dropped until seen again
    # spans one tenant may have waiting for their build; more of its own are dropped (so a
    # tenant's flood leaves the others max_pending - tenant_pending places)
    tenant_pending: int = 64
    # bytes of learned caches one tenant keeps while another tenant holds learned texts too;
    # past it, it gives up its least recently used (None: TENANT_SHARE of the byte budget)
    tenant_bytes: int | None = None
    remembered: int = 1 << 16  # span hashes whose sightings are counted (LRU)
    system: bool = False  # also learn and serve the spans of system (and developer) messages

    def __post_init__(self) -> None:
        if min(self.after, self.max_spans, self.max_learned, self.max_pending, self.tenant_pending) < 1:
            raise ValueError(f"after, max_spans, max_learned, max_pending and tenant_pending must be >= 1, got {self}")
        for name in ("max_bytes", "tenant_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {getattr(self, name)}")
        if not ANCHOR <= self.min_chars <= self.max_chars:
            raise ValueError(f"need {ANCHOR} <= min_chars <= max_chars, got {self}")
        if self.remembered < self.max_pending:
            raise ValueError(f"remembered must be >= max_pending, got {self}")

    @property
    def roles(self) -> tuple[str, ...]:
        """The message roles whose context blocks are learned and served."""
        return CONTEXT_ROLES + (SYSTEM_ROLES if self.system else ())


@dataclass(frozen=True)
class LearnedStats:
    """The learner's counters (`ChunkLearner.stats()`)."""

    learned: int  # texts learned and held now (by any tenant)
    bytes: int  # their caches' bytes in the store (each text once)
    tenants: int  # tenants holding learned texts
    builds: int  # spans whose cache was built
    hits: int  # learned chunks requests served from their cache
    misses: int  # context spans requests computed: no cache held them yet
    evicted: int  # learned texts a tenant gave up past max_learned, max_bytes or its tenant_bytes
    dropped: int  # spans not queued: max_pending builds were waiting, or tenant_pending of the tenant's
    failed: int  # spans whose build raised, exceed the model's context or found no room (computed, as before)
    pending: int  # spans queued or building now


def tenant_tag(tenant: str) -> str:
    """The stored name of a tenant: "" for the one every request without a tenant shares,
    else 16 hex chars of its sha256 (an API key is never stored)."""
    return "" if not tenant else hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:16]


@dataclass
class _Learned:
    """One learned text: its cache's key and bytes, and the tenants holding it."""

    text: str
    key: str | None  # ChunkKey.to_string()
    nbytes: int
    owners: set[str] = field(default_factory=set)


class _Holdings:
    """The learned texts and who holds them (used under the learner's lock). Each tenant's
    ids, least recently used first; a text's bytes counted once. Past `max_learned` texts
    or `max_bytes`, the tenant holding most (texts, or bytes) gives up its least recently
    used text; a text no tenant holds is released (`settle`). So one tenant's flood evicts
    its own texts, never those of a tenant holding less. While two tenants or more hold
    texts, one holding more than `tenant_bytes` gives up its least recently used too (its
    quota: a tenant learning later finds room without waiting for the budget to fill)."""

    def __init__(self, max_learned: int, max_bytes: int, tenant_bytes: int | None = None) -> None:
        self.max_learned, self.max_bytes = max_learned, max_bytes
        self.tenant_bytes_max = max_bytes if tenant_bytes is None else tenant_bytes
        self.texts: dict[str, _Learned] = {}  # learned id -> its text
        self.lru: dict[str, OrderedDict[str, None]] = {}  # tenant -> its ids, least recently used first
        self.tenant_bytes: dict[str, int] = {}
        self.bytes = 0
        self.keys: set[str] = set()  # the cache keys of learned texts (expendable in the store)

    def holds(self, tenant: str, nid: str) -> bool:
        return nid in self.lru.get(tenant, ())

    def touch(self, tenant: str, nid: str) -> None:
        self.lru[tenant].move_to_end(nid)

    def add(self, tenant: str, nid: str, text: str, key: str | None, nbytes: int) -> None:
        entry = self.texts.get(nid)
        if entry is None:
            entry = self.texts[nid] = _Learned(text, key, nbytes)
            self.bytes += nbytes
            if key is not None:
                self.keys.add(key)
        if tenant not in entry.owners:
            entry.owners.add(tenant)
            self.tenant_bytes[tenant] = self.tenant_bytes.get(tenant, 0) + entry.nbytes
        self.lru.setdefault(tenant, OrderedDict())[nid] = None

    def drop(self, tenant: str, nid: str) -> _Learned | None:
        """`tenant` gives up `nid` -> the text, when no tenant holds it any more."""
        entry = self.texts[nid]
        entry.owners.discard(tenant)
        del self.lru[tenant][nid]
        self.tenant_bytes[tenant] -= entry.nbytes
        if not self.lru[tenant]:
            del self.lru[tenant], self.tenant_bytes[tenant]
        if entry.owners:
            return None
        del self.texts[nid]
        self.bytes -= entry.nbytes
        self.keys.discard(entry.key or "")
        return entry

    def settle(self) -> tuple[list[tuple[str, str]], list[tuple[str, _Learned]]]:
        """Within the bounds again -> the (tenant, id) given up, the (id, text) released."""
        dropped: list[tuple[str, str]] = []
        released: list[tuple[str, _Learned]] = []
        while self.lru:
            tenant = self._over()
            if tenant is None:
                break
            nid = next(iter(self.lru[tenant]))
            dropped.append((tenant, nid))
            gone = self.drop(tenant, nid)
            if gone is not None:
                released.append((nid, gone))
        return dropped, released

    def _over(self) -> str | None:
        """The tenant to give up a text now: past the bytes, the one holding most bytes; past
        the texts, the one holding most texts; else one past its quota (two tenants or more)."""
        if self.bytes > self.max_bytes:
            return max(self.tenant_bytes, key=lambda t: self.tenant_bytes[t])
        if len(self.texts) > self.max_learned:
            return max(self.lru, key=lambda t: len(self.lru[t]))
        if len(self.lru) > 1:
            return next((t for t, n in self.tenant_bytes.items() if n > self.tenant_bytes_max), None)
        return None

    def order(self) -> list[tuple[str, str]]:
        """Every (tenant, id), least recently used first within each tenant."""
        return [(t, nid) for t, ids in self.lru.items() for nid in ids]


_LEDGER = (
    "CREATE TABLE IF NOT EXISTS learned_span (tenant TEXT NOT NULL, id TEXT NOT NULL, chars INTEGER NOT NULL, "
    "bytes INTEGER NOT NULL, used INTEGER NOT NULL, PRIMARY KEY (tenant, id))"
)


class _Ledger:
    """Which tenant learned which text, its size, its last use: a table of the learner's own
    in the chunk-text index's file (which holds the learned texts), so that a server started
    again over the folder keeps each tenant's texts apart. Nothing is written where the
    index has no file, or once a write failed (one warning)."""

    def __init__(self, path: Path | None) -> None:
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        if path is None:
            return
        try:
            self._db = sqlite3.connect(str(path), check_same_thread=False, timeout=30)
            self._db.execute(_LEDGER)
            self._db.commit()
        except sqlite3.Error as e:
            self._failed(e)

    def rows(self) -> list[tuple[str, str, int]]:
        """(tenant, id, bytes), least recently used first."""
        with self._lock:
            if self._db is None:
                return []
            return self._db.execute("SELECT tenant, id, bytes FROM learned_span ORDER BY used").fetchall()

    def write(self, put: Sequence[tuple[str, str, int, int, int]], drop: Sequence[tuple[str, str]]) -> None:
        """Rows (tenant, id, chars, bytes, used) in, (tenant, id) out."""
        with self._lock:
            if self._db is None or not (put or drop):
                return
            try:
                self._db.executemany("INSERT OR REPLACE INTO learned_span VALUES (?, ?, ?, ?, ?)", put)
                self._db.executemany("DELETE FROM learned_span WHERE tenant = ? AND id = ?", drop)
                self._db.commit()
            except sqlite3.Error as e:
                self._failed(e)

    def close(self, order: Sequence[tuple[str, str]]) -> None:
        """Record the order of use (`order`: least recently used first) and close."""
        with self._lock:
            db, self._db = self._db, None
        if db is None:
            return
        try:
            db.executemany(
                "UPDATE learned_span SET used = ? WHERE tenant = ? AND id = ?",
                [(i, t, n) for i, (t, n) in enumerate(order)],
            )
            db.commit()
        except sqlite3.Error as e:
            log.warning("the order of the learned texts was not written (%s)", e)
        finally:
            db.close()

    def _failed(self, e: sqlite3.Error) -> None:
        log.warning("the learned texts' tenants are not written (%s): kept in memory for this process", e)
        if self._db is not None:
            self._db.close()
        self._db = None


class ChunkLearner:
    """One server's learned chunks over its engine (module docstring). Thread-safe: `pieces`
    and `observe` run on the event loop (hashing and dictionary updates only), builds on the
    learner's own thread."""

    def __init__(self, engine: QCFuseEngine, config: LearnConfig | None = None) -> None:
        self.engine, self.config = engine, config or LearnConfig()
        store, texts = engine.caches.store, engine.caches.texts
        self._lock = threading.Lock()
        self._seen: OrderedDict[tuple[str, str], int] = OrderedDict()  # (tenant, learned id) -> sightings
        self._unfit: OrderedDict[str, None] = OrderedDict()  # spans longer than the model's context
        self._building: set[str] = set()  # cache keys of learned texts being built (expendable already)
        cap = store.disk_capacity()
        budget = self.config.max_bytes or (int(LEARNED_SHARE * cap) if cap else DEFAULT_LEARNED_BYTES)
        share = self.config.tenant_bytes or max(1, int(TENANT_SHARE * budget))
        self._held = _Holdings(self.config.max_learned, budget, share)
        self._ledger = _Ledger(None if texts.in_memory else texts.path)
        self._builds = BackgroundBuilds("qcfuse-serve-learn")
        self._counts = dict(builds=0, hits=0, misses=0, evicted=0, dropped=0, failed=0)
        self._tick = 0
        self._load()
        store.evict_first(self._expendable)

    @property
    def max_bytes(self) -> int:
        """The bytes learned caches may hold (`LearnConfig.max_bytes`, or its default)."""
        return self._held.max_bytes

    @property
    def tenant_bytes(self) -> int:
        """The bytes one tenant keeps while another holds texts (`LearnConfig.tenant_bytes`, or its default)."""
        return self._held.tenant_bytes_max

    def _load(self) -> None:
        """The learned texts of the index (earlier runs), each held by the tenants the ledger
        names; a text the ledger does not name (learned before tenants were kept) is the
        shared tenant's. Then within the bounds."""
        index = {
            nid: t for _, nid, t in self.engine.caches.texts.verified_rows() if nid is not None and is_learned(nid)
        }
        rows = self._ledger.rows()
        for tenant, nid, nbytes in rows:
            if nid in index:
                self._held.add(tenant, nid, index[nid], self._measure(index[nid])[0], nbytes)
        self._tick = len(rows)  # after the order `close` wrote down
        for nid, text in index.items():
            if nid not in self._held.texts:
                self._held.add("", nid, text, *self._measure(text))
        self._settle()

    def _measure(self, text: str) -> tuple[str | None, int]:
        """(cache key, bytes in the store) of a text's cache."""
        key = self.engine.caches.chunk_tokens(text)[1]
        return (None, 0) if key is None else (key.to_string(), self.engine.caches.store.stored_bytes(key))

    def _expendable(self, key: str) -> bool:
        """The store's question: is this entry a learned cache (it leaves first)?"""
        return key in self._held.keys or key in self._building

    # ------------------------------------------------------------------ requests
    def pieces(self, prompt: str, contexts: Sequence[Context], found: Sequence[Piece], tenant: str = "") -> list[Piece]:
        """The chunks a request is served: the registered ones of `found` (a learned one is the
        learner's to grant) and the texts `tenant` learned, each where it stands as a whole
        span of a context block whose role allows it (`LearnConfig.roles`), in prompt order."""
        tag = tenant_tag(tenant)
        registered = [(s, e, p) for s, e, p in _located(prompt, found) if not is_learned(p.node_id)]
        taken = [(s, e) for s, e, _ in registered]
        mine: list[tuple[int, int, Piece]] = []
        with self._lock:
            for at, span in self._spans_at(prompt, contexts):
                nid = learned_id(span)
                if self._held.holds(tag, nid) and not overlaps(taken, at, at + len(span)):
                    self._held.touch(tag, nid)
                    mine.append((at, at + len(span), Piece("chunk", span, nid)))
                    taken.append((at, at + len(span)))
        return _in_order(prompt, registered, mine)

    def observe(self, prompt: str, contexts: Sequence[Context], found: Sequence[Piece], tenant: str = "") -> int:
        """A request located by content: `prompt` as the model reads it (rendered), `contexts`
        its blocks in order ((role, text), or a text: a user's), `found` the chunks it is
        served. Counts `tenant`'s sightings of the spans no chunk covers and queues the builds
        the policy calls for -> how many were queued."""
        tag = tenant_tag(tenant)
        taken = chunk_positions(prompt, found)
        candidates: dict[str, str] = {}
        for at, span in self._spans_at(prompt, contexts):
            if overlaps(taken, at, at + len(span)):
                continue  # a chunk covers it
            candidates.setdefault(learned_id(span), span)
            if len(candidates) >= self.config.max_spans:
                break
        with self._lock:
            for c in found:
                if c.node_id is not None and self._held.holds(tag, c.node_id):
                    self._held.touch(tag, c.node_id)
            if self._builds.closed:
                return 0
            todo = self._sight(tag, candidates)
            self._builds.submit([((tag, nid), None) for _, _, nid in todo], self._build, todo, lane=tag)
        return len(todo)

    def _spans_at(self, prompt: str, contexts: Sequence[Context]) -> list[tuple[int, str]]:
        """(offset in `prompt`, span) of the spans of the blocks whose role allows them. Each
        block is looked for after the one before it; one the prompt does not hold verbatim
        (a template that rewrites it) gives none."""
        cfg, cursor = self.config, 0
        out: list[tuple[int, str]] = []
        for block in contexts:
            role, text = ("user", block) if isinstance(block, str) else block
            if not isinstance(text, str) or not text.strip():
                continue
            at = prompt.find(text, cursor)
            if at < 0:
                text = text.strip()
                at = prompt.find(text, cursor)
            if at < 0:
                continue
            cursor = at + len(text)
            if role in cfg.roles:
                out.extend((at + s, text[s:e]) for s, e in span_offsets(text, cfg.min_chars, cfg.max_chars))
        return out

    def _sight(self, tenant: str, candidates: dict[str, str]) -> list[tuple[str, str, str]]:
        """(under the lock) count the sightings -> (tenant, span, id) of those to build now."""
        cfg = self.config
        todo: list[tuple[str, str, str]] = []
        waiting = len(self._builds)
        mine = self._builds.count(lambda key: key[0] == tenant)  # type: ignore[index]
        for nid, span in candidates.items():
            if self._held.holds(tenant, nid):  # learned, yet not served: another request's build just landed
                continue
            self._counts["misses"] += 1
            if self._builds.pending((tenant, nid)) is not None or nid in self._unfit:
                continue
            n = self._seen.pop((tenant, nid), 0) + 1
            if n < cfg.after:
                self._seen[(tenant, nid)] = n
            elif waiting + len(todo) >= cfg.max_pending or mine + len(todo) >= cfg.tenant_pending:
                self._counts["dropped"] += 1
                self._seen[(tenant, nid)] = n  # queued when seen next, if there is room then
            else:
                todo.append((tenant, span, nid))
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
    def _build(self, items: list[tuple[str, str, str]]) -> None:
        """Build and register `items` ((tenant, text, learned id)) on the learner's thread, then
        bring the learned texts back within the bounds."""
        try:
            items = self._fitting(items)
            keys = self._expendable_keys([t for _, t, _ in items])
            try:
                self.engine.build_chunks(list(dict.fromkeys(t for _, t, _ in items)), register=False, background=True)
                kept = self._register(items)
            finally:
                self._building.difference_update(keys)
            self._hold(kept, len(items))
        except Exception:  # a failed build is only a lost hit: the spans are computed, as before
            log.exception("building the caches of %d learned span(s) failed", len(items))
            with self._lock:
                self._counts["failed"] += len(items)

    def _expendable_keys(self, texts: Sequence[str]) -> set[str]:
        """Mark the cache keys of the `texts` not stored yet as learned before they are
        written (the store then evicts only learned caches to make room for them)."""
        caches = self.engine.caches
        keys = {k.to_string() for k in (caches.chunk_tokens(t)[1] for t in texts) if k is not None}
        keys = {k for k in keys if k not in self._held.keys and not caches.store.contains(ChunkKey.from_string(k))}
        self._building.update(keys)
        return keys

    def _register(self, items: list[tuple[str, str, str]]) -> list[tuple[str, str, str, str | None, int]]:
        """Register the built texts (one registered meanwhile, /v1/chunks, keeps its own id)
        -> (tenant, text, id, key, bytes) of those learned and stored; one whose cache found
        no room in the store is forgotten."""
        texts, kept = self.engine.caches.texts, []
        for tenant, text, nid in items:
            texts.add(text, nid, overwrite=False)
            if texts.node_id(text) != nid:
                continue
            key, nbytes = self._measure(text)
            if key is not None and nbytes == 0 and not self.engine.caches.store.contains(ChunkKey.from_string(key)):
                texts.remove(text)
                with self._lock:
                    self._counts["failed"] += 1
                continue
            kept.append((tenant, text, nid, key, nbytes))
        return kept

    def _hold(self, kept: list[tuple[str, str, str, str | None, int]], built: int) -> None:
        with self._lock:
            self._counts["builds"] += built
            rows = []
            for tenant, text, nid, key, nbytes in kept:
                self._held.add(tenant, nid, text, key, nbytes)
                self._tick += 1
                rows.append((tenant, nid, len(text), self._held.texts[nid].nbytes, self._tick))
        self._ledger.write(rows, [])
        self._settle()

    def _settle(self) -> None:
        """Within the bounds: what tenants gave up leaves the ledger; a text no tenant holds
        leaves the index and its cache the store."""
        with self._lock:
            dropped, released = self._held.settle()
            self._counts["evicted"] += len(dropped)
        self._ledger.write([], dropped)
        for nid, entry in released:
            self._forget(nid, entry)

    def _fitting(self, items: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
        """`items` less the spans longer than the model's context (they cannot have a cache of
        their own: counted as failed, never queued again)."""
        limit = self.engine.adapter.max_positions
        if not limit:
            return items
        caches = self.engine.caches
        long = {nid for _, t, nid in items if int(caches.chunk_tokens(t)[0].numel()) > limit}
        if long:
            with self._lock:
                self._counts["failed"] += sum(1 for item in items if item[2] in long)
                for nid in long:
                    self._unfit[nid] = None
                while len(self._unfit) > self.config.remembered:
                    self._unfit.popitem(last=False)
        return [item for item in items if item[2] not in long]

    def _forget(self, nid: str, entry: _Learned) -> None:
        """A learned text leaves the index and its cache the store - unless it has since been
        registered under an id of its own (then it is a registered chunk: kept)."""
        caches = self.engine.caches
        if caches.texts.node_id(entry.text) != nid:
            return
        caches.texts.remove(entry.text)
        if entry.key is not None:
            caches.store.delete(ChunkKey.from_string(entry.key))

    # ------------------------------------------------------------------ its life
    def stats(self) -> LearnedStats:
        with self._lock:
            held = self._held
            return LearnedStats(
                learned=len(held.texts),
                bytes=held.bytes,
                tenants=len(held.lru),
                pending=len(self._builds),
                **self._counts,
            )

    def wait(self, timeout: float) -> bool:
        """Until no build is queued or running (tests, benchmarks) -> False on timeout."""
        return self._builds.wait(timeout)

    def close(self) -> None:
        """Stop building: queued builds are dropped, a running one finishes; the order of use
        is written down for the next server over the folder."""
        self._builds.close(cancel=True)
        self.engine.caches.store.evict_first(None)
        with self._lock:
            order = self._held.order()
        self._ledger.close(order)


Context = str | tuple[str, str]  # a block of a prompt: (role, text), or a text (a user's)


def _located(prompt: str, found: Sequence[Piece]) -> list[tuple[int, int, Piece]]:
    """(start, end, chunk) of each located chunk in `prompt`, as `split_prompt` finds them."""
    out: list[tuple[int, int, Piece]] = []
    pos = 0
    for c in found:
        at = prompt.find(c.text, pos)
        if at < 0:
            continue
        out.append((at, at + len(c.text), c))
        pos = at + len(c.text)
    return out


def _in_order(prompt: str, registered: list, learned: list) -> list[Piece]:
    """The chunks in prompt order; a learned text is kept only where it is found there first
    (the engine locates chunks by searching on from the one before)."""
    out, pos = [], 0
    for start, end, piece in sorted(registered + learned, key=lambda x: x[0]):
        if is_learned(piece.node_id) and prompt.find(piece.text, pos) != start:
            continue
        out.append(piece)
        pos = end
    return out


def _totals(path: str | Path) -> tuple[int, int, int]:
    """(texts, characters, bytes) learned in the chunk-text index file at `path`."""
    path = Path(path)
    if not path.is_file():
        return 0, 0, 0
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        row = db.execute(
            "SELECT COUNT(*), COALESCE(SUM(c), 0), COALESCE(SUM(b), 0) FROM "
            "(SELECT MAX(chars) AS c, MAX(bytes) AS b FROM learned_span GROUP BY id)"
        ).fetchone()
    except sqlite3.Error:
        return 0, 0, 0
    finally:
        db.close()
    return int(row[0]), int(row[1]), int(row[2])


def count_learned(path: str | Path) -> tuple[int, int]:
    """(texts, characters) the server learned from prompts, by the ledger in the chunk-text
    index file at `path`, read without writing ((0, 0) when there is no file)."""
    return _totals(path)[:2]


def learned_bytes(path: str | Path) -> int:
    """The bytes of the learned texts' caches, by the ledger in the index file at `path`."""
    return _totals(path)[2]
