"""`qcfuse bench load`: concurrent clients against one engine through `engine.astream`.

Tiny random model, fp32, CPU; every run bounded in requests and in time (--duration-s)."""

import json
import time

import pytest

from qcfuse_core.cli.commands import build_parser, main
from qcfuse_core.eval.load import LoadPoint, load_points, make_requests, percentile
from qcfuse_core.eval.workload import Workload

SMALL = [
    "--shape",
    "tiny-llama",
    "--dtype",
    "fp32",
    "--pool-chunks",
    "8",
    "--chunk-tokens",
    "24",
    "--chunks-per-request",
    "3",
    "--query-tokens",
    "4",
    "--prefix-tokens",
    "4",
]
ROW_KEYS = {
    "mode",
    "clients",
    "rate",
    "load",
    "method",
    "ratio",
    "submitted",
    "finished",
    "errors",
    "cancelled",
    "capped",
    "requests_per_s",
    "output_tokens_per_s",
    "ttft_ms_p50",
    "ttft_ms_p95",
    "ttft_ms_p99",
    "itl_ms_p50",
    "itl_ms_p95",
    "itl_ms_p99",
    "gap_ms_p99",
    "gap_ms_max",
    "e2e_ms_p50",
    "e2e_ms_p95",
    "max_batch_seen",
    "wall_s",
    "tier",
    "device",
    "model",
    "max_new_tokens",
    "chunks_per_request",
    "pool_chunks",
    "timed_call",
}


def _counts_add_up(r: dict) -> None:
    assert r["submitted"] == r["finished"] + r["errors"] + r["cancelled"] + r["refused"], r


def test_closed_loop_cli_writes_rows_table_and_plot(tmp_path, capsys):
    """1 and 4 closed-loop clients, full and qcfuse on the same requests: every request
    finishes with its full answer, 4 clients share decode steps, the JSON, markdown and PNG
    are written, and the console shows the table."""
    out = tmp_path / "load.json"
    rc = main(
        [
            "bench",
            "load",
            *SMALL,
            "--max-new-tokens",
            "16",
            "--clients",
            "1",
            "4",
            "--requests-per-client",
            "2",
            "--methods",
            "full",
            "qcfuse",
            "--ratios",
            "0.3",
            "--duration-s",
            "120",
            "--json",
            str(out),
            "--markdown",
            str(tmp_path / "load.md"),
            "--plot",
            str(tmp_path / "load.png"),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert data["env"]["timed_call"] == "engine.astream" and not data["env"]["partial"]
    assert "load_average" in data["env"] and data["env"]["argv"]["json"] == "load.json"
    assert [(r["clients"], r["method"], r["ratio"]) for r in rows] == [
        (1, "full", None),
        (1, "qcfuse", 0.3),
        (4, "full", None),
        (4, "qcfuse", 0.3),
    ]
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        _counts_add_up(r)
        assert r["mode"] == "closed" and not r["capped"] and r["errors"] == 0 and r["error_messages"] == []
        assert r["finished"] == r["submitted"] == 2 * r["clients"]
        assert r["output_tokens"] == 16 * r["finished"]  # EOS ignored: every answer runs to its length
        assert r["requests_per_s"] > 0 and r["output_tokens_per_s"] > 0
        assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p95"] <= r["ttft_ms_p99"] <= r["e2e_ms_p95"]
        assert 0 < r["itl_ms_p50"] <= r["itl_ms_p95"] <= r["itl_ms_p99"] and r["e2e_ms_p50"] <= r["e2e_ms_p95"]
        assert 0 < r["gap_ms_p99"] <= r["gap_ms_max"] < r["wall_s"] * 1e3  # the tail of the gaps between tokens
        assert r["ran_as"] == [r["method"]]
    assert all(r["max_batch_seen"] == 1 for r in rows if r["clients"] == 1)
    assert all(r["max_batch_seen"] > 1 for r in rows if r["clients"] == 4)
    table = capsys.readouterr()
    assert "| closed | 4 clients | qcfuse | 0.30 | 8/8 | 0 |" in table.out
    assert "[4/4] qcfuse 0.3: closed loop, 4 clients, 8 requests" in table.err  # progress, point by point
    assert (tmp_path / "load.md").read_text().startswith("| mode | load | method |")
    png = (tmp_path / "load.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def test_open_loop_runs_and_the_cap_stops_it(tmp_path):
    """A Poisson open loop: a light one runs every request to the end; an overloaded one
    (long answers, a 1 s cap) stops submitting at the cap, cancels what runs and reports
    what finished - within the cap, with the counts adding up and the engine left idle."""
    out = tmp_path / "open.json"
    rc = main(
        [
            "bench",
            "load",
            *SMALL,
            "--max-new-tokens",
            "8",
            "--rate",
            "20",
            "--requests",
            "6",
            "--methods",
            "qcfuse",
            "--ratios",
            "0.3",
            "--duration-s",
            "60",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    (r,) = json.loads(out.read_text())["rows"]
    assert (r["mode"], r["rate"], r["clients"], r["load"]) == ("open", 20.0, None, 20.0)
    assert r["finished"] == r["submitted"] == 6 and not r["capped"]
    _counts_add_up(r)

    t0 = time.monotonic()
    rc = main(
        [
            "bench",
            "load",
            *SMALL,
            "--max-new-tokens",
            "2000",
            "--rate",
            "40",
            "--requests",
            "400",
            "--methods",
            "full",
            "--duration-s",
            "1",
            "--json",
            str(out),
        ]
    )
    took = time.monotonic() - t0
    assert rc == 0
    (r,) = json.loads(out.read_text())["rows"]
    assert r["capped"] and r["cancelled"] >= 1 and r["submitted"] < 400
    _counts_add_up(r)
    assert r["wall_s"] < 1 + 5  # the cap, and cancelling what runs
    assert took < 60  # model, pool, warm-up, the point: nothing waits for the 2000-token answers


def test_duration_cap_stops_a_long_closed_loop(tmp_path):
    """2 clients x 50 requests of 2000 tokens would take minutes; the 1 s cap ends the point."""
    out = tmp_path / "capped.json"
    rc = main(
        [
            "bench",
            "load",
            *SMALL,
            "--max-new-tokens",
            "2000",
            "--clients",
            "2",
            "--requests-per-client",
            "50",
            "--methods",
            "naive",
            "--duration-s",
            "1",
            "--json",
            str(out),
            "--markdown",
            str(tmp_path / "c.md"),
        ]
    )
    assert rc == 0
    (r,) = json.loads(out.read_text())["rows"]
    assert r["capped"] and r["submitted"] < 100 and r["cancelled"] >= 1 and r["wall_s"] < 1 + 5
    _counts_add_up(r)
    assert "cancelled at the cap" in (tmp_path / "c.md").read_text()


def test_requests_share_pool_chunks_in_their_own_order():
    """Each request: distinct pool chunks in a random order and its own question; requests
    share chunks; the list is the same prefix whatever its length (seeded)."""
    from qcfuse_core.model.testing import byte_tokenizer

    tok = byte_tokenizer()
    pool = Workload([f"chunk {i}" for i in range(12)], [f"n{i}" for i in range(12)], "q?", "")
    reqs = make_requests(tok, pool, 20, 5, 6, seed=3)
    assert make_requests(tok, pool, 5, 5, 6, seed=3) == reqs[:5]
    for r in reqs:
        assert len(set(r.node_ids)) == 5
        assert all(pool.texts[pool.node_ids.index(n)] == t for n, t in zip(r.node_ids, r.texts))
        assert r.question.endswith("?") and len(r.question) == 7
    assert len({r.question for r in reqs}) == 20
    assert any(set(a.node_ids) & set(b.node_ids) for a, b in zip(reqs, reqs[1:]))
    assert any(list(r.node_ids) != sorted(r.node_ids, key=pool.node_ids.index) for r in reqs)  # shuffled orders
    with pytest.raises(ValueError, match="chunks-per-request"):
        make_requests(tok, pool, 1, 13, 6, seed=0)


def test_a_burst_with_shared_chunks(tmp_path, capsys):
    """A burst of 4 requests sharing 2 of their 3 chunks: every request finishes, each
    loading its chunks to the device; one row, and its line in the burst table."""
    out = tmp_path / "burst.json"
    rc = main(
        [
            "bench",
            "load",
            *SMALL,
            "--max-new-tokens",
            "4",
            "--burst",
            "4",
            "--shared-chunks",
            "2",
            "--methods",
            "qcfuse",
            "--ratios",
            "0.3",
            "--duration-s",
            "120",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["burst"]
    (r,) = rows
    _counts_add_up(r)
    assert r["finished"] == r["submitted"] == 4 and r["errors"] == 0
    assert r["ttft_ms_p50"] <= r["ttft_ms_max"] and r["fuse_ms_busy"] > 0
    assert r["bytes_loaded"] > 0
    table = capsys.readouterr().out
    assert "| burst | method | ratio | finished |" in table and "| 4 | qcfuse | 0.30 | 4/4 |" in table


def test_busy_time_counts_overlapping_spans_once():
    from qcfuse_core.eval.load import _covered, _stage_span

    assert _covered([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0  # overlapping spans count once
    assert _covered([(0.0, 1.0), (1.0, 2.0)]) == 2.0 and _covered([]) == 0.0
    stages = {
        "queue_ms": 100.0,
        "lookup_ms": 50.0,
        "plan_ms": 0.0,
        "load_start_ms": 10.0,
        "select_ms": 40.0,
        "prefill_ms": 300.0,
        "first_token_ms": 1.0,
    }
    start, end = _stage_span(10.0, stages, "prefill")
    assert abs(start - 10.2) < 1e-9 and abs(end - 10.5) < 1e-9
    assert _stage_span(10.0, {}, "prefill") is None


def test_shared_chunks_are_in_every_request():
    from qcfuse_core.model.testing import byte_tokenizer

    pool = Workload([f"chunk {i}" for i in range(12)], [f"n{i}" for i in range(12)], "q?", "")
    reqs = make_requests(byte_tokenizer(), pool, 10, 5, 6, seed=1, shared=3)
    for r in reqs:
        assert {"n0", "n1", "n2"} <= set(r.node_ids) and len(set(r.node_ids)) == 5
    assert len({r.node_ids for r in reqs}) > 1  # their own orders and other chunks
    with pytest.raises(ValueError, match="shared-chunks"):
        make_requests(byte_tokenizer(), pool, 1, 5, 6, seed=0, shared=6)


def test_load_points_and_percentiles():
    p = build_parser()
    args = p.parse_args(["bench", "load", "--clients", "1", "4", "--requests-per-client", "3", "--rate", "2.5"])
    assert load_points(args) == [
        LoadPoint("closed", 3, clients=1),
        LoadPoint("closed", 12, clients=4),
        LoadPoint("open", 32, rate=2.5),
    ]
    args = p.parse_args(["bench", "load", "--burst", "8", "16"])
    assert load_points(args) == [LoadPoint("burst", 8), LoadPoint("burst", 16)]
    args = p.parse_args(["bench", "load", "--requests", "7"])  # neither: the closed-loop ladder
    assert [(q.clients, q.requests) for q in load_points(args)] == [(c, 7) for c in (1, 2, 4, 8, 16, 32)]
    for bad in (["--clients", "0"], ["--rate", "-1"], ["--max-new-tokens", "0"], ["--duration-s", "0"]):
        with pytest.raises(SystemExit):
            p.parse_args(["bench", "load", *bad])
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile(list(map(float, range(101))), 95) == 95.0


def test_bench_load_rejects_bad_input(tmp_path, capsys):
    assert main(["bench", "load", *SMALL[:2], "--methods", "nope"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err
    assert main(["bench", "load", *SMALL, "--chunks-per-request", "9", "--clients", "1", "--store", str(tmp_path)]) == 2
    assert "--chunks-per-request must be in [1, --pool-chunks=8]" in capsys.readouterr().err


def test_latencies_come_from_each_request_not_its_text_deltas():
    """A request whose text arrives in one delta at its end (a byte-level tokenizer holding
    back bytes) still reports its own TTFT and per-token latency, from its FusionResult."""
    from qcfuse_core.eval.load import Trace, summarize

    held = Trace(submit=0.0, deltas=[2.0], end=2.0, tokens=101, ttft_ms=50.0, itl_ms=19.5)
    even = Trace(submit=0.0, deltas=[0.1 * i for i in range(1, 11)], end=1.0, tokens=10, ttft_ms=100.0, itl_ms=100.0)
    row = summarize([held, even], wall_s=2.0)
    assert row["ttft_ms_p50"] == pytest.approx(75.0) and row["ttft_ms_p99"] == pytest.approx(99.5)
    assert row["itl_ms_p50"] == pytest.approx(59.75)
    assert row["e2e_ms_p50"] == pytest.approx(1500.0) and row["output_tokens"] == 111


def test_over_http_against_a_live_server(tmp_path, capsys):
    """`bench load --url`: 8 concurrent streaming clients against `qcfuse serve`'s app on
    127.0.0.1 (with an API key): nothing lost (finished + refused == submitted, no error),
    TTFT percentiles from the server's statistics and the client's first byte; the same
    requests in process for the record (timing is compared in docs, never asserted)."""
    from qcfuse_core.engine.api import QCFuseEngine
    from qcfuse_core.model.testing import tiny_model
    from qcfuse_core.serve.app import ServeConfig, create_app
    from qcfuse_core.store import MemoryStore
    from tests.qc_fixtures import LiveServer

    engine = QCFuseEngine(tiny_model("llama", tokenizer=True), store=MemoryStore())
    server = LiveServer(create_app(engine, config=ServeConfig(api_key="k-123")))
    common = [
        *SMALL,
        "--max-new-tokens",
        "8",
        "--clients",
        "8",
        "--requests-per-client",
        "2",
        "--methods",
        "qcfuse",
        "--ratios",
        "0.3",
        "--duration-s",
        "60",
    ]
    try:
        t0 = time.monotonic()
        assert (
            main(
                [
                    "bench",
                    "load",
                    *common,
                    "--url",
                    server.url,
                    "--api-key",
                    "k-123",
                    "--json",
                    str(tmp_path / "http.json"),
                ]
            )
            == 0
        )
        took = time.monotonic() - t0
        assert main(["bench", "load", *common, "--url", server.url, "--api-key", "wrong"]) == 2
        assert "401" in capsys.readouterr().err
    finally:
        server.close()
    data = json.loads((tmp_path / "http.json").read_text())
    (r,) = data["rows"]
    assert data["env"]["timed_call"] == "POST /v1/completions (stream)" and r["url"] == server.url
    _counts_add_up(r)
    assert r["errors"] == 0 and r["cancelled"] == 0 and not r["capped"], r["error_messages"]
    assert r["finished"] + r["refused"] == r["submitted"] == 16 and r["finished"] >= 1
    assert r["output_tokens"] == 8 * r["finished"]  # ignore_eos through the server
    assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"] and 0 < r["first_byte_ms_p50"] <= r["first_byte_ms_p99"]
    assert r["ran_as"] == ["qcfuse"] and r["max_batch_seen"] > 1
    assert took < 60
    assert main(["bench", "load", *common, "--json", str(tmp_path / "local.json")]) == 0
    (local,) = json.loads((tmp_path / "local.json").read_text())["rows"]
    _counts_add_up(local)
    assert local["finished"] == 16 and local["errors"] == 0
    print(
        f"TTFT p50 over HTTP {r['ttft_ms_p50']} ms (first byte {r['first_byte_ms_p50']} ms), "
        f"in process {local['ttft_ms_p50']} ms"
    )


def test_over_http_the_server_learns_the_chunks(tmp_path):
    """`bench load --url --chunks learn` (issue 55): nothing registered, no chunk named - each
    pool chunk shown once, then every timed request's chunks are served from the caches the
    server learned (chunk_hit_share 1, cached_tokens reported), answered in full."""
    from qcfuse_core.engine.api import QCFuseEngine
    from qcfuse_core.learn import LEARNED_PREFIX
    from qcfuse_core.model.testing import tiny_model
    from qcfuse_core.serve.app import create_app
    from qcfuse_core.store import MemoryStore
    from tests.qc_fixtures import LiveServer

    engine = QCFuseEngine(tiny_model("llama", tokenizer=True), store=MemoryStore())
    server = LiveServer(create_app(engine))
    args = [*SMALL, "--chunk-tokens", "96", "--max-new-tokens", "4", "--clients", "1", "--requests-per-client", "3",
            "--methods", "full", "qcfuse", "--ratios", "0.3", "--duration-s", "60"]  # fmt: skip
    try:
        assert main(["bench", "load", *args, "--url", server.url, "--chunks", "learn",
                     "--json", str(tmp_path / "learn.json")]) == 0  # fmt: skip
    finally:
        server.close()
    full, fused = json.loads((tmp_path / "learn.json").read_text())["rows"]
    for r in (full, fused):
        _counts_add_up(r)
        assert r["chunks"] == "learned" and r["finished"] == r["submitted"] == 3 and r["errors"] == 0
    assert full["cached_share"] == 0.0  # full prefill recomputes everything
    assert fused["chunk_hit_share"] == 1.0 and 0 < fused["cached_share"] < 1
    rows = engine.caches.texts.verified_rows()
    assert len(rows) >= 8 and all(nid.startswith(LEARNED_PREFIX) for _, nid, _ in rows)  # none registered
    engine.close()


def test_zipf_draws_are_seeded_skewed_and_distinct():
    """--popularity zipf: chunk i drawn with probability proportional to 1/(i+1)^s - one draw
    per request matches that distribution (fixed seed, total variation under 0.03 over 4000
    draws); several per request are distinct, the head of the pool drawn far more often than
    its tail; the same seed gives the same requests, a longer list extends a shorter one."""
    import random
    from collections import Counter

    from qcfuse_core.eval.load import draw, zipf_weights
    from qcfuse_core.model.testing import byte_tokenizer

    assert zipf_weights(4, 1.0) == [1.0, 0.5, 1 / 3, 0.25] and zipf_weights(3, 2.0) == [1.0, 0.25, 1 / 9]
    w = zipf_weights(20, 1.0)
    rng = random.Random(7)
    counts = Counter(draw(rng, range(20), 1, w)[0] for _ in range(4000))
    expected = [x / sum(w) for x in w]
    tv = 0.5 * sum(abs(counts[i] / 4000 - p) for i, p in enumerate(expected))
    assert tv < 0.03, (tv, sorted(counts.items()))
    assert counts[0] > 2 * counts[4] > 0  # rank 1 against rank 5: 5x the weight

    tok = byte_tokenizer()
    pool = Workload([f"chunk {i}" for i in range(30)], [f"n{i}" for i in range(30)], "q?", "")
    reqs = make_requests(tok, pool, 300, 5, 6, seed=3, popularity="zipf", zipf_s=1.0)
    assert make_requests(tok, pool, 50, 5, 6, seed=3, popularity="zipf") == reqs[:50]
    assert make_requests(tok, pool, 50, 5, 6, seed=4, popularity="zipf") != reqs[:50]
    assert all(len(set(r.node_ids)) == 5 for r in reqs)
    drawn = Counter(n for r in reqs for n in r.node_ids)
    head = sum(drawn[f"n{i}"] for i in range(3))
    tail = sum(drawn[f"n{i}"] for i in range(27, 30))
    assert head > 3 * tail, (head, tail)
    uniform = Counter(n for r in make_requests(tok, pool, 300, 5, 6, seed=3) for n in r.node_ids)
    assert drawn["n0"] > 2 * uniform["n0"]  # uniform: 1/6 of the requests hold each chunk
    assert any(list(r.node_ids) != sorted(r.node_ids, key=pool.node_ids.index) for r in reqs)  # shuffled
    with pytest.raises(ValueError, match="popularity"):
        make_requests(tok, pool, 1, 5, 6, seed=0, popularity="pareto")


def _tier_run(tmp_path, *extra: str) -> list[dict]:
    out = tmp_path / "tiers.json"
    rc = main(
        [
            "bench",
            "load",
            *SMALL,
            "--max-new-tokens",
            "2",
            "--clients",
            "1",
            "--requests-per-client",
            "6",
            "--methods",
            "full",
            "qcfuse",
            "--ratios",
            "0.3",
            "--json",
            str(out),
            "--store",
            str(tmp_path / "store"),
            *extra,
        ]
    )
    assert rc == 0
    return json.loads(out.read_text())["rows"]


def test_per_tier_hit_rates_and_bytes_are_consistent(tmp_path, capsys, monkeypatch):
    """A host tier that holds 3 of the pool's 8 chunks, the pool built 3 at a time: qcfuse's
    chunks come from the host and disk tiers, full prefill recomputes them all; per row the
    shares add up to 1 over every request's chunks, and each tier's bytes per request are its
    chunks' tokens x the KV bytes of a token; the table and the progress show the columns."""
    from qcfuse_core.eval import load

    monkeypatch.setattr(load, "BUILD_BATCH", 3)
    rows = _tier_run(
        tmp_path, "--host-bytes", str(3 * 24 * 1024 + 512), "--popularity", "zipf", "--plot", str(tmp_path / "t.png")
    )
    full, qc = rows
    for r in rows:
        _counts_add_up(r)
        assert r["tier"] == "default" and r["popularity"] == "zipf" and r["zipf_s"] == 1.0
        assert r["chunk_segments"] == r["finished"] * 3 == sum(r["chunk_segments_by_tier"].values())
        shares = [r["hit_rate_gpu"], r["hit_rate_host"], r["hit_rate_disk"], r["recomputed_share"]]
        assert sum(shares) == pytest.approx(1.0, abs=1e-5)
        for tier in ("gpu", "host", "disk"):
            n = r["chunk_segments_by_tier"][tier]
            assert r[f"hit_rate_{tier}"] == pytest.approx(n / r["chunk_segments"], abs=1e-6)
            want = n * r["chunk_tokens"] * r["kv_bytes_per_token"] / r["finished"]
            assert r[f"bytes_per_request_{tier}"] == pytest.approx(want, abs=1), tier
        assert r["store_tiers"]["host"]["capacity_bytes"] == r["host_tier_bytes"] == 3 * 24 * 1024 + 512
        assert "gpu" not in r["store_tiers"]  # a CPU engine: no GPU chunk tier
    assert full["recomputed_share"] == 1.0 and full["bytes_per_request_host"] == 0
    assert qc["recomputed_share"] == 0.0 and qc["hit_rate_disk"] > 0 and qc["hit_rate_host"] > 0, qc
    out = capsys.readouterr()
    assert "| chunks from GPU / host / disk / recomputed | MiB per request from GPU / host / disk |" in out.out
    assert "| 0% / 0% / 0% / 100% | 0.0 / 0.0 / 0.0 |" in out.out  # full prefill
    assert (
        "chunks gpu/host/disk/recomputed" in out.err and "pool: 3/8 chunks built" in out.err and "pool: 8/8" in out.err
    )
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_tier_default_opens_the_store_as_open_engine_does(tmp_path, monkeypatch, capsys):
    """`--tier default` (the default) sizes the host tier from available RAM as `open_engine`'s
    store does (a faked machine here); --host-bytes / --gpu-chunk-bytes only size those tiers."""
    from qcfuse_core.store import sizing

    monkeypatch.setattr(sizing, "available_ram", lambda: 768 << 20)
    assert build_parser().parse_args(["bench", "load"]).tier == "default"
    rows = _tier_run(tmp_path, "--methods", "qcfuse")
    want = sizing.host_tier_bytes(768 << 20)
    assert want == 384 << 20
    for r in rows:
        assert r["tier"] == "default" and r["host_tier_bytes"] == want and r["gpu_chunk_cap_bytes"] is None
        assert r["store_tiers"]["host"]["capacity_bytes"] == want
        assert r["hit_rate_host"] == 1.0  # the whole pool fits
    assert main(["bench", "load", *SMALL, "--tier", "host", "--host-bytes", "1M", "--store", str(tmp_path / "s")]) == 2
    assert "--host-bytes and --gpu-chunk-bytes size the default tiers" in capsys.readouterr().err
