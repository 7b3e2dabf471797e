"""Quality metrics, dataset loaders (every format in ../shared/data), aggregation and the plot."""

import json
from pathlib import Path

import pytest
import torch

from qcfuse_core.eval import metrics as M
from qcfuse_core.eval.quality import ROW_KEYS, aggregate, format_summary, summarize
from qcfuse_core.eval.datasets import detect_format, load_dataset
from qcfuse_core.eval.plot import plot_quality

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


def test_summary_reads_the_targets_off_the_rows():
    """KL gap closed vs naive and contains vs full per set; scores averaged with every set weighing the same."""
    def row(ds, method, ratio, kl, contains, n=10, **kw):
        return dict({k: 0.5 for k in ROW_KEYS[4:]}, dataset=ds, method=method, ratio=ratio, n=n,
                    kl_first_token=kl, contains=contains, **kw)

    rows = [row("a", "full", None, 0.0, 0.30), row("a", "naive", None, 0.40, 0.10), row("a", "qcfuse", 0.3, 0.04, 0.28),
            row("b", "full", None, 0.0, 0.00, n=90), row("b", "naive", None, 0.20, 0.00),
            row("b", "qcfuse", 0.3, 0.03, 0.02, n=90, gold_nll=1.0)]
    s = summarize(rows)
    assert s["per_set"]["a"]["qcfuse@0.3"] == {"kl_gap_closed": 0.9, "contains_vs_full": -0.02}
    assert s["per_set"]["b"]["qcfuse@0.3"] == {"kl_gap_closed": 0.85, "contains_vs_full": 0.02}
    assert "full" not in s["per_set"]["a"] and "naive" not in s["per_set"]["b"]
    avg = s["averaged"]["qcfuse@0.3"]
    assert avg["datasets"] == 2 and avg["kl_first_token"] == 0.035 and avg["gold_nll"] == 0.75  # not n-weighted
    assert s["averaged"]["full"]["contains"] == 0.15
    text = format_summary(s)
    assert "| a | qcfuse@0.3 | 90.0% | -0.020 |" in text and "| b | qcfuse@0.3 | 85.0% | +0.020 |" in text
    json.dumps(s)
    # no naive row: no gap; no full row: no contains delta
    only = summarize([row("c", "qcfuse", 0.15, 0.1, 0.2)])
    assert only["per_set"]["c"]["qcfuse@0.15"] == {}


def _toy_example():
    from qcfuse_core.eval.datasets import Example

    return Example(id="toy", question="Who founded the Zephyr Institute?",
                   passages=("The Zephyr Institute studies ocean currents. It was founded in 1931 by the marine "
                             "biologist Ada Ferreira on the island of Cape Wrayth.",
                             "The Lantern Festival began in 1952 in the port of Cape Wrayth, where lanterns "
                             "are lit every autumn."),
                   answers=("Ada Ferreira",))


@pytest.mark.parametrize("target", ["gold", "full"])
def test_run_example_records_and_variants(smol_engine, target):
    """One example end to end on the embedded model: a record per method/variant with the
    row keys; `full` run through the fused path (every row recomputed) reproduces full
    prefill's scores; with target="full" the teacher-forced target is full's own answer."""
    from qcfuse_core.eval.quality import run_example

    variants = [("qcfuse", "qcfuse", 0.3, {}), ("qcfuse-spread2", "qcfuse", 0.3, {"spread": 2}),
                ("naive", "naive", None, {}), ("full-fused", "full", None, {}),
                ("qcfuse-dev", "qcfuse", 0.3, {"deviation_pool": 2})]
    recs = run_example(smol_engine, _toy_example(), None, None, {}, max_new=8, variants=variants, target=target)
    assert [r.get("variant", r["method"]) for r in recs] == ["full", "qcfuse", "qcfuse-spread2", "naive", "full-fused",
                                                             "qcfuse-dev"]
    # a selection narrowed inside the prefill (deviation_pool) keeps the teacher-forced rows
    assert recs[-1]["recompute_share"] == pytest.approx(recs[1]["recompute_share"], abs=0.02)
    # (were the gold rows dropped at layer 1, the scored rows would sit at the wrong positions)
    assert abs(recs[-1]["gold_nll"] - recs[1]["gold_nll"]) < 1.0 and recs[-1]["kl_first_token"] < recs[3]["kl_first_token"]
    for r in recs:
        assert set(ROW_KEYS) - {"dataset", "n"} <= set(r)  # every metric the table aggregates
        assert r["target"] == target
    full, fused_full = recs[0], recs[4]
    assert fused_full["kl_first_token"] < 1e-6 and fused_full["agree_exact"] == 1.0
    assert fused_full["gold_nll"] == pytest.approx(full["gold_nll"], abs=1e-4)
    assert recs[3]["kl_first_token"] > 1e-4  # naive concatenation differs from full prefill
    assert 0.25 < recs[1]["recompute_share"] < 0.45
    if target == "full":
        assert full["gold_tokens"] == len(smol_engine.caches.tokenize(full["answer"]))
    with pytest.raises(ValueError, match="target"):
        run_example(smol_engine, _toy_example(), ["full"], [], {}, max_new=4, target="answer")


def test_run_appends_records_and_skips_done_questions(smol_engine, tmp_path):
    from qcfuse_core.eval.quality import run

    ex = _toy_example()
    data = tmp_path / "toy_s.json"
    data.write_text(json.dumps([{"question": q, "answers": list(ex.answers), "ctxs": [{"title": "", "text": p} for p in ex.passages]}
                                for q in (ex.question, "When did the Lantern Festival begin?")]))
    jsonl = tmp_path / "toy.records.jsonl"
    first = run(smol_engine, str(data), ["full", "naive"], [], limit=None, max_new=4, jsonl=jsonl)
    assert len(first) == 4 and len(jsonl.read_text().splitlines()) == 4
    again = run(smol_engine, str(data), ["full", "naive"], [], limit=None, max_new=4, jsonl=jsonl)
    assert again == [] and len(jsonl.read_text().splitlines()) == 4
    rows = aggregate([json.loads(l) for l in jsonl.read_text().splitlines()])
    assert {(r["method"], r["n"]) for r in rows} == {("full", 2), ("naive", 2)}


def test_cli_aggregate_only_writes_table_summary_and_plot(tmp_path, capsys):
    """`qcfuse bench quality --aggregate-only` rebuilds the table, its summary and the plot from records."""
    from qcfuse_core.cli.commands import main

    base = {k: 0.0 for k in ROW_KEYS[4:]}
    recs = []
    for i in ("1", "2"):
        recs += [dict(base, dataset="d", id=i, method="full", ratio=None, contains=1.0),
                 dict(base, dataset="d", id=i, method="naive", ratio=None, kl_first_token=0.5),
                 dict(base, dataset="d", id=i, method="qcfuse", ratio=0.3, kl_first_token=0.05,
                      contains=1.0 if i == "1" else 0.0)]
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "q.json"
    assert main(["bench", "quality", "--dataset", "unused", "--aggregate-only", "--jsonl", str(jsonl),
                 "--json", str(out), "--plot", str(tmp_path / "q.png")]) == 0
    rows = json.loads(out.read_text())
    assert [(r["method"], r["n"]) for r in rows] == [("full", 2), ("naive", 2), ("qcfuse", 2)]
    summary = json.loads((tmp_path / "q.summary.json").read_text())
    assert summary["per_set"]["d"]["qcfuse@0.3"] == {"kl_gap_closed": 0.9, "contains_vs_full": -0.5,
                                                      "kl_gap_closed_ci": [0.9, 0.9],  # same KL on both questions
                                                      "contains_vs_full_ci": [-1.0, 0.0]}  # 0 and -1 resampled
    assert (tmp_path / "q.png").stat().st_size > 1000
    assert "| d | qcfuse@0.3 | 90.0% (90.0 to 90.0) | -0.500 (-1.000 to +0.000) |" in capsys.readouterr().out
    assert main(["bench", "quality", "--dataset", "x", "--aggregate-only", "--jsonl", str(tmp_path / "none.jsonl"),
                 "--json", str(out)]) != 0
    assert "no per-example records" in capsys.readouterr().err


def test_full_prefill_reference_is_stored_and_reused(smol_engine, tmp_path, monkeypatch):
    """run(reference=DIR) stores full prefill's outputs per question; a rerun of other methods
    reads them (HF's forward is not called again) and scores exactly as the first run did;
    a changed prompt invalidates the stored file; `full` alone builds no chunk caches."""
    from qcfuse_core.eval import quality as bq

    ex = _toy_example()
    data = tmp_path / "toy_s.json"
    data.write_text(json.dumps([{"question": ex.question, "answers": list(ex.answers),
                                 "ctxs": [{"title": "", "text": p} for p in ex.passages]}]))
    ref_dir = tmp_path / "ref"
    looked, built = [], []
    from qcfuse_core.cache.builder import ChunkBuilder
    from qcfuse_core.engine.pipeline import Steps

    real_lookup, real_build = Steps.lookup, ChunkBuilder.build
    monkeypatch.setattr(Steps, "lookup", lambda self, pieces, method, **kw: looked.append(method) or
                        real_lookup(self, pieces, method, **kw))
    monkeypatch.setattr(ChunkBuilder, "build", lambda self, todo, **kw: built.extend(todo) or
                        real_build(self, todo, **kw))
    first = bq.run(smol_engine, str(data), ["full"], [], limit=None, max_new=6, jsonl=tmp_path / "a.jsonl",
                   reference=ref_dir)
    assert looked == ["full"] and built == []  # full alone tokenizes only: no chunk cache is built
    path = bq.reference_path(ref_dir, "toy_s", first[0]["id"])
    assert path.is_file() and sorted(p.name for p in ref_dir.rglob("*")) == sorted(["toy_s", path.name])  # no temp file

    ref_ids, real_forward = _prompt_g(smol_engine, ex).token_ids, smol_engine.adapter.hf_forward

    def no_forward(ids, *a, **k):  # the reference's forward (prompt + gold) must not run again
        if torch.equal(torch.as_tensor(ids).cpu(), ref_ids.cpu()):
            raise AssertionError("full prefill ran again")
        return real_forward(ids, *a, **k)  # the answer-level fidelity's: prompt + a fused answer

    monkeypatch.setattr(smol_engine.adapter, "hf_forward", no_forward)
    again = bq.run(smol_engine, str(data), ["full", "qcfuse", "naive"], [0.3], limit=None, max_new=6,
                   jsonl=tmp_path / "b.jsonl", reference=ref_dir)
    assert [r["method"] for r in again] == ["full", "qcfuse", "naive"] and again[0]["full_from_reference"]
    for k in ("answer", "gold_nll", "agree_exact", "contains", "ttft_ms"):
        assert again[0][k] == first[0][k]
    assert again[1]["kl_first_token"] > 0 and again[2]["kl_first_token"] > again[1]["kl_first_token"]
    assert all(0.0 <= r["answer_agree"] <= 1.0 for r in again) and again[0]["answer_agree"] == 1.0
    # the same question with fewer new tokens is another reference: full prefill must run again
    with pytest.raises(AssertionError, match="ran again"):
        bq.run_example(smol_engine, ex, ["full"], [], {}, max_new=5, reference=path)
    monkeypatch.undo()
    # a damaged file is recomputed and replaced
    path.write_bytes(b"not a torch file")
    redo = bq.run_example(smol_engine, ex, ["full"], [], {}, max_new=6, reference=path)
    assert redo[0]["answer"] == first[0]["answer"] and "full_from_reference" not in redo[0]
    assert bq._load_reference(path, bq._reference_key(smol_engine, _prompt_g(smol_engine, ex), 6)) is not None
    with pytest.raises(ValueError, match="gold"):
        bq.run_example(smol_engine, ex, ["full"], [], {}, max_new=6, reference=path, target="full")


def _prompt_g(engine, ex):
    from qcfuse_core.model.fusion import FusedPrompt, Segment

    prompt, _, _ = engine._steps.fuse_pieces(engine.frame.rag_pieces(ex.question, list(ex.passages)), caches=False)
    return FusedPrompt(prompt.segments + [Segment("suffix", engine.caches.tokenize(ex.answers[0])[:64])])


def test_merge_rerun_replaces_methods_and_checks_full_prefill():
    from qcfuse_core.eval.quality import merge_rerun

    def rec(i, method, ratio=None, **kw):
        return dict(dict(dataset="d", id=i, method=method, ratio=ratio, answer="a", gold_nll=1.0), **kw)

    old = [rec("1", "full"), rec("1", "naive"), rec("1", "qcfuse", 0.3, kl_first_token=0.2),
           rec("2", "full"), rec("2", "naive"), rec("2", "qcfuse", 0.3, kl_first_token=0.3)]
    new = [rec("1", "full", gold_nll=1.00003), rec("1", "qcfuse", 0.3, kl_first_token=0.1)]
    merged, problems = merge_rerun(old, new, {"qcfuse"}, {"qcfuse": "qcfuse_old"})
    assert problems == []
    got = sorted((r["id"], r["method"], r.get("kl_first_token")) for r in merged)
    assert got == [("1", "full", None), ("1", "naive", None), ("1", "qcfuse", 0.1), ("1", "qcfuse_old", 0.2),
                   ("2", "full", None), ("2", "naive", None), ("2", "qcfuse_old", 0.3)]
    assert next(r for r in merged if r["id"] == "1" and r["method"] == "full")["gold_nll"] == 1.0  # the old one kept
    rows = aggregate(merged)  # question 2 has no new qcfuse yet: the table compares on question 1
    assert {(r["method"], r["n"]) for r in rows} == {("full", 1), ("naive", 1), ("qcfuse", 1), ("qcfuse_old", 1)}
    # filed beside the method: the old rows stay as they were, the new ones get the new name
    beside, _ = merge_rerun(old, new, {"qcfuse"}, {}, new_as={"qcfuse": "qcfuse_dev"})
    assert sorted((r["id"], r["method"]) for r in beside if "qcfuse" in r["method"]) == [
        ("1", "qcfuse"), ("1", "qcfuse_dev"), ("2", "qcfuse")]
    # without a rename the old rows go; a full prefill that does not reproduce is reported
    merged, problems = merge_rerun(old, [rec("2", "full", answer="b"), rec("3", "full")], {"qcfuse"}, {})
    assert all(r["method"] != "qcfuse" for r in merged)
    assert len(problems) == 2 and "2: full prefill differs" in problems[0] and "3: no old" in problems[1]


def test_summary_bootstrap_intervals_from_records():
    """With per-question records the summary carries seeded 95% paired bootstrap intervals that
    bracket the point estimates; identical questions give a zero-width interval."""
    import random

    rnd = random.Random(1)
    recs = []
    for i in range(60):
        kl_naive, kl_q = 0.3 + 0.2 * rnd.random(), 0.05 * rnd.random() * (10 if i % 20 == 0 else 1)
        c_full = float(rnd.random() < 0.3)
        recs += [dict(dataset="d", id=str(i), method="full", ratio=None, kl_first_token=0.0, contains=c_full),
                 dict(dataset="d", id=str(i), method="naive", ratio=None, kl_first_token=kl_naive, contains=c_full),
                 dict(dataset="d", id=str(i), method="qcfuse", ratio=0.3, kl_first_token=kl_q,
                      contains=0.0 if i % 10 == 0 else c_full)]
    rows = aggregate(recs)
    s = summarize(rows, recs)
    d = s["per_set"]["d"]["qcfuse@0.3"]
    lo, hi = d["kl_gap_closed_ci"]
    assert lo < d["kl_gap_closed"] < hi and hi - lo > 0.005
    clo, chi = d["contains_vs_full_ci"]
    assert clo <= d["contains_vs_full"] <= chi <= 0.0  # qcfuse only ever loses answers here
    assert summarize(rows, recs) == s  # seeded: the same intervals every time
    assert summarize(rows)["per_set"]["d"]["qcfuse@0.3"].keys() == {"kl_gap_closed", "contains_vs_full"}
    naive = s["per_set"]["d"]  # naive / full rows get no entry of their own
    assert set(naive) == {"qcfuse@0.3"}
    # every question alike: the interval has no width
    same = [dict(r, kl_first_token=0.01 if r["method"] == "qcfuse" else (0.1 if r["method"] == "naive" else 0.0),
                 contains=1.0) for r in recs]
    d2 = summarize(aggregate(same), same)["per_set"]["d"]["qcfuse@0.3"]
    assert d2["kl_gap_closed_ci"] == [0.9, 0.9] and d2["contains_vs_full_ci"] == [0.0, 0.0]


def test_quality_cli_selection_options_parse_and_reach_the_options():
    import argparse

    from qcfuse_core.cli.quality import _options, _selection_option
    from qcfuse_core.selection.options import parse_selection_options

    assert _selection_option("deviation_pool=2,query_rows=8") == {"deviation_pool": 2, "query_rows": 8}
    assert parse_selection_options("anchor_method=repeat,critical_layers=[3,5]") == {
        "anchor_method": "repeat", "critical_layers": [3, 5]}
    for bad, why in (("deviation_pool", "KEY=VALUE"), ("colour=red", "unknown selection options"),
                     ("deviation_pool=0.5", "deviation_pool"), ("spread=-1", "spread")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            _selection_option(bad)
    args = argparse.Namespace(anchor_method="keynorm", anchor_share=0.125, critical_layers=None, budget="fixed",
                              target_mass=0.8, option=[{"deviation_pool": 2}, {"query_rows": 4}])
    assert _options(args) == {"anchor_method": "keynorm", "anchor_share": 0.125, "budget": "fixed",
                              "target_mass": 0.8, "deviation_pool": 2, "query_rows": 4}
