"""The quality guard (qcfuse_core/engine/guard.py): its decision, its escalation ladder, its
report, its calibration, and what an escalation costs the requests beside it. Tiny random
model, fp32, CPU (the embedded model's short-chunk case is in test_guard_short_chunks.py)."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.engine.config import EngineConfig
from qcfuse_core.engine.guard import GUARDED_LABEL, GuardConfig, escalate, first_token_margin, resolve_threshold
from qcfuse_core.engine.request import Planned, Status
from qcfuse_core.eval.guard_calibration import margins_from_records, pick_threshold, rates
from qcfuse_core.eval.quality import guard_records, guard_summary, with_guard
from qcfuse_core.model.testing import tiny_model
from qcfuse_core.selection import SelectionContext, get_selector
from qcfuse_core.selection.selectors import rechoose
from qcfuse_core.store import MemoryStore

DOCS = [f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(12)) for i in range(4)]
Q = "Which document mentions word2x5?"


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", tokenizer=True)


def _engine(tiny, **guard) -> QCFuseEngine:
    eng = QCFuseEngine(tiny, store=MemoryStore(), config=EngineConfig(guard=GuardConfig(**guard)))
    eng.build_chunks(DOCS)
    return eng


def test_config_is_checked():
    assert GuardConfig().enabled and GuardConfig().ladder == (1.0,)
    for bad in (dict(threshold=1.5), dict(ladder=()), dict(ladder=(1.0, 0.5)), dict(ladder=(0.0,))):
        with pytest.raises(ValueError):
            GuardConfig(**bad)
    with pytest.raises(ValueError):
        GuardConfig(max_added_ms=-1)
    with pytest.raises(TypeError):
        EngineConfig(guard={"enabled": False})  # type: ignore[arg-type]


def test_margin_and_decision():
    logits = torch.tensor([0.0, 2.0, 1.0])
    p = torch.softmax(logits, -1)
    assert first_token_margin(logits) == pytest.approx(float(p[1] - p[2]))
    assert escalate(0.1, 0.2) and not escalate(0.2, 0.2) and not escalate(0.3, 0.2)


def test_the_decision_is_deterministic_for_a_request(tiny):
    eng = _engine(tiny, threshold=0.5)
    a = eng.answer(Q, DOCS, max_new_tokens=4)
    b = eng.answer(Q, DOCS, max_new_tokens=4)
    assert a.guard is not None and b.guard is not None
    assert a.guard.value == b.guard.value and a.guard.action == b.guard.action and a.guard.rungs == b.guard.rungs
    assert a.token_ids == b.token_ids
    assert a.guard.value == pytest.approx(first_token_margin(_fused_first_logits(eng)), abs=1e-6)
    eng.close()


def _fused_first_logits(eng: QCFuseEngine) -> torch.Tensor:
    """qcfuse@0.15's first-token logits of (Q, DOCS), from the steps themselves (no guard)."""
    from qcfuse_core.eval.hooks import internals

    steps = internals(eng).steps
    looked = steps.lookup(eng.frame.rag_pieces(Q, DOCS), "naive", streaming=False)
    loading = steps.start_loading(looked, Planned("naive", frozenset()))
    return steps.fuse(loading, steps.select(loading.prompt, "qcfuse", 0.15), "qcfuse").logits[-1]


@pytest.mark.parametrize("ladder", [(1.0,), (0.5, 1.0)])
def test_escalation_to_full_prefill_is_full_prefills_answer(tiny, ladder):
    eng = _engine(tiny, threshold=1.0, ladder=ladder)  # a margin is below 1: every rung runs
    got = eng.answer(Q, DOCS, max_new_tokens=8, ignore_eos=True)
    full = eng.answer(Q, DOCS, method="full", max_new_tokens=8, ignore_eos=True)
    assert got.guard is not None and got.guard.action == "full" and got.guard.code == "low_margin"
    assert [r for r, _ in got.guard.rungs] == list(ladder)
    assert got.token_ids == full.token_ids and got.text == full.text
    assert torch.equal(got.first_logits, full.first_logits)  # the same forward: bit for bit
    assert got.recomputed_tokens == got.context_tokens
    assert got.guard.spent_tokens > got.context_tokens  # the fused pass before it counts too
    assert full.guard is not None and full.guard.code == "not_guarded"
    eng.close()


def test_a_rung_reranks_the_probe_as_a_selection_at_that_ratio(tiny):
    from qcfuse_core.eval.hooks import internals

    eng = _engine(tiny)
    steps = internals(eng).steps
    looked = steps.lookup(eng.frame.rag_pieces(Q, DOCS), "naive", streaming=False)
    prompt = steps.start_loading(looked, Planned("naive", frozenset())).prompt
    low = steps.select(prompt, "qcfuse", 0.15).selection
    high = steps.select(prompt, "qcfuse", 0.5).selection
    ctx = SelectionContext(eng.adapter, prompt, 0.5, options=steps.selection_options("qcfuse"))
    again = rechoose(ctx, low)
    assert again is not None and torch.equal(again.rows, high.rows)
    assert rechoose(ctx, get_selector("naive").select(ctx)) is None  # no scores to re-rank
    eng.close()


def test_off_by_config_by_request_and_for_an_uncalibrated_model(tiny):
    eng = _engine(tiny, threshold=1.0)
    off = eng.answer(Q, DOCS, max_new_tokens=4, guard=False)
    assert off.guard is not None and off.guard.action == "off" and not off.guard.escalated
    assert off.recomputed_tokens < off.context_tokens
    with pytest.raises(ValueError):
        eng.answer(Q, DOCS, guard="no")  # type: ignore[arg-type]
    eng.close()
    eng = _engine(tiny, enabled=False, threshold=1.0)
    assert eng.answer(Q, DOCS, max_new_tokens=4).guard.action == "off"
    eng.close()
    eng = _engine(tiny)  # the tiny model has no calibration: reported, nothing escalated
    r = eng.answer(Q, DOCS, max_new_tokens=4)
    assert r.guard.code == "uncalibrated" and not r.guard.escalated
    d = r.to_dict()["guard"]
    assert {"signal", "value", "threshold", "action", "reason", "code", "escalated"} <= set(d)
    eng.close()


def test_the_ceiling_holds_back_a_rung(tiny):
    eng = _engine(tiny, threshold=1.0, max_added_ms=0.0)
    r = eng.answer(Q, DOCS, max_new_tokens=4)
    assert r.guard.code == "ceiling" and r.guard.action == "kept" and not r.guard.rungs
    eng.close()


def test_user_calibration_is_found_by_fingerprint(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("QCFUSE_CACHE_DIR", str(tmp_path))
    assert resolve_threshold(tiny.fingerprint(), tiny.name)[0] is None
    (tmp_path / "guard").mkdir()
    (tmp_path / "guard" / f"{tiny.fingerprint()}.json").write_text(
        json.dumps({"signal": "first_token_margin", "threshold": 0.25})
    )
    t, source = resolve_threshold(tiny.fingerprint(), tiny.name)
    assert t == 0.25 and "calibration" in source
    eng = _engine(tiny)
    assert eng.answer(Q, DOCS, max_new_tokens=2).guard.threshold == 0.25
    eng.close()


def test_packaged_calibration_covers_the_embedded_model():
    t, source = resolve_threshold("0" * 16, "SmolLM2-135M-Instruct")
    assert t is not None and 0 < t < 1 and "packaged" in source


def test_threshold_calibration_catches_the_share_asked_for():
    margins = [(0.01, False), (0.05, False), (0.2, False), (0.1, True), (0.3, True), (0.6, True), (0.9, False)]
    t = pick_threshold(margins, 0.75)  # 3 of the 4 disagreeing
    assert 0.2 < t < 0.3
    r = rates(margins, t)
    assert r["catch_rate"] == 0.75 and r["escalation_rate"] == pytest.approx(4 / 7, abs=1e-4)
    assert pick_threshold([(0.5, True)], 0.9) == 0.0
    recs = [{"method": "qcfuse", "ratio": 0.15, "first_margin": m, "first_agree": float(a)} for m, a in margins]
    assert margins_from_records(recs + [{"method": "full", "ratio": None, "first_margin": 1, "first_agree": 1}]) == [
        (m, a) for m, a in margins
    ]


def _rec(method, ratio, margin, agree, share, ex=0.0):
    return dict(
        dataset="d", id="q", method=method, ratio=ratio, first_margin=margin, first_agree=agree,
        recompute_share=share, agree_exact=ex, ttft_ms=100 * share,
    )


def test_bench_guard_records_follow_the_ladder():
    base = [_rec("full", None, 0.9, 1.0, 1.0, 1.0), _rec("qcfuse", 0.15, 0.05, 0.0, 0.15), _rec("qcfuse", 0.5, 0.4, 1.0, 0.5, 1.0)]
    (g,) = guard_records(base, 0.1, 0.15, (0.5, 1.0))  # 0.5 clears the threshold: it stops there
    assert g["method"] == GUARDED_LABEL and g["guard_action"] == "ratio 0.5" and g["escalated"] == 1.0
    assert g["recompute_share"] == pytest.approx(0.65) and g["agree_exact"] == 1.0 and g["first_agree"] == 1.0
    assert g["ttft_ms"] == pytest.approx(65.0)  # both passes
    (g,) = guard_records(base, 0.5, 0.15, (0.5, 1.0))  # 0.5 does not: full prefill
    assert g["guard_action"] == "full" and g["recompute_share"] == pytest.approx(1.65)
    (g,) = guard_records(base, 0.01, 0.15, (0.5, 1.0))
    assert g["guard_action"] == "kept" and g["escalated"] == 0.0 and g["recompute_share"] == 0.15
    assert guard_records(base[:2], 0.1, 0.15, (0.5, 1.0)) == []  # the run lacks 0.5
    s = guard_summary(with_guard(base, (0.1, 0.15, (0.5, 1.0))), 0.15)
    assert s["all"]["catch_rate"] == 1.0 and s["all"]["escalation_rate"] == 1.0 and s["all"]["first_agree_after"] == 1.0


def test_an_escalated_request_does_not_stall_the_decoding_ones(tiny):
    """A request escalated to full prefill is prefilled, escalated and given its first token in
    the one scheduler step that admits it; the request already decoding gets its token in that
    step as in every other (counted in steps, not timed)."""
    eng = _engine(tiny, threshold=1.0)  # every guarded request climbs to full prefill
    sched = eng._scheduler
    real_step = sched.step
    log: list[dict[str, tuple[int, Status]]] = []
    jobs: dict = {}
    done = threading.Event()
    a_decoding = threading.Event()

    def step():
        real_step()
        snap = {k: (len(j.decoding.ids) if j.decoding else 0, j.request.status) for k, j in jobs.items()}
        log.append(snap)
        if snap.get("a", (0,))[0] >= 2:
            a_decoding.set()
        if len(snap) == 2 and all(s.final for _, s in snap.values()):
            done.set()

    sched.step = step  # type: ignore[method-assign]
    pieces = eng.frame.rag_pieces(Q, DOCS)
    _, jobs["a"] = eng._submit(pieces, lambda _: None, guard=False, max_new_tokens=24, ignore_eos=True)
    assert a_decoding.wait(60)
    _, jobs["b"] = eng._submit(pieces, lambda _: None, max_new_tokens=3, ignore_eos=True)
    assert done.wait(120)
    assert jobs["b"].request.guard_report.action == "full"
    a = [s["a"] for s in log]
    first = next(i for i, (n, _) in enumerate(a) if n >= 1)
    last = next(i for i, (_, st) in enumerate(a) if st.final)
    assert all(a[i + 1][0] == a[i][0] + 1 for i in range(first, last))  # one token for `a` in every step
    b = [s.get("b", (0, Status.WAITING)) for s in log]
    got = next(i for i, (n, _) in enumerate(b) if n >= 1)
    # b's lookup, fused prefill, both rungs and first token came in the step that admitted it
    # (b was waiting, then decoding), and a got its token in that step as in every other
    assert b[got - 1] == (0, Status.WAITING) and b[got][1] is Status.DECODING
    assert a[got][0] == a[got - 1][0] + 1
    eng.close()


def test_the_server_counts_escalations_by_action_and_reason(tiny):
    from qcfuse_core.serve.metrics import ServeMetrics
    from qcfuse_core.serve.protocol import fusion_stats

    eng = _engine(tiny, threshold=1.0)
    metrics = ServeMetrics(eng)
    r = eng.answer(Q, DOCS, max_new_tokens=2)
    metrics.finished("completions", r, 0.1)
    metrics.finished("completions", eng.answer(Q, DOCS, max_new_tokens=2, guard=False), 0.1)  # not counted
    text = metrics.render().decode()
    assert 'qcfuse_guard_escalations_total{action="full",reason="low_margin"} 1.0' in text
    assert fusion_stats(r, [None] * 4)["guard"] == r.guard.to_dict()
    eng.close()
