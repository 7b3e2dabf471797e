"""Caches follow retrieval: what the frameworks retrieve is learned, built and matched.

Neither framework tells an LLM which texts are in its prompt, and a user should not have to
add an ingestion step for caches to hit. Each engine has one `Learner`:

    see(texts)      a retriever returned these texts (LlamaIndex: the retrieval-end event;
                    LangChain: `on_retriever_end`): they are registered in the content index
                    and, where no cache is stored yet, built in a background thread
    match(prompt)   the chunk pieces of a prompt (`amatch`: the same for asyncio): registered
                    texts found verbatim (a text inside a longer rendering - a metadata
                    header before it - counts); then recently retrieved texts that the
                    prompt renders differently:

        stored:   "Halden lies on the north coast.\\n\\nIts harbour ..."
        prompt:   "... Halden lies on the north coast. Its harbour ..."     (whitespace)
        prompt:   "... Halden lies on the north coast.\\n\\nIts ha"          (truncated)
        prompt:   "['Halden lies on the north coast.\\\\n\\\\nIts harbour ...']"  (a list repr)

                    the prompt's own rendering of such a text is registered (under the text's
                    id) with the stored text as its source: this call serves the token runs
                    they share from the stored cache (qcfuse_core/cache/subspans.py: a truncation's
                    token-aligned prefix exactly; long runs inside, as approximate as any
                    chunk cache) and computes the rest; the rendering's own cache is then
                    built in the background (`build`), a full hit next time. A cache is only
                    ever served for the exact tokens it holds (runs are matched on token ids),
                    so nothing is attributed to a text it was not computed from.
    waits           a prompt that holds a text whose background build is under way waits for
                    it (no double work; counted in `Match.wait_ms`, inside its TTFT), at most
                    BUILD_WAIT_S; `amatch` awaits those builds as futures
                    (`asyncio.wrap_future`), so the event loop runs meanwhile
    built           a cache a background build computed for a retrieval counts, in the first
                    prompt that uses it, as built during that request (`Match.built`), not as
                    a hit: the request waited for it, or it was computed for this query since
                    its retrieval; the next prompt with the text reports a hit
    unmatched       a prompt that carries retrieved context (a line of a recently retrieved
                    text, or a context header) but matched no chunk logs one WARNING per
                    engine, with the likely cause and the fix, and counts in `counters()`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Collection, Generator, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace

from qcfuse_core import MIN_CHUNK_CHARS, BackgroundBuilds, Piece, QCFuseEngine, chunk_positions, overlaps

log = logging.getLogger(__name__)

RECENT = 256  # retrieved texts kept for matching re-rendered prompts
MIN_SPAN = 2 * MIN_CHUNK_CHARS  # shortest re-rendered span worth a cache of its own (characters)
RECENT_S = 300.0  # a retrieval this recent makes a prompt "look like it carries context"
# the longest a prompt waits for the background builds of texts it holds; past it, the texts
# not built yet are not matched (computed as plain prompt text)
BUILD_WAIT_S = 120.0
_CONTEXT_HEADER = re.compile(r"\b(context|documents?|sources?|passages?)\b\s*(information|:)", re.IGNORECASE)
_WS = re.compile(r"\s+")


@dataclass(frozen=True)
class Match:
    """The chunks of one prompt and how they were found."""

    chunks: list[Piece]
    learned: int  # re-rendered retrieved texts registered by this call
    unmatched: bool  # the prompt carries retrieved context but no chunk matched
    built: frozenset[str] = frozenset()  # chunk texts whose background build this prompt is the first to use
    wait_ms: float = 0.0  # how long matching waited for background builds

    @property
    def built_chunks(self) -> int:
        """How many of `chunks` had their cache built for this prompt (not before it)."""
        return sum((c.source or c.text) in self.built for c in self.chunks)

    @property
    def renderings(self) -> list[tuple[str, str | None]]:
        """(text, id) of the chunks that re-render a stored text (served from its runs)."""
        return [(c.text, c.node_id) for c in self.chunks if c.source is not None]


class Learner:
    """One engine's view of retrieval (see the module docstring); its background builds are the
    core learner's (qcfuse_core/learn.py `BackgroundBuilds`). Thread-safe."""

    def __init__(self, engine: QCFuseEngine) -> None:
        self._engine = weakref.ref(engine)
        self._lock = threading.Lock()
        self._recent: OrderedDict[str, str | None] = OrderedDict()  # text -> node id
        # text -> its latest background build, tagged with the id that build links it to
        self._builds = BackgroundBuilds("qcfuse-learn")
        self._sources: OrderedDict[str, str] = OrderedDict()  # a prompt's rendering -> the text it renders
        # texts whose cache a background build computed and no prompt has used yet: the first
        # prompt that does reports them as built during its request, not as hits
        self._fresh: OrderedDict[str, None] = OrderedDict()
        self._last_retrieval = 0.0
        self._warned = False
        self._counts = dict(
            retrieved_texts=0,
            background_builds=0,
            prompts=0,
            matched_prompts=0,
            unmatched_prompts=0,
            learned_renderings=0,
        )

    @property
    def engine(self) -> QCFuseEngine:
        engine = self._engine()
        if engine is None:
            raise RuntimeError("the engine of this learner is gone")
        return engine

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    # ------------------------------------------------------------------ retrieval
    def see(self, items: Iterable[tuple[str, str | None]], *, build: bool = True) -> Future | None:
        """Texts a retriever returned, with their ids. build: compute the caches not stored yet
        (in the background; the returned future completes when they are stored), else only
        remember the texts for matching re-rendered prompts."""
        todo: list[tuple[str, str | None]] = []
        with self._lock:
            for text, node_id in items:
                if not isinstance(text, str) or len(text) < MIN_CHUNK_CHARS:
                    continue
                self._recent[text] = node_id
                self._recent.move_to_end(text)
                self._counts["retrieved_texts"] += 1
                if build and self._builds.tag(text, ...) != node_id:  # a new id is linked too
                    todo.append((text, node_id))
            while len(self._recent) > RECENT:
                self._recent.popitem(last=False)
            self._last_retrieval = time.monotonic()
            return self._submit(todo, fresh=True)

    def build(self, items: Sequence[tuple[str, str | None]]) -> Future | None:
        """Build (in the background) the caches of prompt texts not stored yet - the
        renderings a call served from sub-spans, so that the next call hits them whole."""
        with self._lock:
            return self._submit([(t, i) for t, i in items if self._builds.tag(t, ...) != i])

    def _submit(self, todo: list[tuple[str, str | None]], *, fresh: bool = False) -> Future | None:
        """(under the lock) one background job for `todo`; fresh: a retrieval's texts (the first
        prompt to use a cache built for them reports it as built, not as a hit)."""
        return self._builds.submit(todo, self._build, todo, fresh)

    def _build(self, items: list[tuple[str, str | None]], fresh: bool = False) -> None:
        """Register and build (on the learner's thread): the texts already stored are only linked."""
        engine = self.engine
        try:
            new = [t for t, _ in items if not engine.caches.is_stored(t)]
            engine.build_chunks([t for t, _ in items], [i for _, i in items])
            with self._lock:
                self._counts["background_builds"] += len(new)
                for t in new if fresh else ():
                    self._fresh[t] = None
                while len(self._fresh) > RECENT:
                    self._fresh.popitem(last=False)
        except Exception:  # a failed background build is only a lost hit: the request computes it
            log.exception("building the caches of %d retrieved text(s) failed", len(items))

    def wait(self, timeout: float | None = None) -> bool:
        """Until no background build is queued or running (tests, shutdown) -> False on timeout."""
        return self._builds.wait(timeout)

    # ------------------------------------------------------------------ prompts
    def match(self, prompt: str, explicit: Mapping[str, str] | None = None) -> Match:
        """The chunk pieces of `prompt` (module docstring); explicit: {text: node id} a caller
        knows is in the prompt (a postprocessor's nodes): treated like retrieved texts. Waits
        (in this thread) for the background builds of the texts the prompt holds."""
        steps = self._matching(prompt, explicit)
        try:
            while True:
                _late(concurrent.futures.wait(next(steps), timeout=BUILD_WAIT_S).not_done)
        except StopIteration as stop:
            return stop.value

    async def amatch(self, prompt: str, explicit: Mapping[str, str] | None = None) -> Match:
        """`match` for asyncio: the background builds it waits for are awaited as futures, so
        the event loop runs other tasks meanwhile (no thread is used for the wait)."""
        steps = self._matching(prompt, explicit)
        try:
            while True:
                futures = [asyncio.wrap_future(f) for f in next(steps)]
                _late((await asyncio.wait(futures, timeout=BUILD_WAIT_S))[1])
        except StopIteration as stop:
            return stop.value

    def _matching(self, prompt: str, explicit: Mapping[str, str] | None) -> Generator[set[Future], None, Match]:
        """`match` as steps: it yields each set of background builds to wait for (the caller
        waits for them, on its thread or its event loop) and returns the Match."""
        engine = self.engine
        explicit = dict(explicit or {})
        t0 = time.perf_counter()
        waited = self._builds_in(prompt)
        if waited:
            yield waited
        chunks = engine.caches.texts.find(prompt, node_ids=explicit or None)
        learned = self._learn(prompt, chunks, explicit)
        if learned:
            chunks = engine.caches.texts.find(prompt, node_ids=explicit or None)
        with self._lock:
            sources = {c.text: self._sources.get(c.text) for c in chunks}
        more = self._builds.where(lambda t: t in sources.values())
        if more:  # chunks that re-render a retrieved text: its build first (its cache serves them)
            yield more
        chunks = [replace(c, source=sources[c.text]) if sources[c.text] is not None else c for c in chunks]
        wait_ms = (time.perf_counter() - t0) * 1e3 if waited or more else 0.0
        unmatched = not chunks and self._carries_context(prompt)
        with self._lock:
            built = frozenset(t for t in {c.source or c.text for c in chunks} if t in self._fresh)
            for t in built:
                del self._fresh[t]
            self._counts["prompts"] += 1
            self._counts["matched_prompts"] += bool(chunks)
            self._counts["unmatched_prompts"] += unmatched
            self._counts["learned_renderings"] += learned
            warn = unmatched and not self._warned
            self._warned = self._warned or unmatched
        if warn:
            log.warning(
                "QCFuse: a prompt that carries retrieved context matched no cached chunk, so nothing was "
                "reused (counted in unmatched_prompts; this warning is logged once per engine). Likely "
                "causes: the texts never reached QCFuse. A retriever that returns plain strings is not seen: "
                "return langchain_core.documents.Document objects from it (any retriever or runnable step "
                "that returns Documents is learned), or build the texts once with "
                "`QCFuseCacheBuilder(llm.engine).transform_documents(docs)` (qcfuse_integrations.langchain; "
                "LlamaIndex: QCFuseCacheBuilder in the IngestionPipeline). Or the prompt re-renders "
                "them beyond recognition (e.g. LlamaIndex's simple_summarize pastes a Python list repr: use "
                "response_mode='compact'). Format retrieved texts verbatim into the prompt."
            )
        return Match(chunks, learned, unmatched, built, wait_ms)

    def _builds_in(self, prompt: str) -> set[Future]:
        """The background builds under way of retrieved texts this prompt contains (waited
        for: no double work)."""
        return self._builds.where(lambda t: isinstance(t, str) and t in prompt)

    def _learn(self, prompt: str, found: Sequence[Piece], explicit: Mapping[str, str | None]) -> int:
        """Register the prompt's renderings of retrieved texts it does not contain verbatim."""
        with self._lock:
            candidates = dict(self._recent)
        candidates.update(explicit)
        if not candidates:
            return 0
        taken = chunk_positions(prompt, found)
        norm, where = _normalise(prompt)
        engine, learned = self.engine, 0
        for text, node_id in candidates.items():
            at = prompt.find(text)
            if at >= 0:  # verbatim: registered unless another text covers it already
                if len(text) >= MIN_CHUNK_CHARS and not overlaps(taken, at, at + len(text)):
                    engine.caches.texts.add(text, node_id)
                    taken.append((at, at + len(text)))
                    learned += 1
                continue
            escaped = repr(text)[1:-1]  # a Python repr of the text (LlamaIndex's simple_summarize)
            at = prompt.find(escaped) if escaped != text and len(escaped) >= MIN_SPAN else -1
            span = (at, at + len(escaped)) if at >= 0 else _rendering(norm, where, text)
            if span is None or overlaps(taken, *span):
                continue
            rendering = prompt[span[0] : span[1]]
            engine.caches.texts.add(rendering, node_id)
            with self._lock:
                self._sources[rendering] = text
                self._sources.move_to_end(rendering)
                while len(self._sources) > RECENT:
                    self._sources.popitem(last=False)
            taken.append(span)
            learned += 1
        return learned

    def _carries_context(self, prompt: str) -> bool:
        with self._lock:
            recent = list(self._recent)
            fresh = time.monotonic() - self._last_retrieval < RECENT_S
        if fresh:
            for text in recent:
                if any(len(line) >= MIN_CHUNK_CHARS and line in prompt for line in text.splitlines()):
                    return True
        return len(prompt) >= 400 and _CONTEXT_HEADER.search(prompt) is not None

    def close(self) -> None:
        self._builds.close(cancel=False)


def _late(builds: Collection[object]) -> None:
    if builds:
        log.warning(
            "%d background cache build(s) still running after %.0f s; the prompt goes on without them",
            len(builds),
            BUILD_WAIT_S,
        )


# ---------------------------------------------------------------------- renderings


def _normalise(text: str) -> tuple[str, list[int]]:
    """Whitespace runs -> one space; where[i] = the offset in `text` of normalised char i.

    text:  "a \\n\\n b"    norm: "a b"    where: [0, 1, 5]
    """
    norm, where, pos = [], [], 0
    for m in _WS.finditer(text):
        for i in range(pos, m.start()):
            norm.append(text[i])
            where.append(i)
        norm.append(" ")
        where.append(m.start())
        pos = m.end()
    for i in range(pos, len(text)):
        norm.append(text[i])
        where.append(i)
    return "".join(norm), where


def _rendering(norm: str, where: list[int], text: str) -> tuple[int, int] | None:
    """The prompt span (start, end) rendering `text` with other whitespace, or its longest
    rendered prefix (a truncating formatter) of at least MIN_SPAN characters; None if neither."""
    want = _WS.sub(" ", text).strip()
    if len(want) < MIN_SPAN:
        return None
    at = norm.find(want)
    n = len(want)
    if at < 0:  # truncated: the longest prefix that occurs (binary search on its length)
        lo, hi = MIN_SPAN, len(want) - 1
        if norm.find(want[:lo]) < 0:
            return None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if norm.find(want[:mid]) >= 0:
                lo = mid
            else:
                hi = mid - 1
        n, at = lo, norm.find(want[:lo])
    start, end = where[at], where[at + n - 1] + 1
    return start, end


# ---------------------------------------------------------------------- one learner per engine

_LEARNERS: "weakref.WeakKeyDictionary[QCFuseEngine, Learner]" = weakref.WeakKeyDictionary()
_REGISTRY = threading.Lock()


# retrievals seen by the hooks, replayed to a learner made later: a chain's retriever runs
# before its model opens the engine on the first call
_SEEN: deque[tuple[tuple[tuple[str, str | None], ...], bool]] = deque(maxlen=RECENT)


def learner_for(engine: QCFuseEngine) -> Learner:
    with _REGISTRY:
        got = _LEARNERS.get(engine)
        if got is not None:
            return got
        got = _LEARNERS[engine] = Learner(engine)
        replay = list(_SEEN)
    for items, build in replay:
        got.see(items, build=build)
    return got


def learners() -> list[Learner]:
    with _REGISTRY:
        return list(_LEARNERS.values())


def see_everywhere(items: Sequence[tuple[str, str | None]], *, build: bool = True) -> None:
    """A retrieval seen by a framework hook: every engine in use learns it."""
    items = tuple(items)
    with _REGISTRY:
        _SEEN.append((items, build))
    for learner in learners():
        learner.see(items, build=build)


def forget_learners() -> None:
    """Stop every learner's background thread (tests; with engines.forget_engines)."""
    with _REGISTRY:
        got = list(_LEARNERS.values())
        _LEARNERS.clear()
    for learner in got:
        learner.close()
