"""The command line of `qcfuse bench load` (eval/load.py runs it in process, eval/load_http.py
against a server's URL)."""

from __future__ import annotations

from qcfuse_core.cli.store import parse_bytes
from qcfuse_core.eval.load import POPULARITY, TIMED_CALL, markdown, plot, run
from qcfuse_core.eval.load_http import TIMED_HTTP, run_http
from qcfuse_core.eval.workload import (
    add_model_options,
    add_report_options,
    add_storage_dtype_option,
    bench_subparsers,
    positive_float,
    positive_int,
    write_reports,
)


def cmd_load(args) -> int:
    import sys

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.url:
        rows, timed = run_http(args, progress), TIMED_HTTP
    else:
        rows, timed = run(args, progress), TIMED_CALL
    write_reports(args, rows, timed, markdown(rows), plot)
    return 0


def add_load_parser(bench_sub) -> None:
    p = bench_sub.add_parser("load", help="many concurrent clients: throughput, TTFT and inter-token latency")
    add_model_options(p)
    p.add_argument(
        "--tier",
        default="default",
        choices=["default", "gpu", "host", "disk"],
        help="default: the store open_engine opens (tiers sized from the machine); gpu/host/disk: the pool "
        "in that one tier, sized to hold it",
    )
    p.add_argument(
        "--host-bytes",
        type=parse_bytes,
        default=None,
        help="--tier default: the host tier's size (e.g. 36e9, 32G; default: from available RAM)",
    )
    p.add_argument(
        "--gpu-chunk-bytes",
        type=parse_bytes,
        default=None,
        help="--tier default: at most this much chunk cache on the GPU (StoreConfig.gpu_bytes; default: what "
        "the engine's GPU budget leaves)",
    )
    add_storage_dtype_option(p)
    p.add_argument("--pool-chunks", type=positive_int, default=50, help="chunks in the pool requests draw from")
    p.add_argument("--chunk-tokens", type=positive_int, default=256, help="tokens per chunk")
    p.add_argument("--chunks-per-request", type=positive_int, default=10, help="pool chunks per request")
    p.add_argument(
        "--popularity",
        default="uniform",
        choices=list(POPULARITY),
        help="how a request draws its chunks: uniform, or zipf (pool chunk i with weight 1/(i+1)^s)",
    )
    p.add_argument("--zipf-s", type=positive_float, default=1.0, help="--popularity zipf: the exponent s")
    p.add_argument("--query-tokens", type=positive_int, default=32, help="tokens of each request's question")
    p.add_argument("--prefix-tokens", type=int, default=16, help="tokens of the system prompt (the prefix's text)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens per answer (greedy, EOS ignored)")
    p.add_argument(
        "--clients",
        type=positive_int,
        nargs="+",
        default=None,
        help="closed loop at each count of concurrent clients (default 1 2 4 8 16 32 when --rate is not given)",
    )
    p.add_argument(
        "--requests-per-client", type=positive_int, default=3, help="closed loop: requests each client sends"
    )
    p.add_argument("--rate", type=positive_float, nargs="+", default=None, help="open loop at each rate (requests/s)")
    p.add_argument(
        "--burst", type=positive_int, nargs="+", default=None, help="a burst of each of these sizes, submitted at once"
    )
    p.add_argument(
        "--shared-chunks",
        type=int,
        default=0,
        help="chunks every request holds (the pool's first ones), of its --chunks-per-request",
    )
    p.add_argument("--open-requests", type=positive_int, default=32, help="open loop: requests submitted per rate")
    p.add_argument(
        "--requests",
        type=positive_int,
        default=None,
        help="requests per point in either mode (overrides --requests-per-client and --open-requests)",
    )
    p.add_argument(
        "--duration-s",
        type=positive_float,
        default=120.0,
        help="cap per point and method: no request is submitted after it, those running are cancelled",
    )
    p.add_argument("--methods", nargs="+", default=["full", "qcfuse"], help="methods, each on the same requests")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.15], help="recompute ratios")
    p.add_argument("--max-running", type=int, default=0, help="SchedulerConfig.max_running (0: its default)")
    p.add_argument(
        "--step-prefill-tokens",
        type=int,
        default=0,
        help="SchedulerConfig.step_prefill_tokens: prefill rows one scheduler step runs, a fixed budget that "
        "overrides --step-prefill-ms (0: the budget in time)",
    )
    p.add_argument(
        "--step-prefill-ms",
        type=float,
        default=0.0,
        help="SchedulerConfig.step_prefill_ms: one step's prefill time, its rows sized from the measured "
        "prefill rate (0: the device's default)",
    )
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=["auto", "fp8"],
        help="CacheConfig.kv_dtype: the running requests' KV caches in the model's dtype (auto) or fp8",
    )
    p.add_argument(
        "--rates", default=None, help="planner rates JSON (from `bench ttft`); None: every stored chunk is loaded"
    )
    p.add_argument("--store", default=None, help="store folder (None: a new temp folder)")
    p.add_argument(
        "--url",
        default=None,
        help="an OpenAI-compatible server (`qcfuse serve`), e.g. http://127.0.0.1:8000: the requests go there "
        "over HTTP (streamed /v1/completions; the pool through /v1/chunks); the model options then only "
        "pick the tokenizer that makes the texts",
    )
    p.add_argument("--api-key", default=None, help="with --url: the server's bearer token")
    p.add_argument(
        "--chunks",
        default="register",
        choices=["register", "learn"],
        help="with --url: register the pool through /v1/chunks and name each request's chunks (register), or "
        "send neither and let the server learn them from the prompts, each shown once first (learn) "
        "(default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the texts, the draws and the arrivals")
    add_report_options(p)
    p.add_argument("--plot", default=None, help="write a PNG of TTFT p50 and output tokens/s against load")
    p.set_defaults(func=cmd_load)


def add_commands(sub) -> None:
    """Add `bench load` to the CLI, under an existing `bench` command if another module made one."""
    add_load_parser(bench_subparsers(sub))
