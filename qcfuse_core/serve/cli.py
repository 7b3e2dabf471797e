"""`qcfuse serve`: the OpenAI-compatible server over a store and a model.

    qcfuse serve --store DIR [--model NAME|DIR] [--host 127.0.0.1] [--port 8000]

Binds to 127.0.0.1 unless --host says otherwise. Point any OpenAI client at
http://HOST:PORT/v1 (LangChain's ChatOpenAI base_url, LlamaIndex's OpenAILike api_base).
With --api-key (repeatable; or QCFUSE_API_KEY in the environment) every /v1/ route needs
`Authorization: Bearer KEY`, and each key is a tenant of its own: what the server learns
from one key's prompts is never served to another (--tenant-by, docs/serving.md). A request whose Host is not the address it came in on or a
localhost name (DNS rebinding) gets a 403, and so does a POST from another site's page
(its Origin): --allowed-host and --allowed-origin name more (docs/serving.md).

Shutdown (SIGTERM, Ctrl-C): uvicorn stops accepting, lets running requests finish for up to
--shutdown-timeout-s and cancels the rest (a cancelled stream aborts its engine request);
then the app's shutdown stops the scheduler and closes the store; the process exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qcfuse_core.cli.flags import above, at_least, port, share
from qcfuse_core.engine.audit import DEFAULT_FIDELITY

DEFAULT_PORT = 8000
BACKLOG = 2048  # uvicorn's default
API_KEY_ENV = "QCFUSE_API_KEY"
DEFAULT_MAX_PROMPT_TOKENS = 32768  # also the cap of a model's own context, when it has one


def add_commands(sub) -> None:
    from qcfuse_core.paths import cache_dir

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine (needs qcfuse[serve])")
    p.add_argument("--store", type=Path, default=cache_dir() / "store", help="store folder (default: %(default)s)")
    _model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=port, default=DEFAULT_PORT, help="port (default: %(default)s; 0: any free one)")
    p.add_argument("--max-tokens", type=at_least(1), default=4096, help="the most tokens a request may ask for")
    p.add_argument(
        "--max-prompt-tokens",
        type=at_least(1),
        default=None,
        help=f"the longest prompt in tokens (default: the model's context, at most {DEFAULT_MAX_PROMPT_TOKENS})",
    )
    p.add_argument(
        "--max-documents",
        type=at_least(1),
        default=64,
        help="the most documents or node ids a request may name in `qcfuse`",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every /v1/ route; repeatable: any of the keys, each its own "
        f"tenant (--tenant-by key) (default: ${API_KEY_ENV} if set, else none)",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name clients may use besides the server's address and localhost (repeatable; '*.example.com' "
        "for subdomains; '*': any, behind a proxy that checks it)",
    )
    p.add_argument(
        "--allowed-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a browser origin (https://app.example) whose pages may POST here (repeatable)",
    )
    p.add_argument(
        "--shutdown-timeout-s",
        type=at_least(0),
        default=10,
        help="on SIGTERM, how long running requests may finish before they are cancelled (default: %(default)s)",
    )
    p.add_argument(
        "--fidelity",
        type=share,
        nargs="?",
        const=DEFAULT_FIDELITY,
        default=None,
        metavar="AGREEMENT",
        help="the answer-token agreement with full prefill wanted: requests that name no ratio get the "
        "cheapest configuration this deployment's audit shows meets it, a conservative one until it has "
        f"evidence, full prefill where none does (engine/audit.py); --fidelity alone: {DEFAULT_FIDELITY:g}, "
        'what a fixed ratio of 0.5 reaches on a QA set (docs/benchmarks.md, "Fidelity") '
        "(default: none, the fixed ratio)",
    )
    _learning_options(p)
    _replica_options(p)
    p.set_defaults(func=cmd_serve)


def _model_options(p) -> None:
    """The model the server runs: a packaged or local one, or a named shape (benchmarks)."""
    p.add_argument(
        "--model",
        default=None,
        metavar="NAME|DIR",
        help="a packaged model (smollm2-135m, gemma3-270m) or a local HF model folder (default: the embedded "
        "SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--model-name", default=None, help="the model id clients send and /v1/models lists (default: the model's name)"
    )
    p.add_argument(
        "--shape",
        default=None,
        help="benchmarks: instead of --model, random weights of a named shape (e.g. llama-3.1-8b, seed 0) with a "
        "byte-level tokenizer - the model `qcfuse bench load --shape` runs in process",
    )
    p.add_argument(
        "--host-bytes",
        type=_bytes,
        default=None,
        metavar="BYTES",
        help="with --shape: the host tier's size (e.g. 36e9; default: from available RAM), as `bench load` takes it",
    )
    p.add_argument(
        "--gpu-chunk-bytes",
        type=_bytes,
        default=None,
        metavar="BYTES",
        help="with --shape: at most this much chunk cache on the GPU (default: what the engine's GPU budget leaves)",
    )
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="model dtype")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda")
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=["auto", "fp8"],
        help="the running requests' KV caches: auto, the model's dtype; fp8, e4m3 with a scale per token and KV "
        "head (half the bytes a decode step reads; CacheConfig.kv_dtype)",
    )


def _learning_options(p) -> None:
    """Chunks learned from prompts (qcfuse_core/learn.py) and whose they are (docs/serving.md)."""
    g = p.add_argument_group("learned chunks and tenants")
    g.add_argument(
        "--learn-after",
        type=at_least(0, "0: learn nothing"),
        default=1,
        metavar="N",
        help="learn chunks from prompts: build a context span's cache once it has been seen N times, served "
        "from then on (0: learn nothing; docs/serving.md) (default: %(default)s)",
    )
    g.add_argument(
        "--max-learned",
        type=at_least(1),
        default=4096,
        help="the most learned chunk texts kept; past it the tenant holding most gives up its least recently used "
        "one (default: %(default)s)",
    )
    g.add_argument(
        "--max-learned-bytes",
        type=_bytes,
        default=None,
        metavar="BYTES",
        help="the most bytes learned caches keep (e.g. 2G), the same way (default: a quarter of the store's disk "
        "limit, which is half of what the store holds plus the disk's free space)",
    )
    g.add_argument(
        "--tenant-max-pending",
        type=at_least(1),
        default=64,
        metavar="N",
        help="the most learned spans one tenant may have waiting for their build; past it its own new ones are "
        "dropped, never another tenant's (of 256 in all) (default: %(default)s)",
    )
    g.add_argument(
        "--tenant-max-learned-bytes",
        type=_bytes,
        default=None,
        metavar="BYTES",
        help="the most bytes of learned caches one tenant keeps while another tenant holds learned chunks too "
        "(default: half of --max-learned-bytes)",
    )
    g.add_argument(
        "--learn-system-prompts",
        action="store_true",
        help="also learn and serve the context spans of system messages (default: only user and tool messages)",
    )
    g.add_argument(
        "--tenant-by",
        default="key",
        choices=["key", "user", "salt", "none"],
        help="whose learned chunks a request sees: those learned from requests with its API key, its OpenAI `user` "
        "field, its `cache_salt` field (as vLLM's), or everyone's (none); without --api-key, `key` is none "
        "(docs/serving.md, multi-tenant) (default: %(default)s)",
    )


def _replica_options(p) -> None:
    ray = p.add_argument_group("replicas on Ray Serve (needs qcfuse[ray])")
    ray.add_argument(
        "--replicas",
        type=at_least(0, "0: one engine in this process"),
        default=0,
        help="run N engine replicas on Ray Serve over this one store folder, behind Ray Serve's HTTP proxy on "
        "--host:--port (default: one engine in this process)",
    )
    ray.add_argument(
        "--router",
        default="affinity",
        choices=["affinity", "default"],
        help="affinity: send a request to the replica holding most of its chunks in memory; default: Ray Serve's "
        "power of two choices (default: %(default)s)",
    )
    ray.add_argument(
        "--cpus-per-replica", type=above(0), default=1.0, help="Ray CPUs per replica (default: %(default)s)"
    )
    ray.add_argument(
        "--gpus-per-replica",
        type=above(0, or_equal=True),
        default=None,
        help="GPUs per replica, a fraction to share one (default: 1 with --device cuda, else 0)",
    )
    ray.add_argument(
        "--memory-mb",
        type=at_least(1),
        default=None,
        help="each replica's host tier in MiB (default: 1/N of the host's share of available RAM, store/sizing.py)",
    )


def learn_config(args):
    """The learning policy --learn-after, --max-learned, --max-learned-bytes, the tenants'
    quotas and --learn-system-prompts ask for (qcfuse_core/learn.py)."""
    from qcfuse_core.learn import LearnConfig

    if args.learn_after < 0:
        raise ValueError(f"--learn-after must be >= 0 (0: learn nothing), got {args.learn_after}")
    if args.learn_after == 0:
        return LearnConfig(enabled=False)
    return LearnConfig(
        after=args.learn_after,
        max_learned=args.max_learned,
        max_bytes=getattr(args, "max_learned_bytes", None) or None,
        tenant_pending=getattr(args, "tenant_max_pending", LearnConfig.tenant_pending),
        tenant_bytes=getattr(args, "tenant_max_learned_bytes", None) or None,
        system=getattr(args, "learn_system_prompts", False),
    )


def _bytes(text: str) -> int:
    from qcfuse_core.cli.store import parse_bytes

    return parse_bytes(text)


def api_keys(args) -> tuple[str, ...] | None:
    """The keys of --api-key (repeatable), else $QCFUSE_API_KEY; None: no auth."""
    keys = tuple(args.api_key or ()) or tuple(k for k in [os.environ.get(API_KEY_ENV)] if k)
    return keys or None


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free one)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port") from None
    sock.listen(BACKLOG)
    return sock


def run_server(app, sock: socket.socket, shutdown_timeout_s: int = 10) -> None:
    """uvicorn over `app` on `sock` until SIGTERM or SIGINT; returns once the app has shut
    down (running requests finished or, after `shutdown_timeout_s`, cancelled)."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that a stop by SIGTERM or SIGINT is a clean exit: uvicorn
        re-raises the signal once it has shut down, so the process would end by it (status
        -15, or a KeyboardInterrupt) after a shutdown that went well."""

        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                self._captured_signals.clear()

    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=shutdown_timeout_s)
    Server(config).run(sockets=[sock])


def cmd_serve(args) -> int:
    from qcfuse_core.serve import require_extra

    require_extra()
    from qcfuse_core.engine.api import open_engine
    from qcfuse_core.engine.config import CacheConfig, EngineConfig
    from qcfuse_core.serve.app import ServeConfig, create_app

    api_key = api_keys(args)
    if args.shape and (args.model is not None or args.replicas):
        raise ValueError("--shape replaces --model, and runs one engine (no --replicas)")
    if not args.shape and (args.host_bytes is not None or args.gpu_chunk_bytes is not None):
        raise ValueError("--host-bytes and --gpu-chunk-bytes size the tiers of a --shape server (benchmarks)")
    if args.replicas:
        return serve_replicas(args, api_key)
    config = ServeConfig(  # checked now, before the model loads; the prompt limit once it has
        max_tokens=args.max_tokens,
        default_max_tokens=min(256, args.max_tokens),
        max_prompt_tokens=args.max_prompt_tokens or DEFAULT_MAX_PROMPT_TOKENS,
        max_documents=args.max_documents,
        api_key=api_key,
        allowed_hosts=tuple(args.allowed_host),
        allowed_origins=tuple(args.allowed_origin),
        learning=learn_config(args),
        tenant_by=args.tenant_by,
    )
    sock = listen(args.host, args.port)
    what = f"a random {args.shape}" if args.shape else args.model or "the embedded model"
    print(f"qcfuse serve: loading {what} and opening {args.store}", flush=True)
    engine_config = EngineConfig(  # a chunk read from disk stays in memory
        cache=CacheConfig(promote_disk_reads=True, kv_dtype=args.kv_dtype), fidelity=args.fidelity or None
    )
    if args.shape:
        engine = _shaped_engine(args, engine_config)
    else:
        engine = open_engine(args.store, model=args.model, dtype=args.dtype, device=args.device, config=engine_config)
    if not args.max_prompt_tokens:  # the model's context, at most DEFAULT_MAX_PROMPT_TOKENS
        context = min(engine.adapter.max_positions or DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_MAX_PROMPT_TOKENS)
        config = dataclasses.replace(config, max_prompt_tokens=context)
    app = create_app(engine, model_name=args.model_name, config=config, owns_engine=True)
    port = sock.getsockname()[1]
    print(
        f"QCFuse serving {app.state.model_ids.public} on http://{args.host}:{port}/v1 "
        f"({len(engine.caches.texts)} chunk texts in {args.store}; {'bearer auth on' if api_key else 'no auth'}; "
        "Ctrl-C stops it)",
        flush=True,
    )
    run_server(app, sock, args.shutdown_timeout_s)
    return 0


def _shaped_engine(args, config):
    """`--shape`: an engine over random weights of a named shape (seed 0, the byte-level
    tokenizer; what `qcfuse bench load --shape` builds in process) and the store folder."""
    from qcfuse_core.engine.api import QCFuseEngine
    from qcfuse_core.eval.workload import build_adapter
    from qcfuse_core.retrieval.texts import ChunkTextIndex
    from qcfuse_core.store import kv_dir, open_store

    shape = argparse.Namespace(shape=args.shape, model=None, dtype=args.dtype, device=args.device, seed=0)
    adapter = build_adapter(shape)
    root = Path(args.store)
    root.mkdir(parents=True, exist_ok=True)
    store = open_store(
        kv_dir(root),
        use_cuda=adapter.device.type == "cuda",
        memory_bytes=args.host_bytes,
        gpu_bytes=args.gpu_chunk_bytes,
    )
    return QCFuseEngine(adapter, store=store, config=config, text_index=ChunkTextIndex(root / "chunk_texts.sqlite"))


def serve_replicas(args, api_key: tuple[str, ...] | None) -> int:
    """`qcfuse serve --replicas N`: the Ray Serve application (serve/replicas.py) on a local Ray
    cluster, until SIGTERM or SIGINT; then Ray Serve stops the replicas (each closes its store)
    and every process the Ray cluster started is gone within --shutdown-timeout-s (`_stop_ray`).

    Contained: with a loopback --host every socket of the cluster binds to the loopback
    interface - the HTTP proxy, the GCS, the raylet, the agents, each worker's gRPC server
    (`_contain_ray`: the node's address is the loopback one) and each replica's
    inter-deployment gRPC server (replicas.bind_internal_grpc); the dashboard is off."""
    import signal
    import threading

    node = _contain_ray(args.host)  # before Ray is imported: it reads its settings then
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ImportError("qcfuse serve --replicas needs Ray Serve: pip install 'qcfuse[ray]'") from None
    from qcfuse_core.serve.replicas import ReplicaOptions, build_app
    from qcfuse_core.store.sizing import HOST_SHARE, host_tier_bytes

    if args.replicas < 1 or not 1 <= args.port <= 65535:
        raise ValueError(f"--replicas must be >= 1 and --port in [1, 65535], got {args.replicas}, {args.port}")
    if args.memory_mb is not None and args.memory_mb < 1:
        raise ValueError(f"--memory-mb must be >= 1, got {args.memory_mb}")
    gpus = args.gpus_per_replica if args.gpus_per_replica is not None else float(args.device.startswith("cuda"))
    options = ReplicaOptions(
        store=str(Path(args.store).resolve()),
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_dtype=args.kv_dtype,
        memory_bytes=(  # the replicas share the host's RAM: each sizes its host tier from 1/N of the share
            host_tier_bytes(share=HOST_SHARE / args.replicas) if args.memory_mb is None else args.memory_mb << 20
        ),
        model_name=args.model_name,
        host=args.host,
        serve_config={
            "max_tokens": args.max_tokens,
            "default_max_tokens": min(256, args.max_tokens),
            "max_prompt_tokens": args.max_prompt_tokens or DEFAULT_MAX_PROMPT_TOKENS,
            "max_documents": args.max_documents,
            "api_key": api_key,
            "allowed_hosts": tuple(args.allowed_host),
            "allowed_origins": tuple(args.allowed_origin),
            "learning": learn_config(args),
            "tenant_by": args.tenant_by,
        },
    )
    Path(options.store).mkdir(parents=True, exist_ok=True)
    ray.init(
        num_cpus=max(os.cpu_count() or 1, int(args.replicas * args.cpus_per_replica) + 1),
        include_dashboard=False,
        logging_level=logging.WARNING,
        **node,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which sets a SIGTERM handler of its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        # Serve's own INFO lines (each replica started or stopped, each request) stay in Ray's logs
        serve.start(http_options={"host": args.host, "port": args.port}, logging_config={"log_level": "WARNING"})
        print(f"qcfuse serve: starting {args.replicas} replicas over {options.store} on Ray Serve", flush=True)
        app = build_app(
            options,
            replicas=args.replicas,
            router=args.router,
            cpus_per_replica=args.cpus_per_replica,
            gpus_per_replica=gpus,
        )
        serve.run(app, name="qcfuse", route_prefix="/")
        print(
            f"QCFuse serving {args.replicas} replicas ({args.router} routing) on http://{args.host}:{args.port}/v1 "
            f"({'bearer auth on' if api_key else 'no auth'}; Ctrl-C stops it)",
            flush=True,
        )
        stop.wait()
    finally:
        _stop_ray(args.replicas, args.shutdown_timeout_s)
    return 0


def _contain_ray(host: str) -> dict:
    """Ray's settings for a cluster whose sockets bind where `host` says -> ray.init's keywords.
    A loopback host: Ray takes the loopback address as the node's (its local-only mode, the
    one it uses on macOS and Windows), so the GCS, the raylet, the agents and the workers bind
    to it; the environment carries that to every process Ray starts. Another specific host
    is the node's address; a wildcard leaves Ray's own choice."""
    import ipaddress

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # ray_constants.ENABLE_RAY_CLUSTER: local only
        return {}
    return {} if host in ("0.0.0.0", "::", "") else {"_node_ip_address": host}


def _stop_ray(replicas: int, timeout_s: float) -> None:
    """Stop Ray Serve and the Ray cluster this process started, then make sure that every
    process of it is gone within `timeout_s` (plus a last few seconds for a kill): Ray's agents
    (DashboardAgent, RuntimeEnvAgent) can outlive `ray.shutdown()`. One line says what
    happened."""
    import time

    import psutil  # ray's own dependency
    import ray
    from ray import serve

    t0 = time.monotonic()
    procs = psutil.Process().children(recursive=True)  # taken now: the agents are the raylet's children
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
    _, alive = psutil.wait_procs(procs, timeout=max(0.0, timeout_s - (time.monotonic() - t0)))
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    _, left = psutil.wait_procs(alive, timeout=5)
    killed = f"; {len(alive) - len(left)} killed after {timeout_s:g} s" if alive else ""
    still = f"; {len(left)} still running: {sorted(p.pid for p in left)}" if left else ""
    print(
        f"qcfuse serve: stopped {replicas} replicas and {len(procs)} Ray processes in "
        f"{time.monotonic() - t0:.1f} s{killed}{still}",
        flush=True,
    )
