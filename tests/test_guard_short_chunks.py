"""Short chunks on the embedded model: the case issue 53 opened with. Ten chunks of 36-55
tokens, one invented fact each; at the default ratio (0.15) a chunk gets about 7 recomputed
tokens. On the question below full prefill names the lifeboat's captain, fused prefill at
the default loses her; the guard's escalation to full prefill gives full prefill's answer,
and the shipped guard does not see it (its signal is the first token's margin, and this
answer parts from full prefill's only at its tenth token): docs/benchmarks.md, "Quality guard"."""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.slow  # three 24-token answers on the embedded model: tens of seconds on 2 cores

from qcfuse_core.engine.config import EngineConfig
from qcfuse_core.engine.guard import GuardConfig
from qcfuse_core.eval.hooks import internals
from qcfuse_core.store import MemoryStore

CHUNKS = [
    "The Varnholt Bridge crosses the river Elme in the town of Kessby. It was opened in 1937 after six years of "
    "work, and its engineer was Lisa Brandt, who later designed two dams in the north of the country.",
    "Kessby is a small market town known for its Saturday cheese fair. About nine thousand people live there, and "
    "the town hall, built of red brick, stands on the main square beside an old linden tree.",
    "The Orlen Observatory sits on Mount Tavel at 2,140 metres. Its main telescope, named Aurora, has a mirror 3.6 "
    "metres wide and was installed in 1998 by a team led by astronomer Paul Renick.",
    "Mount Tavel is the highest peak of the Sarn range. Hikers reach the summit in about five hours from the "
    "village of Dorrow, and snow covers the upper slopes from November until late May.",
    "The painter Ida Morrow was born in Lansford in 1902. Her best known work, The Grey Harbour, shows fishing "
    "boats at dawn and now hangs in the city museum of Brell, where it was given in 1961.",
    "The city museum of Brell opened in 1890 in a former grain store. It holds about forty thousand objects, from "
    "Roman coins to modern posters, and its café on the roof looks over the old harbour.",
    "The chemist Oskar Lind discovered the compound lindite in 1921 while testing soil samples from the Ravel "
    "valley. The pale green crystal glows faintly under ultraviolet light and melts at 412 degrees.",
    "The Ravel valley is farmed mostly for apples and pears. A narrow railway runs along the valley floor, and in "
    "autumn the villages hold harvest markets that draw visitors from the coast.",
    "The ship Marianne Holt sank in the Gelt Sea in 1884 during a winter storm. All twenty-two crew were rescued "
    "by the lifeboat from Pell Point, whose captain, Anna Voss, received a medal for it.",
    "Pell Point is a rocky headland with a white lighthouse built in 1851. Seals rest on the rocks below it, and "
    "a path along the cliffs links the lighthouse to the fishing village of Harra.",
]
QUESTION = "Who was the captain of the lifeboat that rescued the crew of the Marianne Holt?"
FACT = "Voss"
NEW = 24


@pytest.fixture(scope="module")
def short(smol_engine):
    docs = CHUNKS[:]
    random.Random(0).shuffle(docs)
    engine = internals(smol_engine).replace(store=MemoryStore())
    engine.build_chunks(docs)
    tokens = [len(engine.caches.tokenize(c)) for c in docs]
    assert 30 <= min(tokens) and max(tokens) <= 80  # short chunks
    full = engine.answer(QUESTION, docs, method="full", max_new_tokens=NEW)
    return engine, docs, full


def test_the_default_loses_a_fact_full_prefill_keeps_and_escalation_gets_it_back(short):
    engine, docs, full = short
    fused = engine.answer(QUESTION, docs, guard=False, max_new_tokens=NEW)
    assert FACT in full.text and FACT not in fused.text  # the case: fusion at 0.15 lost the fact
    assert fused.recompute_share < 0.2  # the default ratio (plus the glue between chunks)
    forced = internals(engine).replace(config=EngineConfig(guard=GuardConfig(threshold=1.0, ladder=(1.0,))))
    got = forced.answer(QUESTION, docs, max_new_tokens=NEW)
    assert got.guard is not None and got.guard.action == "full"
    assert got.token_ids == full.token_ids and FACT in got.text


@pytest.mark.xfail(
    strict=True,
    reason="the first-token margin does not see a divergence that starts later in the answer (issue 53)",
)
def test_the_shipped_guard_keeps_the_fact(short):
    engine, docs, full = short
    got = engine.answer(QUESTION, docs, max_new_tokens=NEW)
    assert got.guard is not None and got.guard.threshold is not None  # the packaged calibration
    assert FACT in got.text


QUESTIONS = [
    QUESTION,
    "Who was the engineer of the Varnholt Bridge?",
    "Who led the team that installed the Aurora telescope?",
    "In which year did Oskar Lind discover lindite?",
    "Where does The Grey Harbour hang?",
    "When was the lighthouse on Pell Point built?",
]


def test_the_default_fidelity_target_keeps_short_chunks_at_full_prefills_answers(smol_engine, tmp_path):
    """The fidelity target (engine/audit.py) at its recommended value on these short chunks:
    conservative (0.5) until the audit has evidence, which it gathers in idle time - the live
    answers checked and the cheaper ratios answered and checked beside them - and then, since
    no fused ratio reaches the target on chunks this short (docs/benchmarks.md, "Fidelity"),
    full prefill: its answers agree with full prefill's at the target."""
    from qcfuse_core.engine.audit import DEFAULT_FIDELITY, AuditConfig
    from qcfuse_core.eval.fidelity import measure

    docs = CHUNKS[:]
    random.Random(0).shuffle(docs)
    cfg = EngineConfig(fidelity=DEFAULT_FIDELITY, audit=AuditConfig(directory=str(tmp_path), min_samples=4))
    engine = internals(smol_engine).replace(
        store=MemoryStore(), config=cfg
    )  # shares smol_engine's text index: not closed
    engine.build_chunks(docs)
    statuses = []
    for q in QUESTIONS:
        got = engine.answer(q, docs, max_new_tokens=NEW)
        statuses.append(got.fidelity["status"])
        engine.audit.wait(300)
        engine.audit.wait(300)  # the live check, then its shadow answer and check
    assert statuses[0] == "conservative"
    final = [engine.answer(q, docs, max_new_tokens=NEW) for q in QUESTIONS[:3]]
    assert all(r.fidelity["status"] == "full" for r in final), [r.fidelity for r in final]
    agree = [measure(engine.adapter, r.prompt_ids, r.token_ids).agree for r in final]
    assert sum(agree) / len(agree) >= DEFAULT_FIDELITY
    assert "<=80" in engine.stats().fidelity["configs"]["qcfuse@0.5"]["bands"]
