"""`qcfuse bench load --url URL`: the load generator of load.py against an OpenAI-compatible
server (`qcfuse serve`) over HTTP - the same pool, requests, points, caps and rows.

    1. the pool's texts and ids go to POST /v1/chunks (the server builds their caches)
    2. per (point, method): one warm-up request, then the closed or open loop of load.py,
       each request one streamed POST /v1/completions through one shared httpx.AsyncClient:

         {"prompt": "Context:\\n<chunk>\\n\\n<chunk>...\\n\\nQuestion: <question>",
          "max_tokens": N, "temperature": 0, "stream": true,
          "stream_options": {"include_usage": true},
          "qcfuse": {"documents": [<chunk>, ...], "method": M, "ratio": R, "ignore_eos": true}}

    3. wait until the server's /health shows nothing running or waiting

`--chunks learn` leaves registration to the server (issue 55): nothing goes to /v1/chunks and
the requests name no documents - the server must find the chunks in the prompt itself. Before
the points, each pool chunk is sent once (requests of `--chunks-per-request` chunks, full
prefill, one token): the server learns them and builds their caches in the background, and
the run waits until its /metrics shows `qcfuse_learned_pending` 0. Every timed request then
holds chunks the server has seen before. Every row carries `cached_share` (the timed
requests' usage.prompt_tokens_details.cached_tokens over their prompt tokens) and
`chunk_hit_share` (their chunks served from a cache over their chunks, `qcfuse` statistics).

Timing: TTFT is the response's `qcfuse.ttft_ms` (the closing chunk's statistics: the
server's clock from submit to the first token, as in process - text deltas are not tokens);
the client's time to the response's first byte is recorded next to it (`first_byte_ms`,
HTTP and the server's framing included). Inter-token latency is (total - TTFT) / (tokens -
1) from the same statistics; end-to-end is the client's clock. A 429 (the server's queue is
full) is `refused`; any other status, an error event in the stream or a transport error is
an error of that request. `max_batch_seen` is the server's /metrics gauge (over its life).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx

from qcfuse_core.eval.load import (
    WARMUP_TOKENS,
    LoadRequest,
    Method,
    Trace,
    load_points,
    methods_of,
    one_line,
    point_fields,
    pool_and_requests,
    run_loop,
    summarize,
)
from qcfuse_core.eval.workload import build_adapter

TIMED_HTTP = "POST /v1/completions (stream)"
IDLE_WAIT_S = 60.0


def prompt_of(req: LoadRequest) -> str:
    return "Context:\n" + "\n\n".join(req.texts) + f"\n\nQuestion: {req.question}"


def request_body(req: LoadRequest, method: Method, new_tokens: int, name_chunks: bool = True) -> dict:
    """The request's body; name_chunks: its chunks in `qcfuse.documents`, else left to the
    server to find (`--chunks learn`)."""
    docs = {"documents": list(req.texts)} if name_chunks else {}
    return {
        "prompt": prompt_of(req),
        "max_tokens": new_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "qcfuse": {**docs, "method": method.label, "ratio": method.ratio, "ignore_eos": True},
    }


async def http_request(
    client: httpx.AsyncClient, body: dict, trace: Trace, cached: list[tuple[int, int, int, int]] | None = None
) -> None:
    """One streamed completion, recorded in `trace` (see the module docstring); cached: gets
    its (cached tokens, prompt tokens, chunks hit, chunks) appended."""
    stats: dict | None = None
    tokens = prompt_tokens = cached_tokens = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as res:
            if res.status_code == 429:
                trace.refused = True
                return
            if res.status_code != 200:
                text = (await res.aread()).decode(errors="replace")
                trace.error = f"HTTP {res.status_code}: {text[:200]}"
                return
            async for line in res.aiter_lines():
                if trace.first_byte_ms is None:
                    trace.first_byte_ms = (time.perf_counter() - trace.submit) * 1e3
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    trace.error = f"stream error: {event['error'].get('message')}"
                    return
                for choice in event.get("choices") or ():
                    if choice.get("text"):
                        trace.deltas.append(time.perf_counter())
                stats = event.get("qcfuse") or stats
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                    prompt_tokens = event["usage"]["prompt_tokens"]
                    cached_tokens = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except asyncio.CancelledError:
        trace.cancelled = True
        raise
    except (httpx.HTTPError, ValueError, KeyError) as e:  # a failed request is a result: counted
        trace.error = f"{type(e).__name__}: {e}"
        return
    if stats is None:
        trace.error = "the stream ended without its closing chunk"
        return
    trace.end = time.perf_counter()
    if cached is not None:
        cached.append((cached_tokens, prompt_tokens, stats["cache_hits"], stats["chunks"]))
    trace.tokens = tokens
    trace.ttft_ms = stats["ttft_ms"]
    if tokens > 1:
        trace.itl_ms = (stats["total_ms"] - stats["ttft_ms"]) / (tokens - 1)
    trace.prompt_tokens, trace.recomputed_tokens, trace.ran_as = (
        prompt_tokens,
        stats["recomputed_tokens"],
        stats["method"],
    )


def _gauge(metrics: str, name: str) -> int:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return int(float(line.split()[-1]))
    return 0


def _teach(sync: httpx.Client, url: str, headers: dict, pool_texts: list[str], per_request: int) -> float:
    """`--chunks learn`: show the server each pool chunk once, then wait for its background
    builds -> seconds taken (module docstring)."""
    t0 = time.perf_counter()
    full = Method("full", 0.0, None)
    for i in range(0, len(pool_texts), per_request):
        req = LoadRequest("What do these passages say?", tuple(pool_texts[i : i + per_request]), ())
        trace = Trace(time.perf_counter())
        asyncio.run(_one(url, headers, request_body(req, full, 1, name_chunks=False), trace))
        if not trace.finished:
            raise ValueError(f"a request showing the pool failed: {trace.error or 'refused'}")
    end = time.monotonic() + IDLE_WAIT_S + 10 * len(pool_texts)
    while True:
        metrics = sync.get("/metrics").text
        if "qcfuse_learned_pending" not in metrics:
            raise ValueError(f"{url} learns no chunks from prompts (a qcfuse serve with learning off?)")
        if _gauge(metrics, "qcfuse_learned_pending") == 0:
            return time.perf_counter() - t0
        if time.monotonic() > end:
            raise RuntimeError(f"{url} is still building learned chunks")
        time.sleep(0.1)


def _wait_idle(client: httpx.Client) -> None:
    end = time.monotonic() + IDLE_WAIT_S
    while True:
        h = client.get("/health").json()
        if h["running"] == 0 and h["waiting"] == 0:
            return
        if time.monotonic() > end:
            raise RuntimeError(f"the server still runs {h['running']} and queues {h['waiting']} requests")
        time.sleep(0.02)


def run_http(args, progress: Callable[[str], None] = lambda line: None) -> list[dict]:
    """Every load point x (method, ratio) against the server at --url -> rows."""
    methods = methods_of(args)
    points = load_points(args)
    adapter = build_adapter(args)  # its tokenizer makes the texts, as in process
    pool, reqs = pool_and_requests(adapter.tokenizer, args, points)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.rstrip("/")
    learn = getattr(args, "chunks", "register") == "learn"
    with httpx.Client(base_url=url, headers=headers, timeout=600) as sync:
        t0 = time.perf_counter()
        if learn:
            build_s = _teach(sync, url, headers, list(pool.texts), args.chunks_per_request)
            progress(f"pool of {len(pool.texts)} chunks shown to {url} and learned in {build_s:.1f} s")
        else:
            res = sync.post("/v1/chunks", json={"texts": pool.texts, "ids": pool.node_ids})
            if res.status_code != 200:
                raise ValueError(f"{url}/v1/chunks answered {res.status_code}: {res.text[:300]}")
            build_s = time.perf_counter() - t0
            progress(f"pool of {len(pool.texts)} chunks sent to {url} and built in {build_s:.1f} s")
        model = sync.get("/v1/models").json()["data"][0]["id"]
        base = dict(
            url=url,
            tier="server",
            device="server",
            model=model,
            pool_chunks=args.pool_chunks,
            chunk_tokens=args.chunk_tokens,
            chunks_per_request=args.chunks_per_request,
            query_tokens=args.query_tokens,
            max_new_tokens=args.max_new_tokens,
            ignore_eos=True,
            duration_cap_s=args.duration_s,
            timed_call=TIMED_HTTP,
            build_chunks_s=round(build_s, 3),
            chunks="learned" if learn else "registered",
        )
        rows: list[dict] = []
        total = len(points) * len(methods)
        for point in points:
            for method in methods:
                ratio = "" if method.reported_ratio is None else f" {method.reported_ratio:g}"
                progress(f"[{len(rows) + 1}/{total}] {method.label}{ratio}: {point.describe()} over HTTP")
                warm = Trace(time.perf_counter())
                warm_body = request_body(reqs[-1], method, min(WARMUP_TOKENS, args.max_new_tokens), not learn)
                asyncio.run(_one(url, headers, warm_body, warm))
                if not warm.finished:
                    raise ValueError(f"the warm-up request failed: {warm.error or 'refused'}")
                cached: list[tuple[int, int, int, int]] = []
                traces, capped, wall = asyncio.run(
                    _loop(url, headers, reqs[: point.requests], point, method, args, not learn, cached)
                )
                _wait_idle(sync)
                row = {
                    **base,
                    **point_fields(point, method),
                    **summarize(traces, wall),
                    "capped": capped,
                    "max_batch_seen": _gauge(sync.get("/metrics").text, "qcfuse_max_batch_seen"),
                    **_shares(cached),
                }
                rows.append(row)
                progress("    " + one_line(row))
    return rows


def _shares(cached: list[tuple[int, int, int, int]]) -> dict:
    """cached_share and chunk_hit_share of the timed requests (module docstring)."""
    tokens, prompts, hits, chunks = (sum(c[i] for c in cached) for i in range(4))
    return {
        "cached_share": round(tokens / prompts, 4) if prompts else None,
        "chunk_hit_share": round(hits / chunks, 4) if chunks else None,
    }


async def _one(url: str, headers: dict, body: dict, trace: Trace) -> None:
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as client:
        await http_request(client, body, trace)


async def _loop(
    url: str,
    headers: dict,
    todo: list[LoadRequest],
    point,
    method: Method,
    args,
    name_chunks: bool = True,
    cached: list[tuple[int, int, int, int]] | None = None,
):
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(point.clients, 16))
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:

        async def send(req: LoadRequest, trace: Trace) -> None:
            body = request_body(req, method, args.max_new_tokens, name_chunks)
            await http_request(client, body, trace, cached)

        return await run_loop(send, todo, point, args)
