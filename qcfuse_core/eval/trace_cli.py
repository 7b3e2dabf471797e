"""The command line of `qcfuse bench trace` (eval/trace.py runs it)."""

from __future__ import annotations

import sys
from pathlib import Path

from qcfuse_core.cli.store import parse_bytes
from qcfuse_core.eval.workload import (
    add_model_options,
    add_report_options,
    bench_subparsers,
    positive_float,
    positive_int,
    write_reports,
)

# (flag, type, default, help): the numbers of the trace (--help shows each default)
NUMBERS = (
    ("--pool-docs", positive_int, 50, "documents in the corpus"),
    ("--doc-tokens", positive_int, 256, "tokens per document"),
    ("--docs-per-request", positive_int, 10, "documents per request"),
    ("--zipf-s", float, 1.0, "the draws' Zipf exponent (0: uniform)"),
    ("--query-tokens", positive_int, 24, "tokens of a generated question"),
    ("--batches", positive_int, 10, "batches of new questions"),
    ("--clients", positive_int, 8, "concurrent clients (closed loop)"),
    ("--requests-per-client", positive_int, 1, "requests each client sends per batch"),
    ("--ratio", float, 0.15, "qcfuse's recompute ratio"),
    ("--max-new-tokens", positive_int, 32, "tokens per answer (EOS ignored)"),
    ("--settle-s", float, 60.0, "learned: after a batch, wait at most this long for the learner's builds"),
    ("--duration-s", positive_float, 600.0, "cap per batch and method: no request is sent after it"),
    ("--timeout-s", positive_float, 600.0, "per request"),
    ("--seed", int, 0, "seed of the corpus, the draws and the questions"),
)

# (flag, type, help): the in-process server's store (no --url)
IN_PROCESS = (
    ("--store", str, "the stores' folder (default: a temp folder)"),
    ("--host-bytes", parse_bytes, "the host tier's size (e.g. 36e9; default: from available RAM)"),
    ("--gpu-chunk-bytes", parse_bytes, "at most this much chunk cache on the GPU"),
)


def cmd_trace(args) -> int:
    from qcfuse_core.eval.trace import TIMED_CALL, markdown, plot, run

    rows = run(args, lambda line: print(line, file=sys.stderr, flush=True))
    write_reports(args, rows, TIMED_CALL, markdown(rows), plot)
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
    p.add_argument(
        "--dataset",
        type=Path,
        default=None,
        help="a QA set whose paragraphs make the documents and whose questions are asked (default: the packaged "
        "sample corpus and generated questions; a named shape: generated text)",
    )
    p.add_argument(
        "--templates", nargs="+", default=["llamaindex", "langchain"], help="RAG templates, one request each in turn"
    )
    p.add_argument(
        "--api",
        default="auto",
        choices=["auto", "chat", "completions"],
        help="auto: chat where the tokenizer has a chat template, completions otherwise",
    )
    for flag, kind, default, what in NUMBERS:
        p.add_argument(flag, type=kind, default=default, help=what)
    for flag, parse, what in IN_PROCESS:
        p.add_argument(flag, type=parse, default=None, help="in process: " + what)
    p.add_argument(
        "--no-guard",
        action="store_true",
        help="in process, a diagnostic: the engine's quality guard off (the speed without its escalations)",
    )
    add_report_options(p)
    p.add_argument("--plot", default=None, help="write a PNG of the speedup per batch (full prefill at 1x)")
    p.set_defaults(func=cmd_trace)
