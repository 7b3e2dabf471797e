"""`qcfuse bench trace`: a RAG trace through an OpenAI-compatible server, as its users send it.

    qcfuse bench trace --url http://127.0.0.1:8000 --modes learned \\
        --pool-docs 50 --doc-tokens 1024 --docs-per-request 10 --batches 10 --clients 8
    qcfuse bench trace --shape llama-3.1-8b --device cuda --dtype bf16 ...   # in process

The client is the real `openai` package (eval/trace_client.py). With `--url` it talks to a
running `qcfuse serve`; without, to the same server app in this process (`create_app` over an
engine on the default tiers, reached through `ASGIStreamTransport`: no socket, no uvicorn), so
over HTTP and in process run the same client code on the same trace.

The trace (eval/trace_prompts.py): a corpus of `--pool-docs` documents; `--batches` batches
of `--clients` closed-loop clients x `--requests-per-client`; each request draws
`--docs-per-request` documents by Zipf(`--zipf-s`) and asks a new question, in LlamaIndex's or
LangChain's default RAG template (a chat where the model has a chat template, else a
completion). Nothing names the documents: the server finds them by content.

Modes (`--modes`), each on a fresh server in process (over HTTP: start one per mode):

    learned      nothing registered: the server learns the documents from the prompts
    registered   the corpus sent to POST /v1/chunks first (its caches built), then the trace

Per batch the qcfuse method (`--ratio`) runs first, then the same requests with `method:
full` on the same server (full first would show the server the batch's documents before
qcfuse asks for them); then, learned, the run waits up to `--settle-s` for the learner's
builds (/metrics `qcfuse_learned_pending` 0; the wait is in the row). A row per (mode, batch,
method): TTFT p50/p99 on the client's clock and the server's (`qcfuse.ttft_ms`), ITL p50/p99,
req/s, cached_tokens over prompt tokens, the recompute share, guard escalations, each tier's
share of the chunks, and the learner's counters over the batch. A qcfuse row's speedup is the
same batch's full TTFT p50 over its own, on each clock. Everything comes from the responses
(and the server's /metrics): nothing is read from the engine directly.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx

from qcfuse_core.eval.load import LoadRequest, Method, Trace, closed_loop, percentile, summarize
from qcfuse_core.eval.load_http import _gauge
from qcfuse_core.eval.trace_client import SOURCES, ASGIStreamTransport, Sent, send
from qcfuse_core.eval.trace_prompts import TEMPLATES, batches, corpus, render, warmup_docs
from qcfuse_core.eval.workload import build_adapter

TIMED_CALL = "openai.AsyncOpenAI(...).chat.completions.create / .completions.create (stream)"
MODES = ("learned", "registered")
REGISTER_BATCH = 16  # texts per POST /v1/chunks
POLL_S = 0.05
IDLE_WAIT_S = 120.0


def run(args, progress: Callable[[str], None] = lambda line: None) -> list[dict]:
    """Every mode's batches (module docstring) -> rows."""
    _check(args)
    t0 = time.perf_counter()
    adapter = build_adapter(args)  # in process the server's model; over HTTP its tokenizer makes the texts
    progress(f"model {adapter.name} built in {time.perf_counter() - t0:.1f} s")
    tok = adapter.tokenizer
    chat = args.api == "chat" or (args.api == "auto" and bool(getattr(tok, "chat_template", None)))
    pool, questions = corpus(tok, args.pool_docs, args.doc_tokens, args.seed, args.dataset)
    per_batch = args.clients * args.requests_per_client
    trace = batches(
        tok, pool, questions, args.batches, per_batch, args.docs_per_request, args.query_tokens, args.zipf_s, args.seed
    )
    extra = {"warmup": warmup_docs(tok, args.docs_per_request, args.doc_tokens, args.seed), "chat": chat}
    rows: list[dict] = []
    for mode in args.modes:
        if args.url:
            http = httpx.AsyncClient(base_url=args.url.rstrip("/"), timeout=args.timeout_s)
            rows += asyncio.run(_mode(http, mode, pool.texts, trace, args, extra, progress))
        else:
            rows += _in_process(adapter, mode, pool.texts, trace, args, extra, progress)
    return rows


def _check(args) -> None:
    if args.url and (args.host_bytes is not None or args.gpu_chunk_bytes is not None or args.store or args.no_guard):
        raise ValueError(
            "--host-bytes, --gpu-chunk-bytes, --store and --no-guard set up the in-process server (no --url)"
        )
    if args.docs_per_request > args.pool_docs:
        raise ValueError(f"--docs-per-request ({args.docs_per_request}) is more than --pool-docs ({args.pool_docs})")
    for t in args.templates:
        if t not in TEMPLATES:
            raise ValueError(f"unknown template {t!r}; valid: {', '.join(TEMPLATES)}")
    for m in args.modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; valid: {', '.join(MODES)}")


def _in_process(adapter, mode, texts, trace, args, extra, progress) -> list[dict]:
    """One mode against the server app over a fresh engine and store in this process."""
    from qcfuse_core.engine.api import QCFuseEngine
    from qcfuse_core.engine.config import CacheConfig, EngineConfig
    from qcfuse_core.engine.guard import GuardConfig
    from qcfuse_core.eval.workload import open_default_store
    from qcfuse_core.serve.app import create_app

    root = Path(args.store) / f"trace-{mode}" if args.store else Path(tempfile.mkdtemp(prefix="qcfuse-trace-"))
    cuda = adapter.device.type == "cuda"
    if cuda:  # the last mode's engine gone before this store sizes its GPU tier from the free memory
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
    store = open_default_store(root / "kv", cuda, host_bytes=args.host_bytes, gpu_bytes=args.gpu_chunk_bytes)
    # the engine `qcfuse serve` opens: a chunk read from disk stays in memory
    config = EngineConfig(threads=args.threads or None, cache=CacheConfig(promote_disk_reads=True))
    if args.no_guard:  # a diagnostic: the speed without the guard's escalations
        config = replace(config, guard=GuardConfig(enabled=False))
    engine = QCFuseEngine(adapter, store=store, config=config)
    app = create_app(engine)
    try:
        http = httpx.AsyncClient(
            transport=ASGIStreamTransport(app), base_url="http://127.0.0.1", timeout=args.timeout_s
        )
        return asyncio.run(_mode(http, mode, texts, trace, args, extra, progress, where="in process"))
    finally:
        if app.state.learner is not None:
            app.state.learner.close()
        app.state.builds.close()
        engine.close()
        shutil.rmtree(root, ignore_errors=True)


async def _mode(http, mode, texts, trace, args, extra, progress, where: str = "over HTTP") -> list[dict]:
    """One mode's batches through one client -> its rows."""
    import openai

    async with http:
        client = openai.AsyncOpenAI(
            base_url=str(http.base_url).rstrip("/") + "/v1",
            api_key=args.api_key or "unused",
            http_client=http,
            max_retries=0,
        )
        model = (await client.models.list()).data[0].id
        qc, full = Method("qcfuse", args.ratio, args.ratio), Method("full", 0.0, None)
        for m in (qc, full):  # the warm-up: documents outside the corpus
            w = Sent(time.perf_counter())
            req = LoadRequest("What do these passages say?", tuple(extra["warmup"]), ())
            await send(client, model, req, args.templates[0], extra["chat"], _body(m, 2), w)
            if not w.finished:
                raise RuntimeError(f"the warm-up request failed: {w.error or 'refused'}")
        build_s = await _register(http, texts) if mode == "registered" else None
        if build_s is not None:
            progress(f"{mode}: {len(texts)} documents registered through /v1/chunks in {build_s:.1f} s")
        base = {"mode": mode, "where": where, "model": model, "api": "chat" if extra["chat"] else "completions"}
        base["guard"] = "off" if args.no_guard else "server's"
        base |= {"register_s": None if build_s is None else round(build_s, 3), "clients": args.clients}
        rows: list[dict] = []
        learned = await _learned(http)
        for b, reqs in enumerate(trace, 1):
            pair = {}
            for m in (qc, full):
                traces, wall = await _batch(client, model, reqs, m, args, extra["chat"], b)
                await _idle(http)
                pair[m.label] = row = {**base, "batch": b, "method": m.label, "ratio": m.reported_ratio}
                row |= batch_fields(traces, wall)
            settled = await _settle(http, args.settle_s) if mode == "learned" else 0.0
            now = await _learned(http)
            counts = {k: v - learned.get(k, 0) for k, v in now.items() if k != "pending"}  # over the batch
            pair["qcfuse"]["learned"] = counts or None
            pair["qcfuse"]["settle_s"], learned = round(settled, 3), now
            _speedups(pair["qcfuse"], pair["full"])
            rows += [pair["qcfuse"], pair["full"]]
            progress(f"{mode} batch {b}/{len(trace)} {where}: " + one_line(pair["qcfuse"], pair["full"]))
        return rows


def _body(method: Method, max_tokens: int) -> dict:
    return {
        "max_tokens": max_tokens,
        "extra_body": {"qcfuse": {"method": method.label, "ratio": method.ratio, "ignore_eos": True}},
    }


async def _batch(client, model, reqs, method: Method, args, chat: bool, b: int) -> tuple[list[Sent], float]:
    """One batch's requests from `--clients` closed-loop clients -> (traces, wall seconds)."""
    n = len(args.templates)
    template = {r: args.templates[((b - 1) * len(reqs) + i) % n] for i, r in enumerate(reqs)}
    body = _body(method, args.max_new_tokens)

    async def one(req: LoadRequest, trace) -> None:
        await send(client, model, req, template[req], chat, body, trace)

    start = time.perf_counter()
    traces, _ = await closed_loop(one, reqs, args.clients, start + args.duration_s, make=Sent)
    return traces, time.perf_counter() - start  # type: ignore[return-value]


async def _register(http: httpx.AsyncClient, texts: list[str]) -> float:
    """The corpus to POST /v1/chunks, REGISTER_BATCH texts a call -> seconds taken."""
    t0 = time.perf_counter()
    for i in range(0, len(texts), REGISTER_BATCH):
        part = texts[i : i + REGISTER_BATCH]
        ids = [f"trace-{j}" for j in range(i, i + len(part))]
        res = await http.post("/v1/chunks", json={"texts": part, "ids": ids})
        if res.status_code != 200:
            raise ValueError(f"/v1/chunks answered {res.status_code}: {res.text[:300]}")
    return time.perf_counter() - t0


async def _poll(http: httpx.AsyncClient, done: Callable[[], object], limit_s: float) -> tuple[bool, float]:
    """Until `await done()` is true or `limit_s` passed -> (done, seconds waited)."""
    t0 = time.perf_counter()
    while True:
        if await done():  # type: ignore[misc]
            return True, time.perf_counter() - t0
        if time.perf_counter() - t0 > limit_s:
            return False, time.perf_counter() - t0
        await asyncio.sleep(POLL_S)


async def _idle(http: httpx.AsyncClient) -> None:
    async def idle() -> bool:
        h = (await http.get("/health")).json()
        return h["running"] == 0 and h["waiting"] == 0

    ok, _ = await _poll(http, idle, IDLE_WAIT_S)
    if not ok:
        raise RuntimeError(f"the server still runs requests {IDLE_WAIT_S} s after a batch")


async def _settle(http: httpx.AsyncClient, limit_s: float) -> float:
    """Wait (at most limit_s) for the learner's builds -> seconds waited."""

    async def built() -> bool:
        return _gauge((await http.get("/metrics")).text, "qcfuse_learned_pending") == 0

    return (await _poll(http, built, limit_s))[1]


async def _learned(http: httpx.AsyncClient) -> dict[str, int]:
    from qcfuse_core.eval.first_sighting import parse_learned

    return parse_learned((await http.get("/metrics")).text) or {}


# ----------------------------------------------------------------------------- a batch's figures


def _p(xs: list[float], q: float) -> float | None:
    v = percentile(xs, q)
    return None if v is None else round(v, 3)


def batch_fields(traces: list[Sent], wall: float) -> dict:
    """A batch's figures for one method, from its responses (module docstring)."""
    done = [t for t in traces if t.finished]
    s = summarize(list[Trace](traces), wall)  # counts, req/s, the server's TTFT and ITL percentiles, E2E
    client = [t.client_ttft_ms for t in done if t.client_ttft_ms is not None]
    server = [t.ttft_ms for t in done if t.ttft_ms is not None]
    itl = [t.itl_ms for t in done if t.itl_ms is not None]
    gaps = [(b - a) * 1e3 for t in done for a, b in zip(t.deltas, t.deltas[1:])]
    prompt, context = sum(t.prompt_tokens for t in done), sum(t.context_tokens for t in done)
    chunks = sum(t.chunks for t in done)
    sources = {k: sum(t.sources.get(k, 0) for t in done) for k in SOURCES}
    segs = sum(sources.values())
    keep = ("submitted", "finished", "errors", "cancelled", "refused", "error_messages", "wall_s", "requests_per_s")
    return {
        **{k: s[k] for k in keep},
        "ttft_ms_p50": _p(client, 50),  # the client's clock: submit -> the first text chunk
        "ttft_ms_p99": _p(client, 99),
        "server_ttft_ms_p50": _p(server, 50),  # qcfuse.ttft_ms
        "server_ttft_ms_p99": _p(server, 99),
        "kept_ttft_ms_p50": _p(
            [t.client_ttft_ms for t in done if t.client_ttft_ms is not None and not t.escalated], 50
        ),
        "itl_ms_p50": _p(itl, 50),
        "itl_ms_p99": _p(itl, 99),
        "client_gap_ms_p99": _p(gaps, 99),  # between text chunks, the client's clock
        "text_chunks_per_token": round(sum(len(t.deltas) for t in done) / max(1, sum(t.tokens for t in done)), 4),
        "e2e_ms_p50": s["e2e_ms_p50"],
        "prompt_tokens": prompt,
        "cached_tokens": sum(t.cached_tokens for t in done),
        "cached_share": round(sum(t.cached_tokens for t in done) / prompt, 4) if prompt else None,
        "recompute_share": round(sum(t.recomputed_tokens for t in done) / context, 4) if context else None,
        "chunk_hit_share": round(sum(t.cache_hits for t in done) / chunks, 4) if chunks else None,
        "escalations": sum(t.escalated for t in done),
        "ran_as": sorted({t.ran_as for t in done}),
        **{f"chunks_{k}": round(v / segs, 4) if segs else None for k, v in sources.items()},
        "requests": [_request(t) for t in traces],
    }


def _request(t: Sent) -> dict:
    """One request's own figures (the JSON keeps them beside the batch's)."""
    if not t.finished:
        return {"error": t.error, "refused": t.refused, "cancelled": t.cancelled}
    keys = ("client_ttft_ms", "ttft_ms", "itl_ms", "tokens", "prompt_tokens", "cached_tokens", "context_tokens")
    out = {k: round(v, 3) if isinstance(v, float) else v for k in keys if (v := getattr(t, k)) is not None}
    out |= {"recomputed_tokens": t.recomputed_tokens, "chunks": t.chunks, "cache_hits": t.cache_hits}
    out |= {"escalated": t.escalated, "guard": t.guard, "ran_as": t.ran_as, "sources": t.sources}
    return out | {"text_chunks": len(t.deltas)}


def _speedups(qc: dict, full: dict) -> None:
    for clock in ("", "server_"):
        a, b = full[f"{clock}ttft_ms_p50"], qc[f"{clock}ttft_ms_p50"]
        qc[f"{clock}speedup"] = round(a / b, 3) if a and b else None


# ----------------------------------------------------------------------------- reports


def _f(x, digits: int = 1, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def one_line(qc: dict, full: dict) -> str:
    return (
        f"TTFT p50 {_f(qc['ttft_ms_p50'])} ms (server {_f(qc['server_ttft_ms_p50'])}) against full "
        f"{_f(full['ttft_ms_p50'])} ({_f(full['server_ttft_ms_p50'])}): {_f(qc['speedup'], 2, 'x')} "
        f"({_f(qc['server_speedup'], 2, 'x')}), cached {_pct(qc['cached_share'])}, recomputed "
        f"{_pct(qc['recompute_share'])}, {qc['finished']}/{qc['submitted']} finished, {qc['errors']} errors, "
        f"{qc['escalations']} escalated"
    )


def markdown(rows: list[dict]) -> str:
    """A table per (mode, where): a line per batch, qcfuse beside full prefill."""
    out: list[str] = []
    groups = dict.fromkeys((r["mode"], r["where"], r.get("guard")) for r in rows)
    for mode, where, guard in groups:
        mine = [r for r in rows if (r["mode"], r["where"], r.get("guard")) == (mode, where, guard)]
        full = {r["batch"]: r for r in mine if r["method"] == "full"}
        out += [
            f"{mode}, {where}" + (", the quality guard off:" if guard == "off" else ":"),
            "",
            "| batch | TTFT p50 ms | p99 | server p50 | full p50 | full server p50 | speedup | server speedup "
            "| ITL p50 ms | ITL p99 | req/s | full req/s | cached | recomputed | escalated "
            "| chunks from GPU / host / disk / recomputed | finished |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in (r for r in mine if r["method"] != "full"):
            f = full.get(r["batch"], {})
            tiers = " / ".join(_pct(r[f"chunks_{k}"]) for k in SOURCES)
            out.append(
                f"| {r['batch']} | {_f(r['ttft_ms_p50'])} | {_f(r['ttft_ms_p99'])} | {_f(r['server_ttft_ms_p50'])} "
                f"| {_f(f.get('ttft_ms_p50'))} | {_f(f.get('server_ttft_ms_p50'))} | {_f(r['speedup'], 2, 'x')} "
                f"| {_f(r['server_speedup'], 2, 'x')} | {_f(r['itl_ms_p50'], 2)} | {_f(r['itl_ms_p99'], 2)} "
                f"| {r['requests_per_s']:.2f} | {f.get('requests_per_s', 0):.2f} | {_pct(r['cached_share'])} "
                f"| {_pct(r['recompute_share'])} | {r['escalations']} | {tiers} | {r['finished']}/{r['submitted']} |"
            )
        out.append("")
    return "\n".join(out).rstrip()


def plot(rows: list[dict], path: Path) -> Path:
    """TTFT speedup over full prefill against batch (client and server clocks), full prefill's
    line at 1x, and the cached share, a line per (mode, where)."""
    from qcfuse_core.eval.plot import Panel, plot_panels

    speed: dict[str, list[tuple[float, float]]] = {}
    cached: dict[str, list[tuple[float, float]]] = {}
    batches_seen = sorted({r["batch"] for r in rows}) or [1]
    for r in (r for r in rows if r["method"] != "full"):
        label = f"{r['mode']} ({r['where']})"
        if r["speedup"] is not None:
            speed.setdefault(label, []).append((r["batch"], r["speedup"]))
        if r["server_speedup"] is not None:
            speed.setdefault(f"{label}, server clock", []).append((r["batch"], r["server_speedup"]))
        if r["cached_share"] is not None:
            cached.setdefault(label, []).append((r["batch"], r["cached_share"]))
    speed["full prefill"] = [(b, 1.0) for b in batches_seen]
    panels = [
        Panel("TTFT p50 speedup over full prefill", "batch", speed),
        Panel("cached_tokens / prompt tokens", "batch", cached),
    ]
    return plot_panels(panels, path, columns=2)


def prompt_example(template: str, docs: list[str], question: str, chat: bool) -> str:
    """What one request sends (the command's --show-prompt): messages or the prompt text."""
    p = render(template, docs, question, chat)
    if p.messages is not None:
        return "\n".join(f"[{m['role']}] {m['content']}" for m in p.messages)
    return p.text or ""
