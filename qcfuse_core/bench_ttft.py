"""`qcfuse bench ttft`: time-to-first-token of full prefill against fused methods, one process.

    qcfuse bench ttft --shape llama-3.1-8b --device cuda --chunks 10 --chunk-tokens 1024 \\
        --query-tokens 32 --tier host disk --methods full qcfuse cacheblend naive --ratios 0.15 0.3

Per tier: build the chunk caches (random token ids; a named shape gets random weights, a
real model is loaded from disk - nothing is downloaded) into a tiered store holding them in
that tier only, with the probe sidecars; measure the planner's rates (or read them from the
JSON next to the store); then time each (method, ratio) - warm-up runs first, then the
median of `--runs`. One request, timed from lookup to the first token on the host:

    1 lookup   which tier holds each chunk              (prefetch.Prefetcher.tier_of)
    2 plan     load or recompute each chunk             (planner.plan)
    3 sidecars anchors + critical K of loaded chunks    (Prefetcher.view)
    4 prefetch layers 0..L-1 start loading              (Prefetcher.start)
    5 select   probe / score / pick rows                (selectors)
    6 fuse     layer loop, waiting per layer            (fusion.fused_prefill, source=prefetcher)
    7 token    argmax of the last logits (synchronizes)

`full` is HF transformers' own forward (sdpa) of the same prompt. On the disk tier the
entry files are dropped from the page cache (posix_fadvise DONTNEED) before every run.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

TINY_PREFIX = "tiny-"


# ----------------------------------------------------------------------------- setup


def build_adapter(args):
    from qcfuse_core.model import _dtype, load_model
    from qcfuse_core.testing import SHAPES, shaped_model, tiny_model

    dtype = _dtype(args.dtype, args.device)
    if args.shape and args.shape.startswith(TINY_PREFIX):
        return tiny_model(args.shape[len(TINY_PREFIX):], dtype=dtype)
    if args.shape:
        if args.shape not in SHAPES:
            raise ValueError(f"unknown shape {args.shape!r}; valid: {', '.join(SHAPES)} (or tiny-<arch>)")
        return shaped_model(args.shape, dtype=dtype, device=args.device, seed=args.seed)
    return load_model(None if args.model in (None, "embedded") else args.model, dtype=dtype, device=args.device)


@dataclass
class Workload:
    prefix_ids: torch.Tensor
    chunk_ids: list[torch.Tensor]
    suffix_ids: torch.Tensor

    @property
    def token_ids(self) -> torch.Tensor:
        return torch.cat([self.prefix_ids, *self.chunk_ids, self.suffix_ids])


def make_workload(vocab: int, chunks: int, chunk_tokens: int, query_tokens: int, prefix_tokens: int, seed: int) -> Workload:
    g = torch.Generator().manual_seed(seed)
    lo, hi = min(100, vocab // 4), max(vocab - 100, vocab // 2)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64)

    return Workload(ids(prefix_tokens), [ids(chunk_tokens) for _ in range(chunks)], ids(query_tokens))


def cache_alone(adapter, ids: torch.Tensor):
    """A segment alone at positions 0..n-1 -> KVChunk (pre-RoPE K), as the engine ingests it."""
    from qcfuse_core.fusion import FusedPrompt, KVCache, Segment, fused_prefill
    from qcfuse_core.types import ChunkKey, KVChunk

    n = len(ids)
    cache = KVCache(adapter, n)
    out = fused_prefill(adapter, FusedPrompt([Segment("suffix", ids)]), torch.arange(n), kv_out=cache,
                        capture_pre_rope=True)
    return KVChunk(ChunkKey.for_tokens(adapter.fingerprint(), ids), ids.clone(), out.k_pre, cache.v[:, :n].clone())


def open_tier_store(root: Path, tier: str, nbytes: int, cuda: bool):
    """A tiered store at `root` that keeps entries in `tier` only (plus the disk copy)."""
    from qcfuse_core.store import open_store

    room = 3 * nbytes + (256 << 20)  # pinned blocks round up to powers of two (docs/benchmarks.md)
    gpu = room if tier == "gpu" else 0
    host = room if tier in ("gpu", "host") else 0
    if tier == "gpu" and not cuda:
        raise ValueError("--tier gpu needs a CUDA device")
    return open_store(root, memory_bytes=host, gpu_bytes=gpu, use_cuda=cuda)


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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- one request


@dataclass
class RunResult:
    ttft_ms: float
    select_ms: float = 0.0
    probe_ms: float = 0.0
    fuse_ms: float = 0.0
    wait_ms: float = 0.0
    sidecar_ms: float = 0.0
    compute_ms: list[float] | None = None
    recomputed_tokens: int = 0
    plan: dict | None = None
    sync_layer_loads: int = 0


class Bench:
    def __init__(self, adapter, work: Workload, store, prefix_chunk, keys, rates, *, planner: bool = True) -> None:
        from qcfuse_core import critical_layers
        from qcfuse_core.fusion import KVCache
        from qcfuse_core.prefetch import Prefetcher

        self.adapter, self.work, self.store, self.prefix_chunk, self.keys = adapter, work, store, prefix_chunk, keys
        self.rates, self.use_planner = rates, planner
        self.device = adapter.device
        self.pf = Prefetcher(adapter, store)
        self.critical, _ = critical_layers.lookup(adapter)
        self.depth = max(self.critical) + 1
        T = int(work.token_ids.numel())
        self.cache = KVCache(adapter, T + 1)
        self.ids = work.token_ids

    def full(self) -> RunResult:
        sync(self.device)
        t0 = time.perf_counter()
        logits, _ = self.adapter.hf_forward(self.ids)
        int(logits[-1].argmax())
        return RunResult((time.perf_counter() - t0) * 1e3, recomputed_tokens=sum(len(c) for c in self.work.chunk_ids))

    def fused(self, method: str, ratio: float, keep_sidecars: str, overhead_ms: float = 0.0,
              options: dict | None = None) -> RunResult:
        from qcfuse_core.fusion import FusedPrompt, Segment, fused_prefill
        from qcfuse_core.planner import plan
        from qcfuse_core.selectors import SelectionContext, get_selector

        adapter, work, pf = self.adapter, self.work, self.pf
        selector = get_selector(method)
        full_layers = 2 if method == "cacheblend" else 0
        sync(self.device)
        t0 = time.perf_counter()
        # 1. lookup, 2. plan
        tiers = [pf.tier_of(k) for k in self.keys]
        n_chunk = [len(c) for c in work.chunk_ids]
        if self.use_planner and self.rates is not None:
            p = plan(self.rates, list(zip(n_chunk, tiers)), ratio=ratio if selector.uses_ratio else 0.0,
                     total_tokens=int(self.ids.numel()), fresh_rows=len(work.suffix_ids),
                     full_layers=full_layers, num_layers=adapter.num_layers, overhead_ms=overhead_ms)
            load = set(p.loaded)
            if p.all_recompute:  # the planner says fused cannot win: ordinary prefill
                r = self.full()
                r.ttft_ms = (time.perf_counter() - t0) * 1e3
                r.plan = p.to_dict()
                return r
            plan_d = p.to_dict()
        else:
            load, plan_d = {i for i, t in enumerate(tiers) if t is not None}, None
        # 3. sidecars first (only the probe needs them), 4. start the layer loads
        probe = method == "qcfuse"
        segs = [Segment("prefix", work.prefix_ids, self.prefix_chunk)]
        for i, (ids, key) in enumerate(zip(work.chunk_ids, self.keys)):
            view = None
            if i in load:
                view = pf.view(key, ids, depth=self.depth if probe else 0, critical=self.critical, keep=keep_sidecars)
            segs.append(Segment("chunk", ids, view))
        segs.append(Segment("suffix", work.suffix_ids))
        prompt = FusedPrompt(segs)
        pf.start(prompt)
        # 5. select
        t1 = time.perf_counter()
        opts = {"critical_layers": self.critical, **(options or {})} if probe else {}
        sel = selector.select(SelectionContext(adapter, prompt, ratio, options=opts))
        t2 = time.perf_counter()
        # 6. fuse, 7. first token
        out = fused_prefill(adapter, prompt, sel.rows, full_layers=sel.full_layers, on_layer_end=sel.on_layer_end,
                            kv_out=self.cache, source=pf)
        int(out.logits[-1].argmax())
        t3 = time.perf_counter()
        rep = pf.finish()
        ctx = prompt.mask("chunk", "text")
        syncs = sum(getattr(s.chunk, "sync_layer_loads", 0) for s in prompt.segments)
        return RunResult(
            ttft_ms=(t3 - t0) * 1e3, select_ms=(t2 - t1) * 1e3,
            probe_ms=float(sel.details.get("probe_ms", 0.0)), fuse_ms=(t3 - t2) * 1e3,
            wait_ms=rep.total_wait_ms, sidecar_ms=rep.sidecar_ms, compute_ms=rep.compute_ms or None,
            recomputed_tokens=int(ctx[out.rows].sum()), plan=plan_d, sync_layer_loads=syncs,
        )


# ----------------------------------------------------------------------------- rates


def measure_tier_gbps(bench: Bench, drop: Path | None, repeats: int = 3) -> float:
    """Bandwidth of loading every layer of every chunk through the prefetcher (no compute)."""
    from qcfuse_core.fusion import FusedPrompt, Segment

    w, pf = bench.work, bench.pf
    segs = [Segment("chunk", ids, pf.view(k, ids)) for ids, k in zip(w.chunk_ids, bench.keys)]
    prompt = FusedPrompt(segs + [Segment("suffix", w.suffix_ids)])
    like = torch.empty(0, device=bench.device, dtype=bench.adapter.dtype)
    times = []
    for _ in range(repeats + 1):
        if drop is not None:
            drop_page_cache(drop)
        sync(bench.device)
        t0 = time.perf_counter()
        pf.start(prompt)
        for l in range(bench.adapter.num_layers):
            pf.layer(l, like)
        rep = pf.finish()  # synchronizes on CUDA
        times.append(time.perf_counter() - t0)
    return rep.bytes_loaded / statistics.median(times[1:]) / 1e9


def kv_bytes_per_token(adapter) -> int:
    s = adapter.shape
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * torch.empty(0, dtype=adapter.dtype).element_size()


# ----------------------------------------------------------------------------- driver


def _stats(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def _median_lists(ls: list[list[float]]) -> list[float]:
    ls = [l for l in ls if l]
    if not ls:
        return []
    return [round(statistics.median(v), 4) for v in zip(*ls)]


def run(args) -> list[dict]:
    from qcfuse_core.planner import Rates, device_name, load_rates, rates_path, save_rates
    from qcfuse_core.prefetch import ensure_sidecar

    from qcfuse_core.selectors import get_selector

    for m in args.methods:  # fail before building anything
        get_selector(m)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.runs < 1 or args.warmup < 0:
        raise ValueError("--runs must be >= 1 and --warmup >= 0")
    t_build = time.perf_counter()
    adapter = build_adapter(args)
    device = adapter.device
    cuda = device.type == "cuda"
    log.info("model %s built in %.1f s", adapter.name, time.perf_counter() - t_build)
    work = make_workload(adapter.shape.vocab_size, args.chunks, args.chunk_tokens, args.query_tokens,
                         args.prefix_tokens, args.seed)
    T = int(work.token_ids.numel())
    context = sum(len(c) for c in work.chunk_ids)
    chunks = [cache_alone(adapter, ids) for ids in work.chunk_ids]
    prefix_chunk = cache_alone(adapter, work.prefix_ids) if len(work.prefix_ids) else None
    nbytes = sum(c.nbytes for c in chunks)
    root = Path(args.store) if args.store else Path(tempfile.mkdtemp(prefix="qcfuse-ttft-"))
    fp = adapter.fingerprint()
    rpath = Path(args.rates) if args.rates else rates_path(root, fp, device_name(device))
    rates = None if args.remeasure else load_rates(rpath)
    rows: list[dict] = []
    full_cache: dict[str, list[float]] = {}
    for tier in args.tier:
        kv_root = root / f"kv-{tier}"
        store = open_tier_store(kv_root, tier, nbytes, cuda)
        for c in chunks:
            store.put(c)
        from qcfuse_core import critical_layers

        crit, _ = critical_layers.lookup(adapter)
        for c in chunks:
            ensure_sidecar(store, adapter, c.key, max(crit) + 1, crit)
            if tier == "gpu":
                store.get(c.key)  # promote into the GPU tier
        keys = [c.key for c in chunks]
        held = [t.name for t in store.memory_tiers for k in keys if k in t]
        if tier != "disk" and held.count(tier) != len(keys):
            raise RuntimeError(f"only {held.count(tier)} of {len(keys)} chunks fit in the {tier} tier")
        drop = kv_root if tier == "disk" else None
        bench = Bench(adapter, work, store, prefix_chunk, keys, rates, planner=not args.no_planner)
        # full prefill first: it is also the planner's prefill rate
        fr = _repeat(lambda: bench.full(), args, drop=None)
        full_ms = statistics.median(r.ttft_ms for r in fr)
        full_cache[tier] = [r.ttft_ms for r in fr]
        if rates is None or tier not in rates.tier_gbps:
            gbps = measure_tier_gbps(bench, drop)
            old = rates.tier_gbps if rates is not None else {}
            rates = Rates(prefill_ms_per_token=full_ms / T, tier_gbps={**old, tier: gbps},
                          kv_bytes_per_token=kv_bytes_per_token(adapter), calib_tokens=T,
                          device=device_name(device), model=fp, measured=_dt.date.today().isoformat())
            save_rates(rates, rpath)
            log.info("rates: %.4f ms/token, %s GB/s (saved to %s)", rates.prefill_ms_per_token,
                     {k: round(v, 2) for k, v in rates.tier_gbps.items()}, rpath)
        bench.rates = rates
        base = dict(tier=tier, device=str(device), context_tokens=context, prompt_tokens=T, chunks=args.chunks,
                    chunk_tokens=args.chunk_tokens, query_tokens=args.query_tokens, model=adapter.name,
                    dtype=str(adapter.dtype).replace("torch.", ""), runs=args.runs)
        if "full" in args.methods:
            rows.append(_row(base, "full", None, fr, full_ms))
        for method in args.methods:
            if method == "full":
                continue
            from qcfuse_core.selectors import get_selector

            ratios = args.ratios if get_selector(method).uses_ratio else [0.0]
            for ratio in ratios:
                rs = _time_fused(bench, args, method, ratio, tier, drop)
                rows.append(_row(base, method, ratio if get_selector(method).uses_ratio else None, rs, full_ms))
        for label, opts in getattr(args, "variant", None) or []:  # qcfuse with other selection options
            for ratio in args.ratios:
                rs = _time_fused(bench, args, "qcfuse", ratio, tier, drop, opts)
                rows.append(dict(_row(base, label, ratio, rs, full_ms), options=opts))
        store.close()
        _write_json(args, rows, partial=True)  # a tier's rows survive a later timeout
    for r in rows:
        r["rates"] = {"prefill_ms_per_token": round(rates.prefill_ms_per_token, 5),
                      "tier_gbps": {k: round(v, 3) for k, v in rates.tier_gbps.items()}, "file": rpath.name}
    return rows


def _time_fused(bench: Bench, args, method: str, ratio: float, tier: str, drop: Path | None,
                options: dict | None = None) -> list[RunResult]:
    """Warm-ups (the first also compiles kernels), then the timed runs of one fused configuration."""
    keep = {"gpu": "device", "host": "host", "disk": "none"}[tier]
    warm = [bench.fused(method, ratio, keep, options=options) for _ in range(max(args.warmup, 1))]
    over = min(w.select_ms for w in warm)  # steady state
    return _repeat(lambda: bench.fused(method, ratio, keep, overhead_ms=over, options=options), args, drop=drop,
                   warm=False)


def _repeat(fn, args, drop: Path | None, warm: bool = True) -> list[RunResult]:
    for _ in range(args.warmup if warm else 0):
        if drop is not None:
            drop_page_cache(drop)
        fn()
    out = []
    for _ in range(args.runs):
        if drop is not None:
            drop_page_cache(drop)
        out.append(fn())
    return out


def _row(base: dict, method: str, ratio: float | None, rs: list[RunResult], full_ms: float) -> dict:
    med, lo, hi = _stats([r.ttft_ms for r in rs])
    md = lambda name: round(statistics.median(getattr(r, name) for r in rs), 3)  # noqa: E731
    plans = [r.plan for r in rs if r.plan is not None]
    return {
        **base, "method": method, "ratio": ratio,
        "ttft_ms_median": round(med, 3), "ttft_ms_min": round(lo, 3), "ttft_ms_max": round(hi, 3),
        "speedup_vs_full": round(full_ms / med, 3),
        "select_ms": md("select_ms"), "probe_ms": md("probe_ms"), "fuse_ms": md("fuse_ms"),
        "load_wait_ms": md("wait_ms"), "sidecar_ms": md("sidecar_ms"),
        "compute_ms_per_layer": _median_lists([r.compute_ms for r in rs if r.compute_ms]),
        "recomputed_tokens": int(statistics.median(r.recomputed_tokens for r in rs)),
        "sync_layer_loads": max(r.sync_layer_loads for r in rs),
        "plan": plans[-1] if plans else None,
    }


def markdown(rows: list[dict]) -> str:
    out = ["| tier | method | ratio | TTFT median ms (min-max) | speedup | select | probe | fuse | load wait | recomputed | plan (loaded/recomputed chunks) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r.get("plan")
        pl = "-" if not p else ("full prefill" if p["all_recompute"] else f"{len(p['loaded'])}/{len(p['recomputed'])}")
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        out.append(f"| {r['tier']} | {r['method']} | {ratio} | {r['ttft_ms_median']:.1f} ({r['ttft_ms_min']:.1f}-{r['ttft_ms_max']:.1f}) "
                   f"| {r['speedup_vs_full']:.2f}x | {r['select_ms']:.1f} | {r['probe_ms']:.1f} | {r['fuse_ms']:.1f} "
                   f"| {r['load_wait_ms']:.1f} | {r['recomputed_tokens']}/{r['context_tokens']} | {pl} |")
    return "\n".join(out)


def _portable_args(args) -> dict:
    """The command's arguments with file and folder paths reduced to their names (results are
    committed; where a scratch folder lived on the machine that ran them does not matter)."""
    out = vars(args) | {"func": None}
    for key in ("store", "json", "markdown", "rates"):
        if out.get(key):
            out[key] = Path(out[key]).name
    return out


def _write_json(args, rows: list[dict], partial: bool = False) -> None:
    if not args.json:
        return
    env = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
           "torch": torch.__version__, "threads": torch.get_num_threads(), "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
           "argv": _portable_args(args), "partial": partial}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"env": env, "rows": rows}, indent=1, default=str))


def cmd_ttft(args) -> int:
    rows = run(args)
    md = markdown(rows)
    print(md)
    _write_json(args, rows)
    if args.markdown:
        Path(args.markdown).write_text(md + "\n")
    return 0


def add_ttft_parser(bench_sub) -> None:
    from qcfuse_core.testing import SHAPES

    p = bench_sub.add_parser("ttft", help="time-to-first-token: full prefill vs fused methods")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--shape", default=None,
                   help=f"random weights of a named shape: {', '.join(SHAPES)} (or tiny-llama etc. for tests)")
    g.add_argument("--model", default=None, help="local HF model folder, or 'embedded' (default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--query-tokens", type=int, default=32)
    p.add_argument("--prefix-tokens", type=int, default=16)
    p.add_argument("--tier", nargs="+", default=["host"], choices=["gpu", "host", "disk"])
    p.add_argument("--methods", nargs="+", default=["full", "qcfuse", "cacheblend", "naive"])
    p.add_argument("--ratios", type=float, nargs="+", default=[0.15, 0.3])
    p.add_argument("--variant", action="append", default=[], type=parse_variant, metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
                   help="also time qcfuse with these selection options (QCFuseOptions), reported as LABEL; "
                        "repeatable, e.g. qcfuse-dev2:deviation_pool=2")
    p.add_argument("--runs", type=int, default=10, help="timed runs per configuration (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--store", default=None, help="store folder (default: a new temp folder)")
    p.add_argument("--rates", default=None, help="planner rates JSON (default: next to the store)")
    p.add_argument("--remeasure", action="store_true", help="measure rates even if the JSON exists")
    p.add_argument("--no-planner", action="store_true", help="load every chunk (no load/recompute planning)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0: torch's default); 1 avoids barrier stalls on a busy CPU")
    p.add_argument("--json", default=None, help="write rows + environment to this file")
    p.add_argument("--markdown", default=None, help="write the table to this file")
    p.set_defaults(func=cmd_ttft)


def parse_variant(text: str) -> tuple[str, dict]:
    """'LABEL:KEY=VALUE[,KEY=VALUE]' -> (LABEL, options) (selectors.parse_selection_options)."""
    from qcfuse_core.selectors import parse_selection_options

    label, sep, rest = text.partition(":")
    if not sep or not label or not rest:
        raise argparse.ArgumentTypeError(f"variant {text!r}: expected LABEL:KEY=VALUE[,KEY=VALUE]")
    try:
        return label, parse_selection_options(rest)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"variant {text!r}: {e}") from e


def add_commands(sub) -> None:
    """Add `bench ttft` to the CLI, under an existing `bench` command if another module made one."""
    bench = sub.choices.get("bench")
    if bench is None:
        bench = sub.add_parser("bench", help="benchmarks")
        bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    else:
        bench_sub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    add_ttft_parser(bench_sub)
