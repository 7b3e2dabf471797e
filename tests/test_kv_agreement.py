"""eval/kv_agreement.py: fp8 KV's answers against the model dtype's and its self-agreement,
end to end on the tiny model (CPU), and the summary's arithmetic."""

import json

import pytest

from qcfuse_core.eval import kv_agreement as A
from qcfuse_core.model.testing import tiny_model


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", tokenizer=True)


def test_three_engines_answer_every_question(tiny, tmp_path):
    data = tmp_path / "qa.json"
    recs = [
        {"question": f"Which passage names item {i}?", "answers": [f"item {i}"],
         "ctxs": [{"title": "", "text": f"Passage {j} names item {i + j} and the harbour."} for j in range(3)]}
        for i in range(3)
    ]
    data.write_text(json.dumps(recs))
    args = A.parse_args(["--data", str(data), "--limit", "2", "--max-new-tokens", "5", "--methods", "qcfuse", "full"])
    records = A.answers(args, tiny, progress=lambda line: None)
    assert [(r["id"], r["method"]) for r in records] == [(i, m) for i in ("0", "1") for m in ("qcfuse", "full")]
    for r in records:
        assert all(len(r[run]) == 5 for run in A.RUNS)
        assert r["auto"] == r["auto_again"]  # fp32 on a CPU: the same answer every run
    rows = {(r["dataset"], r["method"]): r for r in A.summarize(records)}
    assert rows[("all", "full")]["n"] == 2 and rows[("qa", "qcfuse")]["self_answer"] == 1.0


def test_summary_counts_first_tokens_answers_and_prefixes():
    recs = [
        {"dataset": "d", "method": "m", "auto": [1, 2, 3], "auto_again": [1, 2, 3], "fp8": [1, 2, 4]},
        {"dataset": "d", "method": "m", "auto": [5, 6, 7], "auto_again": [5, 6, 7], "fp8": [5, 6, 7]},
        {"dataset": "d", "method": "m", "auto": [8, 9, 9], "auto_again": [8, 0, 9], "fp8": [0, 9, 9]},
    ]
    row = A.summarize(recs)[0]
    assert row["n"] == 3 and row["self_first"] == 1.0 and row["fp8_first"] == pytest.approx(2 / 3)
    assert row["self_answer"] == pytest.approx(2 / 3) and row["fp8_answer"] == pytest.approx(1 / 3)
    assert row["fp8_of_self_answer"] == pytest.approx(0.5) and row["fp8_prefix_tokens"] == pytest.approx(5 / 3)
    md = A.markdown([row], 3)
    assert "| d | m | 3 | 100% / 67% | 67% / 33% | 50% | 1.7 |" in md
