"""`qcfuse bench ttft` smoke: a tiny model through the CLI, JSON rows with the required keys."""

import json

from qcfuse_core.cli.commands import main

REQUIRED = {"method", "ratio", "tier", "device", "context_tokens", "ttft_ms_median", "ttft_ms_min",
            "ttft_ms_max", "speedup_vs_full"}


def test_bench_ttft_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "ttft.json"
    rc = main(["bench", "ttft", "--shape", "tiny-llama", "--dtype", "fp32", "--chunks", "2", "--chunk-tokens", "24",
               "--query-tokens", "4", "--tier", "host", "disk", "--methods", "full", "qcfuse", "naive",
               "--ratios", "0.3", "--runs", "2", "--warmup", "1", "--store", str(tmp_path / "store"),
               "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {(r["tier"], r["method"], r["ratio"]) for r in rows} == {
        (t, m, r) for t in ("host", "disk") for m, r in (("full", None), ("qcfuse", 0.3), ("naive", None))}
    for r in rows:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        # context: the two chunks and the glue between them ("\n\n", two bytes), as the engine counts it
        assert r["context_tokens"] == 2 * 24 + 2 and r["ttft_ms_min"] <= r["ttft_ms_median"] <= r["ttft_ms_max"]
    assert any((tmp_path / "store").glob("rates-*.json"))
    out_text = capsys.readouterr().out
    assert "| host | qcfuse | 0.30 |" in out_text
    assert "load_average" in data["env"]
    # one new token (the default): TTFT alone, no decode columns
    assert "decode ms/token" not in out_text and data["env"]["timed_call"] == "engine.answer"
    assert all(r["max_new_tokens"] == 1 and r["decode_ms_per_token_median"] is None for r in rows)


def test_bench_ttft_max_new_tokens_reports_decode_and_end_to_end(tmp_path, capsys):
    """--max-new-tokens 12: each answer is streamed to its full length (EOS ignored); rows add
    decode ms/token (the mean gap after the first token) and the end-to-end time, which is at
    least the TTFT run by run; the table shows both."""
    out = tmp_path / "e2e.json"
    rc = main(["bench", "ttft", "--shape", "tiny-llama", "--dtype", "fp32", "--chunks", "2", "--chunk-tokens", "24",
               "--query-tokens", "4", "--tier", "host", "--methods", "full", "qcfuse", "--ratios", "0.3",
               "--runs", "2", "--warmup", "1", "--breakdown-runs", "1", "--max-new-tokens", "12",
               "--store", str(tmp_path / "store"), "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["env"]["timed_call"] == "engine.stream"
    rows = data["rows"]
    assert [r["method"] for r in rows] == ["full", "qcfuse"]
    for r in rows:
        assert r["max_new_tokens"] == 12 and r["new_tokens"] == 12
        assert all(e >= t > 0 for e, t in zip(r["e2e_ms_runs"], r["ttft_ms_runs"]))
        assert r["e2e_ms_median"] >= r["ttft_ms_median"]
        assert 0 < r["decode_ms_per_token_median"] < r["e2e_ms_median"]
    table = capsys.readouterr().out
    assert "| decode ms/token | end-to-end ms (tokens) |" in table
    assert f"| {rows[1]['e2e_ms_median']:.1f} (12) |" in table


def test_bench_ttft_rejects_unknown_method(tmp_path, capsys):
    rc = main(["bench", "ttft", "--shape", "tiny-llama", "--chunks", "1", "--chunk-tokens", "8", "--methods", "nope",
               "--runs", "1", "--warmup", "0", "--store", str(tmp_path)])
    assert rc == 2 and "unknown method 'nope'" in capsys.readouterr().err


def test_bench_ttft_variants_time_qcfuse_with_other_options(tmp_path, capsys):
    """--variant LABEL:KEY=VALUE adds rows for qcfuse with those selection options (here the
    deviation re-ranking, whose rows narrow inside the prefill); bad variants are refused."""
    import pytest

    from qcfuse_core.eval.ttft import parse_variant

    out = tmp_path / "ttft.json"
    rc = main(["bench", "ttft", "--shape", "tiny-llama", "--dtype", "fp32", "--chunks", "2", "--chunk-tokens", "24",
               "--query-tokens", "4", "--tier", "host", "--methods", "full", "qcfuse", "--ratios", "0.3",
               "--variant", "qcfuse-dev2:deviation_pool=2", "--runs", "2", "--warmup", "1",
               "--no-planner",  # the planner may fall back to full prefill on a loaded CPU; rows are the point here
               "--store", str(tmp_path / "store"), "--json", str(out)])
    assert rc == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"full", "qcfuse", "qcfuse-dev2"}
    dev = rows["qcfuse-dev2"]
    assert dev["options"] == {"deviation_pool": 2} and dev["ratio"] == 0.3
    assert dev["recomputed_tokens"] == rows["qcfuse"]["recomputed_tokens"]  # the same budget after narrowing
    assert "| host | qcfuse-dev2 | 0.30 |" in capsys.readouterr().out
    assert parse_variant("x:query_rows=8,anchor_method=repeat") == ("x", {"query_rows": 8, "anchor_method": "repeat"})
    for bad in ("nolabel", "x:", "x:deviation_pool", "x:colour=red", "x:deviation_pool=0.5"):
        with pytest.raises(Exception, match="variant"):
            parse_variant(bad)


def test_bench_ttft_times_methods_round_robin(tmp_path, monkeypatch):
    """The timed runs alternate full prefill and every method (a drift of the machine reaches
    all of them alike); the timed call is the bench's `timed_answer` -> `engine.answer`."""
    from qcfuse_core.eval import ttft as B

    order: list[tuple[str, bool]] = []
    real = B.timed_answer

    def recording(engine, work, method, ratio, **kw):
        order.append((method, bool(kw.get("sync_stages"))))
        return real(engine, work, method, ratio, **kw)

    monkeypatch.setattr(B, "timed_answer", recording)
    rc = main(["bench", "ttft", "--shape", "tiny-llama", "--dtype", "fp32", "--chunks", "2", "--chunk-tokens", "16",
               "--query-tokens", "4", "--tier", "host", "--methods", "full", "naive", "epic", "--ratios", "0.3",
               "--runs", "3", "--warmup", "1", "--breakdown-runs", "1", "--no-planner",
               "--store", str(tmp_path / "store"), "--json", str(tmp_path / "t.json")])
    assert rc == 0
    timed = [m for m, synced in order if not synced]
    rounds = ["full", "naive", "epic"] * 3
    assert timed[-len(rounds):] == rounds, timed
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert rows[0]["interleaved"] is True
    # per-round speedups: full's run of each round over the method's run of the same round
    full = rows[0]["ttft_ms_runs"]
    assert rows[0]["method"] == "full" and len(full) == 3 and rows[0]["speedup_paired_median"] == 1.0
    for r in rows[1:]:
        pairs = sorted(f / m for f, m in zip(full, r["ttft_ms_runs"]))
        assert abs(r["speedup_paired_median"] - pairs[1]) < 2e-3, (r["method"], pairs)
        assert r["speedup_paired_min"] <= r["speedup_paired_median"] <= r["speedup_paired_max"]


def test_bench_ttft_measures_ingestion_into_a_default_store(tmp_path, monkeypatch):
    from qcfuse_core.store import sizing

    monkeypatch.setattr(sizing, "available_ram", lambda: 6 << 30)  # a machine with 6 GiB available
    out = tmp_path / "t.json"
    rc = main(["bench", "ttft", "--shape", "tiny-llama", "--dtype", "fp32", "--chunks", "2", "--chunk-tokens", "16",
               "--query-tokens", "4", "--tier", "host", "--methods", "full", "--runs", "1", "--warmup", "1",
               "--ingest-chunks", "4", "--store", str(tmp_path / "store"), "--json", str(out)])
    assert rc == 0
    ing = json.loads(out.read_text())["ingest"]
    assert ing["chunks"] == 3 and ing["chunk_tokens"] == 16 and ing["host_tier_bytes"] == 3 << 30  # half of it
    assert ing["tokens_per_s"] > 0 and ing["share_of_full"] > 0
