"""Tenant-fair admission (engine/scheduler.py `_pick`, issue 62): waiting requests are
admitted tenant by tenant in turn, first in first out within each, so one tenant's flood
cannot queue ahead of another's single request. Counted in the scheduler's admissions (the
order of `Scheduler._open`), with one request running at a time; no wall clock. Tiny
random model, fp32, CPU."""

from __future__ import annotations

import threading

import pytest

from qcfuse_core.model.testing import tiny_model
from tests.qc_fixtures import docs_engine

DOCS = [f"Document {i}: " + " ".join(f"item{i}y{j}" for j in range(6)) for i in range(3)]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", tokenizer=True)


def _admissions(tiny, tenants: list[str | None]) -> list[tuple[str | None, int]]:
    """Submit one request per entry of `tenants` (in that order) while the first one's
    admission is held until every request waits -> (tenant, submission number) in the order
    the scheduler admitted them."""
    eng = docs_engine(tiny, DOCS, max_running=1)
    sched = eng._scheduler
    order: list[tuple[str | None, int]] = []
    gate = threading.Event()
    real_open = sched._open

    def opening(job):
        order.append((job.request.tenant, job.request.generation.max_new_tokens))
        gate.wait(30)
        real_open(job)

    sched._open = opening
    streams = [
        eng.stream(f"Which item is number {i}?", DOCS, tenant=t, max_new_tokens=i + 1, ignore_eos=True)
        for i, t in enumerate(tenants)
    ]
    gate.set()
    for s in streams:
        list(s)
    assert sched.stats().admitted == len(tenants)
    eng.close()
    return [(t, n - 1) for t, n in order]


def test_one_tenants_flood_does_not_queue_ahead_of_anothers_single_request(tiny):
    """Alice sends six requests, then Bob one: Bob's is admitted right after the request
    already running, not after Alice's five others; Alice's stay in her order."""
    got = _admissions(tiny, ["alice"] * 6 + ["bob"])
    assert got[0] == ("alice", 0) and got[1] == ("bob", 6)
    assert [n for t, n in got if t == "alice"] == [0, 1, 2, 3, 4, 5]


def test_tenants_take_turns_first_in_first_out_within_each(tiny):
    """Three tenants' requests, submitted tenant by tenant, are admitted round-robin."""
    got = _admissions(tiny, ["a", "a", "a", "b", "b", "b", "c", "c", "c"])
    assert got == [("a", 0), ("b", 3), ("c", 6), ("a", 1), ("b", 4), ("c", 7), ("a", 2), ("b", 5), ("c", 8)]


def test_without_tenants_requests_are_admitted_in_order(tiny):
    """In-process callers name no tenant: one tenant, first in first out."""
    got = _admissions(tiny, [None] * 5)
    assert got == [(None, n) for n in range(5)]


def test_a_tenant_must_be_a_string(tiny):
    eng = docs_engine(tiny, DOCS)
    with pytest.raises(TypeError, match="tenant must be a str"):
        eng.answer("Which item?", DOCS, tenant=3, max_new_tokens=1)
    eng.close()


def test_a_tenants_unregistered_documents_and_prefix_are_its_own_caches(tiny):
    """Documents a request brings (not registered) and its prefix are cached under its
    tenant's salt: another tenant's request of the same texts finds no cache (a miss, built
    for it), the same tenant's finds its own; registered chunks are shared by every tenant;
    no tenant is the shared namespace of in-process callers."""
    eng = docs_engine(tiny, DOCS[:1])  # DOCS[0] registered
    docs = [f"Unregistered note {i}: " + " ".join(f"w{i}z{j}" for j in range(8)) for i in range(2)]

    def ask(tenant, documents):
        r = eng.answer("Which note?", documents, tenant=tenant, method="qcfuse", max_new_tokens=2)
        return r.cache_hits, r.cache_misses

    assert ask("alice", docs) == (0, 2)
    assert ask("alice", docs)[0] >= 2  # her own caches (and her prefix)
    assert ask("bob", docs)[1] == 2  # another tenant: nothing of Alice's is found
    assert ask(None, docs)[1] == 2  # nor by the shared tenant
    assert ask("bob", DOCS[:1])[1] == 0 and ask("carol", DOCS[:1])[1] == 0  # registered: shared
    eng.close()
