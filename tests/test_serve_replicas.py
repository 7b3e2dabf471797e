"""Scale-out on Ray Serve (qcfuse_core/serve/replicas.py, eval/routing.py).

The parts on their own: which chunk texts a request carries, the router's ranking on stand-in
replicas, the replayed mix, one request through the app in process (ASGI). Then a live Ray
cluster on this machine with the embedded model: two replicas over one store folder - a chunk
built through one is a hit on the other; chunk-affinity routing against Ray Serve's default
router on the same replayed mix, both in one run; a replica killed mid-stream fails that
stream with a clear error while the other keeps serving, and the store verifies clean.
Servers bind to 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray", reason="the Ray tests need the `ray` extra (ray[serve]); requirements.lock pins it")
from ray.serve._private.common import DeploymentID, ReplicaID  # noqa: E402

from qcfuse_core import DEFAULT_MODEL_NAME  # noqa: E402  (the id the replicas serve the embedded model as)
from qcfuse_core.engine.api import QCFuseEngine  # noqa: E402
from qcfuse_core.eval.routing import mix, pool_texts, prompt_of, replay, summarise  # noqa: E402
from qcfuse_core.model.testing import tiny_model  # noqa: E402
from qcfuse_core.retrieval.texts import ChunkTextIndex  # noqa: E402
from qcfuse_core.serve.app import create_app  # noqa: E402
from qcfuse_core.serve.replicas import (  # noqa: E402
    RESIDENT_HEADER,
    ChunkAffinityRouter,
    Forwarded,
    asgi_call,
    request_texts,
    routing_keys,
    text_key,
)
from qcfuse_core.store import MemoryStore  # noqa: E402

TEXTS = [f"Passage {i} tells of the harbour, the ledger and the copper tide, line {i}." for i in range(4)]


# ---------------------------------------------------------------------------- the parts


def test_request_texts_are_the_chunks_the_replica_will_find():
    index = ChunkTextIndex()
    for t in TEXTS:
        index.add(t)
    prompt = f"Context:\n{TEXTS[2]}\n\n{TEXTS[0]}\nQuestion: ?"
    assert request_texts(index, "/v1/completions", {"prompt": prompt}) == [TEXTS[2], TEXTS[0]]
    assert request_texts(index, "/v1/completions", {"prompt": [prompt, TEXTS[3]]}) == [TEXTS[2], TEXTS[0], TEXTS[3]]
    chat = {"messages": [{"role": "system", "content": TEXTS[1]}, {"role": "user", "content": [
        {"type": "text", "text": TEXTS[3]}, {"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert request_texts(index, "/v1/chat/completions", chat) == [TEXTS[1], TEXTS[3]]
    named = {"prompt": prompt, "qcfuse": {"documents": ["not registered but named", 7]}}
    assert request_texts(index, "/v1/completions", named) == ["not registered but named"]
    assert request_texts(index, "/v1/chunks", {"texts": ["a", "b", None]}) == ["a", "b"]
    for junk in (None, [], "text", {"prompt": 3}, {"messages": "no"}, {"messages": [3, {"content": 4}]}):
        assert request_texts(index, "/v1/completions", junk) == []
    assert text_key(TEXTS[0]) == text_key(TEXTS[0]) != text_key(TEXTS[1]) and len(text_key("x")) == 16
    assert text_key("\ud800 lone surrogate")  # any str a JSON body can hold has a key


def test_replica_options_never_show_the_api_key():
    from qcfuse_core.serve.replicas import ReplicaOptions

    opts = ReplicaOptions(store="s", serve_config={"api_key": "sk-secret-123"})
    assert "sk-secret-123" not in repr(opts) and opts.serve_config["api_key"] == "sk-secret-123"


def _replica(name: str, resident=()):
    rid = ReplicaID(unique_id=name, deployment_id=DeploymentID(name="EngineReplica", app_name="qcfuse"))
    return SimpleNamespace(replica_id=rid, routing_stats={"resident": list(resident)})


def _pending(keys, rid: str | None = None):
    fwd = Forwarded("POST", "/v1/completions", b"", (), b"{}", tuple(keys))
    return SimpleNamespace(args=[fwd], kwargs={}, metadata=SimpleNamespace(internal_request_id=rid))


def _router(**kw) -> ChunkAffinityRouter:
    router = ChunkAffinityRouter.__new__(ChunkAffinityRouter)  # the state only: no Ray runtime needed
    router.initialize_state(**kw)
    return router


def _choose(router, replicas, pending) -> list[list[str]]:
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_the_router_prefers_held_chunks_and_weighs_load():
    keys = [text_key(t) for t in TEXTS]
    a, b, c = _replica("a", keys[:1]), _replica("b", keys[:3]), _replica("c")
    router = _router(load_weight=0.3)
    assert _choose(router, [a, b, c], _pending(keys[:3], "r1")) == [["b"], ["a", "c"]]
    assert router.in_flight(b.replica_id) == 1  # noted when chosen: a request routed at once sees it
    # r2 wants the same chunks: b holds 3, costs 0.3 * 3 = 0.9 per request in flight -> still b
    assert _choose(router, [a, b, c], _pending(keys[:3], "r2"))[0] == ["b"]
    # with r1, r2 in flight b scores 3 - 1.8 = 1.2 against a's 1 - 0 ... and with r3 too, 0.3
    assert _choose(router, [a, b, c], _pending(keys[:3], "r3"))[0] == ["b"]
    assert _choose(router, [a, b, c], _pending(keys[:3], "r4"))[0] == ["a"]  # b: 3 - 2.7 = 0.3 < a: 1
    router.on_request_completed(b.replica_id, "r1")
    router.on_request_completed(b.replica_id, "r2")
    assert router.in_flight(b.replica_id) == 1 and router.in_flight(a.replica_id) == 1
    # a request routed elsewhere than chosen moves its slot; a retry does not count itself
    router.on_request_routed(_pending(keys[:3], "r3"), c.replica_id, None)
    assert router.in_flight(c.replica_id) == 1 and router.in_flight(b.replica_id) == 0
    # the keys of a request in flight count as held where it runs (they are being loaded
    # there), and for recent_s after it completed (until the replica's next report)
    fresh = _router(load_weight=0.0, recent_s=0.2)
    x, y = _replica("x"), _replica("y")
    fresh.on_request_routed(_pending([keys[3]], "q1"), y.replica_id, None)
    assert _choose(fresh, [x, y], _pending([keys[3]], "q2"))[0] == ["y"]
    fresh.on_request_completed(y.replica_id, "q1")
    fresh.on_request_completed(y.replica_id, "q2")
    assert fresh.in_flight(y.replica_id) == 0 and fresh._held(y, time.monotonic()) == {keys[3]}
    time.sleep(0.3)
    assert fresh._held(y, time.monotonic()) == set()  # forgotten once recent_s has passed


def test_requests_without_chunks_go_to_the_shortest_queue():
    router = _router()
    reps = [_replica("a", ["k"]), _replica("b")]
    assert _choose(router, reps, _pending([], "r")) == [["a", "b"]]  # one rank: Ray Serve's queue choice
    assert _choose(router, reps, None) == [["a", "b"]]
    assert routing_keys(SimpleNamespace(args=[{"keys": ("k",)}])) == set()  # not a forwarded request
    with pytest.raises(ValueError):
        _router(load_weight=-1)


def test_the_replayed_mix():
    draws = mix(50, 10, 5, 0.7, 200, seed=3)
    assert draws == mix(50, 10, 5, 0.7, 200, seed=3) and draws != mix(50, 10, 5, 0.7, 200, seed=4)
    for d in draws:
        assert len(d) == len(set(d)) == 10 and all(0 <= i < 50 for i in d)
        topics = [sum(1 for i in d if i % 5 == t) for t in range(5)]
        assert max(topics) >= 7  # 7 of 10 from one topic (a residue class of the pool)
    with pytest.raises(ValueError):
        mix(5, 10, 2, 0.5, 1, 0)
    texts = pool_texts(50, 0, words=10)
    assert len(set(texts)) == 50 and prompt_of(texts[:2], "q?").count("Record") == 2


@pytest.fixture(scope="module")
def tiny_engine():
    adapter = tiny_model("llama", tokenizer=True)
    eng = QCFuseEngine(adapter, store=MemoryStore())
    eng.build_chunks(TEXTS)
    return eng


def _forwarded(body: dict, path="/v1/completions") -> Forwarded:
    return Forwarded("POST", path, b"", ((b"content-type", b"application/json"),), json.dumps(body).encode())


def test_one_request_through_the_app_in_process(tiny_engine):
    from fastapi.testclient import TestClient

    app = create_app(tiny_engine, model_name="tiny")
    body = {"model": "tiny", "prompt": prompt_of(TEXTS[:2], "which?"), "max_tokens": 6, "temperature": 0}

    async def run(b):
        return [p async for p in asgi_call(app, _forwarded(b))]

    parts = asyncio.run(run(body))
    assert parts[0]["status"] == 200 and all(isinstance(p, bytes) for p in parts[1:])
    got = json.loads(b"".join(parts[1:]))
    want = TestClient(app).post("/v1/completions", json=body).json()
    assert got["choices"] == want["choices"] and got["qcfuse"]["cache_hits"] == 2
    streamed = asyncio.run(run({**body, "stream": True}))
    text = b"".join(streamed[1:]).decode()
    assert text.rstrip().endswith("data: [DONE]")
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in text.split("\n\n")
                   if line.startswith("data: {")) == want["choices"][0]["text"]
    bad = asyncio.run(run({"model": "tiny", "prompt": 3}))
    assert bad[0]["status"] == 400 and "error" in json.loads(b"".join(bad[1:]))


def test_closing_the_stream_early_aborts_the_request(tiny_engine):
    app = create_app(tiny_engine, model_name="tiny")
    body = {"model": "tiny", "prompt": prompt_of(TEXTS[:2], "go"), "max_tokens": 400, "temperature": 0,
            "stream": True, "qcfuse": {"ignore_eos": True}}

    async def run():
        it = asgi_call(app, _forwarded(body))
        assert (await it.__anext__())["status"] == 200
        await it.__anext__()  # the first delta: the request is decoding
        await it.aclose()  # the client went away

    asyncio.run(run())
    end = time.monotonic() + 30
    while tiny_engine.stats().scheduler.running and time.monotonic() < end:
        time.sleep(0.05)
    assert tiny_engine.stats().scheduler.running == 0


# ---------------------------------------------------------------------------- on Ray Serve

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray cluster with Ray Serve's proxy on 127.0.0.1, and a store folder holding a
    pool of 50 chunks built in this process (the embedded model)."""
    from ray import serve

    from qcfuse_core.eval.routing import build_pool

    store = tmp_path_factory.mktemp("replicas-store")
    texts = pool_texts(50, seed=0, words=20)
    entry = build_pool(store, texts, None, "bf16")
    port = _free_port()
    # the replicas run what a user gets: conftest's TRITON_INTERPRET=1 (Triton's interpreter on
    # the CPU, far too slow for the embedded model) must not reach Ray's worker processes
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = before
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield SimpleNamespace(store=store, texts=texts, entry=entry, url=f"http://127.0.0.1:{port}")
    finally:
        serve.shutdown()
        ray.shutdown()


def _deploy(cluster, router: str, memory_chunks: int = 25) -> None:
    from ray import serve

    from qcfuse_core.eval.routing import wait_ready
    from qcfuse_core.serve.replicas import ReplicaOptions, build_app

    options = ReplicaOptions(
        store=str(cluster.store), memory_bytes=memory_chunks * cluster.entry, serve_config={"default_max_tokens": 4}
    )
    serve.run(build_app(options, replicas=2, router=router), name="qcfuse", route_prefix="/")
    wait_ready(cluster.url, timeout_s=240)


@pytest.mark.slow
def test_two_replicas_share_one_store(cluster):
    """A chunk built through one replica is a hit (no prefill: a disk read) on the other."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    _deploy(cluster, "default")
    new = "A chunk built through one replica only: the lighthouse keeper's log of the winter storms."
    with httpx.Client(base_url=cluster.url, timeout=180) as c:
        built = c.post("/v1/chunks", json={"texts": [new], "ids": ["log-1"]})
        assert built.status_code == 200, built.text
        builder = built.headers["x-qcfuse-replica"]
        body = {"model": DEFAULT_MODEL_NAME, "prompt": prompt_of([new, cluster.texts[0]], "what?"), "max_tokens": 2, "temperature": 0}
        answers = []
        for _ in range(3):  # rounds of 4 at once: Ray's router spreads them over both replicas
            with ThreadPoolExecutor(4) as pool:
                answers += list(pool.map(lambda _: c.post("/v1/completions", json=body), range(4)))
            if {r.headers["x-qcfuse-replica"] for r in answers} - {builder}:
                break
    for r in answers:
        assert r.status_code == 200, r.text
        stats = r.json()["qcfuse"]
        assert (stats["cache_hits"], stats["cache_misses"], stats["cache_built"]) == (2, 0, 0), stats
    others = [r for r in answers if r.headers["x-qcfuse-replica"] != builder]
    assert others, "every request went to the replica that built the chunk"


@pytest.mark.slow
def test_chunk_affinity_routing_beats_the_default_router(cluster):
    """The same replayed mix (pool of 50 chunks, 10 per request) on fresh replicas, default
    router then chunk affinity, both in this run; each replica's memory holds 25 chunks."""
    draws = mix(50, 10, topics=5, topic_share=0.8, n=48, seed=1)
    prompts = [prompt_of([cluster.texts[i] for i in d], f"What does record {d[0]} say?") for d in draws]
    out = {}
    for router in ("default", "affinity"):
        _deploy(cluster, router)
        out[router] = summarise(router, replay(cluster.url, prompts, clients=4, max_tokens=2))
        assert out[router]["errors"] == 0 and out[router]["cache_misses"] == 0, out[router]
        assert len(out[router]["per_replica"]) == 2  # both replicas served
    print(json.dumps(out, indent=1))
    assert out["affinity"]["memory_hit_rate"] > out["default"]["memory_hit_rate"], out


@pytest.mark.slow
def test_a_replica_killed_mid_stream(cluster):
    import openai

    _deploy(cluster, "affinity")
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0, timeout=120)
    prompt = prompt_of(cluster.texts[:3], "tell me everything")
    with client.completions.with_streaming_response.create(
        model=DEFAULT_MODEL_NAME, prompt=prompt, max_tokens=400, temperature=0, stream=True, extra_body={"qcfuse": {"ignore_eos": True}}
    ) as resp:
        victim = resp.headers["x-qcfuse-replica"]
        stream = resp.parse()
        first = next(iter(stream))
        assert first.choices[0].text is not None
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=False)
        with pytest.raises(openai.APIError, match="replica serving this stream failed"):
            for _ in stream:
                pass
    served = None
    end = time.monotonic() + 120
    while served is None and time.monotonic() < end:  # the other replica keeps serving
        try:
            r = client.completions.with_raw_response.create(model=DEFAULT_MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
            served = r.headers["x-qcfuse-replica"]
        except openai.APIStatusError as e:  # a 503 while the router learns of the death
            assert e.status_code == 503, e
            time.sleep(1)
    assert served is not None and served != victim


@pytest.mark.slow
def test_the_store_verifies_clean_after_the_replicas_stop(cluster):
    from ray import serve

    from qcfuse_core.cli.store import main as store_main

    serve.delete("qcfuse")  # every replica stops and closes its store
    report = cluster.store / "verify.json"
    with open(report, "w") as out, contextlib.redirect_stdout(out):
        store_main(["store", "verify", "--store", str(cluster.store), "--json"])
    got = json.loads(report.read_text())
    assert got["checked"] == got["ok"] >= 51 and not (got["bad"] or got["stale"] or got["orphans"] or got["unindexed"])
    assert got["dangling_links"] == 0 and not got["manifest"]["problem"]
    assert got["chunk_texts"]["present"] and not got["chunk_texts"]["problem"]
    # texts registered through /v1/chunks have no vector index (retrieval runs in the client's
    # framework): verify notes its absence, and finds nothing wrong
    assert not got["chroma"]["present"] and not got["chroma"]["problem"]
    assert any(n.startswith("no vector index") for n in got["notes"])
