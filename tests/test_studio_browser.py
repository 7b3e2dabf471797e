"""`qcfuse studio` end to end: the real command on an empty store and a fresh cache dir (it
converts the models it loads and ingests the sample corpus, offline), and the page in
Chromium through Playwright: ask, run modes, open the details, upload a file and find its
chunk, build a run history over modes, ratios and both packaged models. What the page shows
is checked against the API. A fresh cache dir (`fresh_cache_dir`) means a new machine cannot
surprise these tests: nothing an earlier run converted or cached is there.

Chromium is the operating system's (`apt-get install chromium`), never a download. Without
it the browser tests skip with the reason, unless CI is set (then they fail: `.ci/run`
installs it). Screenshots at 1280x800 and 390x844 go to $QCFUSE_TEST_ARTIFACTS (default
build/test-artifacts/studio).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the studio extra is not installed: pip install 'qcfuse[studio]'")

pytestmark = [pytest.mark.slow, pytest.mark.browser]

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 1200  # a fresh cache dir: SmolLM2 is converted from its GGUF first (minutes on a busy 2-core CPU)
CONVERT_TIMEOUT_MS = 1_200_000  # Gemma-3-270M's first conversion, on the same machine


def artifacts_dir() -> Path:
    d = Path(os.environ.get("QCFUSE_TEST_ARTIFACTS") or REPO / "build" / "test-artifacts" / "studio")
    d.mkdir(parents=True, exist_ok=True)
    return d


def find_chromium() -> str | None:
    explicit = os.environ.get("QCFUSE_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _need_browser(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"CI is set but {reason}; .ci/run installs it (apt-get install chromium)")
    pytest.skip(f"{reason} (apt-get install chromium to run the browser tests)")


def test_without_chromium_the_browser_tests_skip_locally_and_fail_in_ci(monkeypatch, tmp_path):
    monkeypatch.setenv("QCFUSE_CHROMIUM", str(tmp_path / "no-chromium"))
    assert find_chromium() is None
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no Chromium found.*apt-get install chromium"):
        _need_browser("no Chromium found")
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="CI is set but no Chromium found"):
        _need_browser("no Chromium found")
    fake = tmp_path / "chromium"
    fake.write_text("")
    monkeypatch.setenv("QCFUSE_CHROMIUM", str(fake))
    assert find_chromium() == str(fake)


# ---------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def fresh_cache_dir(tmp_path_factory) -> Path:
    """A new, empty QCFUSE_CACHE_DIR for the server of this test session: no converted model,
    no store, no calibration left by an earlier run."""
    d = tmp_path_factory.mktemp("qcfuse-cache")
    assert not any(d.iterdir())
    return d


@pytest.fixture(scope="module")
def server(tmp_path_factory, fresh_cache_dir):
    """`qcfuse studio` on an empty store, a fresh cache dir and a free port, offline; stopped
    at the end."""
    store = tmp_path_factory.mktemp("studio-empty-store")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "QCFUSE_CACHE_DIR": str(fresh_cache_dir)}
    env.pop("TRITON_INTERPRET", None)  # conftest's setting for kernel tests: a user's server has none
    proc = subprocess.Popen([sys.executable, "-m", "qcfuse_core.cli.commands", "studio", "--store", str(store), "--port", "0",
                             "--max-upload-mb", "0.5"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "QCFuse Studio on http://" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    t0 = time.monotonic()
    while not ready.wait(0.5):
        if proc.poll() is not None or time.monotonic() - t0 > START_TIMEOUT_S:
            proc.kill()
            raise AssertionError("qcfuse studio did not start:\n" + "".join(lines[-40:]))
    url = re.search(r"http://127\.0\.0\.1:\d+", next(x for x in lines if "QCFuse Studio on" in x)).group(0)
    yield {"url": url, "log": lines, "store": store, "cache_dir": fresh_cache_dir}
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def get(server, path: str):
    with urllib.request.urlopen(server["url"] + path, timeout=60) as res:
        return json.loads(res.read())


def test_cli_starts_offline_on_the_sample_corpus(server):
    log = "".join(server["log"])
    assert "the store was empty: ingested the sample corpus (12 chunks)" in log
    converted = sorted(p.name for p in (server["cache_dir"] / "models").iterdir())
    assert len(converted) == 1 and converted[0].startswith("SmolLM2-135M-Instruct-")  # converted into the fresh dir
    assert {m["id"]: m["converted"] for m in get(server, "/api/models")["models"]}["gemma3-270m"] is False
    st = get(server, "/api/status")
    assert st["chunks"] == 12 and st["store"] == str(server["store"])
    assert st["model"]["name"] == "SmolLM2-135M-Instruct" and st["examples"]
    with urllib.request.urlopen(server["url"] + "/", timeout=30) as res:
        assert "<div id=\"root\">" in res.read().decode()


# ---------------------------------------------------------------------------- the page


@pytest.fixture(scope="module")
def browser():
    path = find_chromium()
    if path is None:
        _need_browser("no Chromium found")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _need_browser("Playwright's Python package is not installed")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path)  # Playwright passes --no-sandbox (chromium_sandbox=False)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = ctx.new_page()
    pg.requests, pg.errors = [], []
    pg.on("request", lambda r: pg.requests.append(r.url))
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    pg.on("console", lambda m: pg.errors.append(m.text) if m.type == "error" else None)
    pg.set_default_timeout(600_000)  # runs on a shared, busy 2-core machine (one run took over 3 min)
    yield pg
    ctx.close()


def js_fixed(x: float, digits: int = 1) -> str:
    """Number.prototype.toFixed: the exact double, ties away from zero (not Python's even)."""
    return str(Decimal(x).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def sse_events(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.split("\n\n"):
        ev = re.search(r"^event: (.*)$", block, re.M)
        data = re.search(r"^data: (.*)$", block, re.M)
        if ev and data:
            out.append((ev.group(1), json.loads(data.group(1))))
    return out


def only_local(pg, server, expected_errors: tuple[str, ...] = ()) -> None:
    """Every request the page made went to the studio; no script errors."""
    outside = [u for u in pg.requests if not u.startswith(server["url"] + "/")]
    assert not outside, f"requests left the machine: {outside}"
    errors = [e for e in pg.errors if not any(x in e for x in expected_errors)]
    assert not errors, errors


def shot(pg, name: str, **kw) -> Path:
    path = artifacts_dir() / name
    pg.screenshot(path=str(path), **kw)
    print(f"screenshot: {path}")
    return path


def phone_width_holds(page) -> int:
    """At 390x844 nothing is wider than the screen -> the page's width; back to 1280x800."""
    page.set_viewport_size({"width": 390, "height": 844})
    page.evaluate("window.scrollTo(0, 0)")
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, f"the page is {width} px wide at phone width"
    page.set_viewport_size({"width": 1280, "height": 800})
    return width


def small_runs(page, repeats: int = 1, new_tokens: int = 6) -> None:
    """The run settings of these tests: few repeats and new tokens (a shared 2-core CPU)."""
    page.fill("[data-testid=repeats]", str(repeats))
    page.fill("[data-testid=new-tokens]", str(new_tokens))


def set_modes(page, wanted: list[str]) -> None:
    for m in page.eval_on_selector_all("[data-testid^=mode-]", "els => els.map(e => e.dataset.testid.slice(5))"):
        on = page.get_attribute(f"[data-testid=mode-{m}]", "aria-pressed") == "true"
        if on != (m in wanted):
            page.click(f"[data-testid=mode-{m}]")


def set_ratio(page, method: str, value: float) -> None:
    """The mode's own slider, by keyboard (0.01 a step from its minimum 0)."""
    page.focus(f"[data-testid=ratio-{method}]")
    page.keyboard.press("Home")
    for _ in range(round(value * 100)):
        page.keyboard.press("ArrowRight")
    assert page.inner_text(f"[data-testid=ratio-value-{method}]") == f"{value:.2f}"


def run_and_check_cards(page) -> dict:
    """Click Run; -> the run the stream's `done` event carries, after checking that every
    answer card shows that run's TTFT, answer, speedup and what answered."""
    with page.expect_response(lambda r: r.url.endswith("/api/run/stream")) as got:
        page.click("[data-testid=run-button]")
    page.wait_for_selector("[data-testid=answer-card] [data-testid=details-button]:not([disabled])")
    events = sse_events(got.value.text())
    assert events[-1][0] == "done", events[-1]
    run = events[-1][1]
    for r in run["results"]:
        card = page.locator(f"[data-testid=answer-card][data-index='{r['index']}']")
        assert card.locator("[data-testid=ttft]").inner_text() == f"{js_fixed(r['ttft_ms'])} ms"
        assert card.locator("[data-testid=answer-text]").inner_text().strip() == r["answer"].strip()
        assert card.locator("[data-testid=speedup]").inner_text() == f"{js_fixed(r['speedup_vs_full'], 2)}×"
        assert card.locator("[data-testid=answered]").inner_text() == r["answered"]  # what answered, the guard
        assert card.locator("[data-testid=kl]").inner_text() == js_fixed(r["quality"]["kl_first_token"], 4)
        assert card.locator("[data-testid=match]").inner_text() == f"{js_fixed(100 * r['quality']['token_match'], 1)}%"
    build = page.locator("[data-testid=build-step]")
    assert build.get_attribute("data-state") == "done"
    assert f"{run['build']['built']} chunk cache" in build.inner_text() and "before any mode was timed" in build.inner_text()
    return run


def test_run_two_modes_and_the_details_match_the_api(page, server):
    """A new question typed and run without pressing Retrieve is answered from its own chunks
    (Run retrieves first); the cards and the details equal the API's; the phone width holds
    on the fresh cache dir, before Gemma-3-270M was ever converted."""
    q = "How tall is the Cape Wrayth lighthouse?"
    page.goto(server["url"])
    page.wait_for_selector("[data-testid=chunk-card]")  # the example question, retrieved on load
    assert page.locator("[data-testid=chunk-card]:first-child").get_attribute("data-source") != "10-lighthouse.md"
    assert page.get_attribute("[data-testid=repeats]", "value") == "3"  # the page's default N
    small_runs(page)
    page.fill("[data-testid=question-input]", q)
    assert [page.get_attribute(f"[data-testid=mode-{m}]", "aria-pressed") for m in ("qcfuse", "full", "cacheblend")] == \
        ["true", "true", "false"]  # two modes by default
    with page.expect_response(lambda r: r.url.endswith("/api/search") and q in (r.request.post_data or "")) as found:
        run = run_and_check_cards(page)  # Run, not Retrieve: the question changed, so it retrieves first
    hits = found.value.json()["chunks"]
    assert hits[0]["source"] == "10-lighthouse.md" and len(hits) == 4
    assert run["question"] == q and run["chunk_ids"] == [h["id"] for h in hits]  # its own chunks, not the last ones
    cards = page.locator("[data-testid=chunk-card]")
    assert [cards.nth(i).get_attribute("data-chunk-id") for i in range(cards.count())] == run["chunk_ids"]
    assert [r["method"] for r in run["results"]] == ["qcfuse", "full"]
    assert "no cache for this model yet" not in page.inner_text("[data-testid=chunk-list]")
    shot(page, "studio-1280x800.png")

    # details of qcfuse: the highlighted tokens are exactly the API's recomputed positions
    page.click("[data-testid=answer-card][data-method=qcfuse] [data-testid=details-button]")
    page.wait_for_selector("[data-testid=details-panel]")
    api = get(server, f"/api/runs/{run['run_id']}/details/0")
    tokens = page.locator("[data-testid=details-panel] [data-testid=token]")
    assert tokens.count() == len(api["tokens"])

    def highlighted() -> list[int]:
        return page.eval_on_selector_all("[data-testid=details-panel] [data-testid=token][data-hl='1']",
                                         "els => els.map(e => Number(e.dataset.pos))")

    assert page.inner_text("[data-testid=layer-value]") == str(api["num_layers"] - 1)
    assert highlighted() == api["recomputed_positions"]
    assert len(api["recomputed_positions"]) == run["results"][0]["recomputed_tokens"]
    assert page.inner_text("[data-testid=layer-rows]") == str(len(api["recomputed_positions"]))
    page.focus("[data-testid=layer-slider]")
    page.keyboard.press("Home")  # layer 0: qcfuse recomputes the same rows at every layer
    assert page.inner_text("[data-testid=layer-value]") == "0"
    assert highlighted() == api["recomputed_positions"]
    page.keyboard.press("End")
    page.evaluate("document.activeElement.blur()")
    heat = page.locator("[data-testid=details-panel] [data-testid=heat-strip]")
    assert heat.count() == 4  # one per chunk: the probe's attention mass
    stages = ["queue", "lookup", "load", "probe", "select", "fuse", "first token"]
    assert [s["name"] for s in api["stages"]] == stages  # one bar per stage, in the pipeline's order
    assert page.locator("[data-testid=waterfall] .wf-row .wf-name").all_inner_texts() == stages
    assert f"{js_fixed(run['results'][0]['ttft_ms'])} ms" in page.inner_text("[data-testid=waterfall] h3")
    page.evaluate("window.scrollTo(0, 0)")
    shot(page, "studio-1280x800-details.png")
    shot(page, "studio-1280-full.png", full_page=True)

    # full prefill recomputes every context token
    page.click("[data-testid=answer-card][data-method=full] [data-testid=details-button]")
    page.wait_for_selector("[data-testid=details-panel][data-index='1']")
    full = get(server, f"/api/runs/{run['run_id']}/details/1")
    assert highlighted() == full["recomputed_positions"] == [t["pos"] for t in full["tokens"]]

    # the explanation of qcfuse's rows, and the attention numbers on hover and on touch
    page.click("[data-testid=answer-card][data-method=qcfuse] [data-testid=details-button]")
    page.wait_for_selector("[data-testid=details-panel][data-index='0']")
    why = page.inner_text("[data-testid=why]")
    assert all(t in why for t in api["explanation"]["text"])
    assert page.locator("[data-testid=chunk-numbers]").count() == 4
    cell = page.locator("[data-testid=heat-strip]").first.locator("[data-testid=heat-cell]").nth(0)
    cell.hover()
    first = next(t for t in api["tokens"] if api["segments"][t["seg"]]["kind"] == "chunk")
    assert f"{page.evaluate('x => x.toPrecision(3)', first['score'])}" in page.inner_text("[data-testid=heat-readout] >> nth=0")
    assert page.locator("[data-testid=memory]").inner_text().count("resident growth during the run") == 1

    # a phone-width screen on a fresh cache dir (Gemma not converted yet): one column, nothing wider
    assert "converts once" in page.inner_text("[data-testid=model-option-gemma3-270m]")
    page.set_viewport_size({"width": 390, "height": 844})
    page.evaluate("window.scrollTo(0, 0)")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    shot(page, "studio-390x844.png")
    shot(page, "studio-390-full.png", full_page=True)
    only_local(page, server)


def test_upload_a_file_and_find_its_chunk(page, server, tmp_path):
    doc = tmp_path / "quillon-observatory.md"
    doc.write_text("# The Quillon Observatory\n\nThe Quillon Observatory stands on Mount Ebbe above Marrow Bay. "
                   "It was built in 1911 by the astronomer Tomas Reyne and houses a brass refractor telescope.\n")
    page.goto(server["url"])
    page.wait_for_selector("[data-testid=chunk-card]")
    page.set_input_files("[data-testid=upload-input]", str(doc))
    page.wait_for_selector("[data-testid=upload-status][data-state=done]")
    assert "quillon-observatory.md" in page.inner_text("[data-testid=upload-status]")
    assert page.inner_text("[data-testid=store-info]").startswith("13 chunks")
    q = "Who built the Quillon Observatory?"
    page.fill("[data-testid=question-input]", q)
    with page.expect_response(lambda r: r.url.endswith("/api/search") and q in (r.request.post_data or "")) as got:
        page.press("[data-testid=question-input]", "Enter")  # Enter retrieves (no newline)
    assert page.input_value("[data-testid=question-input]") == q
    hits = got.value.json()["chunks"]
    assert hits[0]["source"] == "quillon-observatory.md"
    first = page.locator("[data-testid=chunk-card]:first-child")
    page.wait_for_selector(f"[data-testid=chunk-card]:first-child[data-chunk-id='{hits[0]['id']}']")
    assert first.get_attribute("data-source") == "quillon-observatory.md"
    assert "Tomas Reyne" in first.inner_text()

    bad = tmp_path / "notes.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8: refused with the reason, nothing ingested
    page.set_input_files("[data-testid=upload-input]", str(bad))
    page.wait_for_selector("[data-testid=upload-status][data-state=failed]")
    assert "not UTF-8" in page.inner_text("[data-testid=upload-status]")
    assert get(server, "/api/status")["chunks"] == 13
    only_local(page, server, expected_errors=("status of 422",))  # the browser logs the refused upload


HISTORY_MODES = ["qcfuse", "cacheblend", "epic"]
HISTORY_RATIOS = (0.15, 0.3)


def history_rows_match_the_api(page, server) -> list[dict]:
    """Every row of the page's history table equals the API's row: TTFT, decode rate, total
    and the quality columns (KL, token match, same answer) -> the API's rows."""
    api = get(server, "/api/history")["rows"]
    rows = page.locator("[data-testid=history-row]")
    assert rows.count() == len(api)
    for i, want in enumerate(api):
        row = rows.nth(i)
        assert row.get_attribute("data-run-id") == want["run_id"] and row.get_attribute("data-model") == want["model"]
        assert row.get_attribute("data-method") == want["method"]
        assert row.locator("[data-testid=h-ttft]").inner_text() == f"{js_fixed(want['ttft_ms'])} ms"
        assert row.locator("[data-testid=h-total]").inner_text() == f"{js_fixed(want['total_ms'])} ms"
        dec = want["decode_tok_s"]
        assert row.locator("[data-testid=h-decode]").inner_text() == ("–" if dec is None else f"{js_fixed(dec)} tok/s")
        q = want["quality"]
        assert q is not None  # every run here had full prefill to compare with
        assert row.locator("[data-testid=h-kl]").inner_text() == js_fixed(q["kl_first_token"], 4)
        assert row.locator("[data-testid=h-match]").inner_text() == f"{js_fixed(100 * q['token_match'], 1)}%"
        assert row.locator("[data-testid=h-same]").inner_text() == ("yes" if q["answer_matches"] else "no")
    return api


def test_run_history_over_modes_ratios_and_both_models(page, server):
    """3 modes x 2 ratios on SmolLM2, then the switch to Gemma-3-270M (converted now, into the
    fresh cache dir: the loading message shows until it is loaded, then its plain frame) and
    the same 3 x 2 there; every row stays on screen with quality columns equal to the API's,
    the quality-vs-TTFT plot has a point per row, the phone width holds after the conversion,
    and switching back to SmolLM2 answers from its own caches with the history still there."""
    q = "How tall is the Cape Wrayth lighthouse?"
    page.goto(server["url"])
    page.wait_for_selector("[data-testid=chunk-card]")
    options = page.eval_on_selector_all("[data-testid=model-select] option", "els => els.map(e => e.value)")
    assert options[:2] == ["smollm2-135m", "gemma3-270m"]
    assert "(base)" in page.inner_text("[data-testid=model-option-gemma3-270m]")
    assert page.get_attribute("[data-testid=prompt-frame]", "data-kind") == "chat"
    rows_before = len(get(server, "/api/history")["rows"])  # the earlier tests' runs are kept too

    def retrieve(question: str) -> None:
        page.fill("[data-testid=top-k]", "1")  # one chunk, a tiny prompt
        page.fill("[data-testid=question-input]", question)
        with page.expect_response(lambda r: r.url.endswith("/api/search") and question in (r.request.post_data or "")):
            page.click("[data-testid=search-button]")
        page.wait_for_selector("[data-testid=chunk-card]:first-child[data-source='10-lighthouse.md']")
        assert page.locator("[data-testid=chunk-card]").count() == 1

    def runs_on_current_model(model: str) -> list[dict]:
        retrieve(q)
        small_runs(page, repeats=1, new_tokens=4)
        set_modes(page, HISTORY_MODES)
        out = []
        for ratio in HISTORY_RATIOS:
            for m in HISTORY_MODES:
                set_ratio(page, m, ratio)
            run = run_and_check_cards(page)
            assert run["model"] == model and [(r["method"], r["ratio"]) for r in run["results"]] == \
                [(m, ratio) for m in HISTORY_MODES]
            assert run["reference"] is not None  # full is not a mode: the reference the quality is against
            out.append(run)
        return out

    smol = runs_on_current_model("smollm2-135m")
    assert smol[0]["results"][0]["cache_hits"] == 1

    page.select_option("[data-testid=model-select]", "gemma3-270m")
    notice = page.wait_for_selector("[data-testid=model-loading]")
    assert re.search(r"(Waiting to load|Converting|Loading|Warming up) gemma-3-270m|loading the model",
                     notice.inner_text()), notice.inner_text()
    page.wait_for_selector("[data-testid=model-loading]", state="detached", timeout=CONVERT_TIMEOUT_MS)
    page.wait_for_selector("[data-testid=prompt-frame][data-kind=plain]")  # the page shows the loaded model
    assert page.locator("[data-testid=error]").count() == 0
    assert page.input_value("[data-testid=model-select]") == "gemma3-270m"
    assert " 18 layers " in f" {page.inner_text('[data-testid=store-info]')} "
    page.click("[data-testid=prompt-frame] summary")
    frame = page.inner_text("[data-testid=prompt-frame-text]")
    assert frame.startswith("<bos>") and frame.rstrip().endswith("Answer:") and "{question}" in frame
    assert "no chat template" in page.inner_text("[data-testid=prompt-frame] summary")
    stops = page.inner_text("[data-testid=prompt-frame-stop]")
    assert '"\\nQuestion:"' in stops and '"\\nAnswer:"' in stops
    assert {m["id"]: m["converted"] for m in get(server, "/api/models")["models"]}["gemma3-270m"] is True
    assert "converts once" not in page.inner_text("[data-testid=model-option-gemma3-270m]")
    phone_width_holds(page)  # after Gemma's conversion

    gemma = runs_on_current_model("gemma3-270m")
    for run in gemma:
        for r in run["results"]:  # the base model's answer ends where it starts a next line of the frame
            assert r["answer"].strip() and "Question:" not in r["answer"] and "Answer:" not in r["answer"]
            assert r["finish_reason"] == "stop" or r["new_tokens"] == 4, r
        assert "Answer:" not in run["reference"]["answer"]
    qc = gemma[0]["results"][0]
    assert 0 < qc["recomputed_tokens"] < qc["context_tokens"]
    page.click("[data-testid=answer-card][data-method=qcfuse] [data-testid=details-button]")
    page.wait_for_selector("[data-testid=details-panel]")
    assert page.inner_text("[data-testid=layer-value]") == "17"  # Gemma-3-270M's last layer
    page.click("[data-testid=answer-card][data-method=qcfuse] [data-testid=details-button]")  # closed again

    # the history: 3 modes x 2 ratios x 2 models (and each run's reference), all on screen
    api = history_rows_match_the_api(page, server)
    new = api[rows_before:]
    combos = {(r["model"], r["method"], r["ratio"]) for r in new if r["index"] is not None}
    assert combos == {(m, x, r) for m in ("smollm2-135m", "gemma3-270m") for x in HISTORY_MODES for r in HISTORY_RATIOS}
    assert sum(1 for r in new if r["label"] == "full (reference)") == 4
    plot = page.locator("[data-testid=quality-plot]")
    assert plot.locator("svg").count() == 1
    assert plot.locator("[data-testid=plot-point]").count() == sum(1 for r in api if r["quality"] is not None)
    assert plot.locator("[data-testid=plot-point][data-model=gemma3-270m]").count() == 8
    page.select_option("[data-testid=plot-axis]", "match")
    assert plot.get_attribute("data-axis") == "match"
    assert plot.locator("[data-testid=plot-point]").count() == len(api)
    page.select_option("[data-testid=plot-axis]", "kl")
    page.set_viewport_size({"width": 1280, "height": 800})
    page.locator("[data-testid=history]").scroll_into_view_if_needed()
    shot(page, "studio-1280x800-history.png")
    phone_width_holds(page)
    page.locator("[data-testid=quality-plot]").scroll_into_view_if_needed()
    page.set_viewport_size({"width": 390, "height": 844})
    shot(page, "studio-390x844-history.png")
    page.set_viewport_size({"width": 1280, "height": 800})
    page.evaluate("window.scrollTo(0, 0)")
    shot(page, "studio-1280x800-gemma.png")

    page.select_option("[data-testid=model-select]", "smollm2-135m")
    # SmolLM2 is still loaded: the switch may finish before any loading notice is drawn, so
    # wait for what the page shows of the model, not for the notice to go
    page.wait_for_selector("[data-testid=prompt-frame][data-kind=chat]")
    page.wait_for_selector("[data-testid=model-loading]", state="detached")
    assert page.locator("[data-testid=history-row]").count() == len(api)  # the history survived both switches
    retrieve(q)
    set_modes(page, ["qcfuse", "full"])
    again = run_and_check_cards(page)
    assert again["model"] == "smollm2-135m" and again["results"][0]["cache_hits"] == 1
    assert again["build"]["built"] == 0  # its caches were where they were
    assert get(server, "/api/status")["model"]["id"] == "smollm2-135m"
    history_rows_match_the_api(page, server)
    only_local(page, server)
