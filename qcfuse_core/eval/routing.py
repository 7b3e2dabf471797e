"""`qcfuse bench routing`: chunk-affinity routing against Ray Serve's default router, both in
one run, on N replicas over one store folder (serve/replicas.py).

    qcfuse bench routing [--model NAME|DIR] [--replicas 2] [--pool-chunks 50]
                         [--chunks-per-request 10] [--chunk-words 20] [--requests 40]
                         [--clients 4] [--memory-chunks 25] [--markdown F] [--json F]

The pool's chunks are built once, in this process, into a fresh store folder (its disk tier
and text index are what every replica opens). Then, for each router, a fresh deployment
(empty memory tiers, each holding `--memory-chunks` chunks' worth) answers the same replayed
mix over HTTP: each request draws `--topic-share` of its chunks from one of `--topics` groups
of the pool and the rest from the whole pool (seeded: both routers see the same requests in
the same order). Measured per request, by the replica that answers it: how many of the
request's chunks were in its memory tiers on arrival (`x-qcfuse-memory-chunks`); the others
are read from the shared disk tier. Reported per router: the memory-tier hit rate, requests
per replica, the server's TTFT and the client's end-to-end time (p50, p99).
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

TIMED = "POST /v1/completions through Ray Serve's proxy (serve/replicas.py), one request at a time per client"
WORDS = (
    "harbour ledger copper tide signal orchard lantern quarry beacon meadow granite ferry archive "
    "compass timber furnace glacier canal mill vessel pasture cellar bridge chapel tower market"
).split()


def pool_texts(n: int, seed: int, words: int = 60) -> list[str]:
    """n distinct chunk texts of about `words` words each (seeded)."""
    rng = random.Random(seed)
    return [f"Record {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "." for i in range(n)]


def mix(pool: int, per_request: int, topics: int, topic_share: float, n: int, seed: int) -> list[list[int]]:
    """n requests, each `per_request` distinct pool indices: round(topic_share * per_request)
    from one topic (a contiguous group of the pool), the rest from anywhere else."""
    if not 1 <= per_request <= pool or not 1 <= topics <= pool or not 0 <= topic_share <= 1:
        raise ValueError(f"need 1 <= per_request, topics <= pool and 0 <= topic_share <= 1; got {locals()}")
    rng = random.Random(seed)
    groups = [list(range(pool))[t::topics] for t in range(topics)]
    out = []
    for _ in range(n):
        group = rng.choice(groups)
        k = min(len(group), round(topic_share * per_request))
        picked = rng.sample(group, k)
        rest = [i for i in range(pool) if i not in picked]
        picked += rng.sample(rest, per_request - k)
        out.append(picked)
    return out


def prompt_of(texts: list[str], question: str) -> str:
    return "Context:\n" + "\n\n".join(texts) + f"\n\nQuestion: {question}\nAnswer:"


def replay(
    url: str,
    prompts: list[str],
    clients: int,
    max_tokens: int,
    timeout_s: float = 300.0,
    api_key: str | None = None,
) -> list[dict[str, Any]]:
    """Each prompt once as a non-streamed /v1/completions (greedy, EOS ignored), `clients`
    at a time, in order -> one row per request (replica, chunks held in memory, timings)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def one(i: int, client: httpx.Client) -> dict[str, Any]:
        body = {  # no "model": the server's own (an id it does not serve is a 404)
            "prompt": prompts[i],
            "max_tokens": max_tokens,
            "temperature": 0,
            "qcfuse": {"ignore_eos": True},
        }
        t0 = time.perf_counter()
        r = client.post(f"{url}/v1/completions", json=body, headers=headers)
        e2e = (time.perf_counter() - t0) * 1e3
        if r.status_code != 200:
            return {"i": i, "status": r.status_code, "error": r.text[:300], "e2e_ms": e2e}
        held, total = (int(x) for x in r.headers["x-qcfuse-memory-chunks"].split("/"))
        stats = r.json()["qcfuse"]
        return {
            "i": i,
            "status": 200,
            "replica": r.headers["x-qcfuse-replica"],
            "held": held,
            "chunks": total,
            "cache_hits": stats["cache_hits"],
            "cache_misses": stats["cache_misses"],
            "ttft_ms": stats["ttft_ms"],
            "e2e_ms": e2e,
        }

    with httpx.Client(timeout=timeout_s) as client, ThreadPoolExecutor(clients) as pool:
        return list(pool.map(lambda i: one(i, client), range(len(prompts))))


def summarise(router: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    from qcfuse_core.eval.load import percentile

    ok = [r for r in rows if r["status"] == 200]
    chunks = sum(r["chunks"] for r in ok)

    def pct(xs: list[float], q: int) -> float:
        return percentile(xs, q) or 0.0

    return {
        "router": router,
        "requests": len(rows),
        "errors": len(rows) - len(ok),
        "chunk_lookups": chunks,
        "memory_hits": sum(r["held"] for r in ok),
        "memory_hit_rate": sum(r["held"] for r in ok) / chunks if chunks else 0.0,
        "cache_misses": sum(r["cache_misses"] for r in ok),
        "per_replica": sorted(Counter(r["replica"] for r in ok).values(), reverse=True),
        "ttft_p50_ms": pct([r["ttft_ms"] for r in ok], 50),
        "ttft_p99_ms": pct([r["ttft_ms"] for r in ok], 99),
        "e2e_p50_ms": pct([r["e2e_ms"] for r in ok], 50),
        "e2e_p99_ms": pct([r["e2e_ms"] for r in ok], 99),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| router | requests | errors | memory-tier hit rate | chunks from disk | requests per replica "
        "| TTFT p50 / p99 (ms) | end to end p50 / p99 (ms) |\n|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r['router']} | {r['requests']} | {r['errors']} | {r['memory_hit_rate']:.1%} "
        f"({r['memory_hits']}/{r['chunk_lookups']}) | {r['chunk_lookups'] - r['memory_hits']} "
        f"| {' / '.join(map(str, r['per_replica']))} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} "
        f"| {r['e2e_p50_ms']:.0f} / {r['e2e_p99_ms']:.0f} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def build_pool(store: Path, texts: list[str], model: str | None, dtype: str) -> int:
    """Build the pool's caches into `store` (disk tier + text index) -> mean bytes of an entry
    in memory (the chunks are of nearly one length)."""
    from qcfuse_core.engine.api import open_engine

    with open_engine(store, model=model, dtype=dtype) as engine:
        engine.build_chunks(texts, [f"pool-{i}" for i in range(len(texts))])
        host = engine.caches.store.stats()["tiers"]["host"]
        if host["entries"] != len(texts):
            raise RuntimeError(
                f"the pool does not fit the builder's memory tier ({host['entries']} of {len(texts)} chunks)"
            )
        return -(-host["bytes_used"] // host["entries"])


def wait_ready(url: str, timeout_s: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s")


def run(args, progress: Callable[[str], None] = lambda line: None) -> list[dict[str, Any]]:
    import ray
    from ray import serve

    from qcfuse_core.serve.replicas import ReplicaOptions, build_app

    store = Path(args.store) if args.store else Path(tempfile.mkdtemp(prefix="qcfuse-routing-"))
    texts = pool_texts(args.pool_chunks, args.seed, words=args.chunk_words)
    t0 = time.perf_counter()
    entry = build_pool(store, texts, args.model, args.dtype)
    progress(f"built {len(texts)} chunks ({entry / 2**20:.2f} MiB each) in {time.perf_counter() - t0:.1f} s")
    draws = mix(args.pool_chunks, args.chunks_per_request, args.topics, args.topic_share, args.requests, args.seed)
    prompts = [prompt_of([texts[i] for i in d], f"What does record {d[0]} say?") for d in draws]
    options = ReplicaOptions(
        store=str(store.resolve()),
        model=args.model,
        dtype=args.dtype,
        memory_bytes=args.memory_chunks * entry,
        serve_config={"default_max_tokens": args.max_tokens},
    )
    url = f"http://127.0.0.1:{args.port}"
    ray.init(num_cpus=max(2, args.replicas + 1), include_dashboard=False, log_to_driver=False)
    out = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        for router in ("default", "affinity"):
            t0 = time.perf_counter()
            serve.run(build_app(options, replicas=args.replicas, router=router), name="qcfuse", route_prefix="/")
            wait_ready(url)
            progress(f"{router}: {args.replicas} replicas up in {time.perf_counter() - t0:.1f} s; replaying")
            rows = replay(url, prompts, args.clients, args.max_tokens)
            out.append(summarise(router, rows))
            progress(json.dumps(out[-1]))
            serve.delete("qcfuse")
    finally:
        serve.shutdown()
        ray.shutdown()
    return out


def add_commands(sub) -> None:
    from qcfuse_core.eval.workload import add_report_options, bench_subparsers, positive_int

    p = bench_subparsers(sub).add_parser(
        "routing", help="chunk-affinity routing vs Ray Serve's default router, N replicas (needs qcfuse[ray])"
    )
    p.add_argument("--model", default=None, help="packaged model or HF folder (default: the embedded one)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="weights' dtype")
    p.add_argument("--replicas", type=positive_int, default=2, help="engine replicas behind each router")
    p.add_argument("--pool-chunks", type=positive_int, default=50, help="chunks in the pool requests draw from")
    p.add_argument("--chunks-per-request", type=positive_int, default=10, help="chunks in each request's context")
    p.add_argument("--chunk-words", type=positive_int, default=20, help="words per pool chunk (about 1.7 tokens each)")
    p.add_argument("--topics", type=positive_int, default=5, help="groups of the pool a request draws most chunks from")
    p.add_argument("--topic-share", type=float, default=0.8, help="share of a request's chunks from its topic")
    p.add_argument("--requests", type=positive_int, default=40, help="requests replayed per router")
    p.add_argument("--clients", type=positive_int, default=4, help="concurrent clients")
    p.add_argument("--max-tokens", type=positive_int, default=4, help="tokens per answer (EOS ignored)")
    p.add_argument("--memory-chunks", type=positive_int, default=25, help="each replica's memory tiers, in pool chunks")
    p.add_argument("--port", type=int, default=8000, help="Ray Serve's HTTP port on 127.0.0.1")
    p.add_argument("--store", default=None, help="store folder (default: a new temp folder)")
    p.add_argument("--seed", type=int, default=0, help="seed of the pool and the request mix")
    add_report_options(p, threads=False)
    p.set_defaults(func=cmd_routing)


def cmd_routing(args) -> int:
    import sys

    from qcfuse_core.eval.workload import write_json

    rows = run(args, lambda line: print(line, file=sys.stderr, flush=True))
    md = markdown(rows)
    print(md)
    write_json(args, rows, TIMED)
    if args.markdown:
        Path(args.markdown).write_text(md + "\n")
    return 0
