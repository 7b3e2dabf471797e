"""The audit of live traffic (engine/audit.py) and the fidelity target, on a tiny model: checks
run only in idle scheduler steps, sampling follows the share, results are per configuration
and band in engine.stats() and FusionResult, a restart keeps them, and the target starts
conservative and speeds up as evidence accrues."""

from __future__ import annotations

import contextlib
import io
import json
import threading

import pytest
from qc_fixtures import SERVE_DOCS, engine_config, tiny  # noqa: F401  (tiny: a fixture)

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.engine.audit import (
    CONSERVATIVE_RATIO,
    AuditConfig,
    Ledger,
    band,
    bootstrap,
    config_label,
    wilson,
)
from qcfuse_core.eval.fidelity import AnswerFidelity
from qcfuse_core.store import MemoryStore


def _cli(argv: list[str]) -> tuple[int, str]:
    from qcfuse_core.cli.commands import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(argv)
    return code, buf.getvalue()


QUESTIONS = [f"Which document mentions word{i % 4}x{i % 10}?" for i in range(12)]


def make(tiny, tmp_path, **kw) -> QCFuseEngine:  # noqa: F811
    audit = kw.pop("audit", AuditConfig(directory=str(tmp_path / "fidelity")))
    eng = QCFuseEngine(tiny, store=MemoryStore(), config=engine_config(audit=audit, **kw))
    eng.build_chunks(SERVE_DOCS)
    return eng


def test_checks_run_only_in_steps_with_no_request_waiting_or_running(tiny, tmp_path):  # noqa: F811
    eng = make(tiny, tmp_path)
    try:
        sched = eng._scheduler
        seen: list[tuple[int, int, int]] = []
        real = eng.audit.check

        def check(sample, shadow=False):
            s = sched.stats()
            seen.append((s.steps, s.waiting, s.running))
            return real(sample, shadow)

        eng.audit.check = check  # type: ignore[method-assign]
        busy_steps: list[int] = []
        real_step = sched.step

        def step():  # every step in which a request waits or runs, by its index
            s = sched.stats()
            if s.waiting or s.running:
                busy_steps.append(s.steps)
            real_step()

        sched.step = step  # type: ignore[method-assign]
        streams = [eng.stream(q, SERVE_DOCS[:3], max_new_tokens=6) for q in QUESTIONS[:6]]
        threads = [threading.Thread(target=lambda s=s: list(s)) for s in streams]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(s.result is not None for s in streams)
        eng.audit.wait(60)
        assert len(seen) == 6  # every request audited (warm-up), and every check ran ...
        assert all(w == 0 and r == 0 for _, w, r in seen)  # ... with no request waiting or running
        assert busy_steps and min(step for step, _, _ in seen) > max(busy_steps)  # after the live steps
        st = eng.stats()
        assert st.scheduler.idle_tasks == 6 and st.fidelity["audited"] == 6 and st.fidelity["waiting"] == 0
    finally:
        eng.close()


def test_results_per_configuration_and_band_in_stats_and_in_the_result(tiny, tmp_path):  # noqa: F811
    eng = make(tiny, tmp_path)
    try:
        for q in QUESTIONS[:3]:
            eng.answer(q, SERVE_DOCS[:3], max_new_tokens=6)
        eng.answer(QUESTIONS[0], SERVE_DOCS[:3], ratio=0.3, max_new_tokens=6)
        eng.answer(QUESTIONS[0], SERVE_DOCS[:3], method="full", max_new_tokens=6)  # nothing fused: not audited
        eng.answer(QUESTIONS[0], SERVE_DOCS[:3], temperature=0.8, seed=1, max_new_tokens=6)  # sampled: not audited
        eng.audit.wait(60)
        fid = eng.stats().fidelity
        assert fid["fingerprint"] == tiny.fingerprint() and fid["samples"] == 4 and fid["eligible"] == 4
        assert set(fid["configs"]) == {"qcfuse@0.15", "qcfuse@0.3"}
        c = fid["configs"]["qcfuse@0.15"]
        assert c["n"] == 3 and 0 <= c["agree"] <= 1 and c["agree_ci"][0] <= c["agree"] <= c["agree_ci"][1]
        shortest = band([len(eng.caches.tokenize(d)) for d in SERVE_DOCS[:3]])
        assert c["first_agree_ci"] is not None and set(c["bands"]) == {shortest}  # by the shortest chunk
        got = eng.answer(QUESTIONS[1], SERVE_DOCS[:3], max_new_tokens=6)
        assert got.fidelity is not None and got.fidelity["config"] == "qcfuse@0.15"
        assert got.fidelity["status"] == "fixed" and got.fidelity["measured"]["n"] == 3
        assert got.to_dict()["fidelity"] == got.fidelity
    finally:
        eng.close()


def test_the_share_after_warm_up_and_a_restart_keeps_the_ledger(tiny, tmp_path):  # noqa: F811
    cfg = AuditConfig(directory=str(tmp_path / "fid"), warmup=2, share=0.5)
    eng = make(tiny, tmp_path, audit=cfg)
    try:
        for q in QUESTIONS[:6]:
            eng.answer(q, SERVE_DOCS[:3], max_new_tokens=4)
            eng.audit.wait(60)
        assert eng.stats().fidelity["samples"] == 4  # 2 of warm-up, then every second request
    finally:
        eng.close()
    path = tmp_path / "fid" / f"{tiny.fingerprint()}.json"
    assert path.is_file() and not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]
    again = make(tiny, tmp_path, audit=cfg)
    try:
        assert again.stats().fidelity["samples"] == 4
        assert again.stats().fidelity["configs"]["qcfuse@0.15"]["n"] == 4
    finally:
        again.close()
    code, out = _cli(["fidelity", "--dir", str(tmp_path / "fid")])
    assert code == 0 and f"({tiny.fingerprint()}): 4 live answers audited" in out
    assert "| qcfuse@0.15 | 4 |" in out and "by chunk-length band" in out
    code, out = _cli(["fidelity", "--dir", str(tmp_path / "fid"), "--json"])
    assert json.loads(out)[0]["configs"]["qcfuse@0.15"]["n"] == 4
    assert _cli(["fidelity", "--dir", str(tmp_path / "none")])[1].startswith("no audited answers yet")
    path.write_text("{not json")
    damaged = make(tiny, tmp_path, audit=cfg)
    try:
        assert damaged.stats().fidelity["samples"] == 0  # an unreadable ledger starts anew
    finally:
        damaged.close()


def _fid(agree: float) -> AnswerFidelity:
    n = 10
    k = round(agree * n)
    return AnswerFidelity(n, k > 0, k, k / n, None if k == n else 0.1)


def test_the_target_picks_the_cheapest_configuration_that_meets_it_on_a_fixed_set(tiny, tmp_path):  # noqa: F811
    eng = make(tiny, tmp_path, fidelity=0.8, audit=AuditConfig(directory=str(tmp_path / "f"), min_samples=4))
    try:
        fixed = {0.15: [0.6, 0.7, 0.8, 0.7], 0.3: [0.9, 0.8, 0.8, 0.9], 0.5: [1.0, 1.0, 0.9, 1.0]}
        for ratio, values in fixed.items():
            for v in values:
                eng.audit.add(config_label("qcfuse", ratio), "<=80", _fid(v))  # saved: the strict engine reads it
        c = eng.audit.choose("qcfuse")
        assert (c.ratio, c.status) == (0.3, "measured")  # 0.15 averages 0.70 < 0.8; 0.3 averages 0.85
        got = eng.answer(QUESTIONS[0], SERVE_DOCS[:3], max_new_tokens=4)
        assert got.requested_ratio == 0.3 and got.fidelity["status"] == "measured"
        assert got.fidelity["measured"]["agree"] >= 0.8 and got.fidelity["target"] == 0.8
        strict = make(tiny, tmp_path, fidelity=0.99, audit=AuditConfig(directory=str(tmp_path / "f"), min_samples=4))
        try:
            c = strict.audit.choose("qcfuse")
            assert (c.method, c.ratio, c.status) == ("full", None, "full") and "no fused configuration" in c.reason
            got = strict.answer(QUESTIONS[0], SERVE_DOCS[:3], max_new_tokens=4)
            assert got.method == "full" and got.fidelity["status"] == "full"
        finally:
            strict.close()
    finally:
        eng.close()


def test_without_evidence_the_target_is_conservative_and_speeds_up_as_evidence_accrues(tiny, tmp_path):  # noqa: F811
    cfg = AuditConfig(directory=str(tmp_path / "f"), min_samples=3, warmup=100)
    eng = make(tiny, tmp_path, fidelity=0.5, audit=cfg)
    try:
        first = eng.answer(QUESTIONS[0], SERVE_DOCS[:3], max_new_tokens=6)
        assert first.requested_ratio == CONSERVATIVE_RATIO and first.fidelity["status"] == "conservative"
        assert "not enough evidence" in first.fidelity["reason"]
        ratios = [first.requested_ratio]
        for q in QUESTIONS[1:10]:
            eng.audit.wait(120)  # the live check, then a shadow sample at the least-measured candidate
            eng.audit.wait(120)
            ratios.append(eng.answer(q, SERVE_DOCS[:3], max_new_tokens=6).requested_ratio)
        fid = eng.stats().fidelity
        assert fid["shadow"] > 0
        assert ratios[-1] < CONSERVATIVE_RATIO, (ratios, fid["configs"])  # faster once measured
        assert fid["choice"]["status"] == "measured"
        assert fid["configs"][fid["choice"]["config"]]["agree"] >= 0.5
    finally:
        eng.close()


def test_settings_are_checked():
    with pytest.raises(ValueError, match="share"):
        AuditConfig(share=0)
    with pytest.raises(ValueError, match="min_samples"):
        AuditConfig(min_samples=0)
    with pytest.raises(ValueError, match="fidelity"):
        engine_config(fidelity=1.5)
    assert band([200, 60]) == "<=80" and band([300]) == "257-1024" and band([]) == "none"
    lo, hi = wilson(8, 10)
    assert lo < 0.8 < hi and wilson(0, 0) is None
    lo, hi = bootstrap([0.5, 1.0, 0.75, 0.9])
    assert lo <= 0.7875 <= hi
    led = Ledger("x", "m", None)
    led.add("qcfuse@0.15", "<=80", _fid(0.5), shadow=True)
    assert led.samples == 0 and led.to_dict()["configs"]["qcfuse@0.15"]["n"] == 1  # shadows: not live samples


def test_a_model_calibrated_nowhere_gets_its_guard_threshold_from_its_audit(tiny, tmp_path):  # noqa: F811
    eng = make(tiny, tmp_path, audit=AuditConfig(directory=str(tmp_path / "f"), min_samples=3))
    try:
        first = eng.answer(QUESTIONS[0], SERVE_DOCS[:3], max_new_tokens=4)
        assert first.guard is not None and first.guard.code == "uncalibrated"  # the tiny model has no calibration
        for q in QUESTIONS[1:4]:
            eng.audit.wait(60)
            eng.answer(q, SERVE_DOCS[:3], max_new_tokens=4)
        eng.audit.wait(60)
        pairs = eng.audit.ledger.configs["qcfuse@0.15"]["margins"]
        assert len(pairs) == 4 and not all(a for _, a in pairs)  # some fused first tokens parted
        threshold = eng.audit.guard_threshold("qcfuse", 0.15)
        assert threshold is not None and threshold > min(m for m, a in pairs if not a)
        got = eng.answer(QUESTIONS[5], SERVE_DOCS[:3], max_new_tokens=4)
        assert got.guard.threshold == threshold and "self-calibration" in got.guard.source
    finally:
        eng.close()


def test_serve_takes_a_fidelity_target():
    from qcfuse_core.cli.commands import build_parser
    from qcfuse_core.engine.audit import DEFAULT_FIDELITY

    parse = build_parser().parse_args
    assert parse(["serve"]).fidelity is None
    assert parse(["serve", "--fidelity"]).fidelity == DEFAULT_FIDELITY
    assert parse(["serve", "--fidelity", "0.9"]).fidelity == 0.9
    with pytest.raises(SystemExit):
        parse(["serve", "--fidelity", "1.5"])


def test_the_target_decides_by_the_requests_chunk_length_band_before_its_fused_pass(tiny, tmp_path):  # noqa: F811
    eng = make(tiny, tmp_path, fidelity=0.8, audit=AuditConfig(directory=str(tmp_path / "f"), min_samples=4))
    try:
        for _ in range(4):  # short chunks lose more at 0.15 than long ones; 0.3 holds them
            eng.audit.add("qcfuse@0.15", "<=80", _fid(0.5))
            eng.audit.add("qcfuse@0.3", "<=80", _fid(0.9))
        for _ in range(8):
            eng.audit.add("qcfuse@0.15", ">1024", _fid(1.0))
        assert eng.audit.summary()["configs"]["qcfuse@0.15"]["agree"] >= 0.8  # over every band it meets 0.8
        assert eng.audit.choose("qcfuse").ratio == 0.15
        assert eng.audit.choose("qcfuse", ">1024").ratio == 0.15
        short = eng.audit.choose("qcfuse", "<=80")
        assert short.ratio == 0.3 and "on chunks of <=80 tokens" in short.reason
        short_docs = [d[:40] for d in SERVE_DOCS[:3]]
        assert band([len(eng.caches.tokenize(d)) for d in short_docs]) == "<=80"
        got = eng.answer(QUESTIONS[0], short_docs, max_new_tokens=2)  # chosen before its fused pass
        assert got.requested_ratio == 0.3 and "<=80" in got.fidelity["reason"]
        long_docs = [" ".join([d] * 12) for d in SERVE_DOCS[:3]]
        assert band([len(eng.caches.tokenize(d)) for d in long_docs]) == ">1024"
        assert eng.answer(QUESTIONS[0], long_docs, max_new_tokens=2).requested_ratio == 0.15
    finally:
        eng.close()
