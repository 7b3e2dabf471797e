"""Where the device time of a request and of ingestion goes (GPU runs; writes under --out).

    python3 benchmarks/profile_gpu.py stages --out DIR     # torch.profiler of engine.answer
    python3 benchmarks/profile_gpu.py ingest --out DIR     # build_chunks phases + primitives
    python3 benchmarks/profile_gpu.py host --out DIR       # cProfile of lookup + select (host side)

stages: the `bench ttft` workload (llama-3.1-8b shape, byte-level tokenizer, 10 x 1024 host
tier); per method, warm-ups then a torch.profiler trace of a few `engine.answer` calls with
each engine step wrapped in a `record_function` range (the real request runs). Prints the
kernels by device time and each step's device time; saves the chrome traces (gzipped).

ingest: `engine.build_chunks` of fresh 1024-token chunks into a host-tier store on the disk
and on /dev/shm, with the functions of the write path wrapped by wall-time counters (per
call, summed over the writer threads), and the primitives alone: pinned allocation,
device -> host copies, xxh3, file writes with and without fsync.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import shutil
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

from qcfuse_core import bench_ttft as B
from qcfuse_core.engine import EngineConfig, QCFuseEngine

STEPS = ("lookup", "plan", "start_loading", "select", "fuse", "decode")


def _workload(a, tag=""):
    args = argparse.Namespace(shape=a.shape, model=None, device="cuda", dtype="bf16", seed=0)
    adapter = B.build_adapter(args)
    work = B.make_workload(adapter.tokenizer, a.chunks, a.tokens, 32, 16, 0, tag=tag)
    return adapter, work


def _engine(a):
    """The workload's chunks built into a host-tier store -> (engine, work, store, root)."""
    adapter, work = _workload(a)
    nbytes = B.kv_bytes_per_token(adapter) * a.chunks * a.tokens
    root = Path(a.store)
    store = B.open_tier_store(root, "host", nbytes, True)
    engine = QCFuseEngine(adapter, store=store, config=EngineConfig(system_prompt=work.system))
    engine.build_chunks(work.texts, work.node_ids)
    return engine, work, store, root


def stages(a) -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    engine, work, store, root = _engine(a)
    for name in STEPS:
        fn = getattr(QCFuseEngine, name).__get__(engine)
        setattr(engine, name, _ranged(fn, f"step:{name}", record_function))
    out = Path(a.out)
    for spec in a.methods:
        method, _, ratio = spec.partition("@")
        ratio = float(ratio or 0.15)
        for _ in range(4):
            B.timed_answer(engine, work, method, ratio)
        walls = [B.timed_answer(engine, work, method, ratio).ttft_ms for _ in range(5)]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            rs = [B.timed_answer(engine, work, method, ratio) for _ in range(3)]
        print(f"==== {spec}: unprofiled TTFT median {statistics.median(walls):.1f} ms; profiled "
              f"{[round(r.ttft_ms, 1) for r in rs]}; recomputed {rs[-1].recomputed_tokens}", flush=True)
        ka = prof.key_averages()
        step_rows = [e for e in ka if e.key.startswith("step:")]
        for e in sorted(step_rows, key=lambda e: STEPS.index(e.key[5:])):
            print(f"  {e.key:22s} host {e.cpu_time_total / 1e3 / e.count:7.2f} ms  device "
                  f"{_dev(e) / 1e3 / e.count:7.2f} ms  (x{e.count})")
        print(ka.table(sort_by="device_time_total" if hasattr(ka[0], "device_time_total") else "cuda_time_total",
                       row_limit=a.top, max_name_column_width=60))
        trace = out / f"trace_{method}_{ratio}.json"
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as f, gzip.open(str(trace) + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        trace.unlink()
    store.close()
    shutil.rmtree(root, ignore_errors=True)


def _dev(e) -> float:
    return getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)


def _ranged(fn, name, record_function):
    @functools.wraps(fn)
    def run(*args, **kw):
        with record_function(name):
            return fn(*args, **kw)
    return run


def host(a) -> None:
    """The host side of lookup and select: their wall time (synchronised at each step's end)
    and a cProfile of many requests' calls, by own time."""
    import cProfile
    import pstats

    engine, work, store, root = _engine(a)
    prof = cProfile.Profile()
    walls: dict[str, list[float]] = defaultdict(list)
    on = [False]
    for name in ("lookup", "select"):
        fn = getattr(QCFuseEngine, name).__get__(engine)

        def run(*args, _fn=fn, _name=name, **kw):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if on[0]:
                prof.enable()
            try:
                return _fn(*args, **kw)
            finally:
                if on[0]:
                    prof.disable()
                torch.cuda.synchronize()
                walls[_name].append((time.perf_counter() - t0) * 1e3)
        setattr(engine, name, run)
    for spec in a.methods:
        method, _, ratio = spec.partition("@")
        ratio = float(ratio or 0.15)
        for _ in range(4):
            B.timed_answer(engine, work, method, ratio)
        walls.clear()
        for _ in range(20):
            B.timed_answer(engine, work, method, ratio)
        print(f"==== {spec}: synced wall ms, median of 20: " + ", ".join(
            f"{k} {statistics.median(v):.3f}" for k, v in walls.items()), flush=True)
        on[0] = True
        for _ in range(20):
            B.timed_answer(engine, work, method, ratio)
        on[0] = False
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(a.top)
        prof = cProfile.Profile()
    store.close()
    shutil.rmtree(root, ignore_errors=True)


# ----------------------------------------------------------------------------- ingestion


class Counters:
    """Wall time per wrapped function, summed over threads (thread-safe)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        self._undo: list = []

    def wrap(self, owner, attr: str, label: str | None = None) -> None:
        fn = getattr(owner, attr)
        label = label or f"{getattr(owner, '__name__', owner)}.{attr}"

        @functools.wraps(fn)
        def run(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                dt = (time.perf_counter() - t0) * 1e3
                with self._lock:
                    self.ms[label] += dt
                    self.calls[label] += 1

        setattr(owner, attr, run)
        self._undo.append((owner, attr, fn))

    def undo(self) -> None:
        for owner, attr, fn in reversed(self._undo):
            setattr(owner, attr, fn)
        self._undo.clear()

    def report(self) -> dict:
        return {k: {"ms": round(v, 1), "calls": self.calls[k]} for k, v in sorted(self.ms.items(), key=lambda x: -x[1])}


def _wrap_write_path(c: Counters) -> None:
    from qcfuse_core import ingest
    from qcfuse_core.store import disk, entry, manifest, tier, tiered

    c.wrap(ingest, "prefill_alone_batch")
    c.wrap(QCFuseEngine, "_store_chunk")
    c.wrap(QCFuseEngine, "_add_anchors")
    c.wrap(QCFuseEngine, "_probe_sidecar")
    c.wrap(tiered, "encode_chunk")
    c.wrap(entry, "alloc_host")
    c.wrap(entry.EntryImage, "checksums")
    c.wrap(disk, "prepare_tmp")
    c.wrap(disk, "publish")
    c.wrap(os, "fsync")
    c.wrap(manifest.Manifest, "commit_entry")
    c.wrap(manifest.Manifest, "commit_sidecar")
    c.wrap(tiered.TieredStore, "put")
    c.wrap(tiered.TieredStore, "put_sidecar")
    c.wrap(disk.DiskTier, "write_sidecar")
    c.wrap(tier.MemoryTier, "put")


def ingest(a) -> None:
    adapter, work = _workload(argparse.Namespace(**{**vars(a), "chunks": a.ingest_chunks}), tag="ing")
    bpt = B.kv_bytes_per_token(adapter)
    results = {}
    for where in a.where:
        root = Path(where) / "qcfuse-ingest-profile"
        shutil.rmtree(root, ignore_errors=True)
        if a.host_bytes is None:  # room for every chunk in the host tier (what `bench ttft` does)
            store = B.open_tier_store(root, "host", bpt * a.ingest_chunks * a.tokens, True)
        else:  # a host tier of this size (the store's default is 2 GiB): it fills, then recycles
            from qcfuse_core.store import open_store
            store = open_store(root, memory_bytes=a.host_bytes, gpu_bytes=0, use_cuda=True)
        engine = QCFuseEngine(adapter, store=store, config=EngineConfig())
        engine.build_chunks(work.texts[:1], work.node_ids[:1])
        c = Counters()
        _wrap_write_path(c)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.build_chunks(work.texts[1:], work.node_ids[1:])
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        c.undo()
        n = (a.ingest_chunks - 1) * a.tokens
        results[where] = {"host_bytes": a.host_bytes, "seconds": round(secs, 3), "tokens_per_s": round(n / secs), "phases": c.report()}
        print(f"==== build_chunks into {where}: {secs:.2f} s, {n / secs:,.0f} tokens/s", flush=True)
        for k, v in c.report().items():
            print(f"  {k:40s} {v['ms']:10.1f} ms  x{v['calls']}")
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    results["primitives"] = primitives(bpt * a.tokens, a.where)
    Path(a.out, "ingest_profile.json").write_text(json.dumps(results, indent=1))


def _t(fn, reps=5):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(ts), 2)


def primitives(nbytes: int, wheres: list[str]) -> dict:
    import xxhash

    out = {"entry_bytes": nbytes}
    keep = []
    out["pinned_alloc_ms(entry+4096)"] = _t(lambda: keep.append(torch.empty(nbytes + 4096, dtype=torch.uint8, pin_memory=True)))
    out["pinned_alloc_ms(entry)"] = _t(lambda: keep.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)))
    out["pageable_alloc_touch_ms"] = _t(lambda: keep.append(torch.empty(nbytes, dtype=torch.uint8).fill_(1)))
    cudart = torch.cuda.cudart()

    def register():
        t = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        r = cudart.cudaHostRegister(t.data_ptr(), t.numel(), 0)
        keep.append((t, r))
    out["pageable_touch+cudaHostRegister_ms"] = _t(register)
    for t, r in [k for k in keep if isinstance(k, tuple)]:
        cudart.cudaHostUnregister(t.data_ptr())
    keep.clear()
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    out["d2h_pinned_ms"] = _t(lambda: (pinned.view(torch.bfloat16).copy_(src), torch.cuda.synchronize()))
    out["d2h_pageable_ms"] = _t(lambda: (pageable.view(torch.bfloat16).copy_(src), torch.cuda.synchronize()))
    mv = memoryview(pinned.numpy())
    out["xxh3_ms"] = _t(lambda: xxhash.xxh3_64_hexdigest(mv))

    def par_hash(k=4):
        ts = [threading.Thread(target=xxhash.xxh3_64_hexdigest, args=(mv,)) for _ in range(k)]
        [t.start() for t in ts]
        [t.join() for t in ts]
    out["xxh3_4threads_ms(4x the bytes)"] = _t(par_hash)
    for where in wheres:
        p = Path(where) / "qcfuse-prim.bin"

        def write(sync):
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, mv)
            if sync:
                os.fsync(fd)
            os.close(fd)
        out[f"write_ms[{where}]"] = _t(lambda: write(False), 3)
        out[f"write+fsync_ms[{where}]"] = _t(lambda: write(True), 3)
        p.unlink(missing_ok=True)
    for k, v in out.items():
        print(f"  {k:44s} {v}")
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["stages", "ingest", "host"])
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--chunks", type=int, default=10)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--methods", nargs="+", default=["qcfuse@0.15", "epic@0.15"])
    p.add_argument("--store", default="/tmp/qcfuse-profile-store")
    p.add_argument("--ingest-chunks", type=int, default=33)
    p.add_argument("--where", nargs="+", default=["/tmp", "/dev/shm"])
    p.add_argument("--host-bytes", type=int, default=None, help="host tier size (default: room for every chunk)")
    p.add_argument("--top", type=int, default=30)
    a = p.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    {"stages": stages, "ingest": ingest, "host": host}[a.what](a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
