"""One prefill the scheduler advances by rows (engine/prefill.py, engine/scheduler.py): every
prefill - a request's own, the quality guard's rungs, a rerun after an unreadable chunk -
runs at most `step_prefill_tokens` rows in a step, counted by wrapping the scheduler's one
place that runs prefills (`Scheduler._run`). Tiny random model, fp32, CPU."""

from __future__ import annotations

import pytest
import torch

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.engine.guard import GuardConfig, Keep, Refuse
from qcfuse_core.engine.prefill import Prefill
from qcfuse_core.model.testing import tiny_model
from qcfuse_core.store import MemoryStore, kv_dir, open_store
from tests.qc_fixtures import docs_engine, engine_config

DOCS = [f"Document {i}: " + " ".join(f"item{i}y{j}" for j in range(12)) for i in range(5)]
QUESTIONS = [f"Which document names item{i}y{i + 3}?" for i in range(4)]
BUDGET = 48


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", tokenizer=True)


def _engine(tiny, store=None, **cfg) -> QCFuseEngine:
    return docs_engine(tiny, DOCS, store, **cfg)


def _count_rows(eng: QCFuseEngine) -> list[list[tuple[int, float | None, int]]]:
    """Per scheduler step, the prefills it ran: (request's max_new_tokens, rung, rows)."""
    sched = eng._scheduler
    steps: list[list[tuple[int, float | None, int]]] = []
    real_step, real_run = sched.step, sched._run

    def step():
        steps.append([])
        real_step()

    def run(job, rows):
        steps[-1].append((job.request.generation.max_new_tokens, job.prefill.rung, rows))
        return real_run(job, rows)

    sched.step, sched._run = step, run
    return steps


def test_guard_rungs_run_under_the_step_budget_and_answer_as_full_prefill(tiny):
    """A guard that escalates everything (threshold 1.0, ladder 0.5 then full prefill): each
    qcfuse request's own pass, its 0.5 rung and its full-prefill rung run as Prefills of the
    scheduler, no step running more than the budget's rows; the escalated answer is the
    `full` request's answer under the same scheduler, token for token."""
    guard = GuardConfig(threshold=1.0, ladder=(0.5, 1.0))
    eng = _engine(tiny, step_prefill_tokens=BUDGET, guard=guard)
    steps = _count_rows(eng)
    streams = [
        eng.stream(q, DOCS[i:] + DOCS[:i], method="qcfuse", ratio=0.15, max_new_tokens=10 + i, ignore_eos=True)
        for i, q in enumerate(QUESTIONS)
    ]
    for s in streams:
        list(s)
    rungs = {(n, rung) for step in steps for n, rung, _ in step}
    for i in range(len(QUESTIONS)):
        assert {(10 + i, None), (10 + i, 0.5), (10 + i, 1.0)} <= rungs  # every pass ran in the scheduler
    for step in steps:
        assert sum(rows for _, _, rows in step) <= BUDGET
    full_steps = [i for i, step in enumerate(steps) if any(rung == 1.0 for _, rung, _ in step)]
    assert len(full_steps) > len(QUESTIONS)  # the full-prefill rungs are sliced over several steps
    ref = _engine(tiny, step_prefill_tokens=BUDGET)
    for i, (q, s) in enumerate(zip(QUESTIONS, streams)):
        r = s.result
        assert r.guard.action == "full" and [x for x, _ in r.guard.rungs] == [0.5, 1.0]
        want = ref.answer(q, DOCS[i:] + DOCS[:i], method="full", max_new_tokens=10 + i, ignore_eos=True)
        assert r.token_ids == want.token_ids
        assert torch.allclose(r.first_logits, want.first_logits, atol=1e-5)


def test_an_unreadable_chunk_reruns_under_the_step_budget(tiny, tmp_path):
    """A chunk that leaves the store between a request's lookup and its prefill: the load
    report names it, the request's Prefill is made again with it rebuilt (sliced like any
    other), and the answer is the intact store's."""
    store = open_store(kv_dir(tmp_path))
    eng = _engine(tiny, store=store, step_prefill_tokens=BUDGET)
    want = eng.answer(QUESTIONS[0], DOCS, method="qcfuse", ratio=0.3, max_new_tokens=8, ignore_eos=True)
    steps = _count_rows(eng)
    lookup = eng._steps.lookup
    victim = eng.caches.chunk_tokens(DOCS[2])[1]
    calls = []

    def losing_one(pieces, method, **kw):  # the chunk is gone by the time its layers are read
        looked = lookup(pieces, method, **kw)
        if not calls:
            store.delete(victim)
        calls.append(kw.get("streaming"))
        return looked

    eng._steps.lookup = losing_one
    got = eng.answer(QUESTIONS[0], DOCS, method="qcfuse", ratio=0.3, max_new_tokens=8, ignore_eos=True)
    assert calls == [None, False]  # looked up again, in memory, after the failed load
    assert got.load["failed"] and got.token_ids == want.token_ids
    assert sum(len(step) for step in steps) >= 2
    for step in steps:
        assert sum(rows for _, _, rows in step) <= BUDGET
    again = eng.answer(QUESTIONS[0], DOCS, method="qcfuse", ratio=0.3, max_new_tokens=8, ignore_eos=True)
    assert again.cache_misses == 0 and again.token_ids == want.token_ids  # rebuilt and stored


def test_a_prefill_grants_whole_slices_oldest_first(tiny):
    """`Prefill.grant`: the rows of as many next slices as fit; the first prefill of a step
    runs its next slice whatever its size; `advance` runs exactly the granted slices."""
    eng = _engine(tiny)
    req_pieces = eng.frame.rag_pieces(QUESTIONS[0], DOCS)
    prompt, _, _ = eng._steps.fuse_pieces(req_pieces)
    sel = eng._steps.select(prompt, "full", 1.0).selection
    from qcfuse_core.engine.request import Loading

    p = Prefill.open(eng, req_pieces, None, Loading(prompt, None), sel, "full", budget=20)
    sizes = [p._slice_rows(i) for i in range(len(p.spans))]
    assert p.sliced and all(n <= 20 for n in sizes) and sum(sizes) == prompt.num_tokens
    assert p.grant(5, first=False) == 0  # nothing fits
    assert p.grant(5, first=True) == sizes[0]  # ... but the step's first prefill moves
    assert p.grant(sizes[0] + sizes[1], first=False) == sizes[0] + sizes[1]
    assert p.advance(sizes[0] + sizes[1]) is None and p.done == 2
    out = p.advance(p.remaining)
    assert out is not None and p.finished and out.cache.length == prompt.num_tokens


def test_the_guard_decides_keep_or_refuse(tiny):
    """`Guard.decide` is a decision: Keep for a margin at or above the threshold, for a
    method the selector says is not guarded, and for a request with the guard off; Refuse
    with the next rung otherwise, full prefill last."""
    from qcfuse_core.engine.generation import GenerationConfig
    from qcfuse_core.engine.request import Request, StageClock

    eng = _engine(tiny, guard=GuardConfig(threshold=0.5, ladder=(0.5, 1.0)))
    prompt, _, _ = eng._steps.fuse_pieces(eng.frame.rag_pieces(QUESTIONS[1], DOCS))
    from qcfuse_core.engine.request import Loading

    def decide(method, logits, guard=True, rung=None):
        req = Request(method, 0.15, GenerationConfig(), StageClock(tiny.device), guard=guard)
        sel = eng._steps.select(prompt, method, 0.15)
        pre = eng._steps.fuse(Loading(prompt, None), sel, method)
        pre = type(pre)(logits, pre.cache, pre.prompt, pre.selection, 3, 0, 0)
        d = eng._steps.guard.decide(req, pre, 10.0, lambda r: sel.selection, None)
        if rung is not None and isinstance(d, Refuse):
            d = eng._steps.guard.decide(req, pre, 10.0, lambda r: sel.selection, d.ratio)
        return d, req.guard_report

    sure = torch.full((1, tiny.shape.vocab_size), -10.0)
    sure[0, 7] = 10.0
    unsure = torch.zeros((1, tiny.shape.vocab_size))
    assert isinstance(decide("qcfuse", sure)[0], Keep)
    assert isinstance(decide("cacheblend", unsure)[0], Keep)  # not guarded: the selector says so
    d, rep = decide("qcfuse", unsure, guard=False)
    assert isinstance(d, Keep) and "for this request" in rep.reason
    d, rep = decide("qcfuse", unsure)
    assert d == Refuse(0.5, d.selection) and d.selection is not None and rep.code == "low_margin"
    d, rep = decide("qcfuse", unsure, rung=True)  # the 0.5 rung's margin is still low: full prefill next
    assert d == Refuse(1.0) and rep.rungs[0][0] == 0.5


def test_a_full_prefill_rung_sliced_over_a_streaming_store_reads_no_chunk_layer(tiny, tmp_path):
    """A full-prefill rung recomputes every row: sliced (a small budget, as the step budget in
    time gives on a slow machine), its first slice reads no cached layer - over a store that
    streams layers its chunks are views whose anchor layers are not tensors - and the answer
    is the `full` request's."""
    store = open_store(kv_dir(tmp_path), use_cuda=False)
    guard = GuardConfig(threshold=1.0, ladder=(1.0,))
    eng = _engine(tiny, store=store, step_prefill_tokens=BUDGET, guard=guard)
    steps = _count_rows(eng)
    got = eng.answer(QUESTIONS[0], DOCS, method="qcfuse", ratio=0.15, max_new_tokens=6, ignore_eos=True)
    assert got.guard.action == "full"
    assert sum(1 for step in steps if any(rung == 1.0 for _, rung, _ in step)) > 1  # the rung ran in slices
    want = _engine(tiny).answer(QUESTIONS[0], DOCS, method="full", max_new_tokens=6, ignore_eos=True)
    assert got.token_ids == want.token_ids
    assert torch.allclose(got.first_logits, want.first_logits, atol=1e-5)
