"""Background work at the scheduler's lowest priority (engine/scheduler.py `submit_idle`,
`engine.build_chunks(background=True)`: how learned chunks are built): it runs only in steps
where no request waits or runs, one piece a step, and an idle engine works through its
backlog. Counted in scheduler state, not timed. Tiny random model, CPU."""

from __future__ import annotations

import threading
import time

import pytest

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.engine.audit import AuditConfig
from qcfuse_core.engine.config import EngineConfig
from qcfuse_core.model.testing import tiny_model
from qcfuse_core.store import MemoryStore

# the fidelity audit's checks are idle work too (engine/audit.py, tests/test_audit.py): these
# tests count the chunk builds alone
NO_AUDIT = EngineConfig(audit=AuditConfig(enabled=False))
DOCS = [f"Document {i}: " + " ".join(f"note{i}z{j}" for j in range(10)) for i in range(4)]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", tokenizer=True)


def _outstanding(eng: QCFuseEngine) -> int:
    s = eng._scheduler.stats()
    return s.waiting + s.running


def test_idle_work_never_runs_beside_a_request_and_requests_go_first(tiny):
    """Requests submitted while a backlog of idle work is under way are admitted after the
    piece running then, before the rest of the backlog; every piece sees no request waiting
    or running; the backlog is then worked through."""
    eng = QCFuseEngine(tiny, store=MemoryStore(), config=NO_AUDIT)
    eng.build_chunks(DOCS)
    sched = eng._scheduler
    events: list[tuple[str, int]] = []
    first_started = threading.Event()

    def piece(i: int):
        def work():
            events.append(("piece", _outstanding(eng)))
            first_started.set()
            time.sleep(0.05)
            return i

        return work

    futures = [sched.submit_idle(piece(i)) for i in range(8)]
    assert first_started.wait(10)
    streams = [eng.stream(f"Which note is {i}?", DOCS, method="qcfuse", ratio=0.3, max_new_tokens=4) for i in range(3)]
    for s in streams:
        list(s)
        events.append(("answered", 0))
    assert [f.result(timeout=30) for f in futures] == list(range(8))
    assert all(n == 0 for kind, n in events if kind == "piece")  # never beside a request
    answered = [i for i, (kind, _) in enumerate(events) if kind == "answered"]
    pieces_before = sum(1 for kind, _ in events[: answered[-1]] if kind == "piece")
    assert pieces_before <= 2  # the piece under way when they came (and one racing their submission)
    stats = eng.stats().scheduler
    assert stats.idle_tasks == 8 and stats.idle_waiting == 0 and stats.finished == 3
    eng.close()


def test_build_chunks_in_the_background_builds_them_in_idle_steps(tiny):
    """`build_chunks(background=True)`: one idle piece per new chunk; the caches are stored
    and the next request hits them; an error of a piece reaches the caller."""
    eng = QCFuseEngine(tiny, store=MemoryStore(), config=NO_AUDIT)
    keys = eng.build_chunks(DOCS, register=False, background=True)
    assert all(eng.caches.store.contains(k) for k in keys)
    assert eng.stats().scheduler.idle_tasks == len(DOCS)
    r = eng.answer("Which note is 2?", DOCS, method="qcfuse", ratio=0.3, max_new_tokens=3)
    assert r.cache_hits == len(DOCS) and r.cache_misses == 0
    eng.build_chunks(DOCS, background=True)  # all stored: nothing queued
    assert eng.stats().scheduler.idle_tasks == len(DOCS)

    def broken():
        raise RuntimeError("piece failed")

    sched = eng._scheduler
    with pytest.raises(RuntimeError, match="piece failed"):
        sched.submit_idle(broken).result(timeout=10)
    eng.close()
    with pytest.raises(RuntimeError, match="shut down"):
        sched.submit_idle(lambda: None)


def test_idle_work_waits_for_a_quiet_spell_after_the_last_request(tiny):
    """Background work starts only once no request has waited or run for `idle_after_s`
    (IDLE_WORK_AFTER_S): a request sent right after another finds no piece under way."""
    eng = QCFuseEngine(tiny, store=MemoryStore(), config=NO_AUDIT)
    sched = eng._scheduler
    sched.idle_after_s = 2.0
    eng.answer("Which note is 1?", DOCS, method="qcfuse", ratio=0.3, max_new_tokens=2)
    ran: list[float] = []
    future = sched.submit_idle(lambda: ran.append(time.monotonic()))
    eng.answer("Which note is 2?", DOCS, method="qcfuse", ratio=0.3, max_new_tokens=2)  # sent at once
    last = time.monotonic()
    assert ran == []  # none ran between the two requests
    future.result(timeout=30)
    assert ran[0] - last >= 1.9 and eng.stats().scheduler.idle_tasks == 1  # after the quiet spell
    eng.close()
