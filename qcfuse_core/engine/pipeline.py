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
    5 prefill       Prefill.advance      Prefilled    layer-wise fused prefill by rows (HF's own
                                                      forward for a selector that does not
                                                      fuse), then the guard's decision
    6 decode        Steps.decode         text deltas  first token (TTFT), then the rest

Steps 1-4 of a request make its `Prefill` (`request_lookup`, `prepare`, `open`: the
scheduler reserves its KV cache between the first two); step 5 is that Prefill advanced by
rows (engine/prefill.py) - in one call, or slice by slice as the scheduler's step budget
allows; step 6 is a `Decoding` per request. A finished prefill goes to the quality guard's
decision (`after`): decode from it, or a new Prefill of the same request at the rung the
guard asks for. A chunk whose layers cannot be read raises `Unreadable`; `rerun` deletes it
and makes the request's Prefill again with the chunk as a miss, computed afresh - never
answered from a hole.

The engine's scheduler (engine/scheduler.py) drives every request the engine runs - many at
once, one batched decode step for all; `Steps.run` chains the same calls for one request
alone in the calling thread, the reference the tests hold the scheduler to. Both own the
request's `Request` and close it however it ends, and both build the FusionResult with
`fusion_result`. The steps keep no request state: everything of one request is in its
objects; what they hold is the engine's (read at each call), the measured rates of the
planner, the CPU thread count of every request and the guard's resolved threshold.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Sequence
from dataclasses import replace
from typing import Any

import torch

from qcfuse_core.cache.lookup import LookedUp, check_context
from qcfuse_core.cache.planner import Rates
from qcfuse_core.cache.planner import plan as plan_chunks
from qcfuse_core.cache.prefetch import ChunkView
from qcfuse_core.cache.subspans import count_chunks, served_tokens
from qcfuse_core.engine.frame import eos_ids
from qcfuse_core.engine.generation import GenerationConfig, Sampler, TextAssembler
from qcfuse_core.engine.guard import Guard, Keep
from qcfuse_core.engine.prefill import Engine, Prefill, Unreadable
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
from qcfuse_core.model.batched import decode_batch, deterministic_tile
from qcfuse_core.model.fusion import FusedPrompt, Segment, decode_step
from qcfuse_core.selection import SelectionContext, get_selector
from qcfuse_core.selection.options import FIXED_BUDGET_OPTIONS
from qcfuse_core.selection.selectors import rechoose
from qcfuse_core.types import FusionResult, Piece, PromptSpan, SelectionResult

log = logging.getLogger(__name__)


class Steps:
    """The request's steps over one engine's model, caches and config.

    rates: measured load/compute rates (the planner decides load or recompute per chunk from
    them; None: every cached chunk is loaded). request_threads: CPU intra-op threads per
    request (None: chosen per request from the machine's load, engine/threads.py)."""

    def __init__(self, engine: Engine, rates: Rates | None = None, request_threads: int | None = None) -> None:
        self.engine = engine
        self.rates = rates
        self.request_threads = request_threads
        self.guard = Guard(lambda: engine.config.guard, engine.adapter)

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

    # ------------------------------------------------------------------ 5. prefill
    def open(self, pieces: Sequence[Piece], req: Request, loading: Loading, *, budget: int | None = None) -> Prefill:
        """Steps 3-4 of a prepared request (`prepare`): its load session started (also in
        `req.session`), its rows selected -> its Prefill (engine/prefill.py), in slices of at
        most `budget` rows (None: one)."""
        prompt = loading.prompt
        req.session = self.start_session(prompt)
        req.clock.mark("load_start")
        selected = self.select(prompt, req.method, req.ratio)
        req.clock.mark("select")
        return Prefill.open(
            self.engine,
            pieces,
            req,
            Loading(prompt, req.session),
            selected.selection,
            req.method,
            budget=budget,
            capacity=req.generation.max_new_tokens,
        )

    def after(self, prefill: Prefill, pre: Prefilled, *, budget: int | None = None) -> Prefill | None:
        """The quality guard's decision on a finished prefill (engine/guard.py): None, decode
        from `pre`; or the request's next Prefill, the rung the guard asked for (its prompt
        fused again at a larger ratio, or full prefill), into the same KV buffer."""
        req = prefill.request
        assert req is not None
        decision = self.guard.decide(req, pre, prefill.fuse_ms, lambda r: self._rechosen(req, pre, r), prefill.rung)
        if isinstance(decision, Keep):
            return None
        prompt, engine = pre.prompt, self.engine
        if decision.selection is None:  # full prefill: exactly a `full` request's
            full = get_selector("full").select(SelectionContext(engine.adapter, prompt, 1.0))
            loading, sel, method = Loading(prompt, None), full, "full"
        else:
            req.session = self.start_session(prompt)
            loading, sel, method = Loading(prompt, req.session), decision.selection, req.method
        return Prefill.open(
            engine,
            prefill.pieces,
            req,
            loading,
            sel,
            method,
            budget=budget,
            capacity=req.generation.max_new_tokens,
            rung=decision.ratio,
            load_report=pre.load_report,
        )

    def _rechosen(self, req: Request, pre: Prefilled, ratio: float) -> SelectionResult | None:
        """`req`'s selection at `ratio` from its probe's scores (nothing probed again), or None
        where it has none to re-rank (`selectors.rechoose`)."""
        engine = self.engine
        opts, _ = self._options(req.method, None)
        ctx = SelectionContext(engine.adapter, pre.prompt, ratio, seed=engine.config.seed, options=opts)
        return rechoose(ctx, pre.selection)

    def rerun(self, prefill: Prefill, e: Unreadable, *, budget: int | None = None) -> Prefill:
        """A prefill whose chunks could not be read: they are deleted, and steps 1-4 of its
        request run again with them as misses, rebuilt in memory -> its new Prefill (its
        result reports the failed load). A rerun that fails again raises RuntimeError."""
        if prefill.failed is not None:
            raise RuntimeError("chunk caches could not be read twice in one request") from e
        req = prefill.request
        assert req is not None
        log.warning("%d chunk cache(s) unreadable mid-request; recomputing them", len(e.report["failed"]))
        for key in e.keys:
            self.engine.lookup.forget_unreadable(key)
        loading = self.prepare(self.request_lookup(prefill.pieces, req, again=True), req, again=True)
        new = self.open(prefill.pieces, req, loading, budget=budget)
        new.failed = e.report
        return new

    def fuse(self, loading: Loading, selected: Selected, method: str, *, capacity: int = 0) -> Prefilled:
        """Step 5 of a prompt alone, in one slice and unguarded (the quality benchmarks'
        reference): fused prefill (HF's own forward for a selector that does not fuse) into
        a new cache with room for `capacity` more tokens. Closes the load session; raises
        `Unreadable` when a chunk's layers could not be read."""
        prefill = Prefill.open(self.engine, (), None, loading, selected.selection, method, capacity=capacity)
        pre = prefill.advance(prefill.remaining)
        assert pre is not None
        return pre

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

    # ------------------------------------------------------------------ steps 1-4 before a prefill
    def request_lookup(self, pieces: Sequence[Piece], req: Request, *, again: bool = False) -> LookedUp:
        """Step 1 of `req`: `lookup` for its method, its prompt and max_new_tokens checked
        against the model's positions. Once it returns, the prompt's length is known and
        nothing is loaded or allocated yet: where the scheduler reserves its KV cache.
        again: see `prepare`. A request of a tenant has its own caches of its prefix and of
        the chunks it brings that are not registered (`tenant_pieces`)."""
        pieces = self.tenant_pieces(pieces, req.tenant)
        looked = self.lookup(pieces, req.method, streaming=False if again else None)
        check_context(self.engine.adapter.max_positions, looked.num_tokens, req.generation.max_new_tokens)
        return looked

    def tenant_pieces(self, pieces: Sequence[Piece], tenant: str | None) -> Sequence[Piece]:
        """`pieces` of a request of `tenant`: its prefix and every chunk text not registered in
        the chunk-text index (registered ones, learned ones included, are shared: the learner
        grants learned ones per tenant) salted with the tenant, so their caches are its own -
        another tenant sending the same text neither hits them nor times them. No tenant
        (None, ""): as they are."""
        if not tenant:
            return pieces
        texts = self.engine.caches.texts
        return [
            replace(p, salt=tenant) if p.kind == "prefix" or (p.kind == "chunk" and p.text not in texts) else p
            for p in pieces
        ]

    def prepare(self, looked: LookedUp, req: Request, *, again: bool = False) -> Loading:
        """Steps 2-3 of `req` after its lookup (`request_lookup`), without its load session:
        plan, the fused prompt. again: its chunks could not be read the first time - the
        deleted ones are misses now, rebuilt in memory, and the planner is not asked again."""
        req.clock.mark("lookup")
        planned = Planned(req.method, frozenset()) if again else self.plan(looked, req.method, req.ratio)
        req.method, req.plan = planned.method, planned.plan if not again else req.plan
        req.clock.mark("plan")
        return self.start_loading(looked, planned, stream=False)

    # ------------------------------------------------------------------ one request alone
    def run(
        self,
        pieces: Sequence[Piece],
        method: str,
        ratio: float,
        gen: GenerationConfig,
        sync_stages: bool,
    ) -> Generator[str, None, FusionResult]:
        """One request alone in the calling thread, its prefill in one slice: the reference
        the scheduler is held to (the same `open`, `advance`, `after`, `rerun`, `Decoding`
        and `fusion_result`). Its state is in a `Request`, closed in `finally`."""
        engine = self.engine
        # CPU threads are chosen per request, in the request's thread (a machine's load changes)
        threads = configure_cpu_threads(engine.adapter.device, threads=self.request_threads)["threads"]
        req = Request(method, ratio, gen, StageClock(engine.adapter.device, sync_stages))
        req.threads = threads
        try:
            req.clock.mark("queue")  # nothing to wait for: the stages are the scheduler's all the same
            req.status = Status.PREFILLING
            prefill: Prefill | None = self.open(pieces, req, self.prepare(self.request_lookup(pieces, req), req))
            pre: Prefilled | None = None
            while prefill is not None:
                try:
                    pre = prefill.advance(prefill.remaining)
                except Unreadable as e:
                    prefill = self.rerun(prefill, e)
                    continue
                assert pre is not None
                prefill = self.after(prefill, pre)
            assert pre is not None
            req.clock.mark("prefill")
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
    asked, asked_ratio = request.asked
    rungs = request.guard_report.rungs if request.guard_report is not None else []
    if rungs:  # what answered: the guard's last rung
        method, ratio = ("full", None) if rungs[-1][0] >= 1.0 else (request.method, rungs[-1][0])
    else:
        method, ratio = request.method, request.ratio if get_selector(pre.selection.method).uses_ratio else None
    return FusionResult(
        text=dec.assembler.text,
        token_ids=list(dec.ids),
        method=method,
        ratio=ratio,
        requested_method=asked,
        requested_ratio=asked_ratio if get_selector(asked).uses_ratio else None,
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
