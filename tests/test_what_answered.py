"""What answered a request, in one line (`FusionResult.what_answered`, issue 66 item 2): the
method and ratio actually used and the quality guard's action, before and after the engine
reports an escalation's answering rung in `method` / `ratio` (with `requested_*` saying what
was asked). Hand-built results for every guard outcome; the tiny random model for the engine."""

from __future__ import annotations

import pytest

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.engine.config import EngineConfig
from qcfuse_core.engine.guard import GuardConfig
from qcfuse_core.model.testing import tiny_model
from qcfuse_core.store import MemoryStore
from qcfuse_core.types import FusionResult, GuardReport

DOCS = [f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(12)) for i in range(4)]
Q = "Which document mentions word2x5?"


def _guard(**kw) -> GuardReport:
    return GuardReport(**{"value": 0.41, "threshold": 0.13, "action": "kept", "code": "margin_ok", **kw})


def _asked(guard: GuardReport | None, **kw) -> FusionResult:
    """A qcfuse@0.15 request's result (`kw`: what the engine reports instead)."""
    return FusionResult(**{"method": "qcfuse", "ratio": 0.15, "guard": guard, **kw})


def _escalated(rung: float, **kw) -> FusionResult:
    action = "full" if rung >= 1.0 else f"ratio {rung:g}"
    return _asked(_guard(value=0.05, action=action, code="low_margin", rungs=[(rung, 0.6)]), **kw)


FULL_RUNG = "full (escalated by the guard from qcfuse @ 0.15: margin 0.05 < 0.13)"


@pytest.mark.parametrize(
    "result, line",
    [
        (_asked(_guard()), "qcfuse @ 0.15 · guard: kept (margin 0.41 ≥ 0.13)"),
        (_escalated(1.0), FULL_RUNG),  # today's engine: method / ratio as asked, the rungs say what answered
        (_escalated(0.5), "qcfuse @ 0.50 (escalated by the guard from qcfuse @ 0.15: margin 0.05 < 0.13)"),
        # the engine reporting the answering rung, with what was asked beside it
        (_escalated(1.0, method="full", ratio=1.0, requested_method="qcfuse", requested_ratio=0.15), FULL_RUNG),
        (
            _asked(_guard(value=0.05, code="ceiling", reason="margin below the threshold; full would pass the ceiling")),
            "qcfuse @ 0.15 · guard: kept (margin 0.05 < 0.13; margin below the threshold; full would pass the ceiling)",
        ),
        (_asked(GuardReport(reason="turned off for this request")), "qcfuse @ 0.15 · guard: off (turned off for this request)"),
        (
            FusionResult(method="full", guard=GuardReport(code="not_guarded", reason="full prefill: nothing fused to guard")),
            "full · guard: off (full prefill: nothing fused to guard)",
        ),
        (FusionResult(method="epic", ratio=0.2), "epic @ 0.20"),  # no guard report at all
    ],
    ids=["kept", "full-rung", "ratio-rung", "full-rung-reported", "ceiling", "off", "not-guarded", "no-report"],
)
def test_the_line_for_each_guard_outcome(result, line):
    assert result.what_answered() == line
    d = result.to_dict()
    assert d["answered"] == line
    assert (d["requested_method"], d["requested_ratio"]) == (result.requested_method, result.requested_ratio)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", tokenizer=True)


def _engine(tiny, threshold: float) -> QCFuseEngine:
    eng = QCFuseEngine(tiny, store=MemoryStore(), config=EngineConfig(guard=GuardConfig(threshold=threshold)))
    eng.build_chunks(DOCS)
    return eng


def test_an_engine_escalation_says_full_answered(tiny):
    """threshold 1.0: every margin is below it, so the guard escalates to full prefill."""
    with _engine(tiny, threshold=1.0) as eng:
        r = eng.answer(Q, DOCS, max_new_tokens=2)
    g = r.guard
    assert g is not None and g.action == "full"
    asked = "qcfuse @ 0.15" if r.requested_method is not None or r.ratio is not None else "qcfuse"
    assert r.what_answered() == f"full (escalated by the guard from {asked}: margin {g.value:.2f} < 1.00)"
    assert r.requested_method in (None, "qcfuse")


def test_an_engine_answer_the_guard_kept(tiny):
    with _engine(tiny, threshold=0.0) as eng:
        r = eng.answer(Q, DOCS, max_new_tokens=2)
    assert r.what_answered() == f"qcfuse @ 0.15 · guard: kept (margin {r.guard.value:.2f} ≥ 0.00)"
