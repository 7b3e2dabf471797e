"""`qcfuse bench load`: many clients against one engine - throughput and latency under load.

    qcfuse bench load --shape llama-3.1-8b --device cuda --dtype bf16 \\
        --pool-chunks 50 --chunk-tokens 1024 --chunks-per-request 10 --query-tokens 32 \\
        --max-new-tokens 128 --clients 1 2 4 8 16 32 --requests-per-client 3 \\
        --methods full qcfuse --ratios 0.15 --duration-s 60 --json load.json --plot load.png

What is timed is what a server's clients see: every request is one asyncio task iterating
`engine.astream(question, chunk_texts, node_ids=..., method=..., ratio=..., max_new_tokens=N,
ignore_eos=True)` (greedy; end-of-sequence ignored, so every answer has N tokens).
End-to-end is submit -> the stream's end on the client's clock. TTFT is the request's own
clock from submit to its first token (`FusionResult.ttft_ms`, queueing included), and its
inter-token latency the mean time per token after the first, (total - TTFT) / (tokens - 1):
text deltas are not tokens - a tokenizer holds back bytes that do not yet form text, and
random weights over a byte-level vocabulary emit few whole characters.

The workload: a pool of `--pool-chunks` chunk texts is built once into the store, in
batches, before anything is timed. Request i draws `--chunks-per-request` distinct ones with
a seeded RNG and has its own question, so requests share some chunks and never their order:

    --popularity uniform   every pool chunk equally likely (a fresh draw per request)
    --popularity zipf      pool chunk i (rank i+1) drawn with probability proportional to
                           1 / (i+1)^s (--zipf-s), among those the request has not drawn yet

Every (method, ratio) runs the same requests at every point.

The store: `--tier default` (the default) opens it as `open_engine` does - the host tier
sized from available RAM, on CUDA the GPU chunk tier sharing the engine's GPU budget with the
running requests (store/sizing.py); `--host-bytes` sizes the host tier and
`--gpu-chunk-bytes` caps the GPU chunk cache, for a pool larger than the machine should keep.
`--tier gpu|host|disk` keeps the pool in that one tier, sized to hold it (plus the disk copy).

Where each request's chunks came from: its load report's source per prompt segment
(`PrefetchReport.segment_sources`): a chunk segment is served from the gpu, host or disk tier
(a stored image read), or recomputed (anything else: full prefill, the planner's choice, a
miss built during the request). A row reports each tier's share of its requests' chunk
segments (hit_rate_gpu + hit_rate_host + hit_rate_disk + recomputed_share = 1) and the bytes
each tier moved to the device per request (`bytes_by_source`); over HTTP they are not known.

    closed loop (--clients C ...)   C clients; each sends its next request when its previous
                                    one ends; --requests-per-client each (or --requests in all)
    open loop   (--rate R ...)      --requests requests arriving as a Poisson process of R per
                                    second (seeded), whatever is running

Bounds: a point stops submitting at `--duration-s`; requests still running then are
cancelled (their streams closed: the scheduler aborts them) and counted as `cancelled`, so
the point reports what finished and nothing hangs. A request refused because the engine's
queue is full (EngineBusy; over HTTP, the server's 429) is `refused`, apart from `errors`:
submitted == finished + errors + cancelled + refused.

With `--url URL` the same requests go to an OpenAI-compatible server instead (`qcfuse
serve`; load_http.py): the pool is sent to its /v1/chunks, each request is a streamed POST
/v1/completions naming its chunks in `qcfuse.documents`, and TTFT comes from the response's
`qcfuse.ttft_ms` (the server's clock, as in process) next to the client's first byte.
Requests/s and output tokens/s are the finished requests' over the point's wall time.

Each (point, method, ratio) runs on a fresh engine over the same model and store
(`hooks.internals(engine).replace()`), after one warm-up request: its scheduler's counters (max_batch_seen,
the most sequences one decode step ran) are that run's alone.
"""

from __future__ import annotations

import asyncio
import logging
import random
import shutil
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qcfuse_core.eval.workload import (
    Workload,
    build_adapter,
    kv_bytes_per_token,
    make_question,
    make_workload,
    open_default_store,
    open_tier_store,
    text_words,
    write_json,
)

log = logging.getLogger(__name__)

TIMED_CALL = "engine.astream"
POPULARITY = ("uniform", "zipf")
CHUNK_TIERS = ("gpu", "host", "disk", "recomputed")  # where a request's chunk segment came from
STORED_TIERS = CHUNK_TIERS[:3]
BUILD_BATCH = 16  # pool chunks per build_chunks call
IDLE_WAIT_S = 60.0  # after a point, how long its engine may take to drop cancelled requests
WARMUP_TOKENS = 4


# ----------------------------------------------------------------------------- requests and points


@dataclass(frozen=True)
class LoadRequest:
    """One request: its question and the chunks it draws from the pool, in its order."""

    question: str
    texts: tuple[str, ...]
    node_ids: tuple[str, ...]


def zipf_weights(n: int, s: float) -> list[float]:
    """Weights of n items by rank: item i (rank i+1) has 1 / (i+1)^s."""
    if s < 0:
        raise ValueError(f"--zipf-s must be >= 0, got {s}")
    return [1.0 / (rank**s) for rank in range(1, n + 1)]


def draw(rng: random.Random, candidates: range, k: int, weights: list[float] | None = None) -> list[int]:
    """k distinct candidates: uniformly (`rng.sample`, in a random order), or one after another
    each with probability proportional to its weight among those not drawn yet."""
    if weights is None:
        return rng.sample(candidates, k)
    left, w = list(candidates), list(weights)
    out = []
    for _ in range(k):
        i = rng.choices(range(len(left)), weights=w)[0]
        out.append(left.pop(i))
        w.pop(i)
    return out


def make_requests(
    tokenizer,
    pool: Workload,
    n: int,
    per_request: int,
    query_tokens: int,
    seed: int,
    shared: int = 0,
    popularity: str = "uniform",
    zipf_s: float = 1.0,
) -> list[LoadRequest]:
    """n requests, each `per_request` distinct pool chunks in a random order plus its own
    question; request i is the same whatever n is (a longer list extends a shorter one).
    shared: every request holds the pool's first `shared` chunks among its own (a corpus
    whose requests retrieve the same few chunks), the rest drawn from the others.
    popularity: "uniform", or "zipf" (the k-th of the chunks drawn from has weight 1/k^zipf_s;
    see the module docstring)."""
    if not 1 <= per_request <= len(pool.texts):
        raise ValueError(f"--chunks-per-request must be in [1, --pool-chunks={len(pool.texts)}], got {per_request}")
    if not 0 <= shared <= per_request:
        raise ValueError(f"--shared-chunks must be in [0, --chunks-per-request={per_request}], got {shared}")
    if popularity not in POPULARITY:
        raise ValueError(f"--popularity must be one of {', '.join(POPULARITY)}, got {popularity!r}")
    rest = range(shared, len(pool.texts))
    weights = zipf_weights(len(rest), zipf_s) if popularity == "zipf" else None
    rng = random.Random(seed)
    words = text_words(tokenizer)
    out = []
    for _ in range(n):
        idx = list(range(shared)) + draw(rng, rest, per_request - shared, weights)
        if shared or weights is not None:
            rng.shuffle(idx)  # a random order (uniform draws alone come in one)
        question = make_question(tokenizer, query_tokens, rng, words)
        out.append(LoadRequest(question, tuple(pool.texts[i] for i in idx), tuple(pool.node_ids[i] for i in idx)))
    return out


@dataclass(frozen=True)
class LoadPoint:
    """One load level: `clients` closed-loop clients, or an open loop at `rate` requests/s."""

    mode: str  # "closed" | "open" | "burst" (every request submitted at once)
    requests: int  # submitted at most
    clients: int = 0
    rate: float = 0.0

    @property
    def load(self) -> float:
        """The x of the plots: clients, offered requests/s, or the burst's requests."""
        return float(self.clients) if self.mode == "closed" else self.rate if self.mode == "open" else self.requests

    def describe(self) -> str:
        if self.mode == "burst":
            return f"a burst of {self.requests} requests at once"
        what = (
            f"{self.clients} client{'s' * (self.clients != 1)}"
            if self.mode == "closed"
            else f"Poisson {self.rate:g} req/s"
        )
        return f"{self.mode} loop, {what}, {self.requests} requests"


def load_points(args) -> list[LoadPoint]:
    """The points the arguments ask for: closed loop at each --clients, open loop at each
    --rate, a burst of each --burst size (none of them: closed loop at 1 2 4 8 16 32 clients)."""
    bursts = getattr(args, "burst", None) or []
    clients = args.clients if args.clients or args.rate or bursts else [1, 2, 4, 8, 16, 32]
    points = [LoadPoint("burst", n) for n in bursts]
    for c in clients or []:
        points.append(LoadPoint("closed", args.requests or c * args.requests_per_client, clients=c))
    for r in args.rate or []:
        points.append(LoadPoint("open", args.requests or args.open_requests, rate=r))
    if any(p.clients < 1 for p in points if p.mode == "closed") or any(p.rate <= 0 for p in points if p.mode == "open"):
        raise ValueError("--clients must be >= 1 and --rate > 0")
    if any(p.requests < 1 for p in points):
        raise ValueError("--requests and --requests-per-client must be >= 1")
    return points


# ----------------------------------------------------------------------------- one request, as its client sees it


@dataclass
class Trace:
    """perf_counter() seconds of one request's submit, each text delta and its end."""

    submit: float
    deltas: list[float] = field(default_factory=list)
    end: float | None = None
    tokens: int = 0
    error: str | None = None
    cancelled: bool = False
    refused: bool = False  # the busy error: EngineBusy, or a server's 429
    first_byte_ms: float | None = None  # over HTTP: submit -> the response's first byte, client clock
    queue_ms: float | None = None
    ttft_ms: float | None = None  # the request's clock: submit -> first token
    itl_ms: float | None = None  # mean ms per token after the first
    prompt_tokens: int = 0
    recomputed_tokens: int = 0
    ran_as: str = ""
    fuse: tuple[float, float] | None = None  # its fused prefill (the `prefill` stage): start, end (s)
    bytes_loaded: int = 0  # chunk-cache bytes loaded to the device on its behalf
    chunk_tiers: dict[str, int] = field(default_factory=dict)  # chunk segments per CHUNK_TIERS (in process)
    bytes_by_tier: dict[str, int] = field(default_factory=dict)  # bytes moved to the device per stored tier

    @property
    def finished(self) -> bool:
        return self.end is not None


@dataclass(frozen=True)
class Method:
    label: str
    ratio: float  # passed to the engine (0 for ratio-free methods)
    reported_ratio: float | None


Send = Callable[[LoadRequest, Trace], Coroutine[Any, Any, None]]  # one request, recorded in its trace


async def _client_request(engine, req: LoadRequest, method: Method, new_tokens: int, trace: Trace) -> None:
    """One request through `engine.astream`, recorded in `trace`. An error is the request's
    own (counted in the row); EngineBusy is `refused`; cancellation (the point's time cap)
    closes the stream, which aborts the request."""
    from qcfuse_core.engine.api import EngineBusy

    stream = None
    try:
        stream = engine.astream(
            req.question,
            list(req.texts),
            node_ids=list(req.node_ids),
            method=method.label,
            ratio=method.ratio,
            max_new_tokens=new_tokens,
            ignore_eos=True,
        )
        async for _ in stream:
            trace.deltas.append(time.perf_counter())
    except asyncio.CancelledError:
        trace.cancelled = True
        raise
    except EngineBusy:
        trace.refused = True
        return
    except Exception as e:  # noqa: BLE001 - a failed request is a result of the run: counted, not fatal
        trace.error = f"{type(e).__name__}: {e}"
        return
    finally:
        if stream is not None:
            stream.close()
    trace.end = time.perf_counter()
    r = stream.result
    assert r is not None
    trace.tokens = len(r.token_ids)
    trace.queue_ms = r.timings_ms.get("queue_ms")
    trace.ttft_ms = r.ttft_ms
    if trace.tokens > 1:
        trace.itl_ms = (r.total_ms - r.ttft_ms) / (trace.tokens - 1)
    trace.prompt_tokens, trace.recomputed_tokens, trace.ran_as = r.prompt_tokens, r.recomputed_tokens, r.method
    trace.fuse = _stage_span(trace.submit, r.timings_ms, "prefill")
    trace.bytes_loaded = int(r.load.get("bytes_loaded", 0))
    trace.chunk_tiers = chunk_tiers(r)
    by_source = r.load.get("bytes_by_source", {})
    trace.bytes_by_tier = {t: int(by_source.get(t, 0)) for t in STORED_TIERS}


def chunk_tiers(r) -> dict[str, int]:
    """A finished request's chunk segments per CHUNK_TIERS, from its FusionResult: the load
    report's source of each prompt segment, at the positions of its chunk spans."""
    kinds = r.load.get("segment_sources", [])
    if kinds and len(kinds) != len(r.spans):
        raise RuntimeError(f"the load report names {len(kinds)} segments, the prompt has {len(r.spans)}")
    out = dict.fromkeys(CHUNK_TIERS, 0)
    for i, span in enumerate(r.spans):
        if span.kind == "chunk":
            kind = kinds[i] if kinds else "none"  # no load session: nothing was read from a tier
            out[kind if kind in STORED_TIERS else "recomputed"] += 1
    return out


async def _bounded(tasks: list[asyncio.Task], deadline: float) -> bool:
    """Wait for `tasks` until `deadline`; cancel what still runs then -> whether any was."""
    if not tasks:
        return False
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return bool(pending)


async def closed_loop(
    send: Send, reqs: list[LoadRequest], clients: int, deadline: float, make: Callable[[float], Trace] = Trace
):
    """`clients` clients; client c sends reqs[c], reqs[c + clients], ... one after another
    until the deadline -> (traces, capped). make: the trace of a request submitted at a time."""
    traces: list[Trace] = []

    async def client(c: int) -> None:
        for req in reqs[c::clients]:
            if time.perf_counter() >= deadline:
                return
            trace = make(time.perf_counter())
            traces.append(trace)
            await send(req, trace)

    capped = await _bounded([asyncio.create_task(client(c)) for c in range(clients)], deadline)
    return traces, capped


async def open_loop(send: Send, reqs: list[LoadRequest], rate: float, deadline: float, seed: int):
    """reqs submitted at the arrivals of a Poisson process of `rate`/s (seeded: the same
    arrivals for every method) until the deadline -> (traces, capped)."""
    rng = random.Random(f"arrivals-{seed}-{rate}")
    traces: list[Trace] = []
    tasks: list[asyncio.Task] = []
    start, at = time.perf_counter(), 0.0
    capped = False
    for req in reqs:
        at += rng.expovariate(rate)
        if start + at >= deadline:
            capped = True
            break
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        trace = Trace(time.perf_counter())
        traces.append(trace)
        tasks.append(asyncio.create_task(send(req, trace)))
    capped = await _bounded(tasks, deadline) or capped
    return traces, capped


async def burst(send: Send, reqs: list[LoadRequest], deadline: float):
    """Every request submitted at once -> (traces, capped)."""
    traces = [Trace(time.perf_counter()) for _ in reqs]
    tasks = [asyncio.create_task(send(req, t)) for req, t in zip(reqs, traces)]
    return traces, await _bounded(tasks, deadline)


# ----------------------------------------------------------------------------- statistics


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's
    default); None for no values."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _stage_span(submit: float, timings_ms: dict, stage: str) -> tuple[float, float] | None:
    """(start, end) in perf_counter seconds of one stage of a request whose clock started at
    `submit`: the stages are consecutive intervals from submission (engine/request.py)."""
    from qcfuse_core.engine.request import STAGES

    if f"{stage}_ms" not in timings_ms:
        return None
    end = submit + sum(timings_ms.get(f"{s}_ms", 0.0) for s in STAGES[: STAGES.index(stage) + 1]) / 1e3
    return end - timings_ms[f"{stage}_ms"] / 1e3, end


def _covered(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of the spans (where spans overlap, that time counts once)."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def point_fields(point: LoadPoint, method: Method) -> dict:
    """The columns that name a row's point and method (in process and over HTTP alike)."""
    return {
        "mode": point.mode,
        "clients": point.clients or None,
        "rate": point.rate or None,
        "load": point.load,
        "method": method.label,
        "ratio": method.reported_ratio,
    }


def summarize(traces: list[Trace], wall_s: float) -> dict:
    """The row's counts, rates and latency percentiles from the client-side traces."""
    done = [t for t in traces if t.finished]
    ttft = [t.ttft_ms / 1e3 for t in done if t.ttft_ms is not None]
    itl = [t.itl_ms / 1e3 for t in done if t.itl_ms is not None]
    gaps = [b - a for t in done for a, b in zip(t.deltas, t.deltas[1:])]  # between a request's deltas (s)
    e2e = [t.end - t.submit for t in done if t.end is not None]
    tokens = sum(t.tokens for t in done)
    errors = [t.error for t in traces if t.error is not None]
    queue = [t.queue_ms for t in done if t.queue_ms is not None]
    first_byte = [t.first_byte_ms / 1e3 for t in done if t.first_byte_ms is not None]
    return {
        "submitted": len(traces),
        "finished": len(done),
        "errors": len(errors),
        "cancelled": sum(t.cancelled for t in traces),
        "refused": sum(t.refused for t in traces),
        "error_messages": [f"{n} x {m}" for m, n in Counter(errors).most_common(3)],
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(done) / wall_s, 4) if wall_s > 0 else 0.0,
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
        "ttft_ms_p50": _ms(percentile(ttft, 50)),
        "ttft_ms_p95": _ms(percentile(ttft, 95)),
        "ttft_ms_p99": _ms(percentile(ttft, 99)),
        "itl_ms_p50": _ms(percentile(itl, 50)),
        "itl_ms_p95": _ms(percentile(itl, 95)),
        "itl_ms_p99": _ms(percentile(itl, 99)),
        # the stall a user sees: gaps between one request's consecutive text deltas, client clock
        "gap_ms_p99": _ms(percentile(gaps, 99)),
        "gap_ms_max": _ms(max(gaps)) if gaps else None,
        "e2e_ms_p50": _ms(percentile(e2e, 50)),
        "e2e_ms_p95": _ms(percentile(e2e, 95)),
        "queue_ms_p50": round(statistics.median(queue), 3) if queue else None,
        "first_byte_ms_p50": _ms(percentile(first_byte, 50)),
        "first_byte_ms_p99": _ms(percentile(first_byte, 99)),
        "prompt_tokens": int(statistics.median(t.prompt_tokens for t in done)) if done else None,
        "recomputed_tokens": int(statistics.median(t.recomputed_tokens for t in done)) if done else None,
        "ran_as": sorted({t.ran_as for t in done}),
        "ttft_ms_max": _ms(max(ttft)) if ttft else None,
        "fuse_ms_busy": _ms(_covered([t.fuse for t in done if t.fuse is not None])),
        "bytes_loaded": sum(t.bytes_loaded for t in done),
        **tier_fields(done),
    }


def tier_fields(done: list[Trace]) -> dict:
    """Per tier: its share of the finished requests' chunk segments and the bytes it moved to
    the device per request (None where no request recorded them: over HTTP)."""
    known = [t for t in done if t.chunk_tiers]
    segs = {tier: sum(t.chunk_tiers[tier] for t in known) for tier in CHUNK_TIERS}
    n = sum(segs.values())
    out: dict = {"chunk_segments": n if known else None, "chunk_segments_by_tier": segs if known else None}
    for tier in CHUNK_TIERS:
        key = "recomputed_share" if tier == "recomputed" else f"hit_rate_{tier}"
        out[key] = round(segs[tier] / n, 6) if n else None
    for tier in STORED_TIERS:
        per = [t.bytes_by_tier.get(tier, 0) for t in known]
        out[f"bytes_per_request_{tier}"] = round(statistics.mean(per)) if per else None
    return out


# ----------------------------------------------------------------------------- the driver


def methods_of(args) -> list[Method]:
    from qcfuse_core.selection.base import get_selector

    out = []
    for m in args.methods:
        if get_selector(m).uses_ratio:  # raises on an unknown method, before anything is built
            out += [Method(m, r, r) for r in args.ratios]
        else:
            out.append(Method(m, 0.0, None))
    return out


def run_point(base_engine, pool: Workload, reqs: list[LoadRequest], point: LoadPoint, method: Method, args) -> dict:
    """One (point, method) on a fresh engine over the same model and store -> the row's
    measured fields."""
    from qcfuse_core.eval.hooks import internals

    engine = internals(base_engine).replace()
    for text in pool.texts:  # token ids and keys of every pool chunk, as a long-running server has them
        engine.caches.chunk_tokens(text)
    warm = reqs[-1]
    engine.answer(
        warm.question,
        list(warm.texts),
        node_ids=list(warm.node_ids),
        method=method.label,
        ratio=method.ratio,
        max_new_tokens=min(WARMUP_TOKENS, args.max_new_tokens),
        ignore_eos=True,
    )

    async def send(req: LoadRequest, trace: Trace) -> None:
        await _client_request(engine, req, method, args.max_new_tokens, trace)

    traces, capped, wall = asyncio.run(run_loop(send, reqs[: point.requests], point, args))
    _wait_idle(engine)
    release_device(engine)
    stats = engine.stats().scheduler
    return {
        **summarize(traces, wall),
        "capped": capped,
        "max_batch_seen": stats.max_batch_seen,
        "scheduler_steps": stats.steps,
    }


async def run_loop(send: Send, todo: list[LoadRequest], point: LoadPoint, args) -> tuple[list[Trace], bool, float]:
    """The point's closed or open loop over `send`, capped at --duration-s -> (traces,
    capped, wall seconds)."""
    start = time.perf_counter()
    deadline = start + args.duration_s
    if point.mode == "closed":
        traces, capped = await closed_loop(send, todo, point.clients, deadline)
    elif point.mode == "burst":
        traces, capped = await burst(send, todo, deadline)
    else:
        traces, capped = await open_loop(send, todo, point.rate, deadline, args.seed)
    return traces, capped, time.perf_counter() - start


def release_device(engine) -> None:
    """An idle engine keeps nothing for its next request on the device: its pooled KV cache
    and reusable load buffers are freed (on CUDA given back to the driver), so the next
    point's engine sizes its GPU budget - and with it the GPU chunk tier - from the same free
    memory as this one did."""
    engine.kv_budget.drop_pool()
    if engine.lookup.prefetcher is not None:
        engine.lookup.prefetcher.drop_buffers()
    if engine.adapter.device.type == "cuda":
        torch.cuda.empty_cache()


def _wait_idle(engine) -> None:
    """Until the engine has dropped every cancelled request (the next point starts clean)."""
    end = time.monotonic() + IDLE_WAIT_S
    while True:
        s = engine.stats().scheduler
        if s.running == 0 and s.waiting == 0:
            return
        if time.monotonic() > end:
            raise RuntimeError(
                f"the engine still runs {s.running} and queues {s.waiting} requests {IDLE_WAIT_S} s after the point"
            )
        time.sleep(0.01)


def pool_and_requests(tokenizer, args, points: list[LoadPoint]) -> tuple[Workload, list[LoadRequest]]:
    """The chunk pool and the requests of a run (enough for its largest point, plus the last
    one for the warm-up), the same in process and over HTTP."""
    pool = make_workload(tokenizer, args.pool_chunks, args.chunk_tokens, 1, args.prefix_tokens, args.seed, tag="pool")
    reqs = make_requests(
        tokenizer,
        pool,
        max(p.requests for p in points) + 1,
        args.chunks_per_request,
        args.query_tokens,
        args.seed,
        getattr(args, "shared_chunks", 0),
        getattr(args, "popularity", "uniform"),
        getattr(args, "zipf_s", 1.0),
    )
    return pool, reqs


def open_bench_store(args, root: Path, adapter):
    """The run's store at `root`: the engine's default tiers (`--tier default`, capped by
    --host-bytes / --gpu-chunk-bytes) or one tier sized to hold the pool."""
    cuda = adapter.device.type == "cuda"
    host, gpu = getattr(args, "host_bytes", None), getattr(args, "gpu_chunk_bytes", None)
    if args.tier == "default":
        return open_default_store(root, cuda, args.storage_dtype, host, gpu)
    if host is not None or gpu is not None:
        raise ValueError("--host-bytes and --gpu-chunk-bytes size the default tiers (--tier default)")
    nbytes = kv_bytes_per_token(adapter) * args.pool_chunks * args.chunk_tokens
    return open_tier_store(root, args.tier, nbytes, cuda, args.storage_dtype)


def build_pool(engine, pool: Workload, progress: Callable[[str], None], batch: int | None = None) -> list:
    """Every pool chunk's cache built into the engine's store, `batch` chunks per call (a pool
    larger than the memory tiers streams through them to disk) -> the keys."""
    batch = batch or BUILD_BATCH
    keys: list = []
    t0 = time.perf_counter()
    n = len(pool.texts)
    for i in range(0, n, batch):
        keys += engine.build_chunks(pool.texts[i : i + batch], pool.node_ids[i : i + batch])
        if n > batch:
            progress(f"  pool: {len(keys)}/{n} chunks built ({time.perf_counter() - t0:.1f} s)")
    return keys


def tier_state(store) -> dict:
    """The store's memory tiers now: entries, bytes used and capacity, hits, misses, evictions."""
    tiers = store.stats()["tiers"]
    names = ("entries", "bytes_used", "capacity_bytes", "hits", "misses", "evictions")
    return {name: {k: t.get(k) for k in names} for name, t in tiers.items() if name != "disk"}


def run(args, progress: Callable[[str], None] = lambda line: None) -> list[dict]:
    """Every load point x (method, ratio) -> rows (written to --json as they come)."""
    from qcfuse_core.cache.planner import load_rates
    from qcfuse_core.engine.api import QCFuseEngine
    from qcfuse_core.engine.config import CacheConfig, EngineConfig, FrameConfig, SchedulerConfig

    methods = methods_of(args)
    points = load_points(args)
    if args.duration_s <= 0 or args.max_new_tokens < 1 or args.pool_chunks < 1:
        raise ValueError("--duration-s must be > 0, --max-new-tokens and --pool-chunks >= 1")
    torch.manual_seed(args.seed)
    t_build = time.perf_counter()
    adapter = build_adapter(args)
    progress(f"model {adapter.name} on {adapter.device} built in {time.perf_counter() - t_build:.1f} s")
    pool, reqs = pool_and_requests(adapter.tokenizer, args, points)
    root = Path(args.store) if args.store else Path(tempfile.mkdtemp(prefix="qcfuse-load-"))
    kv_root = root / f"kv-load-{args.tier}"
    store = open_bench_store(args, kv_root, adapter)
    sched_kw = {"max_running": args.max_running} if args.max_running else {}
    if args.step_prefill_tokens:
        sched_kw["step_prefill_tokens"] = args.step_prefill_tokens
    if getattr(args, "step_prefill_ms", 0):
        sched_kw["step_prefill_ms"] = args.step_prefill_ms
    cfg = EngineConfig(
        threads=args.threads or None,
        frame=FrameConfig(system_prompt=pool.system),
        scheduler=SchedulerConfig(**sched_kw),
        cache=CacheConfig(kv_dtype=getattr(args, "kv_dtype", "auto")),
    )
    rates = load_rates(Path(args.rates)) if args.rates else None
    if args.rates and rates is None:
        raise ValueError(f"--rates {args.rates}: no rates there (write them with `qcfuse bench ttft --rates FILE`)")
    engine = QCFuseEngine(adapter, store=store, config=cfg, rates=rates)
    t0 = time.perf_counter()
    keys = build_pool(engine, pool, progress)
    build_s = time.perf_counter() - t0
    release_device(engine)
    progress(f"pool of {len(keys)} chunks x {args.chunk_tokens} tokens built in {build_s:.1f} s ({args.tier} tier)")
    built = tier_state(store)
    base = dict(
        tier=args.tier,
        host_tier_bytes=built.get("host", {}).get("capacity_bytes"),
        gpu_chunk_cap_bytes=getattr(args, "gpu_chunk_bytes", None),
        popularity=getattr(args, "popularity", "uniform"),
        zipf_s=getattr(args, "zipf_s", 1.0) if getattr(args, "popularity", "uniform") == "zipf" else None,
        device=str(adapter.device),
        model=adapter.name,
        dtype=str(adapter.dtype).replace("torch.", ""),
        kv_dtype=getattr(args, "kv_dtype", "auto"),
        pool_chunks=args.pool_chunks,
        chunk_tokens=args.chunk_tokens,
        kv_bytes_per_token=kv_bytes_per_token(adapter),
        chunks_per_request=args.chunks_per_request,
        shared_chunks=getattr(args, "shared_chunks", 0),
        query_tokens=args.query_tokens,
        max_new_tokens=args.max_new_tokens,
        ignore_eos=True,
        duration_cap_s=args.duration_s,
        planner=rates is not None,
        step_prefill_tokens=args.step_prefill_tokens or None,
        step_prefill_ms=getattr(args, "step_prefill_ms", 0) or None,
        timed_call=TIMED_CALL,
        build_chunks_s=round(build_s, 3),
    )
    rows: list[dict] = []
    total = len(points) * len(methods)
    try:
        for point in points:  # every method at one point before the next: a drift reaches them alike
            for method in methods:
                ratio = "" if method.reported_ratio is None else f" {method.reported_ratio:g}"
                progress(f"[{len(rows) + 1}/{total}] {method.label}{ratio}: {point.describe()}")
                got = run_point(engine, pool, reqs, point, method, args)
                row = {**base, **point_fields(point, method), **got}
                row["store_tiers"] = tier_state(store)  # after the point: occupancy, hits, evictions
                rows.append(row)
                write_json(args, rows, TIMED_CALL, partial=True)  # a point's row survives a later timeout
                progress("    " + one_line(row))
    finally:
        store.close()
        shutil.rmtree(kv_root, ignore_errors=True)
    return rows


# ----------------------------------------------------------------------------- reports


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def tier_shares(r: dict) -> str:
    """'gpu / host / disk / recomputed' shares of the row's chunk segments, in percent."""
    keys = [f"hit_rate_{t}" for t in STORED_TIERS] + ["recomputed_share"]
    if r.get(keys[0]) is None:
        return "-"
    return " / ".join(f"{100 * r[k]:.0f}%" for k in keys)


def tier_bytes(r: dict) -> str:
    """'gpu / host / disk' MiB moved to the device per request."""
    keys = [f"bytes_per_request_{t}" for t in STORED_TIERS]
    if r.get(keys[0]) is None:
        return "-"
    return " / ".join(f"{r[k] / 2**20:.1f}" for k in keys)


def one_line(r: dict) -> str:
    capped = " (capped)" if r["capped"] else ""
    return (
        f"{r['finished']}/{r['submitted']} finished{capped}, {r['errors']} errors, {r['requests_per_s']:.2f} req/s, "
        f"{r['output_tokens_per_s']:.1f} tok/s, TTFT p50 {_f(r['ttft_ms_p50'])} ms, "
        f"ITL p50 {_f(r['itl_ms_p50'])} p99 {_f(r['itl_ms_p99'])} ms, largest gap {_f(r['gap_ms_max'])} ms, "
        f"max batch {r['max_batch_seen']}, {r['wall_s']:.1f} s, "
        f"chunks gpu/host/disk/recomputed {tier_shares(r)}, MiB/request gpu/host/disk {tier_bytes(r)}"
    )


def markdown(rows: list[dict]) -> str:
    loops = [r for r in rows if r["mode"] != "burst"]
    bursts = [r for r in rows if r["mode"] == "burst"]
    out: list[str] = []
    if loops:
        out += [
            "| mode | load | method | ratio | finished/submitted | errors | req/s | output tok/s "
            "| TTFT p50 ms | TTFT p95 | TTFT p99 | ITL p50 ms | ITL p95 | ITL p99 | largest gap ms | E2E p50 ms | E2E p95 | max batch "
            "| chunks from GPU / host / disk / recomputed | MiB per request from GPU / host / disk |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in loops:
        load = f"{r['clients']} client{'s' * (r['clients'] != 1)}" if r["mode"] == "closed" else f"{r['rate']:g} req/s"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        done = f"{r['finished']}/{r['submitted']}" + (
            f" ({r['cancelled']} cancelled at the cap)" if r["capped"] else ""
        )
        out.append(
            f"| {r['mode']} | {load} | {r['method']} | {ratio} | {done} | {r['errors']} "
            f"| {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} "
            f"| {_f(r['ttft_ms_p50'])} | {_f(r['ttft_ms_p95'])} | {_f(r['ttft_ms_p99'])} "
            f"| {_f(r['itl_ms_p50'], 2)} | {_f(r['itl_ms_p95'], 2)} | {_f(r['itl_ms_p99'], 2)} | {_f(r['gap_ms_max'])} "
            f"| {_f(r['e2e_ms_p50'])} | {_f(r['e2e_ms_p95'])} "
            f"| {r['max_batch_seen']} | {tier_shares(r)} | {tier_bytes(r)} |"
        )
    if bursts:
        if out:
            out.append("")
        out += [
            "| burst | method | ratio | finished | TTFT p50 ms | last TTFT ms "
            "| fused prefill busy ms | chunk bytes to device | chunks from GPU / host / disk / recomputed |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
    for r in bursts:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        out.append(
            f"| {r['submitted']} | {r['method']} | {ratio} | {r['finished']}/{r['submitted']} "
            f"| {_f(r['ttft_ms_p50'])} | {_f(r['ttft_ms_max'])} | {_f(r['fuse_ms_busy'])} "
            f"| {r['bytes_loaded'] / 2**20:.1f} MiB | {tier_shares(r)} |"
        )
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> Path:
    """TTFT p50, output tokens/s and where the chunks came from against load, one line per
    (method, ratio) (and tier); a row of panels per mode (closed loop: x = clients; open
    loop: x = offered requests/s)."""
    from qcfuse_core.eval.plot import Panel, plot_panels

    panels = []
    for mode, xlabel in (("closed", "concurrent clients"), ("open", "offered requests/s (Poisson)")):  # not bursts
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        for metric, title in (("ttft_ms_p50", "TTFT p50 (ms)"), ("output_tokens_per_s", "output tokens/s")):
            lines: dict[str, list[tuple[float, float]]] = {}
            for r in mine:
                if r[metric] is not None:
                    label = r["method"] if r["ratio"] is None else f"{r['method']} {r['ratio']:g}"
                    lines.setdefault(label, []).append((r["load"], r[metric]))
            panels.append(Panel(f"{title}, {mode} loop", xlabel, lines, log_x=mode == "closed"))
        panels.append(
            Panel(f"share of chunks per tier, {mode} loop", xlabel, _tier_lines(mine), log_x=mode == "closed")
        )
    return plot_panels(panels, path, columns=3)


def _tier_lines(rows: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """'<method ratio>: <tier>' -> [(load, share of chunk segments)], for tiers some row used."""
    lines: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        label = r["method"] if r["ratio"] is None else f"{r['method']} {r['ratio']:g}"
        for tier in CHUNK_TIERS:
            share = r.get("recomputed_share" if tier == "recomputed" else f"hit_rate_{tier}")
            if share is not None:
                lines.setdefault(f"{label}: {tier}", []).append((r["load"], share))
    return {k: v for k, v in lines.items() if any(y for _, y in v)}
