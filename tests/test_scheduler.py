"""The scheduler (qcfuse_core/engine/scheduler.py): many callers, one worker thread, one
batched decode step for every running request - and each answer exactly what the request
gives alone. Tiny random model, fp32, CPU; every test bounded in requests and time."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from qcfuse_core import CacheConfig, EngineBusy, SchedulerConfig
from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.model.testing import tiny_model
from qcfuse_core.store import MemoryStore, kv_dir, open_store
from tests.qc_fixtures import docs_engine, engine_config, hold_worker

DOCS = [f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(10)) for i in range(4)]
METHODS = ("qcfuse", "full", "naive", "cacheblend")
NEW = 6


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", tokenizer=True)


def _engine(tiny, store=None, **cfg) -> QCFuseEngine:
    return docs_engine(tiny, DOCS, store, **cfg)


def _requests(n: int, seed: int) -> list[tuple[str, list[str], str]]:
    """n requests: a question, the documents in a shuffled order, a method."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        docs = DOCS[:]
        rng.shuffle(docs)
        out.append((f"Which document mentions word{i % 4}x{i % 7}?", docs, METHODS[i % len(METHODS)]))
    return out


def _alone(tiny, reqs, **cfg) -> list[list[int]]:
    """The same requests one at a time through a fresh engine."""
    eng = _engine(tiny, **cfg)
    return [eng.answer(q, d, method=m, ratio=0.3, max_new_tokens=NEW).token_ids for q, d, m in reqs]


def _wait_for(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_threads_answer_as_one_at_a_time(tiny):
    """16 threads x 8 requests, shuffled chunk orders, four methods: the answers are the
    one-at-a-time answers token for token, and requests really shared decode steps."""
    reqs = _requests(128, seed=1)
    want = _alone(tiny, reqs)
    eng = _engine(tiny)
    got: list[list[int] | None] = [None] * len(reqs)
    errors: list[BaseException] = []

    def client(t: int) -> None:
        try:
            for i in range(t, len(reqs), 16):
                q, d, m = reqs[i]
                got[i] = eng.answer(q, d, method=m, ratio=0.3, max_new_tokens=NEW).token_ids
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(240)
    assert not errors, errors
    assert got == want
    s = eng.stats().scheduler
    assert (s.submitted, s.finished, s.failed, s.aborted, s.running, s.waiting) == (128, 128, 0, 0, 0, 0)
    assert s.max_batch_seen > 1


@pytest.mark.parametrize("deterministic", [False, True])
def test_asyncio_tasks_answer_as_one_at_a_time(tiny, deterministic):
    """24 asyncio tasks, half through `aanswer`, half through `astream` (deltas joined to the
    text): the one-at-a-time answers token for token; the event loop keeps running meanwhile."""
    reqs = _requests(24, seed=2)
    want = _alone(tiny, reqs, deterministic=deterministic)
    eng = _engine(tiny, deterministic=deterministic)

    async def one(i: int) -> list[int]:
        q, d, m = reqs[i]
        if i % 2:
            return (await eng.aanswer(q, d, method=m, ratio=0.3, max_new_tokens=NEW)).token_ids
        stream = eng.astream(q, d, method=m, ratio=0.3, max_new_tokens=NEW)
        deltas = [delta async for delta in stream]
        assert stream.result is not None and "".join(deltas) == stream.result.text
        return stream.result.token_ids

    async def main() -> tuple[list[list[int]], int]:
        ticks = 0

        async def ticker() -> None:  # runs only if the loop is never blocked for long
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        tick = asyncio.create_task(ticker())
        out = await asyncio.gather(*(one(i) for i in range(len(reqs))))
        tick.cancel()
        return list(out), ticks

    got, ticks = asyncio.run(main())
    assert got == want
    assert ticks > 5
    s = eng.stats().scheduler
    assert s.finished == 24 and s.failed == 0 and s.max_batch_seen > 1


def test_a_batch_forms_from_requests_submitted_together(tiny):
    eng = _engine(tiny)
    streams = [eng.stream(q, d, method=m, ratio=0.3, max_new_tokens=NEW) for q, d, m in _requests(8, seed=3)]
    for s in streams:
        list(s)
    assert eng.stats().scheduler.max_batch_seen == 8


def test_a_closed_stream_frees_its_resources(tiny, tmp_path, monkeypatch):
    """Closing a stream mid-answer: the request leaves the batch, its KV reservation (and with
    it its buffer) is released and its load session is closed - by the time close() returns."""
    eng = _engine(tiny, store=open_store(kv_dir(tmp_path), use_cuda=False))
    given: list[object] = []
    give = eng.kv_budget.release
    monkeypatch.setattr(eng.kv_budget, "release", lambda r: (given.append(r), give(r)))
    other = eng.stream("Which?", DOCS, method="qcfuse", ratio=0.3, max_new_tokens=40)
    stream = eng.stream("Which one?", DOCS, method="qcfuse", ratio=0.3, max_new_tokens=40)
    next(stream)
    stream.close()
    s = eng.stats().scheduler
    assert s.aborted == 1
    assert len([c for c in given if c is not None]) == 1
    assert len(eng.lookup.prefetcher._free) == 1  # every load session gave its buffers back
    r = [*other] and other.result  # the other request is unaffected
    assert r is not None and r.finish_reason in ("length", "stop")
    s = eng.stats().scheduler
    assert (s.finished, s.aborted, s.running) == (1, 1, 0)
    assert len([c for c in given if c is not None]) == 2 and eng.kv_budget.reserved_bytes() == 0
    eng.caches.store.close()


def test_a_cancelled_task_aborts_its_request(tiny):
    eng = _engine(tiny)

    async def main() -> None:
        async def reader() -> None:
            async for _ in eng.astream("Which?", DOCS, method="full", max_new_tokens=200):
                pass

        task = asyncio.create_task(reader())
        await asyncio.sleep(0)
        while eng.stats().scheduler.steps < 3:  # it is decoding
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _wait_for(lambda: eng.stats().scheduler.aborted == 1)
    s = eng.stats().scheduler
    assert s.running == 0 and s.finished == 0


def test_a_full_queue_raises_engine_busy(tiny):
    """max_queue requests waiting: the next submit raises EngineBusy (nothing of it runs);
    the queued ones still answer."""
    eng = _engine(tiny, max_queue=2, max_running=1)
    gate = hold_worker(eng)  # the first request's lookup: the worker waits there, the queue fills
    first = eng.stream("Which?", DOCS, method="naive", max_new_tokens=2)
    _wait_for(lambda: eng.stats().scheduler.running == 1)
    queued = [eng.stream("Which?", DOCS, method="naive", max_new_tokens=2) for _ in range(2)]
    with pytest.raises(EngineBusy, match="max_queue=2"):
        eng.stream("Which?", DOCS, method="naive", max_new_tokens=2)
    assert isinstance(EngineBusy("x"), RuntimeError)
    gate.set()
    for s in [first, *queued]:
        list(s)
        assert s.result is not None
    s = eng.stats().scheduler
    assert (s.submitted, s.finished) == (3, 3)
    with pytest.raises(ValueError, match="max_queue"):
        SchedulerConfig(max_queue=0)


def test_a_bad_request_raises_on_the_callers_thread(tiny):
    """A request is data, checked where it is made: an empty question, a ratio outside [0, 1],
    an unknown method or a malformed prompt raise ValueError in the caller's thread, before
    anything is queued; a function instead of the pieces is refused."""
    from qcfuse_core.types import Piece

    eng = _engine(tiny)
    bad = {
        "question is empty": lambda: eng.stream("  ", DOCS),
        "ratio": lambda: eng.stream("Which?", DOCS, ratio=1.5),
        "unknown method": lambda: eng.stream("Which?", DOCS, method="magic"),
        "at least one piece": lambda: eng._stream([]),
        "of kind": lambda: eng._stream([Piece("question", "Which?")]),
    }
    for message, call in bad.items():
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(TypeError, match="as data"):
        eng._stream(lambda: eng.frame.rag_pieces("Which?", DOCS))
    s = eng.stats().scheduler
    assert (s.submitted, s.waiting, s.running) == (0, 0, 0)


class _Flaky(MemoryStore):
    """A store whose reads of one key fail."""

    bad = None

    def get(self, key):
        if key == self.bad:
            raise OSError("disk went away")
        return super().get(key)


def test_a_request_whose_chunk_read_fails_fails_alone(tiny):
    """8 requests submitted together; the chunk read of the 2 that hold the bad document
    fails: they raise it, the 6 others answer as they do alone."""
    store = _Flaky()
    eng = _engine(tiny, store=store)
    good, bad = DOCS[:3], DOCS[1:]
    reqs = [(f"Which {i}?", bad if i % 4 == 1 else good, "qcfuse") for i in range(8)]
    want = _alone(tiny, [r for i, r in enumerate(reqs) if i % 4 != 1])
    store.bad = eng.caches.chunk_tokens(DOCS[3])[1]
    streams = [eng.stream(q, d, method=m, ratio=0.3, max_new_tokens=NEW) for q, d, m in reqs]
    got = []
    for i, s in enumerate(streams):
        if i % 4 == 1:
            with pytest.raises(OSError, match="disk went away"):
                list(s)
        else:
            list(s)
            assert s.result is not None
            got.append(s.result.token_ids)
    assert got == want
    s = eng.stats().scheduler
    assert (s.finished, s.failed, s.running) == (6, 2, 0)
    assert s.max_batch_seen > 1


def test_a_stream_closed_while_waiting_leaves_the_queue_at_once(tiny):
    """max_running=1 and a long answer running: a waiting request closed leaves the queue at
    the next step, without waiting for a free slot."""
    eng = _engine(tiny, max_running=1)
    long = eng.stream("Which?", DOCS, method="full", max_new_tokens=200)
    next(long)
    queued = eng.stream("Which one?", DOCS, method="full", max_new_tokens=2)
    queued.close()
    s = eng.stats().scheduler
    assert (s.aborted, s.running, s.waiting) == (1, 1, 0)
    long.close()
    s = eng.stats().scheduler
    assert (s.aborted, s.running, s.finished) == (2, 0, 0)


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_one_request_driver_answers_as_the_scheduler(tiny, deterministic):
    """Steps.run (one request alone, in the calling thread) and the scheduler share prefill,
    Decoding and fusion_result: the same tokens, text, finish reason and stage keys."""
    from qcfuse_core.engine.generation import GenerationConfig

    eng = _engine(tiny, deterministic=deterministic)
    for q, d, m in _requests(4, seed=4):
        r = eng.answer(q, d, method=m, ratio=0.3, max_new_tokens=NEW)
        gen = eng._steps.run(eng.frame.rag_pieces(q, d), m, 0.3, GenerationConfig(max_new_tokens=NEW), False)
        deltas = []
        try:
            while True:
                deltas.append(next(gen))
        except StopIteration as stop:
            alone = stop.value
        assert (alone.token_ids, alone.text, alone.finish_reason) == (r.token_ids, r.text, r.finish_reason)
        assert "".join(deltas) == alone.text and set(alone.timings_ms) == set(r.timings_ms)


def _kv_bytes(tiny, tokens: int) -> int:
    s = tiny.shape
    return 2 * tokens * s.num_layers * s.num_kv_heads * s.head_dim * tiny.dtype.itemsize


def test_admission_waits_for_kv_room_and_answers_as_alone(tiny):
    """A KV budget with room for two requests' caches: eight requests submitted together run
    at most two at a time (the others wait, counted as deferred), nothing fails, and every
    answer is the one-at-a-time answer."""
    reqs = _requests(8, seed=5)
    want = _alone(tiny, reqs)
    probe = _engine(tiny)
    longest = max(probe.answer(q, d, method=m, ratio=0.3, max_new_tokens=NEW).prompt_tokens for q, d, m in reqs)
    eng = _engine(tiny, kv_cache_bytes=_kv_bytes(tiny, 2 * (longest + NEW)))

    async def main():
        return await asyncio.gather(*(eng.aanswer(q, d, method=m, ratio=0.3, max_new_tokens=NEW) for q, d, m in reqs))

    got = asyncio.run(main())
    assert [r.token_ids for r in got] == want
    s = eng.stats().scheduler
    assert s.finished == 8 and s.failed == 0
    assert s.deferred > 0 and 1 <= s.max_batch_seen <= 2
    names = ("queue_ms", "lookup_ms", "plan_ms", "load_start_ms", "select_ms", "prefill_ms", "first_token_ms")
    for r in got:  # waiting for room is queue time; the stages still add up to the TTFT
        stages = [r.timings_ms[k] for k in names]
        assert all(v >= 0 for v in stages) and abs(sum(stages) - r.ttft_ms) < 0.05, (r.timings_ms, r.ttft_ms)


def test_a_request_larger_than_the_kv_budget_fails_alone(tiny):
    """A budget below one request's cache: that request fails with KVBudgetError naming the
    budget; a short one submitted beside it answers."""
    from qcfuse_core import KVBudgetError

    short = _engine(tiny).complete("Hi", max_new_tokens=4)
    eng = _engine(tiny, kv_cache_bytes=_kv_bytes(tiny, short.prompt_tokens + 4))
    q = "Which document mentions word1x2?"
    with pytest.raises(KVBudgetError, match=r"KV cache \(\d+ tokens, [\d.]+ \w+\) exceeds the engine's KV budget"):
        eng.answer(q, DOCS, method="qcfuse", ratio=0.3, max_new_tokens=NEW)
    assert eng.complete("Hi", max_new_tokens=4).token_ids == short.token_ids
    assert eng.stats().scheduler.failed == 1
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        CacheConfig(kv_cache_bytes=0)
    with pytest.raises(ValueError, match="kv_memory_share"):
        CacheConfig(kv_memory_share=1.5)


def test_shutdown_aborts_what_runs_and_refuses_new_requests(tiny):
    """At interpreter exit every live scheduler is shut down (atexit): a request still
    running is aborted and its resources freed, the worker thread ends, and a request
    submitted afterwards is refused."""
    from qcfuse_core.engine import scheduler as scheduler_mod

    eng = _engine(tiny)
    stream = eng.stream("Which document mentions word1x2?", DOCS, max_new_tokens=400)
    next(iter(stream))
    sched = eng._scheduler
    assert sched in scheduler_mod._LIVE
    worker = sched._thread
    assert worker is not None and worker.is_alive()
    sched.shutdown()
    s = sched.stats()
    assert s.aborted == 1 and s.running == 0 and s.waiting == 0
    assert not worker.is_alive() and sched._thread is None
    with pytest.raises(RuntimeError, match="shut down"):
        eng.answer("Which document mentions word1x2?", DOCS, max_new_tokens=2)


def test_stats_and_close(tiny, tmp_path):
    """`stats()` reads the scheduler's counters (zero before the first request, starting
    nothing), the store's counters and the cache manager's counts; `close()` stops the
    worker, aborting what runs, closes the store and the text index, and is idempotent; a
    request after it raises. `with` closes the engine."""
    from qcfuse_core import EngineStats

    import sqlite3

    store = open_store(kv_dir(tmp_path), use_cuda=False)
    eng = _engine(tiny, store=store)
    closed: list[int] = []
    real_close = store.close
    store.close = lambda: (closed.append(1), real_close())[1]  # type: ignore[method-assign]
    before = eng.stats()
    assert isinstance(before, EngineStats) and before.scheduler.submitted == 0 and eng._sched is None
    assert before.chunk_texts == len(DOCS) and before.store["backend"] == "tiered"
    eng.answer("Which document mentions word1x2?", DOCS, max_new_tokens=2)
    after = eng.stats()
    assert (after.scheduler.submitted, after.scheduler.finished, after.kv_reserved_bytes) == (1, 1, 0)
    stream = eng.stream("Which document mentions word1x2?", DOCS, max_new_tokens=400)
    next(iter(stream))
    worker = eng._sched._thread
    eng.close()
    assert eng._sched.stats().aborted == 1 and not worker.is_alive() and closed == [1]
    with pytest.raises(sqlite3.ProgrammingError):
        len(eng.caches.texts)  # the chunk-text index is closed too
    final = eng.stats()  # as it was when it closed
    assert (final.chunk_texts, final.scheduler.aborted, final.scheduler.running) == (len(DOCS), 1, 0)
    eng.close()  # idempotent
    assert closed == [1]
    with pytest.raises(RuntimeError, match="closed"):
        eng.answer("Which document mentions word1x2?", DOCS, max_new_tokens=2)
    with _engine(tiny) as held:
        held.answer("Which document mentions word1x2?", DOCS, max_new_tokens=2)
    with pytest.raises(RuntimeError, match="closed"):
        held.complete("Hi", max_new_tokens=2)


def test_the_interpreter_exits_cleanly_with_a_stream_left_open(tmp_path):
    """A script that leaves a stream mid-answer exits with status 0 (the worker is stopped
    before the interpreter finalises, not killed inside a torch call)."""
    import subprocess
    import sys

    script = tmp_path / "left_open.py"
    script.write_text(
        "from qcfuse_core.engine.api import QCFuseEngine\n"
        "from qcfuse_core.model.testing import tiny_model\n"
        "eng = QCFuseEngine(tiny_model('llama', tokenizer=True))\n"
        "eng.complete('Hello', max_new_tokens=3)\n"
        "stream = eng.stream('Hi there', ['doc one', 'doc two'], max_new_tokens=400)\n"
        "next(iter(stream))\n"
        "print('left open')\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "left open" in done.stdout, done.stderr[-2000:]


def test_greedy_rows_are_chosen_together_and_answer_as_alone(tiny, monkeypatch):
    """Greedy requests batched with seeded sampling ones: the greedy rows' tokens come from
    one argmax over the batch (take_token), the others from their own samplers, and every
    answer is the one-at-a-time answer."""
    from qcfuse_core.engine import pipeline

    reqs = _requests(6, seed=9)
    temps = [0.0, 0.8, 0.0, 0.8, 0.0, 0.8]

    def run(eng, together):
        kw = [dict(method=m, ratio=0.3, max_new_tokens=NEW, temperature=t, seed=11) for (_, _, m), t in zip(reqs, temps)]
        if not together:
            return [eng.answer(q, d, **k).token_ids for (q, d, _), k in zip(reqs, kw)]
        streams = [eng.stream(q, d, **k) for (q, d, _), k in zip(reqs, kw)]
        out = []
        for s in streams:
            list(s)
            out.append(s.result.token_ids)
        return out

    want = run(_engine(tiny), together=False)
    picked = []
    real = pipeline.Decoding.take_token
    monkeypatch.setattr(pipeline.Decoding, "take_token", lambda self, t: picked.append(t) or real(self, t))
    eng = _engine(tiny)
    assert run(eng, together=True) == want
    assert eng.stats().scheduler.max_batch_seen == 6 and len(picked) >= 3 * (NEW - 1) - 3
