"""Where qcfuse's selection time goes on a GPU: synchronised phase timings and a torch profile.

    python3 benchmarks/profile_select.py --out DIR [--shape llama-3.1-8b] [--ratio 0.15]

Sets up the `bench ttft` workload (random weights of a named shape, 10 x 1024-token chunks
+ a 32-token question, host tier, every chunk loaded) and then, for method qcfuse:
  1. the request as `bench ttft` times it (median of --runs);
  2. the same request with a device synchronisation after each selection phase
     (anchors, gather, probe, score, choose), so each phase's own device time shows;
  3. the probe alone with no layer loads in flight (is it contention or the probe itself?);
  4. a torch.profiler table (top ops by device and by host time) and a chrome trace.
Writes `phases.json`, `profile_cuda.txt`, `profile_cpu.txt`, `trace.json` under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_ttft  # noqa: E402

run_ttft.ensure_importable()

import torch  # noqa: E402

from qcfuse_core import bench_ttft as B  # noqa: E402
from qcfuse_core import selectors as S  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--chunks", type=int, default=10)
    ap.add_argument("--chunk-tokens", type=int, default=1024)
    ap.add_argument("--query-tokens", type=int, default=32)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--methods", nargs="+", default=["qcfuse"])
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(shape=a.shape, model=None, dtype=a.dtype, device=a.device, seed=0)
    adapter = B.build_adapter(args)
    dev = adapter.device
    work = B.make_workload(adapter.shape.vocab_size, a.chunks, a.chunk_tokens, a.query_tokens, 16, 0)
    chunks = [B.cache_alone(adapter, ids) for ids in work.chunk_ids]
    prefix = B.cache_alone(adapter, work.prefix_ids)
    root = Path(tempfile.mkdtemp(prefix="qcfuse-prof-"))
    store = B.open_tier_store(root / "kv", "host", sum(c.nbytes for c in chunks), dev.type == "cuda")
    from qcfuse_core import critical_layers
    from qcfuse_core.prefetch import ensure_sidecar

    crit, _ = critical_layers.lookup(adapter)
    for c in chunks:
        store.put(c)
        ensure_sidecar(store, adapter, c.key, max(crit) + 1, crit)
    bench = B.Bench(adapter, work, store, prefix, [c.key for c in chunks], None, planner=False)
    res: dict = {"shape": a.shape, "ratio": a.ratio, "critical_layers": crit,
                 "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}

    # full prefill for the ratio
    for _ in range(3):
        bench.full()
    res["full_ms"] = statistics.median(bench.full().ttft_ms for _ in range(a.runs))

    # 1. as bench ttft times it
    for m in a.methods:
        for _ in range(3):
            bench.fused(m, a.ratio, "host")
        rs = [bench.fused(m, a.ratio, "host") for _ in range(a.runs)]
        res[m] = {k: statistics.median(getattr(r, k) for r in rs) for k in ("ttft_ms", "select_ms", "probe_ms", "fuse_ms", "wait_ms")}
        print(m, res[m], flush=True)

    # 2. synchronised phases
    phases: dict[str, list[float]] = {}

    def timed(name, fn):
        def wrap(*args, **kw):
            B.sync(dev)
            t0 = time.perf_counter()
            r = fn(*args, **kw)
            B.sync(dev)
            phases.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
            return r
        return wrap

    orig = {n: getattr(S, n) for n in ("ensure_anchors", "gather_context", "run_probe")}
    orig_score, orig_choose = S.QueryAwareSelector.score, S.QueryAwareSelector.choose
    S.ensure_anchors = timed("anchors(all chunks)", orig["ensure_anchors"])
    S.gather_context = timed("gather_context", orig["gather_context"])
    S.run_probe = timed("run_probe", orig["run_probe"])
    S.QueryAwareSelector.score = staticmethod(timed("score", orig_score))
    S.QueryAwareSelector.choose = timed("choose", orig_choose)
    try:
        for _ in range(a.runs + 2):
            bench.fused("qcfuse", a.ratio, "host")
    finally:
        for n, f in orig.items():
            setattr(S, n, f)
        S.QueryAwareSelector.score, S.QueryAwareSelector.choose = staticmethod(orig_score), orig_choose
    res["phases_synced_ms"] = {k: statistics.median(v[2:]) if len(v) > 4 else statistics.median(v) for k, v in phases.items()}
    print("phases", res["phases_synced_ms"], flush=True)

    # 3. the probe alone, no loads in flight
    from qcfuse_core.anchors import AnchorConfig
    from qcfuse_core.fusion import FusedPrompt, Segment
    from qcfuse_core.probe import gather_context, run_probe

    pf = bench.pf
    depth = max(crit) + 1
    segs = [Segment("prefix", work.prefix_ids, prefix)]
    segs += [Segment("chunk", ids, pf.view(k, ids, depth=depth, critical=crit, keep="host"))
             for ids, k in zip(work.chunk_ids, bench.keys)]
    segs.append(Segment("suffix", work.suffix_ids))
    prompt = FusedPrompt(segs)
    ctxs = gather_context(prompt, depth, lambda s: s.chunk.anchor_idx)
    pos = torch.arange(prompt.starts[-1], prompt.num_tokens)
    ts = []
    for i in range(a.runs + 3):
        B.sync(dev)
        t0 = time.perf_counter()
        pr = run_probe(adapter, work.suffix_ids, pos, ctxs, keep=crit)
        t1 = time.perf_counter()
        B.sync(dev)
        ts.append(((t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3))
    res["probe_alone_ms"] = {"host_enqueue": statistics.median(t[0] for t in ts[3:]),
                             "synced": statistics.median(t[1] for t in ts[3:]), "layers": depth,
                             "context_per_layer": pr.context_sizes[0]}
    print("probe alone", res["probe_alone_ms"], flush=True)
    # weights-bandwidth floor of the probed layers
    nbytes = sum(p.numel() * p.element_size() for l in range(depth) for p in adapter.layers[l].parameters())
    res["probe_weight_bytes"] = nbytes

    # 4. profile
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts, record_shapes=False) as prof:
        for _ in range(2):
            bench.fused("qcfuse", a.ratio, "host")
        B.sync(dev)
    ka = prof.key_averages()
    (out / "profile_cuda.txt").write_text(ka.table(sort_by="self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total", row_limit=45))
    (out / "profile_cpu.txt").write_text(ka.table(sort_by="self_cpu_time_total", row_limit=45))
    prof.export_chrome_trace(str(out / "trace.json"))
    (out / "phases.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
