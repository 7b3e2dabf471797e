"""`/v1/chunks`' build queue: one worker thread builds chunk caches for every request, taking
turns between them, so one large request cannot hold the others back.

    request A: [a1 a2 a3 a4 a5 a6]      batches of at most `batch_texts` texts and
    request B: [b1]                     `batch_chars` characters (one text always fits)
    request C: [c1 c2]
    worker:    a1 b1 c1 a2 c2 a3 a4 ...  round robin over the requests with work left

A batch is one `engine.build_chunks` call (its texts prefilled together). A request's keys
come back once all its batches are built; a batch that fails (a ValueError) fails its
request, whose other batches are dropped. `close()` (the server's shutdown) stops the queue:
the batch being built finishes, every batch not started is dropped and its request fails
with BuildsStopped. No per-request state outside its `_Build` object; the engine (the model)
is touched by the worker thread only.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.types import ChunkKey


class BuildsStopped(RuntimeError):
    """The queue was closed (the server is shutting down) before a request's builds ran."""


@dataclass
class _Build:
    """One request's texts, split into batches; `done` resolves to every key, in order."""

    batches: deque[tuple[int, list[str], list[str | None]]]  # (first index, texts, ids)
    keys: list[ChunkKey | None]
    done: Future = field(default_factory=Future)


def batches(texts: Sequence[str], batch_texts: int, batch_chars: int) -> list[tuple[int, int]]:
    """[start, end) ranges of `texts`: consecutive runs of at most `batch_texts` texts and
    `batch_chars` characters (a longer text is a batch of its own)."""
    out: list[tuple[int, int]] = []
    start, chars = 0, 0
    for i, t in enumerate(texts):
        if i > start and (i - start >= batch_texts or chars + len(t) > batch_chars):
            out.append((start, i))
            start, chars = i, 0
        chars += len(t)
    if start < len(texts):
        out.append((start, len(texts)))
    return out


class BuildQueue:
    def __init__(self, engine: QCFuseEngine, *, batch_texts: int = 8, batch_chars: int = 16_000) -> None:
        if batch_texts < 1 or batch_chars < 1:
            raise ValueError(f"batch_texts and batch_chars must be >= 1, got {batch_texts}, {batch_chars}")
        self.engine, self.batch_texts, self.batch_chars = engine, batch_texts, batch_chars
        self._turns: deque[_Build] = deque()  # requests with batches left, in turn order
        self._cv = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="qcfuse-serve-build", daemon=True)
        self._worker.start()

    def submit(self, texts: Sequence[str], ids: Sequence[str | None] | None = None) -> Future:
        """Queue a request's texts; the future resolves to their keys (or raises)."""
        ids = list(ids) if ids is not None else [None] * len(texts)
        if len(ids) != len(texts):
            raise ValueError("ids and texts differ in length")
        b = _Build(
            deque((s, list(texts[s:e]), ids[s:e]) for s, e in batches(texts, self.batch_texts, self.batch_chars)),
            [None] * len(texts),
        )
        with self._cv:
            if self._closed:
                raise BuildsStopped("the server is shutting down")
            if not b.batches:
                b.done.set_result([])
                return b.done
            self._turns.append(b)
            self._cv.notify()
        return b.done

    async def build(self, texts: Sequence[str], ids: Sequence[str | None] | None = None) -> list[ChunkKey]:
        fut = self.submit(texts, ids)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:  # the client went away: its batches not started are dropped
            self._drop(fut)
            raise

    def _drop(self, fut: Future) -> None:
        with self._cv:
            for b in list(self._turns):
                if b.done is fut:
                    self._turns.remove(b)
        fut.cancel()

    def _next(self) -> tuple[_Build, tuple[int, list[str], list[str | None]]] | None:
        with self._cv:
            while not self._turns and not self._closed:
                self._cv.wait()
            if self._closed:
                return None
            b = self._turns.popleft()
            return b, b.batches.popleft()

    def _run(self) -> None:
        while (got := self._next()) is not None:
            b, (start, texts, ids) = got
            if b.done.done():  # failed or cancelled already
                continue
            try:
                keys = self.engine.build_chunks(texts, ids)
            except Exception as e:  # this request fails; the others go on
                if not b.done.done():
                    b.done.set_exception(e)
                continue
            b.keys[start : start + len(keys)] = keys
            with self._cv:
                if b.done.done():  # cancelled while its batch was built
                    continue
                if not b.batches:
                    b.done.set_result(list(b.keys))
                elif self._closed:
                    b.done.set_exception(BuildsStopped("the server shut down before these chunks were built"))
                else:
                    self._turns.append(b)  # its next batch after those of every request waiting now

    def close(self, timeout_s: float | None = None) -> None:
        """Stop: the batch being built finishes, the rest (that request's too) fail with
        BuildsStopped."""
        with self._cv:
            self._closed = True
            left, self._turns = list(self._turns), deque()
            self._cv.notify_all()
        for b in left:
            if not b.done.done():
                b.done.set_exception(BuildsStopped("the server shut down before these chunks were built"))
        self._worker.join(timeout_s)

    @property
    def waiting(self) -> int:
        """Requests waiting for their turn (not the one whose batch is being built)."""
        with self._cv:
            return len(self._turns)
