"""`qcfuse bench ttft` smoke: a tiny model through the CLI, JSON rows with the required keys."""

import json

from qcfuse_core.cli import main

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
        assert r["context_tokens"] == 48 and r["ttft_ms_min"] <= r["ttft_ms_median"] <= r["ttft_ms_max"]
    assert any((tmp_path / "store").glob("rates-*.json"))
    assert "| host | qcfuse | 0.30 |" in capsys.readouterr().out
    assert "load_average" in data["env"]


def test_bench_ttft_rejects_unknown_method(tmp_path, capsys):
    rc = main(["bench", "ttft", "--shape", "tiny-llama", "--chunks", "1", "--chunk-tokens", "8", "--methods", "nope",
               "--runs", "1", "--warmup", "0", "--store", str(tmp_path)])
    assert rc == 2 and "unknown method 'nope'" in capsys.readouterr().err
