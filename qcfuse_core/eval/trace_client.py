"""The client side of `qcfuse bench trace`: one request through the real `openai` package, and
the transport that takes the same client to an app in this process.

A request is `client.chat.completions.create(...)` (or `client.completions.create(...)`),
streamed with `stream_options={"include_usage": True}` and `extra_body={"qcfuse": {"method",
"ratio", "ignore_eos": True}}` - nothing names the documents: the server finds them by content.
What it records (`Sent`, a load.Trace with more fields), all from the response:

    client TTFT      submit -> the first chunk carrying text, on the client's clock
    server TTFT      the closing chunk's `qcfuse.ttft_ms` (the engine's clock: submit -> first token)
    ITL              per request, (qcfuse.total_ms - ttft_ms) / (tokens - 1); and the client's
                     gaps between text chunks (the tokenizer's stream may hold text back)
    tokens           usage.prompt_tokens, completion_tokens, prompt_tokens_details.cached_tokens
    reuse            qcfuse.recomputed_tokens, context_tokens, chunks, cache_hits,
                     chunk_sources (the tier each chunk came from), guard.escalated

`ASGIStreamTransport`: httpx's own ASGITransport runs the app to the end and hands the body
over at once, so a client behind it sees no stream; this one hands each body part over as the
app sends it, and a client closing the response tells the app it went away.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

from qcfuse_core.eval.load import LoadRequest, Trace
from qcfuse_core.eval.trace_prompts import render

SOURCES = ("gpu", "host", "disk", "recomputed")


@dataclass
class Sent(Trace):
    """One request as the trace saw it (module docstring)."""

    client_ttft_ms: float | None = None
    cached_tokens: int = 0
    context_tokens: int = 0
    chunks: int = 0
    cache_hits: int = 0
    escalated: bool = False
    guard: str | None = None  # what the guard did (its action: kept, full, ratio R, off)
    sources: dict[str, int] = field(default_factory=dict)


async def send(client, model: str, req: LoadRequest, template: str, chat: bool, body: dict, trace: Sent) -> None:
    """One streamed request of `req` rendered by `template`, recorded in `trace`. A failed
    request is a result (trace.error; a 429 is `refused`), never raised."""
    import openai

    prompt = render(template, req.texts, req.question, chat)
    kw = dict(model=model, stream=True, stream_options={"include_usage": True}, temperature=0, **body)
    stats: dict | None = None
    try:
        if chat:
            stream = await client.chat.completions.create(messages=prompt.messages, **kw)
        else:
            stream = await client.completions.create(prompt=prompt.text, **kw)
        async with stream:
            async for chunk in stream:
                now = time.perf_counter()
                if trace.first_byte_ms is None:
                    trace.first_byte_ms = (now - trace.submit) * 1e3
                if _text(chunk, chat):
                    trace.deltas.append(now)
                stats = (chunk.model_extra or {}).get("qcfuse") or stats
                if chunk.usage is not None:
                    trace.tokens = chunk.usage.completion_tokens
                    trace.prompt_tokens = chunk.usage.prompt_tokens
                    details = chunk.usage.prompt_tokens_details
                    trace.cached_tokens = (details.cached_tokens or 0) if details is not None else 0
    except asyncio.CancelledError:
        trace.cancelled = True
        raise
    except openai.RateLimitError:
        trace.refused = True
        return
    except (openai.OpenAIError, httpx.HTTPError, ValueError, KeyError) as e:  # counted in the row
        trace.error = f"{type(e).__name__}: {e}"
        return
    if stats is None:
        trace.error = "the stream ended without the qcfuse statistics"
        return
    trace.end = time.perf_counter()
    _record(trace, stats)


def _text(chunk, chat: bool) -> bool:
    for choice in chunk.choices or ():
        if choice.delta.content if chat else choice.text:
            return True
    return False


def _record(trace: Sent, stats: dict) -> None:
    """The closing chunk's `qcfuse` statistics into the trace."""
    if trace.deltas:
        trace.client_ttft_ms = (trace.deltas[0] - trace.submit) * 1e3
    trace.ttft_ms = stats["ttft_ms"]
    if trace.tokens > 1:
        trace.itl_ms = (stats["total_ms"] - stats["ttft_ms"]) / (trace.tokens - 1)
    trace.recomputed_tokens = stats["recomputed_tokens"]
    trace.context_tokens = stats["context_tokens"]
    trace.ran_as = stats["method"]
    trace.chunks, trace.cache_hits = stats["chunks"], stats["cache_hits"]
    guard = stats.get("guard") or {}
    trace.escalated, trace.guard = bool(guard.get("escalated")), guard.get("action")
    trace.sources = dict(stats.get("chunk_sources") or {})


class _Body(httpx.AsyncByteStream):
    def __init__(self, parts: asyncio.Queue, task: asyncio.Task, gone: asyncio.Event) -> None:
        self.parts, self.task, self.gone = parts, task, gone

    async def __aiter__(self):
        while (part := await self.parts.get()) is not None:
            yield part

    async def aclose(self) -> None:
        self.gone.set()  # the app's next receive() is a disconnect
        try:
            await asyncio.wait_for(asyncio.shield(self.task), 30)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the app's failure was its response
            self.task.cancel()


class ASGIStreamTransport(httpx.AsyncBaseTransport):
    """An ASGI app in this process behind httpx, its response body streamed (module docstring)."""

    def __init__(self, app) -> None:
        self.app = app

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        url = request.url
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "scheme": url.scheme,
            "path": url.path,
            "raw_path": url.raw_path.split(b"?")[0],
            "query_string": url.query,
            "server": (url.host, url.port or 80),
            "client": ("127.0.0.1", 0),
            "root_path": "",
        }
        parts: asyncio.Queue = asyncio.Queue()
        started: asyncio.Future = asyncio.get_running_loop().create_future()
        gone = asyncio.Event()
        first = True

        async def receive() -> dict:
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send_message(message: dict) -> None:
            if message["type"] == "http.response.start":
                started.set_result(message)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    await parts.put(message["body"])
                if not message.get("more_body", False):
                    await parts.put(None)

        async def run() -> None:
            try:
                await self.app(scope, receive, send_message)
            except BaseException as e:
                if not started.done():
                    started.set_exception(e)
                raise
            finally:
                await parts.put(None)

        task = asyncio.create_task(run())
        message = await started
        return httpx.Response(
            message["status"], headers=message.get("headers", []), stream=_Body(parts, task, gone), request=request
        )
