"""Scale-out on Ray Serve: N engine replicas over one store folder, behind Ray Serve's HTTP
proxy, with a request router that sends a request where its chunks already are.

    client ──HTTP──> Ray Serve proxy ──> Ingress (no model: reads the body, finds the
                                         request's chunk texts in the shared text index)
                                           │ handle.forward(Forwarded(..., keys))
                                           ▼  ChunkAffinityRouter picks the replica
                                 EngineReplica × N (open_engine over the shared folder;
                                 the app of create_app, driven through ASGI in-process)

Every replica opens the same store folder: one disk tier and manifest (SQLite, safe for
writers in several processes: store/manifest.py) and one chunk-text index; each keeps its own
memory tiers. A chunk built through one replica is written to the shared disk tier, so it is
a hit (a disk read, no prefill) on every other.

Routing. A request's routing keys are the content hashes of the chunk texts it carries
(`qcfuse.documents`, else the registered texts found in its prompt or messages, as the
replica will find them; `texts` for /v1/chunks). Each replica reports which of those keys sit
in its memory tiers (`record_routing_stats`, polled by Ray Serve every
`ROUTING_STATS_PERIOD_S`); the router adds the keys of the requests it has in flight there
and of those completed since the last report. A replica ranks by how many of the request's keys it holds,
less a cost per request it has in flight (`ChunkAffinityRouter`), so one popular set of
chunks cannot pile every request onto one replica; equal scores go to the shortest queue. A
request with no chunks goes to the shortest queue.

Replica failure. A replica that dies before answering gives a 503 in OpenAI's error shape;
one that dies mid-stream ends the stream with an SSE error event (which the openai client
raises as an APIError) and no `[DONE]`. Ray Serve starts a replacement; the other replicas
keep serving.

Everything here needs the optional extra `ray` (ray[serve]); `qcfuse serve --replicas N` is
the command (serve/cli.py), `build_app` the Ray Serve application for `serve.run`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from qcfuse_core.retrieval.texts import ChunkTextIndex
from qcfuse_core.serve.protocol import error_body

log = logging.getLogger(__name__)

ROUTING_STATS_PERIOD_S = 1.0  # how often Ray Serve asks each replica which chunks it holds
REPLICA_HEADER = "x-qcfuse-replica"  # which replica answered
RESIDENT_HEADER = "x-qcfuse-memory-chunks"  # "held/total": the request's chunks in that replica's memory on arrival
MAX_REMEMBERED = 1 << 16  # text keys a replica or router remembers (LRU)


def text_key(text: str) -> str:
    """A chunk text's routing key: 16 hex chars of its sha256 (the text index's key, cut)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def request_texts(index: ChunkTextIndex, path: str, body: Any) -> list[str]:
    """The chunk texts a parsed request body carries, as the replica will find them: the
    texts of /v1/chunks, `qcfuse.documents`, else the registered texts in the prompt or the
    messages' text. Anything unexpected -> [] (the replica answers the request's errors)."""
    if not isinstance(body, dict):
        return []
    if path.rstrip("/") == "/v1/chunks":
        texts = body.get("texts")
        return [t for t in texts if isinstance(t, str)] if isinstance(texts, list) else []
    q = body.get("qcfuse")
    docs = q.get("documents") if isinstance(q, dict) else None
    if isinstance(docs, list):
        return [d for d in docs if isinstance(d, str)]
    parts: list[str] = []
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        parts.append(prompt)
    elif isinstance(prompt, list):
        parts += [p for p in prompt if isinstance(p, str)]
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [c["text"] for c in content if isinstance(c, dict) and isinstance(c.get("text"), str)]
    return [p.text for p in index.find("\n".join(parts))] if parts else []


@dataclass(frozen=True)
class Forwarded:
    """One HTTP request as the ingress hands it to a replica."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    keys: tuple[str, ...] = ()  # routing keys of its chunk texts


@dataclass(frozen=True)
class ReplicaOptions:
    """How each replica opens its engine and app (picklable: Ray ships it to every replica)."""

    store: str
    model: str | None = None
    dtype: str = "bf16"
    device: str = "cpu"
    kv_dtype: str = "auto"  # CacheConfig.kv_dtype
    memory_bytes: int | None = None  # each replica's memory tiers (None: the store's default)
    model_name: str | None = None
    host: str = "127.0.0.1"  # where the server listens: Ray's sockets in each replica bind there too
    # ServeConfig's fields; left out of the repr, which would show the API key
    serve_config: dict[str, Any] = field(default_factory=dict, repr=False)


WILDCARDS = ("0.0.0.0", "::", "")  # hosts meaning every interface


def bind_internal_grpc(host: str) -> None:
    """Ray Serve starts an inter-deployment gRPC server in every replica on "[::]:0" - every
    interface - whatever the HTTP proxy's host (ray/serve/_private/replica.py, Ray 2.60). In
    this replica's process (call it from the deployment's __init__, which runs before that
    server starts), bind it to `host` instead; a wildcard host leaves Ray's choice. The Ray
    processes' own servers follow the node address (serve/cli.py sets it to the host)."""
    if host in WILDCARDS:
        return
    from ray.serve._private import replica as ray_replica

    add = getattr(ray_replica, "add_port_to_grpc_server", None)
    if add is None:  # another Ray than the one this was written for: the slow test's socket check says so
        log.warning("qcfuse serve: cannot bind Ray Serve's replica gRPC server to %s (Ray changed)", host)
        return
    if getattr(add, "qcfuse_host", None) == host:
        return
    inner = getattr(add, "__wrapped__", add)
    where = f"[{host}]" if ":" in host else host

    def bound(server: Any, address: str) -> Any:
        if address.startswith("[::]:"):
            address = f"{where}:{address[len('[::]:') :]}"
        return inner(server, address)

    bound.qcfuse_host = host  # type: ignore[attr-defined]
    bound.__wrapped__ = inner  # type: ignore[attr-defined]
    ray_replica.add_port_to_grpc_server = bound


# ---------------------------------------------------------------------------- the router


class ChunkAffinityRouter(RequestRouter):
    """Ranks replicas by the request's chunks they hold in memory, less their load.

        score(replica) = chunks of the request it holds - load_weight * chunks * requests in flight

    A replica holds a chunk when its last report says so, or when a request with that chunk
    is in flight there or completed within `recent_s` (its next report shows it). Requests in flight
    are this router's own count (routed, not yet completed). One request in flight costs
    `load_weight` of the request's chunks: a replica holding every chunk but busier by
    1 / load_weight requests loses to an idle one holding none. So requests go where their
    chunks are while the load is even, unrelated requests spread by load, and each replica's
    memory ends up holding its own part of the corpus. Equal scores: Ray Serve takes the
    shortest queue.

    The request's best replica is noted when it is chosen, so requests routed at the same
    moment see each other's load; Ray Serve tries the best first and the others, by score,
    only when its queue is full."""

    def initialize_state(self, load_weight: float = 0.2, recent_s: float = 2 * ROUTING_STATS_PERIOD_S, **kwargs: Any):
        if load_weight < 0 or recent_s <= 0:
            raise ValueError(f"need load_weight >= 0 and recent_s > 0, got {load_weight}, {recent_s}")
        self.load_weight, self.recent_s = load_weight, recent_s
        self._where: dict[str, tuple[ReplicaID, frozenset[str]]] = {}  # request in flight -> replica, keys
        self._done: dict[ReplicaID, OrderedDict[str, float]] = {}  # keys of requests completed lately -> when

    def _held(self, replica: RunningReplica, now: float) -> set[str]:
        """Its last report, the keys of its requests in flight (being loaded there) and of
        those completed within `recent_s` (its next report will show them)."""
        stats = replica.routing_stats or {}
        held = set(stats.get("resident", ()))
        for where, keys in self._where.values():
            if where == replica.replica_id:
                held |= keys
        done = self._done.get(replica.replica_id)
        if done:
            while done and next(iter(done.values())) < now - self.recent_s:
                done.popitem(last=False)
            held.update(done)
        return held

    def in_flight(self, replica_id: ReplicaID) -> int:
        return sum(1 for where, _ in self._where.values() if where == replica_id)

    def _note(self, pending_request: PendingRequest | None, replica_id: ReplicaID, keys: set[str]) -> None:
        """`pending_request` goes (or went) to `replica_id`."""
        rid = _request_id(pending_request)
        if rid is not None:
            self._where[rid] = (replica_id, frozenset(keys))

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """The best replica alone first (noted at once: requests routed at the same moment see
        each other's load), then the rest by score."""
        keys = routing_keys(pending_request)
        if not keys or len(candidate_replicas) < 2:
            return [candidate_replicas]  # Ray Serve takes the shortest queue among them
        rid = _request_id(pending_request)
        if rid is not None:
            self._where.pop(rid, None)  # a retry of this request: its own slot and keys do not count
        now, cost = time.monotonic(), self.load_weight * len(keys)
        flight = {r.replica_id: self.in_flight(r.replica_id) for r in candidate_replicas}
        score = {r.replica_id: len(keys & self._held(r, now)) - cost * flight[r.replica_id] for r in candidate_replicas}
        order = sorted(candidate_replicas, key=lambda r: (-score[r.replica_id], flight[r.replica_id], random.random()))
        self._note(pending_request, order[0].replica_id, keys)
        return [[order[0]], order[1:]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._note(pending_request, replica_id, routing_keys(pending_request))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        where = self._where.pop(internal_request_id, None)
        if where is not None and where[1]:
            done = self._done.setdefault(where[0], OrderedDict())
            now = time.monotonic()
            for k in where[1]:
                done.pop(k, None)
                done[k] = now
            while len(done) > MAX_REMEMBERED:
                done.popitem(last=False)
        super().on_request_completed(replica_id, internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self._done.pop(replica_id, None)
        self._where = {k: w for k, w in self._where.items() if w[0] != replica_id}
        super().on_replica_actor_died(replica_id)


def _request_id(pending_request: PendingRequest | None) -> str | None:
    return getattr(getattr(pending_request, "metadata", None), "internal_request_id", None)


def routing_keys(pending_request: PendingRequest | None) -> set[str]:
    if pending_request is None or not pending_request.args:
        return set()
    # by its fields, not isinstance: Ray may ship the ingress's code by value, so its Forwarded
    # can be another class object than this module's
    keys = getattr(pending_request.args[0], "keys", None)
    return {k for k in keys if isinstance(k, str)} if isinstance(keys, tuple) else set()


# ---------------------------------------------------------------------------- the replica


class EngineReplica:
    """One engine and its OpenAI app; `forward` runs one HTTP request through the app."""

    def __init__(self, options: ReplicaOptions) -> None:
        from qcfuse_core.engine.api import open_engine
        from qcfuse_core.engine.config import CacheConfig, EngineConfig
        from qcfuse_core.serve.app import ServeConfig, create_app

        bind_internal_grpc(options.host)
        self.engine = open_engine(
            options.store,
            model=options.model,
            dtype=options.dtype,
            device=options.device,
            memory_bytes=options.memory_bytes,
            config=EngineConfig(
                cache=CacheConfig(promote_disk_reads=True, kv_dtype=options.kv_dtype)
            ),  # chunks read from disk stay in this replica's memory
        )
        self.app = create_app(
            self.engine, model_name=options.model_name, config=ServeConfig(**options.serve_config), owns_engine=False
        )
        self.name = serve.get_replica_context().replica_id.to_full_id_str()
        self._known: OrderedDict[str, Any] = OrderedDict()  # text key -> ChunkKey
        self._closed = False

    def _chunk_keys(self, fwd: Forwarded) -> list[Any]:
        """The chunk keys behind the request's routing keys. The body is parsed and its texts
        found and tokenized only when a routing key is new to this replica."""
        if any(k not in self._known for k in fwd.keys):
            try:
                texts = request_texts(self.engine.caches.texts, fwd.path, json.loads(fwd.body))
            except ValueError:
                texts = []
            for t in texts:
                k = text_key(t)
                ck = self._known.get(k) or self.engine.caches.chunk_tokens(t)[1]
                if ck is not None:
                    self._known[k] = ck
        keys = []
        for k in fwd.keys:
            if k in self._known:
                self._known.move_to_end(k)
                keys.append(self._known[k])
        while len(self._known) > MAX_REMEMBERED:
            self._known.popitem(last=False)
        return keys

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve polls this: the text keys of the chunks this replica holds in memory."""
        s = self.engine.stats().scheduler
        resident = [k for k, ck in list(self._known.items()) if self.engine.caches.store.in_memory(ck)]
        return {"resident": resident, "running": s.running, "waiting": s.waiting}

    def check_health(self) -> None:
        if self._closed:
            raise RuntimeError("the replica's engine is closed")

    async def forward(self, fwd: Forwarded) -> AsyncIterator[dict[str, Any] | bytes]:
        """Yields {status, headers} once, then the body's bytes as the app sends them."""
        held = sum(self.engine.caches.store.in_memory(k) for k in self._chunk_keys(fwd))
        extra = [
            (REPLICA_HEADER.encode(), self.name.encode()),
            (RESIDENT_HEADER.encode(), f"{held}/{len(fwd.keys)}".encode()),
        ]
        async for part in asgi_call(self.app, fwd):
            if isinstance(part, dict):
                part = {**part, "headers": [*part["headers"], *extra]}
            yield part

    def __del__(self) -> None:  # Ray Serve calls it on a graceful replica shutdown
        if not getattr(self, "_closed", True):
            self._closed = True
            self.engine.close()


async def asgi_call(app: Any, fwd: Forwarded) -> AsyncIterator[dict[str, Any] | bytes]:
    """Run one request through an ASGI app in this process: {status, headers}, then the body
    in the pieces the app sends. Closing the iterator early is a client disconnect (the app
    sees http.disconnect and its task is cancelled)."""
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": fwd.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await out.put(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": fwd.method,
        "scheme": "http",
        "path": fwd.path,
        "raw_path": fwd.path.encode(),
        "root_path": "",
        "query_string": fwd.query,
        "headers": list(fwd.headers),
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    task = asyncio.ensure_future(app(scope, receive, send))
    try:
        while True:
            getter = asyncio.ensure_future(out.get())
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                if out.empty():
                    task.result()  # the app's own exception, if it raised
                    return
                continue
            msg = getter.result()
            if msg["type"] == "http.response.start":
                yield {"status": msg["status"], "headers": [tuple(h) for h in msg.get("headers", ())]}
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield bytes(msg["body"])
                if not msg.get("more_body", False):
                    return
    finally:
        gone.set()
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 - the app's cancellation, expected here
                pass


# ---------------------------------------------------------------------------- the ingress


class Ingress:
    """The HTTP entry: forwards every request to a replica chosen by the router."""

    def __init__(
        self, replicas: DeploymentHandle, store: str, max_body_bytes: int = 1 << 20, host: str = "127.0.0.1"
    ) -> None:
        bind_internal_grpc(host)
        self.replicas = replicas
        self.index = ChunkTextIndex(Path(store) / "chunk_texts.sqlite", read_only=False)
        self.max_body_bytes = max_body_bytes

    async def __call__(self, request: Request) -> Response:
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > self.max_body_bytes:
                msg = f"request body over this server's limit of {self.max_body_bytes} bytes"
                return JSONResponse(error_body(msg, "invalid_request_error", 413), status_code=413)
        path = request.url.path
        try:
            keys = tuple(dict.fromkeys(text_key(t) for t in request_texts(self.index, path, json.loads(body))))
        except (ValueError, UnicodeDecodeError):
            keys = ()
        fwd = Forwarded(
            request.method,
            path,
            request.url.query.encode(),
            tuple((k.lower(), v) for k, v in request.headers.raw),
            bytes(body),
            keys,
        )
        gen: DeploymentResponseGenerator = self.replicas.forward.options(stream=True).remote(fwd)  # type: ignore[assignment]
        try:
            head = await gen.__anext__()
        except Exception as e:  # noqa: BLE001 - the replica died or could not be reached
            log.warning("qcfuse serve: replica failed before answering: %r", e)
            msg = f"the replica serving this request failed before answering ({type(e).__name__}); retry"
            return JSONResponse(error_body(msg, "server_error", 503), status_code=503)
        headers = {k.decode(): v.decode() for k, v in head["headers"] if k.lower() != b"content-length"}
        sse = headers.get("content-type", "").startswith("text/event-stream")

        async def relay() -> AsyncIterator[bytes]:
            finished = False
            try:
                async for part in gen:
                    yield part
                finished = True
            except Exception as e:  # noqa: BLE001 - the replica died mid-answer
                log.warning("qcfuse serve: replica failed mid-stream: %r", e)
                if sse:
                    msg = f"the replica serving this stream failed ({type(e).__name__}); the answer is incomplete"
                    yield f"data: {json.dumps(error_body(msg, 'server_error', 503))}\n\n".encode()
            finally:
                if not finished:
                    gen.cancel()

        return StreamingResponse(relay(), status_code=head["status"], headers=headers)


# ---------------------------------------------------------------------------- the application


def build_app(
    options: ReplicaOptions,
    *,
    replicas: int = 2,
    router: str = "affinity",
    cpus_per_replica: float = 1.0,
    gpus_per_replica: float = 0.0,
    max_ongoing_requests: int = 64,
    load_weight: float = 0.2,
) -> Any:
    """The Ray Serve application: `serve.run(build_app(...), route_prefix="/")`.
    router: "affinity" (ChunkAffinityRouter) or "default" (Ray Serve's power of two choices)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if router not in ("affinity", "default"):
        raise ValueError(f"router must be 'affinity' or 'default', got {router!r}")
    if cpus_per_replica < 0 or gpus_per_replica < 0 or max_ongoing_requests < 1:
        raise ValueError("cpus_per_replica and gpus_per_replica must be >= 0, max_ongoing_requests >= 1")
    routing: dict[str, Any] = {"request_routing_stats_period_s": ROUTING_STATS_PERIOD_S}
    if router == "affinity":
        routing |= {
            "request_router_class": f"{__name__}:{ChunkAffinityRouter.__name__}",
            "request_router_kwargs": {"load_weight": load_weight},
        }
    deployment: Any = serve.deployment  # Ray's stubs type only its decorator form
    engines = deployment(
        EngineReplica,
        name="EngineReplica",
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica},
        request_router_config=routing,
        health_check_period_s=5,
    ).bind(options)
    max_body = int(options.serve_config.get("max_body_bytes", 1 << 20))
    ingress = deployment(Ingress, name="Ingress", max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0}).bind(
        engines, options.store, max_body, options.host
    )
    return ingress
