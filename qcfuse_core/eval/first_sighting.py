"""`qcfuse bench first-sighting --url URL`: what learning costs the request that first shows a
server its documents (issue 66, item 1), measured as a user would feel it.

A user sends fresh document sets one after another, each a streamed chat completion of an
unmodified OpenAI client's shape, nothing registered and nothing named:

    {"messages": [{"role": "user", "content": "Context:\\n<passage>\\n\\n<passage>...\\n\\nQuestion: <q>"}],
     "max_tokens": N, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}}

one set per record of a dataset (`--dataset`, `--docs` passages each, the records from
`--offset` that hold as many);
`--pairs` sends each set twice in a row (its first sighting, then its second: with learning
on, the second is served from the caches built meanwhile, if they are). `--gap-s` is the
user's pause between requests (0: the next request goes out as the last one ends).

Each request's row: its set, its sighting (1, 2), the client's TTFT (submit to the first text
delta), the server's (`qcfuse.ttft_ms`), prompt and cached tokens. The summary: the median
TTFT of first and second sightings, and the server's learned counters at the end (/metrics).
The server's setting is the comparison: run it against `qcfuse serve` (learning on, the
default) and `qcfuse serve --learn-after 0` (learning off), each over an empty store, and
compare the two medians (the target: first sightings with learning on <= 1.1x learning off).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from qcfuse_core.eval.datasets import Example, load_dataset

DEFAULT_DATASET = Path("..") / "shared" / "data" / "hotpotqa" / "hotpotqa_train.json"
LEARNED = ("builds", "hits", "misses", "dropped", "pending")  # /metrics: qcfuse_learned_<name>


def prompt_of(example: Example, docs: int) -> str:
    return "Context:\n" + "\n\n".join(example.passages[:docs]) + f"\n\nQuestion: {example.question}"


def chat(client: httpx.Client, model: str, content: str, max_tokens: int) -> dict:
    """One streamed chat completion -> {client_ttft_ms, server_ttft_ms, prompt_tokens,
    cached_tokens}; raises on an HTTP error or an error event."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    row: dict = {"client_ttft_ms": None, "server_ttft_ms": None, "prompt_tokens": None, "cached_tokens": None}
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body) as res:
        if res.status_code != 200:
            raise RuntimeError(f"HTTP {res.status_code}: {res.read().decode(errors='replace')[:200]}")
        for line in res.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error'].get('message')}")
            if row["client_ttft_ms"] is None and any((c.get("delta") or {}).get("content") for c in event["choices"]):
                row["client_ttft_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
            if event.get("qcfuse"):
                row["server_ttft_ms"] = event["qcfuse"]["ttft_ms"]
            if event.get("usage"):
                row["prompt_tokens"] = event["usage"]["prompt_tokens"]
                row["cached_tokens"] = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return row


def learned_counters(client: httpx.Client) -> dict[str, int] | None:
    """The server's qcfuse_learned_* counters (/metrics) -> None when it learns nothing."""
    return parse_learned(client.get("/metrics").text)


def parse_learned(text: str) -> dict[str, int] | None:
    """The qcfuse_learned_* counters of a /metrics text -> None when it has none."""
    got = {}
    for line in text.splitlines():
        for name in LEARNED:
            if line.startswith((f"qcfuse_learned_{name} ", f"qcfuse_learned_{name}_total ")):
                got[name] = int(float(line.split()[-1]))
    return got or None


def run(args, progress: Callable[[str], None] = lambda line: None) -> dict:
    """The benchmark (module docstring) -> {"rows": [...], "summary": {...}}."""
    examples = [e for e in load_dataset(args.dataset, offset=args.offset) if len(e.passages) >= args.docs]
    if len(examples) < args.sets:
        raise ValueError(f"{args.dataset}: {len(examples)} records from {args.offset} hold {args.docs} passages")
    examples = examples[: args.sets]  # the first `sets` records from `offset` with `docs` passages
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rows = []
    with httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=args.timeout_s) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        chat(client, model, "Say hello.", 2)  # warm-up: nothing in it is learned (no context span)
        for i, example in enumerate(examples):
            for sighting in (1, 2) if args.pairs else (1,):
                time.sleep(args.gap_s)
                row = {
                    "set": i,
                    "sighting": sighting,
                    **chat(client, model, prompt_of(example, args.docs), args.max_tokens),
                }
                rows.append(row)
                progress(json.dumps(row))
        learned = learned_counters(client)
    return {"rows": rows, "summary": summarize(rows, learned)}


def summarize(rows: list[dict], learned: dict[str, int] | None) -> dict:
    """Median TTFTs of first and second sightings (client and server clocks) and the counters."""
    out: dict = {"learning": learned is not None, "learned": learned}
    for sighting in (1, 2):
        mine = [r for r in rows if r["sighting"] == sighting]
        if mine:
            out[f"sighting_{sighting}"] = {
                "requests": len(mine),
                "client_ttft_ms": round(statistics.median(r["client_ttft_ms"] for r in mine), 1),
                "server_ttft_ms": round(statistics.median(r["server_ttft_ms"] for r in mine), 1),
                "cached_share": round(sum(r["cached_tokens"] for r in mine) / sum(r["prompt_tokens"] for r in mine), 3),
            }
    return out


def add_commands(sub) -> None:
    from qcfuse_core.eval.workload import bench_subparsers, positive_int

    p = bench_subparsers(sub).add_parser(
        "first-sighting", help="what learning costs the request that first shows a server its documents (--url)"
    )
    p.add_argument("--url", required=True, help="a running qcfuse serve (or any OpenAI-compatible server)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: none)")
    p.add_argument("--dataset", type=Path, default=DEFAULT_DATASET, help="evaluation set (default: %(default)s)")
    p.add_argument("--sets", type=positive_int, default=10, help="document sets, one per record (default: %(default)s)")
    p.add_argument("--offset", type=int, default=0, help="the first record (default: %(default)s)")
    p.add_argument("--docs", type=positive_int, default=6, help="passages per set (default: %(default)s)")
    p.add_argument("--pairs", action="store_true", help="send each set twice in a row (its second sighting too)")
    p.add_argument("--gap-s", type=float, default=0.0, help="pause before each request (default: %(default)s)")
    p.add_argument("--max-tokens", type=positive_int, default=8, help="tokens per answer (default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request (default: %(default)s)")
    p.add_argument("--json", default=None, help="write the rows and the summary to this file")
    p.set_defaults(func=cmd_first_sighting)


def cmd_first_sighting(args) -> int:
    out = run(args, progress=lambda line: print(line, flush=True))
    print(json.dumps(out["summary"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0
