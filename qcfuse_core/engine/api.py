"""QCFuseEngine: build chunk caches at ingestion; answer from fused caches at query time.

    engine = open_engine("./store")                       # model + persistent store
    engine.build_chunks(texts, node_ids)                  # ingestion: caches computed once
    result = engine.answer(question, documents)           # steps 1-6 -> FusionResult
    for delta in engine.stream(question, documents): ...  # the same, as text deltas
    result = await engine.aanswer(question, documents)    # asyncio: the same, awaited
    async for delta in engine.astream(question, documents): ...
    result = engine.complete(prompt)                      # any rendered prompt, chunks found in it
    for delta in engine.complete(prompt, stream=True): ...
    result = await engine.acomplete(prompt)               # and for asyncio
    async for delta in engine.acomplete(prompt, stream=True): ...
    engine.stats()                                        # EngineStats: scheduler, store, caches
    engine.close()                                        # or `with open_engine(...) as engine:`

Read-only: `config` (EngineConfig), `adapter` (the model: name, device, max_positions, ...),
`tokenizer`, `frame` (the prompt frame: `rag_pieces`, `completion_pieces`, `stops`) and
`caches` (what callers read of the chunk caches, cache/chunks.py `ChunkCaches`: the store,
the chunk-text index, a text's token ids and key). The engine's parts, which its steps and
scheduler use, are read-only too: `lookup` (cache/chunks.py `ChunkLookup`: tokens, keys,
links, prefix caches, a request's lookup, views), `builder` (cache/builder.py
`ChunkBuilder`: chunk caches built and stored) and `kv_budget` (cache/budget.py `KVBudget`:
the running requests' KV reservations, the idle KV pool, the device chunk tier's size).

The engine holds what every request shares - the model adapter, those parts, the chunk-text
index, the prompt frame, the request's steps (engine/pipeline.py) - and its scheduler
(engine/scheduler.py): one worker thread that owns the device, runs each request through
the six steps and decodes all running requests together. Every request verb goes through
one submission path (`_submit`): the request is checked on the caller's thread and handed
to the scheduler as data; the sync and async forms differ only in how its deltas come back
(a thread-safe queue, or the event loop's own). It keeps no state of any one request, so
many threads and tasks may call it; a full queue raises `EngineBusy`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, overload

import torch

from qcfuse_core.cache.budget import KVBudget
from qcfuse_core.cache.budget import KVBudgetError as KVBudgetError
from qcfuse_core.cache.builder import ChunkBuilder
from qcfuse_core.cache.chunks import ChunkCaches, ChunkLookup
from qcfuse_core.cache.planner import Rates, device_name, load_rates, rates_path
from qcfuse_core.cache.prefetch import PrefetchConfig
from qcfuse_core.engine.audit import Audit, Choice, band
from qcfuse_core.engine.config import EngineConfig
from qcfuse_core.engine.frame import PromptFrame
from qcfuse_core.engine.generation import GenerationConfig
from qcfuse_core.engine.pipeline import Steps
from qcfuse_core.engine.request import Prompt
from qcfuse_core.engine.scheduler import EngineBusy as EngineBusy
from qcfuse_core.engine.scheduler import Job, Scheduler, SchedulerStats
from qcfuse_core.engine.streams import AsyncTokenStream, TokenStream
from qcfuse_core.engine.threads import configure_cpu_threads
from qcfuse_core.inputs import require_sequence
from qcfuse_core.model.adapter import ModelAdapter, load_model
from qcfuse_core.paths import cache_dir
from qcfuse_core.retrieval.texts import ChunkTextIndex, split_prompt
from qcfuse_core.selection import SELECTORS
from qcfuse_core.store import ChunkStore, MemoryStore, kv_dir, open_store, writable
from qcfuse_core.types import ChunkKey, FusionResult, Piece


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine (`engine.stats()`)."""

    scheduler: SchedulerStats  # the scheduler's counters (all zero before the first request)
    store: dict[str, Any]  # the store's counters in this process (`ChunkStore.counters()`)
    chunk_texts: int  # texts in the chunk-text index: what `complete` finds inside a prompt
    kv_reserved_bytes: int  # the KV budget the running requests hold
    kv_pooled_bytes: int  # idle KV buffers kept for the next request (CUDA)
    # the audit of live traffic (engine/audit.py): per configuration and chunk-length band, the
    # answer-token agreement with full prefill measured on this model's requests, the audit's
    # counters, and the fidelity target with its choice now
    fidelity: dict[str, Any] = dataclasses.field(default_factory=dict)


_CLOSED = "this engine is closed"
_NOT_AN_ADAPTER = (
    "QCFuseEngine takes a loaded model (a ModelAdapter), got {got}; to open a store folder "
    "with the embedded model, use open_engine(store_dir) (`from qcfuse_core import open_engine`)"
)
_IDLE = SchedulerStats(**{f.name: 0 for f in dataclasses.fields(SchedulerStats)})


class QCFuseEngine:
    """Ingestion and answering over one model and one store (see the module docstring).

    adapter: the model (`open_engine` loads one); store: the chunk store (default: in
    memory); text_index: the chunk-text index (default: in memory); rates: measured load and
    compute rates, with which the planner decides load or recompute per chunk."""

    def __init__(
        self,
        adapter: ModelAdapter,
        store: ChunkStore | None = None,
        config: EngineConfig | None = None,
        text_index: ChunkTextIndex | None = None,
        rates: Rates | None = None,
    ) -> None:
        if not isinstance(adapter, ModelAdapter):
            raise TypeError(_NOT_AN_ADAPTER.format(got=f"{type(adapter).__name__} {adapter!r}"[:200]))
        self._adapter = adapter
        self._config = cfg = config or EngineConfig()
        if adapter.device.type == "cuda" and cfg.scheduler.cuda_graphs:
            adapter.packed_projections()  # before any caller runs the model (the decode step's products)
        sink = _chunk_sink(adapter) if cfg.cache.chunk_sink else None
        store = store if store is not None else MemoryStore()
        self._builder = ChunkBuilder(adapter, store, lambda: self._config.selection, sink)
        prefetch = PrefetchConfig(promote_disk_reads=cfg.cache.promote_disk_reads)
        self._lookup = ChunkLookup(adapter, store, self._builder, sink, prefetch)
        self._kv_budget = KVBudget(
            adapter,
            store,
            kv_cache_bytes=cfg.cache.kv_cache_bytes,
            kv_memory_share=cfg.cache.kv_memory_share,
            kv_dtype=cfg.cache.kv_dtype,
        )
        self._texts = text_index if text_index is not None else ChunkTextIndex()
        self._caches = ChunkCaches(self._lookup, self._texts)
        self._frame = PromptFrame(adapter.tokenizer, cfg.frame)
        chosen = configure_cpu_threads(adapter.device, threads=cfg.threads)["threads"]
        # CPU threads per request: the config's count; else, in the deterministic mode, the
        # count chosen now for the engine's life; else chosen per request (None)
        self._steps = Steps(self, rates, cfg.threads or (chosen if cfg.deterministic else None))
        self._sched: Scheduler | None = None  # started by the first request
        self._audit = Audit(
            adapter,
            lambda: self._config.audit,
            lambda: self._config.fidelity,
            lambda work: self._scheduler.submit_idle(work),
            shadow=self._shadow,
        )
        self._steps.guard.self_calibration = self._audit.guard_threshold  # a model calibrated nowhere
        self._lock = threading.Lock()
        self._closed = False
        self._texts_at_close: int | None = None  # the chunk-text index's size when it closed

    # ------------------------------------------------------------------ what it holds
    @property
    def config(self) -> EngineConfig:
        """The engine's settings (frozen; a request's arguments override method and ratio)."""
        return self._config

    @property
    def adapter(self) -> ModelAdapter:
        """The model: its name, device, dtype, shape, max_positions and tokenizer."""
        return self._adapter

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (token counts, chat templates)."""
        if self._adapter.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids to the low-level fusion API")
        return self._adapter.tokenizer

    @property
    def frame(self) -> PromptFrame:
        """The prompt frame: how `answer` lays out a question and its documents
        (`rag_pieces`), how `complete` frames a prompt (`completion_pieces`), and the stop
        strings a base model's plain frame calls for (`stops`)."""
        return self._frame

    @property
    def caches(self) -> ChunkCaches:
        """What callers read of the chunk caches (cache/chunks.py): `store`, the chunk-text
        index `texts`, `chunk_tokens(text)` (token ids and ChunkKey), `tokenize`,
        `fingerprint`, `is_stored(text)`."""
        return self._caches

    @property
    def audit(self) -> Audit:
        """The audit of live traffic (engine/audit.py): `stats(method)`, `choose(method)`,
        `wait()` for the queued checks (they run only while no request waits or runs)."""
        return self._audit

    # ------------------------------------------------------------------ its parts
    @property
    def lookup(self) -> ChunkLookup:
        """The engine's part its steps find chunk caches with (cache/chunks.py): a request's
        lookup, tokens and keys, links, prefix caches, views."""
        return self._lookup

    @property
    def builder(self) -> ChunkBuilder:
        """The engine's part that builds and stores chunk caches (cache/builder.py)."""
        return self._builder

    @property
    def kv_budget(self) -> KVBudget:
        """The engine's part its scheduler admits requests with (cache/budget.py): KV
        reservations, the idle KV pool, the device chunk tier's size."""
        return self._kv_budget

    # ------------------------------------------------------------------ ingestion
    def build_chunks(
        self,
        texts: Sequence[str],
        node_ids: Sequence[str | None] | None = None,
        *,
        register: bool = True,
        background: bool = False,
    ) -> list[ChunkKey]:
        """Ingestion of many chunks: the caches of those not stored yet are prefilled many per
        forward pass and written to the store off the compute thread; every text is linked
        to its node id and (register) added to the chunk-text index so `complete` finds it.

        background: the caches are built at the scheduler's lowest priority instead, one
        chunk per step in which no request waits or runs (never beside a live request's
        prefill or decode step: how learned chunks are built); the call returns once they
        are built."""
        texts = require_sequence(texts, "texts", one="for one chunk, pass [text]")
        node_ids = None if node_ids is None else require_sequence(node_ids, "node_ids", (str, type(None)))
        ids = list(node_ids) if node_ids is not None else [None] * len(texts)
        if len(ids) != len(texts):
            raise ValueError("node_ids and texts differ in length")
        lookup = self._lookup
        keys: list[ChunkKey] = []
        todo: dict[ChunkKey, torch.Tensor] = {}
        for t in texts:
            tokens, key = lookup.chunk_tokens(t)
            if key is None:
                raise ValueError(f"cannot cache an empty chunk (text {t[:40]!r})")
            keys.append(key)
            if key not in todo and not lookup.store.contains(key):
                todo[key] = tokens
        if background and todo:
            pieces = [self._scheduler.submit_idle(partial(self._builder.build, {k: t})) for k, t in todo.items()]
            for piece in pieces:
                piece.result()
        else:
            self._builder.build(todo)
        for nid, key in zip(ids, keys):
            lookup.link(nid, key)
        if register:
            for t, nid in zip(texts, ids):
                self._texts.add(t, nid)
        return keys

    # ------------------------------------------------------------------ answering
    def answer(self, question: str, documents: Sequence[str], **kw: Any) -> FusionResult:
        """Answer `question` from `documents` (their caches fused): steps 1-6 -> FusionResult.

        Keywords of every request verb: node_ids (answer, stream: one per document), method,
        ratio (default: the config's), generation (a GenerationConfig) or its fields
        (max_new_tokens, temperature, stop, seed, ...), sync_stages (stage timings with the
        GPU synchronised), started (`time.perf_counter()` when the caller began work for
        the request: its clock, and so its TTFT, starts there instead of at submission),
        guard (False: the quality guard does not escalate this request; engine/guard.py),
        tenant (whose request it is: the scheduler admits waiting requests tenant by tenant
        in turn, first in first out within each; None, the default: the one shared tenant).
        A malformed prompt, an unknown method or option, a ratio outside [0, 1] raises before
        anything is queued; a full queue raises EngineBusy."""
        return _drain(self.stream(question, documents, **kw))

    def stream(
        self, question: str, documents: Sequence[str], *, node_ids: Sequence[str | None] | None = None, **kw: Any
    ) -> TokenStream:
        """`answer` as text deltas; the stream's `.result` is the FusionResult, `.close()` ends
        the request early."""
        return self._stream(self._frame.rag_pieces(question, documents, node_ids), **kw)

    @overload
    def complete(
        self, prompt: str, chunks: Sequence[Piece] | None = None, *, stream: Literal[False] = False, **kw: Any
    ) -> FusionResult: ...

    @overload
    def complete(
        self, prompt: str, chunks: Sequence[Piece] | None = None, *, stream: Literal[True], **kw: Any
    ) -> TokenStream: ...

    def complete(
        self,
        prompt: str,
        chunks: Sequence[Piece] | None = None,
        *,
        framed: bool = True,
        stream: bool = False,
        **kw: Any,
    ) -> FusionResult | TokenStream:
        """Answer a rendered prompt. chunks: its chunk texts in order of appearance
        (`Piece("chunk", text, node_id)`); None: every registered text inside it, found by
        content. framed: the prompt is wrapped in the engine's frame (the chat template's
        head and tail); False: it is taken as the model reads it (a chat already rendered in
        the model's template). stream: the text deltas (a TokenStream) instead of the
        FusionResult. Other keywords: as `answer`."""
        got = self._stream(self._completion_pieces(prompt, chunks, framed), **kw)
        return got if stream else _drain(got)

    # ------------------------------------------------------------------ asyncio
    async def aanswer(self, question: str, documents: Sequence[str], **kw: Any) -> FusionResult:
        """`answer` for asyncio: awaits the scheduler without blocking the event loop;
        cancelling the awaiting task aborts the request."""
        return await _adrain(self.astream(question, documents, **kw))

    def astream(
        self, question: str, documents: Sequence[str], *, node_ids: Sequence[str | None] | None = None, **kw: Any
    ) -> AsyncTokenStream:
        """`stream` for asyncio (call it inside a running event loop): `async for delta in
        engine.astream(...)`; the stream's `.result` is the FusionResult."""
        return self._astream(self._frame.rag_pieces(question, documents, node_ids), **kw)

    @overload
    def acomplete(
        self, prompt: str, chunks: Sequence[Piece] | None = None, *, stream: Literal[False] = False, **kw: Any
    ) -> Coroutine[Any, Any, FusionResult]: ...

    @overload
    def acomplete(
        self, prompt: str, chunks: Sequence[Piece] | None = None, *, stream: Literal[True], **kw: Any
    ) -> AsyncTokenStream: ...

    def acomplete(
        self,
        prompt: str,
        chunks: Sequence[Piece] | None = None,
        *,
        framed: bool = True,
        stream: bool = False,
        **kw: Any,
    ) -> Coroutine[Any, Any, FusionResult] | AsyncTokenStream:
        """`complete` for asyncio: `await engine.acomplete(prompt)`, or with stream=True
        `async for delta in engine.acomplete(prompt, stream=True)` (inside a running event
        loop). The prompt is checked and submitted at the call."""
        got = self._astream(self._completion_pieces(prompt, chunks, framed), **kw)
        return got if stream else _adrain(got)

    # ------------------------------------------------------------------ the engine's life
    def stats(self) -> EngineStats:
        """The scheduler's counters, the store's counters and the cache manager's counts (once
        closed: as they were when it closed)."""
        with self._lock:
            sched, texts = self._sched, self._texts_at_close
            if texts is None:
                texts = len(self._texts)
        return EngineStats(
            scheduler=sched.stats() if sched is not None else _IDLE,
            store=self._lookup.store.counters(),
            chunk_texts=texts,
            kv_reserved_bytes=self._kv_budget.reserved_bytes(),
            kv_pooled_bytes=self._kv_budget.pooled_bytes(),
            fidelity=self._audit.stats(self._config.method),
        )

    def close(self) -> None:
        """Stop the scheduler's worker (requests still waiting or running are aborted), then
        close the store and the chunk-text index. Idempotent; a request after it raises
        RuntimeError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sched = self._sched
            self._texts_at_close = len(self._texts)
        if sched is not None:
            sched.shutdown()
        self._kv_budget.drop_pool()
        self._lookup.store.close()
        self._texts.close()

    def __enter__(self) -> QCFuseEngine:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------ private
    @property
    def _scheduler(self) -> Scheduler:
        """The engine's scheduler (engine/scheduler.py), started at the first request."""
        with self._lock:
            if self._closed:
                raise RuntimeError(_CLOSED)
            if self._sched is None:
                self._sched = Scheduler(self._steps)
            return self._sched

    def _completion_pieces(self, prompt: str, chunks: Sequence[Piece] | None, framed: bool) -> list[Piece]:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        if chunks is not None:
            chunks = require_sequence(chunks, "chunks", Piece, one='pass [Piece("chunk", text, node_id)]')
        if self._closed:  # its chunk-text index is closed too
            raise RuntimeError(_CLOSED)
        found = self._texts.find(prompt) if chunks is None else chunks
        if framed:
            return self._frame.completion_pieces(prompt, found)
        return split_prompt(prompt, found)

    def _stream(self, prompt: Prompt | Sequence[Piece], **kw: Any) -> TokenStream:
        """The request of `prompt`, its deltas through a thread-safe queue."""
        box: queue.SimpleQueue[object] = queue.SimpleQueue()
        scheduler, job = self._submit(prompt, box.put, **kw)
        return TokenStream(scheduler.deltas(job, box.get), lambda wait: scheduler.abort(job, wait=wait))

    def _astream(self, prompt: Prompt | Sequence[Piece], **kw: Any) -> AsyncTokenStream:
        """The request of `prompt`, its deltas through the running event loop's own queue."""
        loop = asyncio.get_running_loop()
        box: asyncio.Queue[object] = asyncio.Queue()
        scheduler, job = self._submit(prompt, lambda item: loop.call_soon_threadsafe(box.put_nowait, item), **kw)
        return AsyncTokenStream(box, lambda wait: scheduler.abort(job, wait=wait))

    def _submit(
        self,
        prompt: Prompt | Sequence[Piece],
        emit: Callable[[object], object],
        *,
        method: str | None = None,
        ratio: float | None = None,
        generation: GenerationConfig | None = None,
        sync_stages: bool = False,
        started: float | None = None,
        guard: bool = True,
        tenant: str | None = None,
        **gen_kw: Any,
    ) -> tuple[Scheduler, Job]:
        """The one submission path: the request of `prompt` (a Prompt, or its pieces) checked
        here, on the caller's thread, and handed to the scheduler as data -> (the scheduler,
        its job). Raises EngineBusy when the scheduler's queue is full."""
        if callable(prompt):
            raise TypeError("a request takes its prompt as data: pass the pieces (or a Prompt), not a function")
        prompt = prompt if isinstance(prompt, Prompt) else Prompt(tuple(prompt))
        choice = self._target_choice(method, ratio, prompt.pieces)
        if choice is not None:
            method, ratio = choice.method, choice.ratio
        method = method or self._config.method
        if method not in SELECTORS:
            raise ValueError(f"unknown method {method!r}; valid: {', '.join(sorted(SELECTORS))}")
        ratio = self._config.ratio if ratio is None else ratio
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {ratio}")
        gen = generation or GenerationConfig()
        if gen_kw:
            valid = {f.name for f in dataclasses.fields(GenerationConfig)}
            unknown = sorted(set(gen_kw) - valid)
            if unknown:
                raise TypeError(f"unknown generation options {unknown}; valid: {', '.join(sorted(valid))}")
            gen = replace(gen, **gen_kw)
        if not isinstance(guard, bool):
            raise ValueError(f"guard must be True or False, got {guard!r}")
        if tenant is not None and not isinstance(tenant, str):
            raise TypeError(f"tenant must be a str or None, got {type(tenant).__name__}")
        scheduler = self._scheduler
        audit, pieces, asked = self._audit, prompt.pieces, gen

        def emit_audited(item: object) -> object:  # the worker's: a finished request goes by the audit
            if isinstance(item, FusionResult):
                audit.finish(item, pieces, asked, choice)
            return emit(item)

        return scheduler, scheduler.submit(
            prompt,
            method,
            ratio,
            gen,
            emit_audited,
            sync_stages=sync_stages,
            started=started,
            guard=guard,
            tenant=tenant,
        )

    def _target_choice(self, method: str | None, ratio: float | None, pieces: Sequence[Piece]) -> Choice | None:
        """With a fidelity target (`EngineConfig.fidelity`), a request naming no ratio (and no
        method but the engine's) gets the configuration the audit chooses for its chunks'
        length band (decided before any pass: their token counts are cached per text); else None."""
        cfg = self._config
        if cfg.fidelity is None or ratio is not None or method not in (None, cfg.method):
            return None
        if not SELECTORS[cfg.method].uses_ratio:
            return None
        lengths = [int(self._lookup.chunk_tokens(p.text)[0].numel()) for p in pieces if p.kind == "chunk"]
        return self._audit.choose(cfg.method, band(lengths))

    def _shadow(self, pieces: Sequence[Piece], method: str, ratio: float, gen: GenerationConfig) -> FusionResult:
        """A request answered alone at `ratio` in the calling thread (the scheduler's worker, in
        an idle step): the audit's shadow sample of a configuration it has too little of."""
        run = self._steps.run(pieces, method, ratio, gen, False)
        while True:
            try:
                next(run)
            except StopIteration as done:
                return done.value


def _drain(stream: TokenStream) -> FusionResult:
    for _ in stream:
        pass
    assert stream.result is not None
    return stream.result


async def _adrain(stream: AsyncTokenStream) -> FusionResult:
    """The FusionResult of an async stream read to its end (closed however this ends: a
    cancelled task aborts the request)."""
    try:
        async for _ in stream:
            pass
    finally:
        stream.close()
    assert stream.result is not None
    return stream.result


def _chunk_sink(adapter: ModelAdapter) -> torch.Tensor:
    """The token ids chunks are cached after with `CacheConfig.chunk_sink`: the BOS token."""
    bos = getattr(adapter.tokenizer, "bos_token_id", None)
    if bos is None:
        raise ValueError(
            f"chunk_sink caches chunks after the tokenizer's BOS token, and {adapter.name} has "
            "none; use chunk_sink=False"
        )
    return torch.tensor([int(bos)], dtype=torch.int64)


def open_engine(
    store_dir: str | Path | None = None,
    *,
    model: str | None = None,
    dtype: str | torch.dtype | None = None,
    device: str = "cpu",
    config: EngineConfig | None = None,
    memory_bytes: int | None = None,
    read_only: bool | None = None,
) -> QCFuseEngine:
    """An engine over a persistent store folder (default: <cache dir>/store).

    Layout of `store_dir`: kv/ (chunk caches), chunk_texts.sqlite (content index), chroma/
    (the vector store, used by the CLI and integrations), rates-*.json (measured by `qcfuse
    bench ttft --store DIR`; with them the planner decides load vs recompute per chunk).
    Models are loaded once per process. read_only: None opens the store read-only when it
    is not writable; True never writes to it (answers from what is stored).
    """
    root = Path(store_dir) if store_dir is not None else cache_dir() / "store"
    if not read_only and writable(root):
        root.mkdir(parents=True, exist_ok=True)
    key = (str(model), str(dtype), device)
    if key not in _ADAPTERS:
        _ADAPTERS[key] = load_model(model, dtype=dtype, device=device)
    store_kw: dict[str, Any] = {} if memory_bytes is None else {"memory_bytes": memory_bytes}
    store = open_store(kv_dir(root), read_only=read_only, **store_kw)
    adapter = _ADAPTERS[key]
    rates = load_rates(rates_path(root, adapter.fingerprint(), device_name(adapter.device)))
    return QCFuseEngine(
        adapter,
        store=store,
        config=config,
        text_index=ChunkTextIndex(root / "chunk_texts.sqlite", read_only=store.disk.read_only),
        rates=rates,
    )


_ADAPTERS: dict[tuple[str, str, str], ModelAdapter] = {}
