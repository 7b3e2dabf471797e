"""The studio's JSON API through FastAPI's test client, on the embedded model and the sample
corpus: every endpoint, what its numbers are made of, and bad inputs (a clear 4xx; the
server keeps answering)."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi", reason="the studio extra is not installed: pip install 'qcfuse[studio]'")
from fastapi.testclient import TestClient  # noqa: E402

from qcfuse_core.studio.app import create_app  # noqa: E402
from qcfuse_core.studio.service import StudioConfig, StudioService  # noqa: E402

# the embedded model through the shared per-process model cache: fast tier (tests/README.md)

Q = "Who founded the Zephyr Institute, and in which year?"
UPLOAD_LIMIT = 8192


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    svc = StudioService(StudioConfig(store=tmp_path_factory.mktemp("studio-store"), max_upload_bytes=UPLOAD_LIMIT,
                                     max_files=3))
    got = svc.ensure_corpus()
    assert got is not None and got["chunks"] == 12  # the sample corpus: one chunk per document
    assert svc.ensure_corpus() is None  # a store with chunks is left as it is
    return svc


@pytest.fixture(scope="module")
def client(service):
    with TestClient(create_app(service)) as c:
        assert c.get("/").status_code == 200  # the page hands out the token its writes need (a cookie)
        yield c


@pytest.fixture(scope="module")
def top(client):
    res = client.post("/api/search", json={"question": Q, "top_k": 3})
    assert res.status_code == 200, res.text
    return res.json()["chunks"]


@pytest.fixture(scope="module")
def run(client, top):
    body = {"question": Q, "chunk_ids": [c["id"] for c in top], "max_new_tokens": 8,
            "modes": [{"method": "qcfuse", "ratio": 0.15}, {"method": "full"}, {"method": "cacheblend", "ratio": 0.2}]}
    res = client.post("/api/run", json=body)
    assert res.status_code == 200, res.text
    return res.json()


def _error(res, status: int, *words: str) -> str:
    assert res.status_code == status, (res.status_code, res.text)
    msg = res.json()["error"]["message"]
    for w in words:
        assert w in msg, msg
    return msg


# ---------------------------------------------------------------------------- reading


def test_the_audit_of_answers_is_in_the_api(client, service):
    """/api/fidelity: the engine's audit (engine/audit.py) - its ledger for this model and counters."""
    f = client.get("/api/fidelity").json()
    assert f["fingerprint"] == service.engine.adapter.fingerprint()
    assert {"configs", "samples", "audited", "shadow", "waiting", "share", "target"} <= set(f)


def test_status_and_models(client, service):
    st = client.get("/api/status").json()
    assert st["chunks"] == 12
    assert st["model"]["id"] == "smollm2-135m" and st["model"]["layers"] == 30 and st["model"]["default"]
    assert st["model"]["prompt_frame"]["kind"] == "chat" and st["loading"] is None
    assert st["methods"] == ["qcfuse", "full", "cacheblend", "epic", "naive", "adaptive"]  # SmolLM2 ships a calibration
    assert st["adaptive_shares"] == [0.1, 0.15, 0.2, 0.3, 0.4]
    assert st["memory_kind"] == "resident growth during the run (RSS end - start)"
    assert st["examples"]  # the sample corpus is in the store
    models = client.get("/api/models").json()
    assert models["current"] == "smollm2-135m"
    assert "smollm2-135m" in [m["id"] for m in models["models"]]
    again = client.post("/api/models/select", json={"id": "smollm2-135m"})  # the loaded one: nothing to do
    assert again.status_code == 202 and again.json()["state"] == "done"
    assert again.json()["result"]["model"]["id"] == "smollm2-135m"


def test_search_ranks_the_right_chunk_first_with_tokens_and_anchors(client, service, top):
    assert [c["source"] for c in top][0] == "03-zephyr-institute.md"
    scores = [c["score"] for c in top]
    assert scores == sorted(scores, reverse=True) and all(-1 <= s <= 1 for s in scores)
    for c in top:
        assert "".join(c["tokens"]) == c["text"]  # the pieces are the chunk's own tokens, in order
        ids, key = service.engine.caches.chunk_tokens(c["text"])
        assert len(c["tokens"]) == ids.numel()
        assert c["cached"] and c["anchors"] == sorted(set(c["anchors"]))
        assert c["anchors"][:4] == [0, 1, 2, 3]  # the chunk-local sinks come first
        assert all(0 <= a < ids.numel() for a in c["anchors"])


# ---------------------------------------------------------------------------- runs


def test_run_results_are_the_engines(run, top):
    res = run["results"]
    assert [r["method"] for r in res] == ["qcfuse", "full", "cacheblend"]
    assert run["reference"] is None  # full is a mode: no extra reference run
    full = res[1]
    for r in res:
        assert r["answer"] and r["new_tokens"] <= 8 and r["ttft_ms"] > 0
        assert r["chunks"] == 3 and r["context_tokens"] == full["context_tokens"]
        stages = r["stages"]
        assert [s["name"] for s in stages] == ["queue", "lookup", "load", "probe", "select", "fuse", "first token"]
        total = sum(s["ms"] for s in stages)
        assert total <= r["ttft_ms"] + 0.01 and r["ttft_ms"] - total < 1.0  # consecutive intervals up to the TTFT
        for a, b in zip(stages, stages[1:]):
            assert abs(a["start_ms"] + a["ms"] - b["start_ms"]) < 0.01
        assert r["speedup_vs_full"] == pytest.approx(full["ttft_ms"] / r["ttft_ms"], rel=1e-3)
        mem = r["memory"]
        assert sum(mem["kv_bytes_by_tier"].values()) == mem["kv_bytes_loaded"]
        assert mem["peak_bytes"] >= 0 and mem["peak_kind"] == "resident growth during the run (RSS end - start)"
    assert full["recomputed_tokens"] == full["context_tokens"]
    assert full["memory"]["kv_bytes_loaded"] == 0  # HF's own forward reads no chunk cache
    assert full["agreement"]["same_text"] and full["agreement"]["share"] == 1.0
    fused = res[0]
    assert (fused["cache_hits"], fused["cache_misses"], fused["cache_built"]) == (3, 0, 0)  # built at ingestion
    assert fused["guard"]["signal"] == "first_token_margin" and fused["guard"]["action"] in ("kept", "ratio 0.5", "full")
    assert full["guard"]["code"] == "not_guarded"  # the quality guard's signal and action (issue 53)
    assert fused["stages"][2]["ms"] > 0  # qcfuse's probe
    assert set(fused["memory"]["kv_bytes_by_tier"]) <= {"tensor", "host", "disk", "gpu"}
    assert fused["memory"]["kv_bytes_by_tier"].get("host", 0) + fused["memory"]["kv_bytes_by_tier"].get("disk", 0) > 0


def test_each_answer_card_says_what_answered(client, run):
    """Every mode's result carries the one line of what answered and what the quality guard
    did (FusionResult.what_answered), and the shipped page shows it in the answer card."""
    import re

    fused, full, blend = run["results"]
    g = fused["guard"]
    if g["escalated"]:
        assert fused["answered"].startswith("full (escalated by the guard from qcfuse"), fused["answered"]
    else:
        assert fused["answered"] == f"qcfuse @ 0.15 · guard: kept (margin {g['value']:.2f} ≥ {g['threshold']:.2f})"
    assert full["answered"] == "full · guard: off (full prefill: nothing fused to guard)"
    assert blend["answered"] == "cacheblend @ 0.20 · guard: off (method cacheblend is not guarded)"
    page = client.get("/").text
    js = [r for r in re.findall(r'src="(/assets/[^"]+\.js)"', page)]
    shown = re.compile(r"\"data-testid\":[`\"']answered[`\"']")  # the card's line, as the bundle writes it
    assert js and any(shown.search(client.get(r).text) for r in js)


def test_details_are_the_selection_the_engine_makes(client, service, run, top):
    """The recomputed positions shown are the final rows of the same request run again
    through engine.answer (selection is deterministic), restricted to the context."""
    d = client.get(f"/api/runs/{run['run_id']}/details/0").json()
    L = d["num_layers"]
    assert d["method"] == "qcfuse" and d["critical_layers"] and d["score_kind"] == "attention mass"
    assert len(d["recomputed_positions"]) == run["results"][0]["recomputed_tokens"]
    again = service.engine.answer(Q, [c["text"] for c in top], node_ids=[c["id"] for c in top], method="qcfuse",
                                  ratio=0.15, max_new_tokens=1)
    ctx = {p for s in again.spans if s.kind in ("chunk", "text") for p in range(s.start, s.end)}
    assert d["recomputed_positions"] == sorted(set(again.selection.rows.tolist()) & ctx)
    assert [t["pos"] for t in d["tokens"]] == sorted(ctx)
    assert all(t["depth"] in (0, L) for t in d["tokens"])  # qcfuse: one row set for every layer
    assert d["row_sets"] == [{"from_layer": 0, "to_layer": L, "context_rows": len(d["recomputed_positions"])}]
    # chunk boundaries and text: each chunk's pieces join to its text, in retrieval order
    chunks = [s for s in d["segments"] if s["kind"] == "chunk"]
    assert [s["node_id"] for s in chunks] == [c["id"] for c in top]
    for s, c in zip(chunks, top):
        assert "".join(t["text"] for t in d["tokens"] if t["seg"] == s["index"]) == c["text"]
        assert s["cache_hit"]
        anchors = [t["pos"] - s["start"] for t in d["tokens"] if t["seg"] == s["index"] and t["anchor"]]
        assert anchors == c["anchors"]  # the probe's layer-0 anchors are the stored ones
    glue = [t for t in d["tokens"] if d["segments"][t["seg"]]["kind"] == "text"]
    assert glue and all(t["depth"] == L for t in glue)  # glue has no cache: always recomputed
    scored = [t["score"] for t in d["tokens"] if t["score"] is not None]
    assert len(scored) == len(d["tokens"]) and sum(scored) > 0


def test_details_of_full_and_cacheblend_show_their_layers(client, run):
    full = client.get(f"/api/runs/{run['run_id']}/details/1").json()
    L = full["num_layers"]
    assert full["recomputed_positions"] == [t["pos"] for t in full["tokens"]]
    assert full["score_kind"] is None and not full["anchor_positions"]
    cb = client.get(f"/api/runs/{run['run_id']}/details/2").json()
    n_ctx = len(cb["tokens"])
    assert cb["score_kind"] == "V deviation"
    assert cb["row_sets"] == [{"from_layer": 0, "to_layer": 2, "context_rows": n_ctx},
                              {"from_layer": 2, "to_layer": L, "context_rows": len(cb["recomputed_positions"])}]
    depths = {t["depth"] for t in cb["tokens"]}
    assert depths == {2, L}  # layers 0-1 recompute everything, then the chosen rows only
    assert len(cb["recomputed_positions"]) == run["results"][2]["recomputed_tokens"] < n_ctx


def test_run_streams_deltas_then_the_run(client, top):
    body = {"question": "How tall is the Cape Wrayth lighthouse?", "chunk_ids": [top[0]["id"], top[2]["id"]],
            "modes": [{"method": "naive"}, {"method": "epic", "ratio": 0.3}], "max_new_tokens": 6}
    events = []
    with client.stream("POST", "/api/run/stream", json=body) as res:
        assert res.status_code == 200 and res.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in res.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                events.append((event, json.loads(line[5:])))
    names = [e for e, _ in events]
    assert names[:2] == ["build", "build"] and names[-1] == "done" and "error" not in names
    assert names.index("reference") < names.index("mode")  # full first: the reference for every mode
    assert names.count("result") == 2 and names.count("reference") == 2  # full is not a mode: a reference ran
    done = events[-1][1]
    for r in done["results"]:
        deltas = "".join(d["text"] for e, d in events if e == "delta" and d["index"] == r["index"])
        assert deltas == r["answer"]
        assert "agreement" in r and r["speedup_vs_full"] > 0
    assert done["reference"]["ttft_ms"] > 0
    naive = done["results"][0]
    assert naive["recomputed_tokens"] < naive["context_tokens"]


def test_repeats_give_the_median_and_quality_is_against_full_prefill(client, service, top):
    """Three repeats per mode: the TTFT shown is their median (one repeat's own, its waterfall
    adds up to it); quality is the first-token KL(full || mode), the LCS share of full's
    greedy tokens and the answer match, recomputed here from the engine's own answers; the
    history's rows carry the same numbers."""
    from qcfuse_core.eval.metrics import kl_divergence
    from qcfuse_core.studio.quality import token_match

    ids = [top[0]["id"], top[1]["id"]]
    modes = [{"method": "qcfuse", "ratio": 0.15}, {"method": "cacheblend", "ratio": 0.3}]
    before = len(client.get("/api/history").json()["rows"])
    res = client.post("/api/run", json={"question": Q, "chunk_ids": ids, "modes": modes, "max_new_tokens": 4,
                                        "repeats": 3})
    assert res.status_code == 200, res.text
    run = res.json()
    assert run["repeats"] == 3 and run["build"]["built"] == 0 and run["build"]["cached"] == 2
    docs = [c["text"] for c in top[:2]]
    stop = tuple(service.status()["model"]["prompt_frame"]["stop"])
    full = service.engine.answer(Q, docs, node_ids=ids, method="full", max_new_tokens=4, stop=stop)
    assert run["reference"]["answer"] == full.text and run["reference"]["repeats"] == 3
    for r, m in zip(run["results"], modes):
        assert r["repeats"] == 3 and len(r["ttft_all_ms"]) == 3
        assert r["ttft_ms"] == sorted(r["ttft_all_ms"])[1]  # the median of three
        assert r["ttft_ms"] - sum(s["ms"] for s in r["stages"]) < 1.0
        assert r["speedup_vs_full"] == pytest.approx(run["reference"]["ttft_ms"] / r["ttft_ms"], rel=1e-3)
        assert r["total_ms"] > r["ttft_ms"] and (r["decode_tok_s"] is None or r["decode_tok_s"] > 0)
        mine = service.engine.answer(Q, docs, node_ids=ids, method=m["method"], ratio=m["ratio"], max_new_tokens=4,
                                     stop=stop)
        q = r["quality"]
        assert q["kl_first_token"] == pytest.approx(kl_divergence(full.first_logits, mine.first_logits), abs=1e-5)
        assert q["kl_first_token"] >= 0 and q["repeats_agree"]
        assert q["token_match"] == round(token_match(mine.token_ids, full.token_ids), 4)
        assert q["answer_matches"] == (" ".join(mine.text.split()) == " ".join(full.text.split()))
    rows = client.get("/api/history").json()["rows"][before:]
    assert [(x["method"], x["ratio"]) for x in rows] == [("qcfuse", 0.15), ("cacheblend", 0.3), ("full", None)]
    for row, r in zip(rows, run["results"]):
        assert row["run_id"] == run["run_id"] and row["model"] == "smollm2-135m"
        assert (row["ttft_ms"], row["total_ms"], row["decode_tok_s"], row["quality"]) == \
            (r["ttft_ms"], r["total_ms"], r["decode_tok_s"], r["quality"])
    ref = rows[-1]
    assert ref["label"] == "full (reference)" and ref["ttft_ms"] == run["reference"]["ttft_ms"]
    assert ref["quality"] == {"kl_first_token": 0.0, "token_match": 1.0, "answer_matches": True, "repeats_agree": True}


def test_caches_are_built_before_any_mode_is_timed(client, service, top):
    """A chunk whose cache this model lacks is built in the run's build step (timed on its
    own), so the first mode gets a hit like every other."""
    _, key = service.engine.caches.chunk_tokens(top[2]["text"])
    service.engine.caches.store.delete(key)
    assert not service.engine.caches.store.contains(key)
    card = client.post("/api/chunks", json={"ids": [top[2]["id"]]}).json()["chunks"][0]
    assert card["id"] == top[2]["id"] and not card["cached"]
    body = {"question": Q, "chunk_ids": [top[2]["id"]], "modes": [{"method": "qcfuse", "ratio": 0.15}],
            "max_new_tokens": 2, "reference": False}
    run = client.post("/api/run", json=body).json()
    assert run["build"]["built"] == 1 and run["build"]["ms"] > 0
    r = run["results"][0]
    assert (r["cache_hits"], r["cache_misses"]) == (1, 0) and "quality" not in r  # no reference: no quality
    assert client.post("/api/chunks", json={"ids": [top[2]["id"]]}).json()["chunks"][0]["cached"]  # the card refreshes
    _error(client.post("/api/chunks", json={"ids": ["nope"]}), 404, "nope")


def test_details_explain_why_qcfuse_recomputes_what_it_recomputes(client, run):
    d = client.get(f"/api/runs/{run['run_id']}/details/0").json()
    ex = d["explanation"]
    chunks = [s for s in d["segments"] if s["kind"] == "chunk"]
    assert [c["segment"] for c in ex["chunks"]] == [s["index"] for s in chunks]
    rec = set(d["recomputed_positions"])
    for c, s in zip(ex["chunks"], chunks):
        toks = [t for t in d["tokens"] if t["seg"] == s["index"]]
        assert c["recomputed"] == sum(1 for t in toks if t["pos"] in rec)
        assert c["recomputed_at_start"] == sum(1 for t in toks if t["pos"] in rec and t["pos"] - s["start"] < 4)
        assert c["anchors"] == sum(1 for t in toks if t["anchor"])
    assert sum(c["score_share"] for c in ex["chunks"]) <= 1.0 + 1e-3
    assert ex["recomputed_chunk_tokens"] == sum(c["recomputed"] for c in ex["chunks"])
    text = " ".join(ex["text"])
    assert "stale" in text and "critical" not in text and f"layers {', '.join(map(str, sorted(d['critical_layers'])))}" in text
    full = client.get(f"/api/runs/{run['run_id']}/details/1").json()["explanation"]
    assert full["text"][0].startswith("Full prefill computes every token")


def test_adaptive_needs_a_ratio_in_its_calibrated_range(client, top):
    ok = {"question": Q, "chunk_ids": [top[0]["id"]], "max_new_tokens": 2, "reference": False}
    _error(client.post("/api/run", json={**ok, "modes": [{"method": "adaptive", "ratio": 0.9}]}), 422,
           "adaptive's ratio must be within", "[0.1, 0.4]")
    res = client.post("/api/run", json={**ok, "modes": [{"method": "adaptive", "ratio": 0.2}]})
    assert res.status_code == 200, res.text
    assert res.json()["results"][0]["ran_as"] in ("adaptive", "full")
    _error(client.post("/api/run", json={**ok, "modes": [{"method": "naive"}], "repeats": 11}), 422,
           "repeats must be an integer in [1, 10]")


def test_adaptive_is_offered_only_with_a_calibration(client, service, top, monkeypatch):
    monkeypatch.setattr(service, "_adaptive_shares", lambda: [])
    assert "adaptive" not in client.get("/api/status").json()["methods"]
    body = {"question": Q, "chunk_ids": [top[0]["id"]], "max_new_tokens": 2, "modes": [{"method": "adaptive", "ratio": 0.2}]}
    _error(client.post("/api/run", json=body), 422, "adaptive needs a calibration of SmolLM2-135M-Instruct", "qcfuse")


def test_a_large_json_body_gets_a_413(client):
    """The JSON API refuses a body over max_json_bytes: declared (Content-Length) or streamed
    without one; the server keeps answering."""
    limit = client.app.state.service.config.max_json_bytes
    big = json.dumps({"question": "x" * (limit + 10), "top_k": 1})
    _error(client.post("/api/search", content=big, headers={"content-type": "application/json"}), 413,
           f"over the limit of {limit:,} bytes")

    def chunked():
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096].encode()

    _error(client.post("/api/run", content=chunked(), headers={"content-type": "application/json"}), 413,
           f"over the limit of {limit:,} bytes")
    assert client.get("/api/status").status_code == 200
    small = client.post("/api/search", json={"question": Q, "top_k": 1})
    assert small.status_code == 200  # a body under the limit is replayed to the endpoint intact


def test_a_stream_whose_client_goes_away_is_cancelled_at_once(service, top, monkeypatch):
    """A real server (uvicorn): a long streamed run (40 answers) whose client disconnects
    once it is answering stops at its next token, so the next request does not wait for the
    rest: one worker thread runs them in order, and only the answer in flight (and at most
    one more started before the cancel arrived) ran before the next request's. The cancelled
    run never reaches the history."""
    import http.client
    import socket
    import threading

    import uvicorn

    answers: list[str] = []
    real = service._answer

    def counted(engine, spec, docs, mode, *a, **kw):
        answers.append(mode.method)
        return real(engine, spec, docs, mode, *a, **kw)

    monkeypatch.setattr(service, "_answer", counted)
    app = create_app(service)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        t0 = time.monotonic()
        while not server.started and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        rows_before = len(service.history()["rows"])
        long = {"question": Q, "chunk_ids": [c["id"] for c in top], "max_new_tokens": 256, "repeats": 10,
                "modes": [{"method": m, "ratio": 0.15} for m in ("qcfuse", "cacheblend", "epic")]}
        payload = json.dumps(long).encode()
        conn = socket.create_connection(("127.0.0.1", port), timeout=120)
        conn.sendall(b"POST /api/run/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"X-QCFuse-Token: {app.state.token}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                     + payload)
        got = b""
        while b"event: reference" not in got:  # the run is answering now (full prefill, the reference)
            more = conn.recv(4096)
            assert more, got
            got += more
        assert got.startswith(b"HTTP/1.1 200") and b"event: build" in got
        conn.close()  # the page went away
        t1 = time.monotonic()
        short = {"question": Q, "chunk_ids": [top[0]["id"]], "modes": [{"method": "naive"}], "max_new_tokens": 1,
                 "reference": False}
        c2 = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        c2.request("POST", "/api/run", body=json.dumps(short),
                   headers={"content-type": "application/json", "X-QCFuse-Token": app.state.token})
        got = c2.getresponse()
        assert got.status == 200, got.read()
        waited = time.monotonic() - t1
        # uncancelled, the 10 reference answers and 3 modes x 10 repeats would all run first
        assert answers[-1] == "naive" and len(answers) <= 3, (answers, f"the next run waited {waited:.1f} s")
        assert answers[0] == "full"
        rows = service.history()["rows"][rows_before:]
        assert [r["method"] for r in rows] == ["naive"]  # the cancelled run left no rows
    finally:
        server.should_exit = True
        thread.join(timeout=30)


# ---------------------------------------------------------------------------- ingestion


def _wait(client, job_id: str, timeout: float = 120.0) -> dict:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        job = client.get(f"/api/jobs/{job_id}").json()
        if job["state"] in ("done", "failed"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not finish in {timeout} s")


def test_upload_is_chunked_embedded_cached_and_found(client, service):
    text = ("# The Quillon Observatory\n\nThe Quillon Observatory stands on Mount Ebbe above Marrow Bay. "
            "It was built in 1911 by the astronomer Tomas Reyne and houses a brass refractor telescope.")
    res = client.post("/api/ingest", files=[("files", ("quillon.md", text.encode(), "text/markdown"))])
    assert res.status_code == 202, res.text
    job = res.json()
    assert job["kind"] == "ingest" and job["result"]["files"] == ["quillon.md"]
    with client.stream("GET", f"/api/jobs/{job['id']}/events") as ev:
        lines = [line for line in ev.iter_lines() if line.startswith("event:")]
    assert lines[-1] == "event: done" and "event: progress" in lines
    done = _wait(client, job["id"])
    assert done["state"] == "done" and done["result"]["chunks"] == 1 and done["result"]["sources"] == ["quillon.md"]
    assert client.get("/api/status").json()["chunks"] == 13
    hits = client.post("/api/search", json={"question": "Who built the Quillon Observatory?", "top_k": 2}).json()["chunks"]
    assert hits[0]["source"] == "quillon.md" and hits[0]["id"] == done["result"]["chunk_ids"][0]
    assert hits[0]["cached"]  # its cache was built by the job
    key = service.engine.caches.chunk_tokens(hits[0]["text"])[1]
    assert service.engine.caches.store.contains(key)
    again = _wait(client, client.post("/api/ingest", files=[("files", ("quillon.md", text.encode()))]).json()["id"])
    assert again["result"]["new_in_chroma"] == 0  # the same file again changes nothing
    assert client.get("/api/status").json()["chunks"] == 13


def test_a_repeated_paragraph_or_file_in_one_upload_is_ingested_once(client):
    para = "The Vellin ferry crosses Marrow Bay twice a day and was first run by the Osk family in 1902."
    text = f"# Vellin ferry\n\n{para}\n\n{para}\n"
    files = [("files", ("vellin.md", text.encode())), ("files", ("vellin.md", text.encode()))]
    before = client.get("/api/status").json()["chunks"]
    done = _wait(client, client.post("/api/ingest", files=files).json()["id"])
    assert done["state"] == "done", done
    ids = done["result"]["chunk_ids"]
    assert len(ids) == len(set(ids)) and done["result"]["new_in_chroma"] == len(ids)
    assert client.get("/api/status").json()["chunks"] == before + len(ids)


# ---------------------------------------------------------------------------- bad inputs


def test_bad_inputs_get_a_clear_4xx_and_the_server_keeps_running(client, top, run):
    ids = [top[0]["id"]]
    ok = {"question": Q, "chunk_ids": ids, "modes": [{"method": "naive"}], "max_new_tokens": 2}
    before = client.get("/api/status").json()["chunks"]
    _error(client.post("/api/search", json={"question": "   "}), 422, "question is empty")
    _error(client.post("/api/search", json={"question": Q, "top_k": 0}), 422, "top_k")
    _error(client.post("/api/run", json={**ok, "question": ""}), 422, "question is empty")
    _error(client.post("/api/run", json={**ok, "chunk_ids": ["no-such-chunk"]}), 404, "unknown chunk id", "no-such-chunk")
    _error(client.post("/api/run", json={**ok, "chunk_ids": []}), 422, "chunk_ids")
    _error(client.post("/api/run", json={**ok, "chunk_ids": ids + ids}), 422, "duplicates")
    _error(client.post("/api/run", json={**ok, "modes": [{"method": "turbo"}]}), 422, "unknown method 'turbo'", "qcfuse")
    _error(client.post("/api/run", json={**ok, "modes": [{"method": "qcfuse", "ratio": 1.5}]}), 422, "ratio", "less than or equal to 1")
    _error(client.post("/api/run", json={**ok, "modes": [{"method": "qcfuse", "ratio": -0.1}]}), 422, "ratio")
    _error(client.post("/api/run", json={**ok, "modes": []}), 422, "modes")
    _error(client.post("/api/run", json={**ok, "max_new_tokens": 0}), 422, "max_new_tokens")
    _error(client.post("/api/run", content=b"{not json", headers={"content-type": "application/json"}), 422)
    _error(client.post("/api/run/stream", json={**ok, "chunk_ids": ["nope"]}), 404, "nope")  # before any event
    _error(client.get("/api/runs/0123456789ab/details/0"), 404, "unknown run")
    _error(client.get(f"/api/runs/{run['run_id']}/details/7"), 404, "modes 0..2")
    _error(client.get("/api/jobs/nope"), 404, "unknown job")
    _error(client.post("/api/models/select", json={"id": "gpt-9"}), 404, "unknown model", "smollm2-135m")
    _error(client.get("/api/nothing-here"), 404, "no such endpoint")
    # uploads
    big = b"a" * (UPLOAD_LIMIT + 1)
    _error(client.post("/api/ingest", files=[("files", ("big.md", big))]), 413, "big.md", f"{UPLOAD_LIMIT:,}")
    _error(client.post("/api/ingest", files=[("files", ("latin1.txt", "caf\xe9 au lait".encode("latin-1")))]),
           422, "latin1.txt", "not UTF-8")
    _error(client.post("/api/ingest", files=[("files", ("paper.pdf", b"%PDF-1.7"))]), 415, "paper.pdf", ".md")
    _error(client.post("/api/ingest", files=[("files", ("blank.md", b"  \n\n"))]), 422, "blank.md is empty")
    _error(client.post("/api/ingest", files=[("files", (f"f{i}.md", b"x")) for i in range(4)]), 413, "at most 3 files")
    _error(client.post("/api/ingest"), 422, "files")
    # still serving, with nothing changed
    assert client.get("/api/status").json()["chunks"] == before
    res = client.post("/api/run", json=ok)
    assert res.status_code == 200 and res.json()["results"][0]["answer"]


def test_page_is_served_and_refers_only_to_local_files(client):
    res = client.get("/")
    assert res.status_code == 200 and "<div id=\"root\">" in res.text
    import re

    refs = re.findall(r'(?:src|href)="([^"]+)"', res.text)
    assert refs and all(r.startswith("/assets/") or r.startswith("data:") for r in refs), refs
    for r in refs:
        if r.startswith("/assets/"):
            asset = client.get(r)
            assert asset.status_code == 200
            body = asset.text if r.endswith((".js", ".css")) else ""
            assert "fonts.googleapis" not in body and "cdn." not in body


def test_store_tiers_and_store_stats_url(client, service, run, monkeypatch, capsys):
    """GET /api/store: per tier (host and disk on a CPU) entries, bytes used / capacity,
    occupancy, hits, misses, hit rate and evictions - the engine's store's own figures;
    `qcfuse store stats --url` prints them from a running studio."""
    import httpx

    from qcfuse_core.cli.store import main as store_main
    from qcfuse_core.store.tier_report import TIER_FIELDS, tier_table

    res = client.get("/api/store")
    assert res.status_code == 200, res.text
    got = res.json()
    assert got["backend"] == "tiered" and list(got["tiers"]) == ["host", "disk"]
    want = tier_table(service.engine.caches.store.stats())
    for name, tier in got["tiers"].items():
        assert set(tier) == set(TIER_FIELDS), name
        assert tier == want[name], name  # nothing ran in between
        looked = tier["hits"] + tier["misses"]
        assert tier["hit_rate"] == (tier["hits"] / looked if looked else None)
    host, disk = got["tiers"]["host"], got["tiers"]["disk"]
    assert disk["entries"] >= 12 and disk["bytes_used"] > 0  # the corpus, on disk
    assert 0 < disk["occupancy"] <= 1  # the disk tier is bounded by default (store/sizing.py DISK_SHARE)
    assert host["capacity_bytes"] > 0 and host["occupancy"] == host["bytes_used"] / host["capacity_bytes"]

    monkeypatch.setattr(httpx, "get", lambda url, timeout: client.get(url.removeprefix("http://studio.test")))
    assert store_main(["store", "stats", "--store", "unused", "--url", "http://studio.test"]) == 0
    out = capsys.readouterr().out
    assert "KV store of http://studio.test (tiered store" in out
    assert any(line.split()[:2] == ["host", str(host["entries"])] for line in out.splitlines())
    assert any(line.split()[:2] == ["disk", str(disk["entries"])] for line in out.splitlines())


# ---------------------------------------------------------------------------- the front door


def test_only_the_studios_own_page_may_ingest(service):
    """Case 92: a page on another site posts a file to /api/ingest (browsers send multipart
    uploads cross-site without a preflight) - over real HTTP on 127.0.0.1: a foreign Origin, a
    foreign Host (DNS rebinding), or no page token is a 403, and nothing is ingested; the page
    (its cookie, its own Origin) ingests. A multipart body on a JSON route is held to the JSON
    limit (case 91)."""
    import httpx

    from tests.qc_fixtures import LiveServer

    app = create_app(service)
    server = LiveServer(app)
    secret = ("# The Ossery lighthouse\n\nThe Ossery lighthouse was designed in 1874 by the engineer Brann Tolle "
              "and its lamp burns seal oil; this note came from a page on another site.")
    files = [("files", ("planted.md", secret.encode(), "text/markdown"))]
    try:
        before = service.status()["chunks"]
        with httpx.Client(base_url=server.url) as stranger:  # never loaded the page: no cookie
            for headers, words in (({"Origin": "http://evil.example"}, ("Origin", "cross-site")),
                                   ({"Origin": "null"}, ("Origin",)),
                                   ({"Host": "evil.example"}, ("Host", "DNS rebinding")),
                                   ({"Host": f"evil.example:{server.port}", "Origin": f"http://evil.example:{server.port}"},
                                    ("Host",)),
                                   ({}, ("page token",)),
                                   ({"X-QCFuse-Token": "guessed"}, ("page token",))):
                res = stranger.post("/api/ingest", files=files, headers=headers)
                msg = _error(res, 403, *words)
                assert res.json()["error"]["type"] == "forbidden", msg
            _error(stranger.delete("/api/history"), 403, "page token")
            assert stranger.get("/api/status").status_code == 200  # reads need no token
        assert service.status()["chunks"] == before
        assert all(h["source"] != "planted.md" for h in service.search("Who designed the Ossery lighthouse?", 3))
        with httpx.Client(base_url=server.url) as page:
            res = page.get("/")
            assert res.status_code == 200
            cookie = res.headers["set-cookie"]
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and app.state.token in cookie
            # the page's cookie is not enough from another site's page
            _error(page.post("/api/ingest", files=files, headers={"Origin": "http://evil.example"}), 403, "Origin")
            big, ctype = b"--b\r\n" + b"x" * (service.config.max_json_bytes + 1) + b"\r\n--b--\r\n", "multipart/form-data; boundary=b"
            _error(page.post("/api/search", content=big, headers={"Content-Type": ctype}), 413, "over the limit")
            res = page.post("/api/ingest", files=files, headers={"Origin": server.url})
            assert res.status_code == 202, res.text
            done = _wait(page, res.json()["id"])
            assert done["state"] == "done" and service.status()["chunks"] == before + 1
            hits = page.post("/api/search", json={"question": "Who designed the Ossery lighthouse?", "top_k": 1})
            assert hits.json()["chunks"][0]["source"] == "planted.md"
    finally:
        server.close()
