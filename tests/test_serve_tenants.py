"""Issue 62: learned chunks no client can turn against another. Each row of the issue's table
is a test here, over real HTTP on 127.0.0.1 (uvicorn in a thread, the tiny random fp32 model
with a byte tokenizer), the second tenant a second `user` value or a second API key:

    N-L5b  the disk and the learned caches are bounded in bytes; registered chunks stay
    N-L1   one tenant's prompts never change another's answers; within a tenant a span is
           served only as a whole context paragraph, never in a system prompt or a question
    N-L6   the `qcfuse` field and `cached_tokens` name and count only the tenant's own reuse
    N-L4   one tenant's flood never evicts another's learned chunks

Every wait is bounded and on an event.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import httpx
import pytest

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.learn import LEARNED_SHARE, ChunkLearner, LearnConfig, is_learned, learned_id
from qcfuse_core.model.testing import tiny_model
from qcfuse_core.retrieval.texts import ChunkTextIndex
from qcfuse_core.serve.app import ServeConfig, create_app
from qcfuse_core.store import MemoryStore, kv_dir, open_store, sizing
from tests.qc_fixtures import TEMPLATE, LiveServer, _metric, _run, _wait, ledger, tiny  # noqa: F401  (fixture)

NEW = 6
MODEL = "tiny-tenants"
TIMEOUT_S = 60.0


def para(i: int, topic: str = "harbour") -> str:
    return ledger(i, topic)


@contextmanager
def serving(tiny, store=None, text_index=None, **config):
    """A live server over a fresh engine (nothing registered); tenants by `user` unless
    `config` says otherwise."""
    engine = QCFuseEngine(tiny, store=store or MemoryStore(), text_index=text_index)
    server = LiveServer(create_app(engine, model_name=MODEL, config=ServeConfig(**{"tenant_by": "user", **config})))
    server.learner, server.engine = server.server.config.app.state.learner, engine
    try:
        yield server
    finally:
        server.close()
        engine.close()


def chat(live, messages: list[dict], *, user: str | None = None, key: str | None = None, **extra) -> dict:
    """One chat request at temperature 0 -> the response body (after the learner's builds)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": NEW, "temperature": 0, **extra}
    if user is not None:
        body["user"] = user
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    res = httpx.post(live.url + "/v1/chat/completions", json=body, headers=headers, timeout=TIMEOUT_S)
    assert live.learner.wait(TIMEOUT_S)
    return res.json() | {"status": res.status_code}


def context(*paragraphs: str, question: str = "which ledger?") -> list[dict]:
    return [{"role": "user", "content": "Context:\n" + "\n\n".join(paragraphs) + f"\n\nQuestion: {question}"}]


def learned(r: dict) -> list[str]:
    return [i for i in r["qcfuse"]["chunk_ids"] if is_learned(i)]


def seen_by_the_client(r: dict) -> tuple:
    """What a response tells its client about reuse: the text, chunks, hits, cached tokens."""
    q = r["qcfuse"]
    return (r["choices"][0]["message"]["content"], q["chunks"], q["chunk_ids"], q["cache_hits"], q["cache_misses"],
            r["usage"]["prompt_tokens_details"]["cached_tokens"])  # fmt: skip


# ---------------------------------------------------------------------------- N-L6


@pytest.mark.parametrize("by", ["user", "key"])
def test_n_l6_learned_chunks_are_named_and_counted_only_to_their_tenant(tiny, by):
    """Alice's paragraph, learned, is served to her from its cache; Bob, sending the same
    prompt, sees what a server that never saw Alice would show him: no learned id, no hit,
    no cached token. Naming the learned id is a 400, as for an id that does not exist."""
    doc = para(1)
    msgs = context(doc)
    alice, bob = (dict(user="alice"), dict(user="bob")) if by == "user" else (dict(key="ka"), dict(key="kb"))
    config = {} if by == "user" else dict(tenant_by="key", api_key=("ka", "kb"))
    with serving(tiny, **config) as live:
        first = chat(live, msgs, **alice)  # her first sighting: computed, then built
        again = chat(live, msgs, **alice)
        assert learned(again) == [learned_id(doc)] and again["qcfuse"]["cache_hits"] == 1
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        other = chat(live, msgs, **bob)
        assert seen_by_the_client(other) == seen_by_the_client(first)  # as if Alice had never sent it
        named = chat(live, msgs, **bob, qcfuse={"node_ids": [learned_id(doc)]})
        unknown = chat(live, msgs, **bob, qcfuse={"node_ids": ["learned:0000000000000000"]})
        assert named["status"] == unknown["status"] == 400
        assert named["error"]["message"].replace(learned_id(doc), "ID") == unknown["error"]["message"].replace(
            "learned:0000000000000000", "ID"
        )


def test_n_l6_named_documents_and_the_prefix_are_cached_per_tenant(tiny):
    """A document named in `qcfuse.documents` (not registered) and the system prompt before it
    are cached under their tenant's salt: Alice's second request is served from her caches,
    while Bob, sending the same, sees what a server that never saw Alice would show him -
    no hit, no cached token (his own request builds them)."""
    doc = para(7)
    msgs = [{"role": "system", "content": "You keep the harbour ledgers. " * 3}, *context(doc)]
    named = {"qcfuse": {"documents": [doc]}}
    with serving(tiny, tenant_by="key", api_key=("ka", "kb")) as live:
        first = chat(live, msgs, key="ka", **named)
        again = chat(live, msgs, key="ka", **named)
        assert again["qcfuse"]["cache_hits"] == 1 and first["qcfuse"]["cache_hits"] == 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        other = chat(live, msgs, key="kb", **named)
        assert seen_by_the_client(other) == seen_by_the_client(first)  # as if Alice had never sent it
        assert chat(live, msgs, key="kb", **named)["qcfuse"]["cache_hits"] == 1  # now his own


def test_tenants_and_their_fields(tiny):
    """--tenant-by salt goes by vLLM's cache_salt; another mode refuses a cache_salt (it would
    not separate anything); `user` must be a string."""
    doc = para(2)
    with serving(tiny, tenant_by="salt") as live:
        chat(live, context(doc), cache_salt="s1")
        assert learned(chat(live, context(doc), cache_salt="s1")) == [learned_id(doc)]
        assert learned(chat(live, context(doc), cache_salt="s2")) == []
        assert learned(chat(live, context(doc))) == []  # no salt: the shared tenant
    with serving(tiny, tenant_by="user") as live:
        refused = chat(live, context(doc), cache_salt="s1")
        assert refused["status"] == 400 and refused["error"]["param"] == "cache_salt"
        assert "--tenant-by salt" in refused["error"]["message"]
        assert chat(live, context(doc), user=7)["status"] == 400
    with serving(tiny, tenant_by="none") as live:  # every request alike: what was learned is everyone's
        chat(live, context(doc), user="alice")
        assert learned(chat(live, context(doc), user="bob")) == [learned_id(doc)]
    with pytest.raises(ValueError, match="tenant_by"):
        ServeConfig(tenant_by="ip")


# ---------------------------------------------------------------------------- N-L1


def test_n_l1_one_tenant_cannot_change_anothers_answers(tiny):
    """Alice pastes Bob's questions and his system prompt as context paragraphs, twice. Bob's
    answers and statistics are then those of a server that never saw Alice."""
    system = "You are the archivist of the northern harbour; answer from the ledgers and cite the ledger number."
    questions = [f"In the ledger of the {t}, how many barrels of salt herring were landed, and by whom?"
                 for t in ("harbour", "fjord", "island")]  # fmt: skip

    def bob(live) -> list[tuple]:
        got = []
        for i, q in enumerate(questions):
            msgs = [{"role": "system", "content": system}, *context(para(10 + i, "fjord"), question=q)]
            got.append(seen_by_the_client(chat(live, msgs, user="bob")))
        return got

    with serving(tiny) as quiet:
        want = bob(quiet)
    with serving(tiny) as live:
        for _ in range(2):
            last = chat(live, context(*questions, system), user="alice")
        assert len(learned(last)) == 4  # learned, and served to her as context paragraphs
        assert bob(live) == want


def test_n_l1_within_a_tenant_spans_are_served_only_as_context_paragraphs(tiny):
    """What Alice learned from context paragraphs is served to her only as a whole paragraph of
    a user message: never inside her system prompt, her question or a longer paragraph."""
    a, b, c = para(20), para(21), para(22)
    with serving(tiny) as live:
        for _ in range(2):
            chat(live, context(a, b, c), user="alice")
        placed = [{"role": "system", "content": a}, *context("Note: " + b, para(23), question=c)]
        r = chat(live, placed, user="alice")
        assert learned(r) == []  # a in the system prompt, b inside a paragraph, c the question
        assert learned(chat(live, context(a, question="which?"), user="alice")) == [learned_id(a)]
        # the same text in the system prompt and as a context paragraph: the engine locates a
        # chunk at its first occurrence, in the system prompt - so it is not served at all
        r = chat(live, [{"role": "system", "content": a}, *context(a, question="which?")], user="alice")
        assert learned(r) == []
    with serving(tiny, learning=LearnConfig(system=True)) as live:  # the operator opts system prompts in
        for _ in range(2):
            r = chat(live, [{"role": "system", "content": a}, *context(b, question="which?")], user="alice")
        assert learned(r) == [learned_id(a), learned_id(b)]


# ---------------------------------------------------------------------------- N-L4


@pytest.mark.parametrize("bound", ["texts", "bytes"])
def test_n_l4_one_tenant_cannot_evict_anothers(tiny, bound):
    """Bob's learned paragraph survives Alice's flood of new ones: past the bound the tenant
    holding most gives up its least recently used texts (here Alice, always)."""
    victim = para(30, "fjord")
    entry = 2 * 3 * 2 * 16 * 4  # bytes per token of the tiny model's cache: K and V, 3 layers, 2 heads of 16, fp32
    cfg = LearnConfig(max_learned=8) if bound == "texts" else LearnConfig(max_bytes=8 * len(victim) * entry)
    with serving(tiny, learning=cfg) as live:
        chat(live, context(victim), user="bob")
        assert learned(chat(live, context(victim), user="bob")) == [learned_id(victim)]
        for r in range(3):
            chat(live, context(*(para(100 + 4 * r + i) for i in range(4))), user="alice")
        kept = chat(live, context(victim), user="bob")
        assert learned(kept) == [learned_id(victim)] and kept["qcfuse"]["cache_hits"] == 1
        s = live.learner.stats()
        assert s.evicted >= 12 + 1 - 8 and s.tenants == 2
        assert (s.learned <= 8) if bound == "texts" else (s.bytes <= live.learner.max_bytes)


# ---------------------------------------------------------------------------- N-L3


def _prompt(*docs: str) -> str:
    return "Context:\n" + "\n\n".join(docs) + "\n\nQuestion: which?"


def _observe(learner: ChunkLearner, tenant: str, *docs: str) -> int:
    """`tenant` sends `docs` as one prompt's context -> the spans queued for a build."""
    prompt = _prompt(*docs)
    return learner.observe(prompt, [prompt], [], tenant)


def _served(learner: ChunkLearner, tenant: str, *docs: str) -> list[str | None]:
    """The learned ids `tenant` is served in a prompt of `docs`."""
    prompt = _prompt(*docs)
    return [c.node_id for c in learner.pieces(prompt, [prompt], [], tenant)]


def test_n_l3_a_tenants_pending_builds_stop_at_its_quota(tiny):
    """Alice has at most `tenant_pending` spans waiting for their build: past it her own new
    spans are dropped, Bob's are queued and then served to him. (Idle work queued first holds
    the builds back, so they are all still waiting when counted.)"""
    engine = QCFuseEngine(tiny, store=MemoryStore())
    learner = ChunkLearner(engine, LearnConfig(max_pending=8, tenant_pending=3))
    gate = threading.Event()
    engine._scheduler.submit_idle(lambda: gate.wait(TIMEOUT_S))
    bobs = [para(300), para(301)]
    try:
        assert _observe(learner, "alice", *(para(200 + i) for i in range(4))) == 3
        assert _observe(learner, "alice", para(204), para(205)) == 0
        assert _observe(learner, "bob", *bobs) == 2
        s = learner.stats()
        assert (s.dropped, s.pending) == (3, 5)
    finally:
        gate.set()
    try:
        assert learner.wait(TIMEOUT_S)
        assert _served(learner, "bob", *bobs) == [learned_id(d) for d in bobs]
        assert learner.stats().builds == 5
    finally:
        learner.close()
        engine.close()


def test_n_l3_builds_run_tenant_by_tenant_in_turn(tiny):
    """Alice's three prompts queue three builds, then Bob's one: Bob's runs after at most one
    of Alice's waiting builds (not after all of hers), Alice's in her order. Counted in the
    order the builds reach the engine, the first one held until all are queued."""
    engine = QCFuseEngine(tiny, store=MemoryStore())
    learner = ChunkLearner(engine, LearnConfig(max_pending=16, tenant_pending=8))
    gate, order, build = threading.Event(), [], engine.build_chunks

    def building(texts, **kw):
        order.append(texts[0])
        gate.wait(TIMEOUT_S)
        return build(texts, **kw)

    engine.build_chunks = building
    alices, bobs = [para(400 + i) for i in range(4)], [para(500)]
    try:
        for doc in alices:
            assert _observe(learner, "alice", doc) == 1
        assert _observe(learner, "bob", *bobs) == 1
    finally:
        gate.set()
    try:
        assert learner.wait(TIMEOUT_S)
        assert order.index(bobs[0]) <= 2  # behind the build under way and at most one of Alice's
        assert [d for d in order if d in alices] == alices
        assert learner.stats().builds == 5
    finally:
        learner.close()
        engine.close()


def test_n_l3_a_tenants_learned_bytes_stop_at_its_quota_beside_another(tiny):
    """Alone, Alice keeps all she learned; once Bob learns too, she keeps `tenant_bytes` at
    most (giving up her least recently used text), and Bob keeps his."""
    docs = [para(200 + i) for i in range(4)]  # the same length: the same bytes each
    probe = QCFuseEngine(tiny, store=MemoryStore())
    each = probe.caches.store.stored_bytes(probe.build_chunks(docs[:1])[0])
    probe.close()
    engine = QCFuseEngine(tiny, store=MemoryStore())
    learner = ChunkLearner(engine, LearnConfig(tenant_bytes=int(2.5 * each)))
    try:
        assert learner.tenant_bytes == int(2.5 * each)
        assert _observe(learner, "alice", *docs[:3]) == 3 and learner.wait(TIMEOUT_S)
        assert (learner.stats().learned, learner.stats().evicted) == (3, 0)  # alone: past her quota, kept
        assert _observe(learner, "bob", docs[3]) == 1 and learner.wait(TIMEOUT_S)
        assert _served(learner, "alice", *docs[:3]) == [learned_id(d) for d in docs[1:3]]
        assert _served(learner, "bob", docs[3]) == [learned_id(docs[3])]
        s = learner.stats()
        assert (s.learned, s.evicted, s.bytes) == (3, 1, 3 * each)
    finally:
        learner.close()
        engine.close()
    with pytest.raises(ValueError, match="tenant_pending"):
        LearnConfig(tenant_pending=0)
    with pytest.raises(ValueError, match="tenant_bytes"):
        LearnConfig(tenant_bytes=0)


def _timed_chat(url: str, key: str, docs: list[str]) -> dict:
    """One chat request, not waiting for the learner -> its `qcfuse` statistics."""
    body = {"model": MODEL, "messages": context(*docs), "max_tokens": NEW, "temperature": 0}
    res = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                     timeout=TIMEOUT_S)  # fmt: skip
    assert res.status_code == 200, res.text
    return res.json()["qcfuse"]


BOBS = [[para(500 + 2 * i, "fjord"), para(501 + 2 * i, "fjord")] for i in range(8)]


def _flood(live, until: Callable[[], bool]) -> tuple[list[float], list[float]]:
    """Bob's TTFTs (ms) quiet (BOBS[:4]), then while Alice floods the server with unique
    paragraphs from two clients (BOBS[4:], once `until()`: all first sightings)."""
    quiet = [_timed_chat(live.url, "kb", docs)["ttft_ms"] for docs in BOBS[:4]]
    assert live.learner is None or live.learner.wait(TIMEOUT_S)

    def flood(offset: int) -> None:
        for r in range(20):
            _timed_chat(live.url, "ka", [para(1000 + offset + 3 * r + i, "delta") for i in range(3)])

    threads = [threading.Thread(target=flood, args=(o,)) for o in (0, 500)]
    for t in threads:
        t.start()
    try:
        _wait(until, TIMEOUT_S)
        flooded = [_timed_chat(live.url, "kb", docs)["ttft_ms"] for docs in BOBS[4:]]
    finally:
        for t in threads:
            t.join(TIMEOUT_S)
    return quiet, flooded


@pytest.mark.slow
def test_n_l3_a_flood_from_one_tenant_drops_none_of_anothers_spans(tiny, record_property):
    """Alice floods the server while Bob sends his own paragraphs (first sightings). Alice's
    spans past her quota are dropped; none of Bob's: once the flood is over and the builds
    are done, every paragraph Bob sent is served to him from its cache. Bob's TTFT under the
    flood against his quiet figure, learning on and off, is recorded, not asserted (timings)."""
    ratios = {}
    with serving(tiny, learning=LearnConfig(enabled=False), tenant_by="key", api_key=("ka", "kb")) as live:
        started = time.monotonic()
        quiet, flooded = _flood(live, lambda: time.monotonic() > started + 0.2)
        ratios["off"] = statistics.median(flooded) / statistics.median(quiet)
    cfg = LearnConfig(max_pending=48, tenant_pending=12)
    with serving(tiny, learning=cfg, tenant_by="key", api_key=("ka", "kb")) as live:
        quiet, flooded = _flood(live, lambda: live.learner.stats().dropped > 0)  # Alice is past her quota
        assert live.learner.wait(TIMEOUT_S)
        s = live.learner.stats()
        assert s.dropped > 0 and s.failed == 0
        for docs in BOBS:
            served = _timed_chat(live.url, "kb", docs)
            assert served["cache_hits"] == 2 and learned({"qcfuse": served}) == [learned_id(d) for d in docs]
        ratios["on"] = statistics.median(flooded) / statistics.median(quiet)
    for k, v in ratios.items():
        record_property(f"bob_ttft_flood_over_quiet_learning_{k}", round(v, 2))
    print(f"N-L3: Bob's median TTFT under the flood over his quiet one: {ratios['on']:.2f}x learning on, "
          f"{ratios['off']:.2f}x off; {s.dropped} of Alice's spans dropped")  # fmt: skip


# ---------------------------------------------------------------------------- N-L5b


def test_n_l5b_the_disk_and_the_learned_caches_are_bounded_in_bytes(tiny, tmp_path, monkeypatch, capsys):
    """A store on a disk with FREE bytes free: its disk tier is bounded by default (DISK_SHARE
    of it), learned caches by LEARNED_SHARE of that. A flood of unique prompts leaves both
    within their bounds and every registered chunk stored; `store stats` and /metrics show the
    learned bytes."""
    free = 4 << 20
    monkeypatch.setattr(sizing, "free_disk", lambda path: free)
    store = open_store(kv_dir(tmp_path), use_cuda=False)
    cap = store.disk_capacity()
    assert cap == int(sizing.DISK_SHARE * free)
    index = ChunkTextIndex(tmp_path / "chunk_texts.sqlite")
    registered = [para(i, "archive") for i in range(2)]
    with serving(tiny, store=store, text_index=index) as live:
        res = httpx.post(live.url + "/v1/chunks", json={"texts": registered, "ids": ["r0", "r1"]}, timeout=TIMEOUT_S)
        assert res.status_code == 200
        assert live.learner.max_bytes == int(LEARNED_SHARE * cap)
        for r in range(24):  # ~4 MB of caches, twice the disk's bound
            chat(live, context(para(1000 + 2 * r), para(1001 + 2 * r)), user="mallory")
        s = live.learner.stats()
        disk = store.stats()["tiers"]["disk"]
        assert disk["bytes_used"] <= cap and 0 < s.bytes <= live.learner.max_bytes and s.evicted > 0
        assert all(live.engine.caches.is_stored(t) for t in registered)
        metrics = httpx.get(live.url + "/metrics", timeout=TIMEOUT_S).text
        assert _metric(metrics, "qcfuse_learned_bytes") == s.bytes
        assert _metric(metrics, "qcfuse_learned_max_bytes") == live.learner.max_bytes
        code, out, _ = _run(capsys, "stats", "--store", str(tmp_path), "--json")
        assert (
            code == 0 and json.loads(out)["learned_bytes"] == s.bytes and json.loads(out)["learned_texts"] == s.learned
        )


def test_a_learner_started_again_keeps_each_tenants_texts_apart(tiny, tmp_path):
    """The tenants of learned texts are written down beside them (the chunk-text index's file):
    over the same folder, a new learner serves Alice's text to Alice only."""
    doc = para(40)
    prompt = f"Context:\n{doc}\n\nQuestion: which?"
    engine = QCFuseEngine(tiny, store=MemoryStore(), text_index=ChunkTextIndex(tmp_path / "chunk_texts.sqlite"))
    try:
        learner = ChunkLearner(engine)
        assert learner.observe(prompt, [prompt], [], tenant="alice") == 1 and learner.wait(TIMEOUT_S)
        learner.close()
        again = ChunkLearner(engine)
        found = engine.caches.texts.find(prompt)  # the index finds it by content: the learner decides
        assert [p.node_id for p in again.pieces(prompt, [prompt], found, tenant="alice")] == [learned_id(doc)]
        assert again.pieces(prompt, [prompt], found, tenant="bob") == again.pieces(prompt, [prompt], found) == []
        assert (again.stats().learned, again.stats().tenants) == (1, 1)
        again.close()
    finally:
        engine.close()
