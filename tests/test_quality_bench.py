"""Quality metrics, dataset loaders (every format in ../shared/data), aggregation and the plot."""

import json
from pathlib import Path

import pytest
import torch

from qcfuse_core import metrics as M
from qcfuse_core.bench_quality import ROW_KEYS, aggregate
from qcfuse_core.datasets import detect_format, load_dataset
from qcfuse_core.plot import plot_quality

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def test_text_metrics():
    assert M.normalize("The  Eiffel-Tower!") == "eiffeltower"
    assert M.token_f1("the big red dog", "a red dog") == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))
    assert M.exact_match("The answer.", "answer") == 1.0
    assert M.contains("It was Paris, France.", "paris") == 1.0
    assert M.contains("Parisian food", "paris") == 0.0  # whole words only
    assert M.rouge_l("x b c d", "x c d e") == pytest.approx(0.75)
    assert M.rouge_l("a b c d", "a c d e") == pytest.approx(2 / 3)  # the article "a" is dropped
    assert M.best(M.exact_match, "croatia", ["Ozalj", "Croatia"]) == 1.0


def test_kl_and_nll():
    a = torch.tensor([2.0, 0.0, -1.0])
    assert M.kl_divergence(a, a) == pytest.approx(0.0, abs=1e-7)
    assert M.kl_divergence(a, torch.zeros(3)) > 0
    assert M.nll(torch.tensor([[0.0, 0.0]]), torch.tensor([1])) == pytest.approx(0.6931, abs=1e-4)


@pytest.mark.parametrize("rel,fmt,n_pass", [
    ("musique/musique_s.json", "cacheblend", 10),
    ("2wikimqa/wikimqa_s_clean.json", "cacheblend", 10),
    ("musique/musique_train.json", "musique", 20),
    ("hotpotqa/hotpotqa_train.json", "hotpotqa", 10),
    ("multinews/multi_news.jsonl", "longbench", None),
])
def test_loaders_read_every_shared_format(rel, fmt, n_pass):
    path = DATA / rel
    if not path.is_file():
        pytest.skip(f"{path} not present")
    exs = load_dataset(path, limit=2)
    assert len(exs) == 2
    for ex in exs:
        assert ex.passages and all(p.strip() for p in ex.passages) and ex.answers
        if n_pass:
            assert len(ex.passages) == n_pass
    if fmt == "hotpotqa":
        assert exs[0].passages[0].split("\n")[0] and exs[0].gold_passages
    if fmt == "musique":
        assert len(exs[0].gold_passages) >= 2
    if fmt == "longbench":
        assert exs[0].task == "summarization" and not any(p.startswith("Passage") for p in exs[0].passages)


def test_wikimqa_answers_are_flattened():
    path = DATA / "2wikimqa/wikimqa_s_clean.json"
    if not path.is_file():
        pytest.skip("no wikimqa file")
    assert all(isinstance(a, str) for a in load_dataset(path, limit=1)[0].answers)


def test_unknown_layout_raises():
    with pytest.raises(ValueError, match="cacheblend, musique, hotpotqa, longbench"):
        detect_format({"foo": 1})


def test_aggregate_compares_methods_on_common_questions(tmp_path):
    base = {k: 0.0 for k in ROW_KEYS[4:]}
    recs = [dict(base, dataset="d", id="1", method="full", ratio=None, kl_first_token=0.0),
            dict(base, dataset="d", id="2", method="full", ratio=None, kl_first_token=0.0),
            dict(base, dataset="d", id="1", method="qcfuse", ratio=0.3, kl_first_token=0.2, recompute_share=0.3)]
    rows = aggregate(recs)
    assert [(r["method"], r["ratio"], r["n"]) for r in rows] == [("full", None, 1), ("qcfuse", 0.3, 1)]
    assert set(ROW_KEYS) <= set(rows[1]) and rows[1]["kl_first_token"] == 0.2
    out = plot_quality(rows, tmp_path / "q.png")
    assert out.stat().st_size > 1000
    json.dumps(rows)
