"""The OpenAI-compatible FastAPI app over one engine's scheduler.

    POST /v1/chat/completions   messages in the model's chat template (tools, tool_choice,
                                response_format through constrained decoding, as the chat
                                integrations do: engine/chat.py, engine/grammar.py)
    POST /v1/completions        a prompt in the engine's completion frame (`engine.complete`)
    POST /v1/chunks             {texts, ids?}: chunk caches built (`engine.build_chunks`) and
                                the texts registered, so later prompts holding them hit
    GET  /v1/models, /health, /metrics (Prometheus text, metrics.py)

Safety: with an API key (`ServeConfig.api_key`) every /v1/ route needs `Authorization:
Bearer KEY` (compared in constant time; 401 otherwise); /health and /metrics stay open, as
in vLLM (they carry counts and timings, never prompts or answers: keep the port off the
internet, or put a proxy in front). Limits, each a 4xx in OpenAI's error shape: the body's
bytes (413, before it is parsed), the prompt's tokens, the documents or node ids a request
names, max_tokens (400). Node ids are opaque keys (rows of the store's SQLite tables), never
part of a path. A body that is not JSON, has the wrong types or holds strings no tokenizer
can encode is a 400; nothing a client sends stops the server.

Every generation is one request of the engine's async API (`engine.acomplete(prompt, chunks,
stream=True)`; a chat, rendered in the model's template, with `framed=False`): requests
arriving together are decoded together by the scheduler. The prompt's chunks are found by
content (`ChunkTextIndex.find`, as `engine.complete` does) unless the request names them in
`qcfuse: {documents | node_ids}`; the answer carries the fusion statistics in `qcfuse`.

A request's life, streamed or not:

    1. check the body (400 in OpenAI's error shape), render the prompt, locate its chunks
    2. submit: a full queue -> 429 with Retry-After
    3. wait for the first delta (or the end): an error before any text - a KV cache that can
       never fit (KVBudgetError), say - is still a 4xx/5xx status, not a broken stream
    4. stream: SSE `data: {chunk}` per delta, the last chunk with the finish reason and the
       statistics, usage when `stream_options.include_usage`, then `data: [DONE]`

A client that goes away aborts its request at once: the server polls for the disconnect while
it waits on the engine, and a closed stream closes the engine's stream (its KV cache goes back
at the scheduler's next step).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from qcfuse_core.asgi import AbortLog, BearerAuth, BodyLimit, LocalOnly
from qcfuse_core.engine.api import EngineBusy, KVBudgetError, QCFuseEngine
from qcfuse_core.engine.chat import forced_tools, parse_tool_calls, render, tool_call_schema
from qcfuse_core.engine.generation import GenerationConfig
from qcfuse_core.engine.streams import AsyncTokenStream
from qcfuse_core.learn import ChunkLearner, LearnConfig, is_learned
from qcfuse_core.serve.builds import BuildQueue, BuildsStopped
from qcfuse_core.serve.metrics import LearnedCollector, ServeMetrics
from qcfuse_core.serve.protocol import (
    ApiError,
    ChatRequest,
    ChunksRequest,
    CompletionRequest,
    Kind,
    envelope,
    error_body,
    fusion_stats,
    new_id,
    now,
    usage,
)
from qcfuse_core.serve.validation import ModelIds, StatusCounts
from qcfuse_core.types import FusionResult, Piece

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# what sets a request's tenant, whose learned chunks it sees (`tenant_of`): its API key, the
# OpenAI `user` field, a vLLM-compatible `cache_salt` field, or nothing (every request alike)
TENANT_BY = ("key", "user", "salt", "none")


@dataclass(frozen=True)
class ServeConfig:
    """Limits and defaults of one server."""

    default_max_tokens: int = 256  # a request without max_tokens
    max_tokens: int = 4096  # the most a request may ask for
    max_body_bytes: int = 1 << 20  # a larger JSON body: 413 before it is parsed
    retry_after_s: int = 1  # the Retry-After of a 429 (the engine's queue is full)
    disconnect_poll_s: float = 0.25  # how often a waiting request checks that its client is there
    max_prompt_tokens: int = 32768  # a longer prompt (as rendered, chunks included): 400
    max_documents: int = 64  # the most documents or node ids one request may name in `qcfuse`
    # None: no auth; else /v1/* needs the bearer token (several: any of them, each its own tenant)
    api_key: str | tuple[str, ...] | None = field(default=None, repr=False)
    learning: LearnConfig = field(default_factory=LearnConfig)  # chunks learned from prompts (qcfuse_core/learn.py)
    tenant_by: str = "key"  # whose learned chunks a request sees: key | user | salt | none (TENANT_BY)
    allowed_hosts: tuple[str, ...] = ()  # Host names besides the connection's address and localhost ('*': any)
    allowed_origins: tuple[str, ...] = ()  # browser origins besides the server's own that may POST

    def __post_init__(self) -> None:
        if not 1 <= self.default_max_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= default_max_tokens <= max_tokens, got {self}")
        if self.max_body_bytes < 1024 or self.retry_after_s < 0 or self.disconnect_poll_s <= 0:
            raise ValueError(f"invalid limits: {self}")
        if self.max_prompt_tokens < 1 or self.max_documents < 1:
            raise ValueError(f"max_prompt_tokens and max_documents must be >= 1, got {self}")
        if self.api_key is not None and not all(k.strip() for k in self.api_keys):
            raise ValueError("api_key must not be empty (pass None for no auth)")
        if self.tenant_by not in TENANT_BY:
            raise ValueError(f"tenant_by must be one of {', '.join(TENANT_BY)}, got {self.tenant_by!r}")

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys a request may carry (none: no auth)."""
        return (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key or ())


class ClientGone(Exception):
    """The client disconnected while its request ran."""


@dataclass
class Generation:
    """One generation request, ready to submit: its prompt and chunks, settings and, once
    done, result. framed: the prompt goes in the engine's frame (/v1/completions); a chat is
    rendered in the model's template already."""

    route: str
    kind: Kind
    prompt: str
    chunks: list[Piece]
    framed: bool
    method: str | None
    ratio: float | None
    gen: GenerationConfig
    tools: list[dict] | None = None  # parse tool calls out of the answer
    schema: tuple[bool, dict | None] = (False, None)  # (constrained, JSON schema)
    include_usage: bool = False
    stream: bool = False
    started: float = field(default_factory=time.perf_counter)
    tenant: str | None = None  # whose request, for the engine (`engine_tenant`): fair admission, salted caches

    @property
    def chunk_ids(self) -> list[str | None]:
        return [c.node_id for c in self.chunks]


def _error(status: int, message: str, kind: str, param: str | None = None, **headers: str) -> JSONResponse:
    return JSONResponse(error_body(message, kind, status, param), status_code=status, headers=headers or None)


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _refusal(status: int, message: str, headers: dict[str, str]) -> JSONResponse:
    """What the shared middlewares (qcfuse_core/asgi.py) answer - a body over the limit (413),
    a missing or wrong API key (401) - in OpenAI's error shape."""
    return _error(status, message, "invalid_request_error", **headers)


def create_app(
    engine: QCFuseEngine,
    *,
    model_name: str | None = None,
    config: ServeConfig | None = None,
    owns_engine: bool = False,
) -> FastAPI:
    """The server's app over `engine` (served under `model_name`, default the model's name).
    owns_engine: the app's shutdown (uvicorn's, on SIGTERM or Ctrl-C, after its open
    connections have ended or been cancelled) also closes the engine (`engine.close()`: its
    scheduler stopped, its store and chunk-text index closed)."""
    cfg = config or ServeConfig()
    ids = ModelIds.of(engine.adapter.name, model_name)  # the public id and its aliases (validation.py)
    metrics = ServeMetrics(engine)
    learner = _learner(engine, cfg, metrics)
    builder = BuildQueue(engine)  # /v1/chunks: one worker, requests served in turn (serve/builds.py)
    created = now()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if learner is not None:
            learner.close()  # queued learned builds dropped, a running one finishes
        builder.close()  # builds not started fail (503); the batch being built finishes
        if owns_engine:
            engine.close()  # the scheduler stopped (what still waits or runs is aborted), the store closed
            log.info("qcfuse serve: scheduler stopped and store closed")

    app = FastAPI(title="QCFuse (OpenAI-compatible)", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.config = engine, metrics, cfg
    app.state.builds = builder
    app.state.learner, app.state.model_ids = learner, ids
    _front_door(app, cfg)

    _error_handlers(app, metrics)

    _reading_routes(app, engine, ids, metrics, created)
    _chunk_route(app, engine, cfg, builder)
    _generation_routes(app, engine, cfg, ids, metrics, learner)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unknown(path: str):
        return _error(404, f"no such endpoint: /{path}", "not_found_error")

    app.add_middleware(StatusCounts, count=metrics.status)  # the outermost: every status, 401/403/413 too
    return app


def _front_door(app: FastAPI, cfg: ServeConfig) -> None:
    """The shared middlewares (qcfuse_core/asgi.py), innermost first."""
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes, error=_refusal)  # every content type, streamed
    if cfg.api_keys:  # outside it: a 401 before the body is read
        app.add_middleware(BearerAuth, key=cfg.api_keys, error=_refusal, prefix="/v1/")
    # the outermost: a foreign Host (DNS rebinding) or a cross-site Origin is refused first
    app.add_middleware(
        LocalOnly,
        error=_refusal,
        allowed_hosts=cfg.allowed_hosts,
        allowed_origins=cfg.allowed_origins,
        hints={
            "host": "; to serve under that name, start the server with --allowed-host NAME",
            "origin": "; to let a page there call this server, start it with --allowed-origin ORIGIN",
        },
    )
    app.add_middleware(AbortLog, error=_refusal, name="qcfuse serve")  # SIGTERM: a line per aborted request


def _learner(engine: QCFuseEngine, cfg: ServeConfig, metrics: ServeMetrics) -> ChunkLearner | None:
    """The server's learner (qcfuse_core/learn.py), its counters in /metrics; None: learning off."""
    if not cfg.learning.enabled:
        return None
    learner = ChunkLearner(engine, cfg.learning)
    metrics.registry.register(LearnedCollector(learner))  # type: ignore[arg-type]
    metrics.on_finished.append(learner.finished)
    return learner


def _reading_routes(app: FastAPI, engine: QCFuseEngine, ids: ModelIds, metrics: ServeMetrics, created: int) -> None:
    name = ids.public

    @app.get("/health")
    async def health():
        s = engine.stats().scheduler
        return {"status": "ok", "model": name, "running": s.running, "waiting": s.waiting}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "qcfuse"}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _chunk_route(app: FastAPI, engine: QCFuseEngine, cfg: ServeConfig, builder: BuildQueue) -> None:
    @app.post("/v1/chunks")
    async def chunks(body: ChunksRequest):
        await _check_chunk_tokens(engine, body.texts, cfg)
        try:
            keys = await builder.build(body.texts, body.ids)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        except BuildsStopped as e:
            raise ApiError(503, str(e), kind="server_error") from None
        ids: list[str | None] = list(body.ids) if body.ids else [None] * len(body.texts)
        return {"object": "list", "data": [{"id": i, "key": k.to_string()} for i, k in zip(ids, keys)]}


def _generation_routes(
    app: FastAPI,
    engine: QCFuseEngine,
    cfg: ServeConfig,
    ids: ModelIds,
    metrics: ServeMetrics,
    learner: ChunkLearner | None,
) -> None:
    """/v1/chat/completions and /v1/completions; a request whose chunks are found by content
    is served its tenant's learned chunks too (`tenant_of`, `_learned`)."""

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        _check_model(ids, body.model)
        tenant = tenant_of(request, body, cfg)
        g = await _chat(engine, body, cfg)
        g.tenant = engine_tenant(tenant)
        if learner is not None and _by_content(body):  # the context blocks of its messages, by role
            _learned(learner, g, [(m["role"], m["content"]) for m in body.messages], tenant)
        return await _respond(engine, g, request, ids.public, metrics, cfg)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(ids, body.model)
        tenant = tenant_of(request, body, cfg)
        g = await _completion(engine, body, cfg)
        g.tenant = engine_tenant(tenant)
        if learner is not None and _by_content(body):
            _learned(learner, g, [("user", g.prompt)], tenant)
        return await _respond(engine, g, request, ids.public, metrics, cfg)


def _error_handlers(app: FastAPI, metrics: ServeMetrics) -> None:
    """Every error the app raises, answered in the one error shape (protocol.error_body): an
    ApiError as it says, Starlette's HTTP errors and FastAPI's validation errors as 4xx,
    anything else as a logged 500."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):  # a bug: still the one error shape, logged
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _error(500, f"internal error ({type(exc).__name__}); the server's log has the details", "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):  # a body FastAPI cannot parse, say
        route = _route(request.url.path)
        if route and exc.status_code == 400:
            metrics.outcome(route, "bad_request")
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        parts, param = [], None
        for e in errs:
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            param = param or where or None
            msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
            parts.append(f"{where}: {msg}" if where else msg)
        route = _route(request.url.path)
        if route:
            metrics.outcome(route, "bad_request")
        return _error(400, "; ".join(parts) or "invalid request", "invalid_request_error", param)


def _check_model(ids: ModelIds, model: str | None) -> None:
    if not ids.accepts(model):
        assert model is not None
        raise ApiError(404, ids.not_found(model), param="model", code="model_not_found")


def tenant_of(request: Request, body: ChatRequest | CompletionRequest, cfg: ServeConfig) -> str:
    """The tenant of a request, by `cfg.tenant_by` ("": the one every request without a tenant
    shares): its API key (none configured: ""), its `user`, or its `cache_salt`. A
    `cache_salt` sent to a server that does not go by it is a 400: it would not separate."""
    extra = body.model_extra or {}
    by, salt = cfg.tenant_by, extra.get("cache_salt")
    if salt is not None and by != "salt":
        raise ApiError(
            400, "cache_salt is not honoured here: start the server with --tenant-by salt", param="cache_salt"
        )
    if by == "key" and cfg.api_keys:
        header = dict(request.scope.get("headers") or []).get(b"authorization", b"")
        return "key:" + header.partition(b" ")[2].strip().decode("latin-1")  # BearerAuth checked it
    if by in ("user", "salt"):
        field_name = "user" if by == "user" else "cache_salt"
        value = extra.get(field_name)
        if value is not None and not isinstance(value, str):
            raise ApiError(400, f"{field_name} must be a string", param=field_name)
        return f"{by}:{value}" if value else ""
    return ""


def engine_tenant(tenant: str) -> str | None:
    """The tenant as the engine gets it (`tenant=`: its requests admitted in turn with other
    tenants', its prefix and unregistered documents cached under its own salt): a hash, so
    no key travels further; None for the one shared tenant."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:32] if tenant else None


def _learned(learner: ChunkLearner, g: Generation, blocks: list[tuple[str, str]], tenant: str) -> None:
    """The tenant's learned chunks join the registered ones; then its sightings are counted."""
    g.chunks = learner.pieces(g.prompt, blocks, g.chunks, tenant)
    learner.observe(g.prompt, blocks, g.chunks, tenant)


def _by_content(body: ChatRequest | CompletionRequest) -> bool:
    """The request leaves its chunks to be found by content (it names none in `qcfuse`)."""
    q = body.qcfuse
    return q is None or (q.documents is None and q.node_ids is None)


def _route(path: str) -> str | None:
    return {"/v1/chat/completions": "chat", "/v1/completions": "completions"}.get(path)


# ---------------------------------------------------------------------------- requests


def _settings(engine: QCFuseEngine, body: ChatRequest | CompletionRequest, cfg: ServeConfig, stops=()) -> dict:
    body.check_supported()
    limit = body.token_limit()
    if limit is not None and limit > cfg.max_tokens:
        raise ApiError(400, f"max_tokens={limit} is over this server's limit of {cfg.max_tokens}", param="max_tokens")
    try:
        gen = GenerationConfig(
            max_new_tokens=limit or cfg.default_max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,  # OpenAI's default
            top_p=1.0 if body.top_p is None else body.top_p,
            stop=tuple(dict.fromkeys([*body.stop, *stops])),  # type: ignore[misc]
            seed=body.seed,
        )
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    q = body.qcfuse
    if q is not None and q.count() > cfg.max_documents:
        which = "documents" if q.documents is not None else "node_ids"
        raise ApiError(
            400,
            f"qcfuse.{which} names {q.count()} chunks, over this server's limit of {cfg.max_documents}",
            param=f"qcfuse.{which}",
        )
    if q is not None and q.ignore_eos:
        gen = replace(gen, ignore_eos=True)
    return {
        "gen": gen,
        "method": q.method if q else None,
        "ratio": q.ratio if q else None,
        "include_usage": bool(body.stream_options and body.stream_options.include_usage),
        "stream": body.stream,
    }


def _locate(engine: QCFuseEngine, prompt: str, body: ChatRequest | CompletionRequest) -> list[Piece]:
    """The prompt's chunks, in order: by content (every registered text it holds; the learned
    ones are the learner's to grant, `_learned`), or the texts `qcfuse.documents` names (each must occur in the prompt), or the registered texts
    of `qcfuse.node_ids` (each must be found in the prompt)."""
    q = body.qcfuse
    registered = [p for p in engine.caches.texts.find(prompt) if not is_learned(p.node_id)]  # learned: the learner's
    if q is None or (q.documents is None and q.node_ids is None):
        return registered
    if q.node_ids is not None:
        found = [p for p in registered if p.node_id in set(q.node_ids)]
        missing = sorted(set(q.node_ids) - {p.node_id for p in found})
        if missing:
            raise ApiError(400, f"node ids not found in the prompt: {missing}", param="qcfuse.node_ids")
        return found
    known = {p.text: p.node_id for p in registered}
    spans = []
    for i, doc in enumerate(q.documents or ()):
        at = prompt.find(doc)
        if at < 0:
            raise ApiError(400, f"qcfuse.documents[{i}] does not occur in the prompt", param="qcfuse.documents")
        spans.append((at, at + len(doc), doc))
    spans.sort()
    for (_, end, _), (start, _, _) in zip(spans, spans[1:]):
        if start < end:
            raise ApiError(400, "qcfuse.documents overlap in the prompt", param="qcfuse.documents")
    return [Piece("chunk", doc, known.get(doc)) for _, _, doc in spans]


async def _chat(engine: QCFuseEngine, body: ChatRequest, cfg: ServeConfig) -> Generation:
    tools = body.tools or None
    choice = body.tool_choice
    forced = None
    if tools and choice != "none":
        try:
            forced = forced_tools(tools, choice)
        except ValueError as e:
            raise ApiError(400, str(e), param="tool_choice") from None
    elif choice not in (None, "none", "auto"):
        raise ApiError(400, "tool_choice needs tools", param="tool_choice")
    shown = tools if choice != "none" else None
    try:
        prompt = render(engine.tokenizer, body.messages, shown, forced=forced is not None)
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None
    except KeyError as e:
        raise ApiError(400, f"a message's tool call lacks {e}", param="messages") from None
    schema, field = body.json_schema(), "response_format"
    if forced is not None:
        if schema[0]:
            raise ApiError(400, "a forced tool call and response_format cannot be combined", param="response_format")
        schema, field = (True, tool_call_schema(forced)), _parameters_field(tools or [], forced)
    s = _settings(engine, body, cfg)
    if schema[0]:
        s["gen"] = await asyncio.to_thread(_constrained, engine, s["gen"], schema[1], field)
    chunks = _locate(engine, prompt, body)
    await _check_prompt_tokens(engine, prompt, cfg, "messages")
    return Generation(
        "chat",
        "chat",
        prompt,
        chunks,
        False,
        s["method"],
        s["ratio"],
        s["gen"],
        tools=shown,
        schema=schema,
        include_usage=s["include_usage"],
        stream=s["stream"],
    )


def _parameters_field(tools: list[dict], forced: list) -> str:
    """The field a forced tool call's schema came from: `tools[i].function.parameters` of the
    one forced tool, `tools` where the call may be any of several."""
    at = [i for i, t in enumerate(tools) if any(t is f for f in forced)]
    return f"tools[{at[0]}].function.parameters" if len(at) == 1 else "tools"


def _constrained(engine: QCFuseEngine, gen: GenerationConfig, schema: dict | None, field: str) -> GenerationConfig:
    """`gen` decoding under a JSON schema (llguidance compiles it; the first time it walks the
    tokenizer's vocabulary, so this runs off the event loop). A schema refused (it does not
    compile, or is past grammar.py's depth or recursion limits) is a 400 naming `field`."""
    from qcfuse_core.engine.grammar import json_schema_constraint

    param = field.split("[")[0].split(".")[0]
    try:
        return replace(gen, constraint=json_schema_constraint(engine.tokenizer, schema))
    except ImportError as e:
        raise ApiError(400, f"constrained decoding is not installed: {e}", param=param) from None
    except (ValueError, TypeError) as e:
        raise ApiError(400, f"{field}: {e}", param=param) from None


async def _check_prompt_tokens(engine: QCFuseEngine, text: str, cfg: ServeConfig, param: str) -> None:
    """400 when `text` (the whole prompt as the model reads it) is over max_prompt_tokens.
    A text of no more UTF-8 bytes than the limit is not tokenized: a token is one byte or
    more (byte-level vocabularies, and byte fallback, never split a byte)."""
    if len(text) <= cfg.max_prompt_tokens // 4 or len(text.encode("utf-8")) <= cfg.max_prompt_tokens:
        return
    n = len(await asyncio.to_thread(lambda: engine.tokenizer(text, add_special_tokens=False).input_ids))
    if n > cfg.max_prompt_tokens:
        raise ApiError(
            400, f"the prompt has {n:,} tokens, over this server's limit of {cfg.max_prompt_tokens:,}", param=param
        )


def chunk_token_limit(engine: QCFuseEngine, cfg: ServeConfig) -> int:
    """The most tokens one /v1/chunks text may have: the model's context (a chunk's cache is
    one prefill of it), at most the server's max_prompt_tokens."""
    return min(cfg.max_prompt_tokens, engine.adapter.max_positions or cfg.max_prompt_tokens)


async def _check_chunk_tokens(engine: QCFuseEngine, texts: list[str], cfg: ServeConfig) -> None:
    """400 naming the limit when a text is longer than `chunk_token_limit` tokens (only
    texts of more UTF-8 bytes than the limit are tokenized: a token is one byte or more)."""
    limit = chunk_token_limit(engine, cfg)
    long = [i for i, t in enumerate(texts) if len(t) > limit // 4 and len(t.encode("utf-8")) > limit]
    if not long:
        return
    enc = await asyncio.to_thread(lambda: engine.tokenizer([texts[i] for i in long], add_special_tokens=False))
    for i, ids in zip(long, enc.input_ids):
        if len(ids) > limit:
            raise ApiError(
                400,
                f"texts[{i}] has {len(ids):,} tokens, over the limit of {limit:,} (the model's context): "
                "split it into smaller chunks",
                param="texts",
            )


async def _completion(engine: QCFuseEngine, body: CompletionRequest, cfg: ServeConfig) -> Generation:
    prompt = body.prompt
    assert isinstance(prompt, str)  # the validator made it one
    s = _settings(engine, body, cfg, stops=engine.frame.stops)  # `qcfuse ask`'s stops for a base model
    chunks = _locate(engine, prompt, body)
    framed = "".join(p.text for p in engine.frame.completion_pieces(prompt, chunks))
    await _check_prompt_tokens(engine, framed, cfg, "prompt")
    return Generation(
        "completions",
        "text",
        prompt,
        chunks,
        True,
        s["method"],
        s["ratio"],
        s["gen"],
        include_usage=s["include_usage"],
        stream=s["stream"],
    )


# ---------------------------------------------------------------------------- responses


async def _deltas(stream: AsyncTokenStream, request: Request, poll_s: float) -> AsyncIterator[str]:
    """The stream's deltas; raises ClientGone once the client has disconnected (checked every
    `poll_s`, whether deltas flow or not). The engine's stream is closed however this ends."""
    pending: asyncio.Future | None = None
    checked = time.monotonic()
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(stream.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=poll_s)
            if not done or time.monotonic() - checked >= poll_s:  # waiting, or deltas flowing
                checked = time.monotonic()
                if await request.is_disconnected():
                    raise ClientGone
            if not done:
                continue
            task, pending = pending, None
            try:
                delta = task.result()
            except StopAsyncIteration:
                return
            yield delta
    finally:
        if pending is not None:
            pending.cancel()
        stream.close()


def _failure(e: BaseException) -> ApiError:
    if isinstance(e, KVBudgetError):
        return ApiError(400, str(e), param="max_tokens")
    if isinstance(e, ValueError):
        return ApiError(400, str(e))
    log.error("request failed", exc_info=e)
    return ApiError(500, f"{type(e).__name__}: {e}", kind="server_error")


async def _respond(
    engine: QCFuseEngine, g: Generation, request: Request, model: str, metrics: ServeMetrics, cfg: ServeConfig
):
    try:
        stream = engine.acomplete(
            g.prompt,
            g.chunks,
            framed=g.framed,
            stream=True,
            method=g.method,
            ratio=g.ratio,
            generation=g.gen,
            tenant=g.tenant,
        )
    except EngineBusy as e:
        metrics.outcome(g.route, "busy")
        return _error(429, str(e), "rate_limit_error", **{"Retry-After": str(cfg.retry_after_s)})
    except ValueError as e:  # an unknown method, say
        metrics.outcome(g.route, "bad_request")
        raise ApiError(400, str(e), param="qcfuse") from None
    deltas = _deltas(stream, request, cfg.disconnect_poll_s)
    # 3. the first delta (or the end): errors before any text are an HTTP status
    first: list[str] = []
    try:
        async for d in deltas:
            first.append(d)
            break
    except ClientGone:
        metrics.outcome(g.route, "aborted")
        return Response(status_code=499)
    except Exception as e:
        err = _failure(e)
        metrics.outcome(g.route, "bad_request" if err.status < 500 else "error")
        return JSONResponse(err.body(), status_code=err.status)
    rid = new_id(g.kind)
    if not g.stream:
        try:
            text = "".join(first) + "".join([d async for d in deltas])
        except ClientGone:
            metrics.outcome(g.route, "aborted")
            return Response(status_code=499)
        except Exception as e:
            err = _failure(e)
            metrics.outcome(g.route, "bad_request" if err.status < 500 else "error")
            return JSONResponse(err.body(), status_code=err.status)
        result = stream.result
        assert result is not None
        metrics.finished(g.route, result, time.perf_counter() - g.started)
        return _whole(g, rid, model, text, result)
    return StreamingResponse(
        _events(g, rid, model, first, deltas, stream, metrics), media_type="text/event-stream", headers=SSE_HEADERS
    )


def _finish_reason(result: FusionResult, calls: list) -> str:
    if calls:
        return "tool_calls"
    return "length" if result.finish_reason == "length" else "stop"


def _tool_calls(g: Generation, text: str) -> tuple[str, list]:
    if not g.tools:
        return text, []
    content, calls = parse_tool_calls(text, g.tools)
    return content, calls


def _call_dicts(calls: list, *, index: bool = False) -> list[dict[str, Any]]:
    return [
        {
            **({"index": i} if index else {}),
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.args)},
        }
        for i, c in enumerate(calls)
    ]


def _whole(g: Generation, rid: str, model: str, text: str, result: FusionResult) -> dict[str, Any]:
    content, calls = _tool_calls(g, text)
    choice: dict[str, Any]
    if g.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = _call_dicts(calls)
        choice = {"index": 0, "message": message, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
    choice["finish_reason"] = _finish_reason(result, calls)
    return {
        **envelope(rid, g.kind, model, now(), chunk=False),
        "choices": [choice],
        "usage": usage(result),
        "qcfuse": fusion_stats(result, g.chunk_ids),
    }


async def _events(
    g: Generation,
    rid: str,
    model: str,
    first: list[str],
    deltas: AsyncIterator[str],
    stream: AsyncTokenStream,
    metrics: ServeMetrics,
) -> AsyncIterator[str]:
    """The SSE body: the deltas as OpenAI chunks, the closing chunk, usage, [DONE]. With tools
    the answer is held back to the end (a tool call is only known once it is complete)."""
    created = now()
    head = envelope(rid, g.kind, model, created, chunk=True)

    def chunk(delta: dict[str, Any] | str, finish: str | None = None, **extra: Any) -> str:
        if g.kind == "chat":
            c: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            c = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
        return _sse({**head, "choices": [c], **extra})

    held = bool(g.tools)
    texts: list[str] = []
    outcome = "aborted"
    try:
        if g.kind == "chat":
            yield chunk({"role": "assistant", "content": ""})

        async def every() -> AsyncIterator[str]:
            for d in first:
                yield d
            async for d in deltas:
                yield d

        try:
            async for d in every():
                texts.append(d)
                if d and not held:
                    yield chunk({"content": d} if g.kind == "chat" else d)
        except ClientGone:
            return
        except Exception as e:  # after the first delta: reported inside the stream
            err = _failure(e)
            outcome = "bad_request" if err.status < 500 else "error"
            yield _sse(err.body())
            yield _sse("[DONE]")
            return
        result = stream.result
        assert result is not None
        text = "".join(texts)
        content, calls = _tool_calls(g, text) if held else (text, [])
        last: dict[str, Any] | str = {} if g.kind == "chat" else ""
        if held and g.kind == "chat":
            last = {"tool_calls": _call_dicts(calls, index=True)} if calls else {"content": content}
        yield chunk(last, _finish_reason(result, calls), qcfuse=fusion_stats(result, g.chunk_ids))
        if g.include_usage:
            yield _sse({**head, "choices": [], "usage": usage(result)})
        yield _sse("[DONE]")
        outcome = "ok"
        metrics.finished(g.route, result, time.perf_counter() - g.started)
    finally:  # finished, or the client went away (the generator closed): the request ends
        stream.close()
        if outcome != "ok":
            metrics.outcome(g.route, outcome)
