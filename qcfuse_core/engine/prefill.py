"""One admitted request's prefill, advanced by rows: what the scheduler hands its step budget to.

A `Prefill` holds everything step 5 of one request needs and does: the fused prompt and its
load session, the selected rows, the KV buffer it fills (the request's, `Request.cache`), and
how far it has got. The scheduler asks `grant(left, first)` how many of its rows fit in what
is left of a step's budget (`SchedulerConfig.step_prefill_ms` at the measured rate, or
`step_prefill_tokens`), then runs `advance(rows)`; the call that runs its last rows
returns the `Prefilled` to decide on (the quality guard, engine/guard.py) and decode from.

    one slice      the rows recompute in one fused pass (`fusion.fused_prefill`), or HF's own
                   forward for a selector that does not fuse: a prompt whose rows fit the
                   budget, and any prefill whose rows are chosen during the layer loop
                   (`full_layers`, an `on_layer_end` hook: cacheblend) - its rows are not
                   known up front, so it cannot be split
    slices         more rows than the budget: split by position (`fusion.prefill_slices`, a
                   function of the rows and the budget alone, so in deterministic mode its
                   bits do not depend on what runs beside it); the first slice reads the load
                   session and lays every cached row into the KV buffer, each later one
                   attends to the rows before it there; a full prefill (a selector that does
                   not fuse, a guard's full rung) runs its first slice as HF's own forward of
                   those positions (faster than a fused pass over every row, and it reads no
                   chunk cache), the later ones fused

A chunk whose layers cannot be read (its load session's report) raises `Unreadable` from
`advance`: the caller opens a new Prefill of the same request with that chunk rebuilt
(`Steps.rerun`). Any other error is the request's alone. A Prefill keeps no engine state;
the steps it runs read the engine at each call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from qcfuse_core.cache.budget import KVBudget
from qcfuse_core.cache.builder import ChunkBuilder
from qcfuse_core.cache.chunks import ChunkCaches, ChunkLookup
from qcfuse_core.cache.subspans import count_chunks
from qcfuse_core.engine.config import EngineConfig
from qcfuse_core.engine.request import Loading, Prefilled, Request
from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.model.fusion import KVCache, fill_from_hf, fused_prefill, prefill_slices
from qcfuse_core.selection import get_selector
from qcfuse_core.types import Piece, SelectionResult


class Engine(Protocol):
    """What the steps read of the engine that runs them (its current values, at each call)."""

    @property
    def adapter(self) -> ModelAdapter: ...

    @property
    def config(self) -> EngineConfig: ...

    @property
    def caches(self) -> ChunkCaches: ...

    @property
    def lookup(self) -> ChunkLookup: ...

    @property
    def builder(self) -> ChunkBuilder: ...

    @property
    def kv_budget(self) -> KVBudget: ...

    @property
    def tokenizer(self) -> Any: ...


class Unreadable(Exception):
    """Chunk caches could not be read mid-request (their segment indices in `report['failed']`,
    their keys in `keys`)."""

    def __init__(self, report: dict[str, Any], keys: Sequence[Any] = ()) -> None:
        super().__init__(f"{len(report['failed'])} chunk cache(s) unreadable")
        self.report = report
        self.keys = list(keys)


@dataclass(eq=False)
class Prefill:
    """One request's prefill between scheduler steps (module docstring); its own, mutable.

    rung: the quality guard's ratio this prefill answers at (None: the request's own pass);
    failed: the load report of a pass whose chunks could not be read (this prefill reruns it);
    load_report: a report the result keeps (a rung keeps its first pass's)."""

    engine: Engine
    pieces: Sequence[Piece]
    request: Request | None
    loading: Loading
    selection: SelectionResult
    method: str  # the selector whose rows these are ("full" for a full-prefill rung)
    rows: torch.Tensor  # (R,) int64 on the CPU: every row it recomputes (a full prefill: all)
    spans: list[tuple[int, int]]  # the slices' positions; one span: a whole pass
    capacity: int = 0  # tokens its KV buffer holds beyond the prompt (max_new_tokens)
    rung: float | None = None
    failed: dict[str, Any] | None = None
    load_report: dict[str, Any] = field(default_factory=dict)
    cache: KVCache | None = None
    done: int = 0  # slices run
    fuse_ms: float = 0.0  # time in `advance`
    layer_ms: list[float] = field(default_factory=list)

    @classmethod
    def open(
        cls,
        engine: Engine,
        pieces: Sequence[Piece],
        request: Request | None,
        loading: Loading,
        selection: SelectionResult,
        method: str,
        *,
        budget: int | None = None,
        **kw: Any,
    ) -> Prefill:
        """The prefill of `selection`'s rows over `loading`'s prompt, split into slices of at
        most `budget` rows where its rows are known up front (None: one slice)."""
        fused = get_selector(method).fused
        T = loading.prompt.num_tokens
        rows = selection.rows.to(torch.int64).cpu() if fused else torch.arange(T)
        whole = fused and (selection.full_layers or selection.on_layer_end is not None)
        if whole or budget is None or rows.numel() <= budget:
            spans = [(0, T)]
        else:
            spans = prefill_slices(rows, budget)
        return cls(engine, pieces, request, loading, selection, method, rows, spans, **kw)

    # ------------------------------------------------------------------ what is left
    @property
    def finished(self) -> bool:
        return self.done >= len(self.spans)

    @property
    def sliced(self) -> bool:
        return len(self.spans) > 1

    def _slice_rows(self, i: int) -> int:
        """The budget's rows slice i costs: the rows it recomputes; a prefill in one slice
        costs its prompt's length (it also lays every cached row of the prompt into the KV
        buffer and reads their layers: a 10K prompt recomputing 1.5K rows takes a step of
        its own, as it did before prefills were counted by rows)."""
        if not self.sliced:
            return self.loading.prompt.num_tokens
        a, b = self.spans[i]
        return int(((self.rows >= a) & (self.rows < b)).sum())

    def grant(self, left: int, first: bool) -> int:
        """Rows of its next slices that fit in `left` rows of a step's budget (first: nothing
        has run in this step yet - its next slice runs whatever its size, so every prefill
        moves) -> the rows to `advance` now; 0: it waits for the next step."""
        rows, i = 0, self.done
        while i < len(self.spans):
            n = self._slice_rows(i)
            if rows + n > left and not (first and i == self.done):
                break
            rows += n
            i += 1
        return rows

    @property
    def remaining(self) -> int:
        return sum(self._slice_rows(i) for i in range(self.done, len(self.spans)))

    # ------------------------------------------------------------------ running it
    def advance(self, rows: int) -> Prefilled | None:
        """Run its next slices, `rows` rows of them (from `grant`) -> its Prefilled once the
        last one has run, else None. Raises `Unreadable` when a chunk's layers could not be
        read (its load session then closed), or what the prefill raised."""
        t0 = time.perf_counter()
        try:
            out = None
            while rows > 0 and not self.finished:
                rows -= self._slice_rows(self.done)
                out = self._run_slice()
        except BaseException:
            self._close()
            raise
        finally:
            self.fuse_ms += (time.perf_counter() - t0) * 1e3
        return out

    def _kv(self) -> KVCache:
        """Its KV buffer: the request's, its reservation's (a guard rung and a rerun fill the
        same one again); a prefill with no reserved buffer (a prompt fused alone) gets its own."""
        if self.cache is None:
            req, need = self.request, self.loading.prompt.num_tokens + self.capacity
            if req is not None and req.cache is not None and req.cache.capacity >= need:
                self.cache = req.cache
            else:
                self.cache = KVCache(self.engine.adapter, need, self.engine.config.cache.kv_dtype)
                if req is not None:
                    req.cache = self.cache
        return self.cache

    def _run_slice(self) -> Prefilled | None:
        cache, prompt = self._kv(), self.loading.prompt
        a, b = self.spans[self.done]
        fused = get_selector(self.method).fused
        if not fused and a == 0:  # HF's own forward: exactly a `full` request's, or its first slice
            logits, kv = self.engine.adapter.hf_forward(prompt.token_ids[:b], keep=1)
            fill_from_hf(cache, kv)
            self.done = 1
            return self._prefilled(logits, prompt.context_tokens, self.selection) if self.finished else None
        sel = self.selection
        if self.sliced:
            part = self.rows[(self.rows >= a) & (self.rows < b)]
            source = self.loading.session if a == 0 else None
            res = fused_prefill(self.engine.adapter, prompt, part, kv_out=cache, span=(a, b), source=source)
        else:
            res = fused_prefill(
                self.engine.adapter,
                prompt,
                sel.rows,
                full_layers=sel.full_layers,
                on_layer_end=sel.on_layer_end,
                kv_out=cache,
                source=self.loading.session,
            )
        self.layer_ms = [x + y for x, y in zip(self.layer_ms, res.layer_ms)] if self.layer_ms else list(res.layer_ms)
        self.done += 1
        if a == 0:
            self._finish_session()
        if not self.finished:
            return None
        if not fused:
            return self._prefilled(res.logits, prompt.context_tokens, sel)
        if self.sliced:
            details = {
                **sel.details,
                "layer_ms": self.layer_ms,
                "row_sets": [(0, self.rows)],
                "slices": len(self.spans),
            }
        else:
            details = {
                **sel.details,
                "layer_ms": sel.details.get("layer_ms", res.layer_ms),
                "row_sets": sel.details.get("row_sets", res.row_sets),
            }
        rows = res.rows if not self.sliced else self.rows
        recomputed = int(prompt.mask("chunk", "text")[rows[rows < prompt.num_tokens]].sum())
        return self._prefilled(res.logits, recomputed, replace(sel, details=details))

    def _finish_session(self) -> None:
        """Its load session finished and closed: its report kept; raises `Unreadable` when a
        chunk's layers could not be read."""
        session = self.loading.session
        if session is None:
            return
        try:
            rep = session.finish()
        finally:
            self._close()
        report = rep.to_dict()
        self.load_report = self.load_report or report
        if self.request is not None:
            self.request.extra["load_wait_ms"] = rep.total_wait_ms
        if report.get("failed"):
            segs = self.loading.prompt.segments
            raise Unreadable(report, [segs[i].chunk.key for i in report["failed"]])

    def _close(self) -> None:
        """Close its load session (idempotent); the request no longer holds it."""
        session = self.loading.session
        if session is not None:
            session.close()
            self.loading = Loading(self.loading.prompt, None)
        if self.request is not None and self.request.session is session:
            self.request.session = None

    def _prefilled(self, logits: torch.Tensor, recomputed: int, sel: SelectionResult) -> Prefilled:
        prompt, cache = self.loading.prompt, self._kv()
        cache.length = prompt.num_tokens
        hits, n_chunks = count_chunks(
            [s for s in prompt.segments if s.kind != "chunk" or s.chunk is not None or s.cache_hit],
            lambda s: s.cache_hit,
        )
        report = self.failed if self.failed is not None else self.load_report
        return Prefilled(logits, cache, prompt, sel, recomputed, hits, n_chunks - hits, report)
