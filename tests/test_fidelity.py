"""Answer-level fidelity (eval/fidelity.py): the one teacher-forced full-prefill forward gives
what a decode-by-decode comparison gives - full prefill's cache stepped along the answer,
its greedy choice read at each step - on a tiny model and on the embedded SmolLM2-135M."""

from __future__ import annotations

import pytest
import torch
from qc_fixtures import SERVE_DOCS, _engine, tiny  # noqa: F401  (tiny: a fixture)

from qcfuse_core.eval import fidelity as F
from qcfuse_core.model.fusion import KVCache, decode_step, fill_from_hf


def stepwise(adapter, prompt_ids: torch.Tensor, answer: list[int]) -> tuple[list[int], list[float]]:
    """Full prefill of the prompt, then one decode step per answer token: full prefill's greedy
    choice at each answer position (given the answer so far) and its margin there."""
    logits, kv = adapter.hf_forward(prompt_ids, keep=1)
    cache = KVCache(adapter, int(prompt_ids.numel()) + len(answer) + 1)
    fill_from_hf(cache, kv)
    rows = [logits[-1]]
    for t in answer[:-1]:
        rows.append(decode_step(adapter, cache, int(t)))
    stacked = torch.stack(rows)
    return stacked.argmax(-1).tolist(), F.margins(stacked).tolist()


def by_steps(choices: list[int], margins: list[float], answer: list[int]) -> dict:
    same = [c == a for c, a in zip(choices, answer)]
    prefix = same.index(False) if False in same else len(same)
    return dict(
        tokens=len(answer),
        first_agree=same[0],
        prefix=prefix,
        agree=sum(same) / len(same),
        split_margin=None if prefix == len(same) else margins[prefix],
    )


def check_equal(adapter, prompt_ids: torch.Tensor, answer: list[int]) -> F.AnswerFidelity:
    got = F.measure(adapter, prompt_ids, answer)
    want = by_steps(*stepwise(adapter, prompt_ids, answer), answer)
    d = got.to_dict()
    assert {k: d[k] for k in ("tokens", "first_agree", "prefix")} == {
        k: want[k] for k in ("tokens", "first_agree", "prefix")
    }
    assert d["agree"] == pytest.approx(want["agree"])
    if want["split_margin"] is None:
        assert d["split_margin"] is None
    else:
        assert d["split_margin"] == pytest.approx(want["split_margin"], abs=1e-4)
    return got


def test_teacher_forced_equals_decode_by_decode_on_a_tiny_model(tiny):  # noqa: F811
    eng = _engine(tiny, ratio=0.15)
    try:
        fused = eng.answer("Which document mentions word1x3?", SERVE_DOCS[:3], max_new_tokens=12, guard=False)
        assert fused.prompt_ids is not None and fused.token_ids
        got = check_equal(tiny, fused.prompt_ids, fused.token_ids)
        full = eng.answer("Which document mentions word1x3?", SERVE_DOCS[:3], method="full", max_new_tokens=12)
        same = F.measure(tiny, full.prompt_ids, full.token_ids)  # full prefill agrees with itself
        assert same.agree == 1.0 and same.prefix == same.tokens == len(full.token_ids) and same.split_margin is None
        # an answer that parts from full prefill's: its second token replaced
        other = list(full.token_ids)
        other[1] = (other[1] + 1) % tiny.model.config.vocab_size
        parted = check_equal(tiny, full.prompt_ids, other)
        assert parted.first_agree and parted.prefix == 1 and parted.split_margin is not None
        assert got.tokens == len(fused.token_ids)
    finally:
        eng.close()


def test_teacher_forced_equals_decode_by_decode_on_the_embedded_model(smol_engine):
    docs = [
        "The Orlen Observatory sits on Mount Tavel. Its telescope was installed in 1998 by Paul Renick.",
        "The ship Marianne Holt sank in 1884. The lifeboat's captain, Anna Voss, received a medal.",
    ]
    q = "Who installed the telescope of the Orlen Observatory?"
    res = smol_engine.answer(q, docs, ratio=0.15, guard=False, max_new_tokens=16)
    check_equal(smol_engine.adapter, res.prompt_ids, res.token_ids)
    full = smol_engine.answer(q, docs, method="full", max_new_tokens=16)
    other = list(full.token_ids[:8]) + list(res.token_ids[:8])  # parts somewhere inside
    check_equal(smol_engine.adapter, full.prompt_ids, other)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="one logits row per answer token"):
        F.from_logits(torch.zeros(3, 5), torch.tensor([1, 2]))
    empty = F.from_logits(torch.empty(0, 0), torch.tensor([], dtype=torch.int64))
    assert empty.tokens == 0 and empty.agree == 1.0
