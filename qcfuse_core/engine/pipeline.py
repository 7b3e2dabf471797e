"""The six steps of one request and the driver that chains them.

    step            method               result       what it does
    1 lookup        Steps.lookup         LookedUp     tokens per piece (cached per chunk text),
                                                      chunk keys, the tier holding each chunk;
                                                      misses built and stored: the chunk
                                                      lookup's answer (ChunkLookup.find)
    2 plan          Steps.plan           Planned      load or recompute each chunk (the planner,
                                                      from measured rates) before any loading
    3 start loading Steps.start_loading  Loading      sidecars of the loaded chunks, the fused
                                                      prompt, a LoadSession streaming layers
    4 select        Steps.select         Selected     the method's rows (probe on a GPU)
    5 fuse          Steps.fuse           Prefilled    layer-wise fused prefill (HF's own forward
                                                      for a selector that does not fuse)
    6 decode        Steps.decode         text deltas  first token (TTFT), then the rest

Steps 1-5 run together as `Steps.prefill` (`request_lookup`, `prepare`, `prefill_prepared`:
the scheduler reserves a request's KV cache between the first two), step 6 as a `Decoding`
per request. The engine's scheduler (engine/scheduler.py) drives every request the engine
runs - many at once, one batched decode step for all; `Steps.run` chains the same steps for
one request alone in the calling thread, the reference the tests hold the scheduler to.
Both own the request's `Request` and close it however it ends, and both build the
FusionResult with `fusion_result`. A chunk whose layers cannot be read during step 5 raises
`Unreadable`; `prefill` deletes it and runs steps 1-5 again (the chunk is then a miss,
computed afresh) - never answered from a hole. The steps keep no request state: everything
of one request is in its objects; what they hold is the engine's (read at each call), the
measured rates of the planner and the CPU thread count of every request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from qcfuse_core.cache.budget import KVBudget
from qcfuse_core.cache.builder import ChunkBuilder
from qcfuse_core.cache.chunks import ChunkCaches, ChunkLookup
from qcfuse_core.cache.lookup import LookedUp, check_context
from qcfuse_core.cache.planner import Rates
from qcfuse_core.cache.planner import plan as plan_chunks
from qcfuse_core.cache.prefetch import ChunkView
from qcfuse_core.cache.subspans import count_chunks, served_tokens
from qcfuse_core.engine.config import EngineConfig
from qcfuse_core.engine.frame import eos_ids
from qcfuse_core.engine.generation import GenerationConfig, Sampler, TextAssembler
from qcfuse_core.engine.guard import GuardReport, action_name, escalate, first_token_margin, resolve_threshold
from qcfuse_core.engine.request import (
    Loading,
    Planned,
    Prefilled,
    Request,
    Selected,
    StageClock,
    Status,
)
from qcfuse_core.engine.threads import configure_cpu_threads
from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.model.batched import decode_batch, deterministic_tile
from qcfuse_core.model.fusion import (
    FusedPrompt,
    KVCache,
    PrefillOutput,
    Segment,
    decode_step,
    fill_from_hf,
    fused_prefill,
    prefill_slices,
)
from qcfuse_core.selection import SelectionContext, get_selector
from qcfuse_core.selection.options import FIXED_BUDGET_OPTIONS
from qcfuse_core.selection.selectors import rechoose
from qcfuse_core.types import FusionResult, Piece, PromptSpan, SelectionResult

log = logging.getLogger(__name__)

GUARDED = ("qcfuse", "adaptive")
"""Methods the quality guard watches (its threshold is calibrated on qcfuse); the baselines
run as asked, so a comparison of methods compares them."""


class Unreadable(Exception):
    """Chunk caches could not be read mid-request (their segment indices in `report['failed']`,
    their keys in `keys`)."""

    def __init__(self, report: dict[str, Any], keys: Sequence[Any] = ()) -> None:
        super().__init__(f"{len(report['failed'])} chunk cache(s) unreadable")
        self.report = report
        self.keys = list(keys)


@dataclass(frozen=True)
class FuseJob:
    """One request's input to step 5 (`Steps._fuse_job`)."""

    loading: Loading
    selected: Selected
    method: str
    capacity: int = 0  # tokens its cache must hold beyond the prompt (max_new_tokens)
    request: Request | None = None


@dataclass(eq=False)
class Slicing:
    """One request's chunked prefill between scheduler steps (its own, mutable): the rows it
    recomputes, split by position into `spans` (`fusion.prefill_slices`), `done` of them run
    into its KV cache. `Steps.prefill_slice` runs the next one."""

    pieces: Sequence[Piece]
    job: FuseJob
    rows: torch.Tensor  # (R,) every row it recomputes (a full prefill: all)
    spans: list[tuple[int, int]]
    cache: KVCache
    done: int = 0
    fuse_ms: float = 0.0
    report: dict[str, Any] = field(default_factory=dict)  # its load session's, after the first slice
    layer_ms: list[float] = field(default_factory=list)

    @property
    def next_rows(self) -> int:
        """Rows the next slice recomputes (its prefill work)."""
        a, b = self.spans[self.done]
        return int(((self.rows >= a) & (self.rows < b)).sum())


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


class Steps:
    """The request's steps over one engine's model, caches and config.

    rates: measured load/compute rates (the planner decides load or recompute per chunk from
    them; None: every cached chunk is loaded). request_threads: CPU intra-op threads per
    request (None: chosen per request from the machine's load, engine/threads.py)."""

    def __init__(self, engine: Engine, rates: Rates | None = None, request_threads: int | None = None) -> None:
        self.engine = engine
        self.rates = rates
        self.request_threads = request_threads
        self._threshold: tuple[float | None, str] | None = None  # the guard's, resolved at first use

    # ------------------------------------------------------------------ 1. lookup
    def lookup(self, pieces: Sequence[Piece], method: str, *, streaming: bool | None = None) -> LookedUp:
        """Tokens per piece, chunk keys and tiers; misses are built and stored now: the chunk
        lookup's answer (`ChunkLookup.find`) for the method's kind of request.

        streaming (default: a store that streams layers and a selector that fuses): chunks
        stay in the store and are streamed by the prefetcher; otherwise they come back in memory."""
        return self.engine.lookup.find(pieces, fused=get_selector(method).fused, streaming=streaming)

    # ------------------------------------------------------------------ 2. plan
    def plan(self, looked: LookedUp, method: str, ratio: float) -> Planned:
        """Load or recompute each chunk, from measured rates, before any loading. Without
        rates every cached chunk is loaded. A prompt without a chunk cache to reuse (a plain
        chat turn) is answered by full prefill: there is nothing to fuse."""
        selector = get_selector(method)
        if selector.fused and not any(p.key is not None for p in looked.chunks):
            return Planned("full", frozenset())
        rates = self.rates
        if rates is None or not selector.fused or not looked.chunks:
            return Planned(method, frozenset())
        chunks = looked.chunks
        tiers = [p.tier if p.chunk is None else "host" for p in chunks]  # in memory: as fast as host
        fresh = looked.fresh_tokens
        overhead = rates.select_ms.get(method, rates.overhead_ms)
        p = plan_chunks(
            rates,
            [(int(c.ids.numel()), t) for c, t in zip(chunks, tiers)],
            ratio=ratio if selector.uses_ratio else 0.0,
            total_tokens=looked.num_tokens,
            fresh_rows=fresh,
            full_layers=selector.planner_full_layers,
            num_layers=self.engine.adapter.num_layers,
            overhead_ms=overhead,
        )
        return Planned("full" if p.all_recompute else method, frozenset(p.recomputed), p.to_dict())

    # ------------------------------------------------------------------ 3. start loading
    def start_loading(self, looked: LookedUp, planned: Planned, *, stream: bool = True) -> Loading:
        """The fused prompt (sidecars of the loaded chunks for the probe) and, on a store that
        streams layers, the load session (stream=False: the prompt only; `start_session`
        starts it later)."""
        lookup = self.engine.lookup
        depth = max(self.engine.builder.critical_layers) + 1 if get_selector(planned.method).probes else 0
        segments, n = [], 0
        for p in looked.parts:
            chunk: Any = p.chunk  # a KVChunk, or a ChunkView standing in for one
            if p.kind == "chunk" and p.key is not None:
                if n in planned.recompute:
                    chunk = None
                elif chunk is None:
                    try:
                        chunk = lookup.view(p.key, p.ids, depth)
                    except KeyError:  # stored, but unreadable now: a miss, computed again
                        log.warning("chunk %s is unreadable; recomputing its cache", p.key)
                        chunk, p = lookup.rebuild(p.key, p.ids), replace(p, hit=False)
                n += 1
            segments.append(Segment(p.kind, p.ids, chunk, p.node_id, p.hit))
        prompt = FusedPrompt(segments)
        return Loading(prompt, self.start_session(prompt) if stream else None)

    def start_session(self, prompt: FusedPrompt) -> Any:
        """The prompt's load session (`Prefetcher.start`), or None when all of its caches are
        in memory (or the engine streams no layers)."""
        pf = self.engine.lookup.prefetcher
        if pf is None or not any(isinstance(s.chunk, ChunkView) for s in prompt.segments):
            return None
        return pf.start(prompt)

    # ------------------------------------------------------------------ 4. select
    def select(self, prompt: FusedPrompt, method: str, ratio: float, options: dict | None = None) -> Selected:
        """The method's rows. Selection options default to the engine's config; the critical
        layers resolved once per engine are passed on."""
        opts, source = self._options(method, options)
        sel = get_selector(method).select(
            SelectionContext(self.engine.adapter, prompt, ratio, seed=self.engine.config.seed, options=opts)
        )
        if source is not None:
            sel.details["layers_source"] = source
        return Selected(sel)

    def selection_options(self, method: str, options: dict | None = None) -> dict:
        """The options `select` hands the selector: the caller's (else the engine's config),
        the critical layers filled in, and the profile's ranking options where those layers
        come from the profile."""
        return self._options(method, options)[0]

    def _options(self, method: str, options: dict | None) -> tuple[dict, str | None]:
        engine, selector = self.engine, get_selector(method)
        configured = engine.config.selection
        opts = dict(configured.to_options() if options is None else options)
        source = None  # the model profile's source, where the layers filled in come from it
        if selector.probes and opts.get("critical_layers") is None:
            opts["critical_layers"] = engine.builder.critical_layers
            if not configured.critical_layers:
                profile = engine.builder.profile()
                source = profile.source
                if selector.profiled:
                    # what the profile calibrated with its layers; an adaptive budget takes
                    # them less the options only a fixed budget takes
                    prof = profile.options
                    if selector.adaptive_budget or opts.get("budget") == "adaptive":
                        prof = {k: v for k, v in prof.items() if k not in FIXED_BUDGET_OPTIONS}
                    opts = {**prof, **opts}
        return opts, source

    # ------------------------------------------------------------------ 5. fuse
    def fuse(
        self, loading: Loading, selected: Selected, method: str, *, capacity: int = 0, request: Request | None = None
    ) -> Prefilled:
        """Fused prefill of the prompt (HF's own forward for a selector that does not fuse)
        into a cache with room for `capacity` more tokens. Closes the load session; raises
        `Unreadable` when a chunk's layers could not be read."""
        got = self._fuse_job(FuseJob(loading, selected, method, capacity, request))
        if isinstance(got, Exception):
            raise got
        return got

    def _fuse_job(self, job: FuseJob) -> Prefilled | Exception:
        """Step 5 of one request into its KV cache (`job.request.cache`, else a new one):
        layer-wise fused prefill (`fusion.fused_prefill`), or HF's own forward for a selector
        that does not fuse. Its load session is finished and closed. -> its Prefilled, or the
        exception that ended it (`Unreadable`: a chunk's layers could not be read)."""
        engine = self.engine
        prompt, sel = job.loading.prompt, job.selected.selection
        try:
            req = job.request
            cache = (
                req.cache
                if req is not None and req.cache is not None
                else KVCache(engine.adapter, prompt.num_tokens + job.capacity)
            )
            if req is not None:
                req.cache = cache
            if not get_selector(job.method).fused:
                logits, kv = engine.adapter.hf_forward(prompt.token_ids, keep=1)
                fill_from_hf(cache, kv)
                return self._prefilled(job, cache, logits, prompt.context_tokens, {})
            res = fused_prefill(
                engine.adapter,
                prompt,
                sel.rows,
                full_layers=sel.full_layers,
                on_layer_end=sel.on_layer_end,
                kv_out=cache,
                source=job.loading.session,
            )
        except Exception as e:  # noqa: BLE001 - this request fails alone
            self._close(job)
            return e
        return self._fused(job, cache, res)

    def _fused(self, job: FuseJob, cache: KVCache, res: PrefillOutput) -> Prefilled | Exception:
        """One request's Prefilled from its fused prefill's output: its load session finished
        and closed."""
        report = self._finish_session(job)
        if isinstance(report, Exception):
            return report
        prompt, T = job.loading.prompt, job.loading.prompt.num_tokens
        rows = res.rows
        sel = job.selected.selection
        details = {
            **sel.details,
            "layer_ms": sel.details.get("layer_ms", res.layer_ms),
            "row_sets": sel.details.get("row_sets", res.row_sets),
        }
        recomputed = int(prompt.mask("chunk", "text")[rows[rows < T]].sum())
        return self._prefilled(job, cache, res.logits, recomputed, report, replace(sel, details=details))

    def _finish_session(self, job: FuseJob) -> dict[str, Any] | Exception:
        """`job`'s load session finished and closed -> its report ({} without one), or the
        error: `Unreadable` when a chunk's layers could not be read."""
        report: dict[str, Any] = {}
        session = job.loading.session
        try:
            if session is not None:
                rep = session.finish()
                report = rep.to_dict()
                if job.request is not None:
                    job.request.extra["load_wait_ms"] = rep.total_wait_ms
        except Exception as e:  # noqa: BLE001
            return e
        finally:
            self._close(job)
        if report.get("failed"):
            segs = job.loading.prompt.segments
            return Unreadable(report, [segs[i].chunk.key for i in report["failed"]])
        return report

    @staticmethod
    def _close(job: FuseJob) -> None:
        if job.loading.session is not None:
            job.loading.session.close()

    @staticmethod
    def _prefilled(
        job: FuseJob,
        cache: KVCache,
        logits: torch.Tensor,
        recomputed: int,
        report: dict[str, Any],
        sel: SelectionResult | None = None,
    ) -> Prefilled:
        prompt = job.loading.prompt
        cache.length = prompt.num_tokens
        hits, n_chunks = count_chunks(
            [s for s in prompt.segments if s.kind != "chunk" or s.chunk is not None or s.cache_hit],
            lambda s: s.cache_hit,
        )
        return Prefilled(
            logits, cache, prompt, sel or job.selected.selection, recomputed, hits, n_chunks - hits, report
        )

    # ------------------------------------------------------------------ 6. decode
    def decode(self, pre: Prefilled, request: Request) -> Generator[str, None, FusionResult]:
        """The first token (TTFT is taken here), then decoding from the fused cache, this one
        sequence alone; returns the FusionResult. The scheduler decodes many requests in one
        step with the same `Decoding` state and `fusion_result`."""
        engine = self.engine
        tile = deterministic_tile(engine.adapter.device) if engine.config.deterministic else None
        dec = Decoding(engine, pre, request)
        delta = dec.first()
        while True:
            if delta:
                yield delta
            if dec.finish is not None:
                break
            if tile is None:
                delta = dec.take(decode_step(engine.adapter, pre.cache, dec.token))
            else:  # the rows of a batched step, so alone and batched give the same bits
                delta = dec.take(decode_batch(engine.adapter, [pre.cache], [dec.token], tile=tile)[0])
        return fusion_result(engine, pre, request, dec)

    # ------------------------------------------------------------------ steps 1-5 together
    def prefill(self, pieces: Sequence[Piece], req: Request) -> Prefilled:
        """Steps 1-5 of `req` (its method, ratio and generation config) on `pieces`: the
        prompt's fused cache (also in `req.cache`; a load session in flight is in
        `req.session`), the clock marked through `prefill`.

        A chunk whose layers cannot be read in step 5 (`Unreadable`) is deleted and steps 1-5
        run again with it as a miss; a second failure raises RuntimeError. The caller gives
        `req.cache` back and closes `req` however this ends."""
        got = self.prefill_prepared(pieces, req, self.prepare(self.request_lookup(pieces, req), req))
        if isinstance(got, Exception):
            raise got
        assert isinstance(got, Prefilled)  # not chunked: no `chunk` given
        return got

    def request_lookup(self, pieces: Sequence[Piece], req: Request, *, again: bool = False) -> LookedUp:
        """Step 1 of `req`: `lookup` for its method, its prompt and max_new_tokens checked
        against the model's positions. Once it returns, the prompt's length is known and
        nothing is loaded or allocated yet: where the scheduler reserves its KV cache.
        again: see `prepare`."""
        looked = self.lookup(pieces, req.method, streaming=False if again else None)
        check_context(self.engine.adapter.max_positions, looked.num_tokens, req.generation.max_new_tokens)
        return looked

    def prepare(self, looked: LookedUp, req: Request, *, again: bool = False) -> Loading:
        """Steps 2-3 of `req` after its lookup (`request_lookup`), without its load session:
        plan, the fused prompt. again: its chunks could not be read the first time - the
        deleted ones are misses now, rebuilt in memory, and the planner is not asked again."""
        req.clock.mark("lookup")
        planned = Planned(req.method, frozenset()) if again else self.plan(looked, req.method, req.ratio)
        req.method, req.plan = planned.method, planned.plan if not again else req.plan
        req.clock.mark("plan")
        return self.start_loading(looked, planned, stream=False)

    def prefill_prepared(
        self, pieces: Sequence[Piece], req: Request, loading: Loading, *, chunk: int | None = None
    ) -> Prefilled | Exception | Slicing:
        """Steps 3-5 of a prepared request (`prepare`): its load session started, its rows
        selected (`select`), its fused prefill (`_fuse_job`) and the quality guard -> its
        Prefilled or the exception that ended it; its clock is marked through `prefill`. A
        request whose chunks could not be read runs again with them rebuilt (see `prefill`).

        chunk (chunked prefill): a request that recomputes more than `chunk` rows - and whose
        rows are known before its prefill (no `full_layers`, no `on_layer_end` hook) - is not
        prefilled here: it comes back as its `Slicing`, its load session started, its rows
        chosen and its KV cache taken, for `prefill_slice` to run slice by slice."""
        prompt = loading.prompt
        try:
            req.session = self.start_session(prompt)
        except Exception as e:  # noqa: BLE001 - this request fails alone
            return e
        req.clock.mark("load_start")
        try:
            selected: Selected | Exception = self.select(prompt, req.method, req.ratio)
        except Exception as e:  # noqa: BLE001
            selected = e
        req.clock.mark("select")
        if isinstance(selected, Exception):
            return selected
        job = FuseJob(Loading(prompt, req.session), selected, req.method, req.generation.max_new_tokens, req)
        sliced = None if chunk is None else self._slicing(pieces, job, chunk)
        if sliced is not None:
            return sliced
        t0 = time.perf_counter()
        got = self._fuse_job(job)
        fuse_ms = (time.perf_counter() - t0) * 1e3
        req.session = None  # _fuse_job closed it
        if isinstance(got, Unreadable):
            got = self._again(pieces, req, got)
        if not isinstance(got, Exception):
            got = self.guard(req, got, fuse_ms)
        if not isinstance(got, Exception):
            req.clock.mark("prefill")
        return got

    # ------------------------------------------------------------------ 5a. chunked prefill
    def _slicing(self, pieces: Sequence[Piece], job: FuseJob, chunk: int) -> Slicing | Exception | None:
        """`job`'s Slicing when it recomputes more than `chunk` rows known up front, its KV
        cache taken (or the error that ended it); None: prefilled whole."""
        sel, prompt = job.selected.selection, job.loading.prompt
        fused = get_selector(job.method).fused
        if fused and (sel.full_layers or sel.on_layer_end is not None):
            return None  # its rows are chosen during the prefill: not sliced
        T = prompt.num_tokens
        rows = sel.rows.to(torch.int64).cpu() if fused else torch.arange(T)
        if rows.numel() <= chunk:
            return None
        try:
            req = job.request
            cache = (
                req.cache
                if req is not None and req.cache is not None
                else KVCache(self.engine.adapter, T + job.capacity)
            )
        except Exception as e:  # noqa: BLE001 - this request fails alone
            self._close(job)
            return e
        if job.request is not None:
            job.request.cache = cache
        return Slicing(pieces, job, rows, prefill_slices(rows, chunk), cache)

    def prefill_slice(self, s: Slicing) -> Prefilled | Exception | None:
        """The next slice of a chunked prefill: its rows through every layer, attending to the
        rows before them in the request's KV cache (`fused_prefill`'s `span`). The first slice reads
        the load session's layers and lays every cached row of the prompt into the cache;
        the last one gives the Prefilled (guarded, as `prefill_prepared`'s). -> None while
        slices remain; the Prefilled; or the error that ended the request (a chunk that
        could not be read: its steps 1-5 again, whole, as `prefill`)."""
        job, req = s.job, s.job.request
        assert req is not None
        prompt, T = job.loading.prompt, job.loading.prompt.num_tokens
        a, b = s.spans[s.done]
        part = s.rows[(s.rows >= a) & (s.rows < b)]
        source = job.loading.session if a == 0 else None
        t0 = time.perf_counter()
        try:
            res = fused_prefill(self.engine.adapter, prompt, part, kv_out=s.cache, span=(a, b), source=source)
        except Exception as e:  # noqa: BLE001 - this request fails alone
            self._close(job)
            req.session = None
            return e
        s.fuse_ms += (time.perf_counter() - t0) * 1e3
        s.layer_ms = [x + y for x, y in zip(s.layer_ms, res.layer_ms)] if s.layer_ms else list(res.layer_ms)
        s.done += 1
        if a == 0 and job.loading.session is not None:
            report = self._finish_session(job)
            req.session = None
            if isinstance(report, Unreadable):
                got = self._again(s.pieces, req, report)
                if not isinstance(got, Exception):
                    got = self.guard(req, got, s.fuse_ms)
                if not isinstance(got, Exception):
                    req.clock.mark("prefill")
                return got
            if isinstance(report, Exception):
                return report
            s.report = report
            s.job = job = replace(job, loading=Loading(prompt, None))
        if s.done < len(s.spans):
            return None
        if not get_selector(job.method).fused:
            pre = self._prefilled(job, s.cache, res.logits, prompt.context_tokens, s.report)
        else:
            sel = job.selected.selection
            details = {**sel.details, "layer_ms": s.layer_ms, "row_sets": [(0, s.rows)], "slices": len(s.spans)}
            recomputed = int(prompt.mask("chunk", "text")[s.rows[s.rows < T]].sum())
            pre = self._prefilled(job, s.cache, res.logits, recomputed, s.report, replace(sel, details=details))
        got = self.guard(req, pre, s.fuse_ms)
        if not isinstance(got, Exception):
            req.clock.mark("prefill")
        return got

    # ------------------------------------------------------------------ 5b. the quality guard
    def guard_threshold(self) -> tuple[float | None, str]:
        """The guard's threshold and where it came from: the config's, else the model's
        calibration (resolved once per engine; engine/guard.py)."""
        cfg = self.engine.config.guard
        if cfg.threshold is not None:
            return float(cfg.threshold), "GuardConfig.threshold"
        if self._threshold is None:
            adapter = self.engine.adapter
            self._threshold = resolve_threshold(adapter.fingerprint(), adapter.name)
        return self._threshold

    def guard(self, req: Request, pre: Prefilled, fuse_ms: float) -> Prefilled | Exception:
        """The quality guard on `req`'s fused prefill (engine/guard.py): its report in
        `req.guard_report`; where the first-token margin is below the threshold, the prompt
        fused again up `GuardConfig.ladder` (full prefill at 1.0) within the time ceiling.
        fuse_ms: the fused prefill's time (the ceiling's estimate scales it by rows).
        -> the Prefilled to decode from (the last rung's), or the error of a rung."""
        cfg = self.engine.config.guard
        rep = GuardReport(spent_tokens=pre.recomputed_tokens)
        req.guard_report = rep
        if req.method not in GUARDED:
            rep.code = "not_guarded"
            rep.reason = (
                "full prefill: nothing fused to guard"
                if req.method == "full"
                else f"method {req.method} is not guarded"
            )
            return pre
        if not cfg.enabled or not req.guard:
            rep.reason = "turned off " + ("in EngineConfig.guard" if not cfg.enabled else "for this request")
            return pre
        threshold, rep.source = self.guard_threshold()
        if threshold is None:
            rep.code, rep.reason = "uncalibrated", "no calibration for this model: run `qcfuse calibrate-guard`"
            return pre
        rep.threshold = threshold
        rep.value = value = first_token_margin(pre.logits[-1])
        rep.action = "kept"
        if not escalate(value, threshold):
            rep.code, rep.reason = "margin_ok", "margin at or above the threshold"
            return pre
        rep.code, rep.reason = "low_margin", "margin below the threshold"
        prompt = pre.prompt
        per_row_ms = fuse_ms / max(1, int(pre.selection.rows.numel()))
        uncached = int(prompt.uncached_mask().sum())
        for ratio in cfg.ladder:
            if ratio < 1.0 and ratio <= req.ratio:
                continue
            rows = prompt.num_tokens if ratio >= 1.0 else uncached + round(ratio * prompt.context_tokens)
            if cfg.max_added_ms is not None and rep.added_ms + per_row_ms * rows > cfg.max_added_ms:
                rep.code = "ceiling"
                rep.reason += f"; {action_name(ratio)} would pass the ceiling of {cfg.max_added_ms:g} ms"
                continue
            t0 = time.perf_counter()
            try:
                sel = None if ratio >= 1.0 else self._rechosen(req, pre, ratio)
                if ratio < 1.0 and sel is None:  # nothing to re-rank (an adaptive budget): on to the next rung
                    continue
                pre = self._rung(req, pre, ratio, sel)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                return e
            rep.added_ms += (time.perf_counter() - t0) * 1e3
            rep.spent_tokens += pre.recomputed_tokens
            value = first_token_margin(pre.logits[-1])
            rep.rungs.append((ratio, value))
            rep.action = action_name(ratio)
            if ratio >= 1.0 or not escalate(value, threshold):
                break
        return pre

    def _rechosen(self, req: Request, pre: Prefilled, ratio: float) -> SelectionResult | None:
        """`req`'s selection at `ratio` from its probe's scores (nothing probed again), or None
        where it has none to re-rank (`selectors.rechoose`)."""
        engine = self.engine
        opts, _ = self._options(req.method, None)
        ctx = SelectionContext(engine.adapter, pre.prompt, ratio, seed=engine.config.seed, options=opts)
        return rechoose(ctx, pre.selection)

    def _rung(self, req: Request, pre: Prefilled, ratio: float, sel: SelectionResult | None) -> Prefilled:
        """`req`'s prompt fused again with the rows of `sel` (a rung below 1.0), or at 1.0 by
        full prefill (HF's own forward, as a `full` request alone), into the request's KV
        buffer."""
        engine, prompt = self.engine, pre.prompt
        if ratio >= 1.0 or sel is None:
            full = get_selector("full").select(SelectionContext(engine.adapter, prompt, 1.0))
            job = FuseJob(Loading(prompt, None), Selected(full), "full", req.generation.max_new_tokens, req)
        else:
            session = self.start_session(prompt)
            job = FuseJob(Loading(prompt, session), Selected(sel), req.method, req.generation.max_new_tokens, req)
        got = self._fuse_job(job)
        if isinstance(got, Exception):
            raise got
        return replace(got, load_report=pre.load_report or got.load_report)

    def _again(self, pieces: Sequence[Piece], req: Request, e: Unreadable) -> Prefilled | Exception:
        """Steps 1-5 of a request whose chunks could not be read, with them rebuilt."""
        engine = self.engine
        failed = e.report
        log.warning("%d chunk cache(s) unreadable mid-request; recomputing them", len(failed["failed"]))
        assert req.session is None
        for key in e.keys:
            engine.lookup.forget_unreadable(key)
        try:
            loading = self.prepare(self.request_lookup(pieces, req, again=True), req, again=True)
            req.clock.mark("load_start")
            selected = self.select(loading.prompt, req.method, req.ratio)
            req.clock.mark("select")
            pre = self.fuse(loading, selected, req.method, capacity=req.generation.max_new_tokens, request=req)
        except Unreadable as e2:
            err = RuntimeError("chunk caches could not be read twice in one request")
            err.__cause__ = e2
            return err
        except Exception as e2:  # noqa: BLE001
            return e2
        return replace(pre, load_report=failed)

    # ------------------------------------------------------------------ one request alone
    def run(
        self,
        pieces: Sequence[Piece],
        method: str,
        ratio: float,
        gen: GenerationConfig,
        sync_stages: bool,
    ) -> Generator[str, None, FusionResult]:
        """One request alone in the calling thread: steps 1-6, its state in a `Request` closed
        in `finally`. The engine's API runs requests through its scheduler instead
        (engine/scheduler.py), which calls the same `prefill`, `Decoding` and `fusion_result`."""
        engine = self.engine
        # CPU threads are chosen per request, in the request's thread (a machine's load changes)
        threads = configure_cpu_threads(engine.adapter.device, threads=self.request_threads)["threads"]
        req = Request(method, ratio, gen, StageClock(engine.adapter.device, sync_stages))
        req.threads = threads
        try:
            req.clock.mark("queue")  # nothing to wait for: the stages are the scheduler's all the same
            req.status = Status.PREFILLING
            pre = self.prefill(pieces, req)
            req.status = Status.DECODING
            result = yield from self.decode(pre, req)
            req.status = Status.FINISHED
            return result
        finally:
            req.close()
            req.cache = None

    def fuse_pieces(self, pieces: Sequence[Piece], *, caches: bool = True) -> tuple[FusedPrompt, int, int]:
        """The fused prompt of `pieces` with every cache in memory -> (prompt, chunk hits,
        misses): steps 1 and 3 without streaming. caches=False only tokenizes."""
        looked = self.lookup(pieces, "naive" if caches else "full", streaming=False)
        return self.start_loading(looked, Planned("naive", frozenset())).prompt, looked.hits, looked.misses


class Decoding:
    """One request's decoding state (its own, mutable): sampler, text assembler, the tokens
    taken so far and the next input token.

    `first()` samples the prefill's last row (the TTFT is taken there), `take(logits)` each
    decode step's row; both return the text now safe to emit. Once the request is done
    `finish` is set - "stop" (end of sequence, a stop string) or "length" (max_new_tokens) -
    and the held-back text is in the last delta; until then `token` is the input of its
    next decode step."""

    def __init__(self, engine: Engine, pre: Prefilled, request: Request) -> None:
        gen = request.generation
        self.pre, self.request, self.max_new = pre, request, gen.max_new_tokens
        self.eos = set() if gen.ignore_eos else eos_ids(engine.adapter)
        self.sampler = Sampler(gen, prompt=pre.prompt.token_ids, eos=sorted(self.eos))
        self.assembler = TextAssembler(engine.tokenizer, gen.stop)
        self.ids: list[int] = []
        self.token = -1
        self.finish: str | None = None
        self.ttft_ms = 0.0

    def first(self) -> str:
        token = self.sampler(self.pre.logits[-1])
        self.request.clock.mark("first_token")
        self.ttft_ms = self.request.clock.since_start_ms()
        return self._accept(token)

    def take(self, logits: torch.Tensor) -> str:
        """logits (vocab,) fp32 of the last step -> the text delta."""
        return self._accept(self.sampler(logits))

    def take_token(self, token: int) -> str:
        """The last step's token, chosen by the caller (a plain greedy sampler's argmax, taken
        for a whole batch at once) -> the text delta."""
        assert self.sampler.plain_greedy, "only a plain greedy choice can be made outside the sampler"
        return self._accept(token)

    def _accept(self, token: int) -> str:
        if token in self.eos:
            self.finish = "stop"
            return self.assembler.finish()
        self.ids.append(token)
        delta = self.assembler.push(token)
        if self.assembler.stopped:  # the text is cut before the stop string; nothing is held back
            self.finish = "stop"
        elif len(self.ids) >= self.max_new:
            self.finish = "length"
            delta += self.assembler.finish()
        else:
            self.token = token
        return delta


def fusion_result(engine: Engine, pre: Prefilled, request: Request, dec: Decoding) -> FusionResult:
    """The FusionResult of a finished request (one construction for every decode path)."""
    prompt, clock = pre.prompt, request.clock
    return FusionResult(
        text=dec.assembler.text,
        token_ids=list(dec.ids),
        method=request.method,
        ratio=request.ratio if get_selector(pre.selection.method).uses_ratio else None,
        ttft_ms=dec.ttft_ms,
        total_ms=clock.since_start_ms(),
        context_tokens=prompt.context_tokens,
        prompt_tokens=prompt.num_tokens,
        recomputed_tokens=pre.recomputed_tokens,
        cache_hits=pre.hits,
        cache_misses=pre.misses,
        cache_built=pre.misses,  # every miss is computed during the request (step 1, or 3 if unreadable)
        chunks=count_chunks(prompt.segments, lambda s: s.cache_hit)[1],
        finish_reason=dec.finish or "length",
        timings_ms={**clock.stages, **request.extra},
        selection=pre.selection,
        store_stats=engine.caches.store.counters(),
        plan=request.plan,
        load=pre.load_report,
        threads=request.threads,
        prompt_ids=prompt.token_ids,
        spans=tuple(
            PromptSpan(s.kind, st, st + len(s), s.node_id, s.cache_hit) for s, st in zip(prompt.segments, prompt.starts)
        ),
        subspan_tokens=served_tokens(prompt.segments),
        first_logits=pre.logits[-1].detach().float().cpu(),
        guard=request.guard_report,
    )


def context_rows(prompt: FusedPrompt, rows: torch.Tensor) -> int:
    """Context tokens (chunks and glue) among `rows`."""
    return int(prompt.mask("chunk", "text")[rows].sum())
