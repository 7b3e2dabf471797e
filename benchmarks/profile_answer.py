"""Where `engine.answer`'s host time goes: cProfile of a few warm requests (GPU runs).

    python3 benchmarks/profile_answer.py --shape llama-3.1-8b --size 10x1024 --method qcfuse --ratio 0.15

Builds the `bench ttft` workload (random weights of a named shape, byte-level tokenizer,
chunks ingested with `engine.build_chunks` into the host tier), warms up, then profiles
`--runs` calls of `engine.answer(..., max_new_tokens=1)`: the whole call, and each of the
steps `start_loading` and `select` on its own (their profilers wrap the engine's methods, so
what runs is the real request), printing the top functions by own time, and the median
stage timings with `sync_stages=True`.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
from pathlib import Path

from qcfuse_core import bench_ttft as B
from qcfuse_core.engine import EngineConfig, QCFuseEngine


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", type=B.parse_size, default=(10, 1024))
    p.add_argument("--method", default="qcfuse")
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--top", type=int, default=30)
    a = p.parse_args()
    args = argparse.Namespace(shape=a.shape, model=None, device=a.device, dtype="bf16", seed=0)
    adapter = B.build_adapter(args)
    work = B.make_workload(adapter.tokenizer, a.size[0], a.size[1], 32, 16, 0)
    nbytes = B.kv_bytes_per_token(adapter) * a.size[0] * a.size[1]
    store = B.open_tier_store(Path(tempfile.mkdtemp()), "host", nbytes, adapter.device.type == "cuda")
    engine = QCFuseEngine(adapter, store=store, config=EngineConfig(system_prompt=work.system))
    engine.build_chunks(work.texts, work.node_ids)
    for _ in range(3):
        B.timed_answer(engine, work, a.method, a.ratio)
    prof = cProfile.Profile()
    prof.enable()
    times = [B.timed_answer(engine, work, a.method, a.ratio).ttft_ms for _ in range(a.runs)]
    prof.disable()
    steps = {name: cProfile.Profile() for name in ("start_loading", "select")}  # one profiler at a time
    for name, p in steps.items():
        setattr(engine, name, _profiled(getattr(QCFuseEngine, name).__get__(engine), p))
        for _ in range(a.runs):
            B.timed_answer(engine, work, a.method, a.ratio)
        delattr(engine, name)
    synced = [B.timed_answer(engine, work, a.method, a.ratio, sync_stages=True) for _ in range(a.runs)]
    print(f"{a.method}@{a.ratio} {a.size}: TTFT median {statistics.median(times):.1f} ms (profiled runs)")
    for k in B.STAGE_KEYS + ("load_wait_ms",):
        print(f"  {k:16s} {statistics.median(r.stages.get(k, 0.0) for r in synced):8.2f} ms (synced)")
    details = synced[-1]
    print(f"  probe {details.probe_ms:.2f} ms (host)")
    for title, p in [("whole call", prof)] + [(f"step {n}", p) for n, p in steps.items()]:
        s = io.StringIO()
        pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(a.top)
        print(f"==== {title} (own time)\n{s.getvalue()}")
    store.close()
    return 0


def _profiled(fn, prof: cProfile.Profile):
    def run(*args, **kw):
        prof.enable()
        try:
            return fn(*args, **kw)
        finally:
            prof.disable()
    return run


if __name__ == "__main__":
    raise SystemExit(main())
