"""The request pipeline (qcfuse_core/engine/request.py): one implementation, its steps, no state
left behind, stage timings that add up, and a hot path without per-request index queries."""

from __future__ import annotations

import json

import pytest
import torch

from qcfuse_core.cli.commands import main
from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.cache.prefetch import LoadSession
from qcfuse_core.store import kv_dir, open_store
from qcfuse_core.model.testing import tiny_model

DOCS = [f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(12)) for i in range(3)]
Q = "Which document mentions word1x3?"


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", tokenizer=True)


@pytest.fixture
def engine(tiny, tmp_path):
    eng = QCFuseEngine(tiny, store=open_store(kv_dir(tmp_path), use_cuda=False))
    eng.build_chunks(DOCS, [f"n{i}" for i in range(len(DOCS))])
    yield eng
    eng.caches.store.close()


@pytest.mark.parametrize("method", ["qcfuse", "cacheblend", "epic", "naive", "full"])
def test_stage_timings_add_up_to_the_ttft(engine, method):
    r = engine.answer(Q, DOCS, method=method, ratio=0.3, max_new_tokens=1)
    stages = {k: v for k, v in r.timings_ms.items() if k in
              ("queue_ms", "lookup_ms", "plan_ms", "load_start_ms", "select_ms", "prefill_ms", "first_token_ms")}
    assert len(stages) == 7, r.timings_ms  # queue_ms: the wait for the scheduler to admit it
    assert abs(sum(stages.values()) - r.ttft_ms) < 0.05, (stages, r.ttft_ms)
    assert all(v >= 0 for v in stages.values())


def test_a_request_after_a_failed_one_succeeds(engine, monkeypatch):
    want = engine.answer(Q, DOCS, method="qcfuse", ratio=0.3, max_new_tokens=6)
    real = LoadSession._load

    def broken(self, layer):
        raise OSError("disk went away")

    monkeypatch.setattr(LoadSession, "_load", broken)
    with pytest.raises(RuntimeError, match="prefetch failed"):
        engine.answer(Q, DOCS, method="qcfuse", ratio=0.3, max_new_tokens=6)
    monkeypatch.setattr(LoadSession, "_load", real)
    got = engine.answer(Q, DOCS, method="qcfuse", ratio=0.3, max_new_tokens=6)
    assert got.token_ids == want.token_ids
    assert got.cache_hits == 3 and got.cache_misses == 0
    assert len(engine.lookup.prefetcher._free) == 1  # every session gave its buffers back


def test_an_abandoned_stream_releases_its_session(engine):
    stream = engine.stream(Q, DOCS, method="naive", max_new_tokens=8)
    next(stream)
    stream.close()  # the caller walked away mid-answer: the request leaves the scheduler
    assert len(engine.lookup.prefetcher._free) == 1
    assert engine.answer(Q, DOCS, method="naive", max_new_tokens=2).cache_hits == 3


def test_hot_path_reads_no_index_and_tokenizes_chunks_once(engine, monkeypatch):
    """A warm request: no SQLite query, no critical-layer file lookup, chunk texts not tokenised again."""
    from qcfuse_core.selection import profiles as critical_layers
    from qcfuse_core.store import manifest

    engine.answer(Q, DOCS, node_ids=["n0", "n1", "n2"], method="qcfuse", ratio=0.3, max_new_tokens=1)  # warm
    calls = {"sql": 0, "lookup": 0, "tokenize": []}

    def count_sql(*a, **k):
        calls["sql"] += 1
        raise AssertionError("index query on the hot path")

    for name in ("_query", "transaction", "lookup", "lookup_sidecar", "count_and_bytes"):
        monkeypatch.setattr(manifest.Manifest, name, count_sql)
    monkeypatch.setattr(critical_layers, "lookup", lambda *a: calls.__setitem__("lookup", calls["lookup"] + 1))
    tok = engine.lookup.tokenize
    monkeypatch.setattr(engine.lookup, "tokenize", lambda text: calls["tokenize"].append(text) or tok(text))
    r = engine.answer(Q, DOCS, node_ids=["n0", "n1", "n2"], method="qcfuse", ratio=0.3, max_new_tokens=1)
    assert r.cache_hits == 3 and calls["sql"] == 0 and calls["lookup"] == 0
    assert not set(calls["tokenize"]) & set(DOCS)  # only glue and the question are tokenised
    assert r.store_stats["backend"] == "tiered"


def test_batched_ingestion_answers_like_one_by_one(tiny, tmp_path):
    one = QCFuseEngine(tiny, store=open_store(kv_dir(tmp_path / "one"), use_cuda=False))
    for d in DOCS:
        one.build_chunks([d])
    many = QCFuseEngine(tiny, store=open_store(kv_dir(tmp_path / "many"), use_cuda=False))
    keys = many.build_chunks(DOCS + DOCS[:1], ["a", "b", "c", "d"])  # a repeated text is stored once
    assert keys[0] == keys[3] and len(set(keys)) == 3
    for k in keys[:3]:
        a, b = one.caches.store.get(k), many.caches.store.get(k)
        torch.testing.assert_close(a.k, b.k, rtol=0, atol=1e-5)
        torch.testing.assert_close(a.v, b.v, rtol=0, atol=1e-5)
    assert many.caches.store.resolve("d") == keys[0]
    ra = one.answer(Q, DOCS, method="qcfuse", ratio=0.3, max_new_tokens=6)
    rb = many.answer(Q, DOCS, method="qcfuse", ratio=0.3, max_new_tokens=6)
    assert ra.token_ids == rb.token_ids and rb.cache_hits == 3
    with pytest.raises(ValueError, match="differ in length"):
        many.build_chunks(DOCS, ["x"])
    one.caches.store.close()
    many.caches.store.close()


def test_bench_ttft_times_engine_answer(tmp_path, monkeypatch, capsys):
    """Every timed figure comes from the public call: slow `engine.answer` down by a known
    amount and every row's minimum TTFT must carry it; count the calls."""
    import time

    delay_ms, calls = 40.0, []
    real = QCFuseEngine.answer

    def slow(self, *a, **k):
        calls.append(k.get("method"))
        time.sleep(delay_ms / 1e3)
        return real(self, *a, **k)

    monkeypatch.setattr(QCFuseEngine, "answer", slow)
    out = tmp_path / "ttft.json"
    rc = main(["bench", "ttft", "--shape", "tiny-llama", "--dtype", "fp32", "--context-sizes", "2x24", "3x16",
               "--query-tokens", "4", "--tier", "host", "--methods", "full", "qcfuse", "naive", "--ratios", "0.3",
               "--runs", "2", "--warmup", "1", "--breakdown-runs", "1", "--no-planner",
               "--store", str(tmp_path / "store"), "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["env"]["timed_call"] == "engine.answer"
    rows = data["rows"]
    assert {(r["chunks"], r["chunk_tokens"], r["method"]) for r in rows} == {
        (c, n, m) for c, n in ((2, 24), (3, 16)) for m in ("full", "qcfuse", "naive")}
    for r in rows:
        assert r["ttft_ms_min"] >= delay_ms, r
        assert r["stages_synced"] and r["timed_call"] == "engine.answer"
        assert set(r["stages_ms"]) == {"queue_ms", "lookup_ms", "plan_ms", "load_start_ms", "select_ms", "prefill_ms",
                                       "first_token_ms"}
    # per size: full 1 warm-up + 2 runs + 1 breakdown; each fused method at least 2 warm-ups
    # (the first call compiles: the planner's selection overhead is the least of two) + 2 + 1
    assert len(calls) == 2 * ((1 + 2 + 1) + 2 * (2 + 2 + 1))
    assert "| 2x24 | host | qcfuse | 0.30 |" in capsys.readouterr().out


def test_requests_run_with_the_configured_cpu_threads(tiny, tmp_path):
    """EngineConfig.threads is applied in the thread that runs the requests (the scheduler's),
    whichever thread asked."""
    import threading

    from qcfuse_core.engine.api import EngineConfig

    before = torch.get_num_threads()
    try:
        eng = QCFuseEngine(tiny, config=EngineConfig(threads=1))
        seen = {}
        lookup = eng.lookup.find

        def looked_up(*args, **kwargs):  # called in the thread that runs the request
            seen["torch"] = torch.get_num_threads()
            return lookup(*args, **kwargs)

        eng.lookup.find = looked_up

        def ask():
            stream = eng.stream(Q, DOCS, method="naive", max_new_tokens=1)
            list(stream)
            seen["threads"] = stream.result.threads

        t = threading.Thread(target=ask)
        t.start()
        t.join()
        assert seen == {"threads": 1, "torch": 1}
        assert eng.answer(Q, DOCS, method="full", max_new_tokens=1).to_dict()["threads"] == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="threads"):
        EngineConfig(threads=0)


@pytest.mark.parametrize("method", ["qcfuse", "cacheblend", "epic", "naive"])
def test_a_prompt_without_a_cached_chunk_is_answered_by_full_prefill(engine, method):
    """A chat turn rendered by a framework (no prefix piece, no chunk) is answered, never refused,
    and the answer is full prefill's; so is a completion prompt holding no known chunk."""
    from qcfuse_core.types import Piece

    turn = [Piece("suffix", "<|user|>Say hi to the island of Veloria.<|assistant|>")]
    full = engine._stream(turn, method="full", max_new_tokens=6)
    want = [*full] and full.result
    stream = engine._stream(turn, method=method, ratio=0.3, max_new_tokens=6)
    for _ in stream:
        pass
    got = stream.result
    assert got.token_ids == want.token_ids and got.text == want.text
    assert got.method == "full" and got.chunks == 0 and got.cache_hits == 0
    plain = engine.complete("Say hi to the island of Veloria.", method=method, ratio=0.3, max_new_tokens=6)
    assert plain.token_ids == engine.complete("Say hi to the island of Veloria.", method="full",
                                              max_new_tokens=6).token_ids
