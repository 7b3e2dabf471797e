"""`qcfuse bench ttft`: time-to-first-token through `engine.answer`, full prefill beside every method.

    qcfuse bench ttft --shape llama-3.1-8b --device cuda --context-sizes 10x1024 32x1024 \\
        --query-tokens 32 --tier host disk --methods full qcfuse cacheblend epic naive --ratios 0.15 0.3

What is timed is what users run: `engine.answer(question, chunk_texts, node_ids=...,
max_new_tokens=1)` - text in, first token out, tokenisation, the chunk lookup by content
and node id, planning, loading, selection and fused prefill included. There is no other
copy of the request here (tests/test_bench_ttft.py checks that the timed call is
`engine.answer`).

Per context size and tier: chunk texts (a named shape gets random weights and a byte-level
tokenizer, so 1 byte = 1 token; a real model gets random words from the sample corpus) are
ingested with `engine.build_chunks` into a tiered store that holds them in that tier only;
the planner's rates are measured (or read from the JSON next to the store); then every
(method, ratio) runs its warm-ups and the median of `--runs` is taken, all in one process.
A further `--breakdown-runs` per configuration run with `sync_stages=True`: each stage waits
for the GPU, so the stages (lookup, plan, load_start, select, prefill, first_token) show
their own device time and add up to that run's TTFT. On the disk tier the entry files are
dropped from the page cache (posix_fadvise DONTNEED) before every run.

`--max-new-tokens N` (N > 1) streams N tokens per answer instead (`engine.stream`, greedy,
end-of-sequence ignored so every answer has N tokens): TTFT is then the time to the first
text delta, and each row adds the answer's end-to-end time and decode ms/token, the mean time
between tokens after the first. The breakdown runs stay at one token.

`--ingest-chunks N` also times `engine.build_chunks` on N fresh chunks of the largest size
(store writes included) against full prefill's tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import logging
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qcfuse_core.eval.workload import (
    Workload,
    add_model_options,
    add_report_options,
    add_storage_dtype_option,
    bench_subparsers,
    build_adapter,
    kv_bytes_per_token,
    make_workload,
    open_tier_store,
    positive_int,
    sync,
    write_json,
)

log = logging.getLogger(__name__)

STAGE_KEYS = ("queue_ms", "lookup_ms", "plan_ms", "load_start_ms", "select_ms", "prefill_ms", "first_token_ms")


# ----------------------------------------------------------------------------- setup


def parse_size(text: str) -> tuple[int, int]:
    """'CxN' -> (C chunks, N tokens each)."""
    c, sep, n = text.lower().partition("x")
    try:
        size = (int(c), int(n))
    except ValueError:
        size = None
    if not sep or size is None or min(size) < 1:
        raise argparse.ArgumentTypeError(f"context size {text!r}: expected CHUNKSxTOKENS, e.g. 10x1024")
    return size


def drop_page_cache(folder: Path) -> int:
    """posix_fadvise(DONTNEED) every file under `folder` -> files advised (clean pages only)."""
    n = 0
    if not hasattr(os, "posix_fadvise"):
        return 0
    for dirpath, _, files in os.walk(folder):
        for f in files:
            try:
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


# ----------------------------------------------------------------------------- one request


@dataclass
class RunResult:
    ttft_ms: float  # wall time to the first token (engine.answer's return with one new token)
    stages: dict  # FusionResult.timings_ms
    internal_ms: float = 0.0  # FusionResult.ttft_ms: the engine's own clock (request start -> first token)
    probe_ms: float = 0.0
    context_tokens: int = 0
    prompt_tokens: int = 0
    recomputed_tokens: int = 0
    method: str = ""  # what the engine ran (`full` when the planner fell back)
    plan: dict | None = None
    sync_layer_loads: int = 0
    compute_ms: list[float] | None = None
    threads: int = 0
    e2e_ms: float = 0.0  # wall time of the whole answer (== ttft_ms with one new token)
    new_tokens: int = 1

    @property
    def decode_ms_per_token(self) -> float | None:
        """Mean time between tokens after the first (None with one token)."""
        return (self.e2e_ms - self.ttft_ms) / (self.new_tokens - 1) if self.new_tokens > 1 else None


def timed_answer(
    engine,
    work: Workload,
    method: str,
    ratio: float,
    *,
    sync_stages: bool = False,
    drop: Path | None = None,
    new_tokens: int = 1,
) -> RunResult:
    """One request through the public call, timed from the call to its return.

    new_tokens == 1: `engine.answer(..., max_new_tokens=1)`, TTFT = its wall time. More:
    `engine.stream(..., max_new_tokens=new_tokens, ignore_eos=True)` (every answer runs to its
    full length), end-to-end = the wall time to the stream's end, TTFT = the request's own
    clock from submit (inside the call) to its first token (`FusionResult.ttft_ms`): the first
    text delta can come much later - a tokenizer holds back bytes that do not yet form text
    (random weights over a byte-level vocabulary emit few whole characters).
    """
    if drop is not None:
        drop_page_cache(drop)
    sync(engine.adapter.device)
    kw = dict(node_ids=work.node_ids, method=method, ratio=ratio, sync_stages=sync_stages)
    t0 = time.perf_counter()
    if new_tokens == 1:
        r = engine.answer(work.question, work.texts, max_new_tokens=1, **kw)
        wall = e2e = (time.perf_counter() - t0) * 1e3
    else:
        stream = engine.stream(work.question, work.texts, max_new_tokens=new_tokens, ignore_eos=True, **kw)
        for _ in stream:
            pass
        e2e = (time.perf_counter() - t0) * 1e3
        r = stream.result
        wall = r.ttft_ms
    sel = r.selection.details if r.selection is not None else {}
    return RunResult(
        wall,
        dict(r.timings_ms),
        r.ttft_ms,
        float(sel.get("probe_ms", 0.0)),
        r.context_tokens,
        r.prompt_tokens,
        r.recomputed_tokens,
        r.method,
        r.plan or None,
        int(r.load.get("sync_layer_loads", 0)),
        r.load.get("compute_ms") or None,
        r.threads,
        e2e,
        len(r.token_ids),
    )


# ----------------------------------------------------------------------------- rates


def measure_tier_gbps(engine, work: Workload, drop: Path | None, repeats: int = 3) -> float:
    """Bandwidth of loading every layer of every chunk through the prefetcher (no compute)."""
    from qcfuse_core.model.fusion import FusedPrompt, Segment

    caches = engine.caches
    pf = engine.lookup.prefetcher
    segs = []
    for text in work.texts:
        ids, key = caches.chunk_tokens(text)
        segs.append(Segment("chunk", ids, pf.view(key, ids)))
    prompt = FusedPrompt(segs + [Segment("suffix", caches.tokenize(work.question))])
    like = torch.empty(0, device=engine.adapter.device, dtype=engine.adapter.dtype)
    times = []
    for _ in range(repeats + 1):
        if drop is not None:
            drop_page_cache(drop)
        sync(engine.adapter.device)
        t0 = time.perf_counter()
        session = pf.start(prompt)
        try:
            for l in range(engine.adapter.num_layers):
                session.layer(l, like)
            rep = session.finish()  # synchronizes on CUDA
        finally:
            session.close()
        times.append(time.perf_counter() - t0)
    return rep.bytes_loaded / statistics.median(times[1:]) / 1e9


# ----------------------------------------------------------------------------- driver


def _stats(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def _median_lists(ls: list[list[float]]) -> list[float]:
    ls = [l for l in ls if l]
    if not ls:
        return []
    return [round(statistics.median(v), 4) for v in zip(*ls)]


def sizes_of(args) -> list[tuple[int, int]]:
    return list(args.context_sizes) if args.context_sizes else [(args.chunks, args.chunk_tokens)]


def run(args) -> tuple[list[dict], dict | None]:
    """Every context size x tier x (method, ratio) -> (table rows, ingestion figures or None);
    rows are written to --json as they come."""
    from qcfuse_core.selection.base import get_selector

    for m in args.methods:  # fail before building anything
        get_selector(m)
    torch.manual_seed(args.seed)
    if args.runs < 1 or args.warmup < 0 or args.breakdown_runs < 0:
        raise ValueError("--runs must be >= 1, --warmup and --breakdown-runs >= 0")
    t_build = time.perf_counter()
    adapter = build_adapter(args)
    log.info("model %s built in %.1f s", adapter.name, time.perf_counter() - t_build)
    root = Path(args.store) if args.store else Path(tempfile.mkdtemp(prefix="qcfuse-ttft-"))
    rows: list[dict] = []
    for chunks, chunk_tokens in sizes_of(args):
        work = make_workload(
            adapter.tokenizer,
            chunks,
            chunk_tokens,
            args.query_tokens,
            args.prefix_tokens,
            args.seed,
            tag=f"{chunks}x{chunk_tokens}",
        )
        for tier in args.tier:
            rows += run_tier(args, adapter, work, root, tier, (chunks, chunk_tokens))
            write_json(args, rows, timed_call(args), partial=True)  # a tier's rows survive a later timeout
    return rows, (measure_ingest(args, adapter, root, rows) if args.ingest_chunks else None)


def run_tier(args, adapter, work: Workload, root: Path, tier: str, size: tuple[int, int]) -> list[dict]:
    from qcfuse_core.cache.planner import Rates, device_name, load_rates, rates_path, save_rates
    from qcfuse_core.engine.api import QCFuseEngine
    from qcfuse_core.engine.config import CacheConfig, EngineConfig, FrameConfig
    from qcfuse_core.eval.hooks import internals
    from qcfuse_core.selection.base import get_selector

    device = adapter.device
    cuda = device.type == "cuda"
    new = args.max_new_tokens  # tokens per answer: 1 times TTFT alone; more adds decode and end-to-end
    kv_root = root / f"kv-{tier}-{size[0]}x{size[1]}"
    nbytes = kv_bytes_per_token(adapter) * size[0] * size[1]
    store = open_tier_store(kv_root, tier, nbytes, cuda, getattr(args, "storage_dtype", "auto"))
    engine = QCFuseEngine(
        adapter,
        store=store,
        config=EngineConfig(
            threads=args.threads or None,
            frame=FrameConfig(work.system),
            cache=CacheConfig(promote_disk_reads=False),  # each run reads the tier it measures
        ),
    )
    t0 = time.perf_counter()
    keys = engine.build_chunks(work.texts, work.node_ids)
    build_s = time.perf_counter() - t0
    if tier == "gpu":
        for k in keys:
            store.get(k)  # promote into the GPU tier
    held = [t.name for t in store.memory_tiers for k in keys if k in t]
    if tier != "disk" and held.count(tier) != len(keys):
        raise RuntimeError(f"only {held.count(tier)} of {len(keys)} chunks fit in the {tier} tier")
    drop = kv_root if tier == "disk" else None
    fp = adapter.fingerprint()
    rpath = Path(args.rates) if args.rates else rates_path(root, fp, device_name(device))
    rates = None if args.remeasure else load_rates(rpath)
    # full prefill's warm-ups first: they give the planner's prefill rate (the timed full runs
    # are interleaved with the methods' below, and refine a freshly measured rate)
    fr = [timed_answer(engine, work, "full", 0.0, new_tokens=new) for _ in range(max(args.warmup, 1))]
    full_ms = min(r.ttft_ms for r in fr)
    T = fr[0].prompt_tokens
    fresh = rates is None
    if rates is None or tier not in rates.tier_gbps:
        gbps = measure_tier_gbps(engine, work, drop)
        old = rates.tier_gbps if rates is not None else {}
        rates = Rates(
            prefill_ms_per_token=full_ms / T,
            tier_gbps={**old, tier: gbps},
            kv_bytes_per_token=kv_bytes_per_token(adapter),
            calib_tokens=T,
            select_ms=rates.select_ms if rates is not None else {},
            device=device_name(device),
            model=fp,
            measured=_dt.date.today().isoformat(),
        )
        save_rates(rates, rpath)
        log.info(
            "rates: %.4f ms/token, %s GB/s (saved to %s)",
            rates.prefill_ms_per_token,
            {k: round(v, 2) for k, v in rates.tier_gbps.items()},
            rpath,
        )
    context = fr[0].context_tokens  # chunks and the glue between them (what a ratio is a share of)
    base = dict(
        tier=tier,
        device=str(device),
        context_tokens=context,
        prompt_tokens=T,
        chunks=size[0],
        chunk_tokens=size[1],
        query_tokens=args.query_tokens,
        model=adapter.name,
        dtype=str(adapter.dtype).replace("torch.", ""),
        runs=args.runs,
        timed_call=timed_call(args),
        max_new_tokens=new,
        build_chunks_s=round(build_s, 3),
        interleaved=True,
    )
    configs = [
        (m, r, None)
        for m in args.methods
        if m != "full"
        for r in (args.ratios if get_selector(m).uses_ratio else [0.0])
    ]
    configs += [(label, r, opts) for label, opts in (getattr(args, "variant", None) or []) for r in args.ratios]

    def use(opts) -> None:
        internals(engine).use(selection=dict(opts or {}), rates=None if args.no_planner else rates)

    def method_of(label: str, opts) -> str:
        return "qcfuse" if opts is not None else label

    for label, ratio, opts in configs:  # warm-ups; they also measure each method's lookup + select
        use(opts)
        warm = _repeat(
            lambda: timed_answer(engine, work, method_of(label, opts), ratio, drop=drop, new_tokens=new),
            args,
            0,
            max(args.warmup, 2),  # the first call compiles and captures (the probe's graph): not an overhead
        )
        over = min(sum(w.stages.get(k, 0.0) for k in ("lookup_ms", "select_ms")) for w in warm)
        rates = dataclasses.replace(
            rates, select_ms={**rates.select_ms, label: max(over, rates.select_ms.get(label, 0.0))}
        )
    # timed runs round-robin over full and every method, so a drift of the machine (clocks,
    # other work) reaches each of them alike and the speedups compare like with like
    timed: dict[int, list[RunResult]] = {i: [] for i in range(-1, len(configs))}
    for _ in range(args.runs):
        timed[-1].append(timed_answer(engine, work, "full", 0.0, new_tokens=new))
        for i, (label, ratio, opts) in enumerate(configs):
            use(opts)
            timed[i].append(timed_answer(engine, work, method_of(label, opts), ratio, drop=drop, new_tokens=new))
    rows = []
    full_ms = statistics.median(r.ttft_ms for r in timed[-1])
    if fresh:
        rates = dataclasses.replace(rates, prefill_ms_per_token=full_ms / T)
    if "full" in args.methods:
        fb = [timed_answer(engine, work, "full", 0.0, sync_stages=True) for _ in range(args.breakdown_runs)]
        rows.append(_row(base, "full", None, timed[-1], fb, full_ms, [r.ttft_ms for r in timed[-1]]))
    for i, (label, ratio, opts) in enumerate(configs):
        use(opts)
        method = method_of(label, opts)
        bd = [
            timed_answer(engine, work, method, ratio, sync_stages=True, drop=drop) for _ in range(args.breakdown_runs)
        ]
        row = _row(
            base,
            label,
            ratio if get_selector(method).uses_ratio else None,
            timed[i],
            bd,
            full_ms,
            [r.ttft_ms for r in timed[-1]],
        )
        rows.append(row if opts is None else dict(row, options=opts))
    save_rates(rates, rpath)  # with the measured selection overheads: the engine's planner reads them
    for r in rows:
        r["rates"] = {
            "prefill_ms_per_token": round(rates.prefill_ms_per_token, 5),
            "tier_gbps": {k: round(v, 3) for k, v in rates.tier_gbps.items()},
            "file": rpath.name,
        }
    store.close()
    shutil.rmtree(kv_root, ignore_errors=True)  # GBs of scratch caches; the rates file stays
    return rows


def measure_ingest(args, adapter, root: Path, rows: list[dict]) -> dict:
    """`engine.build_chunks` on fresh chunks of the largest size into a store with the default
    configuration (the host tier sized from available RAM, the disk under --store), store writes included, against
    the best full-prefill tokens/s measured above."""
    from qcfuse_core.engine.api import QCFuseEngine
    from qcfuse_core.engine.config import EngineConfig
    from qcfuse_core.store import open_store

    chunks, n = args.ingest_chunks, max(sizes_of(args), key=lambda s: s[0] * s[1])[1]
    work = make_workload(adapter.tokenizer, chunks, n, 1, 0, args.seed + 1, tag="ingest")
    store = open_store(root / "kv-ingest", use_cuda=adapter.device.type == "cuda")
    engine = QCFuseEngine(adapter, store=store, config=EngineConfig(threads=args.threads or None))
    engine.build_chunks(work.texts[:1], work.node_ids[:1])  # warm-up (kernels, allocator)
    sync(adapter.device)
    t0 = time.perf_counter()
    engine.build_chunks(work.texts[1:], work.node_ids[1:])
    sync(adapter.device)
    secs = time.perf_counter() - t0
    host_bytes = store.host.capacity_bytes
    store.close()
    shutil.rmtree(root / "kv-ingest", ignore_errors=True)
    from qcfuse_core.ingest.prefill import default_batch_tokens, plan_batches, prefill_alone_batch

    ids = [engine.caches.chunk_tokens(t)[0] for t in work.texts[1:]]  # the same prefills, no store: compute alone
    sync(adapter.device)
    t1 = time.perf_counter()
    for batch in plan_batches([len(i) for i in ids], default_batch_tokens(adapter.device)):
        prefill_alone_batch(adapter, [ids[j] for j in batch])
    sync(adapter.device)
    compute_s = time.perf_counter() - t1
    tokens = (chunks - 1) * n
    full = [r for r in rows if r.get("method") == "full"]
    full_tps = max((r["prompt_tokens"] / r["ttft_ms_median"] * 1e3 for r in full), default=None)
    out = dict(
        chunks=chunks - 1,
        chunk_tokens=n,
        host_tier_bytes=host_bytes,
        seconds=round(secs, 3),
        tokens_per_s=round(tokens / secs, 1),
        prefill_only_tokens_per_s=round(tokens / compute_s, 1),
        store=str(root.name),
        full_prefill_tokens_per_s=round(full_tps, 1) if full_tps else None,
    )
    if full_tps:
        out["share_of_full"] = round(tokens / secs / full_tps, 3)
    log.info("ingest: %s", out)
    return out


def _repeat(fn, args, warmup: int, runs: int | None = None) -> list[RunResult]:
    for _ in range(warmup):
        fn()
    return [fn() for _ in range(args.runs if runs is None else runs)]


def _row(
    base: dict,
    method: str,
    ratio: float | None,
    rs: list[RunResult],
    bd: list[RunResult],
    full_ms: float,
    full_runs: list[float] | None = None,
) -> dict:
    """One table row. full_runs: full prefill's timed runs, round by round with `rs`: the
    per-round speedups (full's run / this method's run of the same round) cancel a drift of
    the machine that the ratio of the two medians keeps."""
    med, lo, hi = _stats([r.ttft_ms for r in rs])
    paired = [f / r.ttft_ms for f, r in zip(full_runs or [], rs)]
    stage = lambda name, src: round(statistics.median(r.stages.get(name, 0.0) for r in src), 3) if src else 0.0  # noqa: E731
    src = bd or rs
    plans = [r.plan for r in rs if r.plan]
    ran = sorted({r.method for r in rs})
    stages = {k: stage(k, src) for k in STAGE_KEYS}
    return {
        **base,
        "method": method,
        "ratio": ratio,
        "ttft_ms_median": round(med, 3),
        "ttft_ms_min": round(lo, 3),
        "ttft_ms_max": round(hi, 3),
        "speedup_vs_full": round(full_ms / med, 3),
        "speedup_paired_median": round(statistics.median(paired), 3) if paired else None,
        "speedup_paired_min": round(min(paired), 3) if paired else None,
        "speedup_paired_max": round(max(paired), 3) if paired else None,
        "ttft_ms_runs": [round(r.ttft_ms, 3) for r in rs],
        "select_ms": stages["select_ms"],
        "probe_ms": round(statistics.median(r.probe_ms for r in src), 3),
        "fuse_ms": stages["prefill_ms"],
        "load_wait_ms": stage("load_wait_ms", src),
        "sidecar_ms": stages["load_start_ms"],
        "stages_ms": stages,
        "stages_synced": bool(bd),
        "stages_sum_ms": round(sum(stages.values()), 3),
        "ttft_ms_synced": round(statistics.median(r.ttft_ms for r in bd), 3) if bd else None,
        "ttft_ms_internal_median": round(statistics.median(r.internal_ms for r in rs), 3),
        "compute_ms_per_layer": _median_lists([r.compute_ms for r in src if r.compute_ms]),
        "recomputed_tokens": int(statistics.median(r.recomputed_tokens for r in rs)),
        "sync_layer_loads": max(r.sync_layer_loads for r in rs),
        "plan": plans[-1] if plans else None,
        "ran_as": ran,
        "threads": sorted({r.threads for r in rs}),
        **_decode_fields(rs),
    }


def _decode_fields(rs: list[RunResult]) -> dict:
    """End-to-end time of the answer and decode ms/token (mean time between tokens after
    the first), medians over the runs; decode is None with one new token."""
    per_token = [d for d in (r.decode_ms_per_token for r in rs) if d is not None]
    return {
        "new_tokens": int(statistics.median(r.new_tokens for r in rs)),
        "e2e_ms_median": round(statistics.median(r.e2e_ms for r in rs), 3),
        "e2e_ms_runs": [round(r.e2e_ms, 3) for r in rs],
        "decode_ms_per_token_median": round(statistics.median(per_token), 3) if per_token else None,
    }


def timed_call(args) -> str:
    return "engine.answer" if args.max_new_tokens == 1 else "engine.stream"


def markdown(rows: list[dict]) -> str:
    """The table; with more than one new token per answer (--max-new-tokens), two more
    columns: decode ms/token and the answer's end-to-end ms (with its token count)."""
    decode = any(r.get("max_new_tokens", 1) > 1 for r in rows)
    out = [
        "| context | tier | method | ratio | TTFT median ms (min-max) | speedup | lookup | plan | load start | select | probe | prefill | first token | sum (synced TTFT) | load wait | recomputed | plan (loaded/recomputed chunks) |"
        + (" decode ms/token | end-to-end ms (tokens) |" if decode else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if decode else ""),
    ]
    for r in rows:
        p = r.get("plan")
        pl = "-" if not p else ("full prefill" if p["all_recompute"] else f"{len(p['loaded'])}/{len(p['recomputed'])}")
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        st = r["stages_ms"]
        synced = f" ({r['ttft_ms_synced']:.1f})" if r.get("ttft_ms_synced") is not None else ""
        out.append(
            f"| {r['chunks']}x{r['chunk_tokens']} | {r['tier']} | {r['method']} | {ratio} "
            f"| {r['ttft_ms_median']:.1f} ({r['ttft_ms_min']:.1f}-{r['ttft_ms_max']:.1f}) "
            f"| {r['speedup_vs_full']:.2f}x | {st['lookup_ms']:.1f} | {st['plan_ms']:.1f} | {st['load_start_ms']:.1f} "
            f"| {st['select_ms']:.1f} | {r['probe_ms']:.1f} | {st['prefill_ms']:.1f} | {st['first_token_ms']:.1f} "
            f"| {r['stages_sum_ms']:.1f}{synced} | {r['load_wait_ms']:.1f} | {r['recomputed_tokens']}/{r['context_tokens']} | {pl} |"
            + (_decode_cells(r) if decode else "")
        )
    return "\n".join(out)


def _decode_cells(r: dict) -> str:
    per_token = r.get("decode_ms_per_token_median")
    return f" {'-' if per_token is None else f'{per_token:.2f}'} | {r['e2e_ms_median']:.1f} ({r['new_tokens']}) |"


def cmd_ttft(args) -> int:
    rows, ingest = run(args)
    md = markdown(rows)
    if ingest:
        md += f"\n\ningest (build_chunks): {ingest}"
    print(md)
    write_json(args, rows, timed_call(args), {"ingest": ingest} if ingest else None)
    if args.markdown:
        Path(args.markdown).write_text(md + "\n")
    return 0


def add_ttft_parser(bench_sub) -> None:
    p = bench_sub.add_parser("ttft", help="time-to-first-token: full prefill vs fused methods")
    add_model_options(p)
    p.add_argument("--chunks", type=int, default=8, help="chunks per prompt")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk")
    p.add_argument(
        "--context-sizes",
        type=parse_size,
        nargs="+",
        default=None,
        metavar="CxN",
        help="sweep context sizes in one run, e.g. 4x1024 10x1024 (overrides --chunks/--chunk-tokens)",
    )
    p.add_argument("--query-tokens", type=int, default=32, help="tokens of the question")
    p.add_argument("--prefix-tokens", type=int, default=16, help="tokens of the system prompt (the prefix's text)")
    p.add_argument(
        "--tier", nargs="+", default=["host"], choices=["gpu", "host", "disk"], help="where the chunk caches are"
    )
    add_storage_dtype_option(p)
    p.add_argument("--methods", nargs="+", default=["full", "qcfuse", "cacheblend", "naive"], help="methods to time")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.15, 0.3], help="recompute ratios")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        type=parse_variant,
        metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
        help="also time qcfuse with these selection options (QCFuseOptions), reported as LABEL; "
        "repeatable, e.g. qcfuse-dev2:deviation_pool=2",
    )
    p.add_argument("--runs", type=int, default=10, help="timed runs per configuration (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    p.add_argument(
        "--breakdown-runs",
        type=int,
        default=3,
        help="extra runs per configuration with synchronised stages (the breakdown columns; one new token)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=1,
        help="tokens per answer (greedy, to the full length whatever the model says); above 1 the "
        "answer is streamed and decode ms/token and end-to-end ms are reported beside TTFT",
    )
    p.add_argument(
        "--ingest-chunks",
        type=int,
        default=0,
        help="also time engine.build_chunks on this many fresh chunks of the largest size",
    )
    p.add_argument("--store", default=None, help="store folder (None: a new temp folder)")
    p.add_argument("--rates", default=None, help="planner rates JSON (None: next to the store)")
    p.add_argument("--remeasure", action="store_true", help="measure rates even if the JSON exists")
    p.add_argument("--no-planner", action="store_true", help="load every chunk (no load/recompute planning)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    add_report_options(p)
    p.set_defaults(func=cmd_ttft)


def parse_variant(text: str) -> tuple[str, dict]:
    """'LABEL:KEY=VALUE[,KEY=VALUE]' -> (LABEL, options) (selectors.parse_selection_options)."""
    from qcfuse_core.selection.options import parse_selection_options

    label, sep, rest = text.partition(":")
    if not sep or not label or not rest:
        raise argparse.ArgumentTypeError(f"variant {text!r}: expected LABEL:KEY=VALUE[,KEY=VALUE]")
    try:
        return label, parse_selection_options(rest)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"variant {text!r}: {e}") from e


def add_commands(sub) -> None:
    """Add `bench ttft` to the CLI, under an existing `bench` command if another module made one."""
    add_ttft_parser(bench_subparsers(sub))
