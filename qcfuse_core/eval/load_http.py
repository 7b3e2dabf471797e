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


def request_body(req: LoadRequest, method: Method, new_tokens: int) -> dict:
    return {
        "prompt": prompt_of(req),
        "max_tokens": new_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "qcfuse": {"documents": list(req.texts), "method": method.label, "ratio": method.ratio, "ignore_eos": True},
    }


async def http_request(client: httpx.AsyncClient, body: dict, trace: Trace) -> None:
    """One streamed completion, recorded in `trace` (see the module docstring)."""
    stats: dict | None = None
    tokens = prompt_tokens = 0
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
    with httpx.Client(base_url=url, headers=headers, timeout=600) as sync:
        t0 = time.perf_counter()
        res = sync.post("/v1/chunks", json={"texts": pool.texts, "ids": pool.node_ids})
        if res.status_code != 200:
            raise ValueError(f"{url}/v1/chunks answered {res.status_code}: {res.text[:300]}")
        build_s = time.perf_counter() - t0
        model = sync.get("/v1/models").json()["data"][0]["id"]
        progress(f"pool of {len(pool.texts)} chunks sent to {url} and built in {build_s:.1f} s")
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
        )
        rows: list[dict] = []
        total = len(points) * len(methods)
        for point in points:
            for method in methods:
                ratio = "" if method.reported_ratio is None else f" {method.reported_ratio:g}"
                progress(f"[{len(rows) + 1}/{total}] {method.label}{ratio}: {point.describe()} over HTTP")
                warm = Trace(time.perf_counter())
                asyncio.run(
                    _one(url, headers, request_body(reqs[-1], method, min(WARMUP_TOKENS, args.max_new_tokens)), warm)
                )
                if not warm.finished:
                    raise ValueError(f"the warm-up request failed: {warm.error or 'refused'}")
                traces, capped, wall = asyncio.run(_loop(url, headers, reqs[: point.requests], point, method, args))
                _wait_idle(sync)
                row = {
                    **base,
                    **point_fields(point, method),
                    **summarize(traces, wall),
                    "capped": capped,
                    "max_batch_seen": _gauge(sync.get("/metrics").text, "qcfuse_max_batch_seen"),
                }
                rows.append(row)
                progress("    " + one_line(row))
    return rows


async def _one(url: str, headers: dict, body: dict, trace: Trace) -> None:
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as client:
        await http_request(client, body, trace)


async def _loop(url: str, headers: dict, todo: list[LoadRequest], point, method: Method, args):
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(point.clients, 16))
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:

        async def send(req: LoadRequest, trace: Trace) -> None:
            await http_request(client, request_body(req, method, args.max_new_tokens), trace)

        return await run_loop(send, todo, point, args)
