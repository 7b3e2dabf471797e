"""QCFuseEngine: build chunk caches at ingestion; answer from fused caches at query time.

    engine = open_engine("./store")                       # model + persistent store
    engine.build_chunks(texts, node_ids)                  # ingestion: caches computed once
    result = engine.answer(question, documents)           # steps 1-6 -> FusionResult
    for delta in engine.stream(question, documents): ...  # the same, as text deltas
    result = await engine.aanswer(question, documents)    # asyncio: the same, awaited
    async for delta in engine.astream(question, documents): ...

The engine holds what every request shares - the model adapter, the store, the chunk-cache
manager (cache/chunks.py), the prompt frame - and its scheduler (engine/scheduler.py): one
worker thread that owns the device, runs each request through the six steps of
engine/pipeline.py and decodes all running requests together. It keeps no state of any one
request, so many threads and tasks may call it; a full queue raises `EngineBusy`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch

from qcfuse_core.cache.chunks import ChunkCaches
from qcfuse_core.cache.planner import Rates, device_name, load_rates, rates_path
from qcfuse_core.cache.prefetch import PrefetchConfig, Prefetcher
from qcfuse_core.engine.config import EngineConfig
from qcfuse_core.engine.frame import PromptFrame
from qcfuse_core.engine.generation import GenerationConfig
from qcfuse_core.engine.pipeline import Steps
from qcfuse_core.engine.request import Prompt
from qcfuse_core.engine.scheduler import EngineBusy as EngineBusy
from qcfuse_core.engine.scheduler import KVBudgetError as KVBudgetError
from qcfuse_core.engine.scheduler import Scheduler
from qcfuse_core.engine.streams import AsyncTokenStream, TokenStream
from qcfuse_core.engine.threads import configure_cpu_threads
from qcfuse_core.model.adapter import ModelAdapter, load_model
from qcfuse_core.paths import cache_dir
from qcfuse_core.retrieval.texts import ChunkTextIndex
from qcfuse_core.selection import SELECTORS
from qcfuse_core.store import ChunkStore, MemoryStore, kv_dir, open_store, writable
from qcfuse_core.types import ChunkKey, FusionResult, Piece


class QCFuseEngine:
    """Ingestion and answering over one model and one store (see the module docstring)."""

    def __init__(
        self,
        adapter: ModelAdapter,
        store: ChunkStore | None = None,
        config: EngineConfig | None = None,
        text_index: ChunkTextIndex | None = None,
        rates: Rates | None = None,
    ) -> None:
        self.adapter = adapter
        self.config = config or EngineConfig()
        self.rates = rates  # measured load/compute rates: enable the load-or-recompute planner
        self.texts = text_index if text_index is not None else ChunkTextIndex()
        sink = _chunk_sink(adapter) if self.config.chunk_sink else None
        self.caches = ChunkCaches(
            adapter,
            store if store is not None else MemoryStore(),
            lambda: self.config.options,
            sink,
            PrefetchConfig(promote_disk_reads=self.config.promote_disk_reads),
            kv_cache_bytes=self.config.kv_cache_bytes,
            kv_memory_share=self.config.kv_memory_share,
        )
        self.frame = PromptFrame(adapter.tokenizer, self.config)
        self.steps = Steps(self)
        self._scheduler: Scheduler | None = None  # started by the first request
        self._scheduler_lock = threading.Lock()
        chosen = configure_cpu_threads(adapter.device, threads=self.config.threads)["threads"]
        # CPU threads per request: the config's count; else, in the deterministic mode, the
        # count chosen now for the engine's life; else chosen per request (None)
        self.request_threads: int | None = self.config.threads or (chosen if self.config.deterministic else None)

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        *,
        store: ChunkStore | None = None,
        dtype: str | torch.dtype | None = None,
        device: str = "cpu",
        config: EngineConfig | None = None,
        text_index: ChunkTextIndex | None = None,
    ) -> QCFuseEngine:
        return cls(load_model(model, dtype=dtype, device=device), store=store, config=config, text_index=text_index)

    def replace(
        self,
        *,
        store: ChunkStore | None = None,
        config: EngineConfig | None = None,
        rates: Rates | None | Literal[True] = True,
    ) -> QCFuseEngine:
        """A new engine on the same model (and text index), with another store, config or
        rates (`rates=None`: no planner; the default keeps this engine's)."""
        return QCFuseEngine(
            self.adapter,
            store=store if store is not None else self.store,
            config=config if config is not None else self.config,
            text_index=self.texts,
            rates=self.rates if rates is True else rates,
        )

    # ------------------------------------------------------------------ what it holds
    @property
    def store(self) -> ChunkStore:
        return self.caches.store

    @property
    def prefetcher(self) -> Prefetcher | None:
        return self.caches.prefetcher

    @property
    def fingerprint(self) -> str:
        """The namespace of this engine's chunk keys (the model's, or its own for sink caches)."""
        return self.caches.fingerprint

    @property
    def critical_layers(self) -> list[int]:
        return self.caches.critical_layers

    @property
    def tokenizer(self) -> Any:
        if self.adapter.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids to the low-level fusion API")
        return self.adapter.tokenizer

    @property
    def frame_stops(self) -> tuple[str, ...]:
        return self.frame.stops

    def tokenize(self, text: str) -> torch.Tensor:
        return self.caches.tokenize(text)

    def chunk_tokens(self, text: str) -> tuple[torch.Tensor, ChunkKey | None]:
        return self.caches.chunk_tokens(text)

    # ------------------------------------------------------------------ ingestion
    def build_chunks(
        self, texts: Sequence[str], node_ids: Sequence[str | None] | None = None, *, register: bool = True
    ) -> list[ChunkKey]:
        """Ingestion of many chunks: the caches of those not stored yet are prefilled many per
        forward pass and written to the store off the compute thread; every text is linked
        to its node id and (register) added to the text index so `complete` finds it."""
        ids = list(node_ids) if node_ids is not None else [None] * len(texts)
        if len(ids) != len(texts):
            raise ValueError("node_ids and texts differ in length")
        keys = self.caches.build_texts(texts, ids)
        if register:
            for t, nid in zip(texts, ids):
                self.texts.add(t, nid)
        return keys

    def build_chunk(self, text: str, node_id: str | None = None) -> ChunkKey:
        """Ingestion of one chunk (see `build_chunks`)."""
        return self.build_chunks([text], [node_id])[0]

    # ------------------------------------------------------------------ prompts
    def rag_pieces(
        self, question: str, documents: Sequence[str], node_ids: Sequence[str | None] | None = None
    ) -> list[Piece]:
        return self.frame.rag_pieces(question, documents, node_ids)

    def completion_pieces(self, prompt: str, chunks: Sequence[Piece] = ()) -> list[Piece]:
        return self.frame.completion_pieces(prompt, chunks)

    def selection_options(self, method: str, options: dict | None = None) -> dict:
        return self.steps.selection_options(method, options)

    # ------------------------------------------------------------------ answering
    def answer(self, question: str, documents: Sequence[str], **kw: Any) -> FusionResult:
        """Answer `question` from `documents` (their caches fused): steps 1-6 -> FusionResult."""
        return _drain(self.stream(question, documents, **kw))

    def stream(
        self,
        question: str,
        documents: Sequence[str],
        *,
        node_ids: Sequence[str | None] | None = None,
        method: str | None = None,
        ratio: float | None = None,
        generation: GenerationConfig | None = None,
        sync_stages: bool = False,
        **gen_kw: Any,
    ) -> TokenStream:
        """`answer` as text deltas; the stream's `.result` is the FusionResult."""
        return self.stream_pieces(
            self.rag_pieces(question, documents, node_ids),
            method=method,
            ratio=ratio,
            generation=generation,
            sync_stages=sync_stages,
            **gen_kw,
        )

    def complete(self, prompt: str, chunks: Sequence[Piece] | None = None, **kw: Any) -> FusionResult:
        """Answer a raw completion prompt; known chunk texts inside it are found by content."""
        return _drain(self.stream_complete(prompt, chunks, **kw))

    def stream_complete(self, prompt: str, chunks: Sequence[Piece] | None = None, **kw: Any) -> TokenStream:
        found = self.texts.find(prompt) if chunks is None else chunks
        return self.stream_pieces(self.completion_pieces(prompt, found), **kw)

    def stream_pieces(
        self,
        prompt: Prompt | Sequence[Piece],
        *,
        method: str | None = None,
        ratio: float | None = None,
        generation: GenerationConfig | None = None,
        sync_stages: bool = False,
        started: float | None = None,
        **gen_kw: Any,
    ) -> TokenStream:
        """The request of `prompt` (a Prompt, or its pieces), checked here - a malformed prompt,
        an unknown method or option, a ratio outside [0, 1] raises before anything is queued -
        and handed to the scheduler as data. Its clock (its TTFT) starts now, or at `started`
        (`time.perf_counter()` when the caller began work for it). Raises EngineBusy when the
        scheduler's queue is full."""
        prompt, method, ratio, gen = self._request_args(prompt, method, ratio, generation, gen_kw)
        box: queue.SimpleQueue[object] = queue.SimpleQueue()
        scheduler = self.scheduler
        job = scheduler.submit(prompt, method, ratio, gen, box.put, sync_stages=sync_stages, started=started)
        return TokenStream(scheduler.deltas(job, box.get), lambda wait: scheduler.abort(job, wait=wait))

    # ------------------------------------------------------------------ asyncio
    async def aanswer(self, question: str, documents: Sequence[str], **kw: Any) -> FusionResult:
        """`answer` for asyncio: awaits the scheduler without blocking the event loop;
        cancelling the awaiting task aborts the request."""
        stream = self.astream(question, documents, **kw)
        try:
            async for _ in stream:
                pass
        finally:
            stream.close()
        assert stream.result is not None
        return stream.result

    def astream(
        self,
        question: str,
        documents: Sequence[str],
        *,
        node_ids: Sequence[str | None] | None = None,
        **kw: Any,
    ) -> AsyncTokenStream:
        """`stream` for asyncio (call it inside a running event loop): `async for delta in
        engine.astream(...)`; the stream's `.result` is the FusionResult."""
        return self.astream_pieces(self.rag_pieces(question, documents, node_ids), **kw)

    def astream_pieces(
        self,
        prompt: Prompt | Sequence[Piece],
        *,
        method: str | None = None,
        ratio: float | None = None,
        generation: GenerationConfig | None = None,
        sync_stages: bool = False,
        started: float | None = None,
        **gen_kw: Any,
    ) -> AsyncTokenStream:
        """`stream_pieces` for asyncio (call it inside a running event loop)."""
        prompt, method, ratio, gen = self._request_args(prompt, method, ratio, generation, gen_kw)
        loop = asyncio.get_running_loop()
        box: asyncio.Queue[object] = asyncio.Queue()
        scheduler = self.scheduler
        job = scheduler.submit(
            prompt,
            method,
            ratio,
            gen,
            lambda item: loop.call_soon_threadsafe(box.put_nowait, item),
            sync_stages=sync_stages,
            started=started,
        )
        return AsyncTokenStream(box, lambda wait: scheduler.abort(job, wait=wait))

    # ------------------------------------------------------------------ the scheduler
    @property
    def scheduler(self) -> Scheduler:
        """The engine's scheduler (engine/scheduler.py), started at the first request."""
        with self._scheduler_lock:
            if self._scheduler is None:
                self._scheduler = Scheduler(self)
            return self._scheduler

    def _request_args(
        self,
        prompt: Prompt | Sequence[Piece],
        method: str | None,
        ratio: float | None,
        generation: GenerationConfig | None,
        gen_kw: dict[str, Any],
    ) -> tuple[Prompt, str, float, GenerationConfig]:
        """A request's prompt, method, ratio and generation config, checked on the caller's
        thread, before it is queued."""
        if callable(prompt):
            raise TypeError("a request takes its prompt as data: pass the pieces (or a Prompt), not a function")
        prompt = prompt if isinstance(prompt, Prompt) else Prompt(tuple(prompt))
        method = method or self.config.method
        if method not in SELECTORS:
            raise ValueError(f"unknown method {method!r}; valid: {', '.join(sorted(SELECTORS))}")
        ratio = self.config.ratio if ratio is None else ratio
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {ratio}")
        gen = generation or GenerationConfig()
        if gen_kw:
            valid = {f.name for f in dataclasses.fields(GenerationConfig)}
            unknown = sorted(set(gen_kw) - valid)
            if unknown:
                raise TypeError(f"unknown generation options {unknown}; valid: {', '.join(sorted(valid))}")
            gen = replace(gen, **gen_kw)
        return prompt, method, ratio, gen


def _drain(stream: TokenStream) -> FusionResult:
    for _ in stream:
        pass
    assert stream.result is not None
    return stream.result


def _chunk_sink(adapter: ModelAdapter) -> torch.Tensor:
    """The token ids chunks are cached after with `EngineConfig.chunk_sink`: the BOS token."""
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
