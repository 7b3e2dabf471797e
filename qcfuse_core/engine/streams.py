"""The streams a caller holds while a request runs: `TokenStream` (`engine.stream`) and
`AsyncTokenStream` (`engine.astream`). Each yields text deltas, holds the FusionResult once
exhausted, and ends its request in the scheduler when it is closed or dropped early."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator

from qcfuse_core.engine.scheduler import Failed
from qcfuse_core.types import FusionResult


class TokenStream:
    """Iterator over text deltas; `.result` holds the FusionResult once exhausted.

    `close()` stops early: the request leaves the scheduler's batch, its KV cache and load
    session are given back before `close` returns. A stream dropped unfinished is aborted too
    (without waiting)."""

    def __init__(self, gen: Generator[str, None, FusionResult], abort: Callable[[bool], None] | None = None) -> None:
        self._gen = gen
        self._abort = abort  # abort(wait) ends the request (a started generator does it itself)
        self.result: FusionResult | None = None

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> str:
        try:
            return next(self._gen)
        except StopIteration as stop:
            self.result = stop.value
            self._abort = None
            raise
        except BaseException:
            self._abort = None  # the request failed: nothing left to abort
            raise

    def close(self) -> None:
        """Stop early: the request ends (its state released) without decoding the rest."""
        self._gen.close()
        abort, self._abort = self._abort, None
        if abort is not None:
            abort(True)

    def __del__(self) -> None:
        abort, self._abort = getattr(self, "_abort", None), None
        if abort is not None:
            abort(False)


class AsyncTokenStream:
    """Async iterator over text deltas (`async for delta in engine.astream(...)`); `.result`
    holds the FusionResult once exhausted. Cancelling the task that iterates it, or
    `aclose()`, aborts the request; the event loop is never blocked (deltas arrive through
    the loop's own queue, put there from the scheduler's thread)."""

    def __init__(self, queue: asyncio.Queue, abort: Callable[[bool], None]) -> None:
        self._queue = queue
        self._abort: Callable[[bool], None] | None = abort
        self.result: FusionResult | None = None

    def __aiter__(self) -> AsyncTokenStream:
        return self

    async def __anext__(self) -> str:
        if self._abort is None:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled: the client is gone
            self.close()
            raise
        if isinstance(item, str):
            return item
        self._abort = None
        if isinstance(item, Failed):
            raise item.error
        self.result = item
        raise StopAsyncIteration

    def close(self) -> None:
        """Abort the request unless it has ended (its resources are given back at the
        scheduler's next step; this does not wait for it)."""
        abort, self._abort = self._abort, None
        if abort is not None:
            abort(False)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
