"""The command line of `qcfuse bench trace` (eval/trace.py runs it)."""

from __future__ import annotations

import sys
from pathlib import Path

from qcfuse_core.cli.store import parse_bytes
from qcfuse_core.eval.workload import add_model_options, add_report_options, bench_subparsers, positive_int


def cmd_trace(args) -> int:
    from qcfuse_core.eval.trace import TIMED_CALL, markdown, plot, run
    from qcfuse_core.eval.workload import write_json

    rows = run(args, lambda line: print(line, file=sys.stderr, flush=True))
    md = markdown(rows)
    print(md)
    write_json(args, rows, TIMED_CALL)
    if args.markdown:
        Path(args.markdown).write_text(md + "\n")
    if args.plot:
        plot(rows, Path(args.plot))
    return 0


def add_commands(sub) -> None:
    """Add `bench trace` under the `bench` command."""
    p = bench_subparsers(sub).add_parser(
        "trace", help="a RAG trace through the openai client: batches of new questions, qcfuse against full prefill"
    )
    add_model_options(p)
    p.add_argument(
        "--url",
        default=None,
        help="a running qcfuse serve (e.g. http://127.0.0.1:8000; one per mode); without it the same server app "
        "runs in this process on the model options' model (else they only pick the tokenizer that makes the texts)",
    )
    p.add_argument("--api-key", default=None, help="with --url: the server's bearer token")
    p.add_argument("--modes", nargs="+", default=["learned", "registered"], help="learned, registered (in this order)")
    p.add_argument("--pool-docs", type=positive_int, default=50, help="documents in the corpus (default: %(default)s)")
    p.add_argument("--doc-tokens", type=positive_int, default=256, help="tokens per document (default: %(default)s)")
    p.add_argument(
        "--docs-per-request", type=positive_int, default=10, help="documents per request (default: %(default)s)"
    )
    p.add_argument(
        "--zipf-s", type=float, default=1.0, help="the draws' Zipf exponent (0: uniform) (default: %(default)s)"
    )
    p.add_argument(
        "--dataset",
        type=Path,
        default=None,
        help="a QA set whose paragraphs make the documents and whose questions are asked (default: the packaged "
        "sample corpus and generated questions; a named shape: generated text)",
    )
    p.add_argument(
        "--query-tokens", type=positive_int, default=24, help="generated questions' tokens (default: %(default)s)"
    )
    p.add_argument(
        "--templates",
        nargs="+",
        default=["llamaindex", "langchain"],
        help="RAG templates, request by request in turn: llamaindex, langchain (default: %(default)s)",
    )
    p.add_argument(
        "--api",
        default="auto",
        choices=["auto", "chat", "completions"],
        help="auto: chat where the tokenizer has a chat template, completions otherwise (default: %(default)s)",
    )
    p.add_argument("--batches", type=positive_int, default=10, help="batches of new questions (default: %(default)s)")
    p.add_argument("--clients", type=positive_int, default=8, help="concurrent clients (default: %(default)s)")
    p.add_argument(
        "--requests-per-client",
        type=positive_int,
        default=1,
        help="requests each client sends per batch (default: %(default)s)",
    )
    p.add_argument("--ratio", type=float, default=0.15, help="qcfuse's recompute ratio (default: %(default)s)")
    p.add_argument(
        "--max-new-tokens", type=positive_int, default=32, help="tokens per answer, EOS ignored (default: %(default)s)"
    )
    p.add_argument(
        "--settle-s",
        type=float,
        default=60.0,
        help="learned: after a batch, wait at most this long for the learner's builds (default: %(default)s)",
    )
    p.add_argument("--duration-s", type=float, default=600.0, help="cap per batch and method (default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per request (default: %(default)s)")
    p.add_argument("--store", default=None, help="in process: the stores' folder (default: a temp folder)")
    p.add_argument("--host-bytes", type=parse_bytes, default=None, help="in process: the host tier's size (e.g. 36e9)")
    p.add_argument(
        "--gpu-chunk-bytes", type=parse_bytes, default=None, help="in process: at most this much chunk cache on the GPU"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the corpus, the draws and the questions")
    add_report_options(p)
    p.add_argument("--plot", default=None, help="write a PNG of the speedup per batch (full prefill at 1x)")
    p.set_defaults(func=cmd_trace)
